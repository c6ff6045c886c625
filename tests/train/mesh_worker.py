"""Many [parallel] mesh runs in one torchrun process group, for test_mesh.py.

    torchrun --nproc-per-node 4 tests/train/mesh_worker.py PLAN.json

PLAN.json: {"runs": [{"name", "sets": [...], "resume": bool, "raise_at": step or 0,
"start_from": [run dir, step] or absent}, ...]}; start_from copies that checkpoint into the run's
dir first (to resume it on another mesh).
Each run trains configs/tiny.toml with its overrides in its own run dir (a `--set` names it);
rank 0 writes NAME.json (losses, steps, val loss) and NAME.grads.pt (the full gradients of the
first step, under the unsplit model's names) beside PLAN.json. One process group serves every
run: starting 4 processes costs more than the runs themselves on a small machine.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from kiln.train import distributed
from kiln.train.config import load_train_config
from kiln.train.parallelize import FUSED_ORDER, fused_name
from kiln.train.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def whole_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every gradient of this rank's parameters as a full CPU tensor (a collective)."""
    out = {}
    for name, p in trainer.model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = g.detach().cpu().clone()
    return out


def fuse(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split tensors (qkv.q, fc.gate ...) concatenated back under the fused names."""
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    out = {}
    for name, g in grads.items():
        fused = fused_name(name)
        if fused is None:
            out[name] = g
        else:
            parts.setdefault(fused[0], []).append((FUSED_ORDER[fused[1]], g))
    for name, pieces in parts.items():
        out[name] = torch.cat([g for _, g in sorted(pieces, key=lambda t: t[0])])
    return out


def capture_first_gradients(trainer: Trainer, path: Path) -> None:
    """Save the gradients the first optimizer step of `trainer` applies (rank 0 writes `path`)."""
    done: list[bool] = []

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if done:
            return
        done.append(True)
        mine = whole_gradients(trainer)
        every = distributed.gather_to_main(mine, trainer.dist)
        if every is not None:
            merged: dict[str, torch.Tensor] = {}
            for part in every:
                merged.update(part)
            torch.save(fuse(merged), path)

    trainer.optimizer.optimizers[0].register_step_pre_hook(hook)


def train_once(run: dict[str, Any], out: Path) -> None:
    """One run of the plan; rank 0 writes NAME.json."""
    cfg = load_train_config(CONFIGS / "tiny.toml", run["sets"])
    trainer = Trainer(cfg, cfg.logging.run_dir, resume=run.get("resume", False))
    capture_first_gradients(trainer, out / f"{run['name']}.grads.pt")
    if run.get("raise_at"):
        _raise_in_last_stage(trainer, run["raise_at"])
    result = trainer.run()
    if trainer.dist.is_main:
        doc = {"losses": result.losses, "step": result.step, "val_loss": result.val_loss}
        (out / f"{run['name']}.json").write_text(json.dumps(doc), encoding="utf-8")


def _raise_in_last_stage(trainer: Trainer, step: int) -> None:
    """Make the last pipeline rank's stages raise in the forward of step `step`."""
    mesh = trainer.plan.mesh
    if mesh.rank("pp") != mesh.size("pp") - 1:
        return
    for module in trainer.model.blocks.values():
        inner = module.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if trainer.step + 1 == step:
                raise RuntimeError(f"stage raised on purpose at step {step}")
            return _inner(*args, **kwargs)

        module.forward = forward


def start_from(source: Path, step: int, run_dir: Path) -> None:
    """Copy checkpoint step_<step> of `source` into `run_dir` as its latest."""
    checkpoints = run_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / f"step_{step}", checkpoints / f"step_{step}")
    (checkpoints / "latest").write_text(f"step_{step}\n")


def main(argv: list[str]) -> int:
    """Every run of the plan, in order, in this one process group."""
    torch.set_num_threads(int(os.environ.get("KILN_TEST_THREADS", "1")))  # make test-kernels
    plan_file = Path(argv[0])
    plan = json.loads(plan_file.read_text(encoding="utf-8"))
    rank = int(os.environ.get("RANK", "0"))
    for run in plan["runs"]:
        if run.get("start_from") and rank == 0:
            source, step = run["start_from"]
            target = next(
                s.split("=", 1)[1] for s in run["sets"] if s.startswith("logging.run_dir=")
            )
            start_from(Path(source), step, Path(target))
        if tdist.is_initialized():
            tdist.barrier()
        train_once(run, plan_file.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
