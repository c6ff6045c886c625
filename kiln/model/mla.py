"""Multi-head latent attention (DeepSeek-V2/V3): keys and values decompressed from a small latent.

    q = Wq·x, or Wq_b·norm(Wq_a·x) with query compression          (B, H, T, d_nope + d_rope)
    [c, k_rope] = Wkv_a·x;  c = norm(c)                            c: (B, T, R), k_rope: (B, T, r)
    [k_nope, v] = Wkv_b·c                                           (B, H, S, d_nope), (B, H, S, d_v)
    k = [k_nope, RoPE(k_rope) shared by every head],  q = [q_nope, RoPE(q_rope)]

Only c and RoPE(k_rope) are cached: R + r numbers per token and layer (the cache's "key" and
"value" of a single head, see `ModelConfig.kv_cache_dims`), against 2·H_kv·D for GQA. With
kiln.model.generate's cache the latents are decompressed by Wkv_b at every step (the simple form).
The serving engine's paged cache takes the absorbed form instead (`forward_absorbed`): with
Wkv_b = [W_uk; W_uv] per head, q_nope·k_nopeᵀ = (q_nope·W_uk)·cᵀ and weights·v = (weights·c)·W_uvᵀ,
so attention runs as one shared key head [c, RoPE(k_rope)] with the latent c as its values, and
the cache is never expanded into per-head keys and values. The latent norms use eps 1e-6
whatever norm_eps says, as DeepSeek's do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kiln.model.attention import attend
from kiln.model.config import ModelConfig
from kiln.model.layers import RMSNorm
from kiln.model.rope import apply_rope, yarn_mscale

if TYPE_CHECKING:
    from kiln.model.kv_cache import AttentionCache, PagedAttentionCache

LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/√d_qk, times YaRN's mscale(factor, mscale_all_dim)² when that is set (as DeepSeek-V3)."""
    scale = cfg.qk_head_dim**-0.5
    s = cfg.rope_scaling
    if s is not None and s.type == "yarn" and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


class LatentAttention(nn.Module):
    """MLA with the same interface as CausalSelfAttention (window, sinks, cache)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        assert cfg.mla is not None
        m = cfg.mla
        self.layer = layer
        self.window = cfg.layer_window(layer)
        self.backend = cfg.attention_backend
        self.n_head, self.rope_dim, self.kv_rank = cfg.n_head, m.rope_dim, m.kv_rank
        self.nope_dim, self.v_dim = cfg.qk_head_dim - m.rope_dim, cfg.v_head_dim
        H, C, qk = cfg.n_head, cfg.n_embd, cfg.qk_head_dim
        self.q_rank = m.q_rank
        if m.q_rank is None:
            self.wq = nn.Linear(C, H * qk, bias=False)
        else:
            self.wq_a = nn.Linear(C, m.q_rank, bias=cfg.bias)
            self.q_a_norm = RMSNorm(m.q_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(m.q_rank, H * qk, bias=False)
        self.wkv_a = nn.Linear(C, m.kv_rank + m.rope_dim, bias=cfg.bias)
        self.kv_a_norm = RMSNorm(m.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(m.kv_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.proj = nn.Linear(H * self.v_dim, C, bias=cfg.bias)
        self.scale = mla_softmax_scale(cfg)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.sinks = nn.Parameter(torch.zeros(H)) if cfg.attn_sinks else None

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        mask: Tensor | None,
        cache: AttentionCache | None = None,
    ) -> Tensor:
        """Attention output (B, T, C) of x (B, T, C)."""
        B, T, _ = x.shape
        if cache is not None and hasattr(cache, "attend_latent"):
            return self.forward_absorbed(x, rope, cache)
        q, k, v = self.heads(x, rope, cache)
        y = attend(q, k, v, mask, self.backend, scale=self.scale, sinks=self.sinks)  # (B, H, T, dv)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.v_dim)))

    def forward_absorbed(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None, cache: PagedAttentionCache
    ) -> Tensor:
        """The same output (B, T, C), attending in the latent space of a paged cache."""
        H, R = self.n_head, self.kv_rank
        q_nope, q_rope, latent, k_rope = self.projections(x, rope)
        w = self.wkv_b.weight.view(H, self.nope_dim + self.v_dim, R)  # per head [W_uk; W_uv]
        # One 2-D matmul per head (H is small): a weight matmul that a row-tiling mode sees.
        q_lat = torch.stack([q_nope[:, h] @ w[h, : self.nope_dim] for h in range(H)], 1)
        q = torch.cat((q_lat.to(latent.dtype), q_rope.to(latent.dtype)), dim=-1)  # (B,H,T,R+r)
        kv = torch.cat((latent, k_rope.to(latent.dtype)), dim=-1)  # (B, 1, T, R + r)
        o = cache.attend_latent(self.layer, q, kv, R, self.window, scale=self.scale,
                                sinks=self.sinks)  # (B, H, T, R)  # fmt: skip
        y = torch.cat([o[:, h] @ w[h, self.nope_dim :].t() for h in range(H)], -1)  # (B,T,H·dv)
        return self.drop(self.proj(y))

    def projections(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q_nope (B, H, T, d_nope), RoPE'd q_rope (B, H, T, r), normed latent (B, 1, T, R) and
        RoPE'd shared key (B, 1, T, r) of x (B, T, C)."""
        assert rope is not None  # MLA requires pos_emb = "rope" (checked by the config)
        B, T, _ = x.shape
        q = self.wq(x) if self.q_rank is None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q = q.view(B, T, self.n_head, -1).transpose(1, 2)  # (B, H, T, d_nope + d_rope)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_norm(latent)[:, None]  # (B, 1, T, R)
        k_rope = apply_rope(k_rope[:, None], *rope)  # (B, 1, T, r): one RoPE key for all heads
        return q_nope, apply_rope(q_rope, *rope), latent, k_rope

    def heads(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None, cache: AttentionCache | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, T, d_qk), keys (B, H, S, d_qk), values (B, H, S, d_v) over the prefix."""
        B = x.size(0)
        H = self.n_head
        q_nope, q_rope, latent, k_rope = self.projections(x, rope)
        q = torch.cat((q_nope, q_rope), dim=-1).to(latent.dtype)
        if cache is not None:
            latent, k_rope = cache.update(self.layer, latent, k_rope)  # (B, 1, S, R), (B, 1, S, r)
        S = latent.size(2)
        kv = self.wkv_b(latent[:, 0]).view(B, S, H, -1).transpose(1, 2)  # (B, H, S, d_nope + d_v)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, H, S, self.rope_dim)), dim=-1)  # (B, H, S, d_qk)
        return q, k, v
