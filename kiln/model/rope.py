"""Rotary position embeddings (split-half layout) and their context-extension scalings.

The scaling types follow Hugging Face's `rope_type` meanings exactly (tests/model/test_rope.py
checks each against transformers' own frequencies and a Llama forward):

- linear: position interpolation, every frequency / factor.
- dynamic: NTK-aware; once a sequence is longer than original_max_seq_len L0, the base grows to
  θ·(factor·T/L0 - (factor - 1))^(D/(D-2)) for that sequence of length T. The frequencies then
  depend on the sequence length, so cached decoding past L0 rotates old keys with older
  frequencies (as HF's does): it equals a full forward only up to L0.
- yarn: frequencies with fewer than beta_slow rotations over L0 are interpolated, more than
  beta_fast kept, a linear ramp between; cos and sin are scaled by an attention factor.
- llama3: wavelengths above L0/low_freq_factor divided by the factor, below L0/high_freq_factor
  kept, smoothly interpolated between (Llama 3.1).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kiln.model.config import ModelConfig, RopeScaling


def rope_inv_freq(cfg: ModelConfig, seq_len: int | None = None) -> Tensor:
    """Rotary frequencies θ^(-2i/D) (D/2,), scaled by cfg.rope_scaling (for seq_len if dynamic)."""
    dim, base = cfg.rope_dim, cfg.rope_theta
    s = cfg.rope_scaling
    if (
        s is not None
        and s.type == "dynamic"
        and seq_len is not None
        and seq_len > s.original_max_seq_len
    ):
        growth = s.factor * seq_len / s.original_max_seq_len - (s.factor - 1)
        base = base * growth ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # (D/2,)
    inv_freq = 1.0 / (base**exponents)
    if s is None or s.type == "dynamic":
        return inv_freq
    if s.type == "linear":
        return inv_freq / s.factor
    if s.type == "yarn":
        return _yarn_inv_freq(s, dim, base)
    return _llama3_inv_freq(s, inv_freq)


def _llama3_inv_freq(s: RopeScaling, inv_freq: Tensor) -> Tensor:
    """Llama 3.1: long wavelengths / factor, short ones kept, a smooth blend in between."""
    wavelen = 2 * torch.pi / inv_freq
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(s: RopeScaling, dim: int, base: float) -> Tensor:
    """YaRN: interpolate the frequencies that rotate few times over L0, keep the fast ones."""

    def correction_dim(rotations: float) -> float:
        """The dimension index whose frequency turns `rotations` times over L0."""
        return (
            dim
            * math.log(s.original_max_seq_len / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)  # (D/2,)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the frequency is kept (extrapolated), 0: interpolated
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1·mscale·ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor cos and sin are multiplied by (YaRN's attention scaling; 1 otherwise)."""
    s = cfg.rope_scaling
    if s is None or s.type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def dynamic_rope_length(cfg: ModelConfig, positions: Tensor) -> int | None:
    """The sequence length (last position + 1) when it needs its own dynamic-NTK frequencies."""
    s = cfg.rope_scaling
    if s is None or s.type != "dynamic":
        return None
    seq_len = int(positions.max()) + 1
    return seq_len if seq_len > s.original_max_seq_len else None


def rope_tables(
    cfg: ModelConfig, device: torch.device | None = None, seq_len: int | None = None
) -> tuple[Tensor, Tensor]:
    """cos and sin (block_size, D) for every position, in the split-half layout."""
    inv_freq = rope_inv_freq(cfg, seq_len).to(device)
    freqs = torch.arange(cfg.block_size, device=device).float()[:, None] * inv_freq  # (P, D/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (P, D): both halves rotate by the same angle
    factor = rope_attention_factor(cfg)
    return angles.cos() * factor, angles.sin() * factor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x_i, x_{i+R/2}) of x (B, H, T, D) by the angles in cos, sin (T or B,1,T; R).

    With R < D (partial RoPE, GPT-NeoX / Phi) only the first R dims rotate; the rest pass through.
    """
    if (rot := cos.size(-1)) < x.size(-1):
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # (B, H, T, D)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def rotate_positions(cfg: ModelConfig, x: Tensor, delta: int) -> Tensor:
    """Move already-rotated keys x (..., D) by delta positions (negative: back), exactly RoPE's
    group property R(a)·R(b) = R(a + b); used when a streaming cache shifts its window."""
    freqs = delta * rope_inv_freq(cfg).to(x.device)  # (D/2,)
    angles = torch.cat((freqs, freqs))
    return apply_rope(x, angles.cos(), angles.sin())
