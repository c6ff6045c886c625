"""MinHash: word n-gram hashing, signatures against a plain-Python reference, Jaccard estimates."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.config import ConfigError
from kiln.data.pipeline.dedup.minhash import (
    MERSENNE_61,
    MinHashConfig,
    MinHasher,
    hash_word_ngrams,
    normalized_words,
)

REPO = Path(__file__).resolve().parents[4]
EOT_LINE = "\n<|endoftext|>\n"


@pytest.fixture(scope="module")
def real_docs(shared_data: Path) -> list[str]:
    """The first 300 documents of the English benchmark corpus."""
    with gzip.open(shared_data / "bench" / "en_10m.txt.gz", "rt", encoding="utf-8") as f:
        text = f.read(3_000_000)
    return text.split(EOT_LINE)[:300]


def ngram_set(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """The word n-grams of a text as tuples (the short-document rule included)."""
    words = normalized_words(text)
    return {tuple(words[i : i + n]) for i in range(max(len(words) - n + 1, 1))}


def jaccard(a: str, b: str) -> float:
    sa, sb = ngram_set(a), ngram_set(b)
    return len(sa & sb) / len(sa | sb)


def test_config_defaults_and_s_curve() -> None:
    cfg = MinHashConfig()
    assert (cfg.ngram, cfg.bands, cfg.rows, cfg.num_perm) == (5, 14, 8, 112)
    assert cfg.threshold == pytest.approx((1 / 14) ** (1 / 8))
    # FineWeb's 14x8 figure (datatrove's minhash.py): 92.4% caught at similarity 0.8.
    assert cfg.catch_probability(0.8) == pytest.approx(0.924, abs=5e-4)
    assert cfg.catch_probability(0.0) == 0.0 and cfg.catch_probability(1.0) == 1.0


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"minhash\.rows"):
        MinHashConfig(rows=0)


def test_normalized_words() -> None:
    text = "Hello, World!  It's  a\tTEST--of\u00a0e-mail (co-op) 3.14"
    assert normalized_words(text) == [
        "hello", "world", "its", "a", "testof", "email", "coop", "314",
    ]  # fmt: skip


def test_ngram_hashes_match_distinct_ngrams(real_docs: list[str]) -> None:
    hashes, offsets = hash_word_ngrams(real_docs, 5)
    assert len(offsets) == len(real_docs) + 1
    for i, doc in enumerate(real_docs):
        words = normalized_words(doc)
        mine = hashes[offsets[i] : offsets[i + 1]]
        assert len(mine) == max(len(words) - 4, 1)
        # Equal n-grams hash equal and distinct ones distinct (no collisions on real text).
        assert len(set(mine.tolist())) == len(ngram_set(doc))


def test_hashes_do_not_depend_on_the_batch(real_docs: list[str]) -> None:
    alone, _ = hash_word_ngrams([real_docs[7]], 5)
    batch, offsets = hash_word_ngrams(real_docs[:20], 5)
    np.testing.assert_array_equal(alone, batch[offsets[7] : offsets[8]])


def test_short_and_empty_texts() -> None:
    hashes, offsets = hash_word_ngrams(["one two", "", "!!", "a b c d e f"], 5)
    assert np.diff(offsets).tolist() == [1, 1, 1, 2]
    assert hashes[1] == hashes[2]  # no words either way: the same single shingle
    assert hashes[0] != hashes[1]
    _, offsets = hash_word_ngrams(["one two", "", "a b c d e f"], 5, whole_if_short=False)
    assert np.diff(offsets).tolist() == [0, 0, 2]


text_chars = st.sampled_from(list("aZ09_ é'-,.!\t\n\x0b\x1c\u00a0\u2003\u2019\u201cΣσ日本\x00"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(text_chars, max_size=60), min_size=1, max_size=4))
def test_raw_text_hashes_like_its_normalized_words(texts: list[str]) -> None:
    # The ASCII fast path and the regular-expression path must see the same words.
    raw, raw_offsets = hash_word_ngrams(texts, 3)
    norm, norm_offsets = hash_word_ngrams([" ".join(normalized_words(t)) for t in texts], 3)
    np.testing.assert_array_equal(raw_offsets, norm_offsets)
    np.testing.assert_array_equal(raw, norm)


def reference_signature(hasher: MinHasher, shingles: np.ndarray) -> list[int]:
    """min over shingles of fold((a*x + b) mod 2^64), with Python integers."""
    out = []
    for a, b in zip(hasher.perm_a.tolist(), hasher.perm_b.tolist(), strict=True):
        best = None
        for x in shingles.tolist():
            y = (a * x + b) & ((1 << 64) - 1)
            y = (y & MERSENNE_61) + (y >> 61)
            best = y if best is None else min(best, y)
        out.append(best)
    return out


def test_signatures_match_python_reference(real_docs: list[str]) -> None:
    # A long document spans several permutation blocks; the short ones share blocks.
    cfg = MinHashConfig(bands=3, rows=2)
    hasher = MinHasher(cfg)
    texts = [" ".join(real_docs[:12]), *real_docs[12:16], "tiny", ""]
    sigs = hasher.signatures(texts)
    hashes, offsets = hash_word_ngrams(texts, cfg.ngram)
    assert offsets[1] > 1500  # more than one block of shingles
    assert sigs.shape == (len(texts), 6) and sigs.dtype == np.uint64
    for i in range(len(texts)):
        expected = reference_signature(hasher, hashes[offsets[i] : offsets[i + 1]])
        assert sigs[i].tolist() == expected


def test_permutation_parameters_in_range() -> None:
    hasher = MinHasher(MinHashConfig())
    assert len(hasher.perm_a) == 112 and len(set(hasher.perm_a.tolist())) == 112
    assert int(hasher.perm_a.min()) >= 1 and int(hasher.perm_a.max()) < MERSENNE_61
    assert int(hasher.perm_b.max()) < MERSENNE_61
    other = MinHasher(MinHashConfig(seed=2))
    assert not np.array_equal(hasher.perm_a, other.perm_a)


def mutate(words: list[str], rate: float, rng: np.random.Generator) -> str:
    """Replace a fraction of the words by fresh ones."""
    out = list(words)
    for i in rng.choice(len(out), size=round(rate * len(out)), replace=False):
        out[i] = f"zz{rng.integers(1_000_000)}"
    return " ".join(out)


def test_signature_agreement_estimates_jaccard(real_docs: list[str]) -> None:
    rng = np.random.default_rng(0)
    hasher = MinHasher(MinHashConfig())
    pairs = []
    for doc in real_docs[:120]:
        words = normalized_words(doc)
        if len(words) >= 60:
            pairs.append((doc, mutate(words, rng.uniform(0.0, 0.25), rng)))
    sigs_a = hasher.signatures([a for a, _ in pairs])
    sigs_b = hasher.signatures([b for _, b in pairs])
    estimate = (sigs_a == sigs_b).mean(axis=1)
    truth = np.array([jaccard(a, b) for a, b in pairs])
    assert truth.min() < 0.4 and truth.max() > 0.9  # the pairs cover the range
    sigma = np.sqrt(truth * (1 - truth) / 112)
    assert np.all(np.abs(estimate - truth) <= 4 * sigma + 1e-9)
    assert abs(float(np.mean(estimate - truth))) < 0.01  # unbiased


def test_band_keys_equal_exactly_when_band_rows_equal() -> None:
    hasher = MinHasher(MinHashConfig(bands=4, rows=2))
    sigs = np.arange(24, dtype=np.uint64).reshape(3, 8)
    sigs[1, 2:4] = sigs[0, 2:4]  # docs 0 and 1 agree on band 1 only
    sigs[2, 6] = sigs[0, 6]  # doc 2 agrees with doc 0 on half of band 3: not enough
    keys = hasher.band_keys(sigs)
    assert keys.shape == (3, 4) and keys.dtype == np.uint64
    assert (keys[0] == keys[1]).tolist() == [False, True, False, False]
    assert not (keys[0] == keys[2]).any()


def test_signatures_are_identical_in_another_process(real_docs: list[str]) -> None:
    texts = real_docs[:3]
    here = MinHasher(MinHashConfig()).signatures(texts)
    code = (
        "import json, sys\n"
        "from kiln.data.pipeline.dedup.minhash import MinHashConfig, MinHasher\n"
        "texts = json.load(sys.stdin)\n"
        "print(json.dumps(MinHasher(MinHashConfig()).signatures(texts).tolist()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONHASHSEED": "12345"},  # a different str hash salt
    )
    assert json.loads(out.stdout) == here.tolist()
    np.testing.assert_array_equal(MinHasher(MinHashConfig()).signatures(texts), here)
