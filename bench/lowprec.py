"""Low-precision weight formats (fp8, MXFP8, MXFP4, NVFP4) beside fp32, int8 and int4 on a model.

For each variant: bits per byte of TinyStories valid (`kiln eval --bpb`'s code; the first
--max-bytes of it when given), the model's bytes (parameters and buffers, each storage once) and
the bits per weight of the quantized linear layers (codes + scales), and their weights' relative
error ||W_q - W|| / ||W|| (all quantized layers together). All variants score the same
text, so their differences are paired; timings are not reported (the float formats are emulated:
dequantize, then an fp32 matmul).

    .venv/bin/python bench/lowprec.py --model runs/demo
    .venv/bin/python bench/lowprec.py --model runs/demo --max-bytes 200000 --out /tmp/lowprec.json
    .venv/bin/python bench/lowprec.py --model runs/demo --tiny --noisy   # 20 KB of text: it works

bytes/param is the whole model's bytes over its parameter count (embeddings and norms stay fp32,
so it is above bits/weight / 8 of the quantized layers alone).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.eval.lm import bits_per_byte, read_documents
from kiln.eval.scoring import Scorer
from kiln.io import open_binary
from kiln.loading import load_model
from kiln.quant.lowprec import LowPrecLinear
from kiln.quant.quantize import QuantizedLinear, model_bytes, quantize_model

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"

# name -> (mode, int4 group, fp8 format, fp8 scaling); mode None: fp32
VARIANTS: dict[str, tuple[str | None, int, str, str]] = {
    "fp32": (None, 0, "", ""),
    "int8 (per row)": ("int8", 0, "", ""),
    "int4 g64": ("int4", 64, "", ""),
    "fp8 e4m3, per tensor": ("fp8", 0, "e4m3", "tensor"),
    "fp8 e4m3, 1x128": ("fp8", 0, "e4m3", "1x128"),
    "fp8 e4m3, 128x128": ("fp8", 0, "e4m3", "128x128"),
    "fp8 e5m2, 128x128": ("fp8", 0, "e5m2", "128x128"),
    "MXFP8 (e4m3, 32, E8M0)": ("mxfp8", 0, "", ""),
    "NVFP4 (e2m1, 16, e4m3 + fp32)": ("nvfp4", 0, "", ""),
    "MXFP4 (e2m1, 32, E8M0)": ("mxfp4", 0, "", ""),
}


def build(
    base: torch.nn.Module, spec: tuple[str | None, int, str, str]
) -> tuple[Any, float, float]:
    """A quantized copy of base (or base), its layers' bits per weight and weight error."""
    mode, group, fmt, scaling = spec
    if mode is None:
        return base, 32.0, 0.0
    model = copy.deepcopy(base)
    kw = {"fp8_format": fmt, "fp8_scaling": scaling} if mode == "fp8" else {}
    quantize_model(model, mode, group or 64, False, kernel="dequant", **kw)
    named = [
        (n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear | LowPrecLinear)
    ]
    stored = sum(b.untyped_storage().nbytes() for _, m in named for b in m.buffers())
    bits = 8 * stored / sum(m.in_features * m.out_features for _, m in named)
    # ||W_q - W|| / ||W|| over all quantized layers together
    num = sum(float((m.weight - base.get_submodule(n).weight).pow(2).sum()) for n, m in named)
    den = sum(float(base.get_submodule(n).weight.pow(2).sum()) for n, _ in named)
    return model, bits, (num / den) ** 0.5


def text_file(path: Path, max_bytes: int | None) -> tuple[Path, Any]:
    """path itself, or a temporary file of its first max_bytes (cut at a line end)."""
    if max_bytes is None:
        return path, None
    with open_binary(path) as f:
        data = f.read(max_bytes)
    data = data[: data.rfind(b"\n") + 1]
    tmp = tempfile.NamedTemporaryFile(suffix=".txt", delete=False)  # noqa: SIM115
    tmp.write(data)
    tmp.close()
    return Path(tmp.name), tmp


def main() -> int:
    """Score every variant; print the markdown table and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a trained kiln run or demo folder")
    p.add_argument("--bpb", type=Path, default=SHARED / "tinystories" / "valid.txt.gz")
    p.add_argument("--max-bytes", type=int, help="score only the first N bytes of --bpb")
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    p.add_argument("--tiny", action="store_true", help="score only 20,000 bytes (a quick check)")
    add_noisy_flag(p)
    args = p.parse_args()
    if args.tiny and args.max_bytes is None:
        args.max_bytes = 20_000
    measured = begin("bench/lowprec.py", args.noisy)
    torch.set_num_threads(1)
    loaded = load_model(args.model, dtype="fp32")
    base = loaded.model
    n_params = sum(p.numel() for p in base.parameters())
    text, tmp = text_file(args.bpb, args.max_bytes)
    n_bytes = sum(len(d.encode()) for d in read_documents(text))
    print(f"model: {loaded.source}; {model_bytes(base) / 1e6:.2f} MB; text {n_bytes:,} bytes")
    rows: dict[str, dict[str, Any]] = {}
    try:
        for name, spec in VARIANTS.items():
            model, bits, weight_err = build(base, spec)
            started = time.perf_counter()
            scored = bits_per_byte(Scorer(model, 16, False), loaded.tokenizer, text, loaded.eot_id)
            rows[name] = {
                "bpb": scored.bits_per_byte, "loss": scored.loss, "tokens": scored.n_tokens,
                "bytes": model_bytes(model), "bytes_per_param": model_bytes(model) / n_params,
                "bits_per_weight": bits, "weight_rel_err": weight_err,
                "score_s": time.perf_counter() - started,
            }  # fmt: skip
            print(name, json.dumps(rows[name]), flush=True)
    finally:
        if tmp is not None:
            os.unlink(tmp.name)
    print_table(rows)
    print(measured.line())
    if args.out is not None:
        record = measured.stamp({"model": loaded.source, "text_bytes": n_bytes, "rows": rows})
        tmp_out = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp_out.write_text(json.dumps(record, indent=2) + "\n")
        tmp_out.replace(args.out)
    return 0


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    """The RESULTS.md table: quality and bytes of each variant beside fp32."""
    ref = rows["fp32"]
    print(
        "\n| weights | bpb | Δ bpb vs fp32 | loss (nats/token) | weight rel. error | "
        "bits/weight (linear layers) | bytes/param | MB | × fp32 bytes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['bpb']:.4f} | {(r['bpb'] / ref['bpb'] - 1) * 100:+.2f}% | "
            f"{r['loss']:.4f} | {r['weight_rel_err']:.4f} | {r['bits_per_weight']:.2f} | {r['bytes_per_param']:.3f} | {r['bytes'] / 1e6:.2f} | "
            f"{r['bytes'] / ref['bytes']:.3f} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
