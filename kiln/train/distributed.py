"""Many processes: the process group from torchrun's environment, and how the model is parallelised.

torchrun starts one process per device and tells each its place in RANK, WORLD_SIZE and
LOCAL_RANK (plus MASTER_ADDR/MASTER_PORT for the rendezvous). `DistInfo.from_env` reads them and
`join_from_env` joins the group for the life of the process (nccl on CUDA, gloo on the CPU).
How the model is spread over the processes is parallelize.py's (and parallel_plan.py's).

The small collectives the loop needs (mean or sum of a tensor across ranks, gathering per-rank
objects, agreeing on a stop) are here too, so trainer.py reads the same with one process or many.
"""

from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from kiln.errors import KilnError


@dataclass(frozen=True)
class DistInfo:
    """This process's place among the training processes (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Whether this process writes logs, metrics and checkpoints."""
        return self.rank == 0

    @classmethod
    def from_env(cls) -> DistInfo:
        """RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them (rank 0 of 1 when unset)."""
        values = {}
        for key, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", None)):
            text = os.environ.get(key)
            try:
                values[key] = default if text is None else int(text)
            except ValueError:
                raise KilnError(f"environment variable {key}={text!r} is not an integer") from None
        local = values["LOCAL_RANK"] if values["LOCAL_RANK"] is not None else values["RANK"]
        info = cls(values["RANK"], values["WORLD_SIZE"], local)
        if info.world_size < 1 or not 0 <= info.rank < info.world_size:
            raise KilnError(f"RANK={info.rank} is not in [0, WORLD_SIZE={info.world_size})")
        return info


def backend_for(device: torch.device) -> str:
    """nccl between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(dist: DistInfo, device: torch.device, timeout_s: float = 1800) -> None:
    """Join the process group torchrun set up (env:// rendezvous); a no-op for one process."""
    if dist.world_size == 1 or tdist.is_initialized():
        return
    if not tdist.is_available():
        raise KilnError("this torch build has no torch.distributed; train with one process")
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise KilnError(
                f"WORLD_SIZE={dist.world_size} but {key} is not set: launch with torchrun "
                "(see docs/distributed.md)"
            )
    if device.type == "cuda":
        torch.cuda.set_device(device)  # nccl and all_gather_object use the current device
    tdist.init_process_group(
        backend=backend_for(device),
        rank=dist.rank,
        world_size=dist.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def destroy_process_group() -> None:
    """Leave the process group, if this process is in one."""
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def join_from_env(device: torch.device, dist: DistInfo) -> None:
    """Join torchrun's group for the life of the process (left again at exit)."""
    if dist.world_size > 1 and not tdist.is_initialized():
        init_process_group(dist, device)
        atexit.register(destroy_process_group)


# ---- collectives the loop needs --------------------------------------------------------------


def mean_across_ranks(value: torch.Tensor, dist: DistInfo) -> torch.Tensor:
    """The mean of a tensor over ranks (gloo has no AVG: sum, then divide)."""
    if dist.world_size == 1:
        return value
    out = value.detach().clone()
    tdist.all_reduce(out, op=tdist.ReduceOp.SUM)
    return out / dist.world_size


def sum_across_ranks(value: torch.Tensor, dist: DistInfo) -> torch.Tensor:
    """The sum of a tensor over ranks."""
    if dist.world_size == 1:
        return value
    out = value.detach().clone()
    tdist.all_reduce(out, op=tdist.ReduceOp.SUM)
    return out


def min_across_ranks(value: int, dist: DistInfo, device: torch.device) -> int:
    """The smallest of every rank's `value` (e.g. the micro-batch all ranks can fit)."""
    if dist.world_size == 1:
        return value
    t = torch.tensor([value], device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MIN)
    return int(t.item())


def any_rank(flag: bool, dist: DistInfo, device: torch.device) -> bool:
    """True on every rank when it is true on any (e.g. a stop signal seen by one process)."""
    if dist.world_size == 1:
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return bool(t.item())


def gather_to_main(obj: Any, dist: DistInfo) -> list[Any] | None:
    """Every rank's `obj` (picklable) as a list on rank 0; None on the others."""
    if dist.world_size == 1:
        return [obj]
    out: list[Any] | None = [None] * dist.world_size if dist.is_main else None
    tdist.gather_object(obj, out, dst=0)
    return out


def barrier(dist: DistInfo) -> None:
    """Wait for every rank (e.g. until rank 0 has written a checkpoint)."""
    if dist.world_size > 1:
        tdist.barrier()
