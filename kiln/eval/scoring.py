"""Log-probabilities of token targets under a model, in padded batches.

The one primitive is a *window*: a token sequence whose last `n_scored` tokens are the targets,
each predicted from the tokens before it in the window. A (context, continuation) request is one
window (the context cut from the left to fit the block size); a long document is a run of
overlapping windows (`rolling_windows`) that scores every token exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.model.transformer import Transformer


class TextEncoder(Protocol):
    """What scoring needs from a tokenizer (kiln's Tokenizer has it)."""

    special_tokens: dict[str, int]

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of text, special-token strings encoded as plain text."""
        ...

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes token ids stand for."""
        ...


@dataclass(frozen=True)
class Scored:
    """The summed log-probability (nats) of a window's targets, their count, and whether each
    target was the model's argmax (greedy decoding would have produced them)."""

    logprob: float
    n_tokens: int
    is_greedy: bool


# fp32 logit elements computed at a time (128 MB), whatever the batch and vocabulary size.
LOGIT_CHUNK_ELEMENTS = 2**25

Window = tuple[Sequence[int], int]  # (tokens, n_scored): the last n_scored tokens are targets


def rolling_windows(n_tokens: int, block_size: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows (lo, hi, n_scored) over a sequence of n_tokens that score tokens 1..n-1 once each.

    Targets are taken `stride` at a time; each chunk is predicted by the window tokens[lo:hi]
    that ends at the chunk and reaches back as far as the block size allows, so every target
    has at least block_size - stride tokens of context (all of them near the start). With
    stride == block_size the windows are disjoint chunks (sharing one boundary token), except
    that the last one reaches back to a full block. Token 0 has no context and is not scored.
    """
    if not 1 <= stride <= block_size:
        raise KilnError(f"stride must be in 1..block_size ({block_size}), got {stride}")
    windows = []
    start = 1
    while start < n_tokens:
        end = min(start + stride, n_tokens)
        windows.append((max(0, end - 1 - block_size), end, end - start))
        start = end
    return windows


class Scorer:
    """Scores windows with a model in padded batches (right-padded, longest first)."""

    def __init__(
        self,
        model: Transformer,
        batch_size: int = 16,
        progress: bool = True,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        if batch_size < 1:
            raise KilnError(f"batch size must be >= 1, got {batch_size}")
        self.model = model.eval()
        self.batch_size = batch_size
        self.progress = progress
        self.block_size = model.cfg.block_size
        self.device = next(model.parameters()).device
        self.autocast_dtype = autocast_dtype  # e.g. bf16, as the trainer scores; None: fp32

    def score_windows(self, windows: Sequence[Window], desc: str = "scoring") -> list[Scored]:
        """One `Scored` per window, in the order given."""
        for tokens, n_scored in windows:
            if not 1 <= n_scored < len(tokens) or len(tokens) - 1 > self.block_size:
                raise ValueError(
                    f"a window of {len(tokens)} tokens scoring {n_scored} does not fit "
                    f"block_size {self.block_size}"
                )
        # Longest first: similar lengths share a batch (little padding), and a batch that does
        # not fit in memory fails at the start, not after minutes.
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        results: list[Scored | None] = [None] * len(windows)
        bar = _bar(len(windows), desc, self.progress)
        dtype = self.autocast_dtype
        autocast = torch.autocast(
            self.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None
        )
        with torch.inference_mode(), autocast:
            for first in range(0, len(order), self.batch_size):
                rows = order[first : first + self.batch_size]
                for i, scored in zip(
                    rows, self._score_batch([windows[i] for i in rows]), strict=True
                ):
                    results[i] = scored
                if bar is not None:
                    bar.update(len(rows))
        if bar is not None:
            bar.close()
        return [r for r in results if r is not None]

    def _score_batch(self, batch: Sequence[Window]) -> list[Scored]:
        """Forward one right-padded batch; only the target positions reach the LM head."""
        width = max(len(tokens) for tokens, _ in batch) - 1
        x = torch.zeros(len(batch), width, dtype=torch.long)  # (B, T); pad id 0 is never scored
        y = torch.zeros(len(batch), width, dtype=torch.long)  # (B, T)
        scored = torch.zeros(len(batch), width, dtype=torch.bool)  # (B, T)
        for row, (tokens, n_scored) in enumerate(batch):
            t = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
            n = t.numel() - 1
            x[row, :n], y[row, :n] = t[:-1], t[1:]
            scored[row, n - n_scored : n] = True  # causal attention: padding after n is unseen
        x, y, scored = x.to(self.device), y.to(self.device), scored.to(self.device)
        h = self.model.hidden(x)[scored]  # (N, C), N = targets in the batch
        targets = y[scored]  # (N,)
        # The head in chunks of rows: fp32 logits for all N targets at once could take GBs.
        rows = max(1, LOGIT_CHUNK_ELEMENTS // self.model.cfg.vocab_size)
        logp_parts, greedy_parts = [], []
        for h_part, y_part in zip(h.split(rows), targets.split(rows), strict=True):
            logits = self.model.logits(h_part).float()  # (rows, V)
            target_logit = logits.gather(1, y_part[:, None])[:, 0]
            logp_parts.append(target_logit - torch.logsumexp(logits, dim=-1))
            greedy_parts.append(logits.argmax(dim=-1) == y_part)
        logp, greedy = torch.cat(logp_parts), torch.cat(greedy_parts)  # (N,), (N,)
        counts = scored.sum(dim=1).tolist()
        out = []
        for lp, gr, n in zip(logp.split(counts), greedy.split(counts), counts, strict=True):
            out.append(Scored(float(lp.double().sum()), int(n), bool(gr.all())))
        return out

    def score_groups(
        self, groups: Sequence[Sequence[Window]], desc: str = "scoring"
    ) -> list[Scored]:
        """One `Scored` per group of windows: their log-probs and counts summed (all windows of
        every group are batched together)."""
        windows = [w for group in groups for w in group]
        scored = iter(self.score_windows(windows, desc))
        out = []
        for group in groups:
            parts = [next(scored) for _ in group]
            out.append(
                Scored(
                    sum(p.logprob for p in parts),
                    sum(p.n_tokens for p in parts),
                    all(p.is_greedy for p in parts),
                )
            )
        return out

    def score_documents(
        self, documents: Sequence[Sequence[int]], stride: int | None = None, desc: str = "scoring"
    ) -> list[Scored]:
        """Each document's total log-prob of tokens 1..n-1, in sliding windows (see
        `rolling_windows`; default stride: the block size)."""
        stride = stride or self.block_size
        groups = [
            [(doc[lo:hi], n) for lo, hi, n in rolling_windows(len(doc), self.block_size, stride)]
            for doc in documents
        ]
        return self.score_groups(groups, desc)

    def score_requests(
        self, requests: Sequence[tuple[Sequence[int], Sequence[int]]], desc: str = "scoring"
    ) -> list[Scored]:
        """The log-prob of each (context ids, continuation ids) request's continuation."""
        groups = [request_windows(c, x, self.block_size) for c, x in requests]
        return self.score_groups(groups, desc)


def encode_pair(
    tok: TextEncoder, context: str, continuation: str, prefix_id: int | None
) -> tuple[list[int], list[int]]:
    """Token ids of (context, continuation), split as lm-evaluation-harness does.

    Spaces ending the context move to the continuation; the pair is encoded whole and the
    continuation is what follows the context's own tokens. An empty context becomes
    [prefix_id] (the end-of-text token), so the continuation's first token is scored too.
    """
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        if prefix_id is None:
            raise KilnError("an empty context needs an end-of-text token to condition on")
        return [prefix_id], tok.encode_ordinary(continuation)
    context_ids = tok.encode_ordinary(context)
    whole = tok.encode_ordinary(context + continuation)
    return context_ids, whole[len(context_ids) :]


def request_windows(
    context_ids: Sequence[int], continuation_ids: Sequence[int], block_size: int
) -> list[Window]:
    """The windows scoring a continuation, each reaching back as far as the block allows.

    Usually one window, the context cut from the left to fit. A continuation longer than the
    block is scored in chunks: the last ones of block_size tokens, the first one shorter.
    """
    if not continuation_ids:
        raise KilnError("a continuation encodes to no tokens")
    if not context_ids:
        raise KilnError("a continuation needs at least one context token to condition on")
    tokens = [*context_ids, *continuation_ids]
    first = len(context_ids)
    windows: list[Window] = []
    for end in reversed(range(len(tokens), first, -block_size)):
        lo = max(0, end - 1 - block_size)
        windows.append((tokens[lo:end], end - max(first, end - block_size)))
    return windows


def _bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar with rate and ETA, or None when progress is off."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="seq", dynamic_ncols=True, leave=False)
