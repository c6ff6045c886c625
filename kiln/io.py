"""File I/O shared by every stage: atomic writes, hashing, and readers for compressed inputs."""

from __future__ import annotations

import bz2
import contextlib
import errno
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from kiln.errors import KilnError

COMPRESSED_SUFFIXES = (".gz", ".zst", ".bz2")


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
                raise KilnError(f"{path}:{line_no}: invalid JSON ({exc.msg})") from None
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


def check_can_replace_dir(
    path: str | os.PathLike[str], force: bool, is_ours: Callable[[Path], bool], what: str
) -> bool:
    """Whether output folder `path` exists and may be replaced; refuse anything else clearly.

    A missing or empty folder is fine. An existing one needs `force`, and even then only a
    folder that `is_ours` recognises as `what` (e.g. "a kiln demo run") is replaced: --force
    must never delete a user's unrelated directory. A file in the way is an error. The hidden
    trash an earlier, killed replacement of `path` left beside it is removed first.
    """
    target = Path(path)
    remove_abandoned_trash(target)
    if not target.exists() and not target.is_symlink():
        return False
    if not target.is_dir():
        raise KilnError(f"{target} exists and is not a directory; choose another output folder")
    if not any(target.iterdir()):
        return False
    if not force:
        raise KilnError(f"{target} already exists and is not empty; pass --force to replace it")
    if target.is_symlink() or not is_ours(target):
        raise KilnError(f"{target} exists and is not {what}; refusing to replace it")
    return True


def remove_dir(path: str | os.PathLike[str]) -> None:
    """Delete a directory tree so that it vanishes at once: renamed out of sight, then deleted.

    A kill during the deletion leaves only a hidden `.trash-NAME-PID` folder, never a half
    folder under the real name; the next `remove_dir` of that path (or `check_can_replace_dir`)
    deletes it.
    """
    target = Path(path)
    remove_abandoned_trash(target)
    trash = target.with_name(f".trash-{target.name}-{os.getpid()}")
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(target, trash)
    kill_point("remove:after-rename")
    shutil.rmtree(trash)


def remove_abandoned_trash(path: str | os.PathLike[str]) -> list[Path]:
    """Delete the `.trash-NAME-PID` folders beside `path` that a killed `remove_dir` left."""
    target = Path(path)
    prefix = f".trash-{target.name}-"
    removed = []
    if not target.parent.is_dir():
        return removed
    for entry in target.parent.iterdir():
        pid = entry.name[len(prefix) :]
        if entry.name.startswith(prefix) and pid.isdigit() and abandoned_by(int(pid)):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


_kill_point_hits: dict[str, int] = {}


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists, but is someone else's
        return True
    return True


def abandoned_by(pid: int) -> bool:
    """Whether a leftover named with `pid` is abandoned: that process is gone, or it is us.

    Cleanups run at a command's start, before this process has written anything, so a leftover
    bearing our own PID was left by a dead predecessor that had the same PID (PIDs repeat, e.g.
    in a restarted container whose trainer is PID 7 again).
    """
    return pid == os.getpid() or not pid_alive(pid)


LOCK_NAME = ".lock"
# Real path of a lock file this process holds -> [its descriptor, holders in this process].
_held_locks: dict[str, list[int]] = {}


class FolderLock:
    """This process's hold on a folder's lock (see `lock_folder`); dropped by `release`,
    when the object is collected, or by the OS when the process ends."""

    def __init__(self, key: str) -> None:
        self._finalizer = weakref.finalize(self, _drop_lock, key)

    def release(self) -> None:
        """Let go of the lock (the last holder in this process unlocks the file)."""
        self._finalizer()

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _drop_lock(key: str) -> None:
    entry = _held_locks.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _held_locks[key]
        os.close(entry[0])  # closing the descriptor releases the flock


def lock_folder(folder: str | os.PathLike[str], user: str, kind: str = "folder") -> FolderLock:
    """Hold an exclusive lock on `folder/.lock` (created, with our PID in it) while the result lives.

    Another process holding it is one KilnError naming it, e.g. "run folder X is in use by
    another kiln train (pid N)". Within one process the lock is shared, so a process never locks
    itself out. On a filesystem without flock the folder is used unlocked.
    """
    import fcntl

    path = Path(folder) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(path)
    if key in _held_locks:
        _held_locks[key][1] += 1
        return FolderLock(key)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        pid = f" (pid {holder})" if holder.isdigit() else ""
        raise KilnError(
            f"{kind} {os.fspath(folder)} is in use by another {user}{pid}; wait for it to end "
            "or stop it first"
        ) from None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise KilnError(f"{path}: cannot lock it ({exc.strerror})") from None
        return FolderLock(key)  # no locking on this filesystem: nothing to hold
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    _held_locks[key] = [fd, 1]
    return FolderLock(key)


def kill_point(name: str) -> None:
    """SIGKILL this process at its n-th pass here when KILN_TEST_KILL_AT is `name` or `name@n`.

    The crash-injection tests' hook; without that variable it does nothing.
    """
    point, _, nth = os.environ.get("KILN_TEST_KILL_AT", "").partition("@")
    if point != name:
        return
    _kill_point_hits[name] = _kill_point_hits.get(name, 0) + 1
    if _kill_point_hits[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def wait_point(name: str) -> None:
    """Pause here when KILN_TEST_WAIT_AT is `name`: write `<pid>.ready` into $KILN_TEST_WAIT_DIR
    and wait until a file `go` appears there.

    The tests' hook for catching a run at a known moment (without racing it); without that
    variable it does nothing.
    """
    if os.environ.get("KILN_TEST_WAIT_AT") != name:
        return
    folder = Path(os.environ["KILN_TEST_WAIT_DIR"])
    (folder / f"{os.getpid()}.ready").touch()
    while not (folder / "go").exists():
        time.sleep(0.05)


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
