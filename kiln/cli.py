"""The `kiln` command: each package contributes its subcommands through a `register` function."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from kiln import __version__
from kiln.errors import KilnError

# (module, attribute) pairs imported lazily, so `kiln --help` stays fast and torch is only
# imported by the commands that need it.
_COMMAND_MODULES: list[str] = [
    "kiln.tokenizer.cli",
    "kiln.data.cli",
    "kiln.model.cli",
    "kiln.train.cli",
    "kiln.eval.cli",
    "kiln.scaling.cli",
    "kiln.demo",
]


def add_command_group(
    sub: argparse._SubParsersAction, name: str, help_text: str, description: str, example: str
) -> argparse._SubParsersAction:
    """Add `kiln NAME` with its own subcommands; bare `kiln NAME` prints the group's help."""
    group = sub.add_parser(
        name,
        help=help_text,
        description=description,
        epilog=f"example: {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group.set_defaults(handler=lambda args: group.print_help() or 0)
    return group.add_subparsers(dest=f"{name}_command", metavar="SUBCOMMAND")


def add_subcommand(
    commands: argparse._SubParsersAction, name: str, help_text: str, examples: str
) -> argparse.ArgumentParser:
    """Add one subcommand whose --help ends with its examples."""
    return commands.add_parser(
        name,
        help=help_text,
        description=help_text,
        epilog=examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def build_parser() -> argparse.ArgumentParser:
    """Build the full argument parser with every package's subcommands."""
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="kiln: raw text to a trained, evaluated, servable language model.",
        epilog="Example: kiln demo   |   kiln tokenizer train corpus.txt --vocab-size 8000",
    )
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    import importlib

    for name in _COMMAND_MODULES:
        module = importlib.import_module(name)
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kiln` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int | None] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return int(handler(args) or 0)
    except KilnError as exc:
        if args.debug:
            raise
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
