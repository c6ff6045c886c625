"""What the post-training loops (DPO, reward model, PPO, GRPO) share: the settings every loop
has (`LoopConfig`), the loop itself (steps, checkpoints, resume) and its checkpoints, which are in
the pre-training format.

The trained model is `model.safetensors` under the base run's config, so `kiln.loading` loads a
post-training checkpoint like any other; extra modules (a value model) sit beside it in their own
files; the loop's own settings are one section of the config; RNG states make resume exact.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.checkpoint_format import (
    latest_checkpoint,
    load_model_tensors,
    read_optimizer,
    read_state,
    unique_tensors,
)
from kiln.config import require
from kiln.model.config import ModelConfig
from kiln.train.budget import parse_duration
from kiln.train.checkpoint import TrainState, capture_rng, restore_rng, save_checkpoint
from kiln.train.metrics import MetricsLog


@dataclass(frozen=True)
class LoopConfig:
    """The settings every loop has: its length, the AdamW step, the seed and the checkpoints.

    Each loop's config (DPOConfig, RewardConfig, RLConfig) extends this one: it names its TOML
    section in `SECTION` (every error says `section.field`), may give other defaults, lists its own
    counts that must be >= 1 in `COUNTS` and adds its other checks in `check`.
    """

    SECTION: ClassVar[str] = "loop"
    COUNTS: ClassVar[tuple[str, ...]] = ()

    steps: int = 100
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # the global gradient-norm limit of every update
    seed: int = 0
    save_every: int = 50
    keep_last: int = 2
    # Wall seconds of updates ("90s", "5m"); the loop stops at `steps` or here, whichever first.
    time_budget: float | str | None = None

    def __post_init__(self) -> None:
        """Reject settings that cannot run, naming the field."""
        for name in ("steps", *self.COUNTS, "save_every", "keep_last"):
            self.require(getattr(self, name) >= 1, name, "must be >= 1")
        if self.time_budget is not None:
            parse_duration(self.time_budget, f"{self.SECTION}.time_budget")
        self.require(self.lr > 0, "lr", "must be > 0")
        self.require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        self.require(self.grad_clip > 0, "grad_clip", "must be > 0")
        self.check()

    def check(self) -> None:
        """The loop's own checks, after the shared ones (none here)."""

    @property
    def budget_seconds(self) -> float | None:
        """`time_budget` in seconds, or None when only `steps` bounds the run."""
        if self.time_budget is None:
            return None
        return parse_duration(self.time_budget, f"{self.SECTION}.time_budget")

    def require(self, ok: bool, name: str, expected: str) -> None:
        """A ConfigError `section.name <expected>, got <value>` unless `ok`."""
        require(ok, f"{self.SECTION}.{name} {expected}, got {getattr(self, name)!r}")


class PosttrainRun:
    """A run folder: `checkpoints/step_N/`, `latest`, `metrics.jsonl`."""

    def __init__(self, out_dir: Path, base_state: dict[str, Any] | None, keep_last: int) -> None:
        self.out_dir = Path(out_dir)
        self.base_state = base_state or {}  # the base checkpoint's state.json (model, data)
        self.keep_last = keep_last
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl")

    @property
    def checkpoints(self) -> Path:
        """Where the checkpoints live."""
        return self.out_dir / "checkpoints"

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: Any,
        section: str,
        settings: dict[str, Any],
        extra: dict[str, nn.Module] | None = None,
        seconds: float = 0.0,
    ) -> Path:
        """Write the checkpoint of `step` atomically (settings recorded as config[section]).

        config.model is the model's own config, so the checkpoint loads whatever the base was.
        """
        config = {**self.base_state.get("config", {}), section: settings}
        if isinstance(getattr(model, "cfg", None), ModelConfig):
            config["model"] = model.cfg.to_dict()
        state = TrainState(
            step=step, tokens=0, cursor={"step": step, "seconds": seconds}, config=config,
            dataset=self.base_state.get("dataset", {}), rng={"0": capture_rng()},
        )  # fmt: skip
        files = {f"{name}.safetensors": unique_tensors(m)[0] for name, m in (extra or {}).items()}
        return save_checkpoint(
            self.checkpoints, model, optimizer, state, {}, self.keep_last, extra_tensors=files
        )

    def resume(
        self, model: nn.Module, optimizer: Any, extra: dict[str, nn.Module] | None = None
    ) -> tuple[int, float] | None:
        """Load the latest checkpoint into model, optimizer and extras; (step, seconds) or None."""
        latest = latest_checkpoint(self.checkpoints)
        if latest is None:
            return None
        load_model_tensors(latest / "model.safetensors", model, "cpu", "the model")
        for name, module in (extra or {}).items():
            load_model_tensors(latest / f"{name}.safetensors", module, "cpu", f"the {name} model")
        optimizer.load_state_dict(read_optimizer(latest / "optimizer.pt"))
        state = read_state(latest)
        restore_rng(state["rng"]["0"])
        step = int(state["step"])
        self.metrics.truncate_after(step)
        return step, float(state.get("cursor", {}).get("seconds", 0.0))


def epoch_slice(n: int, k: int, step: int, seed: int) -> list[int]:
    """Indices of step's k items out of n: consecutive slices of a seeded permutation per epoch.

    A pure function of its arguments, so a resumed run sees exactly the items it would have.
    """
    per_epoch = max(1, n // k)
    epoch, slot = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return [order[(slot * k + i) % n] for i in range(k)]


class PosttrainLoop:
    """The shared loop of DPO, reward-model and RL training: steps, checkpoints, resume.

    Subclasses set `model`, `optimizer`, `cfg` (a LoopConfig), `section` and `run_dir`, and
    implement `train_step`; `extra_modules` are saved beside the model.
    """

    section: str
    model: nn.Module
    optimizer: Any
    cfg: LoopConfig
    run_dir: PosttrainRun
    step: int = 0
    seconds: float = 0.0  # wall seconds spent in updates, across resumes (what time_budget counts)
    out_of_time: bool = False

    def extra_modules(self) -> dict[str, nn.Module]:
        """Modules saved in their own files beside the model (none by default)."""
        return {}

    def save(self) -> Path:
        """Checkpoint the model (loadable as a model), the extras, optimizer and RNG."""
        return self.run_dir.save(
            self.step, self.model, self.optimizer, self.section, asdict(self.cfg),
            self.extra_modules(), self.seconds,
        )  # fmt: skip

    def resume(self) -> bool:
        """Continue from the latest checkpoint if there is one; True when it did."""
        resumed = self.run_dir.resume(self.model, self.optimizer, self.extra_modules())
        if resumed is None:
            return False
        self.step, self.seconds = resumed
        return True

    def train_step(self) -> dict[str, Any]:
        """One update; returns (and logs) its metrics."""
        raise NotImplementedError

    def run(self) -> list[dict[str, Any]]:
        """Train until cfg.steps or the time budget; checkpoint every save_every and at the end."""
        records = []
        budget = self.cfg.budget_seconds
        while self.step < self.cfg.steps:
            if budget is not None and self.seconds >= budget:  # also a resumed run already spent
                self.out_of_time = True
                break
            started = time.perf_counter()
            records.append(self.train_step())
            self.seconds += time.perf_counter() - started
            spent = budget is not None and self.seconds >= budget
            if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps or spent:
                self.save()
        return records
