"""Weight-only int8 / int4 beside fp32 on a trained model: quality, bytes and decode speed.

For each variant: bits per byte on TinyStories valid (`kiln eval --bpb`'s code), HellaSwag
accuracy (the first --hellaswag-limit items), model bytes (parameters and buffers), and greedy
decode tokens/s at batch 1 (--new-tokens after a short prompt). Decode timings alternate
between the variants round by round, so load from other processes on a shared machine hits
them alike; the median round and its ratio to fp32 are reported.

    .venv/bin/python bench/quantize.py                        # the demo run in /work/main/runs
    .venv/bin/python bench/quantize.py --model runs/demo --hellaswag-limit 200 --rounds 3

One torch thread (as bench/model.py). The kernel path runs torch's weight-only kernels with
bf16 activations; the "bf16 autocast" row (no quantization) shows what bf16 activations alone
cost, and the "dequant" rows what the weight rounding alone costs (fp32 activations).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.errors import KilnError
from kiln.eval.lm import bits_per_byte
from kiln.eval.multiple_choice import evaluate_task
from kiln.eval.scoring import Scorer
from kiln.eval.tasks import load_task
from kiln.io import write_json_atomic
from kiln.loading import load_model
from kiln.model.generate import generate
from kiln.quant.quantize import model_bytes, quantize_model

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
DEMO_RUN = Path("/work/main/runs/demo-20261201-110757")

# name -> (mode, group size, include head, kernel, autocast bf16); mode None: no quantization
VARIANTS: dict[str, tuple[str | None, int, bool, str, bool]] = {
    "fp32": (None, 0, False, "auto", False),
    "bf16 autocast": (None, 0, False, "auto", True),
    "int8": ("int8", 0, False, "auto", False),
    "int8 dequant": ("int8", 0, False, "dequant", False),
    "int8 +head": ("int8", 0, True, "auto", False),
    "int4 g32": ("int4", 32, False, "auto", False),
    "int4 g64": ("int4", 64, False, "auto", False),
    "int4 g64 dequant": ("int4", 64, False, "dequant", False),
    "int4 g64 +head": ("int4", 64, True, "auto", False),
    "int4 g128": ("int4", 128, False, "auto", False),
}


def build(base: torch.nn.Module, spec: tuple[str | None, int, bool, str, bool]) -> tuple[Any, str]:
    """A quantized copy of base (or base itself) and the path it runs on."""
    mode, group, head, kernel, _ = spec
    if mode is None:
        return base, "fp32 weights"
    model = copy.deepcopy(base)
    report = quantize_model(model, mode, group or 64, head, kernel=kernel)
    return model, ", ".join(f"{path} ×{n}" for path, n in report.paths.items())


def autocast(enabled: bool) -> Any:
    """bf16 autocast on the CPU, or nothing."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def quality(model: Any, loaded: Any, bf16: bool, bpb_file: Path, limit: int) -> dict[str, float]:
    """Bits per byte of bpb_file and HellaSwag accuracy of one variant."""
    scorer = Scorer(model, 16, False, autocast_dtype=torch.bfloat16 if bf16 else None)
    started = time.perf_counter()
    bpb = bits_per_byte(scorer, loaded.tokenizer, bpb_file, loaded.eot_id).bits_per_byte
    task = load_task("hellaswag", SHARED / "eval", limit)
    hs = evaluate_task(task, scorer, loaded.tokenizer, loaded.eot_id)
    return {
        "bpb": float(bpb or 0.0), "hellaswag_acc": hs.metrics["acc"],
        "hellaswag_acc_norm": hs.metrics["acc_norm"], "quality_s": time.perf_counter() - started,
    }  # fmt: skip


def decode_rates(
    models: dict[str, tuple[Any, bool]], prompt: list[int], new_tokens: int, rounds: int
) -> dict[str, float]:
    """Median greedy decode tokens/s per variant over rounds, the variants interleaved."""
    runs: dict[str, list[float]] = {name: [] for name in models}

    def timed(model: Any, bf16: bool) -> Callable[[], float]:
        def once() -> float:
            with autocast(bf16):
                start = time.perf_counter()
                out = generate(model, [prompt], new_tokens, temperature=0, stop_tokens=[])
                return len(out[0]) / (time.perf_counter() - start)

        return once

    fns = {name: timed(model, bf16) for name, (model, bf16) in models.items()}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            runs[name].append(fn())
    return {name: statistics.median(v) for name, v in runs.items()}


def main() -> int:
    """Measure every variant; print the markdown table and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=DEMO_RUN, help="a trained kiln run or demo folder")
    p.add_argument("--bpb", type=Path, default=SHARED / "tinystories" / "valid.txt.gz")
    p.add_argument("--hellaswag-limit", type=int, default=1000)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--skip-quality", action="store_true", help="bytes and speed only")
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    add_noisy_flag(p)
    args = p.parse_args()
    measured = begin("bench/quantize.py", args.noisy)
    torch.set_num_threads(1)
    loaded = load_model(args.model, dtype="fp32")
    base = loaded.model
    print(f"model: {loaded.source}; {model_bytes(base) / 1e6:.2f} MB", flush=True)
    prompt = loaded.tokenizer.encode_ordinary("Once upon a time, there was a little")
    rows: dict[str, dict[str, Any]] = {}
    models: dict[str, tuple[Any, bool]] = {}
    for name, spec in VARIANTS.items():
        try:
            model, path = build(base, spec)
        except KilnError as exc:
            rows[name] = {"error": str(exc)}
            print(f"{name}: not applicable: {exc}", flush=True)
            continue
        rows[name] = {"path": path, "bytes": model_bytes(model)}
        models[name] = (model, spec[4])
        if not args.skip_quality:
            rows[name].update(quality(model, loaded, spec[4], args.bpb, args.hellaswag_limit))
        print(name, json.dumps(rows[name]), flush=True)
    for name, rate in decode_rates(models, prompt, args.new_tokens, args.rounds).items():
        rows[name]["decode_tok_s"] = rate
    print_table(rows, args)
    print(measured.line())
    if args.out is not None:
        write_json_atomic(args.out, measured.stamp({"model": loaded.source, "rows": rows}))
    return 0


def print_table(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """The RESULTS.md table: quality and cost of each variant beside fp32."""
    ref = rows["fp32"]
    print(f"\nHellaSwag: first {args.hellaswag_limit} items; decode: batch 1, greedy, "
          f"{args.new_tokens} new tokens, median of {args.rounds} interleaved rounds, 1 thread\n")  # fmt: skip
    print("| variant | bpb | Δ bpb vs fp32 | HellaSwag acc_norm | MB | × fp32 bytes | "
          "decode tok/s | × fp32 speed | path |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        if "error" in row:
            print(f"| {name} | — | — | — | — | — | — | — | not applicable: {row['error']} |")
            continue
        bpb = row.get("bpb")
        cells = [
            f"{bpb:.4f}" if bpb else "—",
            f"{(bpb / ref['bpb'] - 1) * 100:+.2f}%" if bpb else "—",
            f"{row['hellaswag_acc_norm']:.4f}" if "hellaswag_acc_norm" in row else "—",
            f"{row['bytes'] / 1e6:.2f}",
            f"{row['bytes'] / ref['bytes']:.3f}",
            f"{row['decode_tok_s']:.1f}",
            f"{row['decode_tok_s'] / ref['decode_tok_s']:.2f}",
            row["path"],
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
