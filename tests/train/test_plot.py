"""`kiln plot RUN`: PNG curves and a self-contained HTML report under RUN/report/."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import torch

from kiln.cli import main
from kiln.train.config import load_train_config
from kiln.train.report import final_metrics, plot_losses
from kiln.train.trainer import Trainer

from .conftest import CONFIGS

PNGS = ("loss.png", "lr.png", "grad_norm.png", "throughput.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step tiny run with validation at steps 2 and 4."""
    run = tmp_path_factory.mktemp("plot") / "run"
    cfg = load_train_config(
        CONFIGS / "tiny.toml",
        [f"data.dataset={tiny_dataset}", f"logging.run_dir={run}", "logging.progress=false",
         "train.max_steps=4", "eval.every=2"],
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(cfg, run).run()
    finally:
        torch.set_num_threads(threads)
    return run


def test_plot_writes_the_curves_and_a_self_contained_report(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plot", str(run)]) == 0
    report = run / "report"
    assert f"{report / 'index.html'}" in capsys.readouterr().out
    for name in PNGS:
        assert (report / name).read_bytes()[:8] == PNG_MAGIC, name
    assert sorted(p.name for p in report.iterdir()) == sorted([*PNGS, "index.html"])

    page = (report / "index.html").read_text(encoding="utf-8")
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == len(PNGS)
    assert all(base64.b64decode(img)[:8] == PNG_MAGIC for img in images)
    assert 'src="http' not in page and "<script" not in page  # nothing fetched from elsewhere
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2
    assert f"<tr><th>validation loss</th><td>{val[-1]:.4f} (step 4)</td></tr>" in page
    assert f"<tr><th>train loss</th><td>{records[-1]['loss']:.4f}</td></tr>" in page
    assert "<tr><th>MFU (last)</th><td>n/a</td></tr>" in page  # CPU: no peak, no number
    assert "seq_len = 32" in page and "vocab_size = 300" in page  # the resolved config


def test_the_report_embeds_the_schedule_plot_when_there_is_one(run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    copy.mkdir()
    (copy / "metrics.jsonl").write_bytes((run / "metrics.jsonl").read_bytes())
    plot_losses(copy / "metrics.jsonl", copy / "report" / "lr_schedule.png")  # any PNG will do
    assert main(["plot", str(copy)]) == 0
    page = (copy / "report" / "index.html").read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == len(PNGS) + 1
    assert "config.toml not found" in page


def test_plot_losses_still_writes_the_demo_curve(run: Path, tmp_path: Path) -> None:
    out = plot_losses(run / "metrics.jsonl", tmp_path / "report" / "loss.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_a_run_without_metrics_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}: no such run directory" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'metrics.jsonl'}: not found, so nothing to plot" in err
    (tmp_path / "metrics.jsonl").write_text("\n")
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics records yet" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()


def test_final_metrics_table() -> None:
    records = [
        {"step": 1, "tokens": 100, "loss": 5.0, "lr": 1e-3, "grad_norm": 2.0,
         "tokens_per_s": 900.0, "mfu": 0.10},
        {"step": 2, "tokens": 200, "loss": 4.5, "lr": 9e-4, "grad_norm": 1.5,
         "tokens_per_s": 1000.0, "mfu": 0.12, "val_loss": 4.75},
        {"step": 3, "tokens": 300, "loss": 4.0, "lr": 8e-4, "grad_norm": None,
         "tokens_per_s": 1100.0, "mfu": 0.125, "skipped_steps": 1},
    ]  # fmt: skip
    rows = dict(final_metrics(records))
    assert rows == {
        "step": "3",
        "tokens seen": "300",
        "train loss": "4.0000",
        "validation loss": "4.7500 (step 2)",
        "learning rate": "0.0008",
        "gradient norm": "n/a",
        "tokens/s (last)": "1,100",
        "tokens/s (median)": "1,000",
        "MFU (last)": "12.5%",
        "skipped steps": "1",
    }


def test_final_metrics_show_the_dtype_chosen_and_the_training_time() -> None:
    precision = {"dtype": "fp32", "requested": "auto", "reason": "no native bf16"}
    records = [
        {"step": 1, "tokens": 100, "loss": 5.0, "precision": precision, "train_s": 1.25},
        {"step": 2, "tokens": 200, "loss": 4.5, "train_s": 2.5},
    ]
    rows = dict(final_metrics(records))
    assert rows["precision"] == "fp32 (no native bf16)"
    assert rows["training time"] == "2.5 s (evaluation excluded)"
