"""`kiln scaling`: sweep planning, a tiny IsoFLOP sweep trained end to end, fit, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.errors import KilnError
from kiln.model import ModelConfig
from kiln.scaling.sweep import SweepRun, plan_sweep, read_results, run_name
from kiln.train.config import load_train_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_plan_sweep_rounds_tokens_to_whole_steps_of_6nd() -> None:
    base = load_train_config(CONFIGS / "tiny.toml", ["data.dataset=unused"])
    runs, notes = plan_sweep(base, 300, [1e9, 3e9], [(1, 16), (2, 32), (8, 128)], min_steps=5)
    by_name = {r.name: (r, cfg) for r, cfg in runs}
    run, cfg = by_name[run_name(3e9, 2, 32)]
    model = cfg.model_config(300)
    assert (model.n_layer, model.n_embd, model.n_head, model.kv_heads) == (2, 32, 2, 1)
    assert run.params == model.num_params()
    assert run.steps == round(3e9 / (6 * run.params) / 256)
    assert run.tokens == run.steps * 256 == cfg.train.max_steps * cfg.batch.global_tokens
    assert run.flops_6nd == 6 * run.params * run.tokens
    assert run.flops_exact == model.flops_per_token(32) * run.tokens
    assert cfg.eval.every == 0 and cfg.eval.sample_tokens == 0
    assert any("8x128 at 1e+09 FLOPs" in n and "left out" in n for n in notes)
    assert run_name(3e9, 2, 32) == "c3.0e9_2x32"


def test_tiny_isoflop_sweep_end_to_end(tiny_dataset: Path, tmp_path: Path, capsys) -> None:
    out, fit_dir = tmp_path / "sweep", tmp_path / "fit"
    args = [
        "scaling", "sweep", "--base", str(CONFIGS / "tiny.toml"),
        "--set", f"data.dataset={tiny_dataset}", "--set", "eval.batches=1",
        "--budgets", "2e8,4e8", "--sizes", "1x16,1x32,2x32", "--min-steps", "3",
        "--out", str(out), "--run", "--no-progress",
    ]  # fmt: skip
    assert main(args) == 0
    rows = read_results(out / "results.csv")
    assert len(rows) == 6
    for row in rows:
        run = SweepRun(**{k: row[k] for k in SweepRun.__dataclass_fields__ if k != "name"},
                       name=row["name"])  # fmt: skip
        records = [json.loads(line) for line in
                   (out / "runs" / run.name / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
        assert records[-1]["step"] == run.steps and records[-1]["tokens"] == run.tokens
        assert records[-1]["val_loss"] == pytest.approx(row["loss"], rel=1e-6)
        assert row["loss_kind"] == "val"
    # Each shape trained on twice the compute (twice the steps) reaches a lower loss.
    loss = {row["name"]: row["loss"] for row in rows}
    for shape in ("1x16", "1x32", "2x32"):
        assert loss[f"c4.0e8_{shape}"] < loss[f"c2.0e8_{shape}"]
    # Running again trains nothing: every run has its row.
    before = (out / "results.csv").read_text()
    assert main(["scaling", "run", str(out), "--no-progress"]) == 0
    assert (out / "results.csv").read_text() == before

    assert main(["scaling", "fit", str(out), "--out", str(fit_dir), "--starts", "2"]) == 0
    fit = json.loads((fit_dir / "fit.json").read_text())
    assert [p["budget"] for p in fit["isoflop"]] == [2e8, 4e8]
    for name in ("isoflop.png", "frontier.png", "predicted.png"):
        assert (fit_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "budget 2e+08: 3 runs" in printed
    capsys.readouterr()
    assert main(["scaling", "fit", str(out), "--out", str(fit_dir)]) == 2  # no --force
    assert "already exists" in capsys.readouterr().err
    # A folder holding only a previous fit's figure is refused too: figures are results.
    (fit_dir / "fit.json").unlink()
    figure = (fit_dir / "isoflop.png").read_bytes()
    assert main(["scaling", "fit", str(out), "--out", str(fit_dir)]) == 2
    assert "isoflop.png already exists" in capsys.readouterr().err
    assert (fit_dir / "isoflop.png").read_bytes() == figure
    # Rewriting the sweep sets the old results and runs aside instead of reusing them.
    assert main([*args[:-2], "--no-progress", "--force"]) == 0
    assert not (out / "results.csv").exists() and not (out / "runs").exists()
    (aside,) = out.glob("replaced-*")
    assert (aside / "results.csv").read_text() == before


def test_account_json_matches_the_config(capsys) -> None:
    assert main(["scaling", "account", "gpt2-124m", "--seq-len", "1024", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cfg = ModelConfig.preset("gpt2-124m")
    assert report["params"]["total"] == cfg.num_params() == 124_439_808
    assert report["flops_per_token"]["total"] == cfg.flops_per_token(1024)
    assert report["memory_bytes"]["fp32"]["optimizer"] == 8 * cfg.num_params() + 4 * 148


def test_account_reads_a_train_config(tiny_dataset: Path, tmp_path: Path, capsys) -> None:
    text = (CONFIGS / "tiny.toml").read_text().replace('"data/tiny"', json.dumps(str(tiny_dataset)))
    config = tmp_path / "run.toml"
    config.write_text(text)
    assert main(["scaling", "account", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["seq_len"], report["micro_batch"]) == (32, 4)
    expected = ModelConfig.preset("tiny", block_size=64, vocab_size=300).num_params()
    assert report["params"]["total"] == expected


def test_plan_prints_the_allocation(capsys) -> None:
    assert main(["scaling", "plan", "--flops", "1e21", "--law", "20x", "--gpu", "h100",
                 "--n", "8", "--usd-per-gpu-hour", "2"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "parameters   N = 2.89e+09" in printed  # sqrt(1e21 / 120)
    assert "tokens       D = 5.77e+10 (20.0 per parameter)" in printed
    assert "cost" in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["scaling", "account", "nonsense"], "nonsense: neither a preset"),
        (["scaling", "plan", "--flops", "1e21", "--gpu", "tpu"], "unknown GPU 'tpu'"),
        (["scaling", "plan", "--flops", "-5"], "flops must be a positive number"),
        (["scaling", "sweep", "--base", "x.toml", "--budgets", "1e9", "--sizes", "4by128",
          "--out", "o"], "model size '4by128': expected N_LAYERxN_EMBD"),
        (["scaling", "sweep", "--base", "x.toml", "--budgets", "1e9,abc", "--sizes", "1x16",
          "--out", "o"], "--budgets: expected comma-separated numbers"),
        (["scaling", "run", "nowhere"], "no sweep here"),
        (["scaling", "account", str(CONFIGS / "tiny.toml")], "model.vocab_size is unset"),
        (["scaling", "fit", "missing.csv", "--out", "fit"], "cannot read results"),
    ],
)  # fmt: skip
def test_errors_are_one_line(argv: list[str], message: str, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_sweep_notes_runs_that_repeat_data(tiny_dataset: Path, tmp_path: Path) -> None:
    from kiln.scaling.sweep import write_sweep

    runs, notes = write_sweep(
        tmp_path / "s", CONFIGS / "tiny.toml", [3e9], [(1, 16)], [f"data.dataset={tiny_dataset}"]
    )
    assert len(runs) == 1 and runs[0].tokens > 40_000  # the train split has ~25k tokens
    assert any("data repeats" in n and runs[0].name in n for n in notes)
    with pytest.raises(KilnError, match=r"sweep\.json already exists; pass --force"):
        write_sweep(tmp_path / "s", CONFIGS / "tiny.toml", [3e9], [(1, 16)],
                    [f"data.dataset={tiny_dataset}"])  # fmt: skip
