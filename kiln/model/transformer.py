"""The Transformer language model: embeddings, a stack of pre-norm blocks, a final norm, the head.

GPT-2 and Llama-style models are the same code with different config switches (see config.py).
The model knows nothing of training, data or parallelism: it maps token ids to logits or a loss.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kiln.errors import KilnError
from kiln.model.attention import attention_mask, segment_positions
from kiln.model.block import Block
from kiln.model.config import ModelConfig
from kiln.model.layers import make_norm
from kiln.model.loss import lm_loss
from kiln.model.moe import moe_aux_loss
from kiln.model.rope import dynamic_rope_length, rope_tables

if TYPE_CHECKING:
    from kiln.model.kv_cache import AttentionCache


class Transformer(nn.Module):
    """A decoder-only LM built from a ModelConfig; checks its parameter count against the config."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        V, C = cfg.padded_vocab_size, cfg.n_embd
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(cfg.block_size, C) if cfg.pos_emb == "learned" else None
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        # post-norm blocks already end in a norm (the original Transformer has no final one)
        self.norm_f = make_norm(cfg, C) if cfg.norm_placement != "post" else nn.Identity()
        self.lm_head = nn.Linear(C, V, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # one Parameter, one storage
        # RoPE tables are derived data, not state: rebuilt by init_weights, never checkpointed.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.register_buffer("pos_table", torch.empty(0), persistent=False)  # sinusoidal
        self.init_weights()
        n_module = sum(p.numel() for p in self.parameters())
        if n_module != cfg.num_params():
            raise RuntimeError(
                f"module has {n_module:,} parameters, config says {cfg.num_params():,}"
            )

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02); residual output projections scaled by 1/√(2·n_layer).

        Biases start at zero, norm scales at one, padded vocab rows at zero. Call it again after
        materialising a model built on the meta device (`to_empty`), which also rebuilds RoPE.
        """
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1 and name.endswith(("bias", "sinks")):
                nn.init.zeros_(p)
            elif p.dim() == 1:  # norm scales
                nn.init.ones_(p)
            elif name.endswith("proj.weight") and not name.endswith("in_proj.weight"):
                # attn.proj and mlp.proj write into the residual
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, mean=0.0, std=std)
        for module in self.modules():
            if hasattr(module, "init_ssm"):  # recurrent mixers: decays, time steps, conv taps
                module.init_ssm()
        for name, buffer in self.named_buffers():
            if name.endswith("expert_bias"):  # MoE balancing biases start neutral
                buffer.zero_()
        self.wte.weight[self.cfg.vocab_size :].zero_()
        if not self.cfg.tie_embeddings:
            self.lm_head.weight[self.cfg.vocab_size :].zero_()
        self.init_rope()

    def init_rope(self) -> None:
        """(Re)build the RoPE cos/sin (or sinusoidal position) tables on the parameters' device."""
        if self.cfg.pos_emb == "rope":
            self.rope_cos, self.rope_sin = rope_tables(self.cfg, self.wte.weight.device)
        if self.cfg.pos_emb == "sinusoidal":
            self.pos_table = sinusoidal_table(self.cfg.block_size, self.cfg.n_embd)
            self.pos_table = self.pos_table.to(self.wte.weight.device)

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Transformer:
        """As nn.Module.to_empty (materialise a meta-device model), keeping a tied head tied.

        Follow with `init_weights()` or `load_state_dict(...)` and `init_rope()`.
        """
        super().to_empty(device=device, recurse=recurse)
        if self.cfg.tie_embeddings:  # to_empty gives every parameter its own new storage
            self.lm_head.weight = self.wte.weight
        return self

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        segments: Tensor | None = None,
        *,
        cache: AttentionCache | None = None,
    ) -> Tensor:
        """Logits (B, T, vocab_size) for token ids idx (B, T), or the scalar loss given targets.

        `segments` (B, T) numbers the documents packed into each row (runs of equal ids): a
        token attends only within its own document, whose positions start again at 0.
        """
        h = self.hidden(idx, cache, segments)  # (B, T, C)
        if targets is None:
            return self.logits(h)
        loss = lm_loss(
            self._head_input(h), self.lm_head.weight, targets, self.cfg.vocab_size, self.cfg.logit_softcap,
            self.cfg.z_loss,
        )  # fmt: skip
        return loss + moe_aux_loss(self) if self.cfg.moe is not None and self.training else loss

    def logits(self, h: Tensor) -> Tensor:
        """Head over final hidden states (..., C) -> logits (..., vocab_size), soft-capped if set."""
        logits = self.lm_head(self._head_input(h))[..., : self.cfg.vocab_size]  # padding sliced off
        if self.cfg.logit_softcap is not None:
            c = self.cfg.logit_softcap
            logits = c * torch.tanh(logits / c)
        return logits

    def _head_input(self, h: Tensor) -> Tensor:
        """µP's output multiplier 1/width_mult on the head's input (1 under SP: h unchanged)."""
        m = self.cfg.width_mult
        return h if m == 1.0 else h * (1.0 / m)

    def hidden(
        self, idx: Tensor, cache: AttentionCache | None = None, segments: Tensor | None = None
    ) -> Tensor:
        """Final-norm hidden states (B, T, C); with a cache, idx continues the cached prefix."""
        T = idx.size(1)
        start = 0 if cache is None else cache.length
        given = None if cache is None else getattr(cache, "positions", None)  # ragged batch
        if given is None and start + T > self.cfg.block_size:
            raise KilnError(
                f"sequence of {start + T} tokens is longer than block_size {self.cfg.block_size}"
            )
        slots = torch.arange(start, start + T, device=idx.device)  # (T,)
        first_valid = None if cache is None else cache.first_valid  # (B,): after left padding
        pos = slots if first_valid is None else (slots[None] - first_valid[:, None]).clamp(min=0)
        if given is not None:
            pos = given  # (B, T): each token's position in its own sequence (checked by the cache)
        if segments is not None:
            if self.cfg.has_recurrent_layers:
                raise KilnError(
                    f"packed segments (document masks) are not supported with recurrent layers "
                    f"(model.layer_pattern = {self.cfg.layer_pattern!r}): their state would carry "
                    "across documents; train without packing"
                )
            if cache is not None:
                raise KilnError("packed segments are for training passes, not cached decoding")
            pos = segment_positions(segments)  # (B, T)
        x = self.embed(idx, pos)  # (B, T, C)
        masks = self.attention_masks(slots, start + T, first_valid, segments)
        x = self.run_blocks(x, self.rope_at(pos, start), masks, cache)
        if cache is not None:
            cache.advance(T)
        return self.norm_f(x)  # (B, T, C)

    def embed(self, idx: Tensor, pos: Tensor) -> Tensor:
        """Token ids (B, T) at positions pos ((T,) or (B, T)) -> the residual stream (B, T, C)."""
        x = self.wte(idx)  # (B, T, C)
        if self.cfg.embed_scale:
            x = x * torch.tensor(self.cfg.n_embd**0.5, dtype=x.dtype)
        if self.wpe is not None:
            x = x + self.wpe(pos)  # pos (T,) or (B, T)
        elif self.cfg.pos_emb == "sinusoidal":
            x = x + self.pos_table[pos].to(x.dtype)
        return self.drop(x)

    def rope_at(self, pos: Tensor, start: int = 0) -> tuple[Tensor, Tensor] | None:
        """RoPE's (cos, sin) at positions pos: (T, D) for pos = start.., (B, 1, T, D) for (B, T)."""
        if self.cfg.pos_emb != "rope":
            return None
        cos, sin = self.rope_cos, self.rope_sin
        if (n := dynamic_rope_length(self.cfg, pos)) is not None:  # NTK: this length's freqs
            cos, sin = rope_tables(self.cfg, pos.device, seq_len=n)
        if pos.dim() == 1:  # the same positions in every row
            span = slice(start, start + pos.numel())
            return cos[span], sin[span]  # (T, D)
        return cos[pos][:, None], sin[pos][:, None]  # (B, 1, T, D)

    def run_blocks(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        masks: dict[int | None, Tensor | None],
        cache: AttentionCache | None = None,
        start: int = 0,
        stop: int | None = None,
    ) -> Tensor:
        """Blocks start..stop-1 (every block by default) over the residual stream x (B, T, C)."""
        for i in range(start, len(self.blocks) if stop is None else stop):
            x = self.blocks[i](x, rope, masks, cache)
        return x

    def head(self, x: Tensor) -> Tensor:
        """The residual stream after the last block (..., C) -> logits (..., vocab_size)."""
        return self.logits(self.norm_f(x))

    def attention_masks(
        self, slots: Tensor, n_keys: int, first_valid: Tensor | None, segments: Tensor | None
    ) -> dict[int | None, Tensor | None]:
        """An attention mask per distinct layer window; None where plain causal attention will do."""
        T = slots.numel()
        plain_causal = first_valid is None and segments is None and (n_keys == T or T == 1)
        windows = {block.attn.window for block in self.blocks}
        return {
            w: None
            if plain_causal and (w is None or n_keys <= w)
            else attention_mask(slots, n_keys, w, first_valid, segments)
            for w in windows
        }


def sinusoidal_table(n_positions: int, dim: int) -> Tensor:
    """The original Transformer's fixed positions (P, C): sin at even dims, cos at odd dims.

    PE[p, 2i] = sin(p / 10000^(2i/C)), PE[p, 2i+1] = cos(p / 10000^(2i/C)).
    """
    pos = torch.arange(n_positions, dtype=torch.float32)[:, None]  # (P, 1)
    inv = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (C/2,)
    table = torch.zeros(n_positions, dim)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * inv), torch.cos(pos * inv)
    return table
