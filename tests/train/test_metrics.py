"""MFU and the device peak table; metrics.jsonl writing and truncation on resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.train.metrics import MetricsLog, device_peak_flops, mfu, peak_flops


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA GeForce RTX 3090", None),
        (None, None),
    ],
)
def test_peak_table(name: str | None, peak: float | None) -> None:
    assert peak_flops(name) == peak


def test_mfu_is_achieved_over_peak_and_none_without_a_peak() -> None:
    assert mfu(1000.0, 6 * 10**9, 989e12) == pytest.approx(6e12 / 989e12)
    assert mfu(1000.0, 6 * 10**9, 312e12, n_devices=8) == pytest.approx(6e12 / (8 * 312e12))
    assert mfu(1000.0, 6 * 10**9, None) is None
    assert device_peak_flops(torch.device("cpu")) is None


def test_metrics_log_writes_null_for_nonfinite_and_truncates(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "run" / "metrics.jsonl")
    for step in range(1, 6):
        log.write({"step": step, "loss": float("nan") if step == 2 else 1.0 / step})
    with log.path.open("a") as handle:
        handle.write('{"step": 6, "lo')  # a line torn by a crash
    log.truncate_after(3)
    records = log.read()
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["loss"] is None


def test_truncate_leaves_the_file_alone_unless_it_drops_something(tmp_path: Path) -> None:
    """A resume must never rewrite the history in place (a kill then would lose it)."""
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(1, 4):
        log.write({"step": step, "loss": 1.0})
    before = log.path.stat()
    log.truncate_after(3)  # nothing after step 3: not rewritten at all
    after = log.path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    log.truncate_after(2)  # a new file renamed over the old one, never the old one emptied
    assert log.path.stat().st_ino != before.st_ino
    assert [r["step"] for r in log.read()] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("line", ["[]", '"x"', "42", "null", '{"step": "three"}'])
def test_a_line_that_is_not_a_record_is_dropped_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str
) -> None:
    """Valid JSON but not a metrics object: a resume drops it with a warning, never crashes."""
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1, "loss": 1.0})
    with log.path.open("a") as handle:
        handle.write(line + "\n")
    log.write({"step": 2, "loss": 0.5})
    log.truncate_after(5)
    assert [r["step"] for r in log.read()] == [1, 2]
    err = capsys.readouterr().err
    assert f"{log.path}:2: not a record" in err and err.count("\n") == 1
    log.truncate_after(5)  # dropped for good: no second warning
    assert capsys.readouterr().err == ""


def test_read_skips_lines_that_are_not_objects(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text('{"step": 1}\n[]\n"x"\n{"step": 2}\n{"step": 3, "te')
    assert [r["step"] for r in MetricsLog(path).read()] == [1, 2]
