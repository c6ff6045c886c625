"""`kiln posttrain add-chat-tokens`, `kiln data chat` and `kiln chat`."""

from __future__ import annotations

import argparse
from typing import Any

from kiln.commands import add_command_group, add_subcommand

MODEL_HELP = "a kiln demo, run, train/, checkpoints/, checkpoint (step_N) or HF model folder"

ADD_TOKENS_EXAMPLES = """examples:
  kiln posttrain add-chat-tokens runs/demo runs/demo-chat
  kiln posttrain add-chat-tokens exports/demo runs/demo-chat --force

Writes a NEW run folder (tokenizer.json, checkpoints/step_N/, chat_tokens.json); the source is
never modified. The tokens get the ids after the tokenizer's largest (no id is renumbered); the
embedding and head rows of the new tokens start as the mean of the existing tokens' rows."""


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
