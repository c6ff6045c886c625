"""MFU on one GPU: GPT-2-124M-shaped training, bf16 autocast + torch.compile, kiln's own counter.

    .venv/bin/python bench/mfu.py                      # on a CUDA machine (H100/H200/A100 ...)
    .venv/bin/python bench/mfu.py --attention triton   # kiln's Triton flash kernel, not SDPA
    .venv/bin/python bench/mfu.py --smoke              # a tiny CPU run: the script works

Trains `--steps` steps of gpt2-124m (vocabulary padded to 50304, 1024-token windows) with
kiln's Trainer on the embedded TinyStories shards (bench/train.py's cached preparation), and
reports the median tokens/s and MFU of the logged windows after the first (compile and warm-up).
tokens/s and MFU are the trainer's own (metrics.jsonl: kiln.train.metrics.mfu with
ModelConfig.flops_per_token and the device's bf16 peak from kiln's table). Target: >= 50% MFU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._load import add_noisy_flag, begin  # noqa: E402


def settings(args: argparse.Namespace) -> list[str]:
    """The --set overrides of the measured run (or of the smoke run)."""
    if args.smoke:
        return ["model.preset=tiny", "data.seq_len=64", "model.block_size=64",
                "batch.micro_batch=2", "batch.global_tokens=256", "train.max_steps=4",
                "train.device=cpu", "train.dtype=fp32", "logging.every=2"]  # fmt: skip
    micro = "auto" if args.micro_batch == "auto" else str(int(args.micro_batch))
    return [
        "model.preset=gpt2-124m", "model.vocab_size=50304", "model.block_size=1024",
        f"model.attention_backend={args.attention}", "data.seq_len=1024",
        f"batch.micro_batch={micro}", f"batch.global_tokens={args.global_tokens}",
        f"train.max_steps={args.steps}", "train.device=cuda", "train.dtype=bf16",
        "train.compile=true", "logging.every=5", "optim.fused=true",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Train, then print tokens/s and MFU from the run's metrics."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--micro-batch", default="16", help="a number, or auto (a probe)")
    parser.add_argument("--global-tokens", type=int, default=16 * 1024 * 4)
    parser.add_argument("--attention", choices=("sdpa", "triton"), default="sdpa")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/kiln-bench-train"))
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU run (no GPU needed)")
    add_noisy_flag(parser)
    args = parser.parse_args(argv)
    # A GPU run is fed and launched by the CPU: a busy CPU starves it too.
    measured = begin("bench/mfu.py", args.noisy)

    from bench.train import prepare
    from kiln.train.config import load_train_config
    from kiln.train.trainer import Trainer

    data = prepare(args.cache)
    run = Path(tempfile.mkdtemp(prefix="kiln-mfu-"))
    common = [f"data.dataset={data}", f"logging.run_dir={run}", "logging.progress=false",
              "eval.batches=0", "eval.sample_tokens=0", "checkpoint.every=0"]  # fmt: skip
    cfg = load_train_config(ROOT / "configs" / "tiny.toml", [*common, *settings(args)])
    trainer = Trainer(cfg, run)
    trainer.run()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = records[1:] or records  # the first window holds compile and warm-up
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    mfu = f"{100 * statistics.median(mfus):.1f}%" if mfus else "n/a (no known peak for this device)"
    print(
        f"bench/mfu.py: {trainer.model_cfg.num_params():,} parameters on {trainer.device} "
        f"({trainer.precision.name}, compile={trainer.cfg.train.compile}, attention "
        f"{args.attention}, micro-batch {trainer.cfg.batch.micro_batch}): {tps:,.0f} tokens/s, "
        f"MFU {mfu} (median of {len(steady)} logged windows after the first)"
    )
    print(measured.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
