"""What `kiln data tokenize` leaves on disk: no build folder of a killed run survives the next
one, the dataset's mode follows the umask, identical runs give identical bytes, and replaced
invalid UTF-8 is reported on the console."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kiln.cli
from tests.data.conftest import EOT


def _tokenize(tok: Path, inputs: list[Path], out: Path, *extra: str) -> int:
    argv = ["data", "tokenize", "--tokenizer", str(tok), *map(str, inputs), "--out", str(out)]
    return kiln.cli.main([*argv, "--quiet", *extra])


def test_a_killed_runs_build_folder_is_removed_by_the_next_run(
    shared_data: Path, tmp_path: Path, tiny_tokenizer_file: Path, live_pid: int
) -> None:
    out = tmp_path / "ds"
    command = [sys.executable, "-m", "kiln.cli", "data", "tokenize"]
    command += ["--tokenizer", str(tiny_tokenizer_file), "--workers", "1", "--quiet"]
    command += [str(shared_data / "tinystories" / "train.txt.gz"), "--out", str(out)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".ds.*.tmp")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "tokenize finished before it could be killed"
    leftovers = list(tmp_path.glob(".ds.*.tmp"))
    assert len(leftovers) == 1 and f".{proc.pid}." in leftovers[0].name
    live = tmp_path / f".ds.{live_pid}.abcd1234.tmp"  # a build still running: kept
    live.mkdir()
    # Our own PID on a leftover: a dead predecessor's (PIDs repeat), removed.
    (tmp_path / f".ds.{os.getpid()}.abcd1234.tmp").mkdir()

    small = tmp_path / "a.txt"
    small.write_text(f"one document\n{EOT}\nanother\n{EOT}\n", encoding="utf-8")
    assert _tokenize(tiny_tokenizer_file, [small], out) == 0
    assert sorted(p.name for p in tmp_path.glob(".ds.*")) == [live.name]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_dataset_folder_mode_follows_the_umask(tmp_path, tiny_tokenizer_file, umask) -> None:
    src = tmp_path / "a.txt"
    src.write_text(f"one document\n{EOT}\n", encoding="utf-8")
    old = os.umask(umask)
    try:
        assert _tokenize(tiny_tokenizer_file, [src], tmp_path / "ds") == 0
    finally:
        os.umask(old)
    assert (tmp_path / "ds").stat().st_mode & 0o777 == 0o777 & ~umask


def test_identical_runs_differ_only_in_created_unless_source_date_epoch_is_set(
    tmp_path, tiny_tokenizer_file, monkeypatch
) -> None:
    src = tmp_path / "a.txt"
    src.write_text("".join(f"document {i}\n{EOT}\n" for i in range(20)), encoding="utf-8")
    out = tmp_path / "ds"

    def build(epoch: str | None) -> dict[str, bytes]:
        if epoch is None:
            monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
        else:
            monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)
        assert _tokenize(tiny_tokenizer_file, [src], out, "--force") == 0
        return {p.name: p.read_bytes() for p in sorted(out.iterdir())}

    first = build("1700000000")
    assert b'"created": "2023-11-14T22:13:20+00:00"' in first["manifest.json"]
    assert build("1700000000") == first  # the whole folder, byte for byte
    later = build(None)
    assert {k for k in first if first[k] != later[k]} <= {"manifest.json"}
    a, b = json.loads(first["manifest.json"]), json.loads(later["manifest.json"])
    a.pop("created"), b.pop("created")
    assert a == b


def test_invalid_utf8_is_warned_about_with_file_and_byte_offset(
    capsys, tmp_path, tiny_tokenizer_file
) -> None:
    src = tmp_path / "bad.txt"
    good = f"fine document\n{EOT}\n".encode()
    src.write_bytes(good + b"caf\xe9 au lait\n" + EOT.encode() + b"\n")
    assert _tokenize(tiny_tokenizer_file, [src], tmp_path / "ds") == 0
    err = capsys.readouterr().err
    assert f"warning: {src}: invalid UTF-8 in 1 document(s)" in err
    assert f"byte offset {len(good) + 3}" in err
