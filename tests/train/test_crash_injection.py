"""SIGKILL `kiln train` while it writes or prunes checkpoints, or truncates metrics.jsonl.

The kill comes from the KILN_TEST_KILL_AT hook (`kiln.io.kill_point`) at a named point of a real
subprocess. After each kill: no partial checkpoint is visible (as a listing, `latest` or
`kiln export --step` sees them), history is intact, and the next start removes every temp and
trash folder (and finishes a prune the kill cut short).
"""

from __future__ import annotations

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


def test_a_partial_step_directory_is_not_a_checkpoint_and_is_removed_at_start(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """What older kilns left when killed mid-prune: step_N with only some of its files."""
    cfg = make_config(*BASE)
    Trainer(cfg, cfg.logging.run_dir).run()
    run = Path(cfg.logging.run_dir)
    checkpoints = run / "checkpoints"
    partial = checkpoints / "step_2"
    partial.mkdir()
    (partial / "state.json").write_bytes((checkpoints / "step_4" / "state.json").read_bytes())
    (partial / "model.safetensors").write_bytes(b"")  # its optimizer.pt already deleted
    alive = checkpoints / f".tmp-step_8-{os.getpid()}"  # a save in progress in a live process
    alive.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    gone = checkpoints / f".tmp-step_8-{dead.stdout.strip()}"
    gone.mkdir()
    (checkpoints / ".latest.abc123.tmp").write_text("step_")

    assert [s for s, _ in ckpt.list_checkpoints(checkpoints)] == [4, 6]
    with pytest.raises(KilnError, match=r"no checkpoint of step 2 \(steps saved: 4, 6\)"):
        find_checkpoint(run, 2)

    trainer = Trainer(cfg, run, resume=True)
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        alive.name,
        "latest",
        "step_4",
        "step_6",
    ]
    assert any(".tmp-step_8-" in note and dead.stdout.strip() in note for note in trainer.notes)
