"""Optional metric backends next to metrics.jsonl: TensorBoard and W&B (offline), rank 0 only.

`check_backends(cfg)` runs on every rank at start, so a missing package is one clear error
everywhere rather than a crash on rank 0 and a hang on the others. `Loggers.open(...)` (rank 0)
builds the backends the config turns on; the trainer calls `log(record)` with each metrics
record, `log_samples(step, samples)` at eval steps and `close()` at the end.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from kiln.errors import KilnError
from kiln.train.config import TrainConfig

# The metrics each backend receives (others in the record, e.g. tokens, stay in metrics.jsonl).
SCALARS: tuple[str, ...] = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "val_loss")


class Backend(Protocol):
    """What a metrics backend does."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record finite scalars at a step."""

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Record sampled continuations at a step."""

    def close(self) -> None:
        """Flush and release files."""


def _require(module: str, package: str, option: str) -> ModuleType:
    """Import `module`, or a KilnError that says which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise KilnError(
            f"{option} = true needs the `{package}` package, which is not installed: "
            f"pip install {package} (or set {option} = false)"
        ) from None


def check_backends(cfg: TrainConfig) -> None:
    """Fail early, with the pip command, when a backend the config turns on is not installed."""
    if cfg.logging.tensorboard:
        _require("tensorboard", "tensorboard", "logging.tensorboard")
        _require("torch.utils.tensorboard", "tensorboard", "logging.tensorboard")
    if cfg.logging.wandb:
        _require("wandb", "wandb", "logging.wandb")


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The finite numeric SCALARS of a metrics record (mfu is absent on a CPU)."""
    out = {}
    for key in SCALARS:
        value = record.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            out[key] = float(value)
    return out


class TensorBoardBackend:
    """Scalars (and samples as text) to RUN/tensorboard/ with torch's SummaryWriter."""

    def __init__(self, log_dir: Path, start_step: int) -> None:
        summary = _require("torch.utils.tensorboard", "tensorboard", "logging.tensorboard")
        # On resume, TensorBoard drops the old files' events after the checkpoint's step.
        purge = start_step + 1 if start_step > 0 else None
        self.writer = summary.SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """One add_scalar per metric, tagged with its metrics.jsonl name."""
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """The samples as one markdown text entry."""
        lines = [f"**{s['prompt']}**{s['text']}" for s in samples]
        self.writer.add_text("samples", "\n\n".join(lines), step)

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class WandbBackend:
    """The same scalars to a W&B run in offline mode under RUN/wandb (never goes online)."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str) -> None:
        self.wandb = _require("wandb", "wandb", "logging.wandb")
        self.run = self.wandb.init(
            mode="offline", dir=str(run_dir), config=config, project=project or None
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """One wandb.log call per record."""
        self.run.log(scalars, step=step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Samples as a small table of (prompt, text)."""
        table = self.wandb.Table(columns=["prompt", "text"])
        for s in samples:
            table.add_data(s["prompt"], s["text"])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        """Finish the offline run (it can be uploaded later with `wandb sync`)."""
        self.run.finish()


class Loggers:
    """Every backend the config turns on, behind one interface (empty: every call a no-op)."""

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends

    @classmethod
    def open(cls, cfg: TrainConfig, run_dir: Path, start_step: int = 0) -> Loggers:
        """The backends of `cfg.logging` writing under `run_dir` (call on the main rank only)."""
        backends: list[Backend] = []
        if cfg.logging.tensorboard:
            backends.append(TensorBoardBackend(run_dir / "tensorboard", start_step))
        if cfg.logging.wandb:
            backends.append(WandbBackend(run_dir, cfg.to_dict(), cfg.logging.wandb_project))
        return cls(backends)

    def log(self, record: dict[str, Any]) -> None:
        """Send a metrics record's scalars to every backend."""
        if not self.backends:
            return
        scalars = scalars_of(record)
        for backend in self.backends:
            backend.log(int(record["step"]), scalars)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Send an eval step's samples to every backend."""
        if samples:
            for backend in self.backends:
                backend.log_samples(step, samples)

    def close(self) -> None:
        """Close every backend."""
        for backend in self.backends:
            backend.close()
        self.backends = []
