"""Output folders: what a command may replace, how it removes one, who holds one, and what a
killed run left beside it.

Every leftover is named with the PID of the process that made it, so a later start can tell an
abandoned one (that process is gone) from one a live process is still writing.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.fault_points import kill_point


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


def remove_entry(path: Path) -> None:
    """Delete a leftover, folder or file (a symlink is removed, never followed); no error if gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
            remove_entry(entry)
            removed.append(entry)
    return removed


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


STAGE_STATE = "stages.json"


def open_stage_state(
    out: Path, settings: dict[str, Any], resume: bool, force: bool, marker: str, command: str
) -> dict[str, Any]:
    """A staged run's stages.json: the one to resume (same settings), or a fresh run folder.

    `marker` is the file that says `command` made the folder, so --force replaces only such
    folders; a resume with other `settings` than the run started with is refused, naming the
    flag.
    """
    from kiln.io import write_json_atomic

    state_path = out / STAGE_STATE
    if resume:
        if not state_path.is_file() or not (out / marker).is_file():
            raise KilnError(f"--resume: {out} is not a `{command}` run (no {STAGE_STATE})")
        state = json.loads(state_path.read_text(encoding="utf-8"))
        for key, value in settings.items():
            if state["settings"].get(key) != value:
                flag = "--" + key.replace("_", "-")
                raise KilnError(
                    f"--resume: {out} was started with {flag} {state['settings'].get(key)!r}, "
                    f"not {value!r}; resume with the same flags or start over with --force"
                )
        return state
    if check_can_replace_dir(
        out, force, lambda p: (p / marker).is_file(), f"a {command} run folder"
    ):
        remove_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / marker).write_text(
        f"made by `{command}`; `{command} --force` may replace this folder\n", encoding="utf-8"
    )
    state: dict[str, Any] = {"settings": settings, "stages": {}}
    write_json_atomic(state_path, state)
    return state


def run_stages(
    out: Path, state: dict[str, Any], stages: Sequence[str], do: Callable[[str, bool], None]
) -> None:
    """Run each stage not yet done (`do(stage, resuming)`), saving stages.json around it.

    A killed or failed stage keeps the seconds it spent, so the time table counts every attempt.
    """
    import time

    from kiln.io import write_json_atomic

    for stage in stages:
        record = state["stages"].setdefault(stage, {"status": "pending", "seconds": 0.0})
        if record["status"] == "done":
            print(f"\n[{stage}] done earlier ({record['seconds'] / 60:.1f} min): skipped")
            continue
        resuming = record["status"] == "running"
        record["status"] = "running"
        write_json_atomic(out / STAGE_STATE, state)
        print(f"\n[{stage}] {'resuming' if resuming else 'starting'}", flush=True)
        t0 = time.perf_counter()
        try:
            do(stage, resuming)
            record["status"] = "done"
        finally:
            record["seconds"] = record["seconds"] + time.perf_counter() - t0
            write_json_atomic(out / STAGE_STATE, state)
