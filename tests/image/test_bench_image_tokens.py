"""bench/image_tokens.py at its tiny size: both routes trained, sampled, scored, tabled, drawn."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest


def _bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "image_tokens.py"
    spec = importlib.util.spec_from_file_location("bench_image_tokens_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tiny_bench_runs_both_routes_side_by_side(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends the checkout
    bench = _bench()
    out = tmp_path / "record.json"
    bench.main(["--tiny", "--noisy", "--work", str(tmp_path / "w"), "--out", str(out)])
    text = capsys.readouterr().out
    assert (
        "| kiln DiT on latents (+VQ-VAE) |" in text and "| kiln Transformer on VQ codes |" in text
    )
    assert "tokens / DiT:" in text
    doc = json.loads(out.read_text())
    for side in ("dit", "tokens"):
        keys = {"object", "colour", "relation", "all", "frechet", "cpu_s", "sample_s", "steps"}
        assert keys <= doc[side].keys()
    assert doc["tokens"]["steps"] >= 1 and "measured" in doc
    assert Path(doc["grid"]).stat().st_size > 0
    with pytest.raises(SystemExit, match="holds runs of an earlier bench"):
        bench.main(["--tiny", "--noisy", "--work", str(tmp_path / "w")])
