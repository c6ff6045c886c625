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
  over the longest length instead (fused SDPA is not batch-invariant with 2 threads), and a lone
  decoding sequence whose blocks are consecutive attends a view of the pool: no gather, no mask;
- each multi-token (prefill) segment attends alone, SDPA over its gathered blocks, with shapes
  that depend only on the segment (the scheduler cuts chunks at fixed positions).

Sink logits and score soft-caps (gpt-oss, Gemma 2) go into the same explicit softmax (prefill
segments then use kiln's math attention instead of SDPA). An MLA layer calls `attend_latent`: its
cached [latent | RoPE key] is one key head, the latent's first R columns its values, and the
queries arrive already multiplied into the latent space (absorbed weights, kiln/model/mla.py), so
no step decompresses the cache into per-head keys and values. Recurrent layers call `scan`
(state_pool.py): each segment continues its own sequence's state. Table entries FREED (blocks
that fell out of every sliding window) read the zero block, which the window masks anyway.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.model.attention import attention_mask, math_attention
from kiln.serve.engine.block_pool import FREED, BlockPool

if TYPE_CHECKING:
    from kiln.serve.engine.state_pool import StatePool

PAD = 16  # decode keys are padded to a multiple of this (a multiple of any SIMD width)
SEQ_TILE = 4  # invariant decode attention: sequences per batched call (dummies fill the last)


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of a sequence whose blocks are `table`, computed in this step."""

    table: tuple[int, ...]
    start: int
    end: int
    state: int | None = None  # the sequence's recurrent-state slot (models with recurrent layers)
    local: tuple[int, ...] = ()  # the windowed layers' table of a mixed model (window_blocks.py)


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
        states: StatePool | None = None,
        local: PagedStep | None = None,
    ) -> None:
        bs = pool.block_size
        self.local = local  # the same segments over the windowed layers' pool (mixed models)
        zero_block = pool.zero_slot // bs
        segments = [
            Segment(tuple(zero_block if b == FREED else b for b in s.table), s.start, s.end, s.state)
            for s in segments
        ]  # fmt: skip
        self.pool = pool
        self.states = states
        self.segments = segments
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
        # One flat pool slot per token: a single-index copy is cheaper than (block, offset).
        slot = torch.tensor(blocks, dtype=torch.long) * bs + pos % bs
        self.slot = slot.to(device)  # (N,)
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
        self.pad_tokens = pad_tokens
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
        # A step of decode rows alone, in packed order (the fast path): attention's output is
        # the one group's, its queries are q as it comes, and no zeroed buffer is filled.
        self.decode_only = (not invariant and not self.prefill and pad_tokens == 0
                            and len(self.decode) == 1)  # fmt: skip
        # One decoding sequence (batch 1, fast path): its keys are exactly its own (no padding,
        # no mask), read as a view of the pool when its blocks are consecutive.
        self.single: tuple[int, int] | None = None  # (first slot, key count)
        if self.decode_only and len(decode) == 1:
            seg = decode[0]
            used = seg.table[: -(-seg.end // bs)]
            if all(b == used[0] + j for j, b in enumerate(used)):
                self.single = (used[0] * bs, seg.end)
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

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None, *,
        scale: float | None = None, sinks: Tensor | None = None, softcap: float | None = None,
    ) -> Tensor:  # fmt: skip
        """Store k, v (1, H_kv, N, D) in the pool; attention (1, H, N, D) of every segment."""
        # Plain tensor code, no linear layers: skip torch-function modes (e.g. BatchInvariant)
        # whose per-op Python dispatch would otherwise cost more than these small ops.
        if self.local is not None and layer in self.local.pool.index:
            return self.local.attend(layer, q, k, v, window, scale=scale, sinks=sinks,
                                     softcap=softcap)  # fmt: skip
        with torch._C.DisableTorchFunction():
            i = self.pool.index[layer]
            pk, pv = self.pool.k[i], self.pool.v[i]  # (H_kv, num_blocks, bs, D)
            H_kv, D = pk.size(0), pk.size(-1)
            flat_k, flat_v = pk.view(H_kv, -1, D), pv.view(H_kv, -1, D)
            flat_k.index_copy_(1, self.slot, k[0] if k.dtype == pk.dtype else k[0].to(pk.dtype))
            flat_v.index_copy_(1, self.slot, v[0] if v.dtype == pv.dtype else v[0].to(pv.dtype))
            return self._attend(q[0], flat_k, flat_v, window, scale, sinks, softcap)[None]

    def attend_latent(
        self, layer: int, q: Tensor, kv: Tensor, v_dim: int, window: int | None, *,
        scale: float, sinks: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """Store kv (1, 1, N, R + r); attention (1, H, N, R) of q (1, H, N, R + r) over it.

        The values are the keys' first v_dim columns (MLA's latent): one stored copy.
        """
        if self.local is not None and layer in self.local.pool.index:
            return self.local.attend_latent(layer, q, kv, v_dim, window, scale=scale, sinks=sinks)
        with torch._C.DisableTorchFunction():
            pk = self.pool.k[self.pool.index[layer]]  # (1, num_blocks, bs, R + r)
            flat_k = pk.view(1, -1, pk.size(-1))
            flat_k.index_copy_(1, self.slot, kv[0].to(pk.dtype))
            flat_v = flat_k[..., :v_dim]
            return self._attend(q[0], flat_k, flat_v, window, scale, sinks, None)[None]

    def scan(self, layer: int, core: Callable[..., tuple[Tensor, tuple[Tensor, Tensor]]],
             *inputs: Tensor) -> Tensor:  # fmt: skip
        """A recurrent layer's core over each segment, from and into its sequence's state."""
        assert self.states is not None, "a model with recurrent layers needs the engine's states"
        return self.states.scan(self, layer, core, inputs)

    def _attend(
        self, q3: Tensor, flat_k: Tensor, flat_v: Tensor, window: int | None,
        scale: float | None, sinks: Tensor | None, softcap: float | None,
    ) -> Tensor:  # fmt: skip
        """Attention (H, N, Dv) of the packed queries q3 (H, N, D) over the pool's flat keys."""
        H_kv = flat_k.size(0)
        gqa = q3.size(0) != H_kv
        if self.single is not None and sinks is None and softcap is None:
            first, n = self.single
            if window is None or window >= n:  # every key is visible: no mask, no padding
                keys = flat_k[None, :, first : first + n]  # (1, H_kv, n, D): a view of the pool
                values = flat_v[None, :, first : first + n]
                return F.scaled_dot_product_attention(
                    q3[None].to(keys.dtype), keys, values, scale=scale, enable_gqa=gqa
                )[0].to(q3.dtype)  # (H, 1, Dv)  # fmt: skip
        if self.decode_only:
            return self._decode(0, q3, flat_k, flat_v, window, scale, sinks, softcap)
        out = q3.new_zeros(q3.size(0), q3.size(1), flat_v.size(-1))  # padding rows stay zero
        for g in range(len(self.decode)):
            rows, n = self.decode[g][0], self.decode[g][3]
            part = self._decode(g, q3, flat_k, flat_v, window, scale, sinks, softcap)
            out.index_copy_(1, rows[:n], part[:, :n])
        for i, (_, slots, a, b) in enumerate(self.prefill):
            keys = flat_k.index_select(1, slots).to(q3.dtype)  # (H_kv, S, D)
            values = flat_v.index_select(1, slots).to(q3.dtype)
            mask = self._mask(i, window)
            if sinks is None and softcap is None:
                out[:, a:b] = F.scaled_dot_product_attention(
                    q3[:, a:b], keys, values, attn_mask=mask, is_causal=mask is None,
                    enable_gqa=gqa, scale=scale,
                )  # fmt: skip
            else:  # the explicit softmax: sinks and soft-caps, as kiln.model.attention has them
                out[:, a:b] = math_attention(
                    q3[None, :, a:b], keys[None], values[None],
                    None if mask is None else mask[None], scale=scale, sinks=sinks,
                    softcap=softcap,
                )[0]  # fmt: skip
        return out

    def _decode(
        self, g: int, q3: Tensor, flat_k: Tensor, flat_v: Tensor, window: int | None,
        scale: float | None, sinks: Tensor | None, softcap: float | None,
    ) -> Tensor:  # fmt: skip
        """Attention (H, B, Dv) of decode group g's rows over their padded keys."""
        rows, slots, _, _ = self.decode[g]
        B, S = slots.shape
        H, D = q3.size(0), q3.size(-1)
        H_kv, Dv = flat_k.size(0), flat_v.size(-1)
        group = H // H_kv
        explicit = sinks is not None or softcap is not None
        rows_q = q3 if self.decode_only else q3.index_select(1, rows)  # decode_only: in order
        query = rows_q.view(H_kv, group, B, D).transpose(1, 2)
        query = query.to(flat_k.dtype).contiguous()  # (H_kv, B, g, D): each KV head's queries
        idx = slots.view(-1)
        # Batch dims (H_kv, B): the gathered keys are contiguous as they come (a strided batch
        # would let the matmul choose other kernels, and other bits, for other B).
        keys = flat_k.index_select(1, idx).view(H_kv, B, S, D)
        values = flat_v.index_select(1, idx).view(H_kv, B, S, Dv)
        valid = self._decode_valid(g, window)[None, :, None, :]  # (1, B, 1, S); padding: zeros
        if not self.invariant and not explicit:
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=valid, scale=scale)
        else:
            scale = 1.0 / math.sqrt(D) if scale is None else scale
            scores = query @ keys.transpose(-2, -1) * scale  # (H_kv, B, g, S)
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            scores = scores.masked_fill(~valid, float("-inf")).float()
            if sinks is None:
                weights = torch.softmax(scores, dim=-1)
            else:  # one more logit per head with no value: the head may attend to nothing
                sink = sinks.float().view(H_kv, 1, group, 1).expand(H_kv, B, group, 1)
                weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :S]
            out = weights.to(values.dtype) @ values
        # (H_kv, B, g, Dv) -> (H, B, Dv) with query head h = kv * g + j
        return out.transpose(1, 2).reshape(H, B, Dv).to(q3.dtype)
