"""The windowed layers' own blocks in a model that mixes sliding-window and global attention.

In a mixed model (Gemma-style: some layers see only the last `window` tokens, others all of
them) a block behind the window is still needed by the global layers, so one block table cannot
free it. The engine then keeps two groups of blocks: the main pool holds the global layers'
keys and values, and a second pool (`WindowBlocks.pool`) holds the windowed layers'. Each
sequence has a table per group, with the same logical blocks; the windowed group's entries
behind the window of the sequence's next query are released as the sequence moves on (FREED),
exactly as a model whose every layer is windowed releases its one table.

Because a sequence never holds more windowed blocks than its window and one step's tokens span,
the windowed pool is sized to that bound for every sequence that can run at once, not to the
context: `bound_per_sequence` blocks each. For a long context and a short window that is most of
the windowed layers' memory saved (see kiln/serve/engine/engine.py for the sizing).

Prefix caching: the windowed group's full blocks are registered under the same keys as the
main group's. A prefix hit of n blocks needs the windowed blocks of only the window before
token n·block_size; if one of those was evicted the hit is cut back to a length whose window is
whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from kiln.model.config import ModelConfig
from kiln.serve.engine.block_pool import FREED, BlockKey, BlockPool, window_groups

if TYPE_CHECKING:
    from kiln.serve.engine.scheduler import Sequence as Seq


def bound_per_sequence(window: int, block_size: int, step_tokens: int) -> int:
    """The most windowed blocks one sequence holds: a window behind its first new token plus
    one step's tokens (`step_tokens` at most), each end possibly in a partial block."""
    return -(-(window - 1 + step_tokens) // block_size) + 1


class WindowBlocks:
    """The windowed layers' pool and the per-sequence table operations on it."""

    def __init__(self, pool: BlockPool, window: int, global_layers: list[int]) -> None:
        self.pool = pool
        self.window = window  # the widest window of the windowed layers
        self.bs = pool.block_size
        self.global_layers = global_layers  # the layers the main pool keeps

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, num_blocks: int, block_size: int, max_num_seqs: int,
        step_tokens: int, device: torch.device, dtype: torch.dtype,
    ) -> WindowBlocks | None:  # fmt: skip
        """The windowed group of a mixed model (None for any other): a pool of at most
        num_blocks, `bound_per_sequence` blocks for each of max_num_seqs sequences."""
        groups = window_groups(cfg)
        if groups is None:
            return None
        global_layers, windowed = groups
        window = max(w for i in windowed if (w := cfg.layer_window(i)) is not None)
        size = min(num_blocks, max_num_seqs * bound_per_sequence(window, block_size, step_tokens))
        pool = BlockPool(cfg, size, block_size, device=device, dtype=dtype, layers=windowed)
        return cls(pool, window, global_layers)

    def grow(self, seq: Seq, n_blocks: int) -> None:
        """Extend seq's windowed table to n_blocks entries."""
        for _ in range(n_blocks - len(seq.local)):
            seq.local.append(self.pool.allocate())

    def needs(self, seq: Seq, n_blocks: int) -> int:
        """Blocks growing seq's windowed table to n_blocks entries takes."""
        return max(0, n_blocks - len(seq.local))

    def release(self, seq: Seq, keep: int = 0) -> None:
        """Release seq's windowed entries from `keep` on (all by default)."""
        self.pool.release(seq.local[keep:])
        del seq.local[keep:]
        seq.local_dropped = min(seq.local_dropped, keep)

    def register(self, seq: Seq, keys: Sequence[BlockKey], first: int) -> None:
        """Offer seq's full windowed blocks from `first` on to the prefix cache."""
        for i, key in enumerate(keys[first:], first):
            if seq.local[i] != FREED:
                self.pool.register(seq.local[i], key)

    def first_needed(self, position: int) -> int:
        """The first block a query at `position` attends to in the windowed layers."""
        return max(0, position - self.window + 1) // self.bs

    def drop(self, seq: Seq) -> None:
        """Release the windowed blocks wholly behind the window of seq's next query."""
        behind = self.first_needed(seq.num_computed)
        for i in range(seq.local_dropped, behind):
            if seq.local[i] != FREED:
                self.pool.release([seq.local[i]])
                seq.local[i] = FREED
        seq.local_dropped = max(seq.local_dropped, behind)

    def hit(self, keys: Sequence[BlockKey], n: int) -> tuple[int, list[int]]:
        """The longest prefix hit of at most n blocks whose window is cached: its length and
        the windowed table (FREED before the window), the blocks retained."""
        while n > 0:
            lo = self.first_needed(n * self.bs)
            found = [self.pool.by_key.get(key) for key in keys[lo:n]]
            missing = [i for i, b in enumerate(found, lo) if b is None]
            if not missing:
                table = [FREED] * lo + [b for b in found if b is not None]
                for block in table[lo:]:
                    self.pool.retain(block)
                return n, table
            n = missing[-1]  # a hit can only end before the last missing block
        return 0, []

    def fork(self, parent: Seq, child: Seq, full: int, partial: bool) -> None:
        """The child shares the parent's full windowed prompt blocks; a partial last block is
        copied (each sample writes its own tokens into it)."""
        for block in parent.local[:full]:
            if block != FREED:
                self.pool.retain(block)
        child.local = list(parent.local[:full])
        child.local_dropped = min(parent.local_dropped, full)
        if partial:
            block = self.pool.allocate()
            self.pool.copy(parent.local[full], block)
            child.local.append(block)

    def audit(self, seqs: Iterable[Seq]) -> None:
        """Check the windowed pool's books against the sequences' windowed tables."""
        self.pool.audit(s.local for s in seqs)
