"""`kiln baselines DATASET --valid FILE`: the ladder's lower rungs, scored by bits per byte."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.errors import KilnError

EXAMPLES = """examples:
  kiln baselines runs/demo/data --valid ../shared/data/tinystories/valid.txt.gz
  kiln baselines data/stories --valid valid.txt --rungs bigram,kn --out ladder.json
  kiln baselines data/stories --valid valid.txt --rungs mlp --budget 120

Rungs: bigram (add-k counts), kn (interpolated Kneser–Ney; order and discount picked on the val
split), bigram-nn (a learned V×V table of logits), mlp (Bengio's 5-gram MLP). The neural rungs
train for --budget CPU seconds each. Every rung is scored as the speedrun scores a model: the
file as one stream of documents and end-of-text tokens, every byte counted."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kiln baselines` to the `kiln` command."""
    from kiln.commands import add_subcommand

    p = add_subcommand(
        sub, "baselines", "count and small neural baselines, in bits per byte", EXAMPLES
    )
    p.add_argument("dataset", metavar="DATASET", help="token-shard dataset to fit and train on")
    p.add_argument("--valid", required=True, metavar="FILE", help="text file to score (bpb)")
    p.add_argument(
        "--rungs", default="bigram,kn,bigram-nn,mlp", help="comma-separated (default: all four)"
    )
    p.add_argument("--budget", type=float, default=60.0, help="CPU seconds per neural rung")
    p.add_argument("--block-size", type=int, default=256, help="scoring window (default 256)")
    p.add_argument("--out", metavar="JSON", help="write the results as JSON")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the rungs in order, printing one row each, then write --out."""
    from kiln.eval.baselines.ladder import RUNGS, NeuralSettings, run_rung
    from kiln.io import check_can_write, write_json_atomic

    rungs = [r.strip() for r in args.rungs.split(",") if r.strip()]
    unknown = [r for r in rungs if r not in RUNGS]
    if unknown or not rungs:
        raise KilnError(
            f"--rungs: unknown {unknown or 'empty'}; expected some of {', '.join(RUNGS)}"
        )
    if args.budget <= 0 or args.block_size < 2:
        raise KilnError(
            f"--budget must be > 0 and --block-size >= 2, got {args.budget}, {args.block_size}"
        )
    if not Path(args.valid).is_file():
        raise KilnError(f"--valid {args.valid}: no such file")
    if args.out:
        check_can_write(args.out, args.force)
    results = []
    print("| rung | settings | params | CPU s | valid bpb |")
    print("|---|---|---|---|---|")
    for rung in rungs:
        print(f"{rung}: fitting / training ...", file=sys.stderr, flush=True)
        res = run_rung(
            rung, args.dataset, args.valid, args.block_size, NeuralSettings(budget_s=args.budget),
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )  # fmt: skip
        results.append(res.to_dict())
        settings = ", ".join(f"{k}={v}" for k, v in res.settings.items())
        print(f"| {rung} | {settings} | {res.params:,} | {res.train_s:.1f} | {res.valid_bpb:.4f} |")
    if args.out:
        write_json_atomic(args.out, {"dataset": str(args.dataset), "valid": str(args.valid),
                                     "rungs": results})  # fmt: skip
        print(f"wrote {args.out}")
    return 0
