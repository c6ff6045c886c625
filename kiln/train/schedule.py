"""Learning-rate schedules as pure functions of the step: the multiplier of the peak lr.

Step s is the 0-based index of the optimizer update being taken, so update 0 already has a
non-zero rate (warmup starts at 1/warmup, never at 0, which would waste a step).

- warmup_cosine: linear warmup over `warmup_steps`, then a half cosine from 1 down to
  `min_lr_ratio` at the last step.
- wsd (warmup-stable-decay): linear warmup, a constant plateau, then a linear decay to
  `min_lr_ratio` over the last `decay_fraction` of the steps.
"""

from __future__ import annotations

import math
from pathlib import Path

from kiln.train.config import ScheduleConfig


def warmup_cosine(step: int, max_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Multiplier at `step`: linear warmup, then cosine from 1 to `min_ratio` at max_steps - 1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_stable_decay(
    step: int, max_steps: int, warmup_steps: int, decay_fraction: float, min_ratio: float
) -> float:
    """Multiplier at `step`: warmup, plateau at 1, linear decay to `min_ratio` at max_steps - 1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = round(decay_fraction * max_steps)
    decay_start = max(warmup_steps, max_steps - decay_steps)
    if step < decay_start or decay_steps == 0:
        return 1.0
    span = max(1, max_steps - 1 - decay_start)
    progress = min(1.0, (step - decay_start) / span)
    return 1.0 - (1.0 - min_ratio) * progress


def lr_multiplier(cfg: ScheduleConfig, step: int, max_steps: int) -> float:
    """The configured schedule's multiplier of the peak learning rate at `step`."""
    if cfg.name == "warmup_cosine":
        return warmup_cosine(step, max_steps, cfg.warmup_steps, cfg.min_lr_ratio)
    return warmup_stable_decay(
        step, max_steps, cfg.warmup_steps, cfg.decay_fraction, cfg.min_lr_ratio
    )


def plot_schedule(cfg: ScheduleConfig, max_steps: int, peak_lr: float, out: Path) -> Path:
    """Write a PNG of the learning rate over the run's steps; needs matplotlib."""
    from kiln.plotting import pyplot, save_png

    plt = pyplot()
    steps = list(range(max_steps))
    lrs = [peak_lr * lr_multiplier(cfg, s, max_steps) for s in steps]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, lrs)
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title(
        f"{cfg.name}: warmup {cfg.warmup_steps}, floor {cfg.min_lr_ratio:g}×peak"
        + (f", decay last {cfg.decay_fraction:g}" if cfg.name == "wsd" else "")
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_png(fig, out, dpi=100)
