"""Noise schedules, training targets and samplers for the diffusion transformer.

Two objectives behind one switch (`objective`):
- DDPM (Ho et al., 2020): x_t = √ᾱ_t·x0 + √(1-ᾱ_t)·ε for an integer t in [0, T); the model
  predicts ε (`epsilon`) or the velocity v = √ᾱ_t·ε - √(1-ᾱ_t)·x0 (`v`, Salimans & Ho, 2022).
  Sampled with DDIM (Song et al., 2021; η = 0 is deterministic) or ancestral DDPM steps.
- Rectified flow (`flow`, Liu et al., 2022): x_s = (1-s)·x0 + s·ε for s in [0, 1]; the model
  predicts the velocity ε - x0 and is sampled by Euler steps from s = 1 to 0.

The schedules, the timestep spacing and one step of each sampler are the same arithmetic as
diffusers' DDPMScheduler / DDIMScheduler (timestep_spacing "leading", set_alpha_to_one, no
clipping, variance "fixed_small"); tests/image/test_schedules.py checks that on the same inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kiln.config import require

OBJECTIVES = ("epsilon", "v", "flow")
BETA_SCHEDULES = ("linear", "scaled_linear", "cosine")
SAMPLERS = ("ddim", "ddpm", "euler")


@dataclass
class DiffusionConfig:
    """The objective, its noise schedule and the default sampler."""

    objective: str = "v"  # "epsilon" | "v" (DDPM objectives) | "flow" (rectified flow)
    timesteps: int = 1000  # T of the DDPM chain (flow: the scale of the model's time input)
    beta_schedule: str = "cosine"  # "linear" | "scaled_linear" | "cosine" (squaredcos_cap_v2)
    beta_start: float = 1e-4
    beta_end: float = 0.02
    sampler: str = "ddim"  # "ddim" | "ddpm" for the DDPM objectives; flow always uses "euler"
    sample_steps: int = 25
    eta: float = 0.0  # DDIM's noise: 0 deterministic, 1 as DDPM
    guidance: float = 3.0  # classifier-free guidance scale; 1 turns it off

    def __post_init__(self) -> None:
        require(self.objective in OBJECTIVES, f"diffusion.objective must be one of {OBJECTIVES}")
        require(
            self.beta_schedule in BETA_SCHEDULES,
            f"diffusion.beta_schedule must be one of {BETA_SCHEDULES}, got {self.beta_schedule!r}",
        )
        require(self.sampler in SAMPLERS, f"diffusion.sampler must be one of {SAMPLERS}")
        require(self.timesteps >= 2, f"diffusion.timesteps must be >= 2, got {self.timesteps}")
        require(
            1 <= self.sample_steps <= self.timesteps,
            f"diffusion.sample_steps must be in [1, {self.timesteps}], got {self.sample_steps}",
        )
        require(
            0 < self.beta_start < self.beta_end < 1, "diffusion needs 0 < beta_start < beta_end < 1"
        )
        require(self.eta >= 0, f"diffusion.eta must be >= 0, got {self.eta}")
        require(self.guidance >= 0, f"diffusion.guidance must be >= 0, got {self.guidance}")


def betas(cfg: DiffusionConfig) -> Tensor:
    """β_t for t in [0, T), float32, as diffusers computes them."""
    T = cfg.timesteps
    if cfg.beta_schedule == "linear":
        return torch.linspace(cfg.beta_start, cfg.beta_end, T, dtype=torch.float32)
    if cfg.beta_schedule == "scaled_linear":  # Stable Diffusion's: linear in √β
        return torch.linspace(cfg.beta_start**0.5, cfg.beta_end**0.5, T, dtype=torch.float32) ** 2

    def alpha_bar(t: float) -> float:  # Nichol & Dhariwal's cosine, offset 0.008
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    out = [min(1 - alpha_bar((i + 1) / T) / alpha_bar(i / T), 0.999) for i in range(T)]
    return torch.tensor(out, dtype=torch.float32)


def alphas_cumprod(cfg: DiffusionConfig) -> Tensor:
    """ᾱ_t = Π_{s≤t} (1 - β_s), float32 (T,)."""
    return torch.cumprod(1.0 - betas(cfg), dim=0)


def _bcast(values: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, 1, 1, ...) to scale a batch shaped like `like`."""
    return values.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


class Schedule:
    """A DiffusionConfig made into tensors: noising, targets, and one step of each sampler."""

    def __init__(self, cfg: DiffusionConfig) -> None:
        self.cfg = cfg
        self.flow = cfg.objective == "flow"
        self.alphas_cumprod = alphas_cumprod(cfg)

    # ---- training ------------------------------------------------------------------------------

    def sample_t(self, batch: int, generator: torch.Generator | None = None) -> Tensor:
        """Training times: integers in [0, T) for DDPM, s in (0, 1) for flow, shape (B,)."""
        if self.flow:
            return torch.rand(batch, generator=generator).clamp(1e-4, 1.0)
        return torch.randint(0, self.cfg.timesteps, (batch,), generator=generator)

    def model_time(self, t: Tensor) -> Tensor:
        """What the network is told: the DDPM step, or s·T for flow (the same input range)."""
        return t.float() * self.cfg.timesteps if self.flow else t.float()

    def add_noise(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        """x_t of clean x0 at times t (B,) with `noise` (diffusers' add_noise for DDPM)."""
        if self.flow:
            s = _bcast(t, x0)
            return (1 - s) * x0 + s * noise
        a = self.alphas_cumprod.to(x0.device)[t]
        return _bcast(a.sqrt(), x0) * x0 + _bcast((1 - a).sqrt(), x0) * noise

    def target(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        """What the model should output for (x0, noise, t) under the objective."""
        if self.flow:
            return noise - x0
        if self.cfg.objective == "epsilon":
            return noise
        a = self.alphas_cumprod.to(x0.device)[t]  # v = √ᾱ·ε - √(1-ᾱ)·x0 (get_velocity)
        return _bcast(a.sqrt(), x0) * noise - _bcast((1 - a).sqrt(), x0) * x0

    # ---- sampling ------------------------------------------------------------------------------

    def timesteps(self, steps: int) -> list[int] | list[float]:
        """The sampler's times, first to last: DDPM "leading" spacing, or s from 1 down."""
        if self.flow:
            return [1 - i / steps for i in range(steps)]
        ratio = self.cfg.timesteps // steps
        return [i * ratio for i in reversed(range(steps))]

    def _alphas(self, t: int, steps: int) -> tuple[float, float]:
        prev = t - self.cfg.timesteps // steps
        a_t = float(self.alphas_cumprod[t])
        a_prev = float(self.alphas_cumprod[prev]) if prev >= 0 else 1.0  # set_alpha_to_one
        return a_t, a_prev

    def predict_x0_eps(self, x: Tensor, out: Tensor, t: int) -> tuple[Tensor, Tensor]:
        """(x0, ε) implied by the model's output `out` at DDPM step t."""
        a = self.alphas_cumprod[t].to(x.dtype)
        if self.cfg.objective == "epsilon":
            return (x - (1 - a).sqrt() * out) / a.sqrt(), out
        return a.sqrt() * x - (1 - a).sqrt() * out, a.sqrt() * out + (1 - a).sqrt() * x

    def ddim_step(
        self, out: Tensor, t: int, x: Tensor, steps: int, noise: Tensor | None = None
    ) -> Tensor:
        """x at the previous time of a `steps`-step DDIM run (η = cfg.eta; noise if η > 0)."""
        a_t, a_prev = self._alphas(t, steps)
        x0, eps = self.predict_x0_eps(x, out, t)
        variance = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
        std = self.cfg.eta * variance**0.5
        x_prev = a_prev**0.5 * x0 + max(1 - a_prev - std**2, 0.0) ** 0.5 * eps
        if std > 0:
            if noise is None:
                raise ValueError("a DDIM step with eta > 0 needs noise")
            x_prev = x_prev + std * noise
        return x_prev

    def ddpm_step(
        self, out: Tensor, t: int, x: Tensor, steps: int, noise: Tensor | None = None
    ) -> Tensor:
        """One ancestral DDPM step (posterior mean plus "fixed_small" noise, none at t = 0)."""
        a_t, a_prev = self._alphas(t, steps)
        alpha, beta = a_t / a_prev, 1 - a_t / a_prev  # of this (possibly strided) step
        x0, _ = self.predict_x0_eps(x, out, t)
        mean = (a_prev**0.5 * beta / (1 - a_t)) * x0 + (alpha**0.5 * (1 - a_prev) / (1 - a_t)) * x
        if t == 0:
            return mean
        if noise is None:
            raise ValueError("a DDPM step above t = 0 needs noise")
        variance = max((1 - a_prev) / (1 - a_t) * beta, 1e-20)
        return mean + variance**0.5 * noise

    def euler_step(self, out: Tensor, s: float, x: Tensor, steps: int) -> Tensor:
        """One Euler step of the flow ODE from s to s - 1/steps (`out`: the velocity ε - x0)."""
        return x - out / steps

    def step(
        self, out: Tensor, t: float, x: Tensor, steps: int, noise: Tensor | None = None
    ) -> Tensor:
        """One step of the configured sampler."""
        if self.flow:
            return self.euler_step(out, float(t), x, steps)
        if self.cfg.sampler == "ddpm":
            return self.ddpm_step(out, int(t), x, steps, noise)
        return self.ddim_step(out, int(t), x, steps, noise)

    def needs_noise(self) -> bool:
        """Whether a sampling step draws fresh noise (ancestral DDPM, DDIM with η > 0)."""
        return not self.flow and (self.cfg.sampler == "ddpm" or self.cfg.eta > 0)

    def x0_estimate(self, out: Tensor, t: float, x: Tensor) -> Tensor:
        """The clean sample the current output implies (the previews of a sampling run)."""
        if self.flow:
            return x - float(t) * out  # x_s = x0 + s·(ε - x0)
        return self.predict_x0_eps(x, out, int(t))[0]
