"""Reference BPE merge loop in pure Python: the readable spec the native engine must equal.

Semantics (DESIGN.md): the most frequent adjacent pair, weighted by pre-token counts, is merged at
each step; ties go to the lexicographically greatest pair of byte strings (first, then second).
If a merge produces bytes that already name a token, that token's id is reused (as HF does).
Pair counts are updated incrementally through an index from pair to the words holding it and a
lazy max-heap: a pair's count only falls after it is pushed, except for pairs with the new token,
which are pushed once their count is final at the end of the step.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict

Pair = tuple[int, int]


class _HeapItem:
    """Heap entry ordered so that heapq's min is the highest count, then greatest byte pair."""

    __slots__ = ("count", "key", "pair")

    def __init__(self, count: int, key: tuple[bytes, bytes], pair: Pair) -> None:
        self.count, self.key, self.pair = count, key, pair

    def __lt__(self, other: _HeapItem) -> bool:
        if self.count != other.count:
            return self.count > other.count
        return self.key > other.key


class ReferenceMergeEngine:
    """Learns merges over a fixed set of (word, count) pre-tokens; ids < 256 are the bytes."""

    def __init__(self, words: list[bytes], counts: list[int]) -> None:
        self.vocab: list[bytes] = [bytes([i]) for i in range(256)]
        self._id_of: dict[bytes, int] = {b: i for i, b in enumerate(self.vocab)}
        self.words: list[list[int]] = [list(w) for w in words]
        self.counts = list(counts)
        self.pair_counts: dict[Pair, int] = defaultdict(int)
        self.where: dict[Pair, set[int]] = defaultdict(set)
        for wi, word in enumerate(self.words):
            for pair in itertools.pairwise(word):
                self.pair_counts[pair] += self.counts[wi]
                self.where[pair].add(wi)
        self.heap = [self._item(p) for p, c in self.pair_counts.items() if c > 0]
        heapq.heapify(self.heap)

    @property
    def vocab_size(self) -> int:
        """Number of distinct tokens so far (256 bytes plus merged tokens)."""
        return len(self.vocab)

    def token(self, token_id: int) -> bytes:
        """The bytes of a token id."""
        return self.vocab[token_id]

    def _item(self, pair: Pair) -> _HeapItem:
        return _HeapItem(self.pair_counts[pair], (self.vocab[pair[0]], self.vocab[pair[1]]), pair)

    def _best_pair(self) -> Pair | None:
        while self.heap:
            top = heapq.heappop(self.heap)
            current = self.pair_counts.get(top.pair, 0)
            if current == top.count:
                return top.pair
            if current > 0:
                heapq.heappush(self.heap, self._item(top.pair))
        return None

    def apply(self, a: int, b: int) -> int:
        """Merge the pair (a, b) everywhere; return the id of the merged token."""
        pair = (a, b)
        merged = self.vocab[pair[0]] + self.vocab[pair[1]]
        new_id = self._id_of.get(merged)
        if new_id is None:
            new_id = len(self.vocab)
            self.vocab.append(merged)
            self._id_of[merged] = new_id
        touched: set[Pair] = set()
        for wi in sorted(self.where.pop(pair, ())):
            word, count = self.words[wi], self.counts[wi]
            new_word: list[int] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
                    new_word.append(new_id)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            if len(new_word) == len(word):
                continue
            for old in itertools.pairwise(word):
                self.pair_counts[old] -= count
            for new in itertools.pairwise(new_word):
                self.pair_counts[new] += count
                self.where[new].add(wi)
                if new_id in new:
                    touched.add(new)
            self.words[wi] = new_word
        self.pair_counts.pop(pair, None)
        for p in touched:
            if self.pair_counts[p] > 0:
                heapq.heappush(self.heap, self._item(p))
        return new_id

    def step(self, max_merges: int, max_vocab: int) -> list[Pair]:
        """Learn up to `max_merges` merges, stopping when the vocab reaches `max_vocab` tokens."""
        done: list[Pair] = []
        while len(done) < max_merges and len(self.vocab) < max_vocab:
            pair = self._best_pair()
            if pair is None:
                break
            self.apply(*pair)
            done.append(pair)
        return done
