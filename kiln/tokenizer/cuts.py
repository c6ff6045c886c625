"""Where a growing text buffer may be cut without changing how it pre-tokenizes.

Streaming (training input, `encode_iterable`) processes text in pieces; a cut is safe when the
pieces' pre-tokens are exactly those of the whole text:
- right after a special-token match (matches found leftmost-longest from a safe start, as the
  encoder finds them), since the split pattern never runs across a special token;
- for the built-in patterns, between `\\n` and B in `A\\nB`, where A and B are not whitespace and
  B is not `/`: that newline is a pre-token of its own or the end of one (cl100k's `.\\n`,
  o200k's `.\\n`), whatever follows, and B always starts a new pre-token. With whitespace before
  the newline, `\\s+(?!\\S)` would hand the run's last character to the next pre-token; a `/`
  after it would join o200k's `[\\r\\n/]*`. Newline cuts are off when a special token contains
  a newline, so they can never land inside one.
Custom patterns only get special-token cuts.

The buffer may be `str` or UTF-8 `bytes`; positions are indices into it. Each call looks only at
the part of the buffer that arrived since the last call (plus a small margin), so feeding a long
stretch without any cut stays linear.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import regex

Text = TypeVar("Text", str, bytes)
_SPACE = regex.compile(r"\s")
_WORD = regex.compile(r"[\p{L}\p{N}]")
_LOOKAHEAD = 8  # enough for the character after a newline (4 UTF-8 bytes) and then some


class CutFinder(Generic[Text]):
    """Tracks one growing buffer and reports the last safe cut in it."""

    def __init__(self, specials: Sequence[str], newline_cuts: bool, binary: bool) -> None:
        tokens = [s.encode("utf-8") if binary else s for s in specials if s]
        ordered = sorted(set(tokens), key=lambda t: (-len(t), t))
        self._newline = b"\n" if binary else "\n"
        bar = b"|" if binary else "|"
        self._special = regex.compile(bar.join(map(regex.escape, ordered))) if ordered else None
        self._newline_cuts = newline_cuts and not any(self._newline in t for t in tokens)
        self._margin = max((len(t) for t in tokens), default=0) + _LOOKAHEAD
        self._binary = binary
        self._scanned = 0  # the buffer was already searched up to here (minus the margin)

    def reset(self) -> None:
        """Start over on a new buffer (after the caller cut the old one)."""
        self._scanned = 0

    def last_cut(self, buf: Text) -> int:
        """The last safe cut > 0 in `buf` among positions not yet ruled out, or -1."""
        start = max(0, self._scanned - self._margin)
        self._scanned = len(buf)
        best = -1
        if self._special is not None:
            # No special token matched before `start` (else the caller would have cut there),
            # so a leftmost-longest scan from `start` sees the same matches as one from 0.
            for match in self._special.finditer(buf, start):
                best = match.end()
        if self._newline_cuts:
            best = max(best, self._last_newline_cut(buf, max(start, best)))
        return best if best > 0 else -1

    def _last_newline_cut(self, buf: Text, floor: int) -> int:
        nl = len(buf)
        while True:
            nl = buf.rfind(self._newline, floor, nl)
            if nl < 1:
                return -1
            before, after = self._char_before(buf, nl), self._char_after(buf, nl + 1)
            if before is None or _SPACE.match(before):
                continue
            if after is not None and not _SPACE.match(after) and after != "/":
                return nl + 1
            if _WORD.match(before):
                return nl

    def _char_before(self, buf: Text, end: int) -> str | None:
        if not self._binary:
            return buf[end - 1]
        start = end - 1
        while start > 0 and end - start < 4 and (buf[start] & 0xC0) == 0x80:
            start -= 1
        return _decode_one(buf[start:end])

    def _char_after(self, buf: Text, start: int) -> str | None:
        if start >= len(buf):
            return None  # not known yet: wait for more text
        if not self._binary:
            return buf[start]
        lead = buf[start]
        size = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        return _decode_one(buf[start : start + size])


def _decode_one(data: bytes) -> str | None:
    """The single character `data` encodes, or None (truncated or invalid: no cut there)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if len(text) == 1 else None
