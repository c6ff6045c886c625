"""torch.distributed training on the CPU: 2 gloo processes started by torchrun on 127.0.0.1.

DDP and FSDP2 runs give the losses of one process with the same global batch (within float
tolerance), a stopped-and-resumed 2-process run equals an uninterrupted one exactly, and an
FSDP checkpoint continues in a single process as it does in two.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from safetensors.torch import load_file

from kiln.errors import KilnError
from kiln.train.config import ConfigError, load_train_config
from kiln.train.distributed import DistInfo
from kiln.train.parallelize import parallel_mode
from kiln.train.trainer import Trainer

from .conftest import CONFIGS, MakeConfig

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("distributed_worker.py")
TOL = {"rel": 1e-5, "abs": 1e-6}  # fp32; only the order of the gradient sums differs

needs_gloo = pytest.mark.skipif(
    not (tdist.is_available() and tdist.is_gloo_available()), reason="no gloo backend"
)


def _torchrun_command(args: list[str], nproc: int) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line and environment for `args` in `nproc` local processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would otherwise pick the hostname's interface
    # --standalone: torchrun's own rendezvous store binds port 0 and hands the port it got to
    # the workers, so no other process can take a port between choosing and binding it.
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--standalone", *args,
    ]  # fmt: skip
    return cmd, env


def _torchrun(args: list[str], nproc: int = 2) -> None:
    """Run `args` (a script or `-m module` and its arguments) in `nproc` local processes."""
    cmd, env = _torchrun_command(args, nproc)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    if done.returncode:
        pytest.fail(
            f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )


def _worker(out: Path, sets: list[str], resume: bool = False, stop_at: int = 0) -> dict[str, Any]:
    """Train with distributed_worker.py in 2 processes; what rank 0 saw."""
    args = [str(WORKER), str(out), *[a for s in sets for a in ("--set", s)]]
    args += ["--resume"] if resume else []
    args += [f"--stop-at={stop_at}"] if stop_at else []
    _torchrun(args)
    return json.loads(out.read_text())


def _sets(dataset: Path, run_dir: Path, *more: str) -> list[str]:
    return [
        f"data.dataset={dataset}",
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        *more,
    ]


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors"))


@pytest.fixture(scope="module")
def ddp_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 steps of configs/tiny.toml with DDP in 2 processes, through `kiln train` itself."""
    run = tmp_path_factory.mktemp("ddp") / "run"
    sets = _sets(tiny_dataset, run, "train.parallel=ddp")
    _torchrun(["-m", "kiln.cli", "train", str(CONFIGS / "tiny.toml"),
               *[a for s in sets for a in ("--set", s)]])  # fmt: skip
    return run


@pytest.fixture(scope="module")
def fsdp_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 steps of configs/tiny.toml with FSDP2 in 2 processes (checkpoints at steps 4 and 8)."""
    run = tmp_path_factory.mktemp("fsdp") / "run"
    _worker(run.parent / "out.json", _sets(tiny_dataset, run, "train.parallel=fsdp"))
    return run


def _single(make_config: MakeConfig, run: str) -> Path:
    cfg = make_config(run=run)
    Trainer(cfg, cfg.logging.run_dir).run()
    return Path(cfg.logging.run_dir)


def _assert_same_curve(a: Path, b: Path) -> None:
    ra, rb = _records(a), _records(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, 9))
    for key in ("loss", "grad_norm", "val_loss", "lr"):
        va, vb = [r.get(key) for r in ra], [r.get(key) for r in rb]
        assert [v is None for v in va] == [v is None for v in vb], key
        assert [v for v in vb if v is not None] == pytest.approx(
            [v for v in va if v is not None], **TOL
        ), key


# Not in `make test-kernels` (torchrun start-up is most of a cell's time); a tolerance test in
# the default run (docs/testing.md).
@needs_gloo
def test_ddp_two_processes_match_one_process(ddp_run: Path, make_config: MakeConfig) -> None:
    single = _single(make_config, "single")
    _assert_same_curve(single, ddp_run)
    wa, wb = _weights(single, 8), _weights(ddp_run, 8)
    assert wa.keys() == wb.keys()  # the same files: the unwrapped model, tied head once
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5)
    state = json.loads((ddp_run / "checkpoints/step_8/state.json").read_text())
    assert set(state["rng"]) == {"0", "1"}  # every rank's RNG states
    assert state["config"]["train"]["parallel"] == "ddp"


@needs_gloo
def test_fsdp_two_processes_match_one_process(fsdp_run: Path, make_config: MakeConfig) -> None:
    single = _single(make_config, "single")
    _assert_same_curve(single, fsdp_run)
    wa, wb = _weights(single, 8), _weights(fsdp_run, 8)
    assert wa.keys() == wb.keys()  # gathered full tensors, the single-process layout
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5)


@needs_gloo
def test_two_process_resume_equals_an_uninterrupted_run(tiny_dataset: Path, tmp_path: Path) -> None:
    """DDP: 3 steps, stop (checkpoint), resume for 5 more == the 8-step run, exactly.

    With dropout, so each rank's own RNG state must come back for the masks to repeat.
    """
    ddp_run = tmp_path / "straight"
    _worker(
        tmp_path / "straight.json",
        _sets(tiny_dataset, ddp_run, "train.parallel=ddp", "model.dropout=0.1"),
    )
    run = tmp_path / "cut"
    sets = _sets(tiny_dataset, run, "train.parallel=ddp", "model.dropout=0.1")
    first = _worker(tmp_path / "first.json", sets, stop_at=3)
    assert first["step"] == 3 and (run / "checkpoints" / "step_3").is_dir()
    second = _worker(tmp_path / "second.json", sets, resume=True)
    assert second["step"] == 8
    straight = [r["loss"] for r in _records(ddp_run)]
    assert first["losses"] + second["losses"] == straight
    assert [r.get("val_loss") for r in _records(run)] == [
        r.get("val_loss") for r in _records(ddp_run)
    ]
    wa, wb = _weights(ddp_run, 8), _weights(run, 8)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa = json.loads((ddp_run / "checkpoints/step_8/state.json").read_text())
    sb = json.loads((run / "checkpoints/step_8/state.json").read_text())
    assert sa["cursor"] == sb["cursor"] and sa["rng"] == sb["rng"]


@needs_gloo
def test_fsdp_checkpoint_continues_in_one_process(
    fsdp_run: Path, tiny_dataset: Path, tmp_path: Path, make_config: MakeConfig
) -> None:
    """The 2-process FSDP checkpoint of step 4 resumes in 1 process like the 2-process run."""
    run = tmp_path / "one"
    shutil.copytree(fsdp_run / "checkpoints" / "step_4", run / "checkpoints" / "step_4")
    (run / "checkpoints" / "latest").write_text("step_4\n")
    cfg = make_config("train.parallel=fsdp", run="one")
    trainer = Trainer(cfg, run, resume=True)
    assert trainer.step == 4 and trainer.dist.world_size == 1 and trainer.accum == 2
    result = trainer.run()
    two = [r["loss"] for r in _records(fsdp_run)][4:]
    assert result.losses == pytest.approx(two, **TOL)
    assert result.val_loss == pytest.approx(_records(fsdp_run)[-1]["val_loss"], **TOL)


@needs_gloo
def test_fsdp_two_process_resume_equals_an_uninterrupted_run(
    fsdp_run: Path, tiny_dataset: Path, tmp_path: Path
) -> None:
    """FSDP: resuming the sharded run from its step-4 checkpoint repeats steps 5-8 exactly."""
    run = tmp_path / "cut"
    shutil.copytree(fsdp_run / "checkpoints" / "step_4", run / "checkpoints" / "step_4")
    (run / "checkpoints" / "latest").write_text("step_4\n")
    sets = _sets(tiny_dataset, run, "train.parallel=fsdp")
    second = _worker(tmp_path / "second.json", sets, resume=True)
    assert second["losses"] == [r["loss"] for r in _records(fsdp_run)][4:]
    wa, wb = _weights(fsdp_run, 8), _weights(run, 8)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# ---- without processes ------------------------------------------------------------------------


def test_dist_info_from_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert DistInfo.from_env() == DistInfo(0, 1, 0)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert DistInfo.from_env() == DistInfo(3, 4, 1)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(KilnError, match=r"RANK=4 is not in \[0, WORLD_SIZE=4\)"):
        DistInfo.from_env()


def test_parallel_mode_and_its_config(tiny_dataset: Path) -> None:
    def cfg(mode: str) -> Any:
        sets = [f"data.dataset={tiny_dataset}", f"train.parallel={mode}"]
        return load_train_config(CONFIGS / "tiny.toml", sets)

    assert parallel_mode(cfg("fsdp"), DistInfo()) == "none"  # one process: nothing to wrap
    assert parallel_mode(cfg("auto"), DistInfo(0, 2)) == "ddp"
    assert parallel_mode(cfg("fsdp"), DistInfo(1, 2)) == "fsdp"
    with pytest.raises(KilnError, match="'none' with 2 processes"):
        parallel_mode(cfg("none"), DistInfo(0, 2))
    with pytest.raises(ConfigError, match=r"train\.parallel"):
        cfg("zero3")


@needs_gloo
def test_two_processes_agree_on_a_time_budget_and_the_dtype(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    """Each rank times its own steps; they must plan the same steps, or one would hang."""
    run = tmp_path / "run"
    sets = _sets(tiny_dataset, run, "train.time_budget=1", "train.max_steps=none",
                 "train.dtype=auto", "eval.every=0", "checkpoint.every=0")  # fmt: skip
    seen = _worker(tmp_path / "out.json", sets)
    records = _records(run)
    assert seen["world_size"] == 2 and seen["step"] == records[-1]["step"] >= 1
    assert records[-1]["max_steps"] == seen["step"]  # ended where its last plan said
    assert records[0]["precision"]["requested"] == "auto"
