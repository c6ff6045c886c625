"""Atomic writes: all or nothing, ordinary permissions, no clobbering without force."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.folders import abandoned_by, check_can_replace_dir, lock_folder, pid_alive, remove_dir
from kiln.io import atomic_write, check_can_write, open_binary
from tests.fixtures import dead_pid

ROOT = Path(__file__).resolve().parents[1]


def test_atomic_write_leaves_nothing_on_failure(tmp_path) -> None:
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_write(target) as handle:
        handle.write("partial")
        raise RuntimeError("boom")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.json"]


def test_atomic_write_uses_umask_permissions(tmp_path) -> None:
    target = tmp_path / "out.txt"
    with atomic_write(target) as handle:
        handle.write("x")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask


def test_refuses_to_clobber_without_force(tmp_path) -> None:
    target = tmp_path / "a"
    target.write_text("x")
    with pytest.raises(KilnError, match="--force"):
        check_can_write(target, force=False)
    check_can_write(target, force=True)


def test_open_binary_errors_name_the_path(tmp_path) -> None:
    with pytest.raises(KilnError, match=r"missing\.txt: no such file"):
        open_binary(tmp_path / "missing.txt")
    with pytest.raises(KilnError, match="is a directory"):
        open_binary(tmp_path)


def test_jsonl_errors_name_file_and_line(tmp_path) -> None:
    from kiln.io import iter_jsonl_texts

    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "bad \xff"}\n')
    with pytest.raises(KilnError, match=r"d\.jsonl:2: invalid UTF-8"):
        list(iter_jsonl_texts(path))
    path.write_bytes(b'{"text": "ok"}\n\n{"body": "x"}\n')
    with pytest.raises(KilnError, match=r"d\.jsonl:3: expected an object with a 'text' field"):
        list(iter_jsonl_texts(path))
    path.write_bytes(b'{"text": 3}\n')
    with pytest.raises(KilnError, match=r"d\.jsonl:1: field 'text' must be a string"):
        list(iter_jsonl_texts(path))
    path.write_bytes(b"{not json\n")
    with pytest.raises(KilnError, match=r"d\.jsonl:1: invalid JSON"):
        list(iter_jsonl_texts(path))


HOLD = """
import sys, time
from kiln.folders import lock_folder
hold = lock_folder(sys.argv[1], "kiln train", "run folder")
print("locked", flush=True)
time.sleep(60)
"""


def test_a_folder_lock_held_by_another_process_is_one_clear_error_until_it_ends(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(KilnError, match=rf"in use by another kiln train \(pid {holder.pid}\)"):
            lock_folder(tmp_path, "kiln train", "run folder")
    finally:
        holder.kill()
        holder.wait()
    with lock_folder(tmp_path, "kiln train") as hold:  # the OS dropped the dead holder's lock
        assert lock_folder(tmp_path, "kiln train") is not hold  # shared within one process
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
    # Released: another process can take it now.
    again = subprocess.run(
        [sys.executable, "-c", HOLD.replace("time.sleep(60)", ""), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert again.stdout.strip() == "locked", again.stderr


def test_remove_dir_and_the_next_replacement_clear_a_killed_removals_trash(
    tmp_path: Path, live_pid: int
) -> None:
    """`remove_dir` killed mid-deletion leaves `.trash-NAME-PID`: the next `kiln demo` (its
    check) or `remove_dir` of that name deletes it once that process is gone."""
    target = tmp_path / "demo"
    dead, live = tmp_path / f".trash-demo-{dead_pid()}", tmp_path / f".trash-demo-{live_pid}"
    other = tmp_path / f".trash-other-{dead_pid()}"  # another folder's: not this name's
    for path in (dead, live, other):
        (path / "sub").mkdir(parents=True)
    check_can_replace_dir(target, False, lambda p: True, "x")  # `kiln demo` without --force
    assert not dead.exists() and live.is_dir() and other.is_dir()
    (dead / "sub").mkdir(parents=True)
    (target / "f").parent.mkdir()
    (target / "f").write_text("x")
    remove_dir(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


def test_a_leftover_bearing_our_own_pid_is_abandoned(live_pid: int) -> None:
    assert abandoned_by(os.getpid())  # cleanups run before this process wrote anything
    assert abandoned_by(dead_pid())
    assert not abandoned_by(live_pid)
    assert pid_alive(os.getpid()) and pid_alive(live_pid)
