"""FineWeb's own line-shape filters (Penedo et al. 2024, "The FineWeb Datasets", Sec. 3.6).

Remove a document when fewer than 0.12 of its lines end in terminal punctuation, when the
characters of its duplicated lines are more than 0.01 of its characters, or when more than 0.67
of its lines are at most 30 characters long. The comparisons are datatrove's; the paper writes
<= 0.12 and >= 0.67, which differ only at exact equality. Lines are the non-blank lines,
right-stripped. The duplicated-line threshold is 0.01 in the paper's Appendix E.4 table and in
datatrove's FineWebQualityFilter, the code that built FineWeb; Sec. 3.6 of the paper says 0.1.
datatrove adds a fourth rule, newlines per word above 0.3 ("list_ratio"), that the paper does
not list: kiln has it, off by default (`max_newline_token_ratio = 0`).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import regex

from kiln.data.pipeline.document import Document
from kiln.data.pipeline.filter.quality_gopher import count_duplicates, count_tokens
from kiln.errors import KilnError


@dataclass(frozen=True)
class FineWebConfig:
    """FineWeb's custom quality filters (Penedo et al. 2024, Sec. 3.6); defaults as built."""

    enabled: bool = True
    min_line_punct_ratio: float = 0.12  # lines ending in terminal punctuation, over lines
    max_short_line_ratio: float = 0.67  # short lines over lines
    short_line_length: int = 30  # a line of at most this many characters is short
    max_duplicate_line_char_ratio: float = 0.01  # characters in repeated lines, over the text's
    max_newline_token_ratio: float = 0.0  # datatrove's list_ratio (0.3 there); 0 disables
    terminal_chars: str = ""  # "" = Unicode's Sentence_Terminal characters (as datatrove)

    def __post_init__(self) -> None:
        where = "quality.fineweb"
        for name in ("min_line_punct_ratio", "max_short_line_ratio"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise KilnError(f"[{where}] {name} = {value}: expected a fraction in [0, 1]")
        for name in (
            "short_line_length",
            "max_duplicate_line_char_ratio",
            "max_newline_token_ratio",
        ):
            if getattr(self, name) < 0:
                raise KilnError(f"[{where}] {name} = {getattr(self, name)}: expected >= 0")


class FineWebFilter:
    """Removes documents whose lines look like lists, menus or boilerplate."""

    name = "fineweb"

    def __init__(self, config: FineWebConfig) -> None:
        self.config = config
        chars = config.terminal_chars
        self._terminal_re = regex.compile(
            f"[{re.escape(chars)}]" if chars else r"\p{Sentence_Terminal}"
        )

    def apply(self, doc: Document) -> str | None:
        """Keep `doc` (None) or return `fineweb.<rule>` for the first rule it fails."""
        c = self.config
        text = doc.text
        lines = list(filter(None, map(str.rstrip, text.split("\n"))))
        if not lines:
            return "fineweb.empty"
        n_lines = len(lines)
        # One regex scan over the lines' last characters, not one call per line.
        last_chars = "".join(map(operator.itemgetter(-1), lines))
        if len(self._terminal_re.findall(last_chars)) / n_lines < c.min_line_punct_ratio:
            return "fineweb.line_punct_ratio"
        n_short = sum(map(c.short_line_length.__ge__, map(len, lines)))
        if n_short / n_lines > c.max_short_line_ratio:
            return "fineweb.short_line_ratio"
        dup_chars = count_duplicates(lines)[1]
        if dup_chars / (len(text) - text.count("\n")) > c.max_duplicate_line_char_ratio:
            return "fineweb.duplicate_line_chars"
        ratio = c.max_newline_token_ratio
        if ratio > 0:
            n_newlines = text.count("\n")
            # Every whitespace-separated part holds at least one token: when the parts alone
            # bring the ratio under the limit, the exact (regex) count is not needed.
            if n_newlines / len(text.split()) > ratio and n_newlines / count_tokens(text) > ratio:
                return "fineweb.newline_ratio"
        return None
