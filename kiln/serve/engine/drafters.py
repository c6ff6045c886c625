"""Draft proposals for the engine's speculative steps: many sequences at once.

A drafter proposes, for each sequence that speculates in a step, up to k tokens that might
follow its context; the engine checks them all in its one target forward (see engine.py).
Proposals here are deterministic (q is one-hot), which the accept/reject rule of speculative.py
handles exactly: the output is distributed as the target's whatever the drafter proposes.

- `LookupDrafter`: prompt lookup (n-gram): what followed the latest earlier match of the
  context's suffix. No model, no state.
- `ModelDrafter`: a smaller model sharing the target's vocabulary, decoding greedily on its own
  paged block pool, all sequences' draft tokens in one forward per draft position. Its blocks
  follow each sequence's context (common prefix kept, rejected drafts rolled back) and are
  released when the engine finishes the sequence.
- `truncated(model, n_layer)`: the target's first n layers with its own head, weights shared: a
  draft for showing the mechanics when no trained small model is at hand.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from kiln.errors import KilnError
from kiln.model.transformer import Transformer
from kiln.serve.engine.block_pool import BlockPool
from kiln.serve.engine.paged_cache import PagedStep, Segment
from kiln.serve.engine.speculative import PromptLookupDrafter


class EngineDrafter(Protocol):
    """What the engine asks of a drafter (keys identify sequences across steps)."""

    name: str

    def setup(self, target: Transformer, num_blocks: int, block_size: int) -> None:
        """Check the drafter fits the target and size its state to the engine's pool."""
        ...

    def propose(self, requests: Sequence[tuple[object, list[int], int]]) -> list[list[int]]:
        """For each (key, context, k): up to k draft tokens after the context."""
        ...

    def release(self, key: object) -> None:
        """The sequence `key` is finished: drop what the drafter holds for it."""
        ...

    def audit(self) -> None:
        """Check the drafter's own block books (AssertionError on a leak)."""
        ...


class LookupDrafter:
    """Prompt lookup for the engine: each sequence's own context, longest n-gram first.

    The copy continues past the context's end as an overlapping copy does (LZ77-style): when
    the latest match is only a few tokens back, as in a repeating pattern, the proposal repeats
    the pattern up to k tokens instead of stopping where the context ends.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        PromptLookupDrafter(max_ngram, min_ngram)  # the same checks of the n-gram range
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def setup(self, target: Transformer, num_blocks: int, block_size: int) -> None:
        """Nothing to size: prompt lookup keeps no state."""

    def propose(self, requests: Sequence[tuple[object, list[int], int]]) -> list[list[int]]:
        """Up to k tokens per sequence that followed its suffix's latest earlier occurrence."""
        return [self._one(ctx, k) for _, ctx, k in requests]

    def _one(self, ctx: list[int], k: int) -> list[int]:
        L = len(ctx)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = ctx[L - n :]
            for start in range(L - n - 1, -1, -1):  # the latest occurrence first
                if ctx[start : start + n] == suffix:
                    src = start + n
                    out: list[int] = []
                    while len(out) < k:
                        j = src + len(out)
                        out.append(ctx[j] if j < L else out[j - L])
                    return out
        return []

    def release(self, key: object) -> None:
        """Nothing held."""

    def audit(self) -> None:
        """No books to check."""


@dataclasses.dataclass(eq=False)
class _DraftSeq:
    tokens: list[int] = dataclasses.field(default_factory=list)  # whose KV the blocks hold
    blocks: list[int] = dataclasses.field(default_factory=list)


class ModelDrafter:
    """Greedy drafts from a small model on its own paged pool, every sequence in one forward."""

    name = "model"

    def __init__(
        self,
        model: Transformer,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        name: str = "model",
    ) -> None:
        self.model = model
        self.name = name
        self._autocast = autocast or contextlib.nullcontext
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.pool: BlockPool | None = None
        self.seqs: dict[object, _DraftSeq] = {}

    def setup(self, target: Transformer, num_blocks: int, block_size: int) -> None:
        """Refuse a draft with another vocabulary; a pool as large as the engine's."""
        if self.model.cfg.vocab_size != target.cfg.vocab_size:
            raise KilnError(
                f"the draft model's vocabulary ({self.model.cfg.vocab_size}) differs from the "
                f"target's ({target.cfg.vocab_size}); a draft model must share the tokenizer"
            )
        if next(target.parameters()).device != self.device:
            raise KilnError(
                f"the draft model is on {self.device}, the target on "
                f"{next(target.parameters()).device}: load both on one device"
            )
        if self.model.cfg.has_recurrent_layers:
            raise KilnError(
                f"the draft model has recurrent layers (model.layer_pattern = "
                f"{self.model.cfg.layer_pattern!r}); its state cannot roll back rejected drafts: "
                "draft with an attention model or --draft ngram"
            )
        # Each sequence needs no more draft blocks than target blocks.
        self.pool = BlockPool(self.model.cfg, num_blocks, block_size, device=self.device,
                              dtype=self.dtype)  # fmt: skip

    def propose(self, requests: Sequence[tuple[object, list[int], int]]) -> list[list[int]]:
        """Up to k greedy draft tokens per sequence; none where the draft's pool or context ends."""
        pool = self.pool
        assert pool is not None, "setup() first"
        bs = pool.block_size
        out: list[list[int]] = [[] for _ in requests]
        live: list[tuple[int, _DraftSeq, int]] = []  # request index, state, k
        for i, (key, ctx, k) in enumerate(requests):
            k = min(k, self.model.cfg.block_size - len(ctx) + 1)  # last draft's position fits
            if k < 1:
                continue
            st = self.seqs.setdefault(key, _DraftSeq())
            keep = min(_common_prefix(st.tokens, ctx), len(ctx) - 1)  # feed at least the last
            st.tokens = list(ctx[:keep])
            need = -(-(len(ctx) + k - 1) // bs) - len(st.blocks)
            if need > pool.available:
                continue  # no room in the draft's pool: this sequence decodes plainly this step
            st.blocks += [pool.allocate() for _ in range(need)]
            live.append((i, st, k))
        if not live:
            return out
        feed = {i: requests[i][1][len(st.tokens) :] for i, st, _ in live}
        for j in range(max(k for _, _, k in live)):
            step = [(i, st) for i, st, k in live if k > j]
            segments, tokens, rows = [], [], []
            for i, st in step:
                new = feed[i] if j == 0 else [out[i][-1]]
                start = len(st.tokens)
                segments.append(Segment(tuple(st.blocks), start, start + len(new)))
                tokens += new
                rows.append(len(tokens) - 1)
                st.tokens += new
            idx = torch.tensor([tokens], dtype=torch.long, device=self.device)
            cache = PagedStep(pool, segments, self.device, invariant=False)
            with torch.inference_mode(), self._autocast():
                h = self.model.hidden(idx, cache)
                best = self.model.logits(h[0, rows]).argmax(dim=-1).tolist()
            for (i, _), token in zip(step, best, strict=True):
                out[i].append(int(token))
        for _, st, _ in live:
            # The last draft was never fed: the blocks hold len(st.tokens) tokens; trailing
            # blocks beyond them (a short context after a rollback) go back to the pool.
            extra = len(st.blocks) - -(-len(st.tokens) // bs)
            if extra > 0:
                pool.release(st.blocks[-extra:])
                del st.blocks[-extra:]
        return out

    def release(self, key: object) -> None:
        """Free the sequence's draft blocks."""
        st = self.seqs.pop(key, None)
        if st is not None and self.pool is not None:
            self.pool.release(st.blocks)

    def audit(self) -> None:
        """The draft pool's holds equal the draft block tables."""
        if self.pool is not None:
            self.pool.audit(st.blocks for st in self.seqs.values())


def truncated(model: Transformer, n_layer: int) -> Transformer:
    """The model's first n_layer blocks, its final norm and head: a draft sharing its weights."""
    if not 1 <= n_layer <= model.cfg.n_layer:
        raise KilnError(
            f"a truncated draft needs 1 <= layers <= {model.cfg.n_layer} (the target's), "
            f"got {n_layer}"
        )
    draft = copy.copy(model)
    # A shallow copy shares the module dicts: give the copy its own before swapping the blocks.
    draft._modules = dict(model._modules)
    draft._parameters = dict(model._parameters)
    draft._buffers = dict(model._buffers)
    draft._modules["blocks"] = nn.ModuleList(list(model.blocks)[:n_layer])
    draft.cfg = dataclasses.replace(model.cfg, n_layer=n_layer)
    return draft


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of a and b."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
