"""Sharded checkpoints of a [parallel] mesh run, with torch.distributed.checkpoint (DCP).

`checkpoints/step_<N>/` holds `dcp/` (DCP's files: each rank writes the shards it holds, and
rank 0 the `.metadata` that maps every tensor's pieces) and `state.json` (the same document as
a whole-file checkpoint: step, tokens, loader cursor, every rank's RNG, schedule, config). No
rank ever holds the whole state. The folder is written under a temporary name and renamed by
rank 0 after every rank has finished, then `latest` moves: the same "appears only complete"
rule as checkpoint.py, whose helpers do the renaming and pruning.

Tensors are named by their fully qualified names in the unwrapped model, after parallelize.py
split the fused projections (`blocks.0.attn.qkv.q.weight`), whatever the mesh: DCP reads a
checkpoint into any other mesh shape or number of processes (including one process, with
train.parallel = "mesh") by name, each rank loading only the pieces its own shards overlap.
The optimizer state is flattened to the same names (`flatten_optimizer_state_dict`), so it
reshards too, across pipeline stages as well.

With `parallel.async_checkpoint`, DCP's `async_save` writes the shards in the background (the
state is first staged to CPU memory); the folder is published when the write has finished: at
the next save or at the end of the run (`finish_pending`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as tdist
from torch import nn

from kiln.checkpoint_format import SHARDED_DIR, is_sharded_checkpoint, step_dir
from kiln.errors import KilnError
from kiln.train import checkpoint as ckpt
from kiln.train import distributed
from kiln.train.distributed import DistInfo


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def state_dicts(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """{"model", "optim"}: this rank's sharded state, keyed by unwrapped parameter names."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = _options()
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, list(optimizer), options=opts),
    }


@dataclass
class _Pending:
    """An async save whose shards are still being written."""

    future: Any
    tmp: Path
    final: Path
    state: ckpt.TrainState
    scheduler: dict[str, Any]
    keep_last: int


_pending: _Pending | None = None


def save(
    checkpoints: Path,
    model: nn.Module,
    optimizer: Any,
    state: ckpt.TrainState,
    scheduler: dict[str, Any],
    keep_last: int,
    dist: DistInfo,
    background: bool = False,
) -> Path:
    """Save this step's shards from every rank (a collective); rank 0 publishes the folder."""
    global _pending
    finish_pending(dist)
    import torch.distributed.checkpoint as dcp

    final = step_dir(checkpoints, state.step)
    pid = _main_pid(dist)  # one temp name for all ranks: rank 0's, as clean_leftovers expects
    tmp = checkpoints / f".tmp-{final.name}-{pid}"
    if dist.is_main:
        ckpt.make_temp_dir(checkpoints, final, pid)
    distributed.barrier(dist)
    rngs = distributed.gather_to_main(ckpt.capture_rng(), dist)
    if dist.is_main:
        assert rngs is not None
        state.rng = {str(rank): rng for rank, rng in enumerate(rngs)}
    target = tmp / SHARDED_DIR
    if background:
        future = dcp.async_save(state_dicts(model, optimizer), checkpoint_id=str(target))
        _pending = _Pending(future, tmp, final, state, scheduler, keep_last)
        return final
    dcp.save(state_dicts(model, optimizer), checkpoint_id=str(target))
    _publish(_Pending(None, tmp, final, state, scheduler, keep_last), dist)
    return final


def finish_pending(dist: DistInfo) -> None:
    """Wait for a background save to finish and publish it (every rank calls it)."""
    global _pending
    if _pending is None:
        return
    pending, _pending = _pending, None
    pending.future.result()
    _publish(pending, dist)


def _publish(pending: _Pending, dist: DistInfo) -> None:
    """After every rank's shards are written: rank 0 writes state.json and renames."""
    distributed.barrier(dist)
    if dist.is_main:
        ckpt.publish(
            pending.tmp.parent, pending.tmp, pending.final, pending.state, pending.scheduler,
            pending.keep_last,
        )  # fmt: skip
    distributed.barrier(dist)  # nobody reads `latest` before it names this step


def _main_pid(dist: DistInfo) -> int:
    """Rank 0's process id, on every rank."""
    box = [os.getpid()]
    if dist.world_size > 1:
        tdist.broadcast_object_list(box, src=0)
    return int(box[0])


def load(path: Path, model: nn.Module, optimizer: Any) -> None:
    """Load a sharded checkpoint into this rank's (sharded) model and optimizer, in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not is_sharded_checkpoint(path):
        raise KilnError(
            f"{path} is a whole-file checkpoint (model.safetensors); a [parallel] mesh run "
            "resumes only sharded ones: resume it with train.parallel = 'fsdp' or 'ddp'"
        )
    sd = state_dicts(model, optimizer)  # templates: DCP loads into them in place
    try:
        dcp.load(sd, checkpoint_id=str(path / SHARDED_DIR))
    except (RuntimeError, KeyError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KilnError(f"{path}/{SHARDED_DIR} does not match the model: {first}") from None
    opts = _options()
    set_model_state_dict(model, sd["model"], options=opts)
    set_optimizer_state_dict(model, list(optimizer), sd["optim"], options=opts)
