"""WARC and HTTP at the byte level: record headers, blocks, response bodies and their charset.

The readers (`kiln.data.pipeline.read.readers`) drive these to turn WARC response records into
documents; this module knows nothing of documents, ordinals or issues. It follows WARC/1.0-1.1:
a `WARC/x.y` version line, `Name: value` header lines, a blank line, `Content-Length` bytes of
block, and a blank line or two before the next record.
"""

from __future__ import annotations

import codecs
import re
from typing import IO

MAX_LINE = 1 << 16  # a header line longer than this is garbage, not a header
HTML_TYPES = ("text/html", "application/xhtml+xml")
_SKIP_CHUNK = 1 << 20
_META_CHARSET = re.compile(rb"""<meta[^>]{0,200}?charset\s*=\s*["']?\s*([A-Za-z0-9._:-]+)""", re.I)
_HEADER_CHARSET = re.compile(r"charset\s*=\s*[\"']?([A-Za-z0-9._:-]+)", re.I)


def resync(handle: IO[bytes]) -> tuple[bytes, int]:
    """Skip to the next line starting with `WARC/`; return it (b"" at EOF) and bytes skipped."""
    skipped = 0
    while line := handle.readline(MAX_LINE):
        if line.startswith(b"WARC/"):
            return line, skipped + len(line)
        skipped += len(line)
    return b"", skipped


def read_headers(handle: IO[bytes]) -> tuple[dict[str, str], int]:
    """Read `Name: value` lines up to a blank line; names lower-cased."""
    headers: dict[str, str] = {}
    size = 0
    last = ""
    while line := handle.readline(MAX_LINE):
        size += len(line)
        if not line.strip():
            break
        text = line.decode("utf-8", errors="replace").rstrip("\r\n")
        if text[:1] in (" ", "\t") and last:  # folded continuation of the previous header
            headers[last] += " " + text.strip()
            continue
        name, sep, value = text.partition(":")
        if sep:
            last = name.strip().lower()
            headers[last] = value.strip()
    return headers, size


def content_length(headers: dict[str, str]) -> int | None:
    try:
        length = int(headers.get("content-length", ""))
    except ValueError:
        return None
    return length if length >= 0 else None


def read_block(handle: IO[bytes], length: int, *, keep: bool) -> tuple[bytes | None, int]:
    """Read (or skip) a `length`-byte block; returns it if `keep`, and how many bytes there were."""
    if keep:
        block = handle.read(length)
        return block, len(block)
    got = 0
    while got < length and (chunk := handle.read(min(_SKIP_CHUNK, length - got))):
        got += len(chunk)
    return None, got


def split_http(block: bytes) -> tuple[bytes | None, str]:
    """The body of an HTTP response block and its Content-Type header ("" if none)."""
    if not block.startswith(b"HTTP/"):
        return None, ""
    end = block.find(b"\r\n\r\n")
    size = 4
    if end < 0:
        end, size = block.find(b"\n\n"), 2
    if end < 0:
        return None, ""
    content_type = ""
    for raw in block[:end].split(b"\n")[1:]:
        name, sep, value = raw.decode("latin-1").partition(":")
        if sep and name.strip().lower() == "content-type":
            content_type = value.strip()
    return block[end + size :], content_type


def header_charset(content_type: str) -> str | None:
    """The charset named in a Content-Type header value, if any."""
    found = _HEADER_CHARSET.search(content_type)
    return found.group(1) if found else None


def decode_declared(data: bytes, declared: str | None) -> str | None:
    """Decode non-UTF-8 page bytes in the declared (or `<meta charset>`) encoding.

    None when no usable non-UTF-8 charset is declared: the caller then decodes lossily.
    """
    if declared is None:
        found = _META_CHARSET.search(data, 0, 4096)
        declared = found.group(1).decode("ascii", "replace") if found else None
    if declared is None:
        return None
    try:
        codec = codecs.lookup(declared).name
    except LookupError:
        return None
    return None if codec == "utf-8" else data.decode(codec, errors="replace")
