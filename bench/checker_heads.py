"""The checker's heads at equal steps: `python bench/checker_heads.py {spatial,flat} STEPS`.

Trains kiln's Checker with checker_loss and targets as `kiln image train-checker` does (batch
64, AdamW lr 2e-3, warmup 50 + cosine, left-right flips), on a checker dataset (default: the
demo's, seed 1, 4000 + 2000 held-out-composition renders), and prints the score on another
dataset's held-out renders (seed 0, 500) four times along the run, with CPU seconds per step.
Make the data first:

    kiln image data --out /tmp/ck --train 4000 --val 0 --heldout 2000 --seed 1
    kiln image data --out /tmp/ev --train 10 --val 0 --heldout 500 --seed 0

Its loop mirrors `kiln image train-checker` (kiln/train/checker.py) without a run folder, so both
heads train from one seed with no checkpoints in the way.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.image.checker import Checker, CheckerConfig, checker_loss, predict, score, targets
from kiln.image.dataset import ImageDataset
from kiln.image.vqvae import to_unit
from kiln.train.checker import _flip_records


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
    data, held = ImageDataset.open(args.train_data), ImageDataset.open(args.eval_data)
    records = data.records("train") + data.records("heldout")
    images = np.concatenate([data.images("train"), data.images("heldout")])
    truth = targets(records)
    eval_x = to_unit(torch.from_numpy(np.array(held.images("heldout"))))
    eval_records = held.records("heldout")
    torch.manual_seed(0)
    cfg = CheckerConfig(head=args.head)
    model = Checker(cfg)
    print(args.head, "params", sum(p.numel() for p in model.parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(0)
    start = time.process_time()
    for step in range(1, args.steps + 1):
        cosine = 0.5 * (1 + math.cos(math.pi * step / args.steps)) * 0.9 + 0.1
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, step / 50) * cosine
        idx = rng.integers(0, len(images), args.batch)
        x = to_unit(torch.from_numpy(np.array(images[idx])))
        batch = {k: v[torch.from_numpy(idx)] for k, v in truth.items()}
        flip = torch.rand(args.batch) < 0.5
        x[flip] = x[flip].flip(-1)
        batch = _flip_records(batch, flip)
        loss = checker_loss(model.train()(x), batch, cfg)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % max(1, args.steps // 4) == 0 or step == args.steps:
            scores = score(predict(model, eval_x), eval_records)
            cost = (time.process_time() - start) / step
            print(json.dumps({"step": step, "loss": round(loss.item(), 3),
                              "cpu_s_per_step": round(cost, 3),
                              **{k: round(v, 3) for k, v in scores.items()}}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
