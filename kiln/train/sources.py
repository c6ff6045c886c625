"""What the trainer reads its batches from: the `TrainData` interface and pre-training's shards.

The trainer needs five things of its data: the vocabulary size, a fingerprint of the contents
(checked on resume, kept in every checkpoint), a resumable loader per split (`next_batch()` and
`cursor`, a pure function of seed and cursor like kiln.data.Loader), how many rows the val split
holds, and optionally a sampler for the eval-step samples. A batch's `to_torch(device)` gives
(inputs, targets, *extra): the extra tensors go to the model after the targets (post-training's
packed rows add their segment ids there). `TokenShards` is the pre-training data; post-training
supplies its own (kiln.posttrain.sft.packing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kiln import checkpoint_format as ckpt
from kiln.data import Dataset, Loader, LoaderCursor
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.train.config import EvalConfig
    from kiln.train.samples import ContinuationSampler


class BatchLoader(Protocol):
    """A resumable stream of batches (kiln.data.Loader is one)."""

    @property
    def cursor(self) -> LoaderCursor:
        """The resume point: a loader built with it yields the batches this one yields next."""
        ...

    def next_batch(self) -> Any:
        """This rank's part of the next global batch (with `to_torch(device)`)."""
        ...


class TrainData(Protocol):
    """The data a Trainer trains on (see the module doc)."""

    vocab_size: int

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the contents wherever they live (resume refuses other data)."""
        ...

    def loader(
        self,
        split: str,
        seq_len: int,
        batch_size: int,
        seed: int,
        cursor: LoaderCursor | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> BatchLoader:
        """Rank `rank`'s loader over `split`: global batches of `batch_size` rows of `seq_len`."""
        ...

    def val_rows(self, seq_len: int) -> int:
        """Rows of `seq_len` the val split holds (>= 1; else a KilnError saying what to do)."""
        ...

    def sampler(self, ev: EvalConfig, seed: int) -> ContinuationSampler | None:
        """The eval-step sampler of `ev`'s prompts, or None."""
        ...


class TokenShards:
    """Pre-training data: a token-shard dataset, read in windows by kiln.data.Loader."""

    def __init__(self, path: str) -> None:
        self.dataset = Dataset.open(path)
        self.vocab_size = self.dataset.vocab_size

    def fingerprint(self) -> dict[str, Any]:
        """Tokenizer and shard checksums (checkpoint.dataset_fingerprint)."""
        return ckpt.dataset_fingerprint(self.dataset.manifest)

    def loader(
        self,
        split: str,
        seq_len: int,
        batch_size: int,
        seed: int,
        cursor: LoaderCursor | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> Loader:
        """kiln.data.Loader over the split."""
        return Loader(self.dataset, split, seq_len, batch_size, seed, cursor, rank, world_size)

    def val_rows(self, seq_len: int) -> int:
        """Windows of seq_len + 1 tokens in the val split."""
        split = self.dataset.split("val")  # a missing split is a clear KilnError
        rows = (split.n_tokens - 1) // seq_len
        if rows < 1:
            raise KilnError(
                f"{self.dataset.root}: the val split has {split.n_tokens} tokens, fewer than "
                f"one window of {seq_len}+1; use more val documents or set eval.batches = 0"
            )
        return rows

    def sampler(self, ev: EvalConfig, seed: int) -> ContinuationSampler | None:
        """Continuations with the dataset's tokenizer (None, warned, when it is missing)."""
        from kiln.train.samples import ContinuationSampler

        return ContinuationSampler.for_dataset(
            self.dataset, ev.sample_prompts, ev.sample_tokens, seed, ev.allow_special
        )
