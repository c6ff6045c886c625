"""The training loader: batches of (T+1)-token windows, a pure function of (data, seed, cursor).

The split (its shards concatenated) is cut into `n_windows = (n_tokens - 1) // T` windows;
window w is tokens[w*T : w*T + T + 1], so consecutive windows share one token and every token
but the first is a target exactly once per epoch. Epoch e visits the windows in the order of a
permutation drawn from (seed, e); the epochs' orders are concatenated into one endless stream
and each global batch takes the next `batch_size` windows of it (a batch may straddle two
epochs, so no window is dropped). Rank r of `world_size` reads the r-th contiguous slice of each
global batch, so the global batch does not depend on the world size.

The cursor (epoch, position) is the stream position: windows of epoch `epoch` already consumed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.data.shard_reader import Dataset, Split
from kiln.errors import KilnError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LoaderCursor:
    """Where the window stream stands: `position` windows of epoch `epoch` are consumed."""

    epoch: int = 0
    position: int = 0

    def to_dict(self) -> dict[str, int]:
        """A JSON-ready form, for checkpoints."""
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> LoaderCursor:
        """Inverse of `to_dict`; a malformed state is a KilnError naming the field."""
        values = {}
        for key in ("epoch", "position"):
            value = state.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise KilnError(f"loader cursor: {key!r} must be an integer >= 0, got {value!r}")
            values[key] = value
        return cls(**values)


@dataclass(frozen=True)
class Batch:
    """One rank's part of a global batch, and the cursor to resume after it."""

    inputs: np.ndarray  # (B_local, T) int64
    targets: np.ndarray  # (B_local, T) int64: inputs shifted left by one token
    cursor: LoaderCursor

    def to_torch(
        self, device: str | torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) as int64 tensors on `device`."""
        import torch

        x, y = torch.from_numpy(self.inputs), torch.from_numpy(self.targets)
        if device is None:
            return x, y
        device = torch.device(device)
        if device.type == "cuda":
            # Pinned host memory lets the copy overlap with compute.
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def epoch_permutation(n_windows: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch `epoch` visits the windows: fixed by (seed, epoch) alone."""
    return np.random.default_rng([seed, epoch]).permutation(n_windows)


def window_stream(
    n_windows: int,
    seed: int,
    cursor: LoaderCursor,
    count: int,
    order_of: Callable[[int], np.ndarray] | None = None,
) -> tuple[np.ndarray, LoaderCursor]:
    """The next `count` window indices of the stream after `cursor`, and the cursor after them.

    `order_of(epoch)` may supply (cached) `epoch_permutation(n_windows, seed, epoch)` results.
    """
    if n_windows < 1:
        raise KilnError("the window stream needs at least one window")
    if order_of is None:
        order_of = functools.partial(epoch_permutation, n_windows, seed)
    epoch, position, parts = cursor.epoch, cursor.position, []
    while count > 0:
        order = order_of(epoch)
        take = min(count, n_windows - position)
        parts.append(order[position : position + take])
        position, count = position + take, count - take
        if position == n_windows:
            epoch, position = epoch + 1, 0
    indices = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    return indices, LoaderCursor(epoch, position)


class Loader:
    """Yields this rank's part of each global batch of `batch_size` windows of `seq_len` + 1."""

    def __init__(
        self,
        dataset: Dataset,
        split: str,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        cursor: LoaderCursor | Mapping[str, Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if seq_len < 1 or batch_size < 1:
            raise KilnError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise KilnError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size % world_size:
            raise KilnError(
                f"the global batch of {batch_size} windows does not divide among "
                f"{world_size} ranks; use a batch size that is a multiple of {world_size}"
            )
        self.split: Split = dataset.split(split)
        self.vocab_size = dataset.vocab_size
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.n_windows = max(0, (self.split.n_tokens - 1) // seq_len)
        if self.n_windows < batch_size:
            raise KilnError(
                f"{dataset.root}: split {split!r} has {self.split.n_tokens} tokens = "
                f"{self.n_windows} windows of {seq_len}+1 tokens, fewer than one global batch "
                f"of {batch_size} windows (needs {batch_size * seq_len + 1} tokens); use a "
                "smaller batch or sequence length, or more data"
            )
        if isinstance(cursor, Mapping):
            cursor = LoaderCursor.from_dict(cursor)
        self._cursor = cursor or LoaderCursor()
        # A permutation costs O(n_windows) to draw: keep the current and next epoch's.
        self._orders: dict[int, np.ndarray] = {}
        if self._cursor.position >= self.n_windows:
            raise KilnError(
                f"loader cursor position {self._cursor.position} is beyond the "
                f"{self.n_windows} windows of split {split!r}; was it saved for other data?"
            )

    @property
    def cursor(self) -> LoaderCursor:
        """The resume point: a loader built with it yields the batches this one yields next."""
        return self._cursor

    @property
    def batches_per_epoch(self) -> float:
        """Global batches in one pass over the windows."""
        return self.n_windows / self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = epoch_permutation(self.n_windows, self.seed, epoch)
        return self._orders[epoch]

    def next_batch(self) -> Batch:
        """This rank's part of the next global batch; advances the cursor by the whole batch."""
        windows, after = window_stream(
            self.n_windows, self.seed, self._cursor, self.batch_size, self._order
        )
        local = self.batch_size // self.world_size
        mine = windows[self.rank * local : (self.rank + 1) * local]
        T = self.seq_len
        rows = np.stack([self.split.read(int(w) * T, T + 1) for w in mine]).astype(np.int64)
        if rows.size and int(rows.max()) >= self.vocab_size:
            for w, row in zip(mine, rows, strict=True):
                self.split.check_ids(row, int(w) * T, self.vocab_size)
        self._cursor = after
        inputs, targets = np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])
        return Batch(inputs=inputs, targets=targets, cursor=after)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()
