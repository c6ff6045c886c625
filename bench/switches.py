"""The architecture switches of issue #21 compared on TinyStories (CPU), one switch at a time.

Every variant is bench/arch.py's recipe (demo tokenizer, TinyStories shards, AdamW lr 2e-3,
warmup 10 then cosine, fp32) at a smaller size: Llama-style baseline (pre-norm RMSNorm, SwiGLU,
RoPE, 4 heads, no GQA), 4 layers x 128, 1024 tokens per step (16 x 64), the same batches and
--steps steps; one single-threaded run after another. Reported per variant: parameters, final
val bits per byte (first 64k val tokens; equal steps = equal tokens), training tokens/s and its
ratio to the baseline, and the val loss at equal time read off each run's curve. Runs follow
each other on a shared machine, so their own tokens/s carries the load's drift; the throughput
ratios are therefore measured again **side by side**: every variant's forward + backward on one
batch, round-robin in one process (median of --rounds), and equal time is the time the fastest
variant (by that ratio) needs for --steps steps: each variant's val loss is read off its curve
at the step it reaches in that time.

    .venv/bin/python bench/switches.py                  # 13 runs; ~20 min on a loaded 2-core CPU
    .venv/bin/python bench/switches.py --steps 60 --only baseline,ReLU
    .venv/bin/python bench/switches.py --table-only     # re-time side by side, reuse the runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arch import DEFAULT_CACHE, config, loss_at, prepare, train

from bench._load import add_noisy_flag, begin
from kiln.io import write_json_atomic
from kiln.model import ModelConfig, Transformer
from kiln.tokenizer import Tokenizer

BASE: dict[str, Any] = dict(n_layer=4, n_head=4, n_kv_head=4, n_embd=128, d_ff=None,
                            ff_multiple=32)  # fmt: skip
SEQ, MICRO = 64, 16
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline (pre RMSNorm, SwiGLU, RoPE)": {},
    "GELU (tanh), 4x": {"mlp": "gelu"},
    "ReLU, 4x": {"mlp": "relu"},
    "ReLU², 4x": {"mlp": "relu2"},
    "GeGLU": {"mlp": "geglu"},
    "learned positions": {"pos_emb": "learned"},
    "sinusoidal positions": {"pos_emb": "sinusoidal"},
    "NoPE": {"pos_emb": "none"},
    "partial RoPE 1/4": {"rotary_fraction": 0.25},
    "post-norm": {"norm_placement": "post"},
    "sandwich norm": {"norm_placement": "sandwich"},
    "norms without scale": {"norm_scale": False},
    "parallel block (fused)": {"parallel_block": True},
}


def run_config(data_dir: Path, switches: dict[str, Any], steps: int) -> Any:
    """bench/arch.py's recipe at this comparison's size, with these switches."""
    cfg = config(data_dir, {**BASE, **switches}, steps)
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, seq_len=SEQ),
        batch=dataclasses.replace(cfg.batch, global_tokens=SEQ * MICRO, micro_batch=MICRO),
    )


def side_by_side_tokens_per_s(names: list[str], vocab: int, rounds: int) -> dict[str, float]:
    """Training tokens/s of each variant, timed round-robin in this process (median of rounds)."""
    models = {}
    for name in names:
        cfg = ModelConfig.preset("tiny", **{**BASE, **VARIANTS[name], "vocab_size": vocab,
                                            "block_size": SEQ, "vocab_multiple": 64})  # fmt: skip
        models[name] = Transformer(cfg)
    x = torch.randint(0, vocab, (MICRO, SEQ + 1))
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds + 1):  # the first round warms up
        for name, model in models.items():
            start = time.perf_counter()
            model(x[:, :-1], x[:, 1:]).backward()
            times[name].append(time.perf_counter() - start)
    return {n: SEQ * MICRO / statistics.median(t[1:]) for n, t in times.items()}


def loss_at_step(curve: list[list[float]], step: float) -> float:
    """Val loss at `step`, interpolated along the curve (arch.loss_at, with steps as the clock)."""
    return loss_at([(c[0], c[0], c[2]) for c in curve], step)


def main() -> int:
    """Train each variant; print the table; write JSON under --out-dir."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/kiln-bench-switches"))
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps per variant")
    ap.add_argument("--only", help="comma-separated variant name prefixes")
    ap.add_argument("--rounds", type=int, default=7, help="side-by-side timing rounds")
    ap.add_argument("--table-only", action="store_true", help="reuse switches.json's runs")
    add_noisy_flag(ap)
    args = ap.parse_args()
    measured = begin("bench/switches.py", args.noisy)
    torch.set_num_threads(1)
    data_dir = prepare(args.cache)
    tokenizer = Tokenizer.load(args.cache / "tokenizer.json")
    names = [
        n for n in VARIANTS if not args.only or any(n.startswith(p) for p in args.only.split(","))
    ]
    if args.table_only:
        runs = json.loads((args.out_dir / "switches.json").read_text())["runs"]
        names = [r["name"] for r in runs]
    else:
        runs = []
        for i, name in enumerate(names):
            cfg = run_config(data_dir, VARIANTS[name], args.steps)
            runs.append(train(name, cfg, args.out_dir / f"run{i}", tokenizer))
    tps = side_by_side_tokens_per_s(names, tokenizer.n_vocab, args.rounds)
    base, fastest = runs[0], max(tps.values())
    print(f"\n| variant | params | tok/s (run, sequential) | tok/s side by side | vs "
          f"{base['name'].split(' (')[0]} | val bpb ({args.steps} steps, equal tokens) | "
          f"val loss at equal time (steps reached) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        r["tokens_per_s_side_by_side"] = tps[r["name"]]
        r["steps_at_equal_time"] = args.steps * tps[r["name"]] / fastest
        r["loss_at_equal_time"] = loss_at_step(r["curve"], r["steps_at_equal_time"])
        print(f"| {r['name']} | {r['params'] / 1e6:.2f}M | {r['tokens_per_s']:,.0f} | "
              f"{tps[r['name']]:,.0f} | {tps[r['name']] / tps[base['name']]:.2f}x | "
              f"{r['val_bpb']:.4f} | {r['loss_at_equal_time']:.4f} "
              f"({r['steps_at_equal_time']:.0f}) |")  # fmt: skip
    print(measured.line())
    doc = {"steps": args.steps, "tokens_per_step": SEQ * MICRO, "runs": runs}
    write_json_atomic(args.out_dir / "switches.json", measured.stamp(doc))
    print(f"wrote {args.out_dir / 'switches.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
