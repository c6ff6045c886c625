"""Incremental detokenisation with stop strings: text is released as soon as it is final.

Bytes become text through an incremental UTF-8 decoder, so a character split across tokens is
released whole once its last byte arrives. Text that could still be the start of a stop string
is held back; a stop string found (within one token or across several) ends the sample, and
neither it nor anything after it is ever released.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol


class Detokenizer(Protocol):
    """What the text stream needs from a tokenizer."""

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The bytes the ids stand for."""
        ...


class TextStream:
    """The text of one sample, token by token: what may be released now, and whether it stopped."""

    def __init__(self, tokenizer: Detokenizer | None, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything decoded so far (cut at a stop string once one is found)
        self.sent = 0  # characters of self.text already released
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text it releases ("" while held back or after a stop)."""
        if self.stopped or self.tokenizer is None:
            return ""
        try:
            data = self.tokenizer.decode_bytes([token_id])
        except ValueError:  # an id of a padded vocabulary the tokenizer does not have
            data = b""
        return self._add(self.decoder.decode(data))

    def finish(self) -> str:
        """The text still held back when the sample ends (an incomplete character becomes U+FFFD)."""
        if self.stopped or self.tokenizer is None:
            return ""
        released = self._add(self.decoder.decode(b"", final=True))
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return released + rest

    def _add(self, piece: str) -> str:
        start = max(0, len(self.text) - self.longest + 1)  # a stop may begin in earlier text
        self.text += piece
        cut = self._find_stop(start)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            out = self.text[self.sent :]
            self.sent = len(self.text)
            return out
        end = len(self.text) - self._held()
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _find_stop(self, start: int) -> int | None:
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        room = min(len(self.text) - self.sent, self.longest - 1)
        for k in range(room, 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
