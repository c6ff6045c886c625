"""Per-sequence recurrent state for Mamba-2 / Gated DeltaNet layers, beside the paged KV blocks.

A recurrent layer keeps a fixed-size state per sequence (its conv window and its SSM / delta-rule
matrix) instead of keys and values per token, so it takes no KV blocks: each running sequence
holds one slot of this pool for its whole life, whatever its length. The pool is preallocated,
one slot per sequence that can run at once (engine.max_num_seqs) plus a scratch slot that takes
the dummy rows of a decode tile; a slot is zeroed when handed out (zero state = no tokens yet).

`scan` runs a layer's recurrent core (the mixer's `scan`, kiln/model/ssm.py) over one engine
step's packed row: each prefill segment alone (chunked form, from its sequence's state; a
sequence's consecutive chunks in one step run in order), then the single-token decode rows
batched (recurrent form). With invariant=True the decode rows run in tiles of exactly SEQ_TILE
sequences (dummy rows fill the last tile), so every call's shapes are fixed and a row's bits do
not depend on how many others decode, as for attention (paged_cache.py).

A sequence's state cannot be rebuilt from its blocks, so prefix caching is off for these models
(a cached prefix would need a state snapshot at every block boundary) and preemption frees the
slot and recomputes the sequence from its tokens, like its KV blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from kiln.serve.engine.paged_cache import PagedStep

Core = Callable[..., tuple[Tensor, tuple[Tensor, Tensor]]]


def recurrent_layers(model: nn.Module) -> dict[int, nn.Module]:
    """The model's recurrent mixers by layer index (those with a `state_shapes`)."""
    return {
        i: block.attn for i, block in enumerate(model.blocks) if hasattr(block.attn, "state_shapes")
    }


def state_bytes_per_sequence(model: nn.Module) -> int:
    """Bytes of recurrent state one sequence holds (fp32), over all recurrent layers."""
    total = 0
    for mixer in recurrent_layers(model).values():
        for shape in mixer.state_shapes():
            total += 4 * int(torch.Size(shape).numel())
    return total


class StatePool:
    """num_slots per-sequence states of every recurrent layer, and the slots' books."""

    def __init__(self, model: nn.Module, num_slots: int, device: torch.device, *,
                 invariant: bool = True, tile: int = 4) -> None:  # fmt: skip
        self.layers = recurrent_layers(model)
        self.num_slots = num_slots
        self.scratch = num_slots  # dummy rows of a decode tile write here
        self.invariant, self.tile = invariant, tile
        # fp32 whatever the model's dtype: the SSM state is fp32 in the layers already, and a
        # bf16 conv window is exact in fp32.
        self.conv: dict[int, Tensor] = {}
        self.ssm: dict[int, Tensor] = {}
        for layer, mixer in self.layers.items():
            conv_shape, ssm_shape = mixer.state_shapes()
            self.conv[layer] = torch.zeros(num_slots + 1, *conv_shape, device=device)
            self.ssm[layer] = torch.zeros(num_slots + 1, *ssm_shape, device=device)
        self.free: deque[int] = deque(range(num_slots))
        self.held: set[int] = set()

    def allocate(self) -> int:
        """A zeroed slot (the state before any token)."""
        if not self.free:
            raise RuntimeError("recurrent state pool exhausted (more running than max_num_seqs)")
        slot = self.free.popleft()
        for layer in self.layers:
            self.conv[layer][slot].zero_()
            self.ssm[layer][slot].zero_()
        self.held.add(slot)
        return slot

    def copy(self, src: int, dst: int) -> None:
        """Copy one slot's states into another (a forked sample continues its parent's prompt)."""
        for layer in self.layers:
            self.conv[layer][dst] = self.conv[layer][src]
            self.ssm[layer][dst] = self.ssm[layer][src]

    def release(self, slot: int) -> None:
        """Give a slot back."""
        if slot not in self.held:
            raise RuntimeError(f"recurrent state slot {slot} released but not held")
        self.held.remove(slot)
        self.free.append(slot)

    def audit(self, slots: Iterable[int]) -> None:
        """Check the books: the held slots are exactly the running sequences' ones."""
        slots = list(slots)
        if len(set(slots)) != len(slots):
            raise AssertionError("two running sequences share a recurrent state slot")
        if set(slots) != self.held:
            raise AssertionError(
                f"recurrent state slots held {sorted(self.held)}, running sequences have "
                f"{sorted(slots)}"
            )
        if len(self.held) + len(self.free) != self.num_slots or self.held & set(self.free):
            raise AssertionError("recurrent state slots leaked or double-listed")

    def _state(self, layer: int, slots: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return self.conv[layer][slots].to(dtype), self.ssm[layer][slots]

    def _store(self, layer: int, slots: Tensor, state: tuple[Tensor, Tensor]) -> None:
        self.conv[layer][slots] = state[0].float()
        self.ssm[layer][slots] = state[1].float()

    def scan(self, step: PagedStep, layer: int, core: Core, inputs: tuple[Tensor, ...]) -> Tensor:
        """core over every segment of step's packed inputs (1, N, ·): outputs (1, N, ·)."""
        with torch._C.DisableTorchFunction():  # no weight matmuls here: skip the tiling mode
            return self._scan(step, layer, core, inputs)

    def _scan(self, step: PagedStep, layer: int, core: Core, inputs: tuple[Tensor, ...]) -> Tensor:
        device, dtype = inputs[0].device, inputs[0].dtype
        parts: list[tuple[Tensor, Tensor]] = []  # (rows, outputs (rows, ·))
        at = 0
        decode_rows: list[int] = []
        decode_slots: list[int] = []
        for seg in step.segments:
            T = seg.end - seg.start
            assert seg.state is not None, "a segment of a recurrent model has no state slot"
            if T == 1:
                decode_rows.append(at)
                decode_slots.append(seg.state)
            else:
                slot = torch.tensor([seg.state], device=device)
                y, new = core(*(t[:, at : at + T] for t in inputs),
                              state=self._state(layer, slot, dtype), one_step=False)  # fmt: skip
                self._store(layer, slot, new)
                parts.append((torch.arange(at, at + T, device=device), y[0]))
            at += T
        size = self.tile if self.invariant else max(1, len(decode_rows))
        for t in range(0, len(decode_rows), size):
            rows, slots = decode_rows[t : t + size], decode_slots[t : t + size]
            n = len(rows)
            if self.invariant:  # dummy rows (the first row's inputs, the scratch state)
                rows = rows + [rows[0]] * (size - n)
                slots = slots + [self.scratch] * (size - n)
            r = torch.tensor(rows, device=device)
            s = torch.tensor(slots, device=device)
            if self.invariant and n < size:
                self.conv[layer][self.scratch] = 0.0
                self.ssm[layer][self.scratch] = 0.0
            xs = tuple(x[0].index_select(0, r)[:, None] for x in inputs)  # (b, 1, ·)
            y, new = core(*xs, state=self._state(layer, s, dtype), one_step=True)
            self._store(layer, s, new)  # the scratch slot takes the dummies' states
            parts.append((r[:n], y[:n, 0]))
        width = parts[0][1].size(-1)
        out = torch.zeros(1, at + step.pad_tokens, width, device=device, dtype=parts[0][1].dtype)
        for rows, y in parts:
            out[0].index_copy_(0, rows, y)
        return out  # padding rows stay zero
