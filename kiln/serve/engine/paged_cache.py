"""The AttentionCache of one engine step: a ragged batch of segments packed into one row.

Every scheduled piece of work (a decode token, a prefill chunk) is a segment of one sequence;
their tokens are concatenated into a single (1, N) batch so the linear layers run once for all
of them. Attention first writes the new keys and values into the block pool, then:

- single-token (decode) segments attend in groups: each row's keys are gathered from its block
  table and padded (from an all-zero block, masked out) to its bucket, the next power of two of
  its length (at least 16). With invariant=True the rows of one bucket run in tiles of exactly
  SEQ_TILE sequences (the last tile filled with dummy sequences), one batched matmul / softmax /
  matmul per tile: every call's shape is fixed by the bucket alone, never by how many requests
  decode or how long the others are, and each query row's softmax is its own row reduction. A
  row's bits therefore do not depend on the rest of the batch (checked per position in the tile
  by tests/serve/engine/test_invariant.py). With invariant=False all decode rows run as one fused SDPA
  over the longest length instead (fused SDPA is not batch-invariant with 2 threads);
- each multi-token (prefill) segment attends alone, SDPA over its gathered blocks, with shapes
  that depend only on the segment (the scheduler cuts chunks at fixed positions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.model.attention import attention_mask
from kiln.serve.engine.block_pool import BlockPool

PAD = 16  # decode keys are padded to a multiple of this (a multiple of any SIMD width)
SEQ_TILE = 4  # invariant decode attention: sequences per batched call (dummies fill the last)


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of a sequence whose blocks are `table`, computed in this step."""

    table: tuple[int, ...]
    start: int
    end: int


def _slots(table: tuple[int, ...], n: int, bs: int) -> Tensor:
    """Flat pool slots (block * bs + offset) of a sequence's first n tokens."""
    blocks = torch.tensor(table[: -(-n // bs)], dtype=torch.long)
    return (blocks[:, None] * bs + torch.arange(bs)).view(-1)[:n]


class PagedStep:
    """Positions, KV slots and attention for one forward over packed segments."""

    length = 0  # the packed row has no shared prefix: positions come from `positions`
    first_valid = None

    def __init__(
        self,
        pool: BlockPool,
        segments: list[Segment],
        device: torch.device,
        *,
        invariant: bool = True,
        pad_tokens: int = 0,
    ) -> None:
        bs = pool.block_size
        self.pool = pool
        self.invariant = invariant  # decode attention whose rows do not depend on the batch
        self.device = device
        positions: list[int] = []
        blocks: list[int] = []
        for seg in segments:
            span = range(seg.start, seg.end)
            positions.extend(span)
            blocks.extend(seg.table[p // bs] for p in span)
        # Padding tokens (rows that keep the matmuls at a multiple of 4, see invariant.py) sit
        # at position 0, write into the scratch block and attend to nothing.
        positions.extend([0] * pad_tokens)
        blocks.extend([pool.scratch_block] * pad_tokens)
        pos = torch.tensor(positions, dtype=torch.long)
        self.positions = pos[None].to(device)  # (1, N)
        self.slot_block = torch.tensor(blocks, dtype=torch.long, device=device)  # (N,)
        self.slot_offset = (pos % bs).to(device)  # (N,)
        self.prefill: list[tuple[Segment, Tensor, int, int]] = []  # segment, slots, rows a:b
        decode_rows: list[int] = []
        decode: list[Segment] = []
        at = 0
        for seg in segments:
            T = seg.end - seg.start
            if T == 1:
                decode_rows.append(at)
                decode.append(seg)
            else:
                self.prefill.append((seg, _slots(seg.table, seg.end, bs).to(device), at, at + T))
            at += T
        self.n_tokens = at
        zero_block = pool.zero_slot // bs
        if invariant:
            buckets: dict[int, list[int]] = {}
            for i, seg in enumerate(decode):
                buckets.setdefault(max(PAD, 1 << (seg.end - 1).bit_length()), []).append(i)
            groups = [
                g[t : t + SEQ_TILE] for g in buckets.values() for t in range(0, len(g), SEQ_TILE)
            ]
        else:
            groups = [list(range(len(decode)))] if decode else []
        # Per group: packed rows, key slots (B, S) padded from the zero block, key counts.
        self.decode: list[tuple[Tensor, Tensor, Tensor, int]] = []  # + real rows
        for group in groups:
            segs = [decode[i] for i in group]
            width = -(-max(s.end for s in segs) // PAD) * PAD
            rows_of = [decode_rows[i] for i in group]
            if invariant:
                width = max(PAD, 1 << (segs[0].end - 1).bit_length())
                # Dummy sequences (one zero key, the first row's query) keep the tile whole;
                # their outputs are dropped.
                dummies = SEQ_TILE - len(segs)
                segs += [Segment((zero_block,), 0, 1)] * dummies
                rows_of += [rows_of[0]] * dummies
            n_blocks = -(-width // bs)
            tables = torch.tensor([
                list(s.table[: -(-s.end // bs)]) + [zero_block] * (n_blocks - -(-s.end // bs))
                for s in segs
            ])  # (B, n_blocks)  # fmt: skip
            slots = (tables[:, :, None] * bs + torch.arange(bs)).view(len(segs), -1)[:, :width]
            ends = torch.tensor([s.end for s in segs], dtype=torch.long)
            slots = slots.masked_fill(torch.arange(width)[None] >= ends[:, None], pool.zero_slot)
            rows = torch.tensor(rows_of, dtype=torch.long)
            self.decode.append((rows.to(device), slots.to(device), ends.to(device), len(group)))
        self._masks: dict[tuple[int, int | None], Tensor | None] = {}
        self._valid: dict[tuple[int, int | None], Tensor] = {}

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Not used: the model calls `attend` on a cache that has it."""
        raise NotImplementedError("PagedStep attends itself; call attend()")

    def advance(self, n: int) -> None:
        """Nothing to do: the engine moves each sequence on after the step."""

    def _mask(self, i: int, window: int | None) -> Tensor | None:
        """Prefill segment i's mask (1, T, S), or None where SDPA's causal rule is right."""
        key = (i, window)
        if key not in self._masks:
            seg = self.prefill[i][0]
            T, S = seg.end - seg.start, seg.end
            if (window is None or window >= S) and T == S:
                self._masks[key] = None
            else:
                slots = torch.arange(seg.start, seg.end, device=self.device)
                self._masks[key] = attention_mask(slots, S, window, None)[0]  # (1, T, S)
        return self._masks[key]

    def _decode_valid(self, g: int, window: int | None) -> Tensor:
        """(B, S) which padded key slots each row of decode group g may attend to."""
        key = (g, window)
        if key not in self._valid:
            _, slots, ends, _ = self.decode[g]
            k_pos = torch.arange(slots.size(1), device=self.device)[None]  # (1, S)
            valid = k_pos < ends[:, None]  # the query sits at end - 1
            if window is not None:
                valid = valid & (k_pos >= ends[:, None] - window)
            self._valid[key] = valid
        return self._valid[key]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None) -> Tensor:
        """Store k, v (1, H_kv, N, D) in the pool; attention (1, H, N, D) of every segment."""
        # Plain tensor code, no linear layers: skip torch-function modes (e.g. BatchInvariant)
        # whose per-op Python dispatch would otherwise cost more than these small ops.
        with torch._C.DisableTorchFunction():
            pk, pv = self.pool.k[layer], self.pool.v[layer]  # (H_kv, num_blocks, bs, D)
            pk[:, self.slot_block, self.slot_offset] = k[0].to(pk.dtype)
            pv[:, self.slot_block, self.slot_offset] = v[0].to(pv.dtype)
            H_kv, D = pk.size(0), pk.size(-1)
            flat_k, flat_v = pk.view(H_kv, -1, D), pv.view(H_kv, -1, D)
            q3 = q[0]  # (H, N, D)
            out = torch.zeros_like(q3)  # padding rows stay zero
            for g in range(len(self.decode)):
                rows, n = self.decode[g][0], self.decode[g][3]
                out.index_copy_(1, rows[:n], self._decode(g, q3, flat_k, flat_v, window)[:, :n])
            gqa = q3.size(0) != H_kv
            for i, (_, slots, a, b) in enumerate(self.prefill):
                keys = flat_k.index_select(1, slots).to(q.dtype)  # (H_kv, S, D)
                values = flat_v.index_select(1, slots).to(q.dtype)
                mask = self._mask(i, window)
                out[:, a:b] = F.scaled_dot_product_attention(
                    q3[:, a:b], keys, values, attn_mask=mask, is_causal=mask is None,
                    enable_gqa=gqa,
                )  # fmt: skip
        return out[None]  # (1, H, N, D)

    def _decode(
        self, g: int, q3: Tensor, flat_k: Tensor, flat_v: Tensor, window: int | None
    ) -> Tensor:
        """Attention (H, B, D) of decode group g's rows over their padded keys."""
        rows, slots, _, _ = self.decode[g]
        B, S = slots.shape
        H, D = q3.size(0), q3.size(-1)
        H_kv = flat_k.size(0)
        idx = slots.view(-1)
        # Batch dims (H_kv, B): the gathered keys are contiguous as they come (a strided batch
        # would let the matmul choose other kernels, and other bits, for other B).
        keys = flat_k.index_select(1, idx).view(H_kv, B, S, D)
        values = flat_v.index_select(1, idx).view(H_kv, B, S, D)
        valid = self._decode_valid(g, window)[None, :, None, :]  # (1, B, 1, S); padding: zeros
        query = q3.index_select(1, rows).view(H_kv, H // H_kv, B, D).transpose(1, 2)
        query = query.to(keys.dtype).contiguous()  # (H_kv, B, g, D): each KV head's queries
        if not self.invariant:
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=valid)
        else:
            scores = query @ keys.transpose(-2, -1) * (1.0 / math.sqrt(D))  # (H_kv, B, g, S)
            scores = scores.masked_fill(~valid, float("-inf"))
            out = torch.softmax(scores.float(), dim=-1).to(values.dtype) @ values
        # (H_kv, B, g, D) -> (H, B, D) with query head h = kv * g + j
        return out.transpose(1, 2).reshape(H, B, D).to(q3.dtype)
