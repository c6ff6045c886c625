"""Jaccard verification of MinHash-LSH candidates before their clusters are merged.

LSH links two documents when any band of their signatures agrees, which happens by chance for
pairs well below the target similarity (with 14 bands x 8 rows, a pair at Jaccard 0.6 shares a
band about one time in five). NeMo-Curator's fuzzy dedup therefore computes the exact Jaccard
similarity of each candidate pair's shingle sets and keeps an edge only at or above a threshold;
kiln does the same. Within one band bucket each member is compared with the bucket's first two
members (its "anchors", NeMo-Curator's choice too), so one false positive at the head of a bucket
does not cut the true duplicates behind it apart, and the work stays linear in the bucket size.

Shingles are the MinHash stage's own (`minhash.hash_word_ngrams`): the exact Jaccard measured
here is the quantity the signatures estimate.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import numpy as np

from kiln.data.pipeline.records import save_array

SHINGLES = "shingles"  # a filter task's sorted, distinct shingle hashes per document
ANCHORS = 2


def distinct_shingles(hashes: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each document's shingle hashes sorted and deduplicated: (values, offsets (n + 1,))."""
    n = len(offsets) - 1
    doc = np.repeat(np.arange(n, dtype=np.int64), np.diff(offsets))
    order = np.lexsort((hashes, doc))
    values, doc = hashes[order], doc[order]
    first = np.ones(len(values), dtype=bool)
    first[1:] = (values[1:] != values[:-1]) | (doc[1:] != doc[:-1])
    values, doc = values[first], doc[first]
    return values, np.searchsorted(doc, np.arange(n + 1)).astype(np.int64)


def write_shingles(folder: str | os.PathLike[str], values: np.ndarray, offsets: np.ndarray) -> None:
    """Save one task's distinct shingles (values + offsets), memory-mappable."""
    save_array(os.path.join(folder, f"{SHINGLES}.npy"), values)
    save_array(os.path.join(folder, f"{SHINGLES}.offsets.npy"), offsets)


@functools.lru_cache(maxsize=256)
def _task_shingles(folder: str, identity: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    values = np.load(os.path.join(folder, f"{SHINGLES}.npy"), mmap_mode="r")
    return values, np.load(os.path.join(folder, f"{SHINGLES}.offsets.npy"))


def shingle_lookup(task_dirs: tuple[str, ...], shift: int) -> Callable[[int], np.ndarray]:
    """node -> its document's distinct shingles, read from the task folders (memory-mapped)."""
    local_mask = (1 << shift) - 1

    def lookup(node: int) -> np.ndarray:
        plain = int(node) & ((1 << 62) - 1)
        folder = task_dirs[plain >> shift]
        st = os.stat(os.path.join(folder, f"{SHINGLES}.npy"))  # a rerun must not hit the cache
        values, offsets = _task_shingles(folder, (st.st_mtime_ns, st.st_size))
        i = plain & local_mask
        return np.asarray(values[offsets[i] : offsets[i + 1]])

    return lookup


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|a ∩ b| / |a ∪ b| of two sorted arrays of distinct values (1.0 for two empty sets)."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


def anchor_pairs(keys: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows sorted by (key, node): (smaller, larger) node of the pair of every member of a
    bucket with each of the bucket's first `ANCHORS` members other than itself. A pair appears
    once per bucket that proposes it (a bucket lies in one partition, so the count of these
    bucket-level candidates does not depend on the partitioning)."""
    if len(keys) < 2:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    new = np.concatenate(([True], keys[1:] != keys[:-1]))
    start = np.flatnonzero(new)[np.cumsum(new) - 1]  # (n,) first row of each row's bucket
    end = np.append(np.flatnonzero(new)[1:], len(keys))[np.cumsum(new) - 1]
    us, vs, oks = [], [], []
    for k in range(ANCHORS):
        anchor = start + k
        ok = (anchor < end) & (anchor != np.arange(len(keys)))
        us.append(nodes[ok])
        vs.append(nodes[anchor[ok]])
        oks.append(ok)
    ok0, ok1 = oks
    u, v = np.concatenate(us), np.concatenate(vs)
    # Anchor 1 paired with anchor 0 is the same pair as anchor 0 with anchor 1: count it once.
    lo, hi = np.minimum(u, v), np.maximum(u, v)
    pairs = np.unique(np.stack([lo, hi, np.concatenate([start[ok0], start[ok1]])], axis=1), axis=0)
    return pairs[:, 0], pairs[:, 1]


def verify_pairs(
    u: np.ndarray, v: np.ndarray, lookup: Callable[[int], np.ndarray], threshold: float
) -> np.ndarray:
    """(k,) bool: which candidate pairs have exact Jaccard >= threshold."""
    ok = np.zeros(len(u), dtype=bool)
    for i, (a, b) in enumerate(zip(u.tolist(), v.tolist(), strict=True)):
        ok[i] = jaccard(lookup(a), lookup(b)) >= threshold
    return ok
