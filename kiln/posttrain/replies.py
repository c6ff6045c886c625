"""How post-training generates replies: the one module to switch to kiln.serve's engine.

`stream_reply` (one reply, token by token, for `kiln chat`) and `generate_replies` (many,
batched, greedy by default, for `kiln eval --chat-tasks` and later RL rollouts) both use
kiln.model.generate today; a stop id ends a reply and is not returned.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.loading import LoadedModel
from kiln.model.generate import generate, stream


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


def stream_reply(
    loaded: LoadedModel, prompt_ids: list[int], settings: ReplySettings, stop_ids: tuple[int, ...]
) -> Iterator[int]:
    """The token ids of one reply, as they are decoded (a stop id ends it and is not yielded)."""
    yield from stream(
        loaded.model, prompt_ids, settings.max_tokens, temperature=settings.temperature,
        top_k=settings.top_k, top_p=settings.top_p, seed=settings.seed, stop_tokens=stop_ids,
    )  # fmt: skip


def generate_replies(
    loaded: LoadedModel,
    prompts: Sequence[list[int]],
    settings: ReplySettings,
    stop_ids: tuple[int, ...],
) -> list[list[int]]:
    """The reply ids of several prompts at once (one batch; every prompt gets max_tokens room)."""
    with loaded.autocast():
        return generate(
            loaded.model, prompts, settings.max_tokens, temperature=settings.temperature,
            top_k=settings.top_k, top_p=settings.top_p, seed=settings.seed, stop_tokens=stop_ids,
        )  # fmt: skip
