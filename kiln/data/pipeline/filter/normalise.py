"""Normalise: repair broken Unicode (ftfy), compose to NFC, and tidy whitespace.

ftfy runs with the settings of datatrove's `FTFYFormatter`: it undoes mojibake, HTML entities,
terminal escapes and control characters, but does not impose a typography, so curly quotes,
ligatures and full-width CJK punctuation stay as written (a model should see text as people
write it). Whitespace is tidied without touching indentation, so code keeps its meaning.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from kiln.data.pipeline.document import Document

# ASCII text is left unchanged by every ftfy fix used here, except these characters: HTML
# entities (&), and the C0 controls ftfy removes (including ESC of terminal escapes).
_ASCII_NEEDS_FTFY = re.compile(r"[&\x00-\x08\x0b\x0e-\x1f\x7f]")
_HSPACE = r"[^\S\n]"  # whitespace other than a newline
# A run inside a line (after a visible character, so indentation stays) that is not already
# a single plain space: two or more whitespace characters, or one tab / no-break space / ...
_INNER_SPACE = re.compile(r"(?<=\S)(?:" + _HSPACE + r"{2,}|[^\S\n ])")
_BLANK_LINES = re.compile(r"\n{3,}")
# In ASCII text, only these can make a run _INNER_SPACE rewrites (str.isspace() characters).
_ASCII_ODD_SPACE = ("  ", "\t", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f")


@dataclass(frozen=True)
class NormaliseConfig:
    """Which normalisations run; the ftfy switches default to datatrove's FTFYFormatter."""

    enabled: bool = True
    fix_text: bool = True  # ftfy: mojibake, HTML entities, terminal escapes, control chars
    nfc: bool = True  # compose characters (e + U+0301 -> é), so equal text has equal code points
    whitespace: bool = True  # \r\n -> \n, collapse runs inside lines, strip, <= 1 blank line
    uncurl_quotes: bool = False  # ftfy would turn ’ into ': keep the writer's quotes
    fix_latin_ligatures: bool = False  # ﬁ -> fi
    fix_character_width: bool = False  # would force half-width CJK punctuation: wrong for CJK


class Normalise:
    """Rewrite a document's text in place; a document left empty is removed."""

    name = "normalise"

    def __init__(self, config: NormaliseConfig) -> None:
        import ftfy

        self.config = config
        self._fix_text = ftfy.fix_text
        self._ftfy_config = ftfy.TextFixerConfig(
            unescape_html="auto",  # unescape entities unless the text contains markup ("<")
            remove_terminal_escapes=True,
            fix_encoding=True,
            restore_byte_a0=True,
            replace_lossy_sequences=True,
            decode_inconsistent_utf8=True,
            fix_c1_controls=True,
            fix_latin_ligatures=config.fix_latin_ligatures,
            fix_character_width=config.fix_character_width,
            uncurl_quotes=config.uncurl_quotes,
            fix_line_breaks=False,  # \r\n is handled by the whitespace step
            fix_surrogates=True,
            remove_control_chars=True,
            normalization=None,  # NFC is its own switch below
            explain=False,
        )

    def normalise(self, text: str) -> str:
        """The normalised form of `text` (may be empty)."""
        cfg = self.config
        ascii_only = text.isascii()
        if cfg.fix_text and (not ascii_only or _ASCII_NEEDS_FTFY.search(text)):
            text = self.fix_text(text)
            ascii_only = text.isascii()
        if cfg.nfc and not ascii_only and not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
        if cfg.whitespace:
            text = normalise_whitespace(text)
        return text

    def fix_text(self, text: str) -> str:
        """Exactly `ftfy.fix_text(text, config)`, skipping the lines ftfy would leave alone.

        ftfy fixes a text line by line (segments ending in a newline); a plain ASCII line
        without `&` or control characters comes out unchanged, so only the others are passed
        in. Like ftfy, the first line with a `<` turns HTML unescaping off for the rest.
        """
        config = self._ftfy_config
        if max(map(len, text.split("\n"))) > config.max_decode_length:
            return self._fix_text(text, config=config)  # ftfy splits such lines its own way
        parts = []
        for segment in _segments(text):
            if config.unescape_html == "auto" and "<" in segment:
                config = config._replace(unescape_html=False)
            if segment.isascii() and not _ASCII_NEEDS_FTFY.search(segment):
                parts.append(segment)
            else:
                parts.append(self._fix_text(segment, config=config))
        return "".join(parts)

    def apply(self, doc: Document) -> str | None:
        """Normalise `doc.text`; remove the document if nothing is left."""
        text = self.normalise(doc.text)
        if not text:
            return "normalise.empty"
        doc.text = text
        return None


def _segments(text: str) -> list[str]:
    """The lines of `text`, each with its newline (ftfy's segments)."""
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def normalise_whitespace(text: str) -> str:
    """Unix newlines; runs of spaces/tabs inside a line -> one space (indentation kept);
    no trailing spaces; at most one blank line in a row; no surrounding whitespace."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    # str methods run in C: splitting on lines and rstrip is ~10x faster than a regex pass.
    text = "\n".join([line.rstrip() for line in text.split("\n")])
    if not text.isascii() or any(s in text for s in _ASCII_ODD_SPACE):
        text = _INNER_SPACE.sub(" ", text)
    if "\n\n\n" in text:
        text = _BLANK_LINES.sub("\n\n", text)
    return text.strip()
