"""Exact dedup: case/whitespace variants share a key; the first by order is kept."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.data.pipeline.dedup.exact import exact_key, first_occurrences, keys_array


def test_key_is_blake2b_of_the_canonical_text() -> None:
    expected = hashlib.blake2b(b"hello world", digest_size=16).digest()
    assert exact_key("  Hello\n\tWORLD ") == expected
    assert len(exact_key("")) == 16


def test_case_and_whitespace_variants_collide_others_do_not() -> None:
    base = "The quick brown fox.\nJumps over the lazy dog."
    variants = [base.upper(), "  " + base.replace(" ", "   "), base.replace("\n", "\r\n\t")]
    assert {exact_key(v) for v in variants} == {exact_key(base)}
    assert exact_key(base) != exact_key(base.replace("fox.", "fox!"))
    assert exact_key("ab") != exact_key("a b")


def test_planted_duplicates_removed_first_kept() -> None:
    texts = ["alpha doc", "beta doc", "ALPHA   doc", "gamma", "beta\ndoc", "alpha doc"]
    keys = keys_array([exact_key(t) for t in texts])
    keep, kept_index = first_occurrences(keys, np.arange(len(texts)))
    assert keep.tolist() == [True, True, False, True, False, False]
    assert kept_index.tolist() == [0, 1, 0, 3, 1, 0]


def test_order_decides_which_copy_is_kept() -> None:
    keys = keys_array([exact_key(t) for t in ["x", "y", "x", "x"]])
    keep, kept_index = first_occurrences(keys, np.array([30, 5, 10, 10]))
    assert keep.tolist() == [False, True, True, False]  # order 10 ties: the lower index wins
    assert kept_index.tolist() == [2, 1, 2, 2]


def test_protected_documents_are_never_removed() -> None:
    keys = keys_array([exact_key(t) for t in ["x", "x", "x", "y"]])
    protected = np.array([False, True, True, False])
    keep, kept_index = first_occurrences(keys, np.arange(4), protected=protected)
    assert keep.tolist() == [False, True, True, True]
    assert kept_index.tolist() == [1, 1, 1, 3]


def test_uint64_pair_keys_give_the_same_answer() -> None:
    keys = keys_array([exact_key(t) for t in ["a", "b", "a", "c", "b"]])
    order = np.array([4, 3, 2, 1, 0])
    by_bytes = first_occurrences(keys, order)
    by_pairs = first_occurrences(keys.view(np.uint64), order)
    for x, y in zip(by_bytes, by_pairs, strict=True):
        np.testing.assert_array_equal(x, y)


def test_bad_key_shape_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"\(n, 16\) uint8"):
        first_occurrences(np.zeros((3, 8), np.uint8), np.arange(3))


@settings(deadline=None)  # a shared 2-core machine can stall any example past 200 ms
@given(st.lists(st.sampled_from(["a", "b", "c", "A", " a "]), max_size=30), st.randoms())
def test_matches_a_dictionary_reference(texts: list[str], rnd: random.Random) -> None:
    order = np.array([rnd.randrange(5) for _ in texts], dtype=np.int64)
    keys = keys_array([exact_key(t) for t in texts]) if texts else np.zeros((0, 16), np.uint8)
    keep, kept_index = first_occurrences(keys, order)
    first: dict[bytes, int] = {}
    for i in sorted(range(len(texts)), key=lambda i: (order[i], i)):
        first.setdefault(exact_key(texts[i]), i)
    expected = [first[exact_key(t)] for t in texts]
    assert kept_index.tolist() == expected
    assert keep.tolist() == [expected[i] == i for i in range(len(texts))]
