"""µP transfer of the 10-minute demo recipe: does its learning rate carry to 2× and 4× wider?

The recipe is `kiln/assets/demo.toml` (4 layers, seq 256, batch 2,048 tokens, AdamW, WSD, bf16
autocast where native) under µP with base width 256 (demo.toml's own width, where µP and SP are
the same model). Each (width, lr) cell trains kiln's Trainer for --steps optimizer steps on the
same batches (data.seed 0) of the speedrun's training stories (bench/speedrun.py's data: the
4,096-token BPE, every 50th story held out), fixed step count (no time budget), one thread.

Width convention: the depth stays 4 and heads stay 64 wide, so n_head = width/64 and
n_kv_head = n_head/2 (demo.toml's 4/2 at 256; 8/4 at 512; 16/8 at 1024). With a fixed head
width µP's 1/D attention is the base model's 1/√64 (kiln's √D₀/D at D = D₀), and the width
multiplier m = width/256 rescales the hidden matrices' init (1/√m) and AdamW lr (1/m) and the
head's input (1/m), as kiln/train/mup.py does.

The lr grid is multiplicative around demo.toml's 2e-3 (--mults, default ×1/4..×4). Reported
per cell: the holdout bits per byte (the first --holdout-bytes of the held-out stories, whole
stories, `kiln.eval.lm.stream_bits_per_byte`) and the mean training loss of the last 5 steps;
the best lr per width and whether it lies within one grid step of the base width's best.
Cells are cached as JSON under --out-dir, so a run can be stopped and continued, or a width
given only part of the grid (--cells WIDTH:MULT,...) and completed later.

    .venv/bin/python bench/mup_demo.py --steps 50                 # 15 cells, ~25 CPU-min quiet
    .venv/bin/python bench/mup_demo.py --steps 50 --cells 1024:0.5,1024:1,1024:2 --noisy
    .venv/bin/python bench/mup_demo.py --steps 50 --report        # table + PNG from the cache
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speedrun import EOT, prepare, split_stories

from bench._load import add_noisy_flag, begin
from kiln.errors import KilnError
from kiln.io import atomic_write, write_json_atomic

BASE_WIDTH = 256
WIDTHS = (256, 512, 1024)
MULTS = (0.25, 0.5, 1.0, 2.0, 4.0)
DEMO_LR = 2e-3
HEAD_WIDTH = 64


def cell_config(data_dir: Path, width: int, lr: float, steps: int) -> Any:
    """demo.toml under µP (base 256) at this width and lr, for exactly `steps` steps."""
    from kiln.demo import asset
    from kiln.train.config import load_train_config

    n_head = width // HEAD_WIDTH
    sets = [
        f"data.dataset={data_dir}", "logging.progress=false", "logging.every=10",
        "checkpoint.every=0", "eval.batches=0", "eval.sample_tokens=0",
        "train.time_budget=none", f"train.max_steps={steps}", f"optim.lr={lr}",
        f"model.n_embd={width}", f"model.n_head={n_head}", f"model.n_kv_head={n_head // 2}",
        f"model.mup_base_width={BASE_WIDTH}",
    ]  # fmt: skip
    return load_train_config(asset("demo.toml"), sets)


def holdout_prefix(cache: Path, n_bytes: int) -> Path:
    """The first held-out stories, whole, up to n_bytes (written once)."""
    _, holdout = split_stories(cache)
    out = cache / f"holdout-{n_bytes}.txt"
    if not out.is_file():
        kept, size = [], 0
        for story in holdout.read_text(encoding="utf-8").split(f"{EOT}\n"):
            if not story.strip() or size + len(story.encode()) > n_bytes:
                break
            kept.append(f"{story}{EOT}\n")
            size += len(kept[-1].encode())
        with atomic_write(out) as handle:
            handle.write("".join(kept))
    return out


def run_cell(prep: dict[str, Any], cache: Path, width: int, mult: float, args: Any) -> dict:
    """Train one (width, lr) cell; its holdout bpb, last-5-step train loss and times."""
    import torch

    from kiln.eval.lm import stream_bits_per_byte
    from kiln.eval.scoring import Scorer
    from kiln.tokenizer import Tokenizer
    from kiln.train.trainer import NonFiniteError, Trainer

    data_dir = Path(prep["dir"]) / "data"
    cfg = cell_config(data_dir, width, DEMO_LR * mult, args.steps)
    torch.manual_seed(0)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    out: dict[str, Any] = {"width": width, "mult": mult, "lr": DEMO_LR * mult,
                           "steps": args.steps, "n_head": cfg.model["n_head"]}  # fmt: skip
    try:
        run_dir = args.out_dir / "runs" / f"{width}-{mult:g}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a scratch run; an interrupted cell restarts
        trainer = Trainer(cfg, run_dir)
        result = trainer.run()
        if result.interrupted:  # a stopped cell is no point of the grid: leave it unwritten
            raise SystemExit(f"bench/mup_demo.py: width {width} ×{mult:g} was interrupted")
    except NonFiniteError as exc:  # a diverged cell is a point of the grid
        print(f"    diverged: {exc}", flush=True)
        return {**out, "diverged": True, "holdout_bpb": math.inf, "train_loss": math.inf}
    out["train_cpu_s"] = round(time.process_time() - cpu0, 1)
    out["train_wall_s"] = round(time.perf_counter() - wall0, 1)
    out["params"] = sum(p.numel() for p in trainer.model.parameters())
    out["tokens"] = result.tokens
    out["train_loss"] = round(sum(result.losses[-5:]) / len(result.losses[-5:]), 4)
    tok = Tokenizer.load(Path(prep["dir"]) / "tokenizer.json")
    scorer = Scorer(trainer.model.eval(), batch_size=16, progress=False)
    with torch.no_grad():
        scored = stream_bits_per_byte(
            scorer, tok, holdout_prefix(cache, args.holdout_bytes), tok.special_tokens[EOT]
        )
    bpb = scored.bits_per_byte
    out["holdout_bpb"] = round(bpb, 4) if bpb is not None and math.isfinite(bpb) else math.inf
    out["diverged"] = False
    return out


def parse_cells(text: str | None) -> list[tuple[int, float]]:
    """'1024:0.5,1024:1' -> [(1024, 0.5), (1024, 1.0)]; None: the whole grid."""
    if text is None:
        return [(w, m) for w in WIDTHS for m in MULTS]
    cells = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            w, m = part.split(":")
            cells.append((int(w), float(m)))
        except ValueError:
            raise KilnError(f"--cells: {part!r} is not WIDTH:MULT (e.g. 1024:0.5)") from None
        if cells[-1][0] % (2 * HEAD_WIDTH) or cells[-1][1] <= 0:
            raise KilnError(f"--cells: {part!r}: width must be a multiple of 128, mult > 0")
    return cells


def summarise(cells: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Best multiplier per width and whether it is within one grid step of the base's best."""
    by_width: dict[int, list[dict[str, Any]]] = {}
    for c in cells:
        by_width.setdefault(c["width"], []).append(c)
    best = {w: min(cs, key=lambda c: c[metric])["mult"] for w, cs in by_width.items()}
    out: dict[str, Any] = {"best_mult": best, "within_one_step": {}, "edge": {}}
    grid = sorted(MULTS)
    for w, cs in by_width.items():
        run = sorted(c["mult"] for c in cs)
        # an optimum at the edge of the lrs run at that width may lie beyond them
        out["edge"][w] = best[w] in (run[0], run[-1]) and len(run) < len(grid)
        if BASE_WIDTH in best and best[w] in grid and best[BASE_WIDTH] in grid:
            out["within_one_step"][w] = abs(grid.index(best[w]) - grid.index(best[BASE_WIDTH])) <= 1
    return out


def table(cells: list[dict[str, Any]], metric: str) -> str:
    """Markdown: one row per width, one column per lr multiplier; the best cell in bold."""
    widths = sorted({c["width"] for c in cells})
    mults = sorted({c["mult"] for c in cells})
    lines = ["| width (heads) | params | " + " | ".join(
        f"lr {DEMO_LR * m:.2g} (×{m:g})" for m in mults) + " | best |",
        "|---|---:|" + "---:|" * len(mults) + "---|"]  # fmt: skip
    for w in widths:
        row = {c["mult"]: c for c in cells if c["width"] == w}
        best = min(row.values(), key=lambda c: c[metric])
        vals = [("**%.4f**" if row[m] is best else "%.4f") % row[m][metric] if m in row else "–"
                for m in mults]  # fmt: skip
        params = next((c.get("params") for c in row.values() if c.get("params")), 0)
        lines.append(f"| {w} ({w // HEAD_WIDTH}/{w // HEAD_WIDTH // 2}) | {params / 1e6:.1f}M | "
                     + " | ".join(vals) + f" | ×{best['mult']:g} |")  # fmt: skip
    return "\n".join(lines)


def plot(cells: list[dict[str, Any]], path: Path, steps: int) -> Path:
    """Holdout bpb against lr, a line per width, the best lr starred."""
    from kiln.plotting import pyplot, save_png

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    widths = sorted({c["width"] for c in cells})
    colors = plt.cm.viridis([i / max(1, len(widths) - 1) * 0.85 for i in range(len(widths))])
    for color, w in zip(colors, widths, strict=True):
        pts = sorted((c for c in cells if c["width"] == w), key=lambda c: c["lr"])
        finite = [c for c in pts if math.isfinite(c["holdout_bpb"])]
        ax.plot([c["lr"] for c in finite], [c["holdout_bpb"] for c in finite], marker="o",
                color=color, label=f"width {w}")  # fmt: skip
        best = min(finite, key=lambda c: c["holdout_bpb"])
        ax.scatter([best["lr"]], [best["holdout_bpb"]], marker="*", s=180, color=color,
                   edgecolor="black", zorder=4)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("optim.lr (µP, base width 256)")
    ax.set_ylabel("holdout bits per byte")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    ax.set_title(f"demo recipe under µP, {steps} steps × 2,048 tokens (★ best lr)", fontsize=10)
    return save_png(fig, path, dpi=110)


def write_points(cells: list[dict[str, Any]], log: Path, path: Path) -> int:
    """results.csv for `kiln scaling fit`: real runs on the demo's data, loss = holdout bpb.

    The rows: each width's best cell here (N, steps × 2,048 tokens), and every finished run of
    bench/speedrun_log.jsonl with the 4,096-token BPE and at most 4,096 tokens per step that is
    not the baseline (the demo recipe and its screened variants, 90 s to 10 min; the 8k and 16k
    batches are left out: at 35-67 steps they are step-starved, a recipe effect the law does
    not model). Budget = 6·N·D (no shared IsoFLOP budgets).
    """
    import json

    rows = []
    for w in sorted({c["width"] for c in cells}):
        best = min((c for c in cells if c["width"] == w), key=lambda c: c["holdout_bpb"])
        rows.append(
            (f"mup {w} x{best['mult']:g}", best["params"], best["tokens"], best["holdout_bpb"])
        )
    for line in log.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        small_batch = r.get("steps") and r["tokens"] / r["steps"] <= 4096
        if r.get("tokenizer") == "4096" and not r.get("baseline") and small_batch:
            rows.append((f"speedrun {r['date']} {r['name']}", r["params"], r["tokens"],
                         r["holdout_bpb"]))  # fmt: skip
    with atomic_write(path) as handle:
        handle.write("name,params,tokens,budget,loss\n")
        for name, n, d, loss in rows:
            handle.write(f'"{name}",{n},{d},{6 * n * d:.6g},{loss}\n')
    return len(rows)


def main() -> int:
    """Run the requested cells (cached), then print the table and write JSON and the PNG."""
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/kiln-sprun"))
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/kiln-bench-mup-demo"))
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps per cell (default 50)")
    ap.add_argument("--cells", help="WIDTH:MULT,... to run (default: the whole 3 × 5 grid)")
    ap.add_argument("--holdout-bytes", type=int, default=30_000)
    ap.add_argument("--report", action="store_true", help="run nothing; report the cached cells")
    ap.add_argument(
        "--points",
        type=Path,
        metavar="CSV",
        help="also write results.csv for `kiln scaling fit` (see write_points)",
    )
    ap.add_argument("--log", type=Path, default=Path(__file__).parent / "speedrun_log.jsonl")
    ap.add_argument("--plot", type=Path, default=Path("docs/images/mup_demo_transfer.png"))
    add_noisy_flag(ap)
    args = ap.parse_args()
    if args.steps < 1:
        raise SystemExit(f"bench/mup_demo.py: --steps must be >= 1, got {args.steps}")
    try:
        todo = [] if args.report else parse_cells(args.cells)
    except KilnError as exc:
        raise SystemExit(f"bench/mup_demo.py: {exc}") from None
    measured = begin("bench/mup_demo.py", args.noisy)
    torch.set_num_threads(1)  # one core per process: cells of a shared machine run side by side
    prep = prepare(args.cache, "4096")
    cell_dir = args.out_dir / f"cells-{args.steps}"
    for i, (width, mult) in enumerate(todo):
        path = cell_dir / f"{width}-{mult:g}.json"
        if path.is_file():
            continue
        print(f"[{i + 1}/{len(todo)}] width {width} lr {DEMO_LR * mult:.3g} (×{mult:g}) ...",
              flush=True)  # fmt: skip
        cell = run_cell(prep, args.cache, width, mult, args)
        write_json_atomic(path, measured.stamp(cell))
        print(f"    holdout bpb {cell['holdout_bpb']:.4f}, train loss {cell['train_loss']:.4f}, "
              f"{cell.get('train_cpu_s', 0):.0f} CPU-s", flush=True)  # fmt: skip
    import json

    cells = [json.loads(p.read_text()) for p in sorted(cell_dir.glob("*.json"))]
    if not cells:
        raise SystemExit(f"bench/mup_demo.py: no cells in {cell_dir}; run some first")
    for metric in ("holdout_bpb", "train_loss"):
        print(f"\n{metric} after {args.steps} steps ({args.steps * 2048:,} tokens):\n")
        print(table(cells, metric))
        s = summarise(cells, metric)
        print(f"best ×: {s['best_mult']}; within one grid step of width {BASE_WIDTH}'s: "
              f"{s['within_one_step']}; optimum at the edge of a partial grid: {s['edge']}")  # fmt: skip
    print(measured.line())
    doc = {"steps": args.steps, "tokens_per_step": 2048, "base_width": BASE_WIDTH,
           "demo_lr": DEMO_LR, "cells": cells,
           "summary": {m: summarise(cells, m) for m in ("holdout_bpb", "train_loss")}}  # fmt: skip
    write_json_atomic(args.out_dir / f"mup_demo-{args.steps}.json", measured.stamp(doc))
    if args.points is not None:
        print(f"wrote {write_points(cells, args.log, args.points)} rows to {args.points}")
    print(f"wrote {args.out_dir / f'mup_demo-{args.steps}.json'} and "
          f"{plot(cells, args.plot, args.steps)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
