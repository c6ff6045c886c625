"""bench/ladder.py and bench/arch_length.py in their tiny modes: every rung or cell is measured,
one table, one JSON, one plot (slow: they train small models)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ladder_tiny_mode_writes_every_rung_the_peer_line_and_the_plot(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "ladder.py"), "--tiny", "--noisy", "--budget",
           "2", "--cache", str(tmp_path / "c"), "--out-dir", str(tmp_path / "o"),
           "--only", "bigram,kn,mlp,hybrid,transformer-bytes"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((tmp_path / "o" / "ladder.json").read_text())
    rungs = {r["rung"]: r for r in doc["rungs"]}
    assert list(rungs) == ["bigram", "kn", "mlp", "hybrid", "transformer-bytes"]
    assert rungs["kn"]["valid_bpb"] < rungs["bigram"]["valid_bpb"]
    assert rungs["transformer-bytes"]["settings"]["tokenizer"] == "bytes"
    assert rungs["hybrid"]["settings"]["layer_pattern"] == "DDDA"
    assert doc["nltk_peer"]["max_abs_diff"] < 1e-12 and doc["noisy"]
    assert (tmp_path / "o" / "ladder.png").stat().st_size > 1000
    assert "| transformer-bytes |" in done.stdout and "kiln vs NLTK" in done.stdout


@pytest.mark.slow
def test_arch_length_tiny_mode_measures_every_kind_and_the_recall_task(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "arch_length.py"), "--tiny", "--noisy",
           "--out-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((tmp_path / "arch_length.json").read_text())
    assert set(doc["cost"]) == {"attention", "mamba2", "deltanet", "hybrid"}
    attn, mamba = doc["cost"]["attention"]["rows"], doc["cost"]["mamba2"]["rows"]
    assert [r["T"] for r in attn] == [64, 128]
    assert attn[1]["cache_KiB"] == 2 * attn[0]["cache_KiB"]  # KV grows with the prompt...
    assert mamba[1]["cache_KiB"] == mamba[0]["cache_KiB"]  # ...a recurrent state does not
    assert all(set(v["accuracy"]) == {"0", "8"} for v in doc["recall"].values())
    assert {r["what"] for r in doc["peer"]} == {"DeltaNet core (chunked, fwd+bwd)",
                                                "Mamba-2, 4 layers (fwd+bwd)"}  # fmt: skip
