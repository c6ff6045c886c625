"""bench/data_synth.py at its tiny size: every step runs (teacher, synth, two pipelines, two
students, bpb on real valid) and the table and ratio are printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import require_shared

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_the_tiny_bench_compares_both_arms_at_equal_tokens(tmp_path: Path) -> None:
    require_shared(ROOT.parent / "shared" / "data" / "tinystories")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "data_synth.py"), str(tmp_path), "--tiny",
         "--noisy"], env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(x) for x in done.stdout.splitlines() if x.startswith('{"arm"')]
    assert [r["arm"] for r in rows] == ["real only", "real + synthetic"]
    assert rows[0]["train_tokens"] == rows[1]["train_tokens"]  # equal tokens
    assert set(rows[1]["dataset_tokens"]) == {"real", "synth"}
    assert all(r["bpb_real_valid"] > 0 for r in rows)
    assert "ratio real+synthetic / real only:" in done.stdout
    assert (tmp_path / "synth" / "documents.jsonl").is_file()
