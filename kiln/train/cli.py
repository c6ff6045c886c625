"""`kiln train CONFIG.toml [--set k=v ...] [--resume] [--plot-schedule]`."""

from __future__ import annotations

import argparse
import shlex
import signal
import time
from typing import Any

EXAMPLES = """examples:
  kiln train configs/tiny.toml --set data.dataset=data/stories
  kiln train configs/demo.toml --set optim.lr=1e-3 --set train.max_steps=2000
  kiln train configs/demo.toml --resume            # continue from runs/demo/checkpoints/latest
  kiln train configs/demo.toml --plot-schedule     # write runs/demo/report/lr_schedule.png"""


def register(sub: Any) -> None:
    """Add `kiln train` to the top-level `kiln` parser."""
    from kiln.cli import add_subcommand

    p = add_subcommand(sub, "train", "train a language model from a TOML config", EXAMPLES)
    p.description = (
        "Train a Transformer LM on a token-shard dataset, as a TOML config describes.\n"
        "The run directory gets config.toml (fully resolved), metrics.jsonl and checkpoints/;\n"
        "Ctrl-C or SIGTERM saves a checkpoint before exiting (continue with --resume)."
    )
    p.add_argument("config", metavar="CONFIG.toml", help="run config (see configs/)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set optim.lr=3e-4 (repeatable)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the run's latest checkpoint"
    )
    p.add_argument(
        "--plot-schedule",
        action="store_true",
        help="write the learning-rate schedule as a PNG in the run's report/ and exit",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace) -> int:
    """Load the config, then plot its schedule or train (resuming if asked)."""
    from kiln.train.config import default_run_dir, load_train_config

    overrides = list(args.set)
    if args.no_progress:
        overrides.append("logging.progress=false")
    cfg = load_train_config(args.config, overrides)
    run_dir = default_run_dir(cfg, args.config)
    if args.plot_schedule:
        from kiln.train.schedule import plot_schedule

        out = plot_schedule(
            cfg.schedule, cfg.train.max_steps, cfg.optim.lr, run_dir / "report" / "lr_schedule.png"
        )
        print(f"kiln train: wrote the learning-rate schedule to {out}")
        return 0
    return _train(cfg, run_dir, args)


def _train(cfg: Any, run_dir: Any, args: argparse.Namespace) -> int:
    """Build the trainer, report the setup, train, report the outcome."""
    from kiln.train.trainer import Trainer

    trainer = Trainer(cfg, run_dir, resume=args.resume)
    m, c = trainer.model_cfg, trainer.cfg
    print(
        f"kiln train: {m.num_params():,} parameters ({m.n_layer} layers, width {m.n_embd}) on "
        f"{trainer.device}; {c.batch.global_tokens:,} tokens per step = {trainer.accum} × "
        f"{c.batch.micro_batch} × {c.data.seq_len}; {c.train.max_steps:,} steps; run in {run_dir}"
    )
    if args.resume:
        print(f"kiln train: resuming at step {trainer.step:,} ({trainer.tokens:,} tokens seen)")
        for note in trainer.notes:
            print(f"kiln train: changed since the checkpoint: {note}")
    start = time.perf_counter()
    result = trainer.run()
    elapsed = time.perf_counter() - start
    if result.interrupted:
        again = shlex.join(["kiln", "train", args.config, *_set_args(args.set), "--resume"])
        print(f"kiln train: stopped at step {result.step:,}; saved {result.checkpoint}")
        print(f"kiln train: continue with: {again}")
        return 128 + (result.signal or signal.SIGINT)  # the shell's code for "killed by it"
    val = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    last = f"loss {result.losses[-1]:.4f}" if result.losses else "nothing to do"
    print(
        f"kiln train: step {result.step:,} ({result.tokens:,} tokens) in {elapsed:.1f} s: "
        f"{last}{val}; checkpoint {result.checkpoint}; metrics in {run_dir / 'metrics.jsonl'}"
    )
    return 0


def _set_args(assignments: list[str]) -> list[str]:
    """The --set arguments again, to repeat them in the resume command."""
    return [part for a in assignments for part in ("--set", a)]
