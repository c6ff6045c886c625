"""C4's cleaning rules (Raffel et al. 2020, "Exploring the Limits of Transfer Learning", Sec. 2.2).

Rules, order and defaults follow the implementation that built C4 (TensorFlow Datasets,
`c4_utils.clean_page`): lines are stripped, then dropped for a word over 1,000 characters, for
not ending in a terminal mark (. ? ! or a closing ") or ending in "...", for having fewer than
5 words, for mentioning "javascript", or for a cookie/terms-of-use phrase; Wikipedia-style
citation marks are deleted; a kept line that contains "lorem ipsum" or a curly bracket removes
the whole page, and so does having fewer than 3 sentences over the kept lines. The paper's text
says "fewer than 3 sentences" and "at least 5 words" too; datatrove's C4QualityFilter defaults
to 5 sentences and 3 words. The bad-words rule is off unless `bad_words_file` names a list:
kiln ships none.

Sentences are counted without NLTK's Punkt model (TFDS) or spaCy's sentencizer (datatrove): a
kept line holds one sentence plus one more for each run of . ! ? (with any closing quotes or
brackets) followed by whitespace. Like an untrained splitter, this counts "Mr. Smith" as two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from kiln.data.pipeline.document import Document
from kiln.errors import KilnError

CITATION_RE = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")
# A break inside a line: end marks, closing quotes/brackets, then spaces (not a newline, so
# lines joined by newlines can be scanned at once).
SENTENCE_BREAK_RE = re.compile(r"[.!?]+[\"'”’)\]]*[^\S\n]")
POLICY_PHRASES = (
    "terms of use",
    "privacy policy",
    "cookie policy",
    "uses cookies",
    "use of cookies",
    "use cookies",
)


@dataclass(frozen=True)
class C4Config:
    """C4's line and page rules (Raffel et al. 2020, Sec. 2.2); defaults as TFDS built C4."""

    enabled: bool = True
    end_marks: tuple[str, ...] = (".", "?", "!", '"')  # a kept line ends with one of these
    drop_lines_without_end_mark: bool = True  # FineWeb runs C4 with this off
    min_words_per_line: int = 5  # whitespace-separated words
    min_sentences: int = 3  # over the kept lines; 0 disables
    max_word_length: int = 1000  # a line with a longer word is dropped; 0 disables
    remove_citations: bool = True  # delete [1], [edit], [citation needed]
    drop_javascript_lines: bool = True
    drop_policy_lines: bool = True
    remove_lorem_ipsum: bool = True
    remove_curly_bracket: bool = True
    bad_words_file: str = ""  # one word or phrase per line; "" disables the rule

    def __post_init__(self) -> None:
        where = "quality.c4"
        for name in ("min_words_per_line", "min_sentences", "max_word_length"):
            if getattr(self, name) < 0:
                raise KilnError(f"[{where}] {name} = {getattr(self, name)}: expected >= 0")
        if not self.end_marks or any(not m for m in self.end_marks):
            raise KilnError(f"[{where}] end_marks = {self.end_marks}: expected non-empty strings")


def load_bad_words(path: str) -> tuple[str, ...]:
    """The lowercased, non-empty lines of a bad-words file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise KilnError(f"[quality.c4] bad_words_file = {path!r}: cannot read it ({e})") from e
    except UnicodeDecodeError as e:
        raise KilnError(f"[quality.c4] bad_words_file = {path!r}: not UTF-8 ({e})") from e
    words = tuple(w for w in (line.strip().lower() for line in lines) if w)
    if not words:
        raise KilnError(f"[quality.c4] bad_words_file = {path!r}: no words in it")
    return words


def count_sentences(text: str, limit: int | None = None) -> int:
    """Sentences in newline-joined non-empty lines (module docstring), counting up to `limit`."""
    n_lines = text.count("\n") + 1 if text else 0
    if limit is not None and n_lines >= limit:
        return n_lines
    # Stop scanning as soon as the count is reached: a page has rarely fewer than 3 sentences.
    breaks = SENTENCE_BREAK_RE.finditer(text)
    return n_lines + sum(1 for _ in islice(breaks, None if limit is None else limit - n_lines))


class C4Filter:
    """Drops C4's bad lines from `doc.text` and removes pages C4 would discard.

    Counts of dropped non-blank lines, by rule, go to `doc.meta["c4_lines_removed"]`.
    """

    name = "c4"

    def __init__(self, config: C4Config) -> None:
        self.config = config
        self._end_marks = tuple(config.end_marks)
        phrases: list[str] = []
        if config.remove_lorem_ipsum:
            phrases.append("lorem ipsum")
        if config.drop_javascript_lines:
            phrases.append("javascript")
        if config.drop_policy_lines:
            phrases.extend(POLICY_PHRASES)
        self._bad_words_re = None
        if config.bad_words_file:
            words = load_bad_words(config.bad_words_file)
            alternatives = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
            # As TFDS: a bad word counts only where it is not part of a longer ASCII word.
            self._bad_words_re = re.compile(rf"(?<![a-z])(?:{alternatives})(?![a-z])")
            phrases.extend(words)
        # A phrase rule can only fire if its phrase is somewhere in the page: one look over the
        # whole page spares the per-line checks on almost every page.
        self._phrases = tuple(phrases)

    def apply(self, doc: Document) -> str | None:
        """Rewrite `doc.text` to its kept lines, or return `c4.<rule>` if the page goes."""
        c = self.config
        text = doc.text
        page = CITATION_RE.sub("", text) if c.remove_citations and "[" in text else text
        lower = page.lower()
        phrases = any(p in lower for p in self._phrases)
        brace = c.remove_curly_bracket and "{" in page
        removed: dict[str, int] = {}
        kept: list[str] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line:
                continue  # blank lines carry no text; not counted as removed
            line, rule = self._judge(line, phrases, brace)
            if rule is None:
                kept.append(line)
            elif rule.startswith("c4."):
                return rule
            else:
                removed[rule] = removed.get(rule, 0) + 1
        doc.meta["c4_lines_removed"] = removed
        kept_text = "\n".join(kept)
        if c.min_sentences and count_sentences(kept_text, c.min_sentences) < c.min_sentences:
            return "c4.too_few_sentences"
        doc.text = kept_text
        return None

    def _judge(self, line: str, phrases: bool, brace: bool) -> tuple[str, str | None]:
        """(`line` without citation marks, None to keep it or the rule that drops it).

        A rule starting with "c4." drops the whole page. `phrases` and `brace` say whether the
        page holds any of the phrases or a curly bracket at all.
        """
        c = self.config
        if (
            c.max_word_length
            and len(line) > c.max_word_length
            and any(len(w) > c.max_word_length for w in line.split())
        ):
            return line, "too_long_word"
        if c.remove_citations and "[" in line:
            line = CITATION_RE.sub("", line)
        if c.drop_lines_without_end_mark and (
            not line.endswith(self._end_marks) or line.endswith("...")
        ):
            return line, "no_end_mark"
        if len(line.split()) < c.min_words_per_line:
            return line, "too_few_words"
        if not (phrases or brace):
            return line, None
        lower = line.lower()
        # Checked only on lines that survived the rules above, as in TFDS.
        if c.remove_lorem_ipsum and "lorem ipsum" in lower:
            return line, "c4.lorem_ipsum"
        if c.drop_javascript_lines and "javascript" in lower:
            return line, "javascript"
        if c.remove_curly_bracket and "{" in line:
            return line, "c4.curly_bracket"
        if c.drop_policy_lines and any(p in lower for p in POLICY_PHRASES):
            return line, "policy"
        if self._bad_words_re is not None and self._bad_words_re.search(lower):
            return line, "c4.bad_words"
        return line, None
