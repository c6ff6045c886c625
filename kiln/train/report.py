"""Pictures of a run: loss curves from metrics.jsonl, written under the run's report/ folder."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.errors import KilnError


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file, in order."""
    records = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise KilnError(f"{path}:{line_no}: invalid JSON ({exc.msg})") from None
    return records


def plot_losses(metrics_path: str | Path, png_path: str | Path) -> Path:
    """Train and validation loss against tokens seen, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KilnError("plotting needs matplotlib: pip install 'kiln[plot]'") from None
    records = read_metrics(metrics_path)
    train = [(r["tokens"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["tokens"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if not train:
        raise KilnError(f"{metrics_path}: no training losses to plot")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(*zip(*train, strict=True), label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", linewidth=1.5)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("kiln: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(out)
    return out
