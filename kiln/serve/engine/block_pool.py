"""The fixed pool of KV blocks: preallocated tensors, reference counts, the prefix cache.

Keys and values of every attention layer live in two tensors (n_attn, H_kv, num_blocks,
block_size, D): GQA stores only the KV heads, and a block's slice of one layer (H_kv, block_size,
D) sits next to the other blocks of that head, so gathering a block table is one index per layer.
An MLA model stores one tensor (n_attn, 1, num_blocks, block_size, R + r): the normed latent and
the shared RoPE key of each token, the latent doubling as the values (absorbed-weight attention,
see kiln/model/mla.py); `v` is then None. Recurrent layers (Mamba-2, Gated DeltaNet) store
nothing here: their per-sequence state lives in state_pool.py.

A full block whose tokens are all computed can be registered under the hash of its tokens and
of everything before it (block-aligned prefix caching). Registered blocks that no sequence holds
any more stay in the cache, least recently used first, until a new block needs their space.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import torch

from kiln.errors import KilnError
from kiln.model.config import ModelConfig

BlockKey = tuple[int, tuple[int, ...]]  # (hash of the key before it, this block's token ids)


FREED = -1  # a block-table entry whose block fell wholly out of every layer's sliding window


def attention_layers(cfg: ModelConfig) -> list[int]:
    """The layers that keep keys and values (every one but the recurrent mixers)."""
    return [i for i in range(cfg.n_layer) if cfg.layer_mixer(i) == "attention"]


def window_groups(cfg: ModelConfig) -> tuple[list[int], list[int]] | None:
    """(global layers, windowed layers) of a model that mixes both; None otherwise (all of
    one kind: one block table serves every layer, see window_blocks.py)."""
    layers = attention_layers(cfg)
    windowed = [i for i in layers if cfg.layer_window(i) is not None]
    if not windowed or len(windowed) == len(layers):
        return None
    return [i for i in layers if i not in windowed], windowed


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes the engine's pool stores per token, over all attention layers.

    GQA: 2·H_kv·D per layer (keys and values); MLA: R + r (the latent, which is also the
    values, and the RoPE key); recurrent layers: nothing (their state is per sequence).
    """
    heads, k_dim, v_dim = cfg.kv_cache_dims
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return len(attention_layers(cfg)) * heads * (k_dim + v_dim) * itemsize


def decompressed_kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes per token a per-head K/V cache of the same model would hold (MLA decompressed)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    heads = cfg.n_head if cfg.mla is not None else cfg.kv_heads
    width = cfg.qk_head_dim + cfg.v_head_dim
    return len(attention_layers(cfg)) * heads * width * itemsize


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all attention layers (0 for a purely recurrent model)."""
    return kv_bytes_per_token(cfg, dtype) * block_size


def block_keys(tokens: Sequence[int], block_size: int, n_blocks: int) -> list[BlockKey]:
    """The prefix-cache keys of the first n_blocks full blocks of tokens."""
    keys: list[BlockKey] = []
    parent = 0
    for i in range(n_blocks):
        key = (parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
        keys.append(key)
        parent = hash(key)
    return keys


class BlockPool:
    """num_blocks KV blocks of block_size tokens; allocation, reference counts, prefix cache."""

    @property
    def layer_bytes_per_block(self) -> int:
        """Bytes one block takes in one of this pool's layers (keys and values)."""
        per = self.k[0, :, 0].numel() * self.k.element_size()
        return per * (1 if self.v is None else 2)

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        layers: Sequence[int] | None = None,
    ) -> None:
        # Two extra blocks, never handed out: one stays all zeros (padded reads point at it, so
        # a masked key always holds finite values: 0 weight x stale NaN would still be NaN),
        # the other takes the writes of padding tokens. `layers`: the attention layers this
        # pool stores (default all; a mixed-window model's groups, see window_blocks.py).
        layers = list(attention_layers(cfg) if layers is None else layers)
        self.index = {layer: i for i, layer in enumerate(layers)}  # model layer -> pool row
        heads, k_dim, v_dim = cfg.kv_cache_dims
        self.latent = cfg.mla is not None  # one [latent | RoPE key] tensor, values inside it
        shape = (len(layers), heads, num_blocks + 2, block_size, k_dim)
        if self.latent:
            shape = (*shape[:-1], k_dim + v_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = None if self.latent else torch.zeros(shape, device=device, dtype=dtype)
        self.zero_slot = num_blocks * block_size  # the first slot of the zero block
        self.scratch_block = num_blocks + 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.idle: OrderedDict[int, None] = OrderedDict()  # registered, unheld: LRU order
        self.key_of: dict[int, BlockKey] = {}
        self.by_key: dict[BlockKey, int] = {}

    # ---------------------------------------------------------------------------- accounting
    @property
    def available(self) -> int:
        """Blocks that can be handed out now (free, or cached but held by nobody)."""
        return len(self.free) + len(self.idle)

    @property
    def used(self) -> int:
        """Blocks not on the free list: held by sequences or kept by the prefix cache."""
        return self.num_blocks - len(self.free)

    @property
    def cached(self) -> int:
        """Blocks the prefix cache keeps that no sequence holds."""
        return len(self.idle)

    def allocate(self) -> int:
        """A block for one holder; evicts the least recently used cached block if none is free."""
        if self.free:
            block = self.free.popleft()
        elif self.idle:
            block, _ = self.idle.popitem(last=False)
            del self.by_key[self.key_of.pop(block)]
        else:
            raise KilnError("the KV block pool is exhausted")
        self.refs[block] = 1
        return block

    def retain(self, block: int) -> None:
        """One more holder of a block (a shared prefix, a forked sample)."""
        if self.refs[block] == 0:
            self.idle.pop(block)
        self.refs[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one hold on each block; unheld blocks go to the cache if registered, else free."""
        for block in blocks:
            if block == FREED:
                continue
            self.refs[block] -= 1
            if self.refs[block] < 0:
                raise RuntimeError(f"KV block {block} released more often than held")
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.idle[block] = None
                else:
                    self.free.append(block)

    # ---------------------------------------------------------------------------- prefix cache
    def register(self, block: int, key: BlockKey) -> None:
        """Make a full, computed block findable by its key (a duplicate key keeps the first)."""
        if key not in self.by_key and block not in self.key_of:
            self.by_key[key] = block
            self.key_of[block] = key

    def lookup(self, keys: Sequence[BlockKey]) -> list[int]:
        """The cached blocks of the longest run of keys from the start (not yet retained)."""
        found = []
        for key in keys:
            block = self.by_key.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def copy(self, src: int, dst: int) -> None:
        """Copy one block's keys and values (copy-on-write of a forked sample's last block)."""
        self.k[:, :, dst] = self.k[:, :, src]
        if self.v is not None:
            self.v[:, :, dst] = self.v[:, :, src]

    def audit(self, tables: Iterable[Sequence[int]]) -> None:
        """Check the books: holds equal the tables' entries; free, idle and held partition."""
        expected = [0] * self.num_blocks
        for table in tables:
            for block in table:
                if block != FREED:
                    expected[block] += 1
        if expected != self.refs:
            bad = next(
                i for i, (a, b) in enumerate(zip(expected, self.refs, strict=True)) if a != b
            )
            raise AssertionError(
                f"KV block {bad}: {self.refs[bad]} holds counted, {expected[bad]} in block tables"
            )
        held = {i for i, r in enumerate(self.refs) if r > 0}
        free, idle = set(self.free), set(self.idle)
        if len(free) != len(self.free) or free & idle or (free | idle) & held:
            raise AssertionError("KV block lists overlap")
        if len(free | idle | held) != self.num_blocks:
            raise AssertionError("KV blocks leaked: neither free, cached nor held")
        if not idle <= set(self.key_of):
            raise AssertionError("an unheld cached block has no key")
