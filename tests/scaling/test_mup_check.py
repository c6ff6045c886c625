"""µP's coordinate check: flat activations across widths under µP, growing ones under SP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.scaling.mup_check import coord_check


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_activations_stay_flat_under_mup_and_grow_under_sp(optimizer: str) -> None:
    widths = [32, 64, 128]
    sp = coord_check(widths, "sp", steps=3, lr=0.02, optimizer=optimizer).slopes()
    mup = coord_check(widths, "mup", steps=3, lr=0.02, optimizer=optimizer).slopes()
    stream = [k for k in mup if k.startswith(("embedding", "block", "logits"))]
    assert max(abs(mup[k]) for k in stream) < 0.4, mup  # the residual stream and the logits
    hidden = [k for k in sp if k.startswith(("attn", "mlp"))]
    assert min(sp[k] for k in hidden) > 0.5, sp  # SP's hidden activations grow with width
    assert all(sp[k] > mup[k] + 0.4 for k in hidden)


def test_cli_prints_slopes_and_writes_the_plot(tmp_path: Path, capsys) -> None:
    png = tmp_path / "coord.png"
    args = ["scaling", "mup-check", "--widths", "16,32", "--steps", "2", "--layers", "1"]
    assert main([*args, "--plot", str(png), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.split("plot:")[0])
    assert doc["mup"]["widths"] == [16, 32] and set(doc["sp"]["slopes"]) >= {"logits", "mlp 0"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*args, "--plot", str(png)]) == 2  # refuses to clobber without --force
    assert "already exists" in capsys.readouterr().err
    assert main(["scaling", "mup-check", "--widths", "16"]) == 2
    assert "two or more multiples of 4" in capsys.readouterr().err


def test_account_reads_depth_presets(capsys) -> None:
    assert main(["scaling", "account", "depth-6-mup"]) == 0
    assert "6 layers, width 384, 6 heads" in capsys.readouterr().out
