"""`kiln data run --workers 2` killed or terminated mid-run leaves no worker running, and a
terminated run resumes to the uninterrupted output."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.data.pipeline.test_runner import _fingerprint

EOT = "<|endoftext|>"
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _stat(int(entry)) is not None:
            state, ppid = _stat(int(entry))  # type: ignore[misc]
            if ppid == pid and state != "Z":
                found.append(int(entry))
    return found


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


@pytest.fixture
def run_setup(shared_data: Path, tmp_path: Path) -> list[str]:
    with gzip.open(shared_data / "tinystories" / "train.txt.gz", "rt", encoding="utf-8") as f:
        text = f.read(300_000)
    (tmp_path / "stories.txt").write_text(text[: text.rfind(EOT)], encoding="utf-8")
    (tmp_path / "p.toml").write_text(
        f"""
docs_per_task = 2
[[sources]]
name = "stories"
paths = ["stories.txt"]
[tokenize]
tokenizer = "{shared_data}/gpt2/vocab.json"
""",
        encoding="utf-8",
    )
    command = [sys.executable, "-m", "kiln.cli", "data", "run", str(tmp_path / "p.toml")]
    return [*command, "--out", str(tmp_path / "out"), "--workers", "2", "--quiet"]


def _start_and_wait_for_workers(
    command: list[str], markers: Path
) -> tuple[subprocess.Popen, list[int]]:
    # stderr to a file: a surviving worker would hold a pipe open and hang the test's read.
    log = (markers.parents[2] / "stderr.log").open("wb")
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while proc.poll() is None and time.monotonic() < deadline:
        workers = _children(proc.pid)
        if len(workers) >= 2 and len(list(markers.glob("*/stats.json"))) >= 2:
            return proc, workers
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"the run never got its two workers going (rc {proc.poll()})")


def _wait_gone(pids: list[int], seconds: float = 15.0) -> list[int]:
    """The pids still alive after a bounded wait (killed then, not to outlive the test)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    survivors = [p for p in pids if _alive(p)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    return survivors


def test_sigkill_of_the_parent_leaves_no_worker_running(
    run_setup: list[str], tmp_path: Path
) -> None:
    markers = tmp_path / "out.partial" / "work" / "filter"
    proc, workers = _start_and_wait_for_workers(run_setup, markers)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    survivors = _wait_gone(workers)
    assert survivors == [], f"workers {survivors} outlived their SIGKILLed parent"


def test_sigterm_stops_workers_and_the_rerun_resumes_to_the_same_output(
    run_setup: list[str], tmp_path: Path
) -> None:
    markers = tmp_path / "out.partial" / "work" / "filter"
    proc, workers = _start_and_wait_for_workers(run_setup, markers)
    os.kill(proc.pid, signal.SIGTERM)
    try:
        rc = proc.wait(timeout=30)  # prompt: not after the remaining tasks have run
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("SIGTERM did not stop the run") from None
    assert _wait_gone(workers) == []
    stderr = (tmp_path / "stderr.log").read_text()
    assert rc == 130, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr
    assert not (tmp_path / "out").exists()
    done_before = len(list(markers.glob("*/stats.json")))

    resumed = subprocess.run(run_setup, capture_output=True, text=True, check=True)
    assert f"filter: {done_before} of " in resumed.stderr
    straight = [*run_setup[:-5], "--out", str(tmp_path / "straight"), "--workers", "1", "--quiet"]
    subprocess.run(straight, capture_output=True, check=True)
    assert _fingerprint(tmp_path / "out") == _fingerprint(tmp_path / "straight")
