"""train.dtype in the trainer: auto resolved once and recorded; resume keeps the checkpoint's dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln import devices
from kiln.train.trainer import Trainer

from .conftest import MakeConfig


def _machine(monkeypatch: pytest.MonkeyPatch, flags: set[str], probe: float) -> None:
    """Pretend to be a CPU with these flags whose bf16 probe measures `probe` (bf16 ÷ fp32 time)."""
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(devices, "bf16_probe_ratio", lambda: probe)


def test_auto_is_resolved_once_said_and_recorded_in_the_run(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _machine(monkeypatch, {"avx2"}, 30.0)
    cfg = make_config("train.dtype=auto", "train.max_steps=2", "eval.every=0")
    trainer = Trainer(cfg, cfg.logging.run_dir)
    assert trainer.precision.name == "fp32"
    with trainer.autocast():
        assert not torch.is_autocast_enabled("cpu")
    trainer.run()
    out = capsys.readouterr().out
    assert out.count("dtype auto → fp32: this CPU has no native bf16") == 1
    run = Path(cfg.logging.run_dir)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["precision"]["dtype"] == "fp32"
    assert records[0]["precision"]["requested"] == "auto"
    assert "precision" not in records[1]  # once per run, not per record
    state = json.loads((run / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["precision"]["dtype"] == "fp32" and state["config"]["train"]["dtype"] == "auto"
    toml = (run / "config.toml").read_text()
    assert "# dtype auto → fp32: this CPU has no native bf16" in toml and 'dtype = "auto"' in toml


def test_auto_picks_bf16_autocast_where_the_cpu_has_it(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    _machine(monkeypatch, {"amx_bf16"}, 0.5)
    cfg = make_config("train.dtype=auto", "train.max_steps=1", "eval.batches=0")
    trainer = Trainer(cfg, cfg.logging.run_dir)
    assert trainer.precision.name == "bf16" and trainer.precision.warning is None
    with trainer.autocast():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_explicit_bf16_on_an_emulating_cpu_runs_and_warns_once(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _machine(monkeypatch, {"avx2"}, 31.0)
    cfg = make_config("train.dtype=bf16", "train.max_steps=2", "eval.every=0")
    result = Trainer(cfg, cfg.logging.run_dir).run()
    assert result.step == 2
    out = capsys.readouterr().out
    assert out.count("warning: dtype bf16 on a CPU without native bf16") == 1
    assert "31.0x slower than fp32" in out


def test_a_resumed_auto_run_keeps_its_checkpoints_dtype_on_another_machine(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _machine(monkeypatch, {"amx_bf16"}, 0.5)  # saved on a CPU with native bf16
    cfg = make_config("train.dtype=auto", "train.max_steps=2", "eval.every=0")
    Trainer(cfg, cfg.logging.run_dir).run()
    _machine(monkeypatch, {"avx2"}, 30.0)  # resumed on one without
    longer = make_config("train.dtype=auto", "train.max_steps=3", "eval.every=0")
    resumed = Trainer(longer, longer.logging.run_dir, resume=True)
    assert resumed.precision.name == "bf16"
    out = capsys.readouterr().out
    assert "dtype auto → bf16: kept from step_2" in out and "train.dtype=fp32 to switch" in out
    assert "30.0x slower" in out  # and it says what keeping it costs here
    assert resumed.run().step == 3
    # Asking for fp32 explicitly switches (the change is reported like any other).
    fp32 = make_config("train.dtype=fp32", "train.max_steps=4", "eval.every=0")
    switched = Trainer(fp32, fp32.logging.run_dir, resume=True)
    assert switched.precision.name == "fp32"
    assert "train.dtype: 'auto' -> 'fp32'" in switched.notes


def test_a_checkpoint_from_before_dtype_auto_keeps_the_dtype_its_config_names(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config("train.dtype=fp32", "train.max_steps=2", "eval.every=0")
    Trainer(cfg, cfg.logging.run_dir).run()
    state_file = Path(cfg.logging.run_dir) / "checkpoints" / "step_2" / "state.json"
    state = json.loads(state_file.read_text())
    del state["precision"]  # as written before train.dtype had "auto"
    state_file.write_text(json.dumps(state))
    _machine(monkeypatch, {"amx_bf16"}, 0.5)  # this machine alone would pick bf16
    auto = make_config("train.dtype=auto", "train.max_steps=3", "eval.every=0")
    assert Trainer(auto, auto.logging.run_dir, resume=True).precision.name == "fp32"
