"""Learning-rate schedules at the steps that define them, and the --plot-schedule picture."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from kiln.train.config import ScheduleConfig
from kiln.train.schedule import (
    lr_multiplier,
    plot_schedule,
    warmup_cosine,
    warmup_stable_decay,
)


def test_warmup_cosine_key_steps() -> None:
    f = lambda s: warmup_cosine(s, max_steps=110, warmup_steps=10, min_ratio=0.1)  # noqa: E731
    assert f(0) == pytest.approx(0.1)  # the first update already moves
    assert f(4) == pytest.approx(0.5)
    assert f(9) == 1.0  # end of warmup
    assert f(10) == 1.0  # cosine starts at the peak
    assert f(10 + 99 // 2) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 49 / 99)))
    assert f(109) == pytest.approx(0.1)  # the last step is at the floor
    assert f(500) == pytest.approx(0.1)  # beyond the end stays at the floor
    values = [f(s) for s in range(10, 110)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_warmup_stable_decay_key_steps() -> None:
    f = lambda s: warmup_stable_decay(s, 100, 10, decay_fraction=0.2, min_ratio=0.0)  # noqa: E731
    assert f(0) == pytest.approx(0.1)
    assert f(9) == 1.0
    assert f(10) == f(50) == f(79) == 1.0  # the plateau
    assert f(80) == 1.0  # decay starts at the plateau value
    assert f(99) == pytest.approx(0.0)  # and ends at the floor
    assert f(80 + 19 // 2) == pytest.approx(1 - 9 / 19)


def test_no_warmup_and_no_decay() -> None:
    assert warmup_cosine(0, 10, 0, 0.5) == 1.0
    assert warmup_stable_decay(9, 10, 0, 0.0, 0.5) == 1.0


def test_lr_multiplier_dispatches_on_the_config() -> None:
    cos = ScheduleConfig(name="warmup_cosine", warmup_steps=2, min_lr_ratio=0.2)
    wsd = ScheduleConfig(name="wsd", warmup_steps=2, decay_fraction=0.5, min_lr_ratio=0.2)
    assert lr_multiplier(cos, 9, 10) == pytest.approx(0.2)
    assert lr_multiplier(wsd, 4, 10) == 1.0
    assert lr_multiplier(wsd, 9, 10) == pytest.approx(0.2)


def test_plot_schedule_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = plot_schedule(ScheduleConfig(name="wsd"), 200, 3e-4, tmp_path / "r" / "lr.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
