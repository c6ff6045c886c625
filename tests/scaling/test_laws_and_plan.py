"""Compute-optimal allocation (closed form against numerical minimisation) and plans."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar

from kiln.errors import KilnError
from kiln.hardware import accelerator
from kiln.model import ModelConfig
from kiln.scaling.laws import CHINCHILLA, EPOCH, ScalingLaw, TokensPerParam, get_law
from kiln.scaling.plan import family_aspect_range, find_shape, make_plan


@pytest.mark.parametrize("law", [CHINCHILLA, EPOCH], ids=["chinchilla", "epoch"])
@pytest.mark.parametrize("flops", [1e18, 5.76e23, 1e26])
def test_closed_form_optimum_minimises_the_law_at_fixed_compute(
    law: ScalingLaw, flops: float
) -> None:
    res = minimize_scalar(
        lambda log_n: law.loss(math.exp(log_n), flops / (6 * math.exp(log_n))),
        bounds=(math.log(1e3), math.log(1e15)), method="bounded",
        options={"xatol": 1e-10},
    )  # fmt: skip
    n, d = law.optimal(flops)
    assert n == pytest.approx(math.exp(res.x), rel=1e-4)
    assert 6 * n * d == pytest.approx(flops)


def test_published_exponents_and_ratios() -> None:
    # Hoffmann et al. Table 2 gives a = 0.46, b = 0.54 for approach 3 (from unrounded fits).
    assert CHINCHILLA.a == pytest.approx(0.46, abs=0.01)
    assert CHINCHILLA.b == pytest.approx(0.54, abs=0.01)
    # Epoch AI's re-fit puts the optimum near 20 tokens per parameter at Chinchilla's budget.
    n, d = EPOCH.optimal(5.76e23)
    assert 15 < d / n < 25
    n, d = TokensPerParam().optimal(5.76e23)
    assert d / n == pytest.approx(20) and 6 * n * d == pytest.approx(5.76e23)


@settings(max_examples=50, deadline=None)
@given(
    law=st.sampled_from(["chinchilla", "epoch", "20x"]),
    log_c=st.floats(15, 27),
)
def test_given_params_or_tokens_round_trip_to_the_same_budget(law: str, log_c: float) -> None:
    rule = get_law(law)
    flops = 10**log_c
    n, d = rule.optimal(flops)
    assert rule.flops_for_params(n) == pytest.approx(flops, rel=1e-9)
    assert rule.flops_for_tokens(d) == pytest.approx(flops, rel=1e-9)


def test_shape_search_finds_the_gpt2_preset_and_stays_in_the_aspect_range() -> None:
    shape = find_shape(124.4e6, "gpt2", seq_len=1024)
    assert (shape.config.n_layer, shape.config.n_embd) == (12, 768)
    assert shape.params == ModelConfig.preset("gpt2-124m").num_params()
    lo, hi = family_aspect_range("llama")
    for target in (3e7, 1e9, 7e10):
        s = find_shape(target, "llama")
        assert lo <= s.config.n_embd / s.config.n_layer <= hi
        assert abs(math.log(s.params / target)) < 0.05  # within 5%


def test_plan_time_is_exact_flops_over_delivered_throughput() -> None:
    gpu = accelerator("h100")
    plan = make_plan(CHINCHILLA, flops=1e21, gpu=gpu, n_gpus=8, mfu=0.4)
    n, d = CHINCHILLA.optimal(1e21)
    assert (plan.params, plan.tokens) == (n, d)
    assert plan.train_flops == plan.shape.config.flops_per_token(2048) * d
    assert plan.seconds == pytest.approx(plan.train_flops / (989.4e12 * 8 * 0.4))
    assert plan.gpu_hours == pytest.approx(plan.seconds * 8 / 3600)
    assert plan.loss == pytest.approx(CHINCHILLA.loss(n, d))
    given_n = make_plan(CHINCHILLA, params=n, gpu=gpu)
    assert given_n.flops == pytest.approx(1e21)


def test_plan_errors_are_clear() -> None:
    gpu = accelerator("a100")
    with pytest.raises(KilnError, match="exactly one of"):
        make_plan(CHINCHILLA, flops=1e20, params=1e9, gpu=gpu)
    with pytest.raises(KilnError, match="--mfu must be in"):
        make_plan(CHINCHILLA, flops=1e20, gpu=gpu, mfu=1.5)
    with pytest.raises(KilnError, match="a100 has no fp8 peak"):
        make_plan(CHINCHILLA, flops=1e20, gpu=gpu, precision="fp8")
    with pytest.raises(KilnError, match="unknown scaling law 'kaplan'"):
        get_law("kaplan")
    with pytest.raises(KilnError, match="flops must be a positive number"):
        CHINCHILLA.optimal(-1.0)
    with pytest.raises(KilnError, match="unknown family"):
        find_shape(1e8, "mamba")


def test_trainer_mfu_reads_the_hardware_table() -> None:
    from kiln.train.metrics import peak_flops

    for name in ("h100", "h200", "b200", "a100"):
        assert peak_flops(f"NVIDIA {name.upper()}") == accelerator(name).peak("bf16")
    assert peak_flops("NVIDIA V100-SXM2-32GB") is None  # no bf16 on V100: no MFU, not a guess


def test_hardware_table_refuses_unknown_gpus_and_missing_peaks() -> None:
    with pytest.raises(KilnError, match="unknown GPU 'tpu'"):
        accelerator("tpu")
    with pytest.raises(KilnError, match="v100 has no bf16 peak"):
        accelerator("v100").peak("bf16")
