"""Gopher quality and repetition rules (Rae et al. 2021, "Scaling Language Models", App. A).

Thresholds are those of MassiveText (App. A.1.1 and Table A1) and datatrove's
GopherQualityFilter / GopherRepetitionFilter. Words come from a regex split that imitates the
word tokenizers datatrove uses (spaCy, NLTK) at a fraction of their cost: a word is a run of
letters and digits, or a number with decimal separators ("11.143", "1,000"); a leading apostrophe
stays on a word when a letter follows it ("don't" gives "don" and "'t", as NLTK gives "do" and
"n't"). A symbol is one punctuation character, or a run of dots, hyphens or underscores
("...", "--"). Tokens are words and symbols in text order; like datatrove, the quality ratios
and the repetition n-grams count both. docs/data_pipeline_quality.md lists every rule and where
kiln differs from datatrove.
"""

from __future__ import annotations

import heapq
import operator
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import compress

from kiln.data.pipeline.document import Document
from kiln.errors import KilnError

DECIMAL_RE = re.compile(r"\d+(?:[.,]\d+)+")
WORD_RE = re.compile(rf"{DECIMAL_RE.pattern}|['’](?=[^\W\d_])[^\W_]+|[^\W_]+")
SYMBOL_RE = re.compile(r"\.{2,}|-{2,}|_+|['’](?![^\W\d_])|[^\w\s'’]")
TOKEN_RE = re.compile(f"{WORD_RE.pattern}|{SYMBOL_RE.pattern}")
PARAGRAPH_SPLIT_RE = re.compile(r"\n{2,}")

STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")


def split_tokens(text: str) -> list[str]:
    """The words and symbols of `text` in order (the unit of Gopher's n-grams)."""
    tokens: list[str] = []
    for part in text.split():
        # Most whitespace-separated parts are one plain word: skip the regex for them.
        if part.isalnum():
            tokens.append(part)
        else:
            tokens.extend(TOKEN_RE.findall(part))
    return tokens


def count_words(text: str) -> tuple[list[str], int, int]:
    """(the words of `text`, how many symbols it has, how many of the words have no letter).

    The words come plain ones first, not in text order. The same words and counts as the regexes
    over the whole text, at a third of the cost: parts that are one plain word are taken as they
    are, and only the rest (about a quarter of English text) goes through the regexes.
    `str.split` and the regexes' `\\s` agree on what whitespace is, so no match can straddle
    two parts.
    """
    parts = text.split()
    plain = list(map(str.isalnum, parts))
    words = list(compress(parts, plain))
    n_numbers = sum(map(str.isnumeric, words))
    if len(words) == len(parts):
        return words, 0, n_numbers
    rest = " ".join(compress(parts, map(operator.not_, plain)))
    rest_tokens = TOKEN_RE.findall(rest)
    rest_words = [t for t in rest_tokens if t[-1].isalnum()]  # a symbol never ends so
    # Numbers: all-digit words and decimals, the only words with a "." or ",".
    n_numbers += sum(map(str.isnumeric, rest_words))
    n_numbers += sum(1 for w in rest_words if "." in w or "," in w)
    return words + rest_words, len(rest_tokens) - len(rest_words), n_numbers


def count_tokens(text: str) -> int:
    """How many words and symbols `text` has (len(split_tokens(text)), without the list)."""
    parts = text.split()
    plain = list(map(str.isalnum, parts))
    n_plain = sum(plain)
    if n_plain == len(parts):
        return n_plain
    return n_plain + len(TOKEN_RE.findall(" ".join(compress(parts, map(operator.not_, plain)))))


def _check_fraction(where: str, name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise KilnError(f"[{where}] {name} = {value}: expected a fraction in [0, 1]")


# ------------------------------------------------------------------------------- quality
@dataclass(frozen=True)
class GopherQualityConfig:
    """MassiveText quality rules (Rae et al. 2021, App. A.1.1); defaults as published."""

    enabled: bool = True
    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_hash_ratio: float = 0.1  # '#' per token
    max_ellipsis_ratio: float = 0.1  # '...' or '…' per token
    bullets: tuple[str, ...] = ("•", "-")  # a line starting with one of these is a bullet line
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    min_alpha_words_ratio: float = 0.8  # words with at least one letter, over all words
    stop_words: tuple[str, ...] = STOP_WORDS
    min_stop_words: int = 2  # distinct stop words present (case-sensitive, as datatrove)

    def __post_init__(self) -> None:
        where = "quality.gopher_quality"
        if not 0 <= self.min_words <= self.max_words:
            raise KilnError(
                f"[{where}] min_words = {self.min_words}, max_words = {self.max_words}: "
                "expected 0 <= min_words <= max_words"
            )
        if not 0.0 <= self.min_mean_word_length <= self.max_mean_word_length:
            raise KilnError(
                f"[{where}] min_mean_word_length = {self.min_mean_word_length}, "
                f"max_mean_word_length = {self.max_mean_word_length}: expected 0 <= min <= max"
            )
        for name in ("max_bullet_lines_ratio", "max_ellipsis_lines_ratio", "min_alpha_words_ratio"):
            _check_fraction(where, name, getattr(self, name))
        for name in ("max_hash_ratio", "max_ellipsis_ratio"):
            if getattr(self, name) < 0:
                raise KilnError(f"[{where}] {name} = {getattr(self, name)}: expected >= 0")
        if any(not b for b in self.bullets):
            raise KilnError(f"[{where}] bullets: expected non-empty strings, got {self.bullets}")
        if self.min_stop_words > len(set(self.stop_words)):
            raise KilnError(
                f"[{where}] min_stop_words = {self.min_stop_words}: expected at most the "
                f"{len(set(self.stop_words))} distinct stop_words"
            )


class GopherQuality:
    """Removes documents failing a MassiveText quality rule; the reason names the rule."""

    name = "gopher_quality"

    def __init__(self, config: GopherQualityConfig) -> None:
        self.config = config
        self._stop_words = frozenset(config.stop_words)
        # With no bullets the pattern is (?!), which never matches.
        bullets = "|".join(re.escape(b) for b in config.bullets) or r"(?!)"
        # Counted over the whole text at C speed instead of looping over lines in Python;
        # `[^\S\n]` is whitespace other than the newline, so a match stays inside one line.
        self._bullet_line_re = re.compile(rf"^[^\S\n]*(?:{bullets})", re.MULTILINE)
        self._ellipsis_line_re = re.compile(r"(?:\.\.\.|…)[^\S\n]*$", re.MULTILINE)

    def apply(self, doc: Document) -> str | None:
        """Keep `doc` (None) or return `gopher_quality.<rule>` for the first rule it fails."""
        c = self.config
        text = doc.text
        words, n_symbols, n_numbers = count_words(text)
        n_words = len(words)
        if not c.min_words <= n_words <= c.max_words:
            return "gopher_quality.word_count"
        if n_words:
            mean_length = sum(map(len, words)) / n_words
            if not c.min_mean_word_length <= mean_length <= c.max_mean_word_length:
                return "gopher_quality.mean_word_length"
        n_tokens = n_words + n_symbols
        if not n_tokens:
            return None  # only reachable with min_words = 0: nothing left to judge
        if text.count("#") / n_tokens > c.max_hash_ratio:
            return "gopher_quality.hash_ratio"
        if (text.count("...") + text.count("…")) / n_tokens > c.max_ellipsis_ratio:
            return "gopher_quality.ellipsis_ratio"
        n_lines = text.count("\n") + 1
        if len(self._bullet_line_re.findall(text)) / n_lines > c.max_bullet_lines_ratio:
            return "gopher_quality.bullet_lines"
        if len(self._ellipsis_line_re.findall(text)) / n_lines > c.max_ellipsis_lines_ratio:
            return "gopher_quality.ellipsis_lines"
        # Over words, not punctuation tokens: datatrove divides by every token, so prose with
        # dialogue ("Hi, Sam!" is 5 tokens, 2 words) fails a rule meant for number/symbol soup.
        if n_words and (n_words - n_numbers) / n_words < c.min_alpha_words_ratio:
            return "gopher_quality.alpha_words"
        if len(self._stop_words.intersection(words)) < c.min_stop_words:
            return "gopher_quality.stop_words"
        return None


# ---------------------------------------------------------------------------- repetition
@dataclass(frozen=True)
class GopherRepetitionConfig:
    """MassiveText repetition rules (Rae et al. 2021, Table A1); defaults as published."""

    enabled: bool = True
    max_duplicate_line_fraction: float = 0.30  # repeated lines over lines
    max_duplicate_paragraph_fraction: float = 0.30  # repeated paragraphs over paragraphs
    max_duplicate_line_char_fraction: float = 0.20  # characters in repeated lines over text
    max_duplicate_paragraph_char_fraction: float = 0.20
    # Most frequent n-gram: its characters times its count, over the text's characters.
    top_ngram_sizes: tuple[int, ...] = (2, 3, 4)
    top_ngram_max_fractions: tuple[float, ...] = (0.20, 0.18, 0.16)
    # Characters of the tokens covered by repeated occurrences of n-grams, over the text.
    duplicate_ngram_sizes: tuple[int, ...] = (5, 6, 7, 8, 9, 10)
    duplicate_ngram_max_fractions: tuple[float, ...] = (0.15, 0.14, 0.13, 0.12, 0.11, 0.10)

    def __post_init__(self) -> None:
        where = "quality.gopher_repetition"
        for name in (
            "max_duplicate_line_fraction",
            "max_duplicate_paragraph_fraction",
            "max_duplicate_line_char_fraction",
            "max_duplicate_paragraph_char_fraction",
        ):
            _check_fraction(where, name, getattr(self, name))
        for kind in ("top_ngram", "duplicate_ngram"):
            sizes = getattr(self, f"{kind}_sizes")
            fractions = getattr(self, f"{kind}_max_fractions")
            if len(sizes) != len(fractions):
                raise KilnError(
                    f"[{where}] {kind}_sizes has {len(sizes)} entries but "
                    f"{kind}_max_fractions has {len(fractions)}: expected one fraction per size"
                )
            if any(n < 1 for n in sizes) or len(set(sizes)) != len(sizes):
                raise KilnError(f"[{where}] {kind}_sizes = {sizes}: expected distinct sizes >= 1")
            for f in fractions:
                _check_fraction(where, f"{kind}_max_fractions", f)


def count_duplicates(items: list[str]) -> tuple[int, int]:
    """(how many items repeat an earlier one, their total characters)."""
    if len(set(items)) == len(items):  # the common case, at C speed
        return 0, 0
    seen: set[str] = set()
    n = chars = 0
    for item in items:
        if item in seen:
            n += 1
            chars += len(item)
        else:
            seen.add(item)
    return n, chars


def _ngrams(tokens: Sequence[str], n: int) -> Iterator[tuple[str, ...]]:
    return zip(*(tokens[i:] for i in range(n)), strict=False)


def top_ngram(tokens: Sequence[str], n: int) -> tuple[int, int]:
    """(count, characters joined by spaces) of the most frequent n-gram; ties go to the first.

    (0, 0) when there are fewer than n tokens.
    """
    if len(tokens) < n:
        return 0, 0
    # max() keeps the first of equal counts, and a Counter iterates in insertion order.
    gram, count = max(Counter(_ngrams(tokens, n)).items(), key=operator.itemgetter(1))
    return count, sum(map(len, gram)) + n - 1


def duplicate_ngram_chars(tokens: Sequence[str], n: int) -> int:
    """Characters of the tokens covered by any occurrence of an n-gram that occurred before.

    Each token counts once however many repeated n-grams overlap it (the paper's "taking care not
    to count characters that occur in overlapping n-grams more than once").
    """
    grams = list(_ngrams(tokens, n))
    m = len(grams)
    if len(set(grams)) == m:
        return 0  # no n-gram repeats: the common case
    # Each n-gram's first position, built at C speed: later (smaller) positions overwrite.
    first = dict(zip(reversed(grams), range(m - 1, -1, -1), strict=True))
    repeats = compress(range(m), map(operator.ne, map(first.__getitem__, grams), range(m)))
    covered = bytearray(len(tokens))
    span = b"\x01" * n
    for i in repeats:
        covered[i : i + n] = span
    return sum(compress(map(len, tokens), covered))


class GopherRepetition:
    """Removes documents with too much repeated text; the reason names the rule."""

    name = "gopher_repetition"

    def __init__(self, config: GopherRepetitionConfig) -> None:
        self.config = config
        self._top = sorted(zip(config.top_ngram_sizes, config.top_ngram_max_fractions, strict=True))
        self._dup = sorted(
            zip(config.duplicate_ngram_sizes, config.duplicate_ngram_max_fractions, strict=True)
        )

    def apply(self, doc: Document) -> str | None:
        """Keep `doc` (None) or return `gopher_repetition.<rule>` for the first rule it fails."""
        c = self.config
        text = doc.text
        if not text.strip():
            return "gopher_repetition.empty"
        n_chars = len(text)
        paragraphs = PARAGRAPH_SPLIT_RE.split(text.strip())
        n_dup, dup_chars = count_duplicates(paragraphs)
        if n_dup / len(paragraphs) > c.max_duplicate_paragraph_fraction:
            return "gopher_repetition.duplicate_paragraphs"
        if dup_chars / n_chars > c.max_duplicate_paragraph_char_fraction:
            return "gopher_repetition.duplicate_paragraph_chars"
        lines = [line for line in text.split("\n") if line]
        n_dup, dup_chars = count_duplicates(lines)
        if n_dup / len(lines) > c.max_duplicate_line_fraction:
            return "gopher_repetition.duplicate_lines"
        if dup_chars / n_chars > c.max_duplicate_line_char_fraction:
            return "gopher_repetition.duplicate_line_chars"

        tokens = split_tokens(text)
        return self._top_ngram_rule(tokens, n_chars) or self._duplicate_ngram_rule(tokens, n_chars)

    def _top_ngram_rule(self, tokens: list[str], n_chars: int) -> str | None:
        # An n-gram occurs at most as often as its first (n-1)-gram, and has at most the
        # characters of the n longest tokens: when that product is under the threshold the
        # Counter is skipped. For most documents only the first size is counted.
        max_count = len(tokens)
        longest = heapq.nlargest(self._top[-1][0], map(len, tokens)) if self._top else []
        for n, max_fraction in self._top:
            if max_count * (sum(longest[:n]) + n - 1) / n_chars <= max_fraction:
                continue
            max_count, chars = top_ngram(tokens, n)
            if max_count * chars / n_chars > max_fraction:
                return f"gopher_repetition.top_{n}gram"
        return None

    def _duplicate_ngram_rule(self, tokens: list[str], n_chars: int) -> str | None:
        # Tokens covered by repeated (n+1)-grams are covered by repeated n-grams too, so the
        # fraction for n bounds every larger n: once it is under all remaining thresholds,
        # they all pass without being computed (most documents stop after the first size).
        bound = 1.0
        for k, (n, max_fraction) in enumerate(self._dup):
            if bound <= min(f for _, f in self._dup[k:]):
                return None
            bound = duplicate_ngram_chars(tokens, n) / n_chars
            if bound > max_fraction:
                return f"gopher_repetition.duplicate_{n}gram"
        return None
