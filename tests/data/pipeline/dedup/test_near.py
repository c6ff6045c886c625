"""Near dedup: union-find over shared band keys, one kept per cluster, validation protection."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kiln.data.pipeline.dedup.minhash import MinHashConfig, MinHasher, normalized_words
from kiln.data.pipeline.dedup.near import near_duplicate_clusters

EOT_LINE = "\n<|endoftext|>\n"


def ngram_set(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = normalized_words(text)
    return {tuple(words[i : i + n]) for i in range(max(len(words) - n + 1, 1))}


def jaccard(a: str, b: str) -> float:
    sa, sb = ngram_set(a), ngram_set(b)
    return len(sa & sb) / len(sa | sb)


@pytest.fixture(scope="module")
def distinct_docs(shared_data: Path) -> list[str]:
    """Real 600-3000 character documents from the benchmark corpus, pairwise dissimilar."""
    with gzip.open(shared_data / "bench" / "en_10m.txt.gz", "rt", encoding="utf-8") as f:
        docs = f.read(4_000_000).split(EOT_LINE)
    chosen: list[str] = []
    sets: list[set[tuple[str, ...]]] = []
    for doc in docs:
        if 600 <= len(doc) <= 3000:
            s = ngram_set(doc)
            # The corpus has natural near-duplicates (templated pages): skip those here.
            if all(len(s & t) / len(s | t) < 0.2 for t in sets):
                chosen.append(doc)
                sets.append(s)
        if len(chosen) == 150:
            break
    return chosen


def edit_locally(text: str, rate: float, rng: np.random.Generator, places: int = 3) -> str:
    """Change `rate` of the words, in a few contiguous stretches (a near-duplicate's edits)."""
    words = text.split()
    per_place = max(1, round(rate * len(words) / places))
    for start in rng.choice(len(words) - per_place, size=places, replace=False):
        for i in range(start, start + per_place):
            words[i] = f"edit{rng.integers(10**6)}"
    return " ".join(words)


def test_planted_near_duplicate_found_distinct_docs_kept(distinct_docs: list[str]) -> None:
    rng = np.random.default_rng(1)
    original = next(d for d in distinct_docs if 900 <= len(d) <= 1200)  # a 1 KB document
    copy = edit_locally(original, 0.05, rng, places=2)
    assert jaccard(original, copy) > 0.8  # P(caught) > 0.92 at 0.8, > 0.999 at 0.85 (14x8)
    texts = [*distinct_docs, copy]
    hasher = MinHasher(MinHashConfig())
    keys = hasher.band_keys(hasher.signatures(texts))
    representative, keep = near_duplicate_clusters(keys, np.arange(len(texts)))
    i = distinct_docs.index(original)
    assert representative[-1] == i and not keep[-1]
    assert keep[:-1].all()
    assert representative[:-1].tolist() == list(range(len(distinct_docs)))


def test_chain_makes_one_cluster_first_by_order_kept() -> None:
    # A~B share band 0, B~C share band 1, A and C share nothing; D is alone.
    keys = np.array([[1, 10], [1, 20], [2, 20], [3, 30]], dtype=np.uint64)
    order = np.array([7, 5, 6, 0])  # B comes first by order
    representative, keep = near_duplicate_clusters(keys, order)
    assert representative.tolist() == [1, 1, 1, 3]
    assert keep.tolist() == [False, True, False, True]


def test_ties_in_order_go_to_the_lower_index() -> None:
    keys = np.array([[5], [9], [5], [5]], dtype=np.uint64)
    representative, keep = near_duplicate_clusters(keys, np.array([3, 0, 1, 1]))
    assert representative.tolist() == [2, 1, 2, 2]
    assert keep.tolist() == [False, True, True, False]


def test_validation_documents_protect_their_cluster() -> None:
    keys = np.array([[1, 0], [1, 1], [2, 1], [4, 4], [4, 5], [6, 6]], dtype=np.uint64)
    protected = np.array([False, False, True, False, True, True])
    representative, keep = near_duplicate_clusters(keys, np.arange(6), protected=protected)
    # Cluster {0,1,2}: the val doc 2 stays, the earlier train docs go; {3,4}: 3 goes.
    assert keep.tolist() == [False, False, True, False, True, True]
    assert representative.tolist() == [2, 2, 2, 4, 4, 5]


def test_all_protected_members_are_kept() -> None:
    keys = np.array([[1], [1], [1]], dtype=np.uint64)
    representative, keep = near_duplicate_clusters(
        keys, np.arange(3), protected=np.array([True, False, True])
    )
    assert keep.tolist() == [True, False, True]
    assert representative.tolist() == [0, 0, 0]


def test_band_columns_and_matrix_agree() -> None:
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 6, size=(40, 3)).astype(np.uint64)
    order = rng.permutation(40)
    a = near_duplicate_clusters(keys, order)
    b = near_duplicate_clusters([keys[:, j].copy() for j in range(3)], order)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_empty_input_and_length_mismatch() -> None:
    representative, keep = near_duplicate_clusters(np.zeros((0, 14), np.uint64), np.zeros(0))
    assert len(representative) == 0 and len(keep) == 0
    with pytest.raises(ValueError, match="band 0 has 3 keys for 2 documents"):
        near_duplicate_clusters(np.zeros((3, 2), np.uint64), np.arange(2))


def reference_clusters(keys: np.ndarray) -> list[int]:
    """Smallest member index of each document's component, by breadth-first search."""
    n = len(keys)
    label = [-1] * n
    for s in range(n):
        if label[s] >= 0:
            continue
        label[s], frontier = s, [s]
        while frontier:
            u = frontier.pop()
            for v in range(n):
                if label[v] < 0 and (keys[u] == keys[v]).any():
                    label[v] = s
                    frontier.append(v)
    return label


@settings(max_examples=150, deadline=None)
@given(
    arrays(np.uint64, st.tuples(st.integers(0, 25), st.integers(1, 4)), elements=st.integers(0, 7)),
    st.randoms(),
)
def test_clusters_match_breadth_first_search(keys: np.ndarray, rnd: random.Random) -> None:
    n = len(keys)
    order = np.array([rnd.randrange(4) for _ in range(n)], dtype=np.int64)
    protected = np.array([rnd.random() < 0.2 for _ in range(n)], dtype=bool)
    representative, keep = near_duplicate_clusters(keys, order, protected=protected)
    label = reference_clusters(keys)
    for c in set(label):
        members = [i for i in range(n) if label[i] == c]
        val = [i for i in members if protected[i]]
        pool = val or members
        first = min(pool, key=lambda i: (order[i], i))
        assert all(representative[i] == first for i in members)
        expected_kept = set(val) if val else {first}
        assert {i for i in members if keep[i]} == expected_kept


def test_catch_rate_follows_the_s_curve(distinct_docs: list[str]) -> None:
    # Pairs with scattered edits span Jaccard 0.4-0.95; the number LSH links must match the
    # 14x8 catch probability summed over the pairs, within 4 standard deviations.
    rng = np.random.default_rng(3)
    cfg = MinHashConfig()
    hasher = MinHasher(cfg)
    originals, copies = [], []
    for doc in distinct_docs:
        words = doc.split()
        for i in rng.choice(len(words), size=round(rng.uniform(0.01, 0.12) * len(words))):
            words[i] = f"zz{rng.integers(10**6)}"
        originals.append(doc)
        copies.append(" ".join(words))
    p = np.array(
        [cfg.catch_probability(jaccard(a, b)) for a, b in zip(originals, copies, strict=True)]
    )
    keys = hasher.band_keys(hasher.signatures(originals + copies))
    n = len(originals)
    representative, _ = near_duplicate_clusters(keys, np.arange(2 * n))
    caught = int((representative[n:] == np.arange(n)).sum())
    assert 0.2 * n < p.sum() < 0.8 * n  # the pairs sit on the slope of the curve
    assert abs(caught - p.sum()) <= 4 * np.sqrt((p * (1 - p)).sum())
