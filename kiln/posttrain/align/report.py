"""The picture of a post-training run: its logged curves, one panel per metric."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln.plotting import pyplot, save_png

CURVES = {
    "dpo": ("loss", "margin", "accuracy", "val_accuracy"),
    "reward": ("loss", "accuracy", "val_accuracy", "margin"),
    "rl": ("reward_mean", "kl", "clip_fraction", "entropy", "response_length", "loss"),
}


def plot_curves(records: Sequence[dict[str, Any]], keys: Sequence[str], path: Path) -> Path | None:
    """A PNG of each key against step (reward_mean with its ±std band); None without records."""
    keys = [k for k in keys if any(k in r for r in records)]
    if not records or not keys:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 2.8), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        steps, values = zip(*points, strict=True) if points else ((), ())
        ax.plot(steps, values, marker="." if len(points) < 30 else None)
        if key == "reward_mean":
            spread = [r.get("reward_std", 0.0) for r in records if r.get(key) is not None]
            low = [v - s for v, s in zip(values, spread, strict=True)]
            high = [v + s for v, s in zip(values, spread, strict=True)]
            ax.fill_between(steps, low, high, alpha=0.2)
        ax.set_title(key)
        ax.set_xlabel("step")
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_png(fig, path)
