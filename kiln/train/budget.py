"""`train.time_budget`: seconds of training, and the plan of max_steps that ends the schedule on time.

Only training time counts: the optimizer steps, timed one by one. The trainer does not hand the
time of evaluation, sampling and checkpoints to the planner, so a budget buys the same training
whatever eval.every is.

Before each step the plan is the steps done plus the whole steps that fit into what is left of
the budget at the recent step time (the median of the last `RECENT` steps; a process's first step
is left out once there are others, since it pays for allocation and warm-up), less a reserve of
the recent spread (slowest recent step minus the median), so that on a noisy machine the step
named last still fits. The lr schedule reads the plan afresh at every step, so warmup + cosine
(or WSD's decay) ends at the budget even when a shared machine's speed drifts. Two rules bound
the end:

- a step starts only while budget is left, so a run overruns by at most the step that crossed it;
- a step the plan named as the last one (it ran at the schedule's final lr) is the last: the plan
  never reopens a finished schedule.

So the final lr is reached at the last step unless, right at the end, one step takes longer
than the slowest recent step plus the median (the run then stops when the budget is spent, one
step short of its plan).
"""

from __future__ import annotations

import contextlib
import math
import statistics

from kiln.config import ConfigError

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
RECENT = 8  # step times the rate is the median of: a drift shows within a few steps
CALIBRATION = 2  # measured steps (after a process's first) before the plan may name a last step
DRIFT = 0.2  # a step-time change (relative) that the log reports as a re-plan


def parse_duration(value: object, key: str = "train.time_budget") -> float:
    """Seconds from a number of seconds or a text "90", "90s", "10m", "1.5h" (positive, finite)."""
    seconds = math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        unit = UNITS.get(text[-1:], 1.0)
        number = text[:-1] if text[-1:] in UNITS else text
        with contextlib.suppress(ValueError):  # not a number: the error below says what is
            seconds = float(number) * unit
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(
            f"{key} = {value!r}: expected a positive, finite number of seconds or a duration "
            "such as '90s', '10m' or '1h'"
        )
    return seconds


def format_seconds(seconds: float) -> str:
    """A duration for the log: "42.0 s", "10.0 min", "1.50 h"."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


class TimeBudget:
    """Plans max_steps from measured step times so the schedule ends when `seconds` are spent."""

    def __init__(
        self,
        seconds: float,
        cap: int | None = None,
        elapsed: float = 0.0,
        planned: int | None = None,
    ) -> None:
        self.seconds = seconds
        self.cap = cap  # train.max_steps when also given: an upper bound on the plan
        self.elapsed = elapsed  # training seconds so far, this process and any it resumed
        self.planned = planned  # the schedule's max_steps (a resumed run starts from the saved)
        self.durations: list[float] = []  # this process's step times
        self._reported: float | None = None  # the step time of the last plan the log showed

    def record(self, seconds: float) -> None:
        """Count one optimizer step that took `seconds`."""
        self.durations.append(seconds)
        self.elapsed += seconds

    def _recent(self) -> list[float]:
        """This process's last step times, its first step left out once there are others."""
        times = self.durations[1:] if len(self.durations) > 1 else self.durations
        return times[-RECENT:]

    def step_time(self) -> float | None:
        """The recent seconds per step (None before any step of this process)."""
        recent = self._recent()
        return statistics.median(recent) if recent else None

    def plan(self, steps_done: int) -> int:
        """max_steps for the schedule after `steps_done` steps; equal to `steps_done`: stop."""
        if self.planned is not None and steps_done >= self.planned:
            return self.planned  # the last planned step was taken: the schedule has ended
        left = self.seconds - self.elapsed
        rate = self.step_time()
        if left <= 0:
            planned = steps_done
        elif not rate:  # nothing measured yet: keep the saved plan, or look two steps ahead
            planned = self.planned if self.planned is not None else steps_done + 2
        else:
            reserve = max(self._recent()) - rate  # the spread of recent steps, kept in hand
            planned = steps_done + max(1, int(max(0.0, left - reserve) // rate))
            if len(self.durations) <= CALIBRATION:
                # Too few times (the first carries warm-up) to call a step the last, or to
                # shorten a plan a resumed run brought with it.
                planned = max(planned, steps_done + 2, self.planned or 0)
        if self.cap is not None:
            planned = min(planned, self.cap)
        self.planned = planned
        return planned

    def replan_note(self) -> str | None:
        """A log line when the plan first rests on measured times, or when the step time drifted."""
        rate = self.step_time()
        if rate is None or len(self.durations) <= CALIBRATION or self.planned is None:
            return None
        before = self._reported
        if before is not None and abs(rate - before) <= DRIFT * before:
            return None
        self._reported = rate
        capped = " (train.max_steps caps it)" if self.planned == self.cap else ""
        if before is None:
            return f"time budget: {rate:.3g} s/step measured -> {self.planned:,} steps{capped}"
        return (
            f"time budget: step time {before:.3g} -> {rate:.3g} s, re-planned to "
            f"{self.planned:,} steps{capped}"
        )


def intro_line(budget: TimeBudget, max_steps: int, trained: float) -> str:
    """What a budgeted run says before its first step."""
    cap = f", at most {max_steps:,} steps" if budget.cap else ""
    done = f"; {format_seconds(trained)} already trained" if trained else ""
    return (
        f"time budget {format_seconds(budget.seconds)} of training{cap}{done}: steps are "
        "planned from the measured step time so the lr schedule ends on time (evaluation, "
        "sampling and checkpoints are not counted)"
    )


def summary_line(budget: TimeBudget, trained: float, steps: int, other: float) -> str:
    """What a budgeted run says at its end (`other`: seconds outside the training steps)."""
    return (
        f"time budget: {format_seconds(trained)} of {format_seconds(budget.seconds)} trained, "
        f"{steps:,} steps (evaluation, sampling and checkpoints took {format_seconds(other)} "
        "more, not counted)"
    )
