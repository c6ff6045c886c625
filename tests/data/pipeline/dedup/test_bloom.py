"""The Bloom filter behind `dedup.exact.method = "bloom"`: sizing, no false negatives, and a
measured false-positive rate near the one asked for."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kiln.data.pipeline.dedup.bloom import BloomFilter, bloom_size, first_seen


def keys(start: int, n: int) -> np.ndarray:
    """n distinct 128-bit keys as (n, 2) uint64, as exact dedup makes them (BLAKE2b)."""
    raw = b"".join(
        hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(start, start + n)
    )
    return np.frombuffer(raw, dtype=np.uint64).reshape(n, 2)


def test_size_follows_the_textbook_formulas() -> None:
    bits, probes = bloom_size(1000, 0.01)
    assert bits == 9586 and probes == 7  # m = -n ln p / ln^2 2, k = m/n ln 2


@pytest.mark.parametrize("rate", [0.01, 0.001])
def test_measured_false_positive_rate_is_near_the_design_rate(rate: float) -> None:
    n = 20_000
    bloom = BloomFilter(*bloom_size(n, rate))
    inserted = keys(0, n)
    bloom.add(inserted)
    assert bloom.contains(inserted).all()  # never a false negative
    achieved = bloom.contains(keys(n, 100_000)).mean()
    assert rate / 2 < achieved < rate * 2
    assert abs(bloom.fill() - 0.5) < 0.02  # the optimum: half the bits set


def test_a_batch_finds_repeats_within_itself_and_in_the_filter() -> None:
    bloom = BloomFilter(*bloom_size(100, 1e-6))
    first = keys(0, 10)
    assert not first_seen(bloom, first).any()
    batch = np.concatenate([keys(10, 3), first[[4]], keys(10, 1)])
    assert first_seen(bloom, batch).tolist() == [False, False, False, True, True]
