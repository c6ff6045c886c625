"""train.time_budget: parsing, the plan of max_steps on a fake clock, drift, overrun, resume."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln import config as cfgio
from kiln.config import ConfigError
from kiln.train.budget import TimeBudget, parse_duration
from kiln.train.trainer import Trainer

from .conftest import MakeConfig

PEAK_LR, FLOOR = 3e-3, 0.1  # configs/tiny.toml: optim.lr and schedule.min_lr_ratio


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(90, 90.0), (2.5, 2.5), ("600", 600.0), ("90s", 90.0), ("10m", 600.0), ("1.5h", 5400.0)],
)
def test_durations_read_as_seconds(value: Any, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", [0, -5, "0m", "inf", "nan", "abc", "10x", "", True])
def test_a_bad_budget_is_one_clear_error(make_config: MakeConfig, value: Any) -> None:
    text = json.dumps(value) if isinstance(value, str) else str(value).lower()
    with pytest.raises(ConfigError, match=r"train\.time_budget = .*positive, finite.*'10m'"):
        make_config(f"train.time_budget={text}")


class FakeClock:
    """A clock that moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _budget(seconds: str, *more: str) -> list[str]:
    """Overrides for a budgeted run of configs/tiny.toml (its max_steps would cap the plan)."""
    return [f"train.time_budget={seconds}", "train.max_steps=none", *more]


def _budgeted(
    cfg: Any,
    durations: Callable[[int], float],
    resume: bool = False,
    on_step: Callable[[Trainer, int, float], None] | None = None,
    eval_seconds: float = 0.0,
) -> Trainer:
    """A Trainer whose step N (1-based) takes durations(N) seconds, and each eval eval_seconds."""
    clock = FakeClock()
    trainer = Trainer(cfg, cfg.logging.run_dir, resume=resume, on_step=on_step, clock=clock)
    real_step, real_eval = trainer._train_step, trainer.evaluate

    def step() -> tuple[float, float, float]:
        out = real_step()
        clock.now += durations(trainer.step)
        return out

    def evaluate() -> float | None:
        clock.now += eval_seconds  # not training time: the plan must not see it
        return real_eval()

    trainer._train_step = step  # type: ignore[method-assign]
    trainer.evaluate = evaluate  # type: ignore[method-assign]
    return trainer


def _records(cfg: Any) -> list[dict[str, Any]]:
    text = (Path(cfg.logging.run_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_the_plan_ends_the_schedule_at_the_budget_whatever_eval_costs(
    make_config: MakeConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    # A 3 s first step (warm-up), then 1 s steps: 3 + 17 × 1 = 20 s in 18 steps.
    cfg = make_config(*_budget("20s", "checkpoint.every=0"), run="a")
    result = _budgeted(cfg, lambda n: 3.0 if n == 1 else 1.0, eval_seconds=500.0).run()
    assert result.step == 18 and not result.interrupted
    records = _records(cfg)
    assert records[-1]["train_s"] == 20.0 and records[-1]["max_steps"] == 18
    assert records[-1]["lr"] == pytest.approx(PEAK_LR * FLOOR)  # the schedule's final lr
    assert all(r["lr"] > PEAK_LR * FLOOR for r in records[:-1])
    assert records[0]["time_budget_s"] == 20.0
    assert [r["step"] for r in records if "val_loss" in r][-1] == 18  # the last step evaluates
    out = capsys.readouterr().out
    assert "evaluation, sampling and checkpoints are not counted" in out
    assert "-> 18 steps" in out and "20.0 s of 20.0 s trained, 18 steps" in out


@pytest.mark.parametrize("schedule", ["warmup_cosine", "wsd"])
def test_a_slower_machine_is_re_planned_and_the_lr_still_reaches_its_floor(
    make_config: MakeConfig, capsys: pytest.CaptureFixture[str], schedule: str
) -> None:
    # 1 s steps, then from step 11 the machine halves its speed.
    sets = _budget("40", "checkpoint.every=0", "eval.every=0", f"schedule.name={schedule}")
    cfg = make_config(*sets, run="b")
    result = _budgeted(cfg, lambda n: 1.0 if n <= 10 else 2.0).run()
    records = _records(cfg)
    plans = [r["max_steps"] for r in records]
    assert plans[5] == 40 and plans[-1] == result.step < 40  # first plan, then fewer steps
    assert plans == sorted(plans, reverse=True)
    assert 40 - 2.0 < records[-1]["train_s"] <= 40  # ends within one step of the budget
    assert records[-1]["lr"] == pytest.approx(PEAK_LR * FLOOR)
    out = capsys.readouterr().out
    assert "step time 1 -> 1.5 s, re-planned to" in out and "1.5 -> 2 s" in out


def test_max_steps_with_a_budget_is_an_upper_bound(make_config: MakeConfig) -> None:
    cfg = make_config("train.time_budget=1h", "train.max_steps=5", "checkpoint.every=0", run="c")
    result = _budgeted(cfg, lambda n: 1.0).run()
    records = _records(cfg)
    assert result.step == 5 and records[-1]["lr"] == pytest.approx(PEAK_LR * FLOOR)


def test_raising_the_step_cap_on_resume_extends_a_capped_run(make_config: MakeConfig) -> None:
    cfg = make_config("train.time_budget=1h", "train.max_steps=5", "checkpoint.every=0", run="c")
    assert _budgeted(cfg, lambda n: 1.0).run().step == 5
    raised = make_config("train.time_budget=1h", "train.max_steps=8", "checkpoint.every=0", run="c")
    assert _budgeted(raised, lambda n: 1.0, resume=True).run().step == 8


def test_resume_keeps_the_training_time_and_ends_at_the_same_total_budget(
    make_config: MakeConfig,
) -> None:
    straight = make_config(*_budget("20", "eval.every=0"), run="straight")
    assert _budgeted(straight, lambda n: 1.0).run().step == 20

    def interrupt(trainer: Trainer, step: int, loss: float) -> None:
        if step == 6:
            signal.raise_signal(signal.SIGINT)

    cut = make_config(*_budget("20", "eval.every=0"), run="cut")
    first = _budgeted(cut, lambda n: 1.0, on_step=interrupt).run()
    assert first.interrupted and first.step == 6
    state = json.loads((first.checkpoint / "state.json").read_text())
    assert state["scheduler"]["train_seconds"] == 6.0 and state["scheduler"]["max_steps"] == 20
    resumed = _budgeted(cut, lambda n: 1.0, resume=True)
    assert resumed.train_seconds == 6.0 and resumed.max_steps == 20
    second = resumed.run()
    assert second.step == 20 and _records(cut)[-1]["train_s"] == 20.0
    assert _records(cut)[-1]["lr"] == pytest.approx(PEAK_LR * FLOOR)
    assert first.losses + second.losses == [r["loss"] for r in _records(straight)]


# ---- the planner alone ---------------------------------------------------------------------------


def _drive(budget: TimeBudget, durations: Callable[[int], float]) -> list[int]:
    """Run the planner as the trainer does; the plans made before each step."""
    plans, steps = [], 0
    while steps < budget.plan(steps):
        plans.append(budget.planned)
        steps += 1
        budget.record(durations(steps))
    return plans


def test_a_slow_last_step_overruns_by_less_than_itself() -> None:
    budget = TimeBudget(10.0)
    plans = _drive(budget, lambda n: 7.5 if n == 10 else 1.0)  # step 10: the planned last
    assert len(plans) == 10 and plans[-1] == 10
    assert budget.elapsed - budget.seconds < 7.5


def test_a_resumed_plan_is_not_cut_short_by_the_first_warm_up_step() -> None:
    budget = TimeBudget(20.0, elapsed=6.0, planned=20)  # resumed at step 6 of 20, 1 s steps
    assert budget.plan(6) == 20
    budget.record(5.0)  # the new process's first step pays for warm-up
    assert budget.plan(7) == 20  # 7 + 9 s left / 5 s would have been 8
    budget.record(1.0)
    assert budget.plan(8) == 20  # still calibrating: the plan it brought stands
    budget.record(1.0)
    assert budget.plan(9) == 16  # measured: 1 s steps, 7 s left (the warm-up cost 4 s)


def test_a_step_that_eats_the_rest_of_the_budget_stops_the_run() -> None:
    budget = TimeBudget(20.0)
    plans = _drive(budget, lambda n: 30.0 if n == 6 else 1.0)
    assert len(plans) == 6  # nothing starts once the budget is spent
    assert budget.elapsed - budget.seconds < 30.0


def test_a_plan_never_reopens_a_finished_schedule() -> None:
    budget = TimeBudget(10.0, planned=4)
    budget.record(1.0)
    assert budget.plan(4) == 4  # step 4 ran at the final lr: 6 s left or not, that is the end


@pytest.mark.parametrize("seconds", range(30, 61))
def test_on_a_noisy_machine_the_run_still_ends_on_its_planned_last_step(seconds: int) -> None:
    # Every fifth step is 2.5x slower: the plan keeps that spread in hand at the end.
    budget = TimeBudget(float(seconds))
    plans = _drive(budget, lambda n: 2.5 if n % 5 == 0 else 1.0)
    assert plans[-1] == len(plans)  # the last step ran as the schedule's last (its final lr)
    assert budget.elapsed - budget.seconds < 2.5


def test_length_defaults_and_the_written_config_reads_back(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    from kiln.train.config import TrainSection

    assert TrainSection().max_steps == 1000 and TrainSection().dtype == "auto"
    assert TrainSection(time_budget="10m").max_steps is None  # no cap unless one is given
    assert TrainSection(time_budget="10m").budget_seconds == 600.0
    cfg = make_config(*_budget("1.5h"))
    (tmp_path / "written.toml").write_text(cfg.to_toml())
    again = cfgio.load(type(cfg), tmp_path / "written.toml")
    assert again.train.time_budget == "1.5h" and again.train.max_steps is None
