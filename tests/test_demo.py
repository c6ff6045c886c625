"""`kiln demo` runs the whole path (tokenizer, shards, training, samples, report) end to end."""

from __future__ import annotations

import json
import math

from kiln.cli import main


def test_demo_end_to_end_quick(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    rc = main(["demo", "--out", str(out), "--steps", "2", "--vocab-size", "512",
               "--story-tokens", "16", "--set", "batch.global_tokens=4096",
               "--set", "batch.micro_batch=16", "--set", "eval.batches=2"])  # fmt: skip
    assert rc == 0
    for path in (
        "tokenizer.json",
        "data/manifest.json",
        "train/metrics.jsonl",
        "report/summary.json",
    ):
        assert (out / path).is_file(), path
    assert list((out / "train" / "checkpoints").glob("step_*"))
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert summary["steps"] == 2 and math.isfinite(summary["val_loss"])
    assert [s["text"].startswith(s["prompt"]) for s in summary["stories"]] == [True] * 3
    printed = capsys.readouterr().out
    assert "[5/5]" in printed and "validation loss" in printed and str(out) in printed


def test_demo_refuses_to_overwrite(tmp_path) -> None:
    out = tmp_path / "demo"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["demo", "--out", str(out)]) == 2
    assert (out / "keep.txt").read_text() == "mine"


def test_demo_trains_for_a_time_budget_and_says_its_dtype(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    rc = main(["demo", "--out", str(out), "--minutes", "0.01", "--vocab-size", "512",
               "--story-tokens", "8", "--set", "batch.global_tokens=4096",
               "--set", "batch.micro_batch=16", "--set", "eval.batches=1"])  # fmt: skip
    assert rc == 0
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert summary["time_budget_s"] == 0.6 and summary["steps"] >= 1
    assert summary["precision"]["requested"] == "auto"
    assert summary["precision"]["dtype"] in ("fp32", "bf16")
    printed = capsys.readouterr().out
    assert "0.0 min of training (steps planned as it goes)" in printed
    assert "dtype             dtype auto → " in printed


def test_demo_minutes_must_be_positive(tmp_path) -> None:
    assert main(["demo", "--out", str(tmp_path / "d"), "--minutes", "0"]) == 2


def test_demo_minutes_pick_the_recipe_made_for_the_nearest_budget() -> None:
    from kiln.demo import demo_recipe

    assert demo_recipe(None) == demo_recipe(10) == demo_recipe(0.01) == "demo.toml"
    assert demo_recipe(24) == "demo.toml" and demo_recipe(25) == "demo_60m.toml"
    assert demo_recipe(60) == demo_recipe(600) == "demo_60m.toml"


def test_demo_60_minutes_trains_the_one_hour_recipe(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    rc = main(["demo", "--out", str(out), "--minutes", "60", "--steps", "1", "--vocab-size",
               "512", "--story-tokens", "4", "--set", "eval.batches=1"])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "recipe kiln/assets/demo_60m.toml (made for 60 training minutes)" in printed
    config = (out / "train" / "config.toml").read_text()
    assert "n_embd = 512" in config and "mup_base_width = 256" in config
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert summary["steps"] == 1
