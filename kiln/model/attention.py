"""Attention backends: PyTorch SDPA (default), an explicit math path, and the Triton kernel.

Every backend takes q (B, H, T, D) and k, v (B, H_kv, S, D) with H a multiple of H_kv (grouped
query attention: query head h reads kv head h // (H // H_kv)) and a boolean mask where True means
"may attend". A mask of None means plain causal attention with the T queries being the last T of
the S keys, which is what training, prefill from an empty cache and single-token decode need.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.errors import KilnError


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    backend: str,
    *,
    scale: float | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention output (B, H, T, Dv) by the configured backend.

    scale defaults to 1/√D; sinks (H,) are per-head logits of a key with no value (gpt-oss) and
    softcap maps scores to c·tanh(s/c) (Gemma 2); only the math path implements those two.
    """
    if backend == "math" or sinks is not None or softcap is not None:
        return math_attention(q, k, v, mask, scale=scale, sinks=sinks, softcap=softcap)
    if backend == "triton" and mask is None and q.size(2) == k.size(2) and scale is None:
        out = triton_attention(q, k, v)
        if out is not None:
            return out
    return sdpa_attention(q, k, v, mask, scale)


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None = None
) -> Tensor:
    """torch's fused scaled_dot_product_attention (flash / memory-efficient kernels when it can)."""
    T = q.size(2)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, scale=scale,
        enable_gqa=k.size(1) != q.size(1),
    )  # (B, H, T, Dv)  # fmt: skip


def math_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    scale: float | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """The textbook formula softmax(q·kᵀ/√D)·v, with the weights materialised."""
    groups = q.size(1) // v.size(1)
    v = v.repeat_interleave(groups, dim=1)  # (B, H, S, Dv)
    weights = attention_weights(q, k, mask, scale=scale, sinks=sinks, softcap=softcap)
    return weights @ v  # (B, H, T, Dv)


def attention_weights(
    q: Tensor,
    k: Tensor,
    mask: Tensor | None,
    *,
    scale: float | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """The weights softmax(q·kᵀ/√D) (B, H, T, S) of q (B, H, T, D) over k (B, H_kv, S, D).

    With sinks (H,), each head's softmax also spans one extra logit whose weight is dropped, so
    a row may sum to less than one: the head can attend to "nothing".
    """
    T, S = q.size(2), k.size(2)
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)  # (B, H, S, D)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        return F.softmax(scores, dim=-1).to(q.dtype)  # (B, H, T, S)
    sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)  # (B, H, T, 1)
    return F.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :S].to(q.dtype)


@functools.cache
def _flash_attention() -> Callable[..., Tensor] | None:
    """kiln.kernels.flash_attention, or None (with a one-time warning) when it cannot import."""
    try:
        from kiln.kernels import flash_attention
    except ImportError as exc:
        warnings.warn(
            f"attention_backend='triton': kiln.kernels is unavailable ({exc}); using SDPA",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return flash_attention


def triton_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """Causal attention by the Triton kernel, or None when it cannot run here (caller uses SDPA).

    Only unmasked causal attention (training, prefill) reaches the kernel; sliding windows,
    left padding and decoding against a cache use SDPA.
    """
    kernel = _flash_attention()
    if kernel is None:
        return None
    # The kernel itself knows whether it can run here (CUDA, or Triton's interpreter) and
    # raises ValueError otherwise, e.g. for CPU tensors without the interpreter.
    try:
        return kernel(q, k, v, causal=True)  # (B, H, T, D); GQA handled inside
    except (ImportError, ValueError, NotImplementedError, KilnError) as exc:  # e.g. no triton
        warnings.warn(
            f"Triton attention declined these inputs ({exc}); using SDPA",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def attention_mask(
    q_slots: Tensor,
    n_keys: int,
    window: int | None,
    first_valid: Tensor | None,
    segments: Tensor | None = None,
) -> Tensor:
    """Boolean mask (B or 1, 1, T, S): causal, within the window, and not a left-pad key.

    q_slots (T,) are the cache slots of the queries; first_valid (B,) is each row's first real
    slot (left padding before it). A padded query may still see itself, so no row is all-masked
    (an all-masked row would give NaN, which then leaks through 0·NaN into the real rows).
    segments (B, S) numbers the documents packed into each row (S = T, no cache): a query sees
    only keys of its own document.
    """
    k_slots = torch.arange(n_keys, device=q_slots.device)  # (S,)
    delta = q_slots[:, None] - k_slots[None, :]  # (T, S): how far back each key is
    mask = delta >= 0
    if window is not None:
        mask = mask & (delta < window)
    mask = mask[None, None]  # (1, 1, T, S)
    if first_valid is not None:
        real_key = k_slots[None, :] >= first_valid[:, None]  # (B, S)
        mask = mask & (real_key[:, None, None, :] | (delta == 0)[None, None])  # (B, 1, T, S)
    if segments is not None:
        mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])  # (B, 1, T, S)
    return mask


def segment_positions(segments: Tensor) -> Tensor:
    """Each token's position within its document (B, T), given runs of equal ids in segments."""
    T = segments.size(1)
    index = torch.arange(T, device=segments.device).expand_as(segments)  # (B, T)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first
