"""How post-training generates replies: one small class over kiln.serve's engine.

`ReplyGenerator.stream` gives one reply token by token (`kiln chat`); `generate` runs many
prompts together with continuous batching (`kiln eval --chat-tasks`, later RL rollouts). A stop
id ends a reply and is not returned. Everything that generates for post-training goes through
this module, so switching the backend (kiln.model.generate, the engine) is a change here only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError
from kiln.loading import LoadedModel


@dataclass(frozen=True)
class ReplySettings:
    """How replies are sampled."""

    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = 0.95
    max_tokens: int = 256
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise KilnError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.max_tokens < 1:
            raise KilnError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.top_k is not None and self.top_k < 1:
            raise KilnError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise KilnError(f"top_p must be in (0, 1], got {self.top_p}")


def reply_stop_ids(loaded: LoadedModel, end_ids: Sequence[int]) -> tuple[int, ...]:
    """The ids that end a reply: the chat format's end token, and the model's end-of-text."""
    stops = set(end_ids)
    if loaded.eot_id is not None:
        stops.add(loaded.eot_id)
    return tuple(sorted(stops))


class ReplyGenerator:
    """Replies of one loaded model on kiln.serve's engine (KV blocks shared by common prefixes,
    so each turn of a chat reuses the conversation's cached blocks)."""

    def __init__(self, loaded: LoadedModel, stop_ids: tuple[int, ...], max_batch: int = 1) -> None:
        self.loaded, self.stop_ids, self.max_batch = loaded, stop_ids, max_batch
        self._engine: Any = None

    def _engine_now(self) -> Any:
        from kiln.serve.engine import Engine, EngineConfig

        if self._engine is None:
            # Without the fixed-shape tiles of batch invariance: a greedy reply does not need
            # them, and they cost 4x here (fp32, CPU: 12 replies of 48 tokens, demo model,
            # 40.5 s against 10.2 s; kiln.model.generate's fixed batch 7.8 s).
            config = EngineConfig(max_num_seqs=self.max_batch, batch_invariant=False)
            self._engine = Engine.from_loaded(self.loaded, config)
        return self._engine

    def _params(self, settings: ReplySettings) -> Any:
        from kiln.serve.engine import SamplingParams

        return SamplingParams(
            max_tokens=settings.max_tokens, temperature=settings.temperature,
            top_k=settings.top_k, top_p=1.0 if settings.top_p is None else settings.top_p,
            seed=settings.seed, stop_token_ids=self.stop_ids, ignore_eos=True,
        )  # fmt: skip

    def stream(self, prompt_ids: list[int], settings: ReplySettings) -> Iterator[int]:
        """The token ids of one reply, as they are decoded.

        Stopping early (closing the iterator, or Ctrl-C) cancels the request; an interrupt may
        land inside an engine step, so the engine is then replaced before the next reply.
        """
        handle = self._engine_now().submit(prompt_ids, self._params(settings))
        finished = False
        try:
            for event in handle:
                yield event.token_id
            finished = True
        except BaseException:
            self._engine = None  # possibly interrupted mid-step: start clean next time
            raise
        finally:
            if not finished:
                handle.cancel()
        _raise_on_error(handle.result())

    def generate(
        self, prompts: Sequence[list[int]], settings: ReplySettings | Sequence[ReplySettings]
    ) -> list[list[int]]:
        """The reply ids of every prompt (continuous batching over at most max_batch at once);
        `settings` for all prompts, or one per prompt."""
        return [ids for ids, _ in self.generate_ended(prompts, settings)]

    def generate_ended(
        self, prompts: Sequence[list[int]], settings: ReplySettings | Sequence[ReplySettings]
    ) -> list[tuple[list[int], bool]]:
        """Like `generate`, with whether each reply ended on a stop id (False: cut at the cap)."""
        each = [settings] * len(prompts) if isinstance(settings, ReplySettings) else settings
        params = [self._params(s) for s in each]
        completions = self._engine_now().generate(list(prompts), params)
        out = []
        for (done,) in completions:
            _raise_on_error([done])
            out.append((list(done.token_ids), done.finish_reason == "stop"))
        return out


def _raise_on_error(completions: list[Any]) -> None:
    for done in completions:
        if done.finish_reason == "error":
            raise KilnError(f"generation failed: {done.error}")
