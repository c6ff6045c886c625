"""Count-based language models over token ids: the add-k bigram and interpolated Kneser–Ney.

Both are fitted on a stream of ids in one pass of numpy: an n-gram is one int64 key (its ids
as digits in base V), counts are `np.unique` over keys, and look-ups are binary searches in the
sorted keys. Scoring takes a matrix of contexts (N, n-1), the most recent token in the last
column and -1 where the context is shorter (the start of the stream, or of a scoring window), so
a count model scores the same targets with the same left context a neural model would.

Kneser–Ney follows NLTK's `KneserNeyInterpolated` definition (the test compares the two), with
one addition: with `uniform_floor` the unigram level is itself discounted and interpolated with
the uniform distribution (Chen & Goodman 1998), so a token never seen as a continuation keeps a
non-zero probability and bits-per-byte stays finite. For a context h (of k-1 tokens) and token w:

    p_k(w | h) = max(N_k(hw) − d, 0) / Σ_v N_k(hv) + d · |{v : c(hv) > 0}| / Σ_v N_k(hv) · p_{k-1}(w | h')

with N_n the raw counts at the highest order and, below it, the continuation counts
N_k(hw) = |{x : c(x h w) > 0}|; a context never seen falls through to the order below.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.errors import KilnError

NO_TOKEN = -1  # a context slot before the stream (or the scoring window) starts


def ngram_keys(ids: np.ndarray, n: int, vocab: int) -> np.ndarray:
    """int64 key of every n-gram ids[i : i+n] (ids as base-`vocab` digits, the first highest)."""
    if vocab**n >= 2**63:
        raise KilnError(f"{n}-grams over a {vocab}-token vocabulary overflow an int64 key")
    ids = np.asarray(ids, dtype=np.int64)
    keys = np.zeros(len(ids) - n + 1, dtype=np.int64)
    for j in range(n):
        keys = keys * vocab + ids[j : len(ids) - n + 1 + j]
    return keys


@dataclass(frozen=True)
class Table:
    """A sorted key -> count map; absent keys count 0."""

    keys: np.ndarray
    counts: np.ndarray

    @classmethod
    def of(cls, keys: np.ndarray) -> Table:
        """How often each distinct key occurs."""
        unique, counts = np.unique(keys, return_counts=True)
        return cls(unique, counts.astype(np.float64))

    @classmethod
    def summed(cls, keys: np.ndarray, weights: np.ndarray) -> Table:
        """The sum of `weights` per distinct key."""
        unique, inverse = np.unique(keys, return_inverse=True)
        return cls(unique, np.bincount(inverse, weights=weights, minlength=len(unique)))

    def get(self, query: np.ndarray) -> np.ndarray:
        """Counts of the query keys (0 for keys not in the table)."""
        if len(self.keys) == 0:
            return np.zeros(len(query))
        pos = np.minimum(np.searchsorted(self.keys, query), len(self.keys) - 1)
        return np.where(self.keys[pos] == query, self.counts[pos], 0.0)


def _context_keys(contexts: np.ndarray, length: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys of the last `length` context tokens, whether all of them exist) per row."""
    n_ctx = contexts.shape[1]
    part = contexts[:, n_ctx - length :].astype(np.int64)
    present = (part >= 0).all(axis=1) if length else np.ones(len(contexts), dtype=bool)
    keys = np.zeros(len(contexts), dtype=np.int64)
    for j in range(length):
        keys = keys * vocab + np.maximum(part[:, j], 0)
    return keys, present


class AddKBigram:
    """p(w | v) = (c(vw) + k) / (c(v·) + k·V): Laplace's rule with a pseudo-count k."""

    order = 2

    def __init__(self, vocab: int, k: float = 0.1) -> None:
        if k <= 0:
            raise KilnError(f"add-k smoothing needs k > 0, got {k}")
        self.vocab, self.k = vocab, k
        self.pairs = self.firsts = Table.of(np.zeros(0, dtype=np.int64))

    def fit(self, ids: np.ndarray) -> AddKBigram:
        """Count the stream's adjacent pairs."""
        keys = ngram_keys(ids, 2, self.vocab)
        self.pairs, self.firsts = Table.of(keys), Table.of(keys // self.vocab)
        return self

    def logprob(self, contexts: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """ln p(target | last context token) per row; a row without context gets the uniform."""
        prev, present = _context_keys(contexts, 1, self.vocab)
        num = self.pairs.get(prev * self.vocab + targets) + self.k
        den = self.firsts.get(prev) + self.k * self.vocab
        return np.where(present, np.log(num / den), -np.log(self.vocab))


@dataclass(frozen=True)
class _Level:
    """One order's tables: numerators by k-gram, their sum and the raw follower types by context."""

    num: Table
    den: Table
    types: Table


class KneserNey:
    """Interpolated Kneser–Ney of `order` with one absolute discount (see the module docstring)."""

    def __init__(
        self, vocab: int, order: int = 4, discount: float = 0.75, uniform_floor: bool = True
    ) -> None:
        if order < 2:
            raise KilnError(f"a Kneser–Ney model needs order >= 2, got {order}")
        if not 0 < discount < 1:
            raise KilnError(f"the Kneser–Ney discount must be in (0, 1), got {discount}")
        self.vocab, self.order, self.discount = vocab, order, discount
        self.uniform_floor = uniform_floor
        self.levels: dict[int, _Level] = {}
        self.continuations = np.zeros(vocab)  # distinct left neighbours of each token

    def fit(self, ids: np.ndarray) -> KneserNey:
        """Count every order's n-grams of the stream and derive the continuation counts."""
        V = self.vocab
        raw = {
            k: np.unique(ngram_keys(ids, k, V), return_counts=True)
            for k in range(2, self.order + 1)
        }
        for k in range(2, self.order + 1):
            keys, counts = raw[k]
            if k < self.order:  # N(hw) = distinct left extensions x·hw among the (k+1)-grams
                num = Table.of(raw[k + 1][0] % V**k)
            else:
                num = Table(keys, counts.astype(np.float64))
            den = Table.summed(num.keys // V, num.counts)
            self.levels[k] = _Level(num, den, Table.of(keys // V))
        cont = Table.of(raw[2][0] % V)
        self.continuations = np.zeros(V)
        self.continuations[cont.keys] = cont.counts
        return self

    def unigram(self) -> np.ndarray:
        """p_1(w) = N(·w) / N(··), discounted towards the uniform with `uniform_floor`."""
        cont, d = self.continuations, self.discount
        total = max(cont.sum(), 1.0)
        if not self.uniform_floor:
            return cont / total
        return (np.maximum(cont - d, 0) + d * np.count_nonzero(cont) / self.vocab) / total

    def logprob(self, contexts: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """ln p(target | context) per row (contexts (N, order-1), NO_TOKEN where shorter)."""
        if contexts.shape[1] != self.order - 1:
            raise KilnError(f"contexts have {contexts.shape[1]} columns, expected {self.order - 1}")
        targets = np.asarray(targets, dtype=np.int64)
        p = self.unigram()[targets]
        for k in range(2, self.order + 1):
            level = self.levels[k]
            h, present = _context_keys(contexts, k - 1, self.vocab)
            den = level.den.get(h)
            seen = present & (level.types.get(h) > 0) & (den > 0)
            den = np.where(seen, den, 1.0)
            alpha = np.maximum(level.num.get(h * self.vocab + targets) - self.discount, 0) / den
            gamma = self.discount * level.types.get(h) / den
            p = np.where(seen, alpha + gamma * p, p)
        with np.errstate(divide="ignore"):
            return np.log(p)


def window_contexts(
    ids: np.ndarray, n_ctx: int, windows: list[tuple[int, int, int]]
) -> tuple[np.ndarray, np.ndarray]:
    """(contexts (N, n_ctx), targets (N,)) of the targets `windows` score, in their order.

    Each window (lo, hi, n_scored) of `kiln.eval.scoring.rolling_windows` predicts its last
    n_scored tokens from tokens[lo:] only, so a context never reaches before its window's lo.
    """
    ids = np.asarray(ids, dtype=np.int64)
    pos = np.concatenate([np.arange(hi - n, hi) for _, hi, n in windows])  # target positions
    lo = np.concatenate([np.full(n, lo) for lo, _, n in windows])
    contexts = np.full((len(pos), n_ctx), NO_TOKEN, dtype=np.int64)
    for j in range(n_ctx):  # column n_ctx-1-j holds the token j+1 places back
        back = pos - (j + 1)
        contexts[:, n_ctx - 1 - j] = np.where(back >= lo, ids[np.maximum(back, 0)], NO_TOKEN)
    return contexts, ids[pos]
