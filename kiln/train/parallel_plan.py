"""How one run spreads over its processes: the one object the training loop asks.

Every run has a `ParallelPlan`, and every plan has a `Mesh` (parallelize.py): one process is the
degenerate mesh (every size 1), DDP a mesh of `dp_replicate` = world size, 1-D FSDP one of
`dp_shard` = world size, a [parallel] run its own mesh. So the loop reads the same for all of
them: the loader reads by data-parallel rank, the step's loss and gradient norm are summed over
the mesh's groups, the val loss over the ranks that own a loss. What differs is done once here:
how the model is wrapped (`apply`), whether a step is a pipeline step (`microbatches`), and the
checkpoint format (whole files gathered to rank 0, or DCP shards for a [parallel] run).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from kiln.checkpoint_format import is_sharded_checkpoint, step_dir
from kiln.errors import KilnError
from kiln.train import checkpoint as ckpt
from kiln.train import distributed
from kiln.train import parallelize as mesh_ops
from kiln.train import sharded_checkpoint as sharded
from kiln.train.config import TrainConfig
from kiln.train.distributed import DistInfo
from kiln.train.parallelize import Mesh


@dataclass
class ParallelPlan:
    """This run's parallelism: its mode ("none", "ddp", "fsdp" or "mesh") and mesh."""

    mode: str
    mesh: Mesh
    dist: DistInfo
    microbatches: int = 1  # micro-batches of one pipeline step (parallel.pp > 1), else 1

    @classmethod
    def build(
        cls, cfg: TrainConfig, dist: DistInfo, device: torch.device, resume_from: Path | None
    ) -> ParallelPlan:
        """The plan of `cfg` on these processes (a sharded checkpoint must resume on a mesh)."""
        mode = mesh_ops.parallel_mode(cfg, dist)
        if resume_from is not None and is_sharded_checkpoint(resume_from) and mode != "mesh":
            raise KilnError(
                f"{resume_from} is a sharded checkpoint: resume it with train.parallel = 'mesh' "
                "(on any mesh shape or number of processes)"
            )
        if mode == "mesh":
            return cls(mode, mesh_ops.build_mesh(cfg, dist.world_size, device), dist)
        dim = {"ddp": "dp_replicate", "fsdp": "dp_shard"}.get(mode)
        shape = {d: 1 for d in mesh_ops.MESH_DIMS}
        coords = {d: 0 for d in mesh_ops.MESH_DIMS}
        if dim is not None:
            shape[dim], coords[dim] = dist.world_size, dist.rank
        return cls(mode, Mesh(shape, None, coords), dist)

    @property
    def pipelined(self) -> bool:
        """Whether one step is a pipeline step over stages (parallel.pp > 1)."""
        return self.mesh.size("pp") > 1

    @property
    def whole_on_main(self) -> bool:
        """Whether rank 0 holds every weight unsharded (so it can decode samples alone)."""
        return self.mode in ("none", "ddp") or (self.mode == "mesh" and self.dist.world_size == 1)

    def describe(self) -> str | None:
        """A line for the log when the run uses a [parallel] mesh, else None."""
        return self.mesh.describe() if self.mode == "mesh" else None

    def split_accumulation(self, accum: int) -> int:
        """The loop's micro-steps per optimizer step: `accum`, or 1 pipeline step of them all."""
        if not self.pipelined:
            return accum
        self.microbatches = accum
        return 1

    def apply(self, model: nn.Module, cfg: TrainConfig) -> tuple[nn.Module, Any]:
        """(this rank's modules: what the optimizer and checkpoints see, what the loop calls)."""
        if self.mode == "mesh":
            return parallelize_for_mesh(model, cfg, self.mesh, self.microbatches)
        return model, mesh_ops.parallelize_1d(model, cfg, self.mode, self.dist.world_size)

    def loss_and_clip(
        self, local_mean: Tensor, params: list[nn.Parameter], max_norm: float
    ) -> tuple[float, Tensor]:
        """(the step's global mean loss, the global gradient norm), clipped if max_norm > 0."""
        return mesh_ops.loss_and_clip(local_mean, params, max_norm, self.mesh)

    def loss_sum(self, local: Tensor) -> float:
        """The sum of `local` over the ranks that own a loss (one per data-parallel rank)."""
        return mesh_ops.loss_ranks_sum(local, self.mesh)

    def save(
        self,
        checkpoints: Path,
        model: nn.Module,
        optimizer: Any,
        state: ckpt.TrainState,
        scheduler: dict[str, Any],
        cfg: TrainConfig,
    ) -> Path:
        """Checkpoint this step: every rank takes part, in the plan's format (`state.rng` set here)."""
        if self.mode == "mesh":  # every rank writes its own shards (sharded_checkpoint.py)
            return sharded.save(
                checkpoints, model, optimizer, state, scheduler, cfg.checkpoint.keep_last,
                self.dist, cfg.parallel.async_checkpoint,
            )  # fmt: skip
        # Collectives first, in the same order on every rank; then rank 0 writes alone.
        tensors = ckpt.full_model_state(model, self.dist.is_main)
        optim_state = ckpt.full_optimizer_state(optimizer)
        rngs = distributed.gather_to_main(ckpt.capture_rng(), self.dist)
        path = step_dir(checkpoints, state.step)
        if self.dist.is_main:
            assert rngs is not None
            state.rng = {str(rank): rng for rank, rng in enumerate(rngs)}
            path = ckpt.save_checkpoint(
                checkpoints, tensors, optim_state, state, scheduler, cfg.checkpoint.keep_last
            )
        distributed.barrier(self.dist)  # nobody goes on (or reads `latest`) before it exists
        return path

    def load(self, path: Path, model: nn.Module, optimizer: Any, device: torch.device) -> None:
        """Load checkpoint `path` into this rank's model and optimizer, in place."""
        if self.mode == "mesh":
            sharded.load(path, model, optimizer)
        else:
            ckpt.load_weights(path, model, optimizer, device)

    def finish(self) -> None:
        """Publish a background (async) save before the run returns."""
        sharded.finish_pending(self.dist)


def parallelize_for_mesh(
    model: nn.Module, cfg: TrainConfig, mesh: Mesh, microbatches: int
) -> tuple[nn.Module, Any]:
    """(this rank's modules: what the optimizer and checkpoints see, what the loop calls).

    Without pipeline stages both are `model`, parallelised in place. With them, the stages this
    rank runs (pipeline.py), and a callable that runs one pipeline step of `microbatches`.
    """
    if mesh.size("pp") == 1:
        mesh_ops.parallelize_mesh(model, cfg, mesh)
        return model, model
    from kiln.train.pipeline import build_pipeline  # torch's pipelining, only when pp > 1

    return build_pipeline(model, cfg, mesh, microbatches)
