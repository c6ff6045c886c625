"""A process's resident memory sampled over a benchmark, its trend and its picture.

`RssSampler(pid, every_s)` reads the process's RSS in a background thread every `every_s`
seconds from `start()` to `stop()`; `rss_trend` sums a series up as a leak check reads it: the
first sample, the largest, the last, and the least-squares slope over the last third (a bounded
pool's growth has stopped by then, a leak's has not); `plot_rss` draws it into a PNG.

    sampler = RssSampler(proc.pid, 5.0).start()
    ...
    series = sampler.stop()
    print(describe_trend(rss_trend(series)))
    plot_rss(series, Path("rss.png"), "kiln serve under load")
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

Series = list[tuple[float, float]]  # (seconds since start, MiB)


def rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB."""
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


class RssSampler:
    """A background thread reading one process's RSS every `every_s` seconds."""

    def __init__(self, pid: int, every_s: float) -> None:
        self.pid, self.every_s = pid, every_s
        self.series: Series = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = 0.0

    def start(self) -> RssSampler:
        """Begin sampling now (t = 0)."""
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def elapsed(self) -> float:
        """Seconds since start(), on the series' clock."""
        return time.monotonic() - self._t0

    def _run(self) -> None:
        while True:
            try:
                self.series.append((time.monotonic() - self._t0, rss_mib(self.pid)))
            except Exception:  # the process ended: the series stops where it was
                return
            if self._done.wait(self.every_s):
                return

    def stop(self) -> Series:
        """Stop sampling; the series so far."""
        self._done.set()
        self._thread.join(timeout=10)
        return list(self.series)


@dataclass(frozen=True)
class Trend:
    """A series summed up: first, largest and last RSS, and the slope of its last third."""

    samples: int
    seconds: float
    start_mib: float
    max_mib: float
    end_mib: float
    tail_slope_mib_per_min: float  # least squares over the samples of the last third of the time


def slope(points: Series) -> float:
    """Least-squares slope (MiB per second) of (t, MiB) points; 0 with fewer than two times."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in points) / var


def rss_trend(series: Series) -> Trend:
    """The trend of an RSS series (at least one sample)."""
    if not series:
        raise ValueError("an RSS series needs at least one sample")
    t0, t1 = series[0][0], series[-1][0]
    tail = [(t, y) for t, y in series if t >= t1 - (t1 - t0) / 3]
    return Trend(
        samples=len(series), seconds=t1 - t0, start_mib=series[0][1],
        max_mib=max(y for _, y in series), end_mib=series[-1][1],
        tail_slope_mib_per_min=60.0 * slope(tail),
    )  # fmt: skip


def describe_trend(trend: Trend) -> str:
    """One line: start, max, end and the last third's slope."""
    return (
        f"RSS over {trend.seconds:.0f} s ({trend.samples} samples): start {trend.start_mib:.0f} "
        f"MiB, max {trend.max_mib:.0f} MiB, end {trend.end_mib:.0f} MiB; slope over the last "
        f"third {trend.tail_slope_mib_per_min:+.2f} MiB/min"
    )


def plot_rss(series: Series, out: Path, title: str, marks: Series | None = None) -> Path | None:
    """PNG of RSS against time (written atomically); None when matplotlib is missing.

    `marks`: (time, requests done) points drawn as a second axis, so growth can be read per
    request as well as per second.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from kiln.io import atomic_write

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([t for t, _ in series], [y for _, y in series], color="tab:blue", label="RSS")
    ax.set_xlabel("seconds since the server started")
    ax.set_ylabel("resident memory (MiB)", color="tab:blue")
    ax.grid(alpha=0.3)
    if marks:
        ax2 = ax.twinx()
        ax2.plot([t for t, _ in marks], [n for _, n in marks], color="tab:grey", linestyle=":")
        ax2.set_ylabel("requests done", color="tab:grey")
    trend = rss_trend(series)
    ax.set_title(f"{title}\nlast third: {trend.tail_slope_mib_per_min:+.2f} MiB/min", fontsize=10)
    fig.tight_layout()
    with atomic_write(out, "wb", encoding=None) as handle:
        fig.savefig(handle, format="png", dpi=110)
    plt.close(fig)
    return out
