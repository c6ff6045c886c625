"""The residual block: a sequence mixer (attention, latent attention or a recurrent layer) and an
MLP (dense or experts), wired as the config's norm placement says."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from kiln.model.config import ModelConfig
from kiln.model.layers import MLP, CausalSelfAttention, make_norm
from kiln.model.mla import LatentAttention
from kiln.model.moe import MoE
from kiln.model.ssm import make_mixer

if TYPE_CHECKING:
    from kiln.model.kv_cache import AttentionCache


class Block(nn.Module):
    """A residual block; cfg.norm_placement and cfg.parallel_block choose the wiring.

    pre:       x + attn(n1(x)), then x + mlp(n2(x))
    post:      n1(x + attn(x)), then n2(x + mlp(x))                  (original Transformer, BERT)
    sandwich:  x + n1b(attn(n1(x))), then x + n2b(mlp(n2(x)))       (Gemma 2, OLMo 2)
    parallel:  x + attn(n1(x)) + mlp(n1(x)) (GPT-J, PaLM: one fused input projection), or
               x + attn(n1(x)) + mlp(n2(x)) with parallel_norms = 2 (GPT-NeoX)
    """

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.placement, self.parallel = cfg.norm_placement, cfg.parallel_block
        fused = cfg.fused_input and not cfg.is_moe_layer(layer)
        self.norm1 = make_norm(cfg, cfg.n_embd)
        self.attn: (
            nn.Module
        )  # the sequence mixer: attention, or a recurrent one (kiln/model/ssm.py)
        if cfg.layer_mixer(layer) != "attention":
            self.attn = make_mixer(cfg, layer)
        elif cfg.mla:
            self.attn = LatentAttention(cfg, layer)
        else:
            self.attn = CausalSelfAttention(cfg, layer, fused)
        self.norm2 = make_norm(cfg, cfg.n_embd) if cfg.norms_per_block != 1 else None
        self.mlp: nn.Module | None = None  # mlp = "none": a mixer-only block (Mamba-2's)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, layer)
        elif cfg.has_mlp:
            self.mlp = MLP(cfg, fused_input=fused)
        self.in_proj = None  # (C, qkv + mlp input): one matmul feeds both branches
        if fused:
            width = self.attn.in_width + self.mlp.in_width
            self.in_proj = nn.Linear(cfg.n_embd, width, bias=cfg.bias)
        sandwich = cfg.norm_placement == "sandwich"
        self.norm1_post = make_norm(cfg, cfg.n_embd) if sandwich else None
        self.norm2_post = make_norm(cfg, cfg.n_embd) if sandwich else None

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        masks: dict[int | None, Tensor | None],
        cache: AttentionCache | None = None,
    ) -> Tensor:
        """(B, T, C) -> (B, T, C)."""
        mask = masks[self.attn.window]
        if self.parallel:
            return x + self._parallel(x, rope, mask, cache)
        if self.placement == "post":
            x = self.norm1(x + self.attn(x, rope, mask, cache))
            return self.norm2(x + self.mlp(x))
        a = self.attn(self.norm1(x), rope, mask, cache)  # (B, T, C)
        x = x + (a if self.norm1_post is None else self.norm1_post(a))
        if self.mlp is None:
            return x
        m = self.mlp(self.norm2(x))
        return x + (m if self.norm2_post is None else self.norm2_post(m))

    def _parallel(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None, mask: Tensor | None, cache: Any
    ) -> Tensor:
        """attn(n1(x)) + mlp(n1(x) or n2(x)), through the fused input projection when there is one."""
        h = self.norm1(x)  # (B, T, C)
        if self.in_proj is None:
            mlp_in = h if self.norm2 is None else self.norm2(x)
            return self.attn(h, rope, mask, cache) + self.mlp(mlp_in)
        qkv, up = self.in_proj(h).split([self.attn.in_width, self.mlp.in_width], dim=-1)
        return self.attn(h, rope, mask, cache, qkv=qkv) + self.mlp(h, h=up)
