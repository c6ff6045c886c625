"""The KV cache the model decodes against: its small interface, and the preallocated cache.

The model (layers, transformer) accepts any object with the `AttentionCache` interface and
imports nothing from generation; `KVCache` is the fixed-batch cache `kiln.model.generate` uses.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.model.config import ModelConfig


class AttentionCache(Protocol):
    """What the model needs from a KV cache: store and return each layer's keys and values."""

    length: int  # slots filled so far (the same for every row); new tokens start here
    first_valid: Tensor | None  # (B,) first real slot of each row (left padding), or None

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, H_kv, T, D) after the cached prefix; return the whole prefix (.., S, D)."""
        ...

    def advance(self, n: int) -> None:
        """Mark n more slots as filled (called once per forward, after every layer stored)."""
        ...


class PagedAttentionCache(AttentionCache, Protocol):
    """A cache that places every token itself and runs attention over its own layout.

    For ragged batches (the serving engine): the model takes the positions from `positions`
    instead of `length`/`first_valid`, and each attention layer calls `attend` instead of
    `update` + the model's attention, so a row sees exactly its own sequence's keys.
    """

    positions: Tensor  # (B, T): each token's position in its own sequence

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None) -> Tensor:
        """Store k, v (B, H_kv, T, D); attention output (B, H, T, D) of q over each own prefix."""
        ...


class KVCache:
    """Keys and values of every layer, preallocated (B, H_kv, max_len, D): GQA stores H_kv heads."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        first_valid: Tensor | None = None,
    ) -> None:
        heads, k_dim, v_dim = cfg.kv_cache_dims  # MLA: its latent and RoPE key, one "head"
        k_shape, v_shape = (batch_size, heads, max_len, k_dim), (batch_size, heads, max_len, v_dim)
        self.k = [torch.zeros(k_shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(v_shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.max_len = max_len
        self.length = 0  # slots filled so far (the same for every row)
        self.first_valid = first_valid  # (B,) first real slot of each row, or None: no padding

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, H_kv, T, D) after the cached prefix; return the whole prefix (.., S, D)."""
        end = self.length + k.size(2)
        if end > self.max_len:
            raise KilnError(f"KV cache holds {self.max_len} tokens, asked for {end}")
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        """Mark n more slots as filled (called once per forward, after every layer stored)."""
        self.length += n
