"""`kiln export RUN --hf DIR`: a run's checkpoint, found and loaded by kiln.loading, written as an
HF directory by kiln.train.export (this command sits above both, so it lives here)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kiln.commands import add_subcommand, add_tokenizer_option
from kiln.loading import find_checkpoint, load_checkpoint

EXPORT_EXAMPLES = """examples:
  kiln export runs/demo --hf exports/demo           # the latest checkpoint
  kiln export runs/demo --hf exports/demo-500 --step 500 --force
  kiln export runs/demo --hf exports/demo --tokenizer data/tok.json
  kiln sample exports/demo --prompt 'Once upon a time'

then, in Python:
  AutoModelForCausalLM.from_pretrained("exports/demo"); AutoTokenizer.from_pretrained(...)"""


def register(sub: Any) -> None:
    """Add `kiln export RUN --hf DIR`."""
    p = add_subcommand(
        sub, "export", "export a run's checkpoint as a Hugging Face model directory",
        EXPORT_EXAMPLES,
    )  # fmt: skip
    p.description = (
        "Write a checkpoint of a training run (the latest by default) as a Hugging Face\n"
        "directory: config.json + model.safetensors, and the run's tokenizer as tokenizer.json\n"
        "(+ tokenizer_config.json, special_tokens_map.json) for AutoTokenizer. GPT-2 and\n"
        "Llama-style models only. DIR is written whole or not at all."
    )
    p.add_argument(
        "run",
        metavar="RUN",
        help="run, kiln demo, train/, checkpoints/ or checkpoint (step_N) folder",
    )
    p.add_argument("--hf", required=True, metavar="DIR", help="output directory")
    p.add_argument("--step", type=int, help="checkpoint step to export (default: latest)")
    add_tokenizer_option(p, default="the one the run's dataset manifest names")
    p.add_argument("--force", action="store_true", help="replace a DIR an earlier export wrote")
    p.set_defaults(handler=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Export a checkpoint and say what was written."""
    from kiln.folders import check_can_replace_dir
    from kiln.train.export import (
        EXPORT_KIND,
        ExportSource,
        describe,
        export_hf,
        is_export_dir,
        remove_abandoned_exports,
    )

    # Before loading, not after: a folder export may not replace fails at once (and one a
    # killed export had moved aside is back in place first).
    remove_abandoned_exports(Path(args.hf))
    check_can_replace_dir(Path(args.hf), args.force, is_export_dir, EXPORT_KIND)
    from kiln.checkpoint_format import is_sharded_checkpoint

    # A sharded checkpoint is converted tensor by tensor: the model is never loaded whole.
    sharded = is_sharded_checkpoint(find_checkpoint(args.run, args.step))
    loaded = load_checkpoint(args.run, args.step, args.tokenizer, weights_too=not sharded)
    source = ExportSource(
        model=loaded.model, tokenizer=loaded.tokenizer, tokenizer_path=loaded.tokenizer_path,
        eos_token=loaded.eot_token, run=loaded.run, checkpoint=loaded.path,
        step=loaded.state["step"], tokens=loaded.state["tokens"],
    )  # fmt: skip
    print(describe(export_hf(source, args.hf, args.force)))
    return 0
