"""MinHash signatures of word n-grams, computed for many documents per NumPy call.

Words: the text is lowercased, every character that is neither a word character (`\\w`) nor
whitespace is deleted, and what remains is split on whitespace — GPT-3's definition of a word
("lowercase, whitespace delimited, no punctuation"), shared with decontamination.

Hashes (all uint64, wrapping arithmetic, identical in every process and on every machine):
- a word: a polynomial hash of its UTF-8 bytes (base `_BYTE_BASE`, taken from prefix sums over
  the whole batch, so one pass over the bytes serves every word), then the SplitMix64 finaliser;
- a shingle (n consecutive words): a weighted sum of its word hashes with a distinct odd weight
  per position, then the finaliser. A document with fewer than `ngram` words is one shingle made
  of all its words (an empty document: the shingle of no words);
- permutation i: `h_i(x) = fold((a_i * x + b_i) mod 2^64)` with `fold(y) = (y & p) + (y >> 61)`,
  p = 2^61 - 1: the same family as datasketch and datatrove, whose `% p` becomes two bit
  operations (`fold(y)` is congruent to y mod p and lies in [0, p + 7]);
- `a_i`, `b_i` come from BLAKE2b of (seed, i), not from a NumPy generator, so signatures do not
  change with the NumPy version.
A signature is, per permutation, the minimum over the document's shingles.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kiln.config import ConfigError

MERSENNE_61 = (1 << 61) - 1
_BYTE_BASE = 0x100000001B3  # the FNV-1 64-bit prime: odd, so invertible modulo 2^64
_BYTE_BASE_INV = pow(_BYTE_BASE, -1, 1 << 64)
_NGRAM_SALT = 0x9E3779B97F4A7C15  # keeps the shingle of an empty document away from zero
_PUNCTUATION = re.compile(r"[^\w\s]+")
_NONSPACE = re.compile(r"\S+")
# Bytes that separate words: ASCII whitespace as str.split() sees it (\t\n\v\f\r, \x1c-\x1f,
# space) and NUL, which separates the texts of a batch.
_SEPARATOR = np.zeros(256, dtype=bool)
_SEPARATOR[[0, 9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True
_SEPARATOR.flags.writeable = False
# Bytes that survive normalisation: ASCII word characters and separators, and every byte of a
# multi-byte UTF-8 character (non-ASCII punctuation is removed by `_PUNCTUATION` beforehand).
_KEPT = _SEPARATOR.copy()
_KEPT[128:] = True
_KEPT[[ord(ch) for ch in map(chr, range(128)) if ch.isalnum() or ch == "_"]] = True
_KEPT.flags.writeable = False
# Shingles per permutation block: (num_perm, block) uint64 stays in the L2 cache.
_BLOCK = 1024
_DOCS_PER_BATCH = 256


@dataclass(frozen=True)
class MinHashConfig:
    """MinHash-LSH parameters; defaults are FineWeb's (word 5-grams, 14 bands x 8 rows)."""

    enabled: bool = True
    ngram: int = 5
    bands: int = 14
    rows: int = 8
    seed: int = 1
    # Candidate pairs below this exact Jaccard of their shingle sets are not merged (`verify`,
    # NeMo-Curator's fuzzy dedup); 0 merges every LSH candidate, as FineWeb does.
    jaccard_threshold: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ngram", "bands", "rows"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"minhash.{name}: expected an integer >= 1, got {value}")
        if not 0.0 <= self.jaccard_threshold <= 1.0:
            raise ConfigError(
                f"dedup.near.jaccard_threshold = {self.jaccard_threshold}: expected a Jaccard "
                f"similarity in [0, 1] (0: no verification)"
            )

    @property
    def num_perm(self) -> int:
        """Permutations per signature (bands x rows)."""
        return self.bands * self.rows

    @property
    def threshold(self) -> float:
        """The Jaccard similarity where the LSH S-curve is steepest, about (1/bands)^(1/rows)."""
        return (1.0 / self.bands) ** (1.0 / self.rows)

    def catch_probability(self, jaccard: float) -> float:
        """Probability that two documents with this Jaccard similarity share at least one band."""
        return 1.0 - (1.0 - jaccard**self.rows) ** self.bands


def normalized_words(text: str) -> list[str]:
    """The words MinHash and decontamination see: lowercased, punctuation deleted."""
    return _PUNCTUATION.sub("", text.lower()).split()


def normalized_word_spans(text: str) -> list[tuple[str, int, int]]:
    """`normalized_words(text)`, each with the [start, end) of its characters in `text`."""
    spans = []
    for match in _NONSPACE.finditer(text):
        word = _PUNCTUATION.sub("", match.group().lower())
        if word:
            spans.append((word, match.start(), match.end()))
    return spans


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, in place on a uint64 array: every input bit reaches every output."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def _position_weights(n: int) -> np.ndarray:
    """Odd 64-bit weights, one per position in an n-gram (so word order matters)."""
    out = [
        int.from_bytes(hashlib.blake2b(f"kiln-ngram-weight:{k}".encode(), digest_size=8).digest())
        | 1
        for k in range(n)
    ]
    return np.array(out, dtype=np.uint64)


def _batch_bytes(texts: Sequence[str]) -> np.ndarray:
    """The batch's lowercased texts as UTF-8 bytes with punctuation deleted, NUL-separated.

    ASCII texts (most of them) skip the regular expression: their punctuation bytes are deleted
    here by a table lookup. Other texts go through `normalized_words`' regular expression and
    have their (possibly Unicode) whitespace runs rewritten as single spaces, so that only ASCII
    bytes separate words in the result.
    """
    parts = []
    for text in texts:
        lowered = text.lower()
        if lowered.isascii():
            parts.append(lowered.replace("\0", "") if "\0" in lowered else lowered)
        else:
            parts.append(" ".join(_PUNCTUATION.sub("", lowered).split()))
    data = np.frombuffer("\0".join(parts).encode("utf-8"), dtype=np.uint8)
    return data[_KEPT[data]]


def _word_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Hash every normalised word of every text: (hashes (total_words,), counts (n_texts,))."""
    c = _batch_bytes(texts)  # (L,)
    edge = np.ones(len(c) + 2, dtype=bool)  # separator flags, with one at each end
    edge[1:-1] = _SEPARATOR[c]
    inside = ~edge[1:-1]
    starts = np.flatnonzero(edge[:-2] & inside)  # (W,) first byte of each word
    ends = np.flatnonzero(inside & edge[2:]) + 1  # (W,) one past its last byte
    doc_of_word = np.searchsorted(np.flatnonzero(c == 0), starts)  # NULs before the word
    counts = np.bincount(doc_of_word, minlength=len(texts)).astype(np.int64)
    if len(starts) == 0:
        return np.zeros(0, dtype=np.uint64), counts
    # prefix[j] = sum_{i<j} c_i B^i; the word [s, e) hashes to (prefix[e] - prefix[s]) * B^-s,
    # i.e. sum c_i B^(i-s): the same value wherever the word sits in the batch.
    prefix = np.zeros(len(c) + 1, dtype=np.uint64)
    np.cumsum(c * _powers(_BYTE_BASE, len(c)), out=prefix[1:])
    inverse = _powers(_BYTE_BASE_INV, len(c))[starts]  # (W,) B^-s
    words = (prefix[ends] - prefix[starts]) * inverse
    words += (ends - starts).astype(np.uint64) * np.uint64(_NGRAM_SALT)  # mix in the length
    return mix64(words), counts


def _powers(base: int, length: int) -> np.ndarray:
    """[base^0, base^1, ..., base^(length-1)] modulo 2^64 (uint64 products wrap)."""
    out = np.empty(max(length, 1), dtype=np.uint64)
    out[0] = 1
    filled = 1
    # Doubling: out[k:2k] = out[:k] * base^k, a few vectorised products instead of a serial scan.
    while filled < length:
        step = min(filled, length - filled)
        np.multiply(
            out[:step], np.uint64(pow(base, filled, 1 << 64)), out=out[filled : filled + step]
        )
        filled += step
    return out[:length]


def hash_word_ngrams(
    texts: Sequence[str], n: int, *, whole_if_short: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of the word n-grams of every text: (hashes (total,), offsets (len(texts) + 1,)).

    Text i's n-gram hashes are `hashes[offsets[i]:offsets[i + 1]]`, in text order; its words
    are `normalized_words(texts[i])`, so a text and `" ".join(normalized_words(text))` hash
    alike. With `whole_if_short`, a text with fewer than n words has one hash, of all its words
    (an empty text: the one hash of no words); otherwise it has none.
    """
    words, counts = _word_hashes(texts)
    n_docs = len(counts)
    # Lay the words out with n zero slots after each document: a window starting in one
    # document never reads the next one, and a short (even empty) document's window sums only
    # its own words.
    doc_of_word = np.repeat(np.arange(n_docs, dtype=np.int64), counts)
    padded = np.zeros(len(words) + n_docs * n, dtype=np.uint64)
    padded[np.arange(len(words), dtype=np.int64) + n * doc_of_word] = words
    n_windows = len(padded) - n + 1
    grams = np.full(max(n_windows, 0), np.uint64(_NGRAM_SALT), dtype=np.uint64)
    for k, weight in enumerate(_position_weights(n)):
        grams += padded[k : k + n_windows] * weight
    mix64(grams)
    word_offsets = np.zeros(n_docs, dtype=np.int64)
    np.cumsum(counts[:-1], out=word_offsets[1:])
    first_window = word_offsets + n * np.arange(n_docs, dtype=np.int64)
    per_doc = np.maximum(counts - n + 1, 1 if whole_if_short else 0)
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(per_doc, out=offsets[1:])
    take = np.arange(offsets[-1], dtype=np.int64) + np.repeat(first_window - offsets[:-1], per_doc)
    return grams[take], offsets


class MinHasher:
    """Computes MinHash signatures and LSH band keys for batches of documents."""

    def __init__(self, config: MinHashConfig) -> None:
        self.config = config
        a, b = [], []
        for i in range(config.num_perm):
            digest = hashlib.blake2b(f"kiln-minhash:{config.seed}:{i}".encode(), digest_size=16)
            value = digest.digest()
            a.append(int.from_bytes(value[:8]) % (MERSENNE_61 - 1) + 1)  # [1, p)
            b.append(int.from_bytes(value[8:]) % MERSENNE_61)  # [0, p)
        self.perm_a = np.array(a, dtype=np.uint64)  # (P,)
        self.perm_b = np.array(b, dtype=np.uint64)  # (P,)
        self._band_weights = _position_weights(config.rows)  # (R,)

    def signatures(
        self, texts: Sequence[str], shingles_out: list[np.ndarray] | None = None
    ) -> np.ndarray:
        """MinHash signatures, (n, bands * rows) uint64, one row per text.

        With `shingles_out`, each batch's (shingle hashes, offsets) are appended to it.
        """
        sigs = np.empty((len(texts), self.config.num_perm), dtype=np.uint64)
        # Batches of a few hundred documents keep the per-byte arrays in cache.
        for lo in range(0, len(texts), _DOCS_PER_BATCH):
            batch = texts[lo : lo + _DOCS_PER_BATCH]
            shingles, offsets = hash_word_ngrams(batch, self.config.ngram)
            sigs[lo : lo + len(batch)] = self.signatures_of_shingles(shingles, offsets)
            if shingles_out is not None:
                shingles_out.extend((shingles, offsets))
        return sigs

    def signatures_of_shingles(self, shingles: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Signatures from shingle hashes grouped by `offsets` (each document has >= 1 shingle)."""
        n_docs = len(offsets) - 1
        num_perm = self.config.num_perm
        sigs = np.full((n_docs, num_perm), np.iinfo(np.uint64).max, dtype=np.uint64)
        if n_docs == 0:
            return sigs
        if np.any(offsets[1:] <= offsets[:-1]):
            raise ValueError("every document needs at least one shingle")
        block = np.empty((num_perm, _BLOCK), dtype=np.uint64)
        high = np.empty_like(block)
        a = self.perm_a[:, None]  # (P, 1)
        b = self.perm_b[:, None]  # (P, 1)
        p = np.uint64(MERSENNE_61)
        total = int(offsets[-1])
        for lo in range(0, total, _BLOCK):
            hi = min(lo + _BLOCK, total)
            y, top = block[:, : hi - lo], high[:, : hi - lo]  # (P, S)
            np.multiply(shingles[lo:hi], a, out=y)
            y += b
            np.right_shift(y, np.uint64(61), out=top)
            y &= p
            y += top
            # Documents overlapping [lo, hi): a segment per document, each reduced by min.
            first = int(np.searchsorted(offsets, lo, side="right")) - 1
            last = int(np.searchsorted(offsets, hi, side="left"))  # exclusive
            starts = np.maximum(offsets[first:last], lo) - lo
            partial = np.minimum.reduceat(y, starts, axis=1)  # (P, docs)
            rows = sigs[first:last]  # a view: updated in place
            np.minimum(rows, partial.T, out=rows)
        return sigs

    def band_keys(self, sigs: np.ndarray) -> np.ndarray:
        """One uint64 key per band, (n, bands): equal keys <=> equal rows (up to 2^-64 chance)."""
        bands, rows = self.config.bands, self.config.rows
        if sigs.ndim != 2 or sigs.shape[1] != bands * rows:
            raise ValueError(f"expected signatures of shape (n, {bands * rows}), got {sigs.shape}")
        grouped = sigs.reshape(len(sigs), bands, rows)  # (n, B, R)
        keys = np.full((len(sigs), bands), np.uint64(_NGRAM_SALT), dtype=np.uint64)
        for r, weight in enumerate(self._band_weights):
            keys += grouped[:, :, r] * weight
        return mix64(keys)
