"""`kiln data tokenize|inspect` run in-process through `kiln.cli.main` with the data commands."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import kiln.cli
from kiln.data import Dataset
from kiln.data import cli as data_cli
from tests.data.conftest import DOCS_A, write_inputs


@pytest.fixture
def kiln_main(monkeypatch):
    """The real `kiln` entry point with `kiln.data.cli` registered."""
    if "kiln.data.cli" not in kiln.cli._COMMAND_MODULES:
        monkeypatch.setattr(
            kiln.cli, "_COMMAND_MODULES", [*kiln.cli._COMMAND_MODULES, "kiln.data.cli"]
        )
    return kiln.cli.main


@pytest.mark.parametrize("command", ["tokenize", "inspect"])
def test_every_subcommand_has_help_with_an_example(capsys, command) -> None:
    parser = argparse.ArgumentParser(prog="kiln")
    data_cli.register(parser.add_subparsers())
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["data", command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"kiln data {command}" in out


def test_tokenize_then_inspect(kiln_main, capsys, tmp_path, tiny_tokenizer_file) -> None:
    inputs = [str(p) for p in write_inputs(tmp_path / "in")]
    out = tmp_path / "ds"
    argv = ["data", "tokenize", "--tokenizer", str(tiny_tokenizer_file), *inputs]
    assert kiln_main([*argv, "--out", str(out), "--val-docs", "2", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "train:" in printed and "val:" in printed and f"wrote {out}" in printed
    ds = Dataset.open(out)
    assert ds.split("val").n_documents == 2

    assert kiln_main(["data", "inspect", str(out), "--doc", "1", "--verify"]) == 0
    report = capsys.readouterr().out
    assert "train" in report and "val" in report and "a.txt.gz" in report
    text = ds.split("train").document(1)
    assert f"document 1 ({len(text)} tokens" in report
    assert any(doc[:20] in report for doc in DOCS_A)


def test_user_errors_are_one_line_with_exit_code_2(
    kiln_main, capsys, tmp_path, tiny_tokenizer_file
) -> None:
    inputs = [str(p) for p in write_inputs(tmp_path / "in")]
    out = tmp_path / "ds"
    argv = ["data", "tokenize", "--tokenizer", str(tiny_tokenizer_file), *inputs, "--quiet"]
    assert kiln_main([*argv, "--out", str(out)]) == 0
    capsys.readouterr()
    assert kiln_main([*argv, "--out", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert kiln_main([*argv, "--out", str(out), "--force"]) == 0
    assert kiln_main(["data", "inspect", str(tmp_path / "nowhere")]) == 2
    assert "no such dataset directory" in capsys.readouterr().err
    assert kiln_main(["data", "inspect", str(out), "--split", "test"]) == 2
    assert "no split 'test'" in capsys.readouterr().err


def test_inspect_without_the_tokenizer_still_summarises(
    kiln_main, capsys, tmp_path, tiny_tokenizer_file
) -> None:
    tok = tmp_path / "moved.json"
    tok.write_bytes(Path(tiny_tokenizer_file).read_bytes())
    inputs = [str(p) for p in write_inputs(tmp_path / "in")]
    out = tmp_path / "ds"
    tokenize = ["data", "tokenize", "--tokenizer", str(tok), *inputs, "--quiet", "--out", str(out)]
    assert kiln_main(tokenize) == 0
    tok.unlink()
    capsys.readouterr()
    assert kiln_main(["data", "inspect", str(out)]) == 0
    assert "pass --tokenizer" in capsys.readouterr().out
    assert kiln_main(["data", "inspect", str(out), "--tokenizer", str(tiny_tokenizer_file)]) == 0
    assert "sample: train document 0" in capsys.readouterr().out


def test_inspect_marks_real_special_tokens_apart_from_the_same_text(
    kiln_main, capsys, tmp_path, tiny_tokenizer_file
) -> None:
    corpus = tmp_path / "inline.txt"
    corpus.write_text(
        "a story that says <|endoftext|> inside a line\n<|endoftext|>\nanother story\n",
        encoding="utf-8",
    )
    out = tmp_path / "ds"
    argv = ["data", "tokenize", "--tokenizer", str(tiny_tokenizer_file), str(corpus)]
    assert kiln_main([*argv, "--out", str(out), "--val-docs", "0", "--quiet"]) == 0
    capsys.readouterr()
    assert kiln_main(["data", "inspect", str(out), "--doc", "0"]) == 0
    shown = capsys.readouterr().out
    assert "says <|endoftext|> inside" in shown  # the text, unmarked
    assert "⟦<|endoftext|>⟧" in shown  # the document's real end-of-text token, marked
    assert "marks a real special token" in shown
