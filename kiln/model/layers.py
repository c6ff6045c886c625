"""The pieces of a Transformer block: norms, rotary embeddings, attention, MLP (the block: block.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.model.attention import attend
from kiln.model.config import ModelConfig
from kiln.model.rope import apply_rope, rope_inv_freq, rope_tables

__all__ = ["MLP", "CausalSelfAttention", "RMSNorm", "activate", "make_norm"]
__all__ += ["apply_rope", "rope_inv_freq", "rope_tables"]  # moved to rope.py; still importable

if TYPE_CHECKING:
    from kiln.model.kv_cache import AttentionCache


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in fp32 like the Llama reference (no weight if not `scale`)."""

    def __init__(self, dim: int, eps: float, scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dimension."""
        w = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), (x.size(-1),), w, self.eps).type_as(x)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The config's normalisation layer over `dim` features."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps, cfg.norm_scale)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, elementwise_affine=cfg.norm_scale, bias=cfg.bias)


def activate(kind: str, h: Tensor) -> Tensor:
    """The MLP nonlinearity on the input projection h (..., F), or (..., 2F) [gate | up] if gated."""
    if kind in ("swiglu", "geglu"):
        gate, up = h.chunk(2, dim=-1)
        gate = F.silu(gate) if kind == "swiglu" else F.gelu(gate, approximate="tanh")
        return gate * up  # (..., F)
    if kind == "relu":
        return F.relu(h)
    if kind == "relu2":
        return F.relu(h).square()  # modded-nanogpt's ReLU²
    return F.gelu(h, approximate="tanh" if kind == "gelu" else "none")


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with a fused QKV projection; grouped-query when n_kv_head < n_head."""

    def __init__(self, cfg: ModelConfig, layer: int, fused_input: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_size
        self.window = cfg.layer_window(layer)
        self.backend = cfg.attention_backend
        self.scale, self.softcap = cfg.attention_scale, cfg.attn_softcap
        q_out, kv_out = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.in_width = q_out + 2 * kv_out
        # fused_input: the block's one input projection computes q, k, v (parallel blocks)
        self.qkv = None if fused_input else nn.Linear(cfg.n_embd, self.in_width, bias=cfg.bias)
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
        qkv: Tensor | None = None,
    ) -> Tensor:
        """Attention output (B, T, C) of x (B, T, C) (or of its fused projection qkv)."""
        B, T, _ = x.shape
        q, k, v = self.heads(x, rope, qkv)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
        if cache is not None and hasattr(cache, "attend"):  # a paged cache attends itself
            y = cache.attend(self.layer, q, k, v, self.window, scale=self.scale,
                             sinks=self.sinks, softcap=self.softcap)  # fmt: skip
        else:
            if cache is not None:
                k, v = cache.update(self.layer, k, v)  # (B, Hkv, S, D): the whole prefix so far
            y = attend(
                q, k, v, mask, self.backend, scale=self.scale, sinks=self.sinks,
                softcap=self.softcap,
            )  # (B, H, T, D)  # fmt: skip
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, H·D)
        return self.drop(self.proj(y))

    def heads(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None, qkv: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, T, D), keys and values (B, Hkv, T, D) of x, normed and rotated."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        if qkv is None:
            assert self.qkv is not None, "a fused-input attention is given its projection"
            qkv = self.qkv(x)
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q.to(v.dtype), k.to(v.dtype), v  # under autocast a norm may have upcast q, k


class MLP(nn.Module):
    """Position-wise feed-forward: `activate(cfg.mlp)` between two projections (gate+up fused)."""

    def __init__(self, cfg: ModelConfig, ff_size: int | None = None, fused_input: bool = False):
        super().__init__()
        self.kind, self.gated = cfg.mlp, cfg.gated
        self.swiglu = self.gated  # parallelize.py shards a fused [gate | up] by this flag
        ff_size = ff_size or cfg.ff_size
        self.in_width = (2 if self.gated else 1) * ff_size
        # fused_input: the block's one input projection computes this MLP's input (parallel)
        self.fc = None if fused_input else nn.Linear(cfg.n_embd, self.in_width, bias=cfg.bias)
        self.proj = nn.Linear(ff_size, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: Tensor, h: Tensor | None = None) -> Tensor:
        """(B, T, C) -> (B, T, C); h: the input projection when the block computed it (fused)."""
        if h is None:
            assert self.fc is not None, "a fused-input MLP is given its projection"
            h = self.fc(x)  # (B, T, F) or (B, T, 2F)
        return self.drop(self.proj(activate(self.kind, h)))  # (B, T, C)
