"""Documents from input files: `.txt` split on the end-of-text token, `.jsonl` one per record.

A document is stripped of surrounding whitespace (the separator usually sits on its own line);
empty documents are skipped and counted, and invalid UTF-8 is replaced with U+FFFD and counted,
so nothing is dropped or altered silently.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from kiln.io import iter_jsonl_texts, open_binary, strip_compression

_BLOCK_BYTES = 1 << 20


@dataclass
class SourceCounts:
    """What reading one input produced: documents kept, and what was skipped or repaired."""

    documents: int = 0
    empty_skipped: int = 0
    invalid_utf8_documents: int = 0


def is_jsonl(path: str | os.PathLike[str]) -> bool:
    """Whether a path names JSON lines (`.jsonl`, possibly compressed)."""
    return strip_compression(path).endswith(".jsonl")


def iter_raw_text_documents(path: str, separator: bytes) -> Iterator[bytes]:
    """Yield the byte spans between separators of a (possibly compressed) text file."""
    carry = bytearray()
    with open_binary(path) as handle:
        while block := handle.read(_BLOCK_BYTES):
            # Only the new bytes (and a separator's width before them) can hold a new separator,
            # so a long document costs linear time, not quadratic.
            start = max(0, len(carry) - len(separator) + 1)
            carry += block
            if carry.find(separator, start) < 0:
                continue
            *parts, rest = bytes(carry).split(separator)
            carry = bytearray(rest)
            yield from parts
    if carry.strip():  # the usual newline after the last separator is not an empty document
        yield bytes(carry)


def _decode(raw: bytes, counts: SourceCounts) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        counts.invalid_utf8_documents += 1
        return raw.decode("utf-8", errors="replace")


def iter_documents(
    path: str, eot_token: str, text_field: str = "text", counts: SourceCounts | None = None
) -> Iterator[str]:
    """Yield the documents of one input file, in order, updating `counts` as it goes."""
    counts = counts if counts is not None else SourceCounts()
    if is_jsonl(path):
        texts: Iterator[str] = iter_jsonl_texts(path, text_field)
    else:
        raw_docs = iter_raw_text_documents(path, eot_token.encode("utf-8"))
        texts = (_decode(raw, counts) for raw in raw_docs)
    for text in texts:
        doc = text.strip()
        if not doc:
            counts.empty_skipped += 1
            continue
        counts.documents += 1
        yield doc
