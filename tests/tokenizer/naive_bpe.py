"""An obviously-correct BPE trainer for tests: recount every pair at every step."""

from __future__ import annotations

import itertools
from collections import Counter

import regex


def naive_train(
    text: str, vocab_size: int, specials: list[str], pattern: str
) -> list[tuple[bytes, bytes]]:
    """Merges (as byte pairs) learned from `text`, DESIGN.md semantics, no cleverness."""
    pieces = [text]
    if specials:
        alternation = "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True))
        pieces = regex.split(alternation, text)
    counts: Counter[bytes] = Counter()
    for piece in pieces:
        counts.update(m.encode("utf-8") for m in regex.findall(pattern, piece))
    words = {tuple(bytes([b]) for b in w): c for w, c in counts.items()}
    vocab = {bytes([i]) for i in range(256)}
    merges: list[tuple[bytes, bytes]] = []
    while len(vocab) < vocab_size - len(specials):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, c in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        vocab.add(best[0] + best[1])
        new_words: dict[tuple[bytes, ...], int] = {}
        for word, c in words.items():
            out: list[bytes] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words
    return merges
