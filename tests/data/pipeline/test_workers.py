"""`kiln data run --workers 2` killed or terminated mid-run leaves no worker running, and a
terminated run resumes to the uninterrupted output.

The run is caught at a known moment, not raced: with KILN_TEST_WAIT_AT=pool:task-done each worker
finishes one task, writes `<pid>.ready` and waits (`kiln.fault_points.wait_point`), so exactly two tasks
are done when the signal comes. A worker is identified by its PID and its start time, so a PID
reused by an unrelated process is never taken for a survivor (nor killed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.data.pipeline.conftest import write_stories_pipeline
from tests.data.pipeline.test_runner import output_fingerprint

EOT = "<|endoftext|>"
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
Worker = tuple[int, int]  # (pid, start time in clock ticks since boot)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of process `pid` from /proc, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # from field 3 (state) on
    return fields[0], int(fields[1]), int(fields[19])


def _alive(worker: Worker) -> bool:
    """Whether that very process (same PID and start time) still runs."""
    stat = _stat(worker[0])
    return stat is not None and stat[0] != "Z" and stat[2] == worker[1]


@pytest.fixture
def run_setup(shared_data: Path, tmp_path: Path) -> list[str]:
    write_stories_pipeline(shared_data, tmp_path)
    command = [sys.executable, "-m", "kiln.cli", "data", "run", str(tmp_path / "p.toml")]
    return [*command, "--out", str(tmp_path / "out"), "--workers", "2", "--quiet"]


def _start_and_wait_for_workers(
    command: list[str], tmp_path: Path, new_group: bool = False
) -> tuple[subprocess.Popen, list[Worker]]:
    """Start the run and return once both workers have each finished a task and are waiting."""
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "KILN_TEST_WAIT_AT": "pool:task-done", "KILN_TEST_WAIT_DIR": str(ready)}
    # stderr to a file: a surviving worker would hold a pipe open and hang the test's read.
    log = (tmp_path / "stderr.log").open("wb")
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=new_group
    )
    deadline = time.monotonic() + 120  # a bound for a broken run, not a timing: it waits for us
    while len(pids := [int(p.name.partition(".")[0]) for p in ready.glob("*.ready")]) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the run never got its two workers going (rc {proc.wait()})")
        time.sleep(0.02)
    workers = []
    for pid in pids:
        stat = _stat(pid)
        assert stat is not None and stat[1] == proc.pid, f"{pid} is not the run's worker"
        workers.append((pid, stat[2]))
    return proc, workers


def _wait_gone(workers: list[Worker], seconds: float = 15.0) -> list[int]:
    """The workers still alive after a bounded wait (then killed, not to outlive the test)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.05)
    survivors = [w for w in workers if _alive(w)]
    for pid, _ in survivors:  # its start time matched: our worker, never a reused PID
        os.kill(pid, signal.SIGKILL)
    return [pid for pid, _ in survivors]


def test_sigkill_of_the_parent_leaves_no_worker_running(
    run_setup: list[str], tmp_path: Path
) -> None:
    proc, workers = _start_and_wait_for_workers(run_setup, tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    survivors = _wait_gone(workers)
    assert survivors == [], f"workers {survivors} outlived their SIGKILLed parent"


@pytest.mark.parametrize("target", ["parent", "process group"])
def test_sigterm_stops_workers_and_the_rerun_resumes_to_the_same_output(
    run_setup: list[str], tmp_path: Path, target: str
) -> None:
    """SIGTERM to the parent alone (`kill PID`), or to its whole group (what a terminal, a
    container stop or a job scheduler sends): a clean stop, and a resumable state."""
    markers = tmp_path / "out.partial" / "work" / "filter"
    proc, workers = _start_and_wait_for_workers(run_setup, tmp_path, target == "process group")
    assert len(list(markers.glob("*/stats.json"))) == 2  # one task per worker, then they wait
    if target == "parent":
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
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
    assert len(list(markers.glob("*/stats.json"))) == 2  # what the rerun resumes from
    if target == "process group":
        return  # the same state as after the parent's SIGTERM, whose rerun is checked below

    resumed = subprocess.run(run_setup, capture_output=True, text=True, check=True)
    assert "filter: 2 of " in resumed.stderr
    straight = [*run_setup[:-5], "--out", str(tmp_path / "straight"), "--workers", "1", "--quiet"]
    subprocess.run(straight, capture_output=True, check=True)
    assert output_fingerprint(tmp_path / "out") == output_fingerprint(tmp_path / "straight")
