"""`kiln export RUN --hf DIR`: transformers loads the export offline, with kiln's logits and ids."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.cli import main
from kiln.loading import load_checkpoint_model
from kiln.model.transformer import Transformer
from kiln.tokenizer import Tokenizer
from kiln.train.config import load_train_config
from kiln.train.export import remove_abandoned_exports
from kiln.train.trainer import Trainer
from tests.fixtures import EOT, dead_pid

from .conftest import CONFIGS, MakeConfig

TEXTS = (
    "Once upon a time, there was a little girl named Lily.",
    'Tom said: "Let\'s go!"<|endoftext|>  The end. 123 café ☀\n\nNext',
)


@pytest.fixture(scope="module")
def trained(
    tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Transformer]:
    """A 4-step tiny Llama-style run with checkpoints at steps 2 and 4, and its trained model."""
    run = tmp_path_factory.mktemp("export") / "run"
    cfg = load_train_config(
        CONFIGS / "tiny.toml",
        [f"data.dataset={tiny_dataset}", f"logging.run_dir={run}", "logging.progress=false",
         "train.max_steps=4", "checkpoint.every=2", "eval.every=2"],
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(cfg, run)
        trainer.run()
    finally:
        torch.set_num_threads(threads)
    return run, trainer.model.eval()


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network for transformers: everything must come from the exported directory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _kiln_tokenizer(tiny_dataset: Path) -> Tokenizer:
    return Tokenizer.load(tiny_dataset.parent / "tok.json")


def test_transformers_loads_the_export_with_kiln_logits_and_token_ids(
    trained: tuple[Path, Transformer], tiny_dataset: Path, tmp_path: Path, offline: None,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    transformers = pytest.importorskip("transformers")
    run, model = trained
    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    assert "step 4 (1,024 tokens)" in capsys.readouterr().out
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    tok = _kiln_tokenizer(tiny_dataset)

    assert isinstance(hf_tok, transformers.PreTrainedTokenizerFast)
    assert hf_tok.eos_token == EOT
    assert hf_tok.eos_token_id == hf_model.config.eos_token_id == tok.special_tokens[EOT]
    for text in TEXTS:
        ids = tok.encode(text, allowed_special="all")
        assert hf_tok(text)["input_ids"] == ids
        assert hf_tok.decode(ids) == text
        x = torch.tensor([ids])
        with torch.no_grad():
            expected = model(x)  # (1, T, vocab_size)
            got = hf_model(x).logits
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert json.loads((out / "kiln_export.json").read_text())["step"] == 4


def test_checkpoint_loads_into_a_fresh_model_with_the_trained_weights(
    trained: tuple[Path, Transformer],
) -> None:
    run, model = trained
    loaded = load_checkpoint_model(run / "checkpoints" / "step_4")
    assert loaded.cfg == model.cfg
    for (name, a), (_, b) in zip(
        loaded.state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert loaded.lm_head.weight is loaded.wte.weight  # the tied head stays tied


def test_export_refuses_an_existing_directory_unless_forced(
    trained: tuple[Path, Transformer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = trained
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(run), "--hf", str(out)]) == 2
    assert "already exists and is not empty; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    # --force replaces only a folder kiln export wrote, never a user's directory.
    assert main(["export", str(run), "--hf", str(out), "--force"]) == 2
    assert "is not a kiln export" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"

    (out / "keep.txt").unlink()
    assert main(["export", str(run), "--hf", str(out), "--step", "4"]) == 0  # empty: fine
    assert main(["export", str(run), "--hf", str(out), "--step", "2", "--force"]) == 0
    assert json.loads((out / "kiln_export.json").read_text())["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left behind


def test_export_removes_what_a_killed_export_left(
    trained: tuple[Path, Transformer], tmp_path: Path, live_pid: int
) -> None:
    run, _ = trained
    dead = dead_pid()  # a process that has exited: its leftovers are abandoned
    ours = os.getpid()  # a dead predecessor that had our PID (PIDs repeat in containers)
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    for name in (f".hf.tmp-{dead}", f".hf.old-{ours}", f".hf.tmp-{ours}x", f".hf.tmp-{live_pid}"):
        (tmp_path / name).mkdir()
    assert main(["export", str(run), "--hf", str(tmp_path / "hf"), "--force"]) == 0
    # A live process's export may still be running; a non-numeric suffix is not ours.
    kept = sorted([f".hf.tmp-{ours}x", f".hf.tmp-{live_pid}", "hf"])
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
    # Our own PID on a temp folder, seen before this export has written anything: a dead
    # predecessor's (an export reusing the name would replace it; one refused would not).
    (tmp_path / f".hf.tmp-{ours}").mkdir()
    assert remove_abandoned_exports(tmp_path / "hf") == [tmp_path / f".hf.tmp-{ours}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == kept


def test_a_previous_export_moved_aside_by_a_killed_export_is_restored(
    trained: tuple[Path, Transformer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed inside the swap, between moving the old export aside and renaming the new one in:
    the next export puts the old one back (and needs --force to replace it, as ever)."""
    run, _ = trained
    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", str(out), "--step", "4"]) == 0
    out.rename(tmp_path / f".hf.old-{dead_pid()}")
    (tmp_path / f".hf.tmp-{dead_pid()}").mkdir()  # the new one, never renamed in
    assert main(["export", str(run), "--hf", str(out), "--step", "2"]) == 2
    assert "already exists and is not empty; pass --force" in capsys.readouterr().err
    assert json.loads((out / "kiln_export.json").read_text())["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    # Killed after the new one was renamed in: the old one is only deleted.
    (tmp_path / f".hf.old-{dead_pid()}").mkdir()
    assert main(["export", str(run), "--hf", str(out), "--step", "2", "--force"]) == 0
    assert json.loads((out / "kiln_export.json").read_text())["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_export_of_a_missing_step_names_the_saved_ones(
    trained: tuple[Path, Transformer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = trained
    assert main(["export", str(run), "--hf", str(tmp_path / "hf"), "--step", "3"]) == 2
    assert "no checkpoint of step 3 (steps saved: 2, 4)" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--hf", str(tmp_path / "hf")]) == 2
    assert "not a model folder" in capsys.readouterr().err
    (tmp_path / "checkpoints").mkdir()  # a run that has not saved one yet
    assert main(["export", str(tmp_path), "--hf", str(tmp_path / "hf")]) == 2
    assert "no checkpoints yet" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def _copy_run(run: Path, to: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the run's last checkpoint with its state.json edited."""
    shutil.copytree(run / "checkpoints" / "step_4", to / "checkpoints" / "step_4")
    state_file = to / "checkpoints" / "step_4" / "state.json"
    state = json.loads(state_file.read_text())
    edit(state)
    state_file.write_text(json.dumps(state))
    return to


def test_export_without_the_dataset_needs_tokenizer(
    trained: tuple[Path, Transformer], tiny_dataset: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    def move_dataset(state: dict[str, Any]) -> None:
        state["config"]["data"]["dataset"] = str(tmp_path / "gone")

    moved = _copy_run(trained[0], tmp_path / "moved", move_dataset)
    out = tmp_path / "hf"
    assert main(["export", str(moved), "--hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"no manifest.json in {tmp_path / 'gone'}" in err and "pass --tokenizer PATH" in err
    tok = str(tiny_dataset.parent / "tok.json")
    assert main(["export", str(moved), "--hf", str(out), "--tokenizer", tok]) == 0
    assert (out / "tokenizer.json").is_file()


def test_export_refuses_a_tokenizer_the_run_was_not_trained_with(
    trained: tuple[Path, Transformer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def other_tokenizer(state: dict[str, Any]) -> None:
        state["dataset"]["tokenizer_sha256"] = "0" * 64

    other = _copy_run(trained[0], tmp_path / "other", other_tokenizer)
    assert main(["export", str(other), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "differs from the tokenizer" in err and "was encoded with (000000000000…" in err
    assert not (tmp_path / "hf").exists()


def test_sample_runs_on_the_export(
    trained: tuple[Path, Transformer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = trained
    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    capsys.readouterr()
    argv = ["sample", str(out), "--prompt", "Once upon a time", "--max-tokens", "8", "--seed", "0"]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("Once upon a time")


def test_a_model_hf_cannot_express_is_refused_by_name(
    make_config: MakeConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = make_config("train.max_steps=1", "eval.batches=0", "model.qk_norm=true")
    Trainer(cfg, cfg.logging.run_dir).run()
    assert main(["export", cfg.logging.run_dir, "--hf", str(tmp_path / "hf")]) == 2
    assert "no HF GPT-2/Llama equivalent for qk_norm" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
