"""Attention weights of every layer, for inspection: recorded by hooks, off the forward's hot path."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kiln.model.attention import attention_weights
from kiln.model.transformer import Transformer


@torch.no_grad()
def attention_maps(model: Transformer, idx: Tensor) -> list[Tensor]:
    """Attention weights (B, H, T, T) of every layer for ids idx (B, T), whatever the backend.

    A forward pre-hook records each attention layer's inputs during one ordinary forward pass;
    the weights softmax(q·kᵀ/√D) are then recomputed from them with the layer's own projections.
    """
    inputs: list[tuple[nn.Module, tuple[object, ...]]] = []

    def record(module: nn.Module, args: tuple[object, ...]) -> None:
        inputs.append((module, args))

    handles = [block.attn.register_forward_pre_hook(record) for block in model.blocks]
    try:
        model.hidden(idx)
    finally:
        for handle in handles:
            handle.remove()
    maps = []
    for attn, (x, rope, mask, *_) in inputs:
        q, k, _ = attn.heads(x, rope)  # type: ignore[operator]
        scale, sinks = getattr(attn, "scale", None), attn.sinks  # MLA's scale; learned sinks
        softcap = getattr(attn, "softcap", None)
        maps.append(attention_weights(q, k, mask, scale=scale, sinks=sinks, softcap=softcap))  # type: ignore[arg-type]
    return maps
