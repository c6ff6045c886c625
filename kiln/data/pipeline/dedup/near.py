"""Near-duplicate clusters from LSH band keys: union-find in NumPy, one kept document per cluster.

Two documents are linked when they share the key of any band (see `minhash.MinHasher`); the
clusters are the connected components of those links, so A~B and B~C put A, B and C together
even when A and C share no band. Bands are processed one at a time — sort the column, link each
run of equal keys — so memory is O(n) whatever the number of bands.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _find_all(parent: np.ndarray) -> np.ndarray:
    """Point every node straight at its root (pointer jumping until nothing moves), in place."""
    while True:
        grand = parent[parent]
        if np.array_equal(grand, parent):
            return parent
        parent[:] = grand


def _union(parent: np.ndarray, u: np.ndarray, v: np.ndarray) -> None:
    """Merge the components of every edge (u[i], v[i]); roots are always the smallest index.

    `parent[x] <= x` holds throughout, so the forest never gets a cycle. Each round hooks the
    larger root of every unsatisfied edge onto the smaller one (`minimum.at` resolves hooks that
    compete for the same root), then compresses; edges already inside one component are dropped
    for good, since components only grow.
    """
    while len(u):
        _find_all(parent)
        ru, rv = parent[u], parent[v]
        open_ = ru != rv
        if not open_.any():
            return
        u, v, ru, rv = u[open_], v[open_], ru[open_], rv[open_]
        np.minimum.at(parent, np.maximum(ru, rv), np.minimum(ru, rv))


def _band_edges(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Links for one band: each document to the first one (by index) with the same key."""
    if len(keys) < 2:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.argsort(keys, kind="stable")  # equal keys keep index order
    sorted_keys = keys[order]
    same = sorted_keys[1:] == sorted_keys[:-1]  # (n-1,) continues the previous run
    run_start = np.flatnonzero(np.concatenate(([True], ~same)))
    run_of = np.cumsum(np.concatenate(([False], ~same)))  # run id of every sorted position
    head = order[run_start][run_of]  # first member of each position's run
    linked = np.concatenate(([False], same))
    return head[linked], order[linked]


def _as_band_columns(band_keys: Sequence[np.ndarray] | np.ndarray) -> list[np.ndarray]:
    """The band keys as a list of (n,) columns, from an (n, bands) array or a list of columns."""
    if isinstance(band_keys, np.ndarray):
        if band_keys.ndim != 2:
            raise ValueError(f"expected band keys of shape (n, bands), got {band_keys.shape}")
        return [band_keys[:, b] for b in range(band_keys.shape[1])]
    return [np.asarray(column) for column in band_keys]


def near_duplicate_clusters(
    band_keys: Sequence[np.ndarray] | np.ndarray,
    order: np.ndarray,
    protected: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Cluster documents sharing any band key; returns (representative (n,), keep (n,) bool).

    `band_keys`: an (n, bands) uint64 array, or one (n,) column per band (e.g. memory-mapped
    per-band shards). `order`: (n,) sort keys (say, global ordinals); the first document by
    `order` (ties: the lower index) is a cluster's representative and the only one kept.
    `protected`: (n,) bool, validation documents. A cluster with protected members keeps all of
    them and removes all its other members; its representative is its first protected member.
    `representative[i]` is the index of the document that stands for i's cluster: i itself for
    a kept unclustered document, the document i duplicates for a removed one.
    """
    columns = _as_band_columns(band_keys)
    n = len(order)
    for b, column in enumerate(columns):
        if len(column) != n:
            raise ValueError(f"band {b} has {len(column)} keys for {n} documents")
    protected_mask = np.zeros(n, dtype=bool) if protected is None else np.asarray(protected, bool)
    if len(protected_mask) != n:
        raise ValueError(f"protected has {len(protected_mask)} entries for {n} documents")

    parent = np.arange(n, dtype=np.int64)
    for column in columns:
        _union(parent, *_band_edges(column))
    root = _find_all(parent)

    # Rank each cluster's members: protected first, then by order, then by index.
    rank = np.lexsort((np.arange(n), np.asarray(order), ~protected_mask, root))
    first_of_root = np.empty(n, dtype=np.int64)
    ranked_root = root[rank]
    leader = np.ones(n, dtype=bool)  # the first of each cluster in rank order
    leader[1:] = ranked_root[1:] != ranked_root[:-1]
    first_of_root[ranked_root[leader]] = rank[leader]
    representative = first_of_root[root]
    keep = representative == np.arange(n)
    # A cluster led by a protected document keeps every protected member.
    keep |= protected_mask
    return representative, keep
