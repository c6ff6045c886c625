"""Reference pre-tokenization: split on special tokens, then by the pattern, then count."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache

import regex

from kiln.tokenizer.patterns import SplitPattern


@lru_cache(maxsize=64)
def special_regex(specials: tuple[str, ...]) -> regex.Pattern[str] | None:
    """A regex matching any of `specials`, longest first so overlapping tokens resolve greedily."""
    if not specials:
        return None
    ordered = sorted(set(specials), key=lambda s: (-len(s), s))
    return regex.compile("|".join(regex.escape(s) for s in ordered))


def split_on_specials(text: str, specials: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """Yield (segment, is_special) pieces of `text`; empty ordinary segments are skipped."""
    pattern = special_regex(tuple(sorted(specials)))
    if pattern is None:
        if text:
            yield text, False
        return
    pos = 0
    for match in pattern.finditer(text):
        if match.start() > pos:
            yield text[pos : match.start()], False
        yield match.group(), True
        pos = match.end()
    if pos < len(text):
        yield text[pos:], False


_CUT_BEFORE = frozenset("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_CUT_AFTER = frozenset(chr(c) for c in range(0x21, 0x7F))


def last_safe_cut(text: str, specials: Sequence[str], newline_ok: bool) -> int:
    """The last index > 0 where `text` can be cut without changing its pre-tokens, else -1.

    A cut is safe just before a special token (the pattern never runs across one) and, for the
    built-in patterns, in `X\nA` between the newline and A, where X is printable non-space ASCII
    and A an ASCII letter or digit: the newline is then a whole pre-token (or ends one, as in
    cl100k's `.\n`) whatever follows, and A always starts one. Without X, a preceding whitespace
    run would give its last character to the next pre-token (`\\s+(?!\\S)`).
    """
    best = max((text.rfind(s) for s in specials), default=-1)
    if newline_ok:
        pos = len(text) - 1
        while pos > best:
            nl = text.rfind("\n", 0, pos)
            if nl < 1 or nl + 1 <= best:
                break
            if text[nl + 1] in _CUT_BEFORE and text[nl - 1] in _CUT_AFTER:
                best = nl + 1
                break
            pos = nl
    return best if best > 0 else -1


def iter_pretokens(text: str, pattern: SplitPattern) -> Iterator[str]:
    """Yield the pre-tokens of an ordinary (special-free) text."""
    for match in pattern.compiled.finditer(text):
        yield match.group()


def count_pretokens(
    texts: Iterable[str], pattern: SplitPattern, specials: Iterable[str] = ()
) -> Counter[bytes]:
    """Count the UTF-8 pre-tokens of `texts`; special tokens split the text and are not counted."""
    specials = tuple(specials)
    counts: Counter[bytes] = Counter()
    for text in texts:
        for segment, is_special in split_on_specials(text, specials):
            if not is_special:
                counts.update(p.encode("utf-8") for p in iter_pretokens(segment, pattern))
    return counts
