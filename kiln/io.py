"""File I/O shared by every stage: atomic writes, hashing, readers for compressed inputs, and the
files kiln ships in kiln/assets/."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import IO, Any

from kiln.errors import KilnError, json_error_reason

COMPRESSED_SUFFIXES = (".gz", ".zst", ".bz2")


def asset(name: str) -> Path:
    """Path of a file shipped in kiln/assets/."""
    return Path(str(resources.files("kiln") / "assets" / name))


def strip_compression(path: str | os.PathLike[str]) -> str:
    """The file name without a compression suffix (`a.jsonl.gz` -> `a.jsonl`)."""
    name = os.fspath(path)
    for suffix in COMPRESSED_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def open_binary_raw(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open a file's on-disk bytes, with a clear error if it is missing or a directory."""
    name = os.fspath(path)
    if not os.path.exists(name):
        raise KilnError(f"{name}: no such file")
    if os.path.isdir(name):
        raise KilnError(f"{name}: is a directory, expected a file")
    return open(name, "rb")  # the caller closes it


def open_binary(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open a file for binary reading, decompressing `.gz`, `.zst` and `.bz2` transparently."""
    return decompressing_reader(open_binary_raw(path), os.fspath(path))


def decompressing_reader(raw: IO[bytes], name: str) -> IO[bytes]:
    """Wrap an open raw file in the decompressor its name calls for; closing it closes `raw`.

    Callers that show progress keep `raw` and read its position: that is the on-disk offset,
    which is what a progress bar's total (the file size) is measured in. A corrupt or truncated
    compressed file raises one KilnError naming it (at the read that meets the damage).
    """
    inner: IO[bytes]
    if name.endswith(".gz"):
        inner = gzip.GzipFile(fileobj=raw, mode="rb")
    elif name.endswith(".bz2"):
        inner = bz2.BZ2File(raw, "rb")
    elif name.endswith(".zst"):
        inner = _ZstdFrames(raw)
    else:
        return raw
    return io.BufferedReader(_CheckedDecompression(inner, raw, name), buffer_size=_READ_BYTES)


_READ_BYTES = 1 << 16


class _CheckedDecompression(io.RawIOBase):
    """A decompressing stream whose decoder errors become one KilnError naming the file."""

    def __init__(self, inner: IO[bytes], raw: IO[bytes], name: str) -> None:
        self._inner, self._raw, self._name = inner, raw, name
        self._done = 0  # decompressed bytes handed out so far

    def readable(self) -> bool:
        """Always readable."""
        return True

    def readinto(self, buffer: Any) -> int:
        """Fill `buffer` with decompressed bytes; damage in the file is a KilnError."""
        try:
            n = self._inner.readinto(buffer)  # type: ignore[attr-defined]
        except Exception as exc:  # gzip, bz2 and zstd each raise their own types
            raise KilnError(
                f"{self._name}: corrupt or truncated compressed file (after {self._done:,} "
                f"decompressed bytes): {exc}"
            ) from None
        self._done += n or 0
        return n

    def close(self) -> None:
        """Close the decoder and the file under it."""
        if not self.closed:
            try:
                self._inner.close()
            finally:
                self._raw.close()
        super().close()


class _ZstdFrames(io.RawIOBase):
    """Zstandard frames decoded one after another; a file ending inside a frame is an error
    (zstandard's own stream reader returns the bytes so far and stops silently)."""

    def __init__(self, raw: IO[bytes]) -> None:
        import zstandard

        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._obj: Any = None
        self._pending = b""  # compressed bytes after a finished frame
        self._out = memoryview(b"")
        self._eof = False

    def readable(self) -> bool:
        """Always readable."""
        return True

    def readinto(self, buffer: Any) -> int:
        """Fill `buffer` with decompressed bytes (0 at the end of the last frame)."""
        while not self._out and not self._eof:
            self._decode_more()
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decode_more(self) -> None:
        data, self._pending = (self._pending or self._raw.read(_READ_BYTES)), b""
        if not data:
            if self._obj is not None and not self._obj.eof:
                raise EOFError("the file ends inside a zstd frame")
            self._eof = True
            return
        if self._obj is None or self._obj.eof:
            self._obj = self._dctx.decompressobj()
        self._out = memoryview(self._obj.decompress(data))
        if self._obj.eof:
            self._pending = self._obj.unused_data

    def close(self) -> None:
        """Close the file under it."""
        if not self.closed:
            self._raw.close()
        super().close()


def iter_json_lines(path: str | os.PathLike[str]) -> Iterator[tuple[str, Any]]:
    """Each non-blank line of a JSON-lines file, parsed, with its "file:line" for errors.

    A line that is not JSON is one KilnError naming the file and the line.
    """
    name = os.fspath(path)
    with open_binary(path) as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            where = f"{name}:{number}"
            try:
                yield where, json.loads(raw)
            except ValueError as exc:
                raise KilnError(f"{where}: not a JSON object ({exc})") from None


def iter_jsonl_texts(
    path: str | os.PathLike[str],
    field: str = "text",
    on_invalid_utf8: Callable[[int], None] | None = None,
) -> Iterator[str]:
    """Yield the `field` string of each JSON line; a bad line is an error naming file and line.

    Invalid UTF-8 is an error too, unless `on_invalid_utf8` is given: then that line is decoded
    with U+FFFD replacements and the callback receives its line number.
    """
    with open_binary(path) as handle:
        for line_no, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            if on_invalid_utf8 is not None:
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    on_invalid_utf8(line_no)
                    raw = raw.decode("utf-8", errors="replace")
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise KilnError(
                    f"{path}:{line_no}: invalid JSON ({json_error_reason(exc, line_no)})"
                ) from None
            except UnicodeDecodeError as exc:
                raise KilnError(
                    f"{path}:{line_no}: invalid UTF-8 at byte {exc.start} of the line"
                ) from None
            if not isinstance(record, dict) or field not in record:
                raise KilnError(f"{path}:{line_no}: expected an object with a {field!r} field")
            value = record[field]
            if not isinstance(value, str):
                raise KilnError(
                    f"{path}:{line_no}: field {field!r} must be a string, got {type(value).__name__}"
                )
            yield value


def sha256_file(path: str | os.PathLike[str], chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def check_can_write(path: str | os.PathLike[str], force: bool) -> None:
    """Refuse to replace an existing file unless `force` is set; never replace a directory."""
    if os.path.isdir(path):
        raise KilnError(f"{os.fspath(path)} is a directory; expected a file to write")
    if os.path.exists(path) and not force:
        raise KilnError(f"{os.fspath(path)} already exists; pass --force to replace it")


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str], mode: str = "w", encoding: str | None = "utf-8"
) -> Iterator[IO[Any]]:
    """Write to a temporary file beside `path` and rename it into place only on success."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    binary = "b" in mode
    try:
        with os.fdopen(fd, mode, encoding=None if binary else encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates 0600 files; give the artifact the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> None:
    """Serialise `obj` as JSON into `path` atomically."""
    with atomic_write(path, "w") as handle:
        json.dump(obj, handle, indent=indent, ensure_ascii=False)
        handle.write("\n")
