"""Pictures of a run from its metrics.jsonl: PNG curves and an HTML report under `RUN/report/`.

`plot_run` writes loss (train and validation) against tokens, learning rate, gradient norm and
throughput against steps, then `index.html`: the PNGs embedded (base64, so the page stands alone),
a table of the final metrics and the resolved config. Each file is written under a temporary name
and renamed, the page last, so a reader never sees a half-written picture or a page without one.
"""

from __future__ import annotations

import base64
import html
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, json_error_reason, not_found
from kiln.io import atomic_write
from kiln.plotting import pyplot, save_png

# (file stem, metric key, y label, title, log-scale y) of the per-step curves.
STEP_CURVES: tuple[tuple[str, str, str, str, bool], ...] = (
    ("lr", "lr", "learning rate", "learning rate", False),
    ("grad_norm", "grad_norm", "gradient norm (before clipping)", "gradient norm", True),
    ("throughput", "tokens_per_s", "tokens / s", "throughput", False),
)


@dataclass
class RunReport:
    """The files `plot_run` wrote."""

    html: Path
    pngs: list[Path]


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file, in order."""
    records = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise KilnError(
                f"{path}:{line_no}: invalid JSON ({json_error_reason(exc, line_no)})"
            ) from None
    return records


def read_run_metrics(run_dir: Path) -> list[dict]:
    """The metrics records of a run directory; a clear error when it has none."""
    if not run_dir.is_dir():
        raise not_found(run_dir, "run directory")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise KilnError(
            f"{path}: not found, so nothing to plot; is {run_dir} a `kiln train` run directory "
            "that has logged a step?"
        )
    records = [r for r in read_metrics(path) if isinstance(r, dict) and "step" in r]
    if not records:
        raise KilnError(f"{path}: no metrics records yet, so nothing to plot")
    return records


# ---- figures -------------------------------------------------------------------------------------


def _series(records: list[dict], x: str, y: str) -> list[tuple[float, float]]:
    """(x, y) pairs of the records where both are finite numbers."""
    out = []
    for r in records:
        a, b = r.get(x), r.get(y)
        if isinstance(a, int | float) and isinstance(b, int | float) and math.isfinite(b):
            out.append((a, b))
    return out


def _loss_figure(records: list[dict], source: str | Path) -> Any:
    """Train and validation loss against tokens seen."""
    train = _series(records, "tokens", "loss")
    val = _series(records, "tokens", "val_loss")
    if not train:
        raise KilnError(f"{source}: no training losses to plot")
    fig, ax = pyplot().subplots(figsize=(7, 4), dpi=120)
    ax.plot(*zip(*train, strict=True), label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", linewidth=1.5)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("kiln: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _step_figure(records: list[dict], key: str, ylabel: str, title: str, log: bool) -> Any:
    """One metric against optimizer steps ("no data" written on an empty plot)."""
    points = _series(records, "step", key)
    fig, ax = pyplot().subplots(figsize=(7, 3.2), dpi=120)
    if points:
        ax.plot(*zip(*points, strict=True), linewidth=1.2)
        values = [v for _, v in points]
        if log and min(values) > 0 and max(values) > 10 * min(values):  # spans a decade
            ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, f"no {key} values logged", ha="center", va="center")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(f"kiln: {title}")
    ax.grid(alpha=0.3)
    return fig


def _expert_load_figure(records: list[dict]) -> Any:
    """MoE: each layer's busiest and idlest expert (share × n_experts; 1 = balanced) by step."""
    fig, ax = pyplot().subplots(figsize=(7, 3.2), dpi=120)
    layers = sorted({k.split(".")[1] for r in records for k in r if k.endswith(".load_max")})
    for layer in layers:
        for stat, style in (("load_max", "-"), ("load_min", "--")):
            points = _series(records, "step", f"moe.{layer}.{stat}")
            if points:
                ax.plot(
                    *zip(*points, strict=True), style, linewidth=1.0, label=f"{layer} {stat[5:]}"
                )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("expert load (1 = balanced)")
    ax.set_title("kiln: MoE expert load per layer (max solid, min dashed)")
    ax.legend(fontsize=6, ncol=4)
    ax.grid(alpha=0.3)
    return fig


def plot_losses(metrics_path: str | Path, png_path: str | Path) -> Path:
    """Train and validation loss against tokens seen, as a PNG (needs matplotlib)."""
    records = read_metrics(metrics_path)
    return save_png(_loss_figure(records, metrics_path), png_path)


# ---- the report ----------------------------------------------------------------------------------


def final_metrics(records: list[dict]) -> list[tuple[str, str]]:
    """(name, shown value) rows summarising a run: where it ended and how fast it went."""
    last = records[-1]
    val = _series(records, "step", "val_loss")
    tps = [v for _, v in _series(records, "step", "tokens_per_s") if v > 0]
    mfus = [v for _, v in _series(records, "step", "mfu")]
    rows = [
        ("step", f"{last['step']:,}"),
        ("tokens seen", f"{last['tokens']:,}" if "tokens" in last else "n/a"),
        ("train loss", _number(last.get("loss"), ".4f")),
        ("validation loss", f"{val[-1][1]:.4f} (step {val[-1][0]:,})" if val else "n/a"),
        ("learning rate", _number(last.get("lr"), ".3g")),
        ("gradient norm", _number(last.get("grad_norm"), ".3g")),
        ("tokens/s (last)", _number(last.get("tokens_per_s"), ",.0f")),
        ("tokens/s (median)", f"{sorted(tps)[len(tps) // 2]:,.0f}" if tps else "n/a"),
        ("MFU (last)", f"{100 * mfus[-1]:.1f}%" if mfus else "n/a"),
        ("skipped steps", str(last.get("skipped_steps", 0))),
    ]
    # Written by newer runs only: shown when there (the dtype auto chose, the budget's clock).
    precision = [r["precision"] for r in records if isinstance(r.get("precision"), dict)]
    if precision:
        chosen = precision[-1]
        rows.append(("precision", f"{chosen.get('dtype')} ({chosen.get('reason')})"))
    if isinstance(last.get("train_s"), int | float):
        rows.append(("training time", f"{last['train_s']:,.1f} s (evaluation excluded)"))
    return rows


def _number(value: Any, fmt: str) -> str:
    """A number formatted, or "n/a" for a missing or non-finite one."""
    if isinstance(value, int | float) and math.isfinite(value):
        return format(value, fmt)
    return "n/a"


def plot_run(run_dir: str | Path) -> RunReport:
    """Write the run's curves and `index.html` under `run_dir/report/`; return their paths."""
    run_dir = Path(run_dir)
    records = read_run_metrics(run_dir)
    report = run_dir / "report"
    metrics_path = run_dir / "metrics.jsonl"
    pngs = [save_png(_loss_figure(records, metrics_path), report / "loss.png")]
    for stem, key, ylabel, title, log in STEP_CURVES:
        pngs.append(
            save_png(_step_figure(records, key, ylabel, title, log), report / f"{stem}.png")
        )
    if any("moe.dead_experts" in r for r in records):
        pngs.append(save_png(_expert_load_figure(records), report / "expert_load.png"))
    schedule = report / "lr_schedule.png"  # from `kiln train --plot-schedule`, when there is one
    shown = [*pngs, schedule] if schedule.is_file() else pngs
    page = report / "index.html"
    with atomic_write(page) as handle:
        handle.write(render_html(run_dir, records, shown))
    return RunReport(html=page, pngs=pngs)


def render_html(run_dir: Path, records: list[dict], pngs: list[Path]) -> str:
    """The report page: final metrics, the curves (embedded), the resolved config."""
    name = html.escape(run_dir.resolve().name)
    rows = "\n".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
        for k, v in final_metrics(records)
    )
    images = "\n".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode("ascii")}"></figure>'
        for p in pngs
    )
    config_file = run_dir / "config.toml"
    config = (
        config_file.read_text(encoding="utf-8")
        if config_file.is_file()
        else f"({config_file} not found)"
    )
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>kiln run {name}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ text-align: left; padding: 0.25em 1em; border-bottom: 1px solid #ddd; }}
td {{ font-variant-numeric: tabular-nums; }}
figure {{ margin: 1em 0; }}
img {{ max-width: 100%; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; }}
</style>
</head>
<body>
<h1>kiln run {name}</h1>
<p>{html.escape(str(run_dir))} &middot; {len(records):,} logged steps &middot; written {when}</p>
<h2>Final metrics</h2>
<table>
{rows}
</table>
<h2>Curves</h2>
{images}
<h2>Resolved config</h2>
<pre>{html.escape(config)}</pre>
</body>
</html>
"""
