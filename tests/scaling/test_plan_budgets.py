"""Plans for a time budget, from a fitted law, and on data that runs out (repeated epochs)."""

from __future__ import annotations

import json
import math

import pytest

from kiln.cli import main
from kiln.errors import KilnError
from kiln.hardware import accelerator
from kiln.scaling.laws import (
    EPOCH,
    REPEAT_R_STAR,
    ScalingLaw,
    effective_params,
    effective_tokens,
    get_law,
)
from kiln.scaling.plan import data_constrained_optimal, make_plan, plan_for_time

H200 = accelerator("h200")


def test_repeated_tokens_are_worth_less_and_saturate() -> None:
    u = 1e6
    assert effective_tokens(0.5e6, u) == 0.5e6  # within one epoch: every token is fresh
    two = effective_tokens(2e6, u)
    assert 1.9e6 < two < 2e6  # a second epoch is worth nearly a fresh one
    assert effective_tokens(1e9, u) == pytest.approx(u * (1 + REPEAT_R_STAR), rel=1e-9)
    assert effective_params(5e6, 1e7) == 5e6 and effective_params(1e9, 1e7) < 1e8


def test_data_constrained_plan_beats_the_unconstrained_size_on_repeated_data() -> None:
    flops, unique = 1e19, 1e8
    free = make_plan(EPOCH, flops=flops, gpu=H200, n_gpus=1)
    bound = make_plan(EPOCH, flops=flops, gpu=H200, n_gpus=1, unique_tokens=unique)
    assert free.tokens > 10 * unique  # unconstrained, the optimum would read the data 10+ times
    assert bound.params != pytest.approx(free.params, rel=0.05)
    assert bound.epochs == pytest.approx(bound.tokens / unique)
    # its N minimises the loss at the effective size and data: nudging N either way is worse
    n, d = data_constrained_optimal(EPOCH, flops, unique)
    assert 6 * n * d == pytest.approx(flops)

    def repeated_loss(n: float) -> float:
        unique_params = EPOCH.optimal(EPOCH.flops_for_tokens(unique))[0]
        return EPOCH.loss(
            effective_params(n, unique_params), effective_tokens(flops / 6 / n, unique)
        )

    assert repeated_loss(n) < min(repeated_loss(n * 1.2), repeated_loss(n / 1.2))
    assert bound.loss == pytest.approx(repeated_loss(bound.params), rel=1e-9)
    assert bound.loss > EPOCH.loss(free.params, free.tokens)  # repeated data costs loss
    assert bound.loss < repeated_loss(free.params)  # less than the unconstrained size's, repeated


def test_plan_for_time_fills_the_hours_at_a_measured_rate() -> None:
    plan = plan_for_time(EPOCH, 3600.0, gpu=H200, rate=3e11, vocab_size=4096, seq_len=256)
    assert plan.seconds == pytest.approx(3600.0, rel=2e-3)
    assert plan.train_flops == pytest.approx(3600.0 * 3e11, rel=2e-3)
    gpu_plan = plan_for_time(EPOCH, 3600.0, gpu=H200, n_gpus=1, mfu=0.4)
    assert gpu_plan.train_flops == pytest.approx(3600 * H200.peak("bf16") * 0.4, rel=2e-3)


def test_max_epochs_caps_the_tokens_and_spends_the_rest_on_size() -> None:
    unique = 1.44e6
    kw = dict(gpu=H200, rate=3e11, vocab_size=4096, seq_len=256, unique_tokens=unique)
    free = plan_for_time(EPOCH, 3600.0, **kw)
    capped = plan_for_time(EPOCH, 3600.0, max_epochs=5, **kw)
    assert free.epochs > 5  # the hour would read the data more often than the cap allows
    assert capped.epochs == pytest.approx(5, rel=0.05)
    assert capped.seconds == pytest.approx(3600.0, rel=2e-3)  # the hour is still filled ...
    assert capped.params > 1.5 * free.params  # ... by a larger model
    loose = make_plan(EPOCH, flops=1e15, gpu=H200, unique_tokens=1e12, max_epochs=5)
    assert loose.tokens == make_plan(EPOCH, flops=1e15, gpu=H200, unique_tokens=1e12).tokens
    sized = make_plan(EPOCH, params=1e8, gpu=H200, unique_tokens=unique, max_epochs=5)
    assert sized.params == pytest.approx(1e8) and sized.tokens == pytest.approx(5 * unique)
    assert sized.flops == pytest.approx(6 * 1e8 * 5 * unique)
    with pytest.raises(KilnError, match=r"--tokens 1e\+07 is more than --max-epochs 5"):
        make_plan(EPOCH, tokens=1e7, gpu=H200, unique_tokens=unique, max_epochs=5)
    with pytest.raises(KilnError, match="--max-epochs needs --unique-tokens"):
        make_plan(EPOCH, flops=1e15, gpu=H200, max_epochs=5)
    with pytest.raises(KilnError, match="--max-epochs must be a positive number, got 0"):
        make_plan(EPOCH, flops=1e15, gpu=H200, unique_tokens=unique, max_epochs=0)


def fit_json(tmp_path, parametric: object) -> str:
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"isoflop": [], "parametric": parametric}))
    return str(path)


def test_a_fitted_law_is_read_from_fit_json(tmp_path) -> None:
    consts = {"E": 0.5, "A": 300.0, "B": 900.0, "alpha": 0.4, "beta": 0.35}
    law = get_law(fit_json(tmp_path, {**consts, "rmse_log": 0.01}))
    assert isinstance(law, ScalingLaw)
    assert law.loss(1e7, 1e8) == pytest.approx(0.5 + 300 / 1e7**0.4 + 900 / 1e8**0.35)
    with pytest.raises(KilnError, match="no parametric fit"):
        get_law(fit_json(tmp_path, None))
    with pytest.raises(KilnError, match="needs numbers E, A, B, alpha, beta"):
        get_law(fit_json(tmp_path, {"E": 1.0}))
    with pytest.raises(KilnError, match="cannot read the fit"):
        get_law(str(tmp_path / "missing.json"))


def test_plan_cli_for_hours_on_repeated_data(tmp_path, capsys) -> None:
    law = fit_json(tmp_path, {"E": 0.5, "A": 300.0, "B": 900.0, "alpha": 0.4, "beta": 0.35})
    argv = ["scaling", "plan", "--hours", "1", "--rate", "3e11", "--law", law,
            "--unique-tokens", "1.44e6", "--vocab-size", "4096", "--seq-len", "256"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "epochs of 1.44e+06 unique tokens" in printed
    assert "1.0 hours at the measured 3e+11 FLOP/s" in printed
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["epochs"] == pytest.approx(doc["tokens"] / 1.44e6)
    assert math.isfinite(doc["loss"]) and doc["effective_tokens"] < doc["tokens"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hours", "0"], "--hours must be a positive number"),
        (["--hours", "1", "--rate", "-3"], "--rate must be a positive FLOP/s"),
        (["--flops", "1e18", "--unique-tokens", "0"], "--unique-tokens must be a positive"),
    ],
)
def test_plan_budget_errors_are_one_line(argv: list[str], message: str, capsys) -> None:
    assert main(["scaling", "plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
