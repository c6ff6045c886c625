"""Exact deduplication: a 16-byte key per document, the first document by order kept per key."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from kiln.errors import KilnError

METHODS = ("sort", "bloom")


@dataclass(frozen=True)
class ExactDedupConfig:
    """Exact dedup: the key and the keep rule are fixed (see `exact_key`); the method is
    "sort" (hash partitions on disk, exact) or "bloom" (one Bloom filter, see `bloom`)."""

    enabled: bool = True
    method: str = "sort"
    false_positive_rate: float = 1e-3  # "bloom": the share of unique documents it may remove

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise KilnError(f"dedup.exact.method = {self.method!r}: expected one of {METHODS}")
        if not 0.0 < self.false_positive_rate < 0.5:
            raise KilnError(
                f"dedup.exact.false_positive_rate = {self.false_positive_rate}: expected a rate "
                f"in (0, 0.5)"
            )


def exact_key(text: str) -> bytes:
    """BLAKE2b-128 of the text lowercased with whitespace runs collapsed to one space.

    So case and spacing variants of a document share a key. Unicode normalisation (NFC) is not
    applied here: the normalise stage has already done it, and the key only reads the text.
    """
    canonical = " ".join(text.lower().split())
    return hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def keys_array(keys: list[bytes]) -> np.ndarray:
    """Stack `exact_key` results into an (n, 16) uint8 array."""
    return np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 16)


def _as_uint64_pairs(keys: np.ndarray) -> np.ndarray:
    """Keys as (n, 2) uint64, from (n, 16) uint8 or (n, 2) uint64."""
    keys = np.ascontiguousarray(keys)
    if keys.ndim == 2 and keys.shape[1] == 16 and keys.dtype == np.uint8:
        return keys.view(np.uint64)
    if keys.ndim == 2 and keys.shape[1] == 2 and keys.dtype == np.uint64:
        return keys
    raise ValueError(
        f"expected keys of shape (n, 16) uint8 or (n, 2) uint64, got {keys.shape} {keys.dtype}"
    )


def first_occurrences(
    keys: np.ndarray, order: np.ndarray, protected: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Keep the first document by `order` per key; returns (keep (n,) bool, kept_index (n,)).

    `kept_index[i]` is the index of the document kept in i's place (i itself when i is kept).
    Ties in `order` go to the lower index. `protected` (n,) bool marks validation documents:
    they are never removed, and a key with protected documents keeps only those (its other
    documents point at the first protected one), as near dedup does.
    """
    pairs = _as_uint64_pairs(keys)
    n = len(pairs)
    if len(order) != n:
        raise ValueError(f"order has {len(order)} entries for {n} keys")
    protected_mask = np.zeros(n, dtype=bool) if protected is None else np.asarray(protected, bool)
    # Sort by key, then protected first, then order, then index: each group's first is kept.
    rank = np.lexsort((np.arange(n), np.asarray(order), ~protected_mask, pairs[:, 1], pairs[:, 0]))
    sorted_pairs = pairs[rank]
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = np.any(sorted_pairs[1:] != sorted_pairs[:-1], axis=1)
    group_first = rank[np.flatnonzero(new_group)]
    kept_index = np.empty(n, dtype=np.int64)
    kept_index[rank] = group_first[np.cumsum(new_group) - 1]
    keep = (kept_index == np.arange(n)) | protected_mask
    return keep, kept_index
