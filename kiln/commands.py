"""How a package adds its subcommands to `kiln`: one helper, so every --help ends the same way.

Each package's `cli.py` has a `register(sub)` that calls `add_subcommand` (or `add_command_group`
for a `kiln NAME SUBCOMMAND` family). Every help text then ends with an "examples:" block of
indented command lines, the block a user looks for first.
"""

from __future__ import annotations

import argparse

EXAMPLES_HEADER = "examples:\n"


def add_command_group(
    sub: argparse._SubParsersAction, name: str, help_text: str, description: str, example: str
) -> argparse._SubParsersAction:
    """Add `kiln NAME` with its own subcommands; bare `kiln NAME` prints the group's help."""
    group = sub.add_parser(
        name,
        help=help_text,
        description=description,
        epilog=f"{EXAMPLES_HEADER}  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group.set_defaults(handler=lambda args: group.print_help() or 0)
    return group.add_subparsers(dest=f"{name}_command", metavar="SUBCOMMAND")


def add_subcommand(
    commands: argparse._SubParsersAction,
    name: str,
    help_text: str,
    examples: str,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """Add one subcommand whose --help ends with `examples` ("examples:" + indented lines)."""
    if not examples.startswith(EXAMPLES_HEADER + "  "):
        raise ValueError(f"kiln {name}: examples must start with {EXAMPLES_HEADER!r} and indent")
    return commands.add_parser(
        name,
        help=help_text,
        description=description or help_text,
        epilog=examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def command_group(sub: argparse._SubParsersAction, name: str) -> argparse._SubParsersAction:
    """The subcommands of an existing `kiln NAME` group, so a higher layer can add to it.

    (`kiln data chat` lives in kiln.posttrain, above kiln.data, but belongs in `kiln data`.)
    """
    group = sub.choices.get(name)
    actions = [
        a for a in getattr(group, "_actions", []) if isinstance(a, argparse._SubParsersAction)
    ]
    if not actions:
        raise ValueError(f"kiln {name} is not a command group (register it first)")
    return actions[0]


# The options several commands share, defined here once so their names, values and help agree.
MODEL_TOKENIZER_HELP = (
    "kiln tokenizer.json, HF tokenizer.json, or a directory with GPT-2's vocab.json + merges.txt"
)
TOKENIZER_FILE_HELP = (
    "a kiln tokenizer.json, an HF tokenizer.json, or gpt2:VOCAB_JSON:MERGES_TXT for GPT-2's files"
)


def add_tokenizer_option(
    p: argparse.ArgumentParser, *, default: str | None = "the model's own", help_text: str = ""
) -> None:
    """`--tokenizer PATH`: optional with `default` named in the help, required when None."""
    text = help_text or (MODEL_TOKENIZER_HELP if default else TOKENIZER_FILE_HELP)
    suffix = f" (default: {default})" if default else ""
    p.add_argument("--tokenizer", metavar="TOK", required=default is None, help=text + suffix)


def add_device_options(p: argparse.ArgumentParser) -> None:
    """`--device` and `--dtype` for a command that runs a model."""
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto, fp32 or bf16: the autocast precision (default auto: bf16 where the device "
        "multiplies it natively)",
    )
