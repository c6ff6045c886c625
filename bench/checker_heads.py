"""The checker's heads at equal steps: `python bench/checker_heads.py {spatial,flat} STEPS`.

Trains kiln's Checker with `kiln image train-checker`'s own run (kiln/train/checker.py's
CheckerRun: batch 64, AdamW lr 2e-3, warmup 50 + cosine, left-right flips) in a scratch run
folder, on a checker dataset (default: the demo's, seed 1, 4000 + 2000 held-out-composition
renders, both learnt from), and prints the score on another dataset's held-out renders (seed 0,
500) four times along the run, with CPU seconds per step. Make the data first:

    kiln image data --out /tmp/ck --train 4000 --val 0 --heldout 2000 --seed 1
    kiln image data --out /tmp/ev --train 10 --val 0 --heldout 500 --seed 0
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.image.checker import CheckerConfig, predict, score
from kiln.image.dataset import ImageDataset
from kiln.image.vqvae import to_unit
from kiln.train.checker import CheckerRun, CheckerTrainConfig, CheckerTrainSection
from kiln.train.config import OptimConfig, ScheduleConfig
from kiln.train.image_loop import CheckpointSection, ImageDataSection


def checker_config(
    head: str, steps: int, data: str, lr: float, batch: int, run_dir: str
) -> CheckerTrainConfig:
    """train-checker's config for one head: train + held-out splits learnt, no checkpoints."""
    return CheckerTrainConfig(
        data=ImageDataSection(dataset=data, train_split="train", eval_splits=()),
        model=CheckerConfig(head=head),
        optim=OptimConfig(lr=lr, weight_decay=0.0),
        schedule=ScheduleConfig(warmup_steps=50),
        train=CheckerTrainSection(max_steps=steps, batch_size=batch, extra_splits=("heldout",)),
        checkpoint=CheckpointSection(every=steps + 1, keep_last=1),
        run_dir=run_dir,
    )


def main(argv: list[str] | None = None) -> None:
    """Train one head for STEPS steps and print its held-out scores along the way."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("head", choices=["spatial", "flat"])
    parser.add_argument("steps", type=int)
    parser.add_argument("--train-data", default="/tmp/ck")
    parser.add_argument("--eval-data", default="/tmp/ev")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch", type=int, default=64)
    add_noisy_flag(parser)
    args = parser.parse_args(argv)
    # The scores are at equal steps (load cannot change them); the CPU seconds per step can.
    print(begin("bench/checker_heads.py", args.noisy).line())
    torch.set_num_threads(1)
    held = ImageDataset.open(args.eval_data)
    eval_x = to_unit(torch.from_numpy(np.array(held.images("heldout"))))
    eval_records = held.records("heldout")
    with tempfile.TemporaryDirectory(prefix="checker-heads-") as scratch:
        cfg = checker_config(args.head, args.steps, args.train_data, args.lr, args.batch, scratch)
        run = CheckerRun(cfg)
        print(args.head, "params", sum(p.numel() for p in run.model.parameters()))
        start = time.process_time()
        while run.step < args.steps:
            loss = run.train_step()["loss"]
            if run.step % max(1, args.steps // 4) == 0 or run.step == args.steps:
                with torch.no_grad():
                    scores = score(predict(run.model, eval_x), eval_records)
                cost = (time.process_time() - start) / run.step
                print(json.dumps({"step": run.step, "loss": round(loss, 3),
                                  "cpu_s_per_step": round(cost, 3),
                                  **{k: round(v, 3) for k, v in scores.items()}}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
