"""Rendered conversations as fixed training rows, and the resumable loader that serves them.

A conversation of n ids and loss mask m gives n - 1 (input, target) pairs: input ids[i], target
ids[i+1] where m[i+1] is set, else IGNORE (the loss skips targets < 0, kiln/model/loss.py), so
only the assistant's replies and their end tokens are learned. A conversation longer than
seq_len + 1 ids is cut to its first seq_len + 1 (`too_long="cut"`), or left out ("drop"): a cut
reply has lost its `<|end|>`, so it teaches the model that a reply of that length goes on, and a
model fed many of them rarely stops (kiln sft's default is "drop").

Two layouts of rows of `seq_len` positions:

- "packed": several conversations per row (best-fit, longest first), each its own segment:
  the model attends only within a segment and restarts positions there (document masking),
  so a packed conversation's logits are those of the conversation alone. The row's free tail
  is padding, a segment of its own with ignored targets.
- "padded": one conversation per row, the tail padding. Plain causal attention suffices (the
  padding comes after the text), at the price of computing the padding.

Rows are fixed once built (the same conversations share a row in every epoch); the loader
visits them in a fresh seeded order each epoch, with kiln.data.loader's window stream, so it is
a pure function of (rows, seed, cursor), like the pre-training loader, and resumes exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from kiln.data.loader import LoaderCursor, window_stream
from kiln.errors import KilnError

IGNORE = -1  # target of a position the loss skips
Layout = Literal["packed", "padded"]
LAYOUTS = ("packed", "padded")
TOO_LONG = ("drop", "cut")


@dataclass(frozen=True)
class Rows:
    """Training rows: inputs, targets and (packed) segment ids, (N, T) each, plus counts."""

    inputs: np.ndarray  # (N, T) int64
    targets: np.ndarray  # (N, T) int64, IGNORE where the loss skips
    segments: np.ndarray | None  # (N, T) int64 per-row conversation numbers; None: padded
    real: np.ndarray  # (N, T) bool: True where a position holds a conversation token
    conversations: int  # how many conversations the rows hold
    truncated: int  # how many of them were cut to seq_len + 1 ids
    dropped: int = 0  # conversations left out for being longer than seq_len + 1 ids

    @property
    def seq_len(self) -> int:
        """Positions per row."""
        return int(self.inputs.shape[1])

    @property
    def n_rows(self) -> int:
        """Number of rows."""
        return int(self.inputs.shape[0])

    @property
    def loss_tokens(self) -> int:
        """Targets the loss counts."""
        return int((self.targets >= 0).sum())

    @property
    def real_tokens(self) -> int:
        """Positions holding conversation tokens (not padding)."""
        return int(self.real.sum())

    def sha256(self) -> str:
        """A digest of the rows' contents (inputs, targets, segments)."""
        digest = hashlib.sha256()
        for array in (self.inputs, self.targets, self.segments):
            if array is not None:
                digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()


def pairs(ids: Sequence[int], loss_mask: Sequence[int]) -> tuple[list[int], list[int]]:
    """(inputs, targets) of one conversation: next-token pairs, unmasked targets IGNORE."""
    if len(ids) != len(loss_mask):
        raise KilnError(f"ids ({len(ids)}) and loss mask ({len(loss_mask)}) differ in length")
    targets = [t if m else IGNORE for t, m in zip(ids[1:], loss_mask[1:], strict=True)]
    return list(ids[:-1]), targets


def build_rows(
    examples: Iterable[tuple[Sequence[int], Sequence[int]]],
    seq_len: int,
    layout: Layout = "packed",
    pad_id: int = 0,
    too_long: str = "cut",
) -> Rows:
    """Rows of `seq_len` positions from rendered conversations (ids, loss_mask) in `layout`;
    conversations longer than a row are cut or dropped (`too_long`)."""
    if layout not in LAYOUTS:
        raise KilnError(f"sft.layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    if too_long not in TOO_LONG:
        raise KilnError(f"data.too_long must be one of {', '.join(TOO_LONG)}; got {too_long!r}")
    if seq_len < 1:
        raise KilnError(f"seq_len must be >= 1, got {seq_len}")
    items, truncated, dropped = [], 0, 0
    for ids, mask in examples:
        x, y = pairs(ids, mask)
        if len(x) > seq_len and too_long == "drop":
            dropped += 1
            continue
        if len(x) > seq_len:
            x, y, truncated = x[:seq_len], y[:seq_len], truncated + 1
        if x and any(t >= 0 for t in y):  # nothing to learn: no row
            items.append((x, y))
    if not items:
        why = (
            f" ({dropped} longer than {seq_len + 1} ids left out: a larger data.seq_len, or "
            'data.too_long = "cut")'
            if dropped
            else ""
        )
        raise KilnError(f"no conversation with an assistant reply to learn from{why}")
    placement = _best_fit([len(x) for x, _ in items], seq_len) if layout == "packed" else None
    n_rows = len(items) if placement is None else max(placement) + 1
    inputs = np.full((n_rows, seq_len), pad_id, dtype=np.int64)
    targets = np.full((n_rows, seq_len), IGNORE, dtype=np.int64)
    segments = np.zeros((n_rows, seq_len), dtype=np.int64) if placement is not None else None
    real = np.zeros((n_rows, seq_len), dtype=bool)
    used = np.zeros(n_rows, dtype=np.int64)
    counts = np.zeros(n_rows, dtype=np.int64)
    for k, (x, y) in enumerate(items):
        row = k if placement is None else placement[k]
        start, end = int(used[row]), int(used[row]) + len(x)
        inputs[row, start:end], targets[row, start:end], real[row, start:end] = x, y, True
        if segments is not None:
            segments[row, start:end] = counts[row]
        used[row], counts[row] = end, counts[row] + 1
    if segments is not None:  # the free tail: a segment of its own, never attended into
        for row in range(n_rows):
            segments[row, used[row] :] = counts[row]
    return Rows(inputs, targets, segments, real, len(items), truncated, dropped)


def _best_fit(lengths: list[int], capacity: int) -> list[int]:
    """The row of each item: longest first, each into the fullest row it fits (a new one else)."""
    free: list[list[int]] = [[] for _ in range(capacity + 1)]  # rows by free positions left
    row_of = [0] * len(lengths)
    n_rows = 0
    for k in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        need = lengths[k]
        room = next((c for c in range(need, capacity + 1) if free[c]), None)
        if room is None:
            row, room = n_rows, capacity
            n_rows += 1
        else:
            row = free[room].pop()
        row_of[k] = row
        free[room - need].append(row)
    return row_of


@dataclass(frozen=True)
class RowBatch:
    """One rank's part of a global batch of rows, and the cursor after the whole batch."""

    inputs: np.ndarray
    targets: np.ndarray
    segments: np.ndarray | None
    cursor: LoaderCursor

    def to_torch(self, device: str | torch.device | None = None) -> tuple[torch.Tensor, ...]:
        """(inputs, targets) or (inputs, targets, segments) as int64 tensors on `device`."""
        arrays = [self.inputs, self.targets]
        if self.segments is not None:
            arrays.append(self.segments)
        return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays)


class RowLoader:
    """Yields this rank's part of each global batch of `batch_size` rows, in seeded epoch orders."""

    def __init__(
        self,
        rows: Rows,
        batch_size: int,
        seed: int = 0,
        cursor: LoaderCursor | None = None,
        rank: int = 0,
        world_size: int = 1,
        name: str = "rows",
    ) -> None:
        if batch_size % world_size:
            raise KilnError(
                f"the global batch of {batch_size} rows does not divide among {world_size} ranks"
            )
        if rows.n_rows < 1:
            raise KilnError(f"{name}: no rows")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self._cursor = cursor or LoaderCursor()
        if self._cursor.position >= rows.n_rows:
            raise KilnError(
                f"loader cursor position {self._cursor.position} is beyond the {rows.n_rows} "
                f"rows of {name}; was it saved for other data?"
            )

    @property
    def cursor(self) -> LoaderCursor:
        """The resume point: a loader built with it yields the batches this one yields next."""
        return self._cursor

    def next_batch(self) -> RowBatch:
        """This rank's part of the next global batch; advances the cursor by the whole batch."""
        order, after = window_stream(self.rows.n_rows, self.seed, self._cursor, self.batch_size)
        local = self.batch_size // self.world_size
        mine = order[self.rank * local : (self.rank + 1) * local]
        segments = self.rows.segments
        self._cursor = after
        return RowBatch(
            self.rows.inputs[mine],
            self.rows.targets[mine],
            None if segments is None else segments[mine],
            after,
        )


def describe(rows: Rows) -> dict[str, Any]:
    """Counts of a row set, for the log and the resolved config."""
    positions = rows.n_rows * rows.seq_len
    return {
        "rows": rows.n_rows,
        "conversations": rows.conversations,
        "truncated": rows.truncated,
        "dropped": rows.dropped,
        "real_tokens": rows.real_tokens,
        "loss_tokens": rows.loss_tokens,
        "fill": rows.real_tokens / positions if positions else 0.0,
    }
