"""`kiln tokenizer ...` run in-process through `kiln.cli.main`: exit codes, output, files."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kiln.cli
from kiln.tokenizer import Tokenizer
from kiln.tokenizer import train as train_module
from kiln.tokenizer.formats import read_gpt2, read_hf, read_kiln, write_kiln

EOT = "<|endoftext|>"


@pytest.fixture
def kiln_main():
    """The real `kiln` entry point, run in-process."""
    return kiln.cli.main


@pytest.fixture(scope="module")
def gpt2_spec(shared_data: Path) -> str:
    return f"gpt2:{shared_data / 'gpt2' / 'vocab.json'}:{shared_data / 'gpt2' / 'merges.txt'}"


@pytest.fixture(scope="module")
def small_tok(shared_data: Path) -> Tokenizer:
    """GPT-2 cut to its first 400 merges, with <|endoftext|> at id 700."""
    gpt2 = read_gpt2(shared_data / "gpt2" / "vocab.json", shared_data / "gpt2" / "merges.txt")
    merges = gpt2.merges[:400]
    keep = {a + b for a, b in merges} | {bytes([v]) for v in range(256)}
    vocab = {i: b for i, b in gpt2.vocab.items() if b in keep and i != 50256}
    return Tokenizer(vocab, merges, {EOT: 700})


@pytest.fixture
def tok_file(small_tok, tmp_path) -> Path:
    path = tmp_path / "tok.json"
    write_kiln(small_tok, path)
    return path


@pytest.mark.parametrize("command", ["train", "encode", "decode", "inspect", "convert"])
def test_every_subcommand_has_help_with_an_example(kiln_main, capsys, command) -> None:
    with pytest.raises(SystemExit) as exit_info:
        kiln_main(["tokenizer", command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"kiln tokenizer {command}" in out


def test_group_without_subcommand_prints_help(kiln_main, capsys) -> None:
    assert kiln_main(["tokenizer"]) == 0
    assert "train" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ train
class FakeTrain:
    """Stands in for train_bpe: records its arguments, returns a ready tokenizer."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Tokenizer:
        self.calls.append((args, kwargs))
        return Tokenizer(
            self.tok.vocab,
            self.tok.merges,
            self.tok.special_tokens,
            metadata={"training": {"summary": "fake report"}},
        )


@pytest.fixture
def fake_train(monkeypatch, small_tok) -> FakeTrain:
    fake = FakeTrain(small_tok)
    monkeypatch.setattr(train_module, "train_bpe", fake)
    monkeypatch.setattr(train_module, "format_report", lambda training: training["summary"])
    return fake


def test_train_passes_defaults_and_writes(kiln_main, fake_train, tmp_path, capsys) -> None:
    out = tmp_path / "out.json"
    code = kiln_main(
        ["tokenizer", "train", "a.txt", "b.jsonl", "--vocab-size", "500", "-o", str(out)]
    )
    assert code == 0
    (args, kwargs), = fake_train.calls  # fmt: skip
    assert list(args) == [["a.txt", "b.jsonl"], 500]
    assert kwargs == {
        "special_tokens": [EOT],
        "pattern": "gpt2",
        "workers": None,
        "min_frequency": 1,
        "text_field": "text",
        "invalid_utf8": "replace",
        "holdout": 0.01,
        "checkpoint_dir": str(out) + ".train-state",
        "resume": False,
        "progress": True,
    }
    assert "fake report" in capsys.readouterr().out
    assert read_kiln(out).metadata == {"training": {"summary": "fake report"}}


def test_train_passes_every_option(kiln_main, fake_train, tmp_path) -> None:
    out = tmp_path / "out.json"
    argv = ["tokenizer", "train", "c.txt", "--vocab-size", "1000", "-o", str(out),
            "--special-token", "<|a|>", "--special-token", "<|b|>", "--pattern", "cl100k",
            "--workers", "3", "--min-frequency", "2", "--text-field", "body",
            "--invalid-utf8", "error", "--holdout", "0.1", "--resume"]  # fmt: skip
    assert kiln_main(argv) == 0
    kwargs = fake_train.calls[0][1]
    assert kwargs["special_tokens"] == ["<|a|>", "<|b|>"]
    assert (kwargs["pattern"], kwargs["workers"], kwargs["min_frequency"]) == ("cl100k", 3, 2)
    assert (kwargs["text_field"], kwargs["invalid_utf8"]) == ("body", "error")
    assert (kwargs["holdout"], kwargs["resume"]) == (0.1, True)
    assert kiln_main([*argv[:7], "--no-special-tokens", "--force"]) == 0
    assert fake_train.calls[1][1]["special_tokens"] == []


def test_train_expands_directories(kiln_main, fake_train, tmp_path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for name in ("b.txt", "a.txt", "sub/c.jsonl"):
        (corpus / name).write_text("x", encoding="utf-8")
    argv = [
        "tokenizer",
        "train",
        str(corpus),
        "--vocab-size",
        "300",
        "-o",
        str(tmp_path / "o.json"),
    ]
    assert kiln_main(argv) == 0
    inputs = fake_train.calls[0][0][0]
    assert inputs == [str(corpus / "a.txt"), str(corpus / "b.txt"), str(corpus / "sub" / "c.jsonl")]


def test_train_refuses_to_overwrite_before_training(kiln_main, fake_train, tmp_path, capsys):
    out = tmp_path / "out.json"
    out.write_text("precious", encoding="utf-8")
    argv = ["tokenizer", "train", "a.txt", "--vocab-size", "300", "-o", str(out)]
    assert kiln_main(argv) == 2
    assert fake_train.calls == []
    err = capsys.readouterr().err
    assert err.startswith("kiln: error:") and str(out) in err and "--force" in err
    assert out.read_text(encoding="utf-8") == "precious"
    assert kiln_main([*argv, "--force"]) == 0
    assert len(fake_train.calls) == 1


def test_train_end_to_end(kiln_main, shared_data, tmp_path, capsys) -> None:
    """The real trainer on a small text: the file loads and round-trips text."""
    out = tmp_path / "trained.json"
    corpus = str(shared_data / "text" / "tinystories_sample.txt")
    argv = ["tokenizer", "train", corpus, "--vocab-size", "300", "-o", str(out), "--workers", "1"]
    assert kiln_main(argv) == 0
    assert str(out) in capsys.readouterr().out
    tok = read_kiln(out)
    assert tok.n_vocab == 300 and tok.special_tokens == {EOT: 299}
    assert "training" in tok.metadata
    assert tok.decode(tok.encode("Once upon a time")) == "Once upon a time"


# -------------------------------------------------------------------------------- encode / decode
def test_encode_text_file_stdin_and_json(
    kiln_main, tok_file, small_tok, tmp_path, capsys, monkeypatch
):
    text = "Hello world, once upon a time"
    expected = small_tok.encode(text)
    assert kiln_main(["tokenizer", "encode", "--tokenizer", str(tok_file), text]) == 0
    assert capsys.readouterr().out.split() == [str(i) for i in expected]
    source = tmp_path / "in.txt"
    source.write_text(text, encoding="utf-8")
    assert (
        kiln_main(
            ["tokenizer", "encode", "--tokenizer", str(tok_file), "-f", str(source), "--json"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out) == expected
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert kiln_main(["tokenizer", "encode", "--tokenizer", str(tok_file)]) == 0
    assert capsys.readouterr().out.split() == [str(i) for i in expected]


def test_encode_special_policy(kiln_main, tok_file, capsys) -> None:
    argv = ["tokenizer", "encode", "--tokenizer", str(tok_file), f"a{EOT}"]
    assert kiln_main(argv) == 2
    err = capsys.readouterr().err
    assert EOT in err and "--allow-special" in err and len(err.strip().splitlines()) == 1
    assert kiln_main([*argv, "--allow-special"]) == 0
    assert capsys.readouterr().out.split()[-1] == "700"


def test_decode_args_and_stdin(kiln_main, tok_file, small_tok, capsys, monkeypatch) -> None:
    ids = small_tok.encode("déjà vu\n日本")
    assert kiln_main(["tokenizer", "decode", "--tokenizer", str(tok_file), *map(str, ids)]) == 0
    assert capsys.readouterr().out == "déjà vu\n日本\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(ids)))
    assert kiln_main(["tokenizer", "decode", "--tokenizer", str(tok_file)]) == 0
    assert capsys.readouterr().out == "déjà vu\n日本\n"


@pytest.mark.parametrize(
    ("ids", "message"),
    [(["12", "x"], "'x' is not a token id"), (["99999"], "99999"), (["²"], "not a token id")],
)
def test_decode_bad_ids(kiln_main, tok_file, capsys, ids, message) -> None:
    assert kiln_main(["tokenizer", "decode", "--tokenizer", str(tok_file), *ids]) == 2
    assert message in capsys.readouterr().err


def test_gpt2_spec_matches_known_ids(kiln_main, gpt2_spec, capsys) -> None:
    assert kiln_main(["tokenizer", "encode", "--tokenizer", gpt2_spec, "Hello world"]) == 0
    assert capsys.readouterr().out.split() == ["15496", "995"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gpt2", "gpt2:VOCAB_JSON:MERGES_TXT"),
        ("gpt2:only-one", "expected gpt2:"),
        ("missing.json", "missing.json: no such file"),
    ],
)
def test_bad_tokenizer_spec(kiln_main, capsys, spec, message) -> None:
    assert kiln_main(["tokenizer", "encode", "--tokenizer", spec, "x"]) == 2
    assert message in capsys.readouterr().err


def test_hf_file_as_tokenizer(kiln_main, tok_file, small_tok, tmp_path, capsys) -> None:
    hf_path = tmp_path / "hf.json"
    assert kiln_main(["tokenizer", "convert", str(tok_file), str(hf_path), "--to", "hf"]) == 0
    capsys.readouterr()
    assert kiln_main(["tokenizer", "encode", "--tokenizer", str(hf_path), "a cat sat"]) == 0
    assert capsys.readouterr().out.split() == [str(i) for i in small_tok.encode("a cat sat")]


# ---------------------------------------------------------------------------------------- inspect
def test_inspect_terminal_and_html(kiln_main, tok_file, shared_data, tmp_path, capsys) -> None:
    html_path = tmp_path / "view.html"
    german = str(shared_data / "text" / "german.txt")
    argv = ["tokenizer", "inspect", "--tokenizer", str(tok_file), "hello  world", "-f", german,
            "--html", str(html_path), "--top", "4", "--color", "never"]  # fmt: skip
    assert kiln_main(argv) == 0
    out = capsys.readouterr().out
    assert "== <text>" in out and "he│ll│o│·│·wor│ld" in out and f"== {german}" in out
    assert "bytes/token" in out and "4 longest tokens" in out
    assert "\x1b[" not in out
    page = html_path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "german.txt" in page
    assert kiln_main([*argv[:5], "--color", "always", "--top", "0"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[30;48;5;" in out and "longest" not in out


# ---------------------------------------------------------------------------------------- convert
def test_convert_round_trip_and_force(kiln_main, tok_file, small_tok, tmp_path, capsys) -> None:
    hf_path, tt_path, back = tmp_path / "hf.json", tmp_path / "t.tiktoken", tmp_path / "back.json"
    assert kiln_main(["tokenizer", "convert", str(tok_file), str(hf_path)]) == 0
    assert "(kiln)" in capsys.readouterr().out
    assert read_hf(hf_path).merges == small_tok.merges
    assert kiln_main(["tokenizer", "convert", str(hf_path), str(tt_path)]) == 0
    argv = ["tokenizer", "convert", str(tt_path), str(back), "--special-token", f"{EOT}=700"]
    assert kiln_main(argv) == 0
    assert back.read_bytes() == tok_file.read_bytes()
    assert kiln_main(argv) == 2
    assert "--force" in capsys.readouterr().err
    assert kiln_main([*argv, "--force"]) == 0
    assert kiln_main([*argv[:4], "--special-token", "nonsense", "--force"]) == 2
    assert "expected NAME=ID" in capsys.readouterr().err


def test_convert_gpt2_with_merges(kiln_main, shared_data, tmp_path) -> None:
    out = tmp_path / "gpt2.json"
    argv = ["tokenizer", "convert", str(shared_data / "gpt2" / "vocab.json"), str(out),
            "--from", "gpt2", "--merges", str(shared_data / "gpt2" / "merges.txt")]  # fmt: skip
    assert kiln_main(argv) == 0
    assert read_kiln(out).encode("Hello world") == [15496, 995]


def test_console_error_is_one_line(gpt2_spec) -> None:
    """Through a real process: exit status 2 and a single `kiln: error:` line, no traceback."""
    argv = [
        sys.executable,
        "-W",
        "ignore",
        "-m",
        "kiln.cli",
        "tokenizer",
        "encode",
        "--tokenizer",
        gpt2_spec,
    ]
    result = subprocess.run([*argv, EOT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    errors = result.stderr.splitlines()
    assert len(errors) == 1 and errors[0].startswith("kiln: error: text contains")


def test_an_error_while_counting_starts_on_its_own_line_after_the_progress_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "c.jsonl"
    good = "".join(json.dumps({"text": f"hello world number {i} " * 5}) + "\n" for i in range(2000))
    corpus.write_text(good + '{"text": broken\n')
    argv = ["tokenizer", "train", str(corpus), "--vocab-size", "300", "-o", str(tmp_path / "t")]
    assert kiln.cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "count pre-tokens" in err  # the bar was drawn
    assert f"\nkiln: error: {corpus}:2001: invalid JSON" in err, err
    assert err.rstrip("\n").splitlines()[-1].startswith("kiln: error: "), err
