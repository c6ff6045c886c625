"""The loop the image models train on: the VQ-VAE's, the DiT's and the checker's runs.

Each subclasses ImageRun: the run-folder lock, the refusal to start over a run without
--resume, leftovers tidied, atomic checkpoints with `latest` holding weights, optimizer, cursor
and RNG states, metrics.jsonl, Ctrl-C/SIGTERM saving between steps, and batches that are a pure function of (seed, epoch, position), so a resumed run takes the same
steps bit for bit. The run's length is train.max_steps, or the plan train.time_budget re-makes
after every step from the measured step time (kiln/train/budget.py, as `kiln train` does), so
the lr schedule ends on time; subclasses read it as `self.max_steps`. A subclass builds
`self.model` and `self.optimizer`, and gives `train_step`, `evaluate` and `postfix`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch

from kiln import checkpoint_format as fmt
from kiln import config as cfgio
from kiln.config import require
from kiln.errors import KilnError
from kiln.folders import lock_folder
from kiln.image.dataset import ImageDataset
from kiln.io import atomic_write, write_json_atomic
from kiln.train import checkpoint as ckpt
from kiln.train.budget import TimeBudget, intro_line, parse_duration, summary_line
from kiln.train.metrics import MetricsLog


@dataclass
class ImageDataSection:
    """Which image dataset, which split trains, which are evaluated."""

    dataset: str = ""
    train_split: str = "train"
    eval_splits: tuple[str, ...] = ("val", "heldout")  # those the dataset lacks are skipped

    def __post_init__(self) -> None:
        require(bool(self.dataset), "data.dataset: give the image dataset directory")


@dataclass
class CheckpointSection:
    """How often to save and how many to keep."""

    every: int = 500
    keep_last: int = 2

    def __post_init__(self) -> None:
        require(self.every >= 1, f"checkpoint.every must be >= 1, got {self.every}")
        require(self.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {self.keep_last}")


@dataclass
class ImageTrainSection:
    """Length, batch, evaluation and logging cadence, device, seed (each image run's [train])."""

    max_steps: int = 2000
    batch_size: int = 64
    grad_clip: float = 1.0  # 0 turns clipping off
    eval_every: int = 250
    eval_images: int = 500  # per eval split (the first N, so every eval sees the same)
    log_every: int = 25
    device: str = "cpu"
    seed: int = 0
    # Seconds of training ("90s", "10m"): steps are planned from the measured step time so the
    # lr schedule ends on time (kiln/train/budget.py); max_steps then caps the plan.
    time_budget: float | str | None = None

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "eval_every", "eval_images", "log_every"):
            require(getattr(self, name) >= 1, f"train.{name} must be >= 1")
        require(self.grad_clip >= 0, f"train.grad_clip must be >= 0, got {self.grad_clip}")
        if self.time_budget is not None:
            parse_duration(self.time_budget)  # a clear error now, not when training starts

    @property
    def budget_seconds(self) -> float | None:
        """`time_budget` in seconds, or None when the run is sized by max_steps alone."""
        return None if self.time_budget is None else parse_duration(self.time_budget)


class ImageTrainConfig:
    """What every image run's TOML dataclass shares: loading with overrides, plain data."""

    @classmethod
    def load(cls, path: str | Path | None, overrides: Sequence[str] = ()) -> Self:
        """Read the TOML file, apply --set overrides, check it."""
        return cfgio.load(cls, path, overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what config.toml and state.json hold)."""
        return cfgio.to_dict(self)


def open_images(dataset: str, image_size: int, what: str) -> ImageDataset:
    """The image dataset, refused in one line when its pictures are not `image_size` square."""
    data = ImageDataset.open(dataset)
    if data.size != image_size:
        raise KilnError(
            f"{what} = {image_size}, but {dataset} holds {data.size}×{data.size} pictures"
        )
    return data


def batch_indices(n: int, batch: int, seed: int, epoch: int, position: int) -> np.ndarray:
    """The batch at `position` of `epoch`: a slice of that epoch's seeded permutation."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return np.sort(order[position : position + batch])


class ImageRun:
    """One run of an image model in `cfg.run_dir`: the lifecycle; subclasses give the model."""

    command = "kiln image"
    fixed_sections: tuple[str, ...] = ("model", "data")  # a resume may not change these

    def __init__(self, cfg: Any, n_train: int, resume: bool) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.checkpoints = self.run_dir / "checkpoints"
        self.n_train = n_train
        if n_train < cfg.train.batch_size:
            raise KilnError(
                f"train.batch_size = {cfg.train.batch_size} is more than the {n_train} "
                f"pictures of split {cfg.data.train_split!r}"
            )
        self.step, self.epoch, self.position, self.images_seen = 0, 0, 0, 0
        self._lock = lock_folder(self.run_dir, self.command, "run folder")
        self.saved = fmt.resume_checkpoint(self.checkpoints)
        if self.saved is not None and not resume:
            raise KilnError(
                f"{self.checkpoints} already holds checkpoints; pass --resume to continue that "
                "run, or set run_dir to start a new one"
            )
        if resume and self.saved is None:
            raise KilnError(f"nothing to resume: {self.checkpoints} has no checkpoint")
        self.notes = ckpt.tidy(self.checkpoints, cfg.checkpoint.keep_last if self.saved else None)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        seconds = cfg.train.budget_seconds
        self.budget = None if seconds is None else TimeBudget(seconds, cfg.train.max_steps)
        # The schedule's length: train.max_steps, or the budget's plan (re-made after each step).
        self.max_steps = cfg.train.max_steps

    def state_config(self) -> dict[str, Any]:
        """What state.json's `config` holds (the resolved config; subclasses may add to it)."""
        return self.cfg.to_dict()

    def fingerprint(self) -> dict[str, Any]:
        """The training data's identity, checked on resume."""
        raise NotImplementedError

    def start(self) -> None:
        """Resume from the saved checkpoint if there is one; write config.toml."""
        if self.saved is not None:
            self._resume(self.saved)
        with atomic_write(self.run_dir / "config.toml") as handle:
            handle.write(cfgio.to_toml(self.cfg.to_dict(), f"{self.command}: resolved config"))

    def _resume(self, path: Path) -> None:
        state = fmt.read_state(path)
        now = self.state_config()
        fixed = {k: v for k, v in now.items() if k in self.fixed_sections}
        saved = {k: v for k, v in state["config"].items() if k in self.fixed_sections}
        changed = fmt.config_differences(saved, fixed)
        if state.get("dataset") != self.fingerprint():
            changed.append("the training data (the dataset's contents, or the VQ-VAE's weights)")
        if changed:
            raise KilnError(
                f"cannot resume from {path}: the model or data changed ({'; '.join(changed)})"
            )
        ckpt.load_weights(path, self.model, self.optimizer, self.device)
        self.step = int(state["step"])
        self.images_seen = int(state["tokens"])
        self.epoch, self.position = int(state["cursor"]["epoch"]), int(state["cursor"]["position"])
        ckpt.restore_rng(state["rng"]["0"])
        self.metrics.truncate_after(self.step)
        schedule = state.get("scheduler") or {}
        if self.budget is not None and schedule.get("time_budget_s") == self.budget.seconds:
            # The same budget goes on: its clock and plan continue from the saved step.
            self.budget.elapsed = float(schedule.get("train_seconds", 0.0))
            self.budget.planned = schedule.get("planned_steps")
        self.notes.append(f"resumed from {path} (step {self.step})")

    def next_indices(self) -> np.ndarray:
        """The next batch's training-set indices (an epoch's remainder is dropped)."""
        n, b = self.n_train, self.cfg.train.batch_size
        if self.position + b > n:
            self.epoch, self.position = self.epoch + 1, 0
        idx = batch_indices(n, b, self.cfg.train.seed, self.epoch, self.position)
        self.position += b
        self.images_seen += b
        return idx

    def train_step(self) -> dict[str, float]:
        """One optimizer update; returns the step's scalars."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, Any]:
        """Held-out measurements."""
        raise NotImplementedError

    def postfix(self, scalars: dict[str, float]) -> dict[str, str]:
        """What the progress bar shows beside the step count."""
        return {"loss": f"{scalars['loss']:.4f}"}

    def clip_and_step(self, loss: torch.Tensor) -> float:
        """Backward, clip (train.grad_clip; 0: off), optimizer step; returns the grad norm."""
        self.optimizer.zero_grad()
        loss.backward()
        clip = self.cfg.train.grad_clip
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else 1e30)
        self.optimizer.step()
        if not torch.isfinite(loss):
            raise KilnError(f"step {self.step + 1}: the loss is not finite; lower optim.lr")
        return float(norm)

    def save(self) -> Path:
        """Checkpoint the current step (weights, optimizer, cursor, RNG)."""
        state = ckpt.TrainState(
            step=self.step, tokens=self.images_seen,  # images, for these models
            cursor={"epoch": self.epoch, "position": self.position},
            config=self.state_config(), dataset=self.fingerprint(),
        )  # fmt: skip
        return ckpt.save_checkpoint(
            self.checkpoints, self.model, self.optimizer, state,
            self._schedule_record(), self.cfg.checkpoint.keep_last,
        )  # fmt: skip

    def _schedule_record(self) -> dict[str, Any]:
        """The schedule as it stands: a budgeted run's clock and plan go on from here on resume."""
        record: dict[str, Any] = {"name": self.cfg.schedule.name, "max_steps": self.max_steps}
        if self.budget is not None:
            record.update(time_budget_s=self.budget.seconds, train_seconds=self.budget.elapsed,
                          planned_steps=self.budget.planned)  # fmt: skip
        return record

    def run(self, progress: bool = True, time_budget: float | None = None) -> dict[str, Any]:
        """Train to the planned steps (max_steps or train.time_budget), saving, logging, evaluating.

        `time_budget` (seconds, from code) sets a budget as train.time_budget does.
        """
        cfg = self.cfg.train
        from tqdm import tqdm

        if time_budget is not None:
            self.budget = TimeBudget(time_budget, cfg.max_steps)
        if self.budget is not None:
            self.max_steps = self.budget.plan(self.step)
            print(intro_line(self.budget, cfg.max_steps, self.budget.elapsed), flush=True)
        interrupted: list[int] = []
        # Ctrl-C and SIGTERM end the loop between steps (never inside an update), then it saves.
        previous = {
            sig: signal.signal(sig, lambda s, f: interrupted.append(s))
            for sig in (signal.SIGINT, signal.SIGTERM)
        }
        bar = tqdm(total=self.max_steps, initial=self.step, disable=not progress, unit="step")
        start, start_step = time.perf_counter(), self.step
        try:
            while self.step < self.max_steps and not interrupted:
                t0 = time.perf_counter()
                scalars = self.train_step()
                if self.budget is not None:
                    self.budget.record(time.perf_counter() - t0)
                    if self.step < self.max_steps:
                        self.max_steps = self.budget.plan(self.step)
                        bar.total = self.max_steps  # the bar's ETA follows the plan
                    note = self.budget.replan_note()
                    if note:
                        bar.write(note)
                bar.update()
                elapsed = time.perf_counter() - start
                last = self.step >= self.max_steps
                if self.step % cfg.log_every == 0 or last:
                    rate = (self.step - start_step) * cfg.batch_size / elapsed
                    record = {"step": self.step, "images": self.images_seen, **scalars,
                              "images_per_s": rate}  # fmt: skip
                    if self.step % cfg.eval_every == 0 or last:
                        record.update(self.evaluate())
                    self.metrics.write(record)
                    bar.set_postfix(self.postfix(scalars))
                if self.step % self.cfg.checkpoint.every == 0 and not last:
                    self.save()
        finally:
            bar.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.save()
        if interrupted:
            raise KilnError(
                f"stopped at step {self.step}; saved {self.checkpoints} (continue with --resume)"
            )
        if self.budget is not None:
            other = time.perf_counter() - start - sum(self.budget.durations)
            print(summary_line(self.budget, self.budget.elapsed, self.step, other), flush=True)
        final = {"step": self.step, **self.evaluate()}
        write_json_atomic(self.run_dir / "eval.json", final)
        self._lock.release()
        return final
