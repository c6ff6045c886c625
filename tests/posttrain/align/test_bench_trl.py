"""bench/posttrain_trl.py in its tiny mode: kiln's and trl's GRPO and DPO train from the same
exported model, both are scored by the same chat-task evaluation, and the table compares them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="trl (a dev dependency) is the anchor")
BENCH = Path(__file__).resolve().parents[3] / "bench" / "posttrain_trl.py"


@pytest.mark.slow
def test_the_tiny_bench_runs_both_sides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("bench_posttrain_trl", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--tiny", "--noisy", "--out", str(tmp_path / "o"), "--steps", "1"]) == 0
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    for method in ("grpo", "dpo"):
        for side in ("kiln", "trl"):
            entry = doc[method][side]
            assert entry["n"] == doc["sft"]["n"] > 0 and entry["seconds"] > 0
            assert 0.0 <= entry["success"] <= 1.0
    assert (tmp_path / "o" / "trl-grpo" / "model.safetensors").is_file()
    out = capsys.readouterr().out
    assert "| grpo |" in out and "| dpo |" in out and "kiln ÷ trl time" in out
