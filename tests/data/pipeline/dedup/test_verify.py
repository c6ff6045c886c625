"""Jaccard verification of LSH candidates: exact Jaccard, anchors, and what it removes."""

from __future__ import annotations

import numpy as np

from kiln.data.pipeline.dedup.minhash import hash_word_ngrams
from kiln.data.pipeline.dedup.verify import anchor_pairs, distinct_shingles, jaccard, verify_pairs


def test_distinct_shingles_are_sorted_sets_per_document() -> None:
    values, offsets = distinct_shingles(
        np.array([5, 3, 5, 9, 9, 1], np.uint64), np.array([0, 3, 6])
    )
    assert values.tolist() == [3, 5, 1, 9] and offsets.tolist() == [0, 2, 4]


def test_jaccard_of_shingle_sets() -> None:
    a, b = np.array([1, 2, 3, 4], np.uint64), np.array([3, 4, 5], np.uint64)
    assert jaccard(a, b) == 2 / 5 and jaccard(a, a) == 1.0
    texts = ["the cat sat on the mat today", "the cat sat on the mat today"]
    values, offsets = distinct_shingles(*hash_word_ngrams(texts, 5))
    assert jaccard(values[: offsets[1]], values[offsets[1] :]) == 1.0


def test_a_false_positive_at_the_head_of_a_bucket_does_not_split_the_rest() -> None:
    # One bucket: node 0 only collides by chance; 1 and 2 are true duplicates.
    keys = np.array([7, 7, 7], dtype=np.uint64)
    nodes = np.array([0, 1, 2], dtype=np.int64)
    u, v = anchor_pairs(keys, nodes)
    assert sorted(zip(u.tolist(), v.tolist(), strict=True)) == [(0, 1), (0, 2), (1, 2)]
    sets = {0: np.array([1, 2, 3], np.uint64), 1: np.array([10, 11, 12, 13], np.uint64),
            2: np.array([10, 11, 12, 14], np.uint64)}  # fmt: skip
    ok = verify_pairs(u, v, sets.__getitem__, 0.5)
    kept = {(a, b) for a, b, k in zip(u.tolist(), v.tolist(), ok.tolist(), strict=True) if k}
    assert kept == {(1, 2)}


def test_anchor_pairs_stay_linear_in_the_bucket_size() -> None:
    n = 1000
    u, _ = anchor_pairs(np.zeros(n, dtype=np.uint64), np.arange(n, dtype=np.int64))
    assert len(u) == 2 * n - 3  # every member with anchors 0 and 1, the anchors paired once
