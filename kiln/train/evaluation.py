"""The fixed val set of a run, split across data-parallel ranks, and the val loss over it.

The val set is the first `eval.batches` batches of `micro_batch` windows of the val stream
whatever the world size, so val losses compare across world sizes. Rank r takes the r-th of W
near-equal slices and reads it in as many forward passes as the largest slice needs: every rank
runs the same number of passes (FSDP gathers weights in each), and a pass with nothing left for
this rank reuses a window with weight 0. The loss is then summed over the ranks that own one and
divided by the windows of the whole set.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln.devices import Precision
from kiln.train.parallel_plan import ParallelPlan
from kiln.train.sources import TrainData
from kiln.train.step import autocast


def val_set(
    data: TrainData, seq_len: int, micro_batch: int, batches: int, seed: int,
    rank: int, ranks: int, device: torch.device,
) -> tuple[list[tuple[Any, ...]], int]:  # fmt: skip
    """(rank `rank`'s passes over the fixed val set: (inputs, targets, windows that count,
    *extra), the windows of the whole set); see the module doc."""
    T, B, W = seq_len, micro_batch, ranks
    size = min(B, data.val_rows(T))  # a small val split: smaller batches
    loader = data.loader("val", T, size, seed)
    read = [loader.next_batch().to_torch() for _ in range(batches)]
    x, y, *extra = (torch.cat(column) for column in zip(*read, strict=True))  # (N, T)
    mine = np.array_split(np.arange(len(x)), W)[rank]
    n_passes = max(1, math.ceil(math.ceil(len(x) / W) / B))
    passes = []
    for rows in np.array_split(mine, n_passes):
        weight = len(rows)
        rows = rows if weight else np.array([0])  # nothing left: a pass that counts 0
        x_rows, y_rows, *more = (t[rows].to(device) for t in (x, y, *extra))
        passes.append((x_rows, y_rows, weight, *more))
    return passes, len(x)


@torch.no_grad()
def val_loss(
    model: nn.Module,
    passes: list[tuple[Any, ...]],
    windows: int,
    plan: ParallelPlan,
    precision: Precision,
    device: torch.device,
) -> float:
    """Mean loss over the whole val set, all ranks together (every rank must call it)."""
    model.eval()
    total = torch.zeros((), device=device)
    # Every window has T targets: weigh by windows (post-training rows add segment ids).
    for x, y, weight, *extra in passes:
        with autocast(precision, device):
            total += model(x, y, *extra).float() * weight
    model.train()
    return plan.loss_sum(total) / windows


def is_due(step: int, every: int, last: bool) -> bool:
    """Whether `step` is one of a cadence's (every `every` steps, 0 = never, and the last)."""
    return last or bool(every and step % every == 0)
