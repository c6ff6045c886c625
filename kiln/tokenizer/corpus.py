"""Stream a training corpus as UTF-8 segments whose boundaries never split a pre-token.

A segment boundary falls where `cuts.CutFinder` allows (after a special token, or after a
newline in the built-in patterns), so pre-tokens are the same as if the whole file were
split at once. Custom patterns only split at special tokens. Memory is bounded by
the block size plus the longest stretch without such a boundary.
"""

from __future__ import annotations

import codecs
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

from kiln.errors import KilnError
from kiln.io import decompressing_reader, iter_jsonl_texts, open_binary_raw, strip_compression
from kiln.tokenizer.cuts import CutFinder
from kiln.tokenizer.pretokenize import to_utf8


@dataclass
class Utf8Report:
    """Invalid UTF-8 found while reading: per file, the count and the first byte offsets."""

    counts: dict[str, int] = field(default_factory=dict)
    first_places: dict[str, list[str]] = field(default_factory=dict)

    def add(self, path: str, where: str) -> None:
        """Record one invalid sequence `where` ("byte offset N" of the decompressed file, "line N")."""
        self.counts[path] = self.counts.get(path, 0) + 1
        places = self.first_places.setdefault(path, [])
        if len(places) < 5:
            places.append(where)

    def summary(self) -> str:
        """A one-line-per-file description, for warnings and the training summary."""
        return "; ".join(
            f"{p}: {n} invalid UTF-8 sequence(s), first at {', '.join(self.first_places[p])}"
            for p, n in self.counts.items()
        )


def _validated(block: bytes, path: str, offset: int, report: Utf8Report, strict: bool) -> bytes:
    """`block` if valid UTF-8; otherwise report each bad sequence and replace it with U+FFFD."""
    try:
        block.decode("utf-8")
        return block
    except UnicodeDecodeError as exc:
        if strict:
            raise KilnError(
                f"{path}: invalid UTF-8 at byte offset {offset + exc.start} "
                f"({exc.reason}); pass --invalid-utf8 replace to replace such bytes with U+FFFD"
            ) from None
    # A memoryview decodes from each error onwards without copying the rest of the block, and
    # each strict decode stops at the next error: linear however many bad bytes there are.
    view, pos = memoryview(block), 0
    while pos < len(block):
        try:
            codecs.utf_8_decode(view[pos:], "strict", True)
            break
        except UnicodeDecodeError as exc:
            report.add(path, f"byte offset {offset + pos + exc.start}")
            pos += exc.end
    return block.decode("utf-8", errors="replace").encode("utf-8")


def _report_line(report: Utf8Report, path: str, line_no: int) -> None:
    report.add(path, f"line {line_no}")


def iter_segments(
    paths: Sequence[str | os.PathLike[str]],
    specials: Sequence[str],
    newline_boundaries: bool,
    *,
    block_bytes: int = 1 << 20,
    text_field: str = "text",
    strict_utf8: bool = False,
    report: Utf8Report | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> Iterator[bytes]:
    """Yield valid UTF-8 segments of every input; `.jsonl` records are segments of their own.

    `on_progress` receives on-disk (compressed) bytes consumed, to compare with file sizes.
    """
    report = report if report is not None else Utf8Report()
    cuts: CutFinder[bytes] = CutFinder(specials, newline_boundaries, binary=True)
    for path in paths:
        name = os.fspath(path)
        if strip_compression(name).endswith(".jsonl"):
            if on_progress:
                on_progress(os.path.getsize(name))
            texts = iter_jsonl_texts(
                name,
                text_field,
                on_invalid_utf8=None if strict_utf8 else partial(_report_line, report, name),
            )
            for text in texts:
                data = to_utf8(text)
                if data:
                    yield data
            continue
        yield from _iter_file_segments(name, cuts, block_bytes, strict_utf8, report, on_progress)
    if report.counts:
        warnings.warn(
            f"replaced invalid UTF-8 with U+FFFD: {report.summary()}", UnicodeWarning, stacklevel=2
        )


def _iter_file_segments(
    path: str,
    cuts: CutFinder[bytes],
    block_bytes: int,
    strict: bool,
    report: Utf8Report,
    on_progress: Callable[[int], None] | None,
) -> Iterator[bytes]:
    buf = bytearray()
    offset = 0  # decompressed offset of buf[0]
    raw = open_binary_raw(path)
    disk_done = 0
    cuts.reset()
    with decompressing_reader(raw, path) as handle:
        while True:
            try:
                block = handle.read(block_bytes)
            except KilnError:  # kiln.io already named the file and the damage
                raise
            except Exception as exc:  # gzip/bz2/zstd each raise their own types
                raise KilnError(
                    f"{path}: corrupt or truncated compressed file (after {offset + len(buf):,} "
                    f"decompressed bytes): {exc}"
                ) from None
            if on_progress and not raw.closed:
                on_progress(raw.tell() - disk_done)
                disk_done = raw.tell()
            if not block:
                break
            buf += block
            cut = cuts.last_cut(buf)
            if cut <= 0:
                continue
            yield _validated(bytes(buf[:cut]), path, offset, report, strict)
            offset += cut
            del buf[:cut]
            cuts.reset()
    if buf:
        yield _validated(bytes(buf), path, offset, report, strict)
