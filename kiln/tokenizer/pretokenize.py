"""Reference pre-tokenization: split on special tokens, then by the pattern, then count."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
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
    yield from split_on_specials_with(pattern, text)


def split_on_specials_with(pattern: regex.Pattern[str], text: str) -> Iterator[tuple[str, bool]]:
    """`split_on_specials` with the special-token regex already built."""
    pos = 0
    for match in pattern.finditer(text):
        if match.start() > pos:
            yield text[pos : match.start()], False
        yield match.group(), True
        pos = match.end()
    if pos < len(text):
        yield text[pos:], False


def to_utf8(text: str) -> bytes:
    """UTF-8 bytes of `text`; lone surrogates become U+FFFD (as tiktoken does)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")


def iter_pretokens(text: str, pattern: SplitPattern) -> Iterator[str]:
    """Yield the pre-tokens of an ordinary (special-free) text.

    Text a custom pattern does not match is kept as pre-tokens of its own (like HF's `Split`
    with `isolated` behaviour) rather than dropped; empty matches are skipped. The built-in
    patterns match every character, so for them this is exactly `findall`.
    """
    pos = 0
    for match in pattern.compiled.finditer(text):
        start, end = match.span()
        if start > pos:
            yield text[pos:start]
        if end > start:
            yield match.group()
        pos = max(pos, end)
    if pos < len(text):
        yield text[pos:]


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
