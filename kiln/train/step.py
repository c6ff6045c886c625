"""One optimizer step's parts: accumulation over micro-steps, gradient sync, autocast, the guard.

One optimizer step consumes `batch.global_tokens` tokens: `accum` micro-steps, each reading the
next `world_size · micro_batch` windows of the loader's stream (this rank's slice of them). The
loss of each micro-step is divided by `accum` so the accumulated gradient is that of the mean.
The wrapped module skips gradient synchronisation on the non-final micro-steps when it can
(DDP's `no_sync()`, FSDP2's `set_requires_gradient_sync`); a pipeline step runs its own
backward over its micro-batches (pipeline.py) and is one micro-step here.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from kiln.devices import Precision
from kiln.errors import KilnError


class NonFiniteError(KilnError):
    """The loss or gradient norm of a step was NaN or infinite."""


def accumulation_steps(global_tokens: int, world_size: int, micro_batch: int, seq_len: int) -> int:
    """Micro-steps per optimizer step; the global batch must split exactly into micro-batches."""
    per_micro = world_size * micro_batch * seq_len
    if global_tokens % per_micro:
        lower = max(per_micro, global_tokens // per_micro * per_micro)
        raise KilnError(
            f"batch.global_tokens ({global_tokens}) must be a multiple of data-parallel ranks × "
            f"batch.micro_batch × data.seq_len = {world_size} × {micro_batch} × {seq_len} = "
            f"{per_micro}; use e.g. {lower} or {lower + per_micro}"
        )
    return global_tokens // per_micro


def autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast for matmuls (on CPU and CUDA), or nothing for fp32."""
    enabled = precision.name == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def grad_sync(train_model: Any, last_micro: bool) -> contextlib.AbstractContextManager[Any]:
    """Synchronise gradients on the last micro-step only, where the module can (DDP, FSDP2)."""
    set_sync = getattr(train_model, "set_requires_gradient_sync", None)
    if set_sync is not None:  # FSDP2: a flag read by the next backward
        set_sync(last_micro)
        return contextlib.nullcontext()
    no_sync = getattr(train_model, "no_sync", None)
    return contextlib.nullcontext() if last_micro or no_sync is None else no_sync()


def accumulate(
    train_model: Any, loader: Any, accum: int, precision: Precision, device: torch.device
) -> torch.Tensor:
    """Forward and backward of `accum` micro-batches; this rank's mean loss (detached)."""
    total = torch.zeros((), device=device)
    for micro in range(accum):
        # (B, T) each; post-training's packed rows add their segment ids
        x, y, *extra = loader.next_batch().to_torch(device)
        with grad_sync(train_model, micro == accum - 1), autocast(precision, device):
            loss = train_model(x, y, *extra)
        if loss.requires_grad:  # a pipeline step has run its own backward
            (loss / accum).backward()
        total += loss.detach()
    return total / accum


def nonfinite_message(step: int, loss: float, grad_norm: float, latest: Path | None) -> str:
    """Why the run stopped at `step` and where to go on from."""
    where = (
        f"the last good checkpoint is {latest} (continue with --resume)"
        if latest is not None
        else "no checkpoint was saved yet"
    )
    return (
        f"step {step}: non-finite loss {loss} or gradient norm {grad_norm}; "
        f"stopped without updating the weights, {where}. Lower optim.lr or train.grad_clip, "
        "or set train.skip_nonfinite = true to skip such steps"
    )
