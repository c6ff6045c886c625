"""Checkpoints of post-training loops (DPO, reward model, PPO, GRPO): the pre-training format.

The trained model is `model.safetensors` under the base run's config, so `kiln.loading` loads a
post-training checkpoint like any other; extra modules (a value model) sit beside it in their own
files; the loop's own settings are one section of the config; RNG states make resume exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from kiln.train.checkpoint import (
    TrainState,
    capture_rng,
    latest_checkpoint,
    load_model_tensors,
    read_optimizer,
    read_state,
    restore_rng,
    save_checkpoint,
    unique_tensors,
)
from kiln.train.metrics import MetricsLog


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
    ) -> Path:
        """Write the checkpoint of `step` atomically (settings recorded as config[section])."""
        state = TrainState(
            step=step, tokens=0, cursor={"step": step},
            config={**self.base_state.get("config", {}), section: settings},
            dataset=self.base_state.get("dataset", {}), rng={"0": capture_rng()},
        )  # fmt: skip
        files = {f"{name}.safetensors": unique_tensors(m)[0] for name, m in (extra or {}).items()}
        return save_checkpoint(
            self.checkpoints, model, optimizer, state, {}, self.keep_last, extra_tensors=files
        )

    def resume(
        self, model: nn.Module, optimizer: Any, extra: dict[str, nn.Module] | None = None
    ) -> int | None:
        """Load the latest checkpoint into model, optimizer and extras; its step, or None."""
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
        return step
