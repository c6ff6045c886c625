"""Stream a training corpus as UTF-8 segments whose boundaries never split a pre-token.

A segment boundary falls where `pretokenize.last_safe_cut` allows (before a special token, or
after a newline in the built-in patterns), so pre-tokens are the same as if the whole file were
split at once. Custom patterns only split at special tokens. Memory is bounded by
the block size plus the longest stretch without such a boundary.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kiln.errors import KilnError
from kiln.io import decompressing_reader, iter_jsonl_texts, open_binary_raw, strip_compression
from kiln.tokenizer.pretokenize import last_safe_cut


@dataclass
class Utf8Report:
    """Invalid UTF-8 found while reading: per file, the count and the first byte offsets."""

    counts: dict[str, int] = field(default_factory=dict)
    first_offsets: dict[str, list[int]] = field(default_factory=dict)

    def add(self, path: str, offset: int) -> None:
        """Record one invalid sequence at `offset` (bytes from the start of the decompressed file)."""
        self.counts[path] = self.counts.get(path, 0) + 1
        offsets = self.first_offsets.setdefault(path, [])
        if len(offsets) < 5:
            offsets.append(offset)

    def summary(self) -> str:
        """A one-line-per-file description, for warnings and the training summary."""
        return "; ".join(
            f"{p}: {n} invalid UTF-8 sequence(s), first at byte offset(s) "
            f"{', '.join(map(str, self.first_offsets[p]))}"
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
    pos = 0
    while True:
        try:
            block[pos:].decode("utf-8")
            break
        except UnicodeDecodeError as exc:
            report.add(path, offset + pos + exc.start)
            pos += exc.end
    return block.decode("utf-8", errors="replace").encode("utf-8")


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
    special_latin1 = [s.encode("utf-8").decode("latin-1") for s in specials]
    for path in paths:
        name = os.fspath(path)
        if strip_compression(name).endswith(".jsonl"):
            if on_progress:
                on_progress(os.path.getsize(name))
            for text in iter_jsonl_texts(name, text_field):
                data = text.encode("utf-8", errors="replace")
                if data:
                    yield data
            continue
        yield from _iter_file_segments(
            name, special_latin1, newline_boundaries, block_bytes, strict_utf8, report, on_progress
        )
    if report.counts:
        warnings.warn(
            f"replaced invalid UTF-8 with U+FFFD: {report.summary()}", UnicodeWarning, stacklevel=2
        )


def _iter_file_segments(
    path: str,
    specials: Sequence[str],
    newline_ok: bool,
    block_bytes: int,
    strict: bool,
    report: Utf8Report,
    on_progress: Callable[[int], None] | None,
) -> Iterator[bytes]:
    carry = b""
    offset = 0  # decompressed offset of carry[0]
    raw = open_binary_raw(path)
    disk_done = 0
    with decompressing_reader(raw, path) as handle:
        while True:
            block = handle.read(block_bytes)
            if on_progress and not raw.closed:
                on_progress(raw.tell() - disk_done)
                disk_done = raw.tell()
            if not block:
                break
            data = carry + block
            # Latin-1 maps bytes 1:1 to code points, so str cut positions are byte positions;
            # a cut only ever lands before an ASCII byte, never inside a UTF-8 sequence.
            cut = last_safe_cut(data.decode("latin-1"), specials, newline_ok)
            if cut <= 0:
                carry = data
                continue
            yield _validated(data[:cut], path, offset, report, strict)
            offset += cut
            carry = data[cut:]
    if carry:
        yield _validated(carry, path, offset, report, strict)
