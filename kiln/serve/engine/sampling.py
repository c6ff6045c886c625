"""Sampling parameters (checked when a request is made) and the per-request sampler.

Every request samples its own row of logits with its own `torch.Generator`, so a seeded
request's tokens depend only on its own logits, never on what else is in the batch.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kiln.errors import KilnError

# A logits processor sees the sample's generated ids so far and its logits row (V,), and
# returns the row to sample from (constrained decoding, banned words, test hooks).
LogitsProcessor = Callable[[Sequence[int], Tensor], Tensor]


class SamplingParamsError(KilnError):
    """A sampling parameter outside its range; the message names the field."""


def _require(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise SamplingParamsError(f"sampling parameter {name} = {value!r}: expected {expected}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: length, temperature and truncation, penalties, stops, seed, n."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL: divide positive logits, multiply negative
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's generated count
    stop_token_ids: tuple[int, ...] = ()  # the engine adds the model's end-of-text id unless
    ignore_eos: bool = False  # ignore_eos
    stop: tuple[str, ...] = ()  # stop strings: never sent to the caller, found across tokens
    seed: int | None = None
    n: int = 1  # n samples of one prompt share its KV blocks
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob + top-k
    logits_processors: tuple[LogitsProcessor, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        """Refuse out-of-range values with a SamplingParamsError naming the field."""
        # Lists are accepted for the tuple fields (JSON bodies) and frozen here.
        for name in ("stop_token_ids", "stop", "logits_processors"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            _require(isinstance(value, list | tuple), name, value, "a list")
            object.__setattr__(self, name, tuple(value))
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
                 self.max_tokens, "an integer >= 1")  # fmt: skip
        _require(_is_real(self.temperature) and self.temperature >= 0, "temperature",
                 self.temperature, "a finite number >= 0")  # fmt: skip
        _require(self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1), "top_k",
                 self.top_k, "None or an integer >= 1")  # fmt: skip
        _require(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _require(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _require(_is_real(self.repetition_penalty) and self.repetition_penalty > 0,
                 "repetition_penalty", self.repetition_penalty, "a finite number > 0")  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_real(value) and -2 <= value <= 2, name, value, "in [-2, 2]")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 self.stop_token_ids, "non-negative integer token ids")  # fmt: skip
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
                 "non-empty strings")  # fmt: skip
        _require(self.seed is None or _is_int(self.seed), "seed", self.seed, "None or an integer")
        _require(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
                 "logprobs", self.logprobs, "None or an integer in [0, 20]")  # fmt: skip
        _require(all(callable(f) for f in self.logits_processors), "logits_processors",
                 self.logits_processors, "callables (ids, logits) -> logits")  # fmt: skip
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "a boolean")

    @property
    def greedy(self) -> bool:
        """Whether every token is the most likely one (temperature 0)."""
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: no penalty, processor or logprobs (a batched argmax)."""
        return (
            self.temperature == 0 and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
            and not self.logits_processors and self.logprobs is None
        )  # fmt: skip


def sample_generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator:
    """The generator of sample `index` of a request: from its seed, else from fresh entropy."""
    seed = secrets.randbits(63) if params.seed is None else params.seed
    # Each of the n samples gets its own stream; sample 0 of seed s is the plain seed s.
    mixed = (seed + index * 0x9E3779B97F4A7C15) % (1 << 63)
    return torch.Generator(device=device).manual_seed(mixed)


def apply_penalties(
    logits: Tensor, params: SamplingParams, prompt_ids: Sequence[int], generated: Sequence[int]
) -> Tensor:
    """Logits (V,) after the repetition (prompt and output) and presence/frequency (output)."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt_ids, *generated}), device=logits.device)
        picked = logits[seen]
        penalised = torch.where(
            picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty
        )
        logits = logits.index_copy(0, seen, penalised)
    if generated and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        ids = torch.tensor(list(generated), device=logits.device)
        counts = torch.zeros_like(logits).index_add_(
            0, ids, torch.ones_like(ids, dtype=logits.dtype)
        )
        logits = logits - params.frequency_penalty * counts
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def truncate(logits: Tensor, params: SamplingParams) -> Tensor:
    """Tempered logits (V,) with the tokens outside top_k, top_p and min_p set to -inf."""
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop = probs.cumsum(dim=-1) - probs > params.top_p  # the top token is never dropped
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


@dataclass(frozen=True)
class Sampled:
    """One sampled token, with its log-probability and the top alternatives when asked."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


def sample_token(
    logits: Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    generated: Sequence[int],
    generator: torch.Generator,
) -> Sampled:
    """Sample the next token from one row of logits (V,); logprobs are the model's own (raw)."""
    raw = logits.float()
    row = apply_penalties(raw, params, prompt_ids, generated)
    for processor in params.logits_processors:
        row = processor(generated, row)
    if params.greedy:
        token = int(row.argmax())
    else:
        probs = truncate(row, params).softmax(dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    if params.logprobs is None:
        return Sampled(token, None, None)
    logp = raw.log_softmax(dim=-1)
    top: list[tuple[int, float]] = []
    if params.logprobs > 0:
        values, ids = logp.topk(params.logprobs)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return Sampled(token, float(logp[token]), top)
