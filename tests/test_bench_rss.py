"""bench/_rss.py: the RSS trend a leak check reads (start, max, slope of the last third), and
its picture."""

from pathlib import Path

import pytest

from bench._rss import describe_trend, plot_rss, rss_trend, slope


def test_a_series_that_levels_off_has_a_flat_last_third_and_a_leak_does_not() -> None:
    pool = [(t, 500.0 + min(t, 100.0)) for t in range(0, 301, 5)]  # grows, then stops at t=100
    leak = [(t, 500.0 + 0.25 * t) for t in range(0, 301, 5)]  # 0.25 MiB/s all along
    bounded, leaking = rss_trend(pool), rss_trend(leak)
    assert (bounded.start_mib, bounded.max_mib, bounded.end_mib) == (500.0, 600.0, 600.0)
    assert bounded.tail_slope_mib_per_min == pytest.approx(0.0)
    assert leaking.tail_slope_mib_per_min == pytest.approx(15.0)
    assert "+15.00 MiB/min" in describe_trend(leaking)


def test_the_slope_is_least_squares_and_defined_for_short_series() -> None:
    assert slope([(0.0, 1.0), (1.0, 2.0), (2.0, 4.0)]) == pytest.approx(1.5)
    assert slope([(3.0, 7.0)]) == 0.0 and slope([(3.0, 7.0), (3.0, 9.0)]) == 0.0
    assert rss_trend([(0.0, 42.0)]).tail_slope_mib_per_min == 0.0
    with pytest.raises(ValueError, match="at least one sample"):
        rss_trend([])


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = plot_rss([(0.0, 500.0), (5.0, 510.0), (10.0, 511.0)], tmp_path / "rss.png", "t",
                   [(0.0, 0), (10.0, 64)])  # fmt: skip
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["rss.png"]  # no temporary file left
