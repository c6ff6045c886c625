"""`--force` replaces only what kiln made, and only after every argument has been checked.

The probe from issue 20: a user's folder holding a precious file, passed as the output of each
command with `--force`; the file must survive and the command must say why in one line.
(`kiln export --force` is covered in tests/train/test_export.py, `kiln data run/tokenize` in
tests/data.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.cli import main
from kiln.demo import DEMO_MARKER, _prepare_out
from kiln.errors import KilnError


@pytest.fixture
def precious(tmp_path: Path) -> Path:
    """A user's folder `d` with `d/precious/t.txt` in it."""
    folder = tmp_path / "d"
    (folder / "precious").mkdir(parents=True)
    (folder / "precious" / "t.txt").write_text("thesis")
    return folder


def _fails_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kiln: error: "), err
    for word in words:
        assert word in err, err


def _intact(folder: Path) -> bool:
    return (folder / "precious" / "t.txt").read_text() == "thesis"


def test_demo_force_checks_arguments_before_touching_the_folder(
    precious: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--steps", "1", "--out", str(precious), "--force"]
    _fails_with_one_line([*argv, "--vocab-size", "10"], capsys, "--vocab-size 10 is too small")
    assert _intact(precious)
    _fails_with_one_line([*argv, "--set", "optim.lrr=1"], capsys, "optim.lrr")
    assert _intact(precious)
    _fails_with_one_line([*argv, "--steps", "0"], capsys, "--steps must be >= 1")
    assert _intact(precious)


def test_demo_force_keeps_the_old_run_when_the_trainer_would_refuse_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "demo"
    (old / "train").mkdir(parents=True)
    (old / DEMO_MARKER).write_text("")
    (old / "train" / "metrics.jsonl").write_text('{"step": 1}\n')
    argv = ["demo", "--out", str(old), "--force", "--set"]
    for override, words in (
        ("batch.global_tokens=1000", "batch.global_tokens (1000)"),
        ("train.device=tpu", "device must be cpu, cuda"),
        ("eval.sample_prompts=['Once<|endoftext|>']", "special token"),
    ):
        _fails_with_one_line([*argv, override], capsys, words)
        assert (old / "train" / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_demo_force_refuses_a_folder_it_did_not_make(
    precious: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--steps", "1", "--out", str(precious), "--force"]
    _fails_with_one_line(argv, capsys, str(precious), "is not a kiln demo run folder")
    assert _intact(precious)
    # A tokenizer.json does not make it a demo folder while it holds other things.
    (precious / "tokenizer.json").write_text("{}")
    _fails_with_one_line(argv, capsys, "is not a kiln demo run folder")
    assert _intact(precious)


def test_demo_out_that_is_a_file_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "f"
    file.write_text("mine")
    _fails_with_one_line(["demo", "--steps", "1", "--out", str(file)], capsys, "not a directory")
    _fails_with_one_line(["demo", "--out", str(file), "--force"], capsys, "not a directory")
    _fails_with_one_line(["demo", "--out", str(file / "sub")], capsys, str(file / "sub"))
    assert file.read_text() == "mine"


@pytest.mark.parametrize("layout", ["marker", "older demo"])
def test_demo_force_replaces_a_demo_run_folder(tmp_path: Path, layout: str) -> None:
    out = tmp_path / "demo"
    (out / "train" / "checkpoints").mkdir(parents=True)
    (out / "tokenizer.json").write_text("{}")
    if layout == "marker":
        (out / DEMO_MARKER).write_text("")
        (out / "notes.txt").write_text("anything, in a folder kiln demo made")
    with pytest.raises(KilnError, match="pass --force"):
        _prepare_out(out, force=False)
    _prepare_out(out, force=True)
    assert sorted(p.name for p in out.iterdir()) == [DEMO_MARKER]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no trash left behind


def test_demo_force_keeps_a_tokenizer_folder_that_no_demo_run_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only a tokenizer.json and data/ (a user's tokenizer work) is not an older demo's folder:
    that needs train/checkpoints or report/summary.json beside them."""
    out = tmp_path / "mytok"
    (out / "data").mkdir(parents=True)
    (out / "tokenizer.json").write_text("{}")
    (out / "data" / "corpus.txt").write_text("mine")
    argv = ["demo", "--steps", "1", "--out", str(out), "--force"]
    _fails_with_one_line(argv, capsys, str(out), "is not a kiln demo run folder")
    assert (out / "data" / "corpus.txt").read_text() == "mine"
    (out / "report").mkdir()
    (out / "report" / "summary.json").write_text("{}")
    # A report beside it does not make the user's corpus a demo's file.
    _fails_with_one_line(argv, capsys, str(out), "is not a kiln demo run folder")
    assert (out / "data" / "corpus.txt").read_text() == "mine"
    (out / "data" / "corpus.txt").unlink()
    for name in ("manifest.json", "train_000000.bin", "train_000000.idx"):
        (out / "data" / name).write_text("")
    _prepare_out(out, force=True)  # now every file in it is one an older demo wrote
    assert sorted(p.name for p in out.iterdir()) == [DEMO_MARKER]


def test_demo_force_keeps_a_user_folder_in_the_old_demo_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's folder: a demo's layout (tokenizer.json, data/, train/checkpoints/) holding
    the user's corpus and weights, no marker. --force must refuse it and delete nothing."""
    out = tmp_path / "mine"
    (out / "data").mkdir(parents=True)
    (out / "train" / "checkpoints").mkdir(parents=True)
    (out / "tokenizer.json").write_text("{}")
    (out / "data" / "my_corpus.txt").write_text("corpus")
    (out / "train" / "my_weights.bin").write_bytes(b"weights")
    argv = ["demo", "--steps", "1", "--out", str(out), "--force"]
    _fails_with_one_line(argv, capsys, str(out), "is not a kiln demo run folder")
    assert (out / "data" / "my_corpus.txt").read_text() == "corpus"
    assert (out / "train" / "my_weights.bin").read_bytes() == b"weights"
    (out / "data" / "my_corpus.txt").unlink()  # only the weights left: still the user's
    _fails_with_one_line(argv, capsys, "is not a kiln demo run folder")
    assert (out / "train" / "my_weights.bin").read_bytes() == b"weights"
    # A link in it is never followed into, and never taken for a demo's file.
    (out / "train" / "my_weights.bin").unlink()
    (out / "data" / "manifest.json").symlink_to(tmp_path / "elsewhere.json")
    _fails_with_one_line(argv, capsys, "is not a kiln demo run folder")
    (out / "data" / "manifest.json").unlink()
    _prepare_out(out, force=True)
    assert sorted(p.name for p in out.iterdir()) == [DEMO_MARKER]


def test_file_outputs_refuse_a_directory_even_with_force(
    precious: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n")
    for argv in (
        ["tokenizer", "train", str(corpus), "--vocab-size", "300", "-o", str(precious)],
        ["tokenizer", "convert", str(corpus), str(precious)],
        ["eval", str(tmp_path), "--bpb", str(corpus), "--out", str(precious)],
    ):
        _fails_with_one_line([*argv, "--force"], capsys, str(precious), "is a directory")
        assert _intact(precious)


def test_scaling_sweep_force_keeps_old_results_in_place_when_the_arguments_are_bad(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep"
    (out / "runs" / "a").mkdir(parents=True)
    (out / "sweep.json").write_text("{}")
    (out / "results.csv").write_text("name\na\n")
    argv = ["scaling", "sweep", "--base", str(tmp_path / "missing.toml"), "--budgets", "1e9",
            "--sizes", "1x32", "--out", str(out), "--force"]  # fmt: skip
    _fails_with_one_line(argv, capsys, "missing.toml")
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "runs", "sweep.json"]
