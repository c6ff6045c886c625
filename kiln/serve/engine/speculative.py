"""Speculative decoding of one request: a drafter proposes k tokens, the target checks them at once.

The accept/reject rule (Leviathan et al. 2023, Chen et al. 2023): draft token x_i, drawn from
the drafter's distribution q_i, is kept with probability min(1, p_i(x_i) / q_i(x_i)), where p_i
is the target's (temperature / top-k / top-p applied). At the first rejection the next token is
drawn from the residual max(p_i - q_i, 0), renormalised; when every draft is kept, one more token
comes from p_{k+1}. Each output token is then distributed exactly as the target alone would draw
it. A drafter that proposes deterministically (prompt lookup, greedy drafting) returns no
probabilities: q_i is one-hot. At temperature 0 drafts are kept while they equal the target's
argmax, so the output is the target's greedy output.

The target decodes on kiln's `KVCache`; rejected positions are rolled back by moving the cache's
length back (their slots are overwritten by the next forward).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.model.generate import check_prompts, decode_step, filter_logits
from kiln.model.kv_cache import KVCache
from kiln.model.transformer import Transformer


class Drafter(Protocol):
    """Proposes up to k next tokens for a context, with the distributions they were drawn from."""

    def propose(self, context_ids: Sequence[int], k: int) -> tuple[list[int], Tensor | None]:
        """Up to k draft ids, and their (len, V) draft probabilities (None: drawn deterministically)."""
        ...


@dataclass(frozen=True)
class Warp:
    """How logits become a sampling distribution: temperature (0 = greedy), top-k, top-p."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax, no randomness."""
        return self.temperature == 0

    def probs(self, logits: Tensor) -> Tensor:
        """fp32 probabilities (..., V) of logits (..., V) (temperature > 0)."""
        flat = logits.reshape(-1, logits.size(-1))
        warped = filter_logits(flat, self.temperature, self.top_k, self.top_p)
        return warped.softmax(dim=-1).reshape(logits.shape)


GREEDY = Warp(temperature=0.0)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """max(p - q, 0) renormalised (V,): what to draw from after a draft token is rejected."""
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    # A rejection implies p(x) < q(x), so the residual has mass; rounding can still empty it.
    return residual / total if total > 0 else p


def verify(
    target_probs: Tensor,
    draft_ids: Sequence[int],
    draft_probs: Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """(drafts accepted, the next token) for target_probs (m+1, V) over m drafts, by the rule."""
    for i, x in enumerate(draft_ids):
        p = target_probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        u = float(torch.rand((), generator=generator))
        if u * q_x < float(p[x]):  # u < p(x) / q(x), without dividing by a zero q(x)
            continue
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = draft_probs[i]
        residual = residual_distribution(p, q)
        return i, int(torch.multinomial(residual, 1, generator=generator))
    bonus = target_probs[len(draft_ids)]
    return len(draft_ids), int(torch.multinomial(bonus, 1, generator=generator))


def verify_greedy(target_logits: Tensor, draft_ids: Sequence[int]) -> tuple[int, int]:
    """(drafts accepted, the next token) at temperature 0: drafts kept while they are the argmax."""
    best = target_logits.argmax(dim=-1).tolist()  # (m+1,)
    for i, x in enumerate(draft_ids):
        if x != best[i]:
            return i, best[i]
    return len(draft_ids), best[len(draft_ids)]


@dataclass
class SpeculativeStats:
    """Counts over a decoder's requests: drafts proposed and kept, target forwards, tokens out."""

    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0  # verification forwards (prefill not counted)
    generated: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (0 when none were proposed)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per target forward (1.0 is plain decoding)."""
        return self.generated / self.target_forwards if self.target_forwards else 0.0


class SpeculativeDecoder:
    """Decodes one request at a time with a target model and a drafter proposing k tokens a step."""

    def __init__(self, model: Transformer, drafter: Drafter, k: int = 4) -> None:
        if k < 1:
            raise KilnError(f"speculative draft length k must be >= 1, got {k}")
        draft_vocab = getattr(drafter, "vocab_size", None)
        if draft_vocab is not None and draft_vocab != model.cfg.vocab_size:
            raise KilnError(
                f"the draft model's vocabulary ({draft_vocab}) differs from the target's "
                f"({model.cfg.vocab_size}); a draft model must share the tokenizer"
            )
        self.model, self.drafter, self.k = model, drafter, k
        self.stats = SpeculativeStats()

    @torch.inference_mode()
    def stream(
        self,
        prompt: Sequence[int], max_new_tokens: int, warp: Warp = Warp(), *,
        seed: int | None = None, stop_tokens: Sequence[int] = (),
    ) -> Iterator[int]:  # fmt: skip
        """Yield the request's new tokens (a stop token ends it and is not yielded)."""
        cfg = self.model.cfg
        check_prompts(cfg, [prompt], max_new_tokens, warp.top_k, warp.top_p, warp.temperature)
        param = next(self.model.parameters())
        generator = None if seed is None else torch.Generator(param.device).manual_seed(seed)
        cache = KVCache(cfg, 1, len(prompt) + max_new_tokens, device=param.device,
                        dtype=param.dtype)  # fmt: skip
        tokens = list(prompt)
        if len(tokens) > 1:  # the cache holds every token but the last, which each step feeds
            self.model.hidden(_ids(tokens[:-1], param.device), cache)
        stop = set(stop_tokens)
        produced = 0
        while produced < max_new_tokens:
            k = min(self.k, max_new_tokens - produced - 1)
            drafts, draft_probs = self.drafter.propose(tokens, k) if k > 0 else ([], None)
            drafts = [int(t) for t in drafts[:k]]
            h = self.model.hidden(_ids([tokens[-1], *drafts], param.device), cache)
            logits = self.model.logits(h[0])  # (m+1, V)
            if warp.greedy:
                n, nxt = verify_greedy(logits, drafts)
            else:
                probs = warp.probs(logits)
                if draft_probs is not None:
                    draft_probs = draft_probs[: len(drafts)].to(probs.device, torch.float32)
                n, nxt = verify(probs, drafts, draft_probs, generator)
            cache.length = len(tokens) + n  # roll back the rejected drafts' slots
            self.stats.drafted += len(drafts)
            self.stats.accepted += n
            self.stats.target_forwards += 1
            for token in [*drafts[:n], nxt]:
                if token in stop:
                    return
                tokens.append(token)
                produced += 1
                self.stats.generated += 1
                yield token

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, warp: Warp = Warp(), **kwargs: object
    ) -> list[int]:
        """The request's new tokens (see `stream` for the options)."""
        return list(self.stream(prompt, max_new_tokens, warp, **kwargs))  # type: ignore[arg-type]


class PromptLookupDrafter:
    """Drafts by n-gram lookup: the tokens that followed the latest earlier match of the suffix.

    No second model: repeated names, phrases and copied spans in the context are proposed as
    they appeared before (Saxena 2023, "prompt lookup decoding"). Longest n-gram first.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise KilnError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context_ids: Sequence[int], k: int) -> tuple[list[int], Tensor | None]:
        """Up to k tokens that followed the suffix's latest earlier occurrence, or none."""
        ctx = list(context_ids)
        L = len(ctx)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = ctx[L - n :]
            for start in range(L - n - 1, -1, -1):  # the latest occurrence first
                if ctx[start : start + n] == suffix:
                    return ctx[start + n : start + n + k], None
        return [], None


class DraftModelDrafter:
    """Drafts with a small model sharing the target's tokenizer, on its own KV cache.

    Its cache follows the context between calls: the common prefix is kept, the rest (rejected
    drafts) rolled back. At temperature 0 drafts are the draft model's argmax (no probabilities);
    otherwise they are sampled with the given warp and their distributions returned.
    """

    def __init__(self, model: Transformer, warp: Warp = GREEDY, seed: int | None = None) -> None:
        self.model = model
        self.vocab_size = model.cfg.vocab_size
        self.warp = warp
        param = next(model.parameters())
        self.device = param.device
        self.cache = KVCache(model.cfg, 1, model.cfg.block_size, device=param.device,
                             dtype=param.dtype)  # fmt: skip
        self.cached: list[int] = []  # the tokens whose keys and values the cache holds
        self.generator = None if seed is None else torch.Generator(param.device).manual_seed(seed)

    @torch.inference_mode()
    def propose(self, context_ids: Sequence[int], k: int) -> tuple[list[int], Tensor | None]:
        """k draft tokens after context_ids (fewer only where the draft's block size ends)."""
        ctx = list(context_ids)
        k = min(k, self.model.cfg.block_size - len(ctx) + 1)
        if k < 1:
            return [], None
        keep = min(_common_prefix(self.cached, ctx), len(ctx) - 1)  # feed at least the last
        self.cache.length = keep
        logits = decode_step(self.model, _ids(ctx[keep:], self.device), self.cache)  # (1, V)
        self.cached = ctx
        drafts: list[int] = []
        probs: list[Tensor] = []
        for i in range(k):
            if self.warp.greedy:
                token = int(logits[0].argmax())
            else:
                q = self.warp.probs(logits[0])  # (V,)
                token = int(torch.multinomial(q, 1, generator=self.generator))
                probs.append(q)
            drafts.append(token)
            if i < k - 1:
                logits = decode_step(self.model, _ids([token], self.device), self.cache)
                self.cached = [*self.cached, token]
        return drafts, torch.stack(probs) if probs else None


def _ids(tokens: Sequence[int], device: torch.device) -> Tensor:
    """A (1, T) id tensor."""
    return torch.tensor([list(tokens)], dtype=torch.long, device=device)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of a and b."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
