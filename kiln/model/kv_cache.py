"""The KV cache the model decodes against: its small interface, and the preallocated cache.

The model (layers, transformer) accepts any object with the `AttentionCache` interface and
imports nothing from generation; `KVCache` is the fixed-batch cache `kiln.model.generate` uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

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


class RecurrentCache(AttentionCache, Protocol):
    """A cache that also holds Mamba-2 / Gated DeltaNet layers' fixed-size states."""

    def recurrent(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """This layer's (conv state (B, C, K-1), SSM state), or None before the first token."""
        ...

    def set_recurrent(self, layer: int, conv: Tensor, state: Tensor) -> None:
        """Replace this layer's states (called by the layer on every forward)."""
        ...


class PagedAttentionCache(AttentionCache, Protocol):
    """A cache that places every token itself and runs attention over its own layout.

    For ragged batches (the serving engine): the model takes the positions from `positions`
    instead of `length`/`first_valid`, and each attention layer calls `attend` instead of
    `update` + the model's attention, so a row sees exactly its own sequence's keys.
    """

    positions: Tensor  # (B, T): each token's position in its own sequence

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None, *,
        scale: float | None = None, sinks: Tensor | None = None, softcap: float | None = None,
    ) -> Tensor:  # fmt: skip
        """Store k, v (B, H_kv, T, D); attention output (B, H, T, D) of q over each own prefix."""
        ...

    def attend_latent(
        self, layer: int, q: Tensor, kv: Tensor, v_dim: int, window: int | None, *,
        scale: float, sinks: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """MLA: store kv (B, 1, T, R + r); attention (B, H, T, v_dim) over the cached kv, whose
        first v_dim columns are the values (q arrives absorbed into the latent space)."""
        ...

    def scan(self, layer: int, core: Callable[..., Any], *inputs: Tensor) -> Tensor:
        """A recurrent layer's core(*inputs, state=..., one_step=...) per sequence, its state kept."""
        ...


class KVCache:
    """Keys and values of every layer, preallocated (B, H_kv, max_len, D): GQA stores H_kv heads.

    Recurrent layers (model.layer_pattern) store no keys: their constant-size state instead.
    """

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
        attention = [cfg.layer_mixer(i) == "attention" for i in range(cfg.n_layer)]
        none = torch.empty(0, device=device, dtype=dtype)
        self.k = [
            torch.zeros(k_shape, device=device, dtype=dtype) if a else none for a in attention
        ]
        self.v = [
            torch.zeros(v_shape, device=device, dtype=dtype) if a else none for a in attention
        ]
        self.states: dict[int, tuple[Tensor, Tensor]] = {}  # recurrent layers: (conv, SSM)
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

    def recurrent(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """This layer's (conv state, SSM state), or None before the first token."""
        return self.states.get(layer)

    def set_recurrent(self, layer: int, conv: Tensor, state: Tensor) -> None:
        """Replace this layer's states (called by the layer on every forward)."""
        self.states[layer] = (conv, state)
