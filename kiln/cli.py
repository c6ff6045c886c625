"""The `kiln` entry point: builds the parser from each package's `register`, runs the handler.

Subcommands are added through `kiln.commands` (one helper, one "examples:" block in every --help);
errors a user can fix (KilnError) print as one line, with --debug for the traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from kiln import __version__
from kiln.errors import KilnError

# Modules whose `register(sub)` adds their subcommands; each imports torch only in its handlers,
# so `kiln --help` stays fast.
_COMMAND_MODULES: list[str] = [
    "kiln.tokenizer.cli",
    "kiln.data.cli",
    "kiln.image.cli",  # before kiln.train.cli, which adds `kiln image train-vqvae`
    "kiln.train.cli",
    "kiln.loading.cli",
    "kiln.posttrain.cli",
    "kiln.eval.cli",
    "kiln.eval.baselines.cli",
    "kiln.scaling.cli",
    "kiln.serve.cli",
    "kiln.demo",
]


def build_parser() -> argparse.ArgumentParser:
    """Build the full argument parser with every package's subcommands."""
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="kiln: raw text to a trained, evaluated, servable language model.",
        epilog="examples:\n  kiln demo\n  kiln tokenizer train corpus.txt --vocab-size 8000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
