"""fp8 training against bf16 and fp32: the demo recipe for the same steps, loss curves overlaid.

    .venv/bin/python bench/fp8_train.py OUT                 # demo recipe, 150 steps per run
    .venv/bin/python bench/fp8_train.py OUT --tiny --noisy  # a tiny model, 20 steps: it works

Trains kiln/assets/demo.toml (4 × 256, 4k BPE, TinyStories: bench/train.py's cached shards) with
the same seed and data order under each precision: bf16 autocast (the baseline), fp32, and
`train.fp8` = tensor and block (bf16 autocast around fp8-rounded matmul operands; on a CPU the
fp8 is exact emulation, so the times say nothing of fp8 speed). Prints one JSON line per run,
the final loss (mean of the last 10% of steps) and val loss per run with its ratio to bf16, and
writes OUT/fp8_loss.png (the curves) and OUT/fp8_train.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._load import add_noisy_flag, begin  # noqa: E402

# name -> --set overrides
RUNS: dict[str, list[str]] = {
    "bf16": ["train.dtype=bf16"],
    "fp32": ["train.dtype=fp32"],
    "fp8 tensor": ["train.dtype=bf16", "train.fp8=tensor"],
    "fp8 block": ["train.dtype=bf16", "train.fp8=block"],
}
TINY = ["model.n_layer=2", "model.n_embd=128", "data.seq_len=64", "model.block_size=64",
        "schedule.warmup_steps=2",
        "batch.global_tokens=512", "batch.micro_batch=8"]  # fmt: skip


def train(name: str, sets: list[str], args: argparse.Namespace, data: Path) -> dict[str, Any]:
    """One run of the demo recipe with `sets`; its per-step losses and final figures."""
    from kiln.demo import asset
    from kiln.train.config import load_train_config
    from kiln.train.trainer import Trainer

    run = args.out / name.replace(" ", "_")
    common = [
        f"data.dataset={data}", f"logging.run_dir={run}", "logging.progress=false",
        "train.time_budget=none", f"train.max_steps={args.steps}", "eval.every=0",
        "eval.sample_tokens=0", "checkpoint.every=0", "logging.every=1", "eval.batches=8",
    ]  # fmt: skip
    cfg = load_train_config(asset("demo.toml"), [*common, *(TINY if args.tiny else []), *sets])
    if run.exists():
        import shutil

        shutil.rmtree(run)  # a bench run folder of this script's own, remade each time
    started = time.perf_counter()
    trainer = Trainer(cfg, run)
    result = trainer.run()
    tail = result.losses[-max(1, len(result.losses) // 10) :]
    return {
        "run": name, "steps": result.step, "final_loss": statistics.fmean(tail),
        "val_loss": result.val_loss, "losses": result.losses, "fp8": trainer.fp8,
        "precision": trainer.precision.name, "seconds": time.perf_counter() - started,
    }  # fmt: skip


def plot(rows: list[dict[str, Any]], path: Path, what: str) -> None:
    """The loss curves of every run on one chart."""
    from kiln.plotting import pyplot, save_png

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        ax.plot(range(1, len(row["losses"]) + 1), row["losses"], label=row["run"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title(f"{what}: fp8 (emulated) vs bf16 vs fp32, same steps and data")
    ax.set_ylim(top=min(8.5, max(max(r["losses"]) for r in rows)))
    ax.legend()
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    """Train every run, print the table and the ratios, write the PNG and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=None, help="per run (150; --tiny: 20)")
    parser.add_argument(
        "--runs", default=",".join(RUNS), help="comma-separated, of " + ", ".join(RUNS)
    )
    parser.add_argument("--tiny", action="store_true", help="a 2 × 128 model, 64-token windows")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/kiln-bench-train"))
    add_noisy_flag(parser)
    args = parser.parse_args(argv)
    args.steps = args.steps or (20 if args.tiny else 150)
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown or "bf16" not in names:
        parser.error(f"--runs: need bf16 and only names of {', '.join(RUNS)}; got {args.runs!r}")
    measured = begin("bench/fp8_train.py", args.noisy)
    import torch

    from bench.train import prepare

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    data = prepare(args.cache)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        row = train(name, RUNS[name], args, data)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    base = next(r for r in rows if r["run"] == "bf16")
    print(f"\n| run | final train loss | × bf16 | val loss | × bf16 | s ({args.steps} steps) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        val = r["val_loss"] or float("nan")
        print(f"| {r['run']} | {r['final_loss']:.4f} | {r['final_loss'] / base['final_loss']:.4f} "
              f"| {val:.4f} | {val / (base['val_loss'] or float('nan')):.4f} "
              f"| {r['seconds']:.0f} |")  # fmt: skip
    plot(rows, args.out / "fp8_loss.png", "tiny model" if args.tiny else "demo recipe")
    print(f"\ncurves: {args.out / 'fp8_loss.png'}")
    print(measured.line())
    from kiln.io import write_json_atomic

    write_json_atomic(args.out / "fp8_train.json", measured.stamp({"steps": args.steps,
                                                                   "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
