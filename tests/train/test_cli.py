"""`kiln train`: arguments, the printed summary, --plot-schedule, --resume, one-line errors."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.config import ConfigError, to_toml
from kiln.errors import KilnError
from kiln.train.cli import register

from .conftest import CONFIGS


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kiln")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["train", *argv])


def _run(*argv: str) -> int:
    args = _parse(*argv)
    return int(args.handler(args))


def test_train_then_resume_from_the_command_line(
    tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [
        str(CONFIGS / "tiny.toml"), "--no-progress",
        "--set", f"data.dataset={tiny_dataset}",
        "--set", f"logging.run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    assert _run(*common, "--set", "train.max_steps=2") == 0
    out = capsys.readouterr().out
    assert "tokens per step = 2 × 4 × 32" in out and "step 2 (512 tokens)" in out
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "state.json").is_file()
    assert _run(*common, "--set", "train.max_steps=3", "--resume") == 0
    out = capsys.readouterr().out
    assert "resuming at step 2" in out and "train.max_steps: 2 -> 3" in out
    assert "step 3 (768 tokens)" in out


def test_train_for_a_time_budget_from_the_command_line(
    tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        str(CONFIGS / "tiny.toml"), "--no-progress",
        "--set", f"data.dataset={tiny_dataset}", "--set", f"logging.run_dir={tmp_path / 'run'}",
        "--set", "train.time_budget=0.5s", "--set", "train.max_steps=none",
        "--set", "eval.every=0", "--set", "checkpoint.every=0",
    ]  # fmt: skip
    assert _run(*argv) == 0
    out = capsys.readouterr().out
    assert "a time budget of 0.5 s of training; run in" in out
    assert "(evaluation, sampling and checkpoints are not counted)" in out
    assert "kiln train: dtype fp32: asked for" in out
    # Resuming the finished budgeted run: nothing to do, said in the budget's terms.
    assert _run(*argv, "--resume") == 0
    out = capsys.readouterr().out
    assert "nothing to do (the time budget's plan of" in out and "of 0.5 s trained" in out


def test_plot_schedule_writes_a_png_in_the_run_report(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = tmp_path / "r"
    argv = [
        str(CONFIGS.parent / "kiln" / "assets" / "demo.toml"),
        "--plot-schedule",
        "--set",
        f"logging.run_dir={run}",
    ]
    # demo.toml trains for a time budget: its steps are planned while it trains.
    with pytest.raises(KilnError, match=r"--plot-schedule needs train\.max_steps"):
        _run(*argv)
    assert _run(*argv, "--set", "train.max_steps=250") == 0
    assert (run / "report" / "lr_schedule.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_override_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"--set optim\.lr='fast': optim\.lr = 'fast': expected float"
    ):
        _run(str(CONFIGS / "tiny.toml"), "--set", "optim.lr='fast'")
    with pytest.raises(ConfigError, match=r"--set optim\.lrr=1: unknown config key optim\.lrr"):
        _run(str(CONFIGS / "tiny.toml"), "--set", "optim.lrr=1")


@pytest.mark.parametrize(
    ("key", "text"),
    [("lr", "inf"), ("weight_decay", "inf"), ("lr", "nan"), ("eps", "-inf")],
)
def test_non_finite_float_in_the_config_is_one_clear_line(
    key: str, text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # lr = inf used to be accepted and the run died at step 2; now loading refuses it.
    data = tomllib.loads((CONFIGS / "tiny.toml").read_text())
    data["optim"][key] = float(text)
    config = tmp_path / "bad.toml"
    config.write_text(to_toml(data))
    assert f"{key} = {text}" in config.read_text()
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kiln: error: {config}: optim.{key} = {text}: expected a finite number"]
    assert main(["train", str(CONFIGS / "tiny.toml"), "--set", f"optim.{key}={text}"]) == 2
    assert f"optim.{key} = {text}: expected a finite number" in capsys.readouterr().err


def test_the_continue_hint_after_a_signal_repeats_the_torchrun_launch() -> None:
    """Stopped by SIGTERM under torchrun, the printed hint must relaunch with torchrun too (a
    bare `kiln train --resume` would resume on one process)."""
    from kiln.train.cli import continue_command

    argv = ["my.toml", "--set", "optim.lr=1e-3", "--resume"]
    assert continue_command("train", argv, env={}) == ["kiln", "train", *argv]
    single_node = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "8"}
    assert continue_command("train", argv, env=single_node) == [
        "torchrun", "--nproc-per-node", "8", "-m", "kiln.cli", "train", *argv,
    ]  # fmt: skip
    four_nodes = {"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "32"}
    assert continue_command("sft", argv, env=four_nodes)[:6] == [
        "torchrun", "--nproc-per-node", "8", "--nnodes", "4", "-m",
    ]  # fmt: skip


def test_a_run_that_stops_on_a_corrupt_shard_leaves_no_folder_behind(
    tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out-of-vocabulary ids found while training (verification off): the run folder the start
    made (a .lock and config.toml, nothing of the run) goes; a folder that was there stays."""
    import shutil

    from kiln.data.shard_format import HEADER_BYTES

    dataset = tmp_path / "ds"
    shutil.copytree(tiny_dataset, dataset)
    shard = dataset / "train_000000.bin"
    data = bytearray(shard.read_bytes())
    data[HEADER_BYTES:] = b"\xff" * (len(data) - HEADER_BYTES)  # every id 65535
    shard.write_bytes(bytes(data))
    monkeypatch.setenv("KILN_VERIFY_SHARDS", "0")
    run = tmp_path / "run"
    argv = [
        "train",
        str(CONFIGS / "tiny.toml"),
        "--no-progress",
        "--set",
        f"data.dataset={dataset}",
    ]
    argv += ["--set", f"logging.run_dir={run}", "--set", "eval.batches=0"]
    argv += ["--set", "eval.sample_tokens=0", "--set", "train.max_steps=2"]
    assert main(argv) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    assert main(argv) == 2
    assert (run / "notes.txt").read_text() == "mine"
