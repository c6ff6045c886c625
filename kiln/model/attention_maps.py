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
    inputs: list[tuple[nn.Module, tuple[object, ...], dict[str, object]]] = []

    def record(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        inputs.append((module, args, kwargs))

    handles = [
        block.attn.register_forward_pre_hook(record, with_kwargs=True) for block in model.blocks
    ]
    try:
        model.hidden(idx)
    finally:
        for handle in handles:
            handle.remove()
    maps = []
    for attn, (x, rope, mask, *_), kwargs in inputs:
        fused = [kwargs["qkv"]] if kwargs.get("qkv") is not None else []  # a parallel block's
        q, k, _ = attn.heads(x, rope, *fused)  # type: ignore[operator]
        scale, sinks = getattr(attn, "scale", None), attn.sinks  # MLA's scale; learned sinks
        softcap = getattr(attn, "softcap", None)
        maps.append(attention_weights(q, k, mask, scale=scale, sinks=sinks, softcap=softcap))  # type: ignore[arg-type]
    return maps
