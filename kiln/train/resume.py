"""Where a run resumes from, what it takes back from the checkpoint, and the RNG per rank.

A resumed run checks that its model and data are those of the checkpoint (the data by its
contents, so a dataset that moved still resumes), then goes on with the saved step, tokens,
loader cursor, schedule and RNG states, so it takes the same steps as an uninterrupted one (bit
for bit on the CPU). A resumed `dtype = "auto"` run keeps the precision its checkpoint was
trained in, even on a machine that would choose the other.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln import checkpoint_format as fmt
from kiln.data import LoaderCursor
from kiln.devices import Precision, choose_precision
from kiln.errors import KilnError
from kiln.train import checkpoint as ckpt
from kiln.train import distributed
from kiln.train.distributed import DistInfo


@dataclass
class ResumePoint:
    """A checkpoint to resume from and its state.json (read once)."""

    path: Path
    state: dict[str, Any]


@dataclass
class Resumed:
    """What a run takes back from its checkpoint (a fresh run: the defaults)."""

    step: int = 0
    tokens: int = 0
    skipped: int = 0
    train_seconds: float = 0.0
    planned_steps: int | None = None  # a budgeted run's saved plan, when its budget is unchanged
    cursor: LoaderCursor = field(default_factory=LoaderCursor)


def find_resume_point(
    checkpoints: Path, resume: bool, now: dict[str, Any], fingerprint: dict[str, Any]
) -> tuple[ResumePoint | None, list[str]]:
    """(the checkpoint to resume from, checked against config `now`, or None; config notes)."""
    latest = fmt.resume_checkpoint(checkpoints)  # tidy() rewrites a lost `latest`
    if not resume:
        if latest is not None or fmt.list_checkpoints(checkpoints):
            raise KilnError(
                f"{checkpoints} already holds checkpoints; pass --resume to continue "
                "that run, or set logging.run_dir to start a new one"
            )
        return None, []
    if latest is None:
        raise KilnError(f"nothing to resume: {checkpoints} has no checkpoint")
    state = fmt.read_state(latest)
    saved = state["config"]
    # The data is identified by its contents, so a dataset that moved may still resume.
    fixed = fmt.config_differences(
        {"model": saved["model"], "data": {**saved["data"], "dataset": None},
         "dataset": state["dataset"]},
        {"model": now["model"], "data": {**now["data"], "dataset": None},
         "dataset": fingerprint},
    )  # fmt: skip
    if fixed:
        raise KilnError(
            f"cannot resume from {latest}: the model or data changed "
            f"({'; '.join(fixed)}); restore it or start a new run in another logging.run_dir"
        )
    return ResumePoint(latest, state), fmt.config_differences(saved, now)


def resumed_from(
    point: ResumePoint, budget: tuple[float | None, int], seed: int, dist: DistInfo
) -> tuple[Resumed, list[str]]:
    """The saved counters, cursor and plan, this rank's RNG restored; (them, notes).

    `budget`: this run's (train.budget_seconds, train.max_steps): the saved plan of steps is
    kept only when both are unchanged (else a new budget or cap plans afresh).
    """
    state, notes = point.state, []
    schedule = state["scheduler"]
    same = (schedule.get("time_budget_s"), schedule.get("max_steps_cap")) == budget
    out = Resumed(
        step=state["step"], tokens=state["tokens"], skipped=state.get("skipped_steps", 0),
        train_seconds=float(schedule.get("train_seconds", 0.0)),
        planned_steps=schedule.get("max_steps") if same else None,
        cursor=LoaderCursor.from_dict(state["cursor"]),
    )  # fmt: skip
    rng = state["rng"].get(str(dist.rank))
    if rng is not None:
        ckpt.restore_rng(rng)
    else:  # resumed on more ranks than saved it: a fresh, distinct stream for this one
        seed_rank(seed + 1_000_003 * out.step, dist.rank)
        notes.append(
            f"rank {dist.rank}: no RNG state in {point.path.name} (saved by "
            f"{len(state['rng'])} rank(s)); reseeded"
        )
    return out, notes


def run_precision(
    requested: str, device: torch.device, dist: DistInfo, point: ResumePoint | None
) -> Precision:
    """train.dtype resolved for this device; a resumed "auto" keeps its checkpoint's dtype.

    Every rank must train in the same dtype: where any rank's "auto" falls back to fp32 (its
    probe disagreed), all do.
    """
    precision = choose_precision(requested, device)
    if requested == "auto":
        fp32 = distributed.any_rank(precision.name == "fp32", dist, device)
        if fp32 and precision.name != "fp32":
            precision = Precision("fp32", requested, "another rank's probe chose fp32")
    kept = saved_precision(point.state) if point is not None else {}
    if (
        point is not None
        and requested == "auto"
        and kept.get("dtype") not in (None, precision.name)
    ):
        slowdown = None
        if kept["dtype"] == "bf16" and device.type == "cpu":
            slowdown = choose_precision("bf16", device).bf16_slowdown
        precision = Precision(
            kept["dtype"],
            requested,
            f"kept from {point.path.name} so the resumed run trains as it began (this machine "
            f"alone would pick {precision.name}: {precision.reason}; set "
            f"train.dtype={precision.name} to switch)",
            slowdown,
        )
    return precision


def saved_precision(state: dict[str, Any]) -> dict[str, Any]:
    """The precision a checkpoint was trained in (older ones name it in their config only)."""
    if state.get("precision"):
        return state["precision"]
    dtype = state["config"].get("train", {}).get("dtype", "bf16")  # bf16: the old default
    return {"dtype": dtype} if dtype != "auto" else {}


def seed_rank(seed: int, rank: int) -> None:
    """Seed Python and NumPy (and torch past rank 0) for this rank: one state per rank.

    Rank 0's torch stream goes on from the model's initialisation, as with one process; the
    other ranks get their own, so dropout masks differ between ranks. Seeding Python and NumPy
    too makes every saved RNG state a function of the config, not of the process.
    """
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    if rank:
        torch.manual_seed(seed + rank)
