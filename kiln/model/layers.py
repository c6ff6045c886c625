"""The pieces of a Transformer block: norms, rotary embeddings, attention, MLP, the block itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.model.attention import attend
from kiln.model.config import ModelConfig
from kiln.model.rope import apply_rope, rope_inv_freq, rope_tables

__all__ = ["MLP", "Block", "CausalSelfAttention", "RMSNorm", "make_norm"]
__all__ += ["apply_rope", "rope_inv_freq", "rope_tables"]  # moved to rope.py; still importable

if TYPE_CHECKING:
    from kiln.model.kv_cache import AttentionCache


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in fp32 like the Llama reference."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dimension."""
        return F.rms_norm(x.float(), (x.size(-1),), self.weight.float(), self.eps).type_as(x)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The config's normalisation layer over `dim` features."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with a fused QKV projection; grouped-query when n_kv_head < n_head."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_size
        self.window = cfg.layer_window(layer)
        self.backend = cfg.attention_backend
        q_out, kv_out = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.qkv = nn.Linear(cfg.n_embd, q_out + 2 * kv_out, bias=cfg.bias)
        self.proj = nn.Linear(q_out, cfg.n_embd, bias=cfg.bias)
        self.q_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else None
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.sinks = nn.Parameter(torch.zeros(self.n_head)) if cfg.attn_sinks else None

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        mask: Tensor | None,
        cache: AttentionCache | None = None,
    ) -> Tensor:
        """Attention output (B, T, C) of x (B, T, C)."""
        B, T, _ = x.shape
        q, k, v = self.heads(x, rope)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
        if cache is not None and hasattr(cache, "attend"):  # a paged cache attends itself
            y = cache.attend(self.layer, q, k, v, self.window)  # (B, H, T, D)
        else:
            if cache is not None:
                k, v = cache.update(self.layer, k, v)  # (B, Hkv, S, D): the whole prefix so far
            y = attend(q, k, v, mask, self.backend, sinks=self.sinks)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, H·D)
        return self.drop(self.proj(y))

    def heads(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, T, D), keys and values (B, Hkv, T, D) of x, normed and rotated."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q.to(v.dtype), k.to(v.dtype), v  # under autocast a norm may have upcast q, k


class MLP(nn.Module):
    """Position-wise feed-forward: GELU (tanh) or SwiGLU, gate and up projections fused."""

    def __init__(self, cfg: ModelConfig, ff_size: int | None = None) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        n_in = 2 if self.swiglu else 1
        ff_size = ff_size or cfg.ff_size
        self.fc = nn.Linear(cfg.n_embd, n_in * ff_size, bias=cfg.bias)
        self.proj = nn.Linear(ff_size, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, C)."""
        h = self.fc(x)  # (B, T, F) or (B, T, 2F)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up  # (B, T, F)
        else:
            h = F.gelu(h, approximate="tanh")
        return self.drop(self.proj(h))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        from kiln.model.mla import LatentAttention
        from kiln.model.moe import MoE

        self.norm1 = make_norm(cfg, cfg.n_embd)
        self.attn = LatentAttention(cfg, layer) if cfg.mla else CausalSelfAttention(cfg, layer)
        self.norm2 = make_norm(cfg, cfg.n_embd)
        self.mlp = MoE(cfg, layer) if cfg.is_moe_layer(layer) else MLP(cfg)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        masks: dict[int | None, Tensor | None],
        cache: AttentionCache | None = None,
    ) -> Tensor:
        """(B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.norm1(x), rope, masks[self.attn.window], cache)
        return x + self.mlp(self.norm2(x))
