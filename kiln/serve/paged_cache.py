"""The AttentionCache of one engine step: a ragged batch of segments packed into one row.

Every scheduled piece of work (a decode token, a prefill chunk) is a segment of one sequence;
their tokens are concatenated into a single (1, N) batch so the linear layers run once for all
of them. Attention writes the new keys and values into the block pool, then attends each
segment over its own sequence's blocks (SDPA over the gathered blocks), so a row never sees
another request's keys and its result does not depend on the other segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.model.attention import attention_mask
from kiln.serve.block_pool import BlockPool


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of a sequence whose blocks are `table`, computed in this step."""

    table: tuple[int, ...]
    start: int
    end: int


class PagedStep:
    """Positions, KV slots and per-segment attention for one forward over packed segments."""

    length = 0  # the packed row has no shared prefix: positions come from `positions`
    first_valid = None

    def __init__(self, pool: BlockPool, segments: list[Segment], device: torch.device) -> None:
        bs = pool.block_size
        self.pool = pool
        self.segments = segments
        positions: list[int] = []
        blocks: list[int] = []
        for seg in segments:
            span = range(seg.start, seg.end)
            positions.extend(span)
            blocks.extend(seg.table[p // bs] for p in span)
        pos = torch.tensor(positions, dtype=torch.long)
        self.positions = pos[None].to(device)  # (1, N)
        self.slot_block = torch.tensor(blocks, dtype=torch.long, device=device)  # (N,)
        self.slot_offset = (pos % bs).to(device)  # (N,)
        # One index of the flat (num_blocks * bs) slots per segment, for all its keys so far.
        within = torch.arange(bs)
        self.key_slots = [
            (torch.tensor(seg.table[: -(-seg.end // bs)])[:, None] * bs + within)
            .view(-1)[: seg.end]
            .to(device)
            for seg in segments
        ]
        self.bounds: list[tuple[int, int]] = []
        at = 0
        for seg in segments:
            self.bounds.append((at, at + seg.end - seg.start))
            at += seg.end - seg.start
        self._masks: dict[tuple[int, int | None], Tensor | None] = {}

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Not used: the model calls `attend` on a cache that has it."""
        raise NotImplementedError("PagedStep attends itself; call attend()")

    def advance(self, n: int) -> None:
        """Nothing to do: the engine moves each sequence on after the step."""

    def _mask(self, i: int, window: int | None) -> Tensor | None:
        """Segment i's mask (1, T, S), or None where SDPA's own causal rule is right."""
        key = (i, window)
        if key not in self._masks:
            seg = self.segments[i]
            T, S = seg.end - seg.start, seg.end
            windowed = window is not None and window < S
            if not windowed and (T == 1 or T == S):
                self._masks[key] = None
            else:
                slots = torch.arange(seg.start, seg.end, device=self.positions.device)
                self._masks[key] = attention_mask(slots, S, window, None)[0]  # (1, T, S)
        return self._masks[key]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None) -> Tensor:
        """Store k, v (1, H_kv, N, D) in the pool; attention (1, H, N, D) of each segment."""
        # Plain tensor code, no linear layers: skip torch-function modes (e.g. BatchInvariant)
        # whose per-op Python dispatch would otherwise cost more than these small ops.
        with torch._C.DisableTorchFunction():
            pk, pv = self.pool.k[layer], self.pool.v[layer]  # (H_kv, num_blocks, bs, D)
            pk[:, self.slot_block, self.slot_offset] = k[0].to(pk.dtype)
            pv[:, self.slot_block, self.slot_offset] = v[0].to(pv.dtype)
            H_kv, D = pk.size(0), pk.size(-1)
            flat_k, flat_v = pk.view(H_kv, -1, D), pv.view(H_kv, -1, D)
            q3 = q[0]  # (H, N, D)
            gqa = q3.size(0) != H_kv
            same = pk.dtype == q.dtype
            outs = []
            for i, (slots, (a, b)) in enumerate(zip(self.key_slots, self.bounds, strict=True)):
                keys = flat_k.index_select(1, slots)  # (H_kv, S, D)
                values = flat_v.index_select(1, slots)
                if not same:
                    keys, values = keys.to(q.dtype), values.to(q.dtype)
                mask = self._mask(i, window)
                outs.append(F.scaled_dot_product_attention(
                    q3[:, a:b], keys, values, attn_mask=mask, is_causal=mask is None and b - a > 1,
                    enable_gqa=gqa,
                ))  # fmt: skip
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out[None]  # (1, H, N, D)
