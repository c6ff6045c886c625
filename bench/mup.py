"""µP transfer on TinyStories (CPU): the learning-rate sweep at three widths, SP against µP.

Each (parameterisation, width, lr) trains kiln's Trainer for --steps steps on the same batches
(bench/arch.py's data: the demo tokenizer and TinyStories shards), Llama-style, 2 layers, 4
heads (head width grows with the model), tied embeddings, AdamW, warmup 10 then cosine, fp32,
one thread, one run after another. µP is relative to the smallest width, where SP and µP are
the same model (its two curves coincide: a check of the setup). Reported: final val loss
(first 16k val tokens) per lr, the best lr per width, and a PNG of loss against lr.

Under SP the best lr falls as the model widens (hidden updates grow with width); under µP it
should stay put, so an lr tuned on the small model is the right one for the large.

    .venv/bin/python bench/mup.py                     # 30 short runs; ~15-25 min on a loaded CPU
    .venv/bin/python bench/mup.py --steps 40 --lrs 0.002,0.008,0.032
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arch import DEFAULT_CACHE, config, prepare

from bench._load import add_noisy_flag, begin
from kiln.io import write_json_atomic
from kiln.train.trainer import NonFiniteError, Trainer

WIDTHS = (64, 128, 256)
LRS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032)
SEQ, MICRO = 64, 16  # one micro-step of 16 x 64 = 1024 tokens per step


def run_config(data_dir: Path, width: int, mup: bool, lr: float, steps: int) -> Any:
    """bench/arch.py's recipe at this sweep's size: 2 layers, this width, SP or µP, this lr."""
    model = dict(n_layer=2, n_head=4, n_kv_head=4, n_embd=width, d_ff=None, ff_multiple=32,
                 mup_base_width=min(WIDTHS) if mup else None)  # fmt: skip
    cfg = config(data_dir, model, steps)
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, seq_len=SEQ),
        batch=dataclasses.replace(cfg.batch, global_tokens=SEQ * MICRO, micro_batch=MICRO),
        optim=dataclasses.replace(cfg.optim, lr=lr),
    )


def val_loss_of(model: torch.nn.Module, data_dir: Path, n_tokens: int = 16384) -> float:
    """Mean val loss (nats/token) on the first n_tokens of the val split."""
    from kiln.eval.lm import val_loss
    from kiln.eval.scoring import Scorer

    result = val_loss(Scorer(model, 32, progress=False), data_dir, "val", n_tokens)
    return result.nats / result.n_tokens


def train_one(cfg: Any, run_dir: Path, data_dir: Path) -> dict[str, Any]:
    """One run: final val loss (inf if it diverged), whether it diverged, seconds."""
    shutil.rmtree(run_dir, ignore_errors=True)
    torch.manual_seed(0)
    start = time.perf_counter()
    diverged = False
    try:
        trainer = Trainer(cfg, run_dir)
        trainer.run()
        loss = val_loss_of(trainer.model.eval(), data_dir)
    except NonFiniteError as exc:  # a diverged run is a point of the sweep; other errors are bugs
        print(f"    diverged: {exc}", flush=True)
        loss, diverged = math.inf, True
    return {"val_loss": loss if math.isfinite(loss) else math.inf, "diverged": diverged,
            "seconds": time.perf_counter() - start}  # fmt: skip


def plot(results: dict[str, Any], path: Path) -> Path:
    """Loss against lr per width, one panel per parameterisation; the best lr starred."""
    from kiln.plotting import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    colors = plt.cm.viridis([0.0, 0.45, 0.85])
    for ax, param in zip(axes, ("sp", "mup"), strict=True):
        for color, width in zip(colors, WIDTHS, strict=True):
            points = results[param][str(width)]
            lrs = [p["lr"] for p in points]
            losses = [p["val_loss"] for p in points]
            ax.plot(lrs, losses, marker="o", color=color, label=f"width {width}")
            best = min(points, key=lambda p: p["val_loss"])
            ax.scatter([best["lr"]], [best["val_loss"]], marker="*", s=180, color=color,
                       edgecolor="black", zorder=4)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("learning rate (AdamW, optim.lr)")
        ax.set_title({"sp": "standard parameterisation", "mup": "µP (base width 64)"}[param])
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("final val loss (nats/token)")
    finite = [p["val_loss"] for r in results.values() for w in r.values() for p in w
              if math.isfinite(p["val_loss"])]  # fmt: skip
    axes[0].set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 1.5) + 0.05)
    axes[1].legend()
    fig.suptitle("TinyStories, 2 layers, lr sweep at three widths (★ best lr)", fontsize=10)
    return save_png(fig, path, dpi=110)


def main() -> int:
    """Run the sweep; print the table and the optima; write JSON and the PNG."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/kiln-bench-mup"))
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    ap.add_argument("--lrs", default=",".join(map(str, LRS)), help="comma-separated lrs")
    ap.add_argument("--plot", type=Path, default=Path("docs/images/mup_lr_transfer.png"))
    add_noisy_flag(ap)
    args = ap.parse_args()
    measured = begin("bench/mup.py", args.noisy)
    torch.set_num_threads(1)  # the machine is shared: one core, runs one after another
    data_dir = prepare(args.cache)
    lrs = [float(x) for x in args.lrs.split(",")]
    results: dict[str, Any] = {"sp": {}, "mup": {}}
    for param in ("sp", "mup"):
        for width in WIDTHS:
            points = results[param].setdefault(str(width), [])
            for lr in lrs:
                cfg = run_config(data_dir, width, param == "mup", lr, args.steps)
                out = train_one(cfg, args.out_dir / f"{param}-{width}-{lr}", data_dir)
                points.append({"lr": lr, **out})
                print(f"{param:>3} width {width:>3} lr {lr:<7g} val loss {out['val_loss']:.4f} "
                      f"({out['seconds']:.0f}s)", flush=True)  # fmt: skip
    print(
        "\n| parameterisation | width | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr |"
    )
    print("|---|---:|" + "---:|" * len(lrs) + "---:|")
    optima: dict[str, dict[str, float]] = {"sp": {}, "mup": {}}
    for param in ("sp", "mup"):
        for width in WIDTHS:
            points = results[param][str(width)]
            best = min(points, key=lambda p: p["val_loss"])
            optima[param][str(width)] = best["lr"]
            cells = " | ".join(f"{p['val_loss']:.4f}" for p in points)
            print(f"| {param} | {width} | {cells} | {best['lr']:g} |")
    doc = {"steps": args.steps, "tokens_per_step": SEQ * MICRO, "widths": WIDTHS, "lrs": lrs,
           "results": results, "optima": optima}  # fmt: skip
    print(measured.line())
    write_json_atomic(args.out_dir / "mup.json", measured.stamp(doc))
    print(f"optima: {json.dumps(optima)}")
    print(f"wrote {args.out_dir / 'mup.json'} and {plot(results, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
