"""A byte-offset index of a compressed input, so each task starts reading at its own range.

A gzip or bzip2 stream cannot be entered part-way, so without an index every task of a large
compressed file decompresses it from the start up to its range: the file is decompressed about
tasks/2 times. The counting pass (which reads the whole file anyway) writes instead a re-chunked
copy: the decompressed bytes as zstd frames that begin exactly at the records the tasks start
at (every `every` records), and an index of those frames (compressed offset, first record
ordinal, first line). A task seeks to its frame and decompresses only its range.

The copy holds the file's bytes unchanged, so the records, their ordinals, line numbers and
read issues are exactly those of reading the original from its start. Only compressed `.txt`
and `.jsonl` inputs are indexed (parquet has row groups; HTML is one record; WARC records
are rarely split across tasks).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import zstandard

from kiln.data.documents import iter_text_documents
from kiln.io import COMPRESSED_SUFFIXES, atomic_write, decompressing_reader, open_binary

INDEXED_FORMATS = ("txt", "jsonl")


def wants_index(path: str, fmt: str) -> bool:
    """Whether a file is worth indexing: a compressed txt/jsonl input."""
    return fmt in INDEXED_FORMATS and path.endswith(COMPRESSED_SUFFIXES)


class _Recorder:
    """The lines of a stream, keeping the bytes read since the last `take`."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.buffer = bytearray()
        self.lines = 0  # newlines taken so far

    def __iter__(self) -> Iterator[bytes]:
        for line in self.handle:
            self.buffer += line
            yield line

    def take(self, upto: int) -> bytes:
        """The first `upto` buffered bytes, removed from the buffer."""
        data = bytes(self.buffer[:upto])
        del self.buffer[:upto]
        self.lines += data.count(b"\n")
        return data


def build_index(path: str, fmt: str, separator: bytes, every: int, out: str) -> int:
    """Count the records of `path` and write `<out>.zst` (re-chunked) and `<out>.json`; return
    the count. Frame k starts at record k * every."""
    frames: list[dict[str, int]] = []
    cctx = zstandard.ZstdCompressor(level=1)
    with open_binary(path) as handle, atomic_write(out + ".zst", "wb") as copy:
        recorder = _Recorder(handle)

        def cut(upto: int, ordinal: int) -> None:
            data = recorder.take(upto)
            line = recorder.lines + 1  # the first line of the new frame
            if frames:
                copy.write(cctx.compress(data))  # closes the previous frame
            frames.append({"offset": copy.tell(), "ordinal": ordinal, "line": line})

        count, consumed = 0, 0  # records seen; bytes of the records before the next one
        if fmt == "txt":
            spans = iter_text_documents(path, separator, recorder)
            for count, span in enumerate(spans):
                if count % every == 0:
                    cut(span.offset - consumed, count)
                    consumed = span.offset
            count = count + 1 if frames else 0
        else:
            for count, line in enumerate(recorder):
                if count % every == 0:
                    cut(len(recorder.buffer) - len(line), count)
            count = count + 1 if frames else 0
        if frames:
            copy.write(cctx.compress(recorder.take(len(recorder.buffer))))
    index = {"source": path, "records": count, "every": every, "frames": frames}
    with atomic_write(out + ".json", "w") as handle:
        json.dump(index, handle)
    return count


def load_index(out: str) -> dict[str, Any]:
    """The index `build_index` wrote."""
    return json.loads(Path(out + ".json").read_text())


@contextmanager
def open_at(out: str, start: int) -> Iterator[tuple[IO[bytes], int, int]]:
    """The indexed file's bytes from the frame holding record `start`: (stream, first ordinal
    in it, its first line)."""
    index = load_index(out)
    frames = index["frames"]
    k = min(start // index["every"], len(frames) - 1) if frames else 0
    raw = open(out + ".zst", "rb")  # noqa: SIM115 (closed by the reader below)
    if frames:
        raw.seek(frames[k]["offset"])
    reader = decompressing_reader(raw, out + ".zst")
    try:
        first = frames[k] if frames else {"ordinal": 0, "line": 1}
        yield reader, first["ordinal"], first["line"]
    finally:
        reader.close()


def index_path(work: Path, file_number: int) -> str:
    """Where the index of the run's n-th input file lives (without suffix)."""
    return os.fspath(work / "index" / f"{file_number:06d}")
