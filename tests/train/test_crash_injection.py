"""SIGKILL `kiln train` while it writes or prunes checkpoints, or truncates metrics.jsonl.

The kill comes from the KILN_TEST_KILL_AT hook (`kiln.fault_points.kill_point`) at a named point of a real
subprocess. After each kill: no partial checkpoint is visible (as a listing, `latest` or
`kiln export --step` sees them), history is intact, and the next start removes every temp and
trash folder (and finishes a prune the kill cut short).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.errors import KilnError
from kiln.loading import find_checkpoint
from kiln.train import checkpoint as ckpt
from kiln.train.trainer import Trainer
from tests.fixtures import dead_pid

from .conftest import CONFIGS, MakeConfig

ROOT = Path(__file__).resolve().parents[2]
FILES = {"model.safetensors", "optimizer.pt", "state.json"}
# Six steps, a checkpoint every two, no eval or samples: each subprocess takes ~2 s.
BASE = ("eval.batches=0", "eval.sample_tokens=0", "checkpoint.every=2", "train.max_steps=6")


def _kiln_train(dataset: Path, run: Path, kill_at: str, *sets: str, resume: bool = False) -> int:
    """Run `kiln train` in a subprocess with the kill hook armed; returns its exit status."""
    argv = [sys.executable, "-m", "kiln.cli", "train", str(CONFIGS / "tiny.toml"), "--no-progress"]
    for assignment in (f"data.dataset={dataset}", f"logging.run_dir={run}", *BASE, *sets):
        argv += ["--set", assignment]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KILN_TEST_KILL_AT": kill_at}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [*argv, *(["--resume"] if resume else [])], env=env, capture_output=True, timeout=300
    )
    return done.returncode


def _visible(checkpoints: Path) -> list[int]:
    """The steps of every `step_N` directory there, each asserted complete."""
    steps = []
    for entry in sorted(checkpoints.iterdir()):
        if entry.name.startswith("step_"):
            assert {p.name for p in entry.iterdir()} == FILES, f"partial {entry.name}"
            steps.append(int(entry.name[5:]))
    assert [s for s, _ in ckpt.list_checkpoints(checkpoints)] == sorted(steps)
    return sorted(steps)


def _hidden(checkpoints: Path) -> list[str]:
    return sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize(
    ("kill_at", "keep_last", "visible", "latest", "leftover"),
    [
        # The second save (step 4): after the weights, before state.json / before the rename.
        ("save:mid-write@2", 2, [2], 2, ".tmp-step_4-"),
        ("save:before-rename@2", 2, [2], 2, ".tmp-step_4-"),
        # Renamed but `latest` not yet moved: the new one is complete, `latest` the old one.
        ("save:after-rename@2", 2, [2, 4], 2, None),
        # Pruning step_2 at the second save: renamed out of sight, not yet deleted.
        ("prune:after-rename@1", 1, [4], 4, ".trash-step_2-"),
    ],
)
def test_a_kill_while_saving_or_pruning_never_shows_a_partial_checkpoint(
    tiny_dataset: Path,
    make_config: MakeConfig,
    tmp_path: Path,
    kill_at: str,
    keep_last: int,
    visible: list[int],
    latest: int,
    leftover: str | None,
) -> None:
    run = tmp_path / "run"
    keep = f"checkpoint.keep_last={keep_last}"
    assert _kiln_train(tiny_dataset, run, kill_at, keep) == -signal.SIGKILL
    checkpoints = run / "checkpoints"
    assert _visible(checkpoints) == visible
    assert ckpt.latest_checkpoint(checkpoints) == checkpoints / f"step_{latest}"
    hidden = _hidden(checkpoints)
    assert [h.rpartition("-")[0] + "-" for h in hidden] == ([leftover] if leftover else [])
    with pytest.raises(KilnError, match=r"no checkpoint of step 6"):
        find_checkpoint(run, 6)  # what `kiln export --step 6` says
    assert find_checkpoint(run, visible[-1]) == checkpoints / f"step_{visible[-1]}"

    # The next start cleans up, resumes from `latest` and finishes normally.
    cfg = make_config(*BASE, keep)
    trainer = Trainer(cfg, run, resume=True)
    assert _hidden(checkpoints) == [] and trainer.step == latest
    assert trainer.run().step == 6
    assert _visible(checkpoints) == [4, 6][-keep_last:]
    assert _hidden(checkpoints) == []


@pytest.mark.parametrize(
    "kill_at",
    [
        "save:before-prune@3",  # the final save, before its prune: step_4 stays
        "prune:after-rename@2",  # the final save's prune, step_4 renamed but not deleted
    ],
)
def test_a_kill_after_the_final_save_is_tidied_by_a_resume_with_nothing_to_do(
    tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kill_at: str
) -> None:
    run = tmp_path / "run"
    assert _kiln_train(tiny_dataset, run, kill_at, "checkpoint.keep_last=1") == -signal.SIGKILL
    checkpoints = run / "checkpoints"
    assert _visible(checkpoints)[-1] == 6
    assert ckpt.latest_checkpoint(checkpoints) == checkpoints / "step_6"

    argv = ["train", str(CONFIGS / "tiny.toml"), "--no-progress", "--resume"]
    for assignment in (f"data.dataset={tiny_dataset}", f"logging.run_dir={run}", *BASE):
        argv += ["--set", assignment]
    assert main([*argv, "--set", "checkpoint.keep_last=1"]) == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out and f"checkpoint {checkpoints / 'step_6'};" in out
    assert "checkpoint None" not in out
    assert _visible(checkpoints) == [6]
    assert _hidden(checkpoints) == []


def test_a_kill_while_truncating_metrics_keeps_the_history(
    tiny_dataset: Path, make_config: MakeConfig, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    # Killed while saving step 4: metrics.jsonl has steps 1-4, the last checkpoint is step 2.
    assert _kiln_train(tiny_dataset, run, "save:before-rename@2") == -signal.SIGKILL
    metrics = run / "metrics.jsonl"
    history = metrics.read_bytes()
    assert history.count(b"\n") == 4
    # The resume must drop steps 3-4; it is killed just before the truncated copy replaces them.
    assert _kiln_train(tiny_dataset, run, "metrics:before-rename", resume=True) == -signal.SIGKILL
    assert metrics.read_bytes() == history
    assert [p.name for p in run.glob(".metrics.jsonl.*.tmp")]  # the unfinished copy, aside

    trainer = Trainer(make_config(*BASE), run, resume=True)
    assert [p.name for p in run.iterdir() if p.name.startswith(".metrics")] == []
    assert metrics.read_bytes().count(b"\n") == 2
    trainer.run()
    assert [r["step"] for r in trainer.metrics.read()] == [1, 2, 3, 4, 5, 6]


def test_an_incomplete_step_directory_is_not_a_checkpoint_and_its_weights_are_kept(
    make_config: MakeConfig, tmp_path: Path, live_pid: int
) -> None:
    """A user who deleted optimizer.pt to save disk keeps the weights; what older kilns left
    when killed mid-prune (nothing, or only a partial state) is removed at start, as are the
    temp folders of processes that are gone or bear our own PID (a dead predecessor's)."""
    cfg = make_config(*BASE)
    Trainer(cfg, cfg.logging.run_dir).run()
    run = Path(cfg.logging.run_dir)
    checkpoints = run / "checkpoints"
    weights = checkpoints / "step_2"  # complete once, then its optimizer.pt deleted by the user
    weights.mkdir()
    for name in ("model.safetensors", "state.json"):
        (weights / name).write_bytes((checkpoints / "step_4" / name).read_bytes())
    (checkpoints / "step_1").mkdir()  # older kilns' in-place prune: emptied...
    (checkpoints / "step_3").mkdir()  # ...or down to its state
    (checkpoints / "step_3" / "optimizer.pt").write_bytes(b"")
    (checkpoints / "step_3" / "state.json").write_bytes(b"{}")
    alive = checkpoints / f".tmp-step_8-{live_pid}"  # a save in progress in a live process
    alive.mkdir()
    gone = checkpoints / f".tmp-step_8-{dead_pid()}"
    gone.mkdir()
    ours = checkpoints / f".tmp-step_9-{os.getpid()}"  # a dead predecessor with our PID
    ours.mkdir()
    (checkpoints / ".latest.abc123.tmp").write_text("step_")

    assert [s for s, _ in ckpt.list_checkpoints(checkpoints)] == [4, 6]
    with pytest.raises(KilnError, match=r"no checkpoint of step 2 \(steps saved: 4, 6\)"):
        find_checkpoint(run, 2)

    trainer = Trainer(cfg, run, resume=True)
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        alive.name,
        "latest",
        "step_2",
        "step_4",
        "step_6",
    ]
    assert sorted(p.name for p in weights.iterdir()) == ["model.safetensors", "state.json"]
    assert [s for s, _ in ckpt.list_checkpoints(checkpoints)] == [4, 6]
    assert any(gone.name in note for note in trainer.notes)
    assert any(ours.name in note for note in trainer.notes)
    assert f"{weights} is incomplete (no optimizer.pt): not a checkpoint, left in place" in (
        trainer.notes
    )
    trainer.run()  # prunes with keep_last, and never the kept weights
    assert (weights / "model.safetensors").is_file()


def test_a_second_trainer_on_a_live_run_folder_is_refused_and_touches_nothing(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """The run lock: while another process trains in the folder (here: holds its lock), a
    second trainer says so in one error and deletes none of the live run's temp files."""
    cfg = make_config(*BASE)
    run = Path(cfg.logging.run_dir)
    Trainer(cfg, run).run()
    gc.collect()  # the finished Trainer's hold on the lock
    checkpoints = run / "checkpoints"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        live = [
            checkpoints / f".tmp-step_8-{holder.pid}",
            checkpoints / f".trash-step_2-{holder.pid}",
        ]
        for path in live:
            path.mkdir()
        (checkpoints / ".latest.live.tmp").write_text("step_")
        with pytest.raises(KilnError) as refused:
            Trainer(cfg, run, resume=True)
        assert str(refused.value) == (
            f"run folder {run} is in use by another kiln train (pid {holder.pid}); "
            "wait for it to end or stop it first"
        )
        assert all(path.is_dir() for path in live)
        assert (checkpoints / ".latest.live.tmp").is_file()
    finally:
        holder.kill()
        holder.wait()
    trainer = Trainer(cfg, run, resume=True)  # the holder is gone: the lock went with it
    assert _hidden(checkpoints) == []
    assert trainer.step == 6


# What a live `kiln train` holds: an exclusive flock on <run_dir>/.lock, its PID inside.
HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(os.path.join(sys.argv[1], ".lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.ftruncate(fd, 0)
os.write(fd, f"{os.getpid()}\\n".encode())
print("locked", flush=True)
time.sleep(60)
"""


def test_a_kill_before_the_first_latest_is_written_still_resumes(
    tiny_dataset: Path, make_config: MakeConfig, tmp_path: Path
) -> None:
    """Killed after step_2 is renamed into place, before the first `latest`: a complete step_2,
    no pointer. A fresh start must point at --resume, and --resume must continue from step_2."""
    run = tmp_path / "run"
    assert _kiln_train(tiny_dataset, run, "save:after-rename@1") == -signal.SIGKILL
    checkpoints = run / "checkpoints"
    assert _visible(checkpoints) == [2]
    assert not (checkpoints / ckpt.LATEST).exists()

    with pytest.raises(KilnError, match="pass --resume"):
        Trainer(make_config(*BASE), run)
    trainer = Trainer(make_config(*BASE), run, resume=True)
    assert trainer.step == 2
    assert ckpt.latest_checkpoint(checkpoints) == checkpoints / "step_2"
    assert any("now names step_2" in note for note in trainer.notes)
    assert _hidden(checkpoints) == []
    assert trainer.run().step == 6
