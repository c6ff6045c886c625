"""One training process for test_distributed.py, started by torchrun (or as a single process).

    torchrun --nproc-per-node 2 tests/train/distributed_worker.py OUT.json [--resume]
        [--stop-at N] [--set key=value ...]

Trains configs/tiny.toml with the overrides, stopping after step N if asked (as a signal
would), and writes {"losses", "step", "val_loss", "world_size"} to OUT.json from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from kiln.train.config import load_train_config
from kiln.train.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def main(argv: list[str] | None = None) -> int:
    """Train once as the arguments say; rank 0 writes what it saw."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stop-at", type=int, default=0)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    # Two processes on two cores, and a fixed reduction order; `make test-kernels` varies it.
    torch.set_num_threads(int(os.environ.get("KILN_TEST_THREADS", "1")))
    cfg = load_train_config(CONFIGS / "tiny.toml", args.set)

    def stop(trainer: Trainer, step: int, loss: float) -> None:
        if step == args.stop_at:
            trainer.request_stop()  # on every rank, as torchrun forwarding a SIGTERM would

    trainer = Trainer(cfg, cfg.logging.run_dir, resume=args.resume, on_step=stop)
    result = trainer.run()
    if trainer.dist.is_main:
        doc = {
            "losses": result.losses,
            "step": result.step,
            "val_loss": result.val_loss,
            "world_size": trainer.dist.world_size,
            "notes": trainer.notes,
        }
        Path(args.out).write_text(json.dumps(doc), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
