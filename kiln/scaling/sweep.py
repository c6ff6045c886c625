"""IsoFLOP sweeps: a train config per (FLOP budget, model size), run with kiln's trainer.

For each budget C and shape (n_layer × n_embd) the run trains on D = C / (6·N) tokens, N being
the model's whole parameter count (Hoffmann et al.'s C ≈ 6·N·D), rounded to whole steps of the
base config's global batch; the cosine schedule spans each run's own length, as Chinchilla's
runs did. The sweep directory holds `sweep.json` (the plan), `configs/NAME.toml` (one
`kiln train` config per run), `runs/NAME/` (each run directory) and `results.csv` (one row per
finished run, its final validation loss). Running again skips finished runs and resumes an
interrupted one from its checkpoint.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.io import atomic_write, check_can_write, write_json_atomic
from kiln.model.config import ModelConfig
from kiln.train.config import TrainConfig, load_train_config

RESULT_FIELDS = (
    "name", "budget", "n_layer", "n_embd", "params", "tokens", "steps", "flops_6nd",
    "flops_exact", "loss", "loss_kind", "train_loss", "seconds",
)  # fmt: skip
TEXT_FIELDS = ("name", "loss_kind")


@dataclass(frozen=True)
class SweepRun:
    """One planned run of the sweep."""

    name: str
    budget: float  # the nominal FLOP budget this run belongs to
    n_layer: int
    n_embd: int
    params: int
    tokens: int  # steps × global batch
    steps: int
    flops_6nd: float  # 6·N·D of the run as trained
    flops_exact: float  # ModelConfig.flops_per_token(seq_len) × D


def parse_shape(text: str) -> tuple[int, int]:
    """'4x128' -> (n_layer, n_embd)."""
    try:
        layers, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise KilnError(f"model size {text!r}: expected N_LAYERxN_EMBD, e.g. 4x128") from None
    if layers < 1 or width < 1:
        raise KilnError(f"model size {text!r}: both numbers must be >= 1")
    return layers, width


def parse_floats(text: str, what: str) -> list[float]:
    """'1e12,3e12' -> [1e12, 3e12], positive values only."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise KilnError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise KilnError(f"{what}: expected positive numbers, got {text!r}")
    return values


def shape_overrides(base: ModelConfig, n_layer: int, n_embd: int) -> dict[str, Any]:
    """Model fields for a shape, keeping the base's head width and query-per-kv-head grouping."""
    head = base.head_size
    if n_embd % head:
        raise KilnError(f"n_embd {n_embd} is not a multiple of the base head_dim {head}")
    n_head = n_embd // head
    group = base.n_head // base.kv_heads
    fields: dict[str, Any] = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head}
    fields["n_kv_head"] = n_head // group if n_head % group == 0 else n_head
    return fields


def run_name(budget: float, n_layer: int, n_embd: int) -> str:
    """A file-name-safe run name, e.g. c1.0e12_4x128."""
    mantissa, exponent = f"{budget:.1e}".split("e")
    return f"c{mantissa}e{int(exponent)}_{n_layer}x{n_embd}"


def plan_sweep(
    base: TrainConfig,
    vocab_size: int,
    budgets: list[float],
    shapes: list[tuple[int, int]],
    min_steps: int = 5,
) -> tuple[list[tuple[SweepRun, TrainConfig]], list[str]]:
    """The runs (and their configs) of a sweep, and notes on the pairs left out."""
    base_model = base.model_config(vocab_size)
    T, batch = base.data.seq_len, base.batch.global_tokens
    runs: list[tuple[SweepRun, TrainConfig]] = []
    notes: list[str] = []
    for budget in budgets:
        for n_layer, n_embd in shapes:
            model_fields = {**base.model, **shape_overrides(base_model, n_layer, n_embd)}
            cfg = dataclasses.replace(base, model=model_fields)
            model = cfg.model_config(vocab_size)
            n = model.num_params()
            steps = round(budget / (6 * n) / batch)
            if steps < min_steps:
                notes.append(
                    f"{n_layer}x{n_embd} at {budget:.3g} FLOPs: {steps} steps of {batch} tokens "
                    f"(< {min_steps}); left out"
                )
                continue
            tokens = steps * batch
            run = SweepRun(
                run_name(budget, n_layer, n_embd), budget, n_layer, n_embd, n, tokens, steps,
                6.0 * n * tokens, float(model.flops_per_token(T)) * tokens,
            )  # fmt: skip
            runs.append((run, _run_config(cfg, steps)))
    return runs, notes


def _run_config(cfg: TrainConfig, steps: int) -> TrainConfig:
    """The base config set to `steps` steps, one eval at the end, no samples, little saved."""
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, max_steps=steps, time_budget=None),  # sized by steps
        schedule=dataclasses.replace(
            cfg.schedule, warmup_steps=min(cfg.schedule.warmup_steps, max(1, steps // 10))
        ),
        eval=dataclasses.replace(cfg.eval, every=0, sample_tokens=0),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=max(50, steps // 4), keep_last=1),
        logging=dataclasses.replace(cfg.logging, every=max(1, steps // 20), progress=False),
    )


def write_sweep(
    out: str | Path,
    base_path: str | Path,
    budgets: list[float],
    shapes: list[tuple[int, int]],
    overrides: list[str] | None = None,
    min_steps: int = 5,
    force: bool = False,
) -> tuple[list[SweepRun], list[str]]:
    """Write sweep.json and configs/*.toml under `out`; returns the runs and notes."""
    from kiln.data import Dataset

    out = Path(out)
    check_can_write(out / "sweep.json", force)
    base = load_train_config(base_path, overrides or [])
    dataset = Dataset.open(base.data.dataset)
    planned, notes = plan_sweep(base, dataset.vocab_size, budgets, shapes, min_steps)
    available = dataset.split("train").n_tokens
    notes += [
        f"{run.name} reads {run.tokens:,} tokens, {run.tokens / available:.1f}× the "
        f"{available:,}-token train split: data repeats, which scaling laws do not model"
        for run, _ in planned
        if run.tokens > available
    ]
    if not planned:
        raise KilnError("no run left in the sweep: raise the budgets or use smaller models")
    _set_aside_old_results(out)  # only once the new sweep is known to be valid
    for run, cfg in planned:
        cfg = dataclasses.replace(
            cfg, logging=dataclasses.replace(cfg.logging, run_dir=str(out / "runs" / run.name))
        )
        with atomic_write(out / "configs" / f"{run.name}.toml") as handle:
            handle.write(cfg.to_toml())
    runs = [run for run, _ in planned]
    write_json_atomic(
        out / "sweep.json",
        {"base": str(base_path), "overrides": overrides or [], "budgets": budgets,
         "shapes": [f"{n}x{d}" for n, d in shapes], "seq_len": base.data.seq_len,
         "global_tokens": base.batch.global_tokens, "notes": notes,
         "runs": [dataclasses.asdict(r) for r in runs]},
    )  # fmt: skip
    return runs, notes


def load_sweep(out: str | Path) -> list[SweepRun]:
    """The runs of a sweep directory written by `write_sweep`."""
    path = Path(out) / "sweep.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return [SweepRun(**r) for r in data["runs"]]
    except OSError:
        raise KilnError(f"{path}: no sweep here (write one with `kiln scaling sweep`)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise KilnError(f"{path}: not a kiln sweep file ({exc})") from None


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a results.csv (numbers parsed); an empty list when there is none yet."""
    path = Path(path)
    if not path.is_file():
        return []
    with path.open(encoding="utf-8", newline="") as handle:
        return [
            {k: (v if k in TEXT_FIELDS else float(v)) for k, v in row.items()}
            for row in csv.DictReader(handle)
        ]


def _set_aside_old_results(out: Path) -> None:
    """A rewritten sweep must not reuse the old one's results or resume its checkpoints: move
    them into `replaced-<time>/` (kept, not deleted)."""
    old = [p for p in (out / "results.csv", out / "runs") if p.exists()]
    if not old:
        return
    aside = out / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(parents=True)
    for path in old:
        os.replace(path, aside / path.name)


def write_results(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Write results.csv atomically."""
    with atomic_write(path) as handle:
        writer = csv.DictWriter(handle, fieldnames=RESULT_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: row.get(k, "") for k in RESULT_FIELDS} for row in rows)


def run_sweep(out: str | Path, progress: bool = True) -> list[dict[str, Any]]:
    """Train every run of the sweep that has no result yet; returns all result rows."""
    out = Path(out)
    runs = load_sweep(out)
    results_path = out / "results.csv"
    rows = read_results(results_path)
    done = {row["name"] for row in rows}
    todo = [r for r in runs if r.name not in done]
    bar = _progress(len(runs), len(runs) - len(todo), progress)
    try:
        for run in todo:
            if bar is not None:
                bar.set_postfix_str(run.name)
            rows.append(train_one(out, run))
            write_results(results_path, rows)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return rows


def train_one(out: Path, run: SweepRun) -> dict[str, Any]:
    """Train one run of the sweep in this process (as `kiln train` would) and report it."""
    from kiln.checkpoint_format import latest_checkpoint
    from kiln.train.trainer import Trainer

    cfg = load_train_config(out / "configs" / f"{run.name}.toml")
    run_dir = Path(cfg.logging.run_dir)
    resume = latest_checkpoint(run_dir / "checkpoints") is not None
    start = time.perf_counter()
    result = Trainer(cfg, run_dir, resume=resume).run()
    if result.interrupted:
        raise KeyboardInterrupt
    tail = result.losses[-max(1, len(result.losses) // 10) :]
    train_loss = sum(tail) / len(tail) if tail else float("nan")
    if result.val_loss is None:
        warnings.warn(
            f"{run.name}: no validation loss (eval is off); its `loss` is the training loss",
            stacklevel=2,
        )
    loss = result.val_loss if result.val_loss is not None else train_loss
    kind = "val" if result.val_loss is not None else "train"
    return {
        **dataclasses.asdict(run), "loss": loss, "loss_kind": kind, "train_loss": train_loss,
        "seconds": time.perf_counter() - start,
    }  # fmt: skip


def _progress(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="run", dynamic_ncols=True)
