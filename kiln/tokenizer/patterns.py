"""Named pre-tokenization split patterns and their resolution from a name or a custom regex."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import regex

from kiln.errors import KilnError

# The patterns as published with GPT-2 (encoder.py), GPT-4 (cl100k_base) and GPT-4o (o200k_base).
# tiktoken later rewrote some with possessive quantifiers and `\s++$`; the classic forms below are
# the ones HF tokenizers and most re-implementations use. They differ from the rewrites only for a
# whitespace run containing a newline at the very end of a text.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

CL100K_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NAMED_PATTERNS: dict[str, str] = {
    "gpt2": GPT2_PATTERN,
    "cl100k": CL100K_PATTERN,
    "o200k": O200K_PATTERN,
}


@dataclass(frozen=True)
class SplitPattern:
    """A pre-tokenization pattern: its name ("custom" for user regexes) and regex text."""

    name: str
    text: str

    @property
    def compiled(self) -> regex.Pattern[str]:
        """The compiled regex (cached per pattern text)."""
        return _compile(self.text)

    @property
    def is_builtin(self) -> bool:
        """Whether the native extension has a hand-written matcher for this pattern."""
        return NAMED_PATTERNS.get(self.name) == self.text


@lru_cache(maxsize=32)
def _compile(text: str) -> regex.Pattern[str]:
    return regex.compile(text)


def resolve_pattern(pattern: str | SplitPattern) -> SplitPattern:
    """Turn a pattern name (`gpt2`, `cl100k`, `o200k`) or a custom regex into a SplitPattern."""
    if isinstance(pattern, SplitPattern):
        return pattern
    if pattern in NAMED_PATTERNS:
        return SplitPattern(pattern, NAMED_PATTERNS[pattern])
    for name, text in NAMED_PATTERNS.items():
        if pattern == text:
            return SplitPattern(name, text)
    try:
        compiled = regex.compile(pattern)
    except regex.error as exc:
        raise KilnError(
            f"pattern {pattern!r} is neither a known name ({', '.join(NAMED_PATTERNS)}) "
            f"nor a valid regex: {exc}"
        ) from None
    if compiled.match("") is not None:
        raise KilnError(f"pattern {pattern!r} matches the empty string; it must consume text")
    return SplitPattern("custom", pattern)
