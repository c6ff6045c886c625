"""Documents from input files: `.txt` split on end-of-text lines, `.jsonl` one per record.

A `.txt` document ends at a line holding only the end-of-text token; the token inside a line is
ordinary text (counted). A document is stripped of surrounding whitespace;
empty documents are skipped and counted, and invalid UTF-8 is replaced with U+FFFD and counted,
so nothing is dropped or altered silently.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from kiln.errors import KilnError
from kiln.io import iter_jsonl_texts, open_binary, strip_compression


@dataclass
class SourceCounts:
    """What reading one input produced: documents kept, and what was skipped or repaired."""

    documents: int = 0
    empty_skipped: int = 0
    invalid_utf8_documents: int = 0
    inline_separators: int = 0  # separator text inside a document, kept as ordinary text
    invalid_utf8_first: str = ""  # where the first invalid UTF-8 was: "byte offset N"


def is_jsonl(path: str | os.PathLike[str]) -> bool:
    """Whether a path names JSON lines (`.jsonl`, possibly compressed)."""
    return strip_compression(path).endswith(".jsonl")


class TextSpan(NamedTuple):
    """One document's bytes in a text file, where they start, and separators inside them."""

    data: bytes
    offset: int  # decompressed byte offset of data[0] in the file
    inline: int  # separator text inside the document, kept as ordinary text


def iter_text_documents(
    path: str, separator: bytes, lines: Iterable[bytes] | None = None
) -> Iterator[TextSpan]:
    """Yield each span between separator lines of a (possibly compressed) text file.

    A separator is a line holding only the separator (surrounding whitespace allowed); the
    separator anywhere else is ordinary text of the document, counted in `inline`. With
    `lines`, the file's lines come from there (say, from a checkpoint part-way in; offsets are
    then counted from its first line) instead of opening `path`.
    """
    if not separator.strip() or b"\n" in separator:
        raise KilnError(f"{path}: the document separator must be one non-blank line of text")
    doc, start, offset, inline = bytearray(), 0, 0, 0
    longest = len(separator) + 64  # a separator line with some surrounding whitespace
    with open_binary(path) if lines is None else contextlib.nullcontext(lines) as handle:
        for line in handle:
            offset += len(line)
            if len(line) <= longest and line.strip() == separator:
                yield TextSpan(bytes(doc), start, inline)
                doc, start, inline = bytearray(), offset, 0
                continue
            if separator in line:
                inline += line.count(separator)
            doc += line
    if doc.strip():  # the usual newline after the last separator is not an empty document
        yield TextSpan(bytes(doc), start, inline)


def iter_raw_text_documents(path: str, separator: bytes) -> Iterator[bytes]:
    """Yield the byte spans between separator lines of a (possibly compressed) text file."""
    for span in iter_text_documents(path, separator):
        yield span.data


def _decoded_texts(path: str, separator: bytes, counts: SourceCounts) -> Iterator[str]:
    for span in iter_text_documents(path, separator):
        counts.inline_separators += span.inline
        try:
            yield span.data.decode("utf-8")
        except UnicodeDecodeError as exc:
            counts.invalid_utf8_documents += 1
            if not counts.invalid_utf8_first:
                counts.invalid_utf8_first = f"byte offset {span.offset + exc.start}"
            yield span.data.decode("utf-8", errors="replace")


def iter_documents(
    path: str, eot_token: str, text_field: str = "text", counts: SourceCounts | None = None
) -> Iterator[str]:
    """Yield the documents of one input file, in order, updating `counts` as it goes."""
    counts = counts if counts is not None else SourceCounts()
    if is_jsonl(path):
        texts: Iterator[str] = iter_jsonl_texts(path, text_field)
    else:
        texts = _decoded_texts(path, eot_token.encode("utf-8"), counts)
    for text in texts:
        doc = text.strip()
        if not doc:
            counts.empty_skipped += 1
            continue
        counts.documents += 1
        yield doc
