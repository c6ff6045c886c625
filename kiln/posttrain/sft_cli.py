"""`kiln sft CONFIG.toml [--set k=v ...] [--resume]`: fine-tune a pretrained model on conversations."""

from __future__ import annotations

import argparse
from typing import Any

EXAMPLES = """examples:
  kiln sft configs/sft.toml --set sft.base=runs/demo-chat --set data.train=data/chat/train.jsonl
  kiln sft configs/sft.toml --set lora.rank=8 --set logging.run_dir=runs/sft-lora
  kiln sft configs/sft.toml --resume           # continue from the run's latest checkpoint
  kiln eval runs/sft --chat-tasks              # then score it (a LoRA run loads merged)"""


def register(sub: Any) -> None:
    """Add `kiln sft` to the top-level `kiln` parser."""
    from kiln.commands import add_subcommand

    p = add_subcommand(sub, "sft", "fine-tune a model on conversations (full or LoRA)", EXAMPLES)
    p.description = (
        "Supervised fine-tuning: start from sft.base (a model with the chat tokens, e.g. from\n"
        "`kiln posttrain add-chat-tokens`) and train on data.train's conversations, learning the\n"
        "assistant replies only. lora.rank > 0 trains LoRA adapters with the base frozen and\n"
        "writes RUN/adapter/ (PEFT's format). The run folder is a kiln run: config.toml (the\n"
        "base and data recorded by sha256), metrics.jsonl, checkpoints/ (exact --resume)."
    )
    p.add_argument("config", metavar="CONFIG.toml", help="SFT config (see configs/sft.toml)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set lora.rank=8 (repeatable)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the run's latest checkpoint"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_sft)


def run_sft(args: argparse.Namespace) -> int:
    """Load the config, fine-tune (resuming if asked), write a LoRA run's adapter."""
    from kiln.posttrain.sft import build_trainer, load_sft_config, write_adapter
    from kiln.train.cli import train_and_report
    from kiln.train.config import default_run_dir

    overrides = list(args.set)
    if args.no_progress:
        overrides.append("logging.progress=false")
    cfg = load_sft_config(args.config, overrides)
    run_dir = default_run_dir(cfg, args.config)

    def after(trainer: Any, result: Any) -> None:
        written = write_adapter(trainer)
        if written is not None:
            trainer.say(f"kiln sft: LoRA adapter of step {result.step:,} in {written} (PEFT)")

    return train_and_report(cfg, run_dir, args, build=build_trainer, command="sft", after=after)
