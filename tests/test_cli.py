"""The `kiln` command tree: every command's --help ends with the same "examples:" block."""

from __future__ import annotations

import argparse
import re

import pytest

from kiln.cli import build_parser, main
from kiln.commands import add_subcommand


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for every parser under `parser`, the top level included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from walk(child, (*path, name))


COMMANDS = dict(walk(build_parser()))


def test_the_tree_holds_every_documented_command() -> None:
    names = {" ".join(path) for path in COMMANDS}
    for expected in ("sample", "demo", "train", "eval", "export", "plot", "tokenizer train",
                     "data run", "data tokenize", "scaling account", "image data",
                     "image train-vqvae"):  # fmt: skip
        assert expected in names


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "kiln")
def test_every_help_ends_with_an_examples_block_of_kiln_commands(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*path, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    block = text[text.rindex("\nexamples:\n") + 1 :] if "\nexamples:\n" in text else ""
    lines = block.splitlines()[1:]
    assert lines, f"kiln {' '.join(path)} --help has no examples: block"
    commands = [line for line in lines if re.match(r"  kiln( |$)", line)]
    assert commands, f"kiln {' '.join(path)}: no indented `kiln ...` line under examples:"
    own = "  kiln " + " ".join(path)
    assert any(line.startswith(own) for line in commands) or not path


def test_a_subcommand_without_the_examples_block_is_refused() -> None:
    sub = argparse.ArgumentParser().add_subparsers()
    with pytest.raises(ValueError, match="examples must start with"):
        add_subcommand(sub, "x", "does x", "Example: kiln x")
