"""Mixing: how many times each training document appears, to reach each source's token target.

A source's target is `share x (all available training tokens)` when shares are given, else
`rate x (its own available tokens)` (rate 1 when neither is given). A target of k whole copies
plus a remainder R repeats every document k times and adds one more copy of documents taken in
a seeded order until R tokens are reached, so the result lands within one document of the
target and depends only on (seed, document ids), never on the order documents were processed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SourceMix:
    """One source's documents (train split): their order keys and token lengths."""

    name: str
    share: float | None
    rate: float | None
    order_keys: np.ndarray  # (n,) float64 in [0, 1), a seeded hash of each document id
    lengths: np.ndarray  # (n,) int64 tokens per document (end-of-text included)


def source_targets(sources: list[SourceMix]) -> dict[str, float]:
    """The token target of each source (see the module docstring)."""
    total = float(sum(int(s.lengths.sum()) for s in sources))
    targets = {}
    for s in sources:
        if s.share is not None:
            targets[s.name] = s.share * total
        else:
            targets[s.name] = (1.0 if s.rate is None else s.rate) * float(s.lengths.sum())
    return targets


def repeats_for(source: SourceMix, target: float) -> np.ndarray:
    """How many copies of each document reach `target` tokens (within one document)."""
    n = source.lengths.shape[0]
    available = int(source.lengths.sum())
    if n == 0 or available == 0 or target <= 0:
        return np.zeros(n, dtype=np.int64)
    whole = math.floor(target / available)
    remainder = target - whole * available
    repeats = np.full(n, whole, dtype=np.int64)
    if remainder > 0:
        order = np.argsort(source.order_keys, kind="stable")
        before = np.cumsum(source.lengths[order]) - source.lengths[order]
        repeats[order[before < remainder]] += 1
    return repeats


def plan_mixture(sources: list[SourceMix]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Repeats per document for every source, and the before/after summary for the manifest."""
    targets = source_targets(sources)
    repeats = {s.name: repeats_for(s, targets[s.name]) for s in sources}
    after_total = sum(int((repeats[s.name] * s.lengths).sum()) for s in sources)
    before_total = sum(int(s.lengths.sum()) for s in sources)
    summary: dict[str, Any] = {}
    for s in sources:
        r = repeats[s.name]
        tokens_after = int((r * s.lengths).sum())
        summary[s.name] = {
            "documents_before": int(s.lengths.shape[0]),
            "tokens_before": int(s.lengths.sum()),
            "share_before": int(s.lengths.sum()) / before_total if before_total else 0.0,
            "target_share": s.share,
            "rate": s.rate,
            "target_tokens": round(targets[s.name]),
            "documents_after": int(r.sum()),
            "unique_documents_after": int((r > 0).sum()),
            "tokens_after": tokens_after,
            "share_after": tokens_after / after_total if after_total else 0.0,
            "max_repeats": int(r.max()) if r.size else 0,
        }
    return repeats, summary
