"""Architecture benchmark on TinyStories (CPU): dense vs MoE at equal active parameters, GQA vs
MLA, and attention sinks for streaming past the trained length.

1. Data: the `kiln demo` tokenizer (4096-token BPE) and token shards of the embedded TinyStories,
   shared with bench/train.py (prepared once under --cache).
2. Training: each variant trains with kiln's Trainer on the same batches for the same number of
   steps (equal tokens: --steps × 4096), same optimizer, schedule and fp32 precision, all
   variants at once, each in its own single-threaded process, so they share the (loaded)
   machine alike. Reported: final val bits per byte on the first 64k val tokens (nats / ln 2 /
   UTF-8 bytes of those tokens), training tokens/s, and the ratio of each variant's tokens/s to
   the dense baseline's, measured side by side. Equal time: each run's
   val loss is also recorded at every tenth of its steps against its training seconds, and the
   val loss at the shortest run's training time is read off each curve (linear interpolation).
   - dense: Llama-style (RoPE, RMSNorm, SwiGLU d_ff 512, GQA 4 heads / 2 kv heads), 4 x 192.
   - moe: the same with 8 experts of width 256, top-2 (softmax, renormalised, aux loss 0.01):
     equal active MLP parameters (2 x 256 = 512 wide), 4x the MLP parameters in total.
   - moe-ds: 16 fine-grained experts of width 64, top-6, one shared expert of 128, sigmoid
     routing with aux-loss-free bias balancing (DeepSeek-V3 style): again 512 wide active.
   - mla: dense MLP, MLA attention (latent 64, RoPE key 16): cache 80 numbers per token and
     layer vs GQA's 2 x 2 x 48 = 192.
3. Streaming (attention sinks): the dense model (block 128) reads a 2,048-token text token by
   token through a bounded cache: 4 sink tokens + 60 recent, against window eviction without
   sinks (64 recent). Reported: mean NLL per quarter of the text.
4. Length extrapolation: the dense model's bits per byte on Gutenberg text (en_100m.txt.gz) at
   contexts 64..1024 (trained at 128), as trained (plain RoPE) and with linear, dynamic-NTK and
   YaRN scaling by 4 (`kiln eval --context` machinery); a PNG under --out-dir.

    .venv/bin/python bench/arch.py                      # ~15-25 minutes on a loaded 2-core CPU
    .venv/bin/python bench/arch.py --steps 60 --skip-streaming
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from bench._load import add_noisy_flag, begin
from kiln.io import write_json_atomic
from kiln.model import ModelConfig
from kiln.train.config import TrainConfig, load_train_config
from kiln.train.trainer import Trainer

DEFAULT_CACHE = Path("/tmp/kiln-bench-train")  # bench/train.py's prepared data
VOCAB = 4096
SEQ, MICRO, GLOBAL = 128, 16, 4096  # tokens per step: 2 micro-steps of 16 x 128
DENSE: dict[str, Any] = dict(
    preset="tiny", block_size=SEQ, n_layer=4, n_head=4, n_kv_head=2, n_embd=192, d_ff=512,
    vocab_multiple=64,
)  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    "dense (GQA)": {},
    "moe 8x256 top-2": {"moe": {"n_experts": 8, "top_k": 2, "d_expert": 256, "aux_loss": 0.01}},
    "moe-ds 16x64 top-6 +shared": {
        "moe": {
            "n_experts": 16,
            "top_k": 6,
            "d_expert": 64,
            "n_shared": 2,
            "score": "sigmoid",
            "expert_bias": True,
            "bias_update_rate": 0.001,
        },
    },
    "mla (latent 64, rope 16)": {"mla": {"kv_rank": 64, "rope_dim": 16}},
}
CURVE_POINTS = 10


def prepare(cache: Path) -> Path:
    """The demo tokenizer and token shards under `cache` (built once); returns the dataset dir."""
    from kiln import demo

    if not (cache / "prepared.ok").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        demo._train_tokenizer(cache, VOCAB)
        demo._make_shards(cache)
        (cache / "prepared.ok").write_text("ok\n")
    return cache / "data"


def config(data_dir: Path, model: dict[str, Any], steps: int) -> TrainConfig:
    """demo.toml's recipe at this benchmark's size: fixed steps, fp32, no checkpoints."""
    from kiln.demo import asset

    overrides = [
        f"data.dataset={data_dir}", f"data.seq_len={SEQ}", f"batch.global_tokens={GLOBAL}",
        f"batch.micro_batch={MICRO}", "train.time_budget=none", f"train.max_steps={steps}",
        "train.dtype=fp32", "schedule.warmup_steps=10", "eval.every=0", "eval.sample_tokens=0",
        "checkpoint.every=0", "logging.progress=false", "logging.every=10",
    ]  # fmt: skip
    cfg = load_train_config(asset("demo.toml"), overrides)
    return dataclasses.replace(cfg, model={**DENSE, **model})


def val_bpb(model: torch.nn.Module, data_dir: Path, tokenizer: Any, n_tokens: int = 65536) -> float:
    """Bits per byte of the first n_tokens of the val split (one stream, 128-token windows)."""
    from kiln.data import Dataset
    from kiln.eval.lm import val_loss
    from kiln.eval.scoring import Scorer

    result = val_loss(Scorer(model, 32, progress=False), data_dir, "val", n_tokens)
    tokens = Dataset.open(data_dir).split("val").read(0, result.n_tokens + 1)
    n_bytes = len(tokenizer.decode_bytes([int(t) for t in tokens[1:]]))
    return result.nats / (math.log(2) * n_bytes)


def train(name: str, cfg: TrainConfig, run_dir: Path, tokenizer: Any) -> dict[str, Any]:
    """Train one variant; its curve (step, seconds, val loss), bpb, tokens/s, parameters."""
    shutil.rmtree(run_dir, ignore_errors=True)
    curve: list[tuple[int, float, float]] = []
    steps = cfg.train.max_steps or 0

    def on_step(tr: Trainer, step: int, loss: float) -> None:
        if step % max(1, steps // CURVE_POINTS) == 0:
            curve.append((step, tr.train_seconds, tr.evaluate() or float("nan")))

    torch.manual_seed(0)
    trainer = Trainer(cfg, run_dir, on_step=on_step)
    mc: ModelConfig = trainer.model_cfg
    result = trainer.run()
    tps = result.tokens / trainer.train_seconds
    bpb = val_bpb(trainer.model.eval(), Path(cfg.data.dataset), tokenizer)
    out = {
        "name": name, "params": mc.num_params(), "active_params": mc.num_active_params(),
        "kv_cache_bytes_per_token_bf16": mc.kv_cache_bytes_per_token(),
        "steps": result.step, "tokens": result.tokens, "train_s": trainer.train_seconds,
        "tokens_per_s": tps, "val_bpb": bpb, "curve": curve,
        "flops_per_token": mc.flops_per_token(SEQ),
    }  # fmt: skip
    print(f"{name}: {mc.num_params() / 1e6:.2f}M params ({mc.num_active_params() / 1e6:.2f}M "
          f"active), {result.step} steps in {trainer.train_seconds:.0f}s, {tps:,.0f} tok/s, "
          f"val bpb {bpb:.4f}", flush=True)  # fmt: skip
    torch.save(trainer.model.state_dict(), run_dir / "model.pt")
    (run_dir / "result.json").write_text(json.dumps(out) + "\n")
    return out


def loss_at(curve: list[tuple[int, float, float]], seconds: float) -> float:
    """Val loss at `seconds` of training, linearly interpolated along the curve."""
    points = [(s, v) for _, s, v in curve]
    for (s0, v0), (s1, v1) in itertools.pairwise(points):
        if s0 <= seconds <= s1:
            return v0 + (v1 - v0) * (seconds - s0) / max(s1 - s0, 1e-9)
    return points[-1][1]


def streaming(model: torch.nn.Module, tokenizer: Any, text_path: Path, n: int) -> dict[str, Any]:
    """Mean NLL by quarter of an n-token text: sinks + window against window eviction alone."""
    from kiln.eval.context import read_text_prefix
    from kiln.model.streaming import streaming_nll

    ids = tokenizer.encode_ordinary(read_text_prefix(text_path, 8 * n))[:n]
    out: dict[str, Any] = {"tokens": len(ids)}
    for label, n_sink, window in (("4 sinks + 60 window", 4, 60), ("window 64, no sinks", 0, 64)):
        nll = streaming_nll(model, ids, n_sink, window)
        quarters = [float(q.mean()) for q in nll.chunk(4)]
        out[label] = quarters
        print(f"  streaming {label:<22} NLL by quarter: " + "  ".join(f"{q:.3f}" for q in quarters))
    return out


def context_section(model: torch.nn.Module, tokenizer: Any, out_dir: Path) -> dict[str, Any]:
    """bpb by context length and position for each RoPE scaling type; the plot."""
    from kiln.eval.context import context_curve, plot_context_curves

    text = Path(__file__).resolve().parents[2] / "shared" / "data" / "bench" / "en_100m.txt.gz"
    curves = []
    for scaling in (None, "linear:4", "dynamic:4", "yarn:4"):
        curve = context_curve(model, tokenizer, text, [64, 128, 256, 512, 1024], 8192, 8, scaling)
        curves.append(curve)
        print(
            f"  {scaling or 'plain RoPE':<10} "
            + "  ".join(f"L={k}: {v:.4f}" for k, v in curve.bpb.items())
        )
    png = plot_context_curves(curves, out_dir / "arch_context.png", SEQ)
    print(f"wrote {png}")
    return {"curves": [c.to_dict() for c in curves], "plot": str(png)}


def load_dense(data_dir: Path, out_dir: Path) -> torch.nn.Module:
    """The dense variant as trained by the last run (run0/model.pt)."""
    model = Trainer(config(data_dir, VARIANTS["dense (GQA)"], 1), out_dir / "reload").model
    model.load_state_dict(torch.load(out_dir / "run0" / "model.pt"))
    return model.eval()


def main() -> int:
    """Run the benchmark; print the table; write JSON beside --out-dir."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/kiln-bench-arch"))
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per variant")
    ap.add_argument("--only", help="comma-separated variant names (prefix match)")
    ap.add_argument("--skip-streaming", action="store_true")
    ap.add_argument("--only-context", action="store_true", help="part 4 only, on run0's model")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)  # index of the variant to train
    ap.add_argument("--text", type=Path, default=Path(__file__).resolve().parents[2] / "shared"
                    / "data" / "tinystories" / "valid.txt.gz")  # fmt: skip
    add_noisy_flag(ap)
    args = ap.parse_args()
    # The children run under the parent's measurement; only the parent checks the load.
    measured = begin("bench/arch.py", args.noisy) if args.child is None else None
    torch.set_num_threads(1)  # one core per run: the other is another helper's
    from kiln.tokenizer import Tokenizer

    data_dir = prepare(args.cache)
    tokenizer = Tokenizer.load(args.cache / "tokenizer.json")
    names = [
        n for n in VARIANTS if not args.only or any(n.startswith(p) for p in args.only.split(","))
    ]
    if args.only_context:
        doc = json.loads((args.out_dir / "arch.json").read_text())
        doc["context"] = context_section(
            load_dense(data_dir, args.out_dir), tokenizer, args.out_dir
        )
        assert measured is not None
        doc["context_measured"] = measured.record()
        write_json_atomic(args.out_dir / "arch.json", doc)
        print(measured.line())
        return 0
    if measured is None:
        name, run_dir = names[args.child], args.out_dir / f"run{args.child}"
        train(name, config(data_dir, VARIANTS[name], args.steps), run_dir, tokenizer)
        return 0
    children = [
        subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--child", str(i)])
        for i in range(len(names))
    ]  # side by side: every variant sees the same machine load
    if any(child.wait() != 0 for child in children):
        raise SystemExit("a variant failed")
    runs = [
        json.loads((args.out_dir / f"run{i}" / "result.json").read_text())
        for i in range(len(names))
    ]
    base = runs[0]
    t_common = min(r["train_s"] for r in runs)
    print(
        f"\n| variant | params | active | KV bytes/token (bf16) | tok/s | tok/s vs {base['name']} "
        f"| val bpb ({args.steps} steps, equal tokens) | val loss at {t_common:.0f}s (equal time) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        r["loss_at_common_time"] = loss_at(r["curve"], t_common)
        print(f"| {r['name']} | {r['params'] / 1e6:.2f}M | {r['active_params'] / 1e6:.2f}M | "
              f"{r['kv_cache_bytes_per_token_bf16']:,} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['val_bpb']:.4f} | "
              f"{r['loss_at_common_time']:.4f} |")  # fmt: skip
    doc: dict[str, Any] = {"steps": args.steps, "tokens_per_step": GLOBAL, "seq_len": SEQ,
                           "runs": runs}  # fmt: skip
    if not args.skip_streaming:
        print(f"\nstreaming a long text through the dense model (block {SEQ}):")
        doc["streaming"] = streaming(load_dense(data_dir, args.out_dir), tokenizer, args.text, 2048)
    doc["context"] = context_section(load_dense(data_dir, args.out_dir), tokenizer, args.out_dir)
    write_json_atomic(args.out_dir / "arch.json", measured.stamp(doc))
    print(measured.line())
    print(f"wrote {args.out_dir / 'arch.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
