"""The AttentionCache of one engine step: a ragged batch of segments packed into one row.

Every scheduled piece of work (a decode token, a prefill chunk) is a segment of one sequence;
their tokens are concatenated into a single (1, N) batch so the linear layers run once for all
of them. Attention first writes the new keys and values into the block pool, then:

- all single-token (decode) segments attend together: their block tables are gathered into one
  (B, H_kv, S, D) batch padded to a multiple of 16 keys, and attention is computed by explicit
  elementwise products and sums, with the padding masked to exactly zero weight. Every reduction
  then runs over the same values in the same order whatever the padding, so a row's result does
  not depend on the other rows or on how far the longest of them reaches (measured: batched
  matmuls do not have this property on CPU). With invariant=False, one fused SDPA instead;
- each multi-token (prefill) segment attends alone, SDPA over its gathered blocks, with shapes
  that depend only on the segment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.model.attention import attention_mask
from kiln.serve.block_pool import BlockPool

PAD = 16  # decode keys are padded to a multiple of this (a multiple of any SIMD width)


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
        self.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        ends = torch.tensor([s.end for s in decode], dtype=torch.long)
        self.decode_ends = ends.to(device)
        self.decode_slots: Tensor | None = None
        if decode:
            width = -(-max(s.end for s in decode) // PAD) * PAD
            n_blocks = -(-width // bs)
            zero_block = pool.zero_slot // bs
            tables = torch.tensor([
                list(s.table[: -(-s.end // bs)]) + [zero_block] * (n_blocks - -(-s.end // bs))
                for s in decode
            ])  # (B, n_blocks)  # fmt: skip
            slots = (tables[:, :, None] * bs + torch.arange(bs)).view(len(decode), -1)[:, :width]
            beyond = torch.arange(width)[None] >= ends[:, None]
            slots = slots.masked_fill(beyond, pool.zero_slot)
            self.decode_slots = slots.to(device)  # (B, S); padding reads the zero block
        self._masks: dict[tuple[int, int | None], Tensor | None] = {}
        self._valid: dict[int | None, Tensor] = {}

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

    def _decode_valid(self, window: int | None) -> Tensor:
        """(B, S) which padded key slots each decode row may attend to."""
        if window not in self._valid:
            assert self.decode_slots is not None
            k_pos = torch.arange(self.decode_slots.size(1), device=self.device)[None]  # (1, S)
            ends = self.decode_ends[:, None]  # (B, 1): the query sits at end - 1
            valid = k_pos < ends
            if window is not None:
                valid = valid & (k_pos >= ends - window)
            self._valid[window] = valid
        return self._valid[window]

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
            if not self.prefill:
                return self._decode(q3, flat_k, flat_v, window)[None]
            out = torch.empty_like(q3)
            if self.decode_slots is not None:
                out.index_copy_(1, self.decode_rows, self._decode(q3, flat_k, flat_v, window))
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

    def _decode(self, q3: Tensor, flat_k: Tensor, flat_v: Tensor, window: int | None) -> Tensor:
        """Attention (H, B, D) of the B single-token segments over their padded keys."""
        assert self.decode_slots is not None
        B, S = self.decode_slots.shape
        H, D = q3.size(0), q3.size(-1)
        H_kv = flat_k.size(0)
        idx = self.decode_slots.view(-1)
        keys = flat_k.index_select(1, idx).view(H_kv, B, S, D).transpose(0, 1)  # (B, H_kv, S, D)
        values = flat_v.index_select(1, idx).view(H_kv, B, S, D).transpose(0, 1)
        valid = self._decode_valid(window)  # (B, S); padding reads zeros: 0 weight x 0 value
        rows = q3 if self.decode_rows.numel() == q3.size(1) else q3[:, self.decode_rows]
        query = rows.transpose(0, 1).reshape(B, H_kv, H // H_kv, D).to(keys.dtype)  # GQA groups
        if not self.invariant:  # fused SDPA: faster, but its sums follow the padded length
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=valid[:, None, None, :], enable_gqa=False
            )  # (B, H_kv, g, D)
            return out.reshape(B, H, D).transpose(0, 1).to(q3.dtype)
        # Elementwise products summed over the last axis: each sum runs over the same values in
        # the same order for any B or S (GEMM kernels re-block with the shape; these do not).
        scores = (query[:, :, :, None, :] * keys[:, :, None]).sum(-1) * (1.0 / math.sqrt(D))
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))  # (B, H_kv, g, S)
        weights = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = (weights[..., None] * values[:, :, None]).sum(-2)  # (B, H_kv, g, D)
        return out.reshape(B, H, D).transpose(0, 1).to(q3.dtype)  # (H, B, D)
