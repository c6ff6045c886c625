"""StreamingLLM-style decoding: keep the first n_sink tokens and a sliding window in the cache.

Generation and scoring then run past block_size with bounded memory: when the cache is full, the
oldest tokens after the sinks are evicted and the kept window moves left. Positions are those
inside the cache (as in StreamingLLM), so the window's cached RoPE keys are rotated back by the
evicted count: RoPE's rotations compose exactly, R(p - e) = R(-e)·R(p). (MLA's cached RoPE key
is its "value" slot, see ModelConfig.kv_cache_dims; learned absolute positions keep what they
were cached with.) With n_sink = 0 this is plain window eviction, the baseline that degrades
once the first tokens, where trained models park spare attention, leave the cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.model.config import ModelConfig
from kiln.model.generate import sample_next
from kiln.model.rope import rotate_positions
from kiln.model.transformer import Transformer


class SinkCache:
    """An AttentionCache of n_sink + window slots that evicts the oldest non-sink tokens."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        n_sink: int,
        window: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if n_sink < 0 or window < 1 or n_sink + window > cfg.block_size:
            raise KilnError(
                f"streaming needs n_sink >= 0, window >= 1 and n_sink + window <= block_size "
                f"({cfg.block_size}), got n_sink={n_sink}, window={window}"
            )
        self.cfg, self.n_sink, self.window = cfg, n_sink, window
        self.capacity = n_sink + window
        heads, k_dim, v_dim = cfg.kv_cache_dims
        shape = (batch_size, heads, self.capacity)
        self.k = [
            torch.zeros(*shape, k_dim, device=device, dtype=dtype) for _ in range(cfg.n_layer)
        ]
        self.v = [
            torch.zeros(*shape, v_dim, device=device, dtype=dtype) for _ in range(cfg.n_layer)
        ]
        self.length = 0
        self.first_valid: Tensor | None = None
        self.evicted = 0  # tokens dropped so far

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, H, T, D) after the cached prefix; return the whole cache (.., S, D)."""
        end = self.length + k.size(2)
        if end > self.capacity:
            raise KilnError(f"streaming cache holds {self.capacity} tokens; call make_room first")
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        """Mark n more slots as filled."""
        self.length += n

    def make_room(self, n: int) -> None:
        """Evict the oldest window tokens so n more fit; the kept ones move back in position."""
        if n > self.window:
            raise KilnError(f"cannot add {n} tokens at once to a window of {self.window}")
        drop = self.length + n - self.capacity
        if drop <= 0:
            return
        keep = slice(self.n_sink + drop, self.length)
        to = slice(self.n_sink, self.length - drop)
        rotated = self.v if self.cfg.mla is not None else self.k  # where the RoPE key lives
        for layer in range(self.cfg.n_layer):
            for store in (self.k, self.v):
                moved = store[layer][:, :, keep].clone()
                if store is rotated and self.cfg.pos_emb == "rope":
                    moved = rotate_positions(self.cfg, moved, -drop)
                store[layer][:, :, to] = moved
        self.length -= drop
        self.evicted += drop


@torch.inference_mode()
def streaming_nll(
    model: Transformer, ids: Sequence[int], n_sink: int, window: int, chunk: int = 1
) -> Tensor:
    """Per-token negative log-likelihood (len(ids) - 1,) of a text of any length, read in chunks
    of `chunk` tokens through a SinkCache (chunk 1 is exact streaming decoding)."""
    param = next(model.parameters())
    cache = SinkCache(model.cfg, 1, n_sink, window, device=param.device, dtype=param.dtype)
    tokens = torch.tensor([list(ids)], device=param.device)
    out = []
    for start in range(0, tokens.size(1) - 1, chunk):
        piece = tokens[:, start : min(start + chunk, tokens.size(1) - 1)]
        cache.make_room(piece.size(1))
        logits = model.logits(model.hidden(piece, cache)).float()  # (1, t, V)
        targets = tokens[:, start + 1 : start + 1 + piece.size(1)]
        out.append(torch.nn.functional.cross_entropy(logits[0], targets[0], reduction="none"))
    return torch.cat(out)


@torch.inference_mode()
def stream_generate(
    model: Transformer,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    n_sink: int = 4,
    window: int | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
) -> Iterator[int]:
    """Yield new tokens for one prompt, for as long as asked, with a bounded SinkCache.

    window defaults to block_size - n_sink. The prompt is fed in window-sized chunks.
    """
    if not prompt:
        raise KilnError("every prompt needs at least one token")
    window = window or model.cfg.block_size - n_sink
    param = next(model.parameters())
    cache = SinkCache(model.cfg, 1, n_sink, window, device=param.device, dtype=param.dtype)
    generator = torch.Generator(device=param.device).manual_seed(seed) if seed is not None else None
    tokens = torch.tensor([list(prompt)], device=param.device)
    for start in range(0, tokens.size(1), window):
        piece = tokens[:, start : start + window]
        cache.make_room(piece.size(1))
        logits = model.logits(model.hidden(piece, cache)[:, -1])
    for _ in range(max_new_tokens):
        token = sample_next(logits, temperature, generator=generator)  # (1,)
        yield int(token)
        cache.make_room(1)
        logits = model.logits(model.hidden(token[:, None], cache)[:, -1])
