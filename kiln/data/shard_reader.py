"""Read a token-shard dataset: check manifest and headers, memory-map tokens, recover documents."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.data.manifest import MANIFEST_NAME, Manifest, ShardEntry
from kiln.data.shard_format import (
    HEADER_BYTES,
    dtype_from_name,
    dtype_name,
    read_bin_header,
    read_idx,
)
from kiln.data.verified import VerifiedStamp
from kiln.errors import KilnError, not_found
from kiln.io import sha256_file


@dataclass(frozen=True)
class Shard:
    """One shard: its memory-mapped tokens, document offsets and per-document source indices."""

    path: Path
    tokens: np.ndarray  # (n_tokens,) uint16/uint32, memory-mapped read-only
    offsets: np.ndarray  # (documents + 1,) int64: document i is tokens[offsets[i]:offsets[i+1]]
    sources: np.ndarray  # (documents,) int32 indices into the manifest's sources

    @property
    def n_documents(self) -> int:
        """Documents in this shard."""
        return int(self.sources.shape[0])


VERIFY_ENV = "KILN_VERIFY_SHARDS"  # "0" skips the sha256 check of every shard at opening


def verify_by_default() -> bool:
    """Whether `Dataset.open` checks sha256s when not told: yes, unless KILN_VERIFY_SHARDS=0."""
    return os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _open_shard(
    root: Path,
    entry: ShardEntry,
    dtype: np.dtype,
    verify: bool,
    vocab_size: int,
    stamp: VerifiedStamp | None = None,
    trust_stamp: bool = False,
) -> Shard:
    bin_path, idx_path = root / f"{entry.name}.bin", root / f"{entry.name}.idx"
    header = read_bin_header(bin_path)
    if header.dtype != dtype:
        raise KilnError(
            f"{bin_path}: header says {dtype_name(header.dtype)} tokens, the manifest "
            f"{dtype_name(dtype)}"
        )
    if header.n_tokens != entry.tokens:
        raise KilnError(
            f"{bin_path}: header says {header.n_tokens} tokens, the manifest {entry.tokens}"
        )
    offsets, sources, idx_tokens = read_idx(idx_path)
    if idx_tokens != entry.tokens or sources.shape[0] != entry.documents:
        raise KilnError(
            f"{idx_path}: index holds {sources.shape[0]} documents over {idx_tokens} tokens, the "
            f"manifest {entry.documents} over {entry.tokens}"
        )
    if verify:
        for path, expected in ((bin_path, entry.sha256), (idx_path, entry.idx_sha256)):
            if trust_stamp and stamp is not None and stamp.is_verified(path):
                continue
            st, started = path.stat(), time.time_ns()
            if sha256_file(path) != expected:
                raise KilnError(
                    f"{path}: sha256 differs from the manifest's; the file changed or is corrupt "
                    f"(re-create the dataset)"
                )
            if stamp is not None:
                stamp.record(path, st, started)
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(entry.tokens,))
    # The writer records the largest id; a manifest without it (older kiln) costs one scan.
    max_id = entry.max_id if entry.max_id is not None else _scan_max(tokens)
    if max_id >= vocab_size:
        raise KilnError(
            f"{bin_path}: holds token id {max_id}, outside the tokenizer's vocabulary of "
            f"{vocab_size}; the shard is corrupt or from another tokenizer"
        )
    return Shard(bin_path, tokens, offsets, sources)


def _scan_max(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    return max((int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)


class Split:
    """The shards of one split read as one concatenated token sequence of documents."""

    def __init__(
        self, name: str, shards: list[Shard], source_paths: list[str], dtype: np.dtype
    ) -> None:
        self.name, self.dtype = name, dtype
        self.shards = shards
        self._source_paths = source_paths
        self._token_starts = np.cumsum([0] + [s.tokens.shape[0] for s in shards])
        self._doc_starts = np.cumsum([0] + [s.n_documents for s in shards])

    @property
    def n_tokens(self) -> int:
        """Tokens in the split."""
        return int(self._token_starts[-1])

    @property
    def n_documents(self) -> int:
        """Documents in the split."""
        return int(self._doc_starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the concatenated split (a view when in one shard)."""
        if start < 0 or length < 0 or start + length > self.n_tokens:
            raise IndexError(
                f"tokens [{start}, {start + length}) outside split {self.name!r} of "
                f"{self.n_tokens} tokens"
            )
        i = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        pieces, end = [], start + length
        while start < end:
            local = start - int(self._token_starts[i])
            take = min(end - start, self.shards[i].tokens.shape[0] - local)
            pieces.append(self.shards[i].tokens[local : local + take])
            start += take
            i += 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.empty(0, self.dtype)

    def check_ids(self, tokens: np.ndarray, start: int, vocab_size: int) -> None:
        """Refuse `tokens` (read from `start`) if one is outside the vocabulary, naming the shard.

        One max over what is about to be used: opening checks the manifest's recorded maxima, not
        the bytes, so with verification off a corrupted shard is caught here instead of by an
        IndexError deep in the model.
        """
        if tokens.size == 0 or int(tokens.max()) < vocab_size:
            return
        at = int(np.argmax(tokens >= vocab_size))
        position = start + at
        i = int(np.searchsorted(self._token_starts, position, side="right")) - 1
        local = position - int(self._token_starts[i])
        raise KilnError(
            f"{self.shards[i].path}: token {local:,} is id {int(tokens[at])}, outside the "
            f"tokenizer's vocabulary of {vocab_size}; the shard is corrupt or changed since it "
            f"was written (re-create the dataset; `kiln data inspect DIR --verify` checks it)"
        )

    def _locate(self, index: int) -> tuple[Shard, int]:
        if not 0 <= index < self.n_documents:
            raise IndexError(
                f"document {index} outside split {self.name!r} of {self.n_documents} documents"
            )
        i = int(np.searchsorted(self._doc_starts, index, side="right")) - 1
        return self.shards[i], index - int(self._doc_starts[i])

    def document(self, index: int) -> np.ndarray:
        """The tokens of document `index` (ending with end-of-text)."""
        shard, local = self._locate(index)
        return shard.tokens[shard.offsets[local] : shard.offsets[local + 1]]

    def document_start(self, index: int) -> int:
        """Where document `index` starts in the concatenated split (for `check_ids`)."""
        shard, local = self._locate(index)
        i = next(n for n, s in enumerate(self.shards) if s is shard)
        return int(self._token_starts[i]) + int(shard.offsets[local])

    def document_source(self, index: int) -> str:
        """The input file document `index` came from."""
        shard, local = self._locate(index)
        return self._source_paths[int(shard.sources[local])]


class Dataset:
    """A token-shard dataset directory, checked on opening (see `Dataset.open`)."""

    def __init__(self, root: Path, manifest: Manifest, splits: dict[str, Split]) -> None:
        self.root = root
        self.manifest = manifest
        self.splits = splits

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        tokenizer: str | os.PathLike[str] | None = None,
        verify: bool | None = None,
    ) -> Dataset:
        """Open `root`, checking the manifest, every shard header, index and id range, and (when
        given) that `tokenizer` is the file the shards were encoded with.

        `verify` also checks every file's sha256 (so in-range corruption is caught before it is
        trained on). By default (None) it does so on first use, unless the environment sets
        KILN_VERIFY_SHARDS=0: files that passed are stamped in the user cache (`kiln.data.verified`)
        and not hashed again while their size, mtime and inode are unchanged. True hashes every
        file whatever the stamp says.
        """
        trust_stamp = verify is None
        verify = verify_by_default() if verify is None else verify
        root = Path(root)
        manifest = Manifest.read(root)
        stamp = VerifiedStamp.load(root / MANIFEST_NAME) if verify else None
        if tokenizer is not None:
            if not os.path.isfile(tokenizer):
                raise not_found(tokenizer, "tokenizer file")
            found = sha256_file(tokenizer)
            if found != manifest.tokenizer.sha256:
                raise KilnError(
                    f"{tokenizer}: sha256 {found[:12]}… differs from the tokenizer {root} was "
                    f"encoded with ({manifest.tokenizer.sha256[:12]}…, {manifest.tokenizer.path})"
                )
        dtype = dtype_from_name(manifest.dtype)
        sources = [s.path for s in manifest.sources]
        splits = {}
        for name, entry in manifest.splits.items():
            vocab = manifest.tokenizer.vocab_size
            shards = [
                _open_shard(root, s, dtype, verify, vocab, stamp, trust_stamp) for s in entry.shards
            ]
            for shard in shards:
                if shard.n_documents and int(shard.sources.max()) >= len(sources):
                    raise KilnError(f"{shard.path}: source index beyond the manifest's sources")
            splits[name] = Split(name, shards, sources, dtype)
        if stamp is not None:
            stamp.save()
        return cls(root, manifest, splits)

    def split(self, name: str) -> Split:
        """The split called `name`; an unknown name is a KilnError listing the ones there are."""
        if name not in self.splits:
            raise KilnError(f"{self.root}: no split {name!r}; it has {sorted(self.splits)}")
        return self.splits[name]

    @property
    def eot_id(self) -> int:
        """The end-of-text token id every document ends with."""
        return self.manifest.tokenizer.eot_id

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocab size (an embedding table's rows)."""
        return self.manifest.tokenizer.vocab_size
