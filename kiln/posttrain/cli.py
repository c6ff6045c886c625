"""`kiln posttrain add-chat-tokens`, `kiln data chat`, `kiln chat` and `kiln sft`."""

from __future__ import annotations

import argparse
from typing import Any

from kiln.commands import add_command_group, add_subcommand, command_group

MODEL_HELP = "a kiln demo, run, train/, checkpoints/, checkpoint (step_N) or HF model folder"

ADD_TOKENS_EXAMPLES = """examples:
  kiln posttrain add-chat-tokens runs/demo runs/demo-chat
  kiln posttrain add-chat-tokens exports/demo runs/demo-chat --force

Writes a NEW run folder (tokenizer.json, checkpoints/step_N/, chat_tokens.json); the source is
never modified. The tokens get the ids after the tokenizer's largest (no id is renumbered); the
embedding and head rows of the new tokens start as the mean of the existing tokens' rows."""

DATA_CHAT_EXAMPLES = """examples:
  kiln data chat data/chat
  kiln data chat data/chat-big --source ../shared/data/tinystories --heldout 500 --seed 1
  kiln data chat data/chat-small --max-stories 2000 --tasks words,name --force

Writes OUT/train.jsonl and OUT/heldout.jsonl (one conversation per line: "messages", plus the
"task" and "params" its check needs) and OUT/manifest.json (counts per task, sha256). The
held-out split shares no story with train; the same sources and seed give the same files."""


def register(sub: Any) -> None:
    """Add `kiln posttrain ...`, `kiln data chat` and `kiln chat` to the `kiln` parser."""
    commands = add_command_group(
        sub,
        "posttrain",
        "prepare a base model for post-training (chat tokens)",
        "Post-training preparation: give a base model and its tokenizer the chat tokens.",
        "kiln posttrain add-chat-tokens runs/demo runs/demo-chat",
    )
    _add_chat_tokens_command(commands)
    _add_data_chat_command(command_group(sub, "data"))
    _add_sft_command(sub)


def _add_chat_tokens_command(commands: Any) -> None:
    p = add_subcommand(
        commands,
        "add-chat-tokens",
        "add the chat tokens to a model and its tokenizer (a new folder)",
        ADD_TOKENS_EXAMPLES,
    )
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("out", metavar="OUT", help="the new run folder to write")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer file (default: the model's own)")
    p.add_argument("--force", action="store_true", help="replace an OUT this command wrote before")
    p.set_defaults(handler=run_add_chat_tokens)


def run_add_chat_tokens(args: argparse.Namespace) -> int:
    """Write OUT and report the tokens and rows added."""
    from kiln.posttrain.chat_tokens import add_chat_tokens, describe

    result = add_chat_tokens(args.model, args.out, force=args.force, tokenizer=args.tokenizer)
    print(describe(result, args.model))
    return 0


def _add_data_chat_command(commands: Any) -> None:
    from kiln.posttrain.tasks import TASKS

    p = add_subcommand(
        commands,
        "chat",
        "build instruction conversations with checkable tasks from TinyStories",
        DATA_CHAT_EXAMPLES,
    )
    p.add_argument("out", metavar="OUT", help="the folder to write")
    p.add_argument(
        "--source",
        action="append",
        metavar="PATH",
        help="story file (.txt[.gz], <|endoftext|> lines between stories) or a folder of "
        "train*.txt[.gz] (repeatable; default: the shipped TinyStories)",
    )
    p.add_argument("--seed", type=int, default=0, help="shuffle and task seed (default 0)")
    p.add_argument("--heldout", type=int, default=250, help="held-out stories (default 250)")
    p.add_argument("--max-stories", type=int, help="train stories (default: all the rest)")
    p.add_argument(
        "--tasks", default=",".join(TASKS), help=f"comma-separated (default {','.join(TASKS)})"
    )
    p.add_argument("--force", action="store_true", help="replace an OUT this command wrote")
    p.set_defaults(handler=run_data_chat)


def run_data_chat(args: argparse.Namespace) -> int:
    """Build and write the conversations, print the counts."""
    from kiln.posttrain.chat_data import ChatDataConfig, format_summary, write_chat_data

    config = ChatDataConfig(
        seed=args.seed,
        heldout=args.heldout,
        max_stories=args.max_stories,
        tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()),
        **({"sources": tuple(args.source)} if args.source else {}),
    )
    print(format_summary(write_chat_data(config, args.out, args.force), args.out))
    return 0


SFT_EXAMPLES = """examples:
  kiln sft configs/sft.toml --set sft.base=runs/demo-chat --set data.train=data/chat/train.jsonl
  kiln sft configs/sft.toml --set lora.rank=8 --set logging.run_dir=runs/sft-lora
  kiln sft configs/sft.toml --resume           # continue from the run's latest checkpoint
  kiln eval runs/sft --chat-tasks              # then score it (a LoRA run loads merged)"""


def _add_sft_command(sub: Any) -> None:
    """`kiln sft CONFIG.toml [--set k=v ...] [--resume]`: fine-tune a model on conversations."""
    p = add_subcommand(
        sub, "sft", "fine-tune a model on conversations (full or LoRA)", SFT_EXAMPLES
    )
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
