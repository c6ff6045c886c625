"""The golden loss curve: the `tiny` preset trained 20 steps on a shipped token sample, fp32, CPU.

Every step's loss is compared with `golden/loss_curve.json`, so a numerical change anywhere in the
model, optimizer, schedule or loader shows up as the first step that differs.

The run happens in a child process whose CPU kernels are pinned to the AVX2 code paths
(ATen's `ATEN_CPU_CAPABILITY`, MKL's `MKL_CBWR`, oneDNN's `ONEDNN_MAX_CPU_ISA`) with one
thread, so the curve does not depend on whether this machine has AVX-512.

Regenerate (after a change that is *meant* to alter the numbers; say so in the commit):

    python -m tests.train.golden_curve --write            # the curve, from the shipped sample
    python -m tests.train.golden_curve --rebuild-sample   # the token sample too, then --write

The sample (`golden/dataset/`, a `kiln data tokenize` dataset) is the first ~40 KB of whole
stories of kiln/assets/tinystories_train.txt.gz under `golden/tokenizer.json`, a 512-token BPE
trained on them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "golden"
DATASET = GOLDEN / "dataset"
TOKENIZER = GOLDEN / "tokenizer.json"
CURVE = GOLDEN / "loss_curve.json"
ROOT = Path(__file__).resolve().parents[2]

STEPS = 20
SAMPLE_CHARS = 40_000
# The run: configs/tiny.toml's settings, spelled out so that editing that file does not move the
# golden numbers. fp32 is explicit (the default dtype may pick bf16 on some CPUs).
OVERRIDES = [
    f"train.max_steps={STEPS}",
    "train.dtype=fp32",
    "train.device=cpu",
    "train.seed=0",
    "train.grad_clip=1.0",
    "data.seq_len=32",
    "data.seed=0",
    "model.preset=tiny",
    "model.block_size=64",
    "optim.name=adamw",
    "optim.lr=3e-3",
    "optim.betas=[0.9, 0.95]",
    "optim.weight_decay=0.1",
    "schedule.name=warmup_cosine",
    "schedule.warmup_steps=2",
    "schedule.min_lr_ratio=0.1",
    "batch.global_tokens=256",
    "batch.micro_batch=4",
    "eval.batches=0",
    "eval.sample_tokens=0",
    f"checkpoint.every={STEPS}",
    "checkpoint.keep_last=1",
    "logging.progress=false",
]
# Kernels pinned to paths every x86-64 machine kiln targets has; one thread keeps sums in order.
PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2,STRICT",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def train_losses(run_dir: Path) -> list[float]:
    """The per-step training losses of the golden run (in this process, as it is set up)."""
    import torch

    from kiln.train.config import load_train_config
    from kiln.train.trainer import Trainer

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg = load_train_config(
        None, [f"data.dataset={DATASET}", f"logging.run_dir={run_dir}", *OVERRIDES]
    )
    return Trainer(cfg, run_dir).run().losses


def pinned_losses() -> list[float]:
    """The golden run's losses, computed in a child process with the pinned kernel settings."""
    env = {**os.environ, **PINNED_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "tests.train.golden_curve", "--print"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"golden run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_difference(
    expected: list[float], actual: list[float], rel: float
) -> tuple[int, float, float] | None:
    """(step, expected, actual) of the first step whose loss is off by more than `rel`, if any."""
    for step, (want, got) in enumerate(zip(expected, actual, strict=False), start=1):
        if abs(got - want) > rel * abs(want):
            return step, want, got
    if len(expected) != len(actual):
        n = min(len(expected), len(actual)) + 1
        return n, float("nan"), float("nan")
    return None


def rebuild_sample() -> None:
    """Rebuild golden/tokenizer.json and golden/dataset/ from the shipped TinyStories asset."""
    import gzip
    import shutil

    from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
    from kiln.tokenizer import train_bpe
    from kiln.tokenizer.special import EOT

    with gzip.open(ROOT / "kiln" / "assets" / "tinystories_train.txt.gz", "rt") as handle:
        text = handle.read(SAMPLE_CHARS)
    text = text[: text.rfind(EOT) + len(EOT)]  # whole stories only
    # Relative paths from the repository root, so the committed manifest names no machine's dirs.
    os.chdir(ROOT)
    corpus = (GOLDEN / "stories.txt").relative_to(ROOT)  # provenance only; removed afterwards
    corpus.write_text(text, encoding="utf-8")
    try:
        tok = train_bpe(corpus, 512, special_tokens=[EOT], workers=1)
        TOKENIZER.unlink(missing_ok=True)
        tok.save(TOKENIZER)
        shutil.rmtree(DATASET, ignore_errors=True)
        tokenize_to_shards(
            TokenizeConfig(
                tokenizer=str(TOKENIZER.relative_to(ROOT)), inputs=(str(corpus),),
                out=str(DATASET.relative_to(ROOT)), val_docs=2, workers=1, progress=False,
            )
        )  # fmt: skip
    finally:
        corpus.unlink()


def main() -> int:
    """`--print` the pinned run's losses as JSON, `--write` them as the golden curve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="train here and print the losses")
    parser.add_argument("--write", action="store_true", help="write golden/loss_curve.json")
    parser.add_argument("--rebuild-sample", action="store_true", help="rebuild golden/dataset")
    args = parser.parse_args()
    if args.print:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(train_losses(Path(tmp) / "run")))
        return 0
    if args.rebuild_sample:
        rebuild_sample()
        print(f"wrote {TOKENIZER} and {DATASET}; now run with --write")
    if args.write:
        losses = pinned_losses()
        import torch

        CURVE.write_text(
            json.dumps(
                {"steps": STEPS, "torch": torch.__version__, "overrides": OVERRIDES,
                 "pinned_env": PINNED_ENV, "losses": losses},
                indent=1,
            ) + "\n"
        )  # fmt: skip
        print(f"wrote {CURVE}: {len(losses)} losses, last {losses[-1]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
