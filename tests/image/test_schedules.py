"""kiln's noise schedules and sampler steps against diffusers' DDPMScheduler / DDIMScheduler."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ConfigError
from kiln.image.schedules import DiffusionConfig, Schedule, alphas_cumprod, betas

diffusers = pytest.importorskip("diffusers")

DIFFUSERS_SCHEDULE = {"linear": "linear", "scaled_linear": "scaled_linear",
                      "cosine": "squaredcos_cap_v2"}  # fmt: skip


def _pair(kind: str, schedule: str, objective: str, **kw):
    cfg = DiffusionConfig(beta_schedule=schedule, objective=objective, **kw)
    prediction = {"epsilon": "epsilon", "v": "v_prediction"}[objective]
    cls = diffusers.DDIMScheduler if kind == "ddim" else diffusers.DDPMScheduler
    theirs = cls(
        num_train_timesteps=cfg.timesteps, beta_start=cfg.beta_start, beta_end=cfg.beta_end,
        beta_schedule=DIFFUSERS_SCHEDULE[schedule], prediction_type=prediction, clip_sample=False,
    )  # fmt: skip
    return Schedule(cfg), theirs


@pytest.mark.parametrize("schedule", ["linear", "scaled_linear", "cosine"])
def test_betas_and_alphas_cumprod_equal_diffusers(schedule: str) -> None:
    ours, theirs = _pair("ddpm", schedule, "epsilon")
    assert torch.allclose(betas(ours.cfg), theirs.betas, atol=1e-7, rtol=0)
    assert torch.allclose(alphas_cumprod(ours.cfg), theirs.alphas_cumprod, atol=1e-7, rtol=0)


@pytest.mark.parametrize("objective", ["epsilon", "v"])
def test_noising_and_velocity_target_equal_diffusers(objective: str) -> None:
    ours, theirs = _pair("ddpm", "cosine", objective)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(5, 4, 8, 8, generator=g), torch.randn(5, 4, 8, 8, generator=g)
    t = torch.tensor([0, 17, 500, 998, 999])
    assert torch.allclose(ours.add_noise(x0, noise, t), theirs.add_noise(x0, noise, t), atol=1e-6)
    expected = noise if objective == "epsilon" else theirs.get_velocity(x0, noise, t)
    assert torch.allclose(ours.target(x0, noise, t), expected, atol=1e-6)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("objective", ["epsilon", "v"])
@pytest.mark.parametrize("eta", [0.0, 0.7])
def test_a_ddim_step_equals_diffusers(schedule: str, objective: str, eta: float) -> None:
    steps = 20
    ours, theirs = _pair("ddim", schedule, objective, eta=eta, sample_steps=steps)
    theirs.set_timesteps(steps)
    assert ours.timesteps(steps) == theirs.timesteps.tolist()
    g = torch.Generator().manual_seed(1)
    x, out = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    for t in (theirs.timesteps[0], theirs.timesteps[7], theirs.timesteps[-1]):
        expected = theirs.step(
            out, t, x, eta=eta, generator=torch.Generator().manual_seed(5)
        ).prev_sample
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
        got = ours.ddim_step(out, int(t), x, steps, noise)
        assert torch.allclose(got, expected, atol=1e-5), (t, (got - expected).abs().max())


@pytest.mark.parametrize("objective", ["epsilon", "v"])
@pytest.mark.parametrize("steps", [1000, 50])
def test_a_ddpm_step_equals_diffusers(objective: str, steps: int) -> None:
    ours, theirs = _pair("ddpm", "linear", objective, sampler="ddpm", sample_steps=steps)
    theirs.set_timesteps(steps)
    assert ours.timesteps(steps) == theirs.timesteps.tolist()
    g = torch.Generator().manual_seed(2)
    x, out = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    for t in (
        theirs.timesteps[0],
        theirs.timesteps[len(theirs.timesteps) // 2],
        theirs.timesteps[-1],
    ):
        expected = theirs.step(out, t, x, generator=torch.Generator().manual_seed(9)).prev_sample
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
        got = ours.ddpm_step(out, int(t), x, steps, noise)
        assert torch.allclose(got, expected, atol=1e-5), (t, (got - expected).abs().max())


def test_ddim_with_the_true_noise_recovers_the_clean_sample() -> None:
    # With the exact ε as the model's answer, deterministic DDIM walks back to x0.
    sched = Schedule(DiffusionConfig(objective="epsilon", beta_schedule="cosine"))
    g = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    times = sched.timesteps(10)
    x = sched.add_noise(x0, noise, torch.tensor([times[0]] * 2))
    for t in times:
        a = sched.alphas_cumprod[t]
        eps = (x - a.sqrt() * x0) / (1 - a).sqrt()
        x = sched.ddim_step(eps, t, x, 10)
    assert torch.allclose(x, x0, atol=1e-4)


def test_flow_noises_linearly_and_euler_integrates_the_straight_path() -> None:
    sched = Schedule(DiffusionConfig(objective="flow"))
    g = torch.Generator().manual_seed(4)
    x0, noise = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    half = sched.add_noise(x0, noise, torch.tensor([0.5, 0.5]))
    assert torch.allclose(half, (x0 + noise) / 2)
    x = noise.clone()
    times = sched.timesteps(8)
    assert times[0] == 1.0 and len(times) == 8
    for s in times:
        x = sched.step(sched.target(x0, noise, torch.zeros(2)), s, x, 8)
    assert torch.allclose(x, x0, atol=1e-5)  # a straight path: Euler is exact


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"diffusion\.objective"):
        DiffusionConfig(objective="x0")
    with pytest.raises(ConfigError, match=r"diffusion\.sample_steps"):
        DiffusionConfig(sample_steps=0)
