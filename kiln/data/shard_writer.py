"""ShardWriter: append documents' tokens to one split's `.bin`/`.idx` shards, rolling over by size."""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import BinaryIO

import numpy as np

from kiln.data.manifest import ShardEntry, SplitEntry
from kiln.data.shard_format import (
    OFFSET_DTYPE,
    SOURCE_DTYPE,
    pack_bin_header,
    pack_idx_header,
    shard_stem,
)
from kiln.io import sha256_file


class ShardWriter:
    """Writes one split's shards into `directory`; a document never straddles two shards."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype = directory, split, dtype
        self.shard_tokens = shard_tokens
        self._entries: list[ShardEntry] = []
        self._handle: BinaryIO | None = None
        self._offsets = array("q", [0])
        self._sources = array("i")
        self._max_id = -1

    def add(self, tokens: np.ndarray, source: int) -> None:
        """Append one document (its tokens already end with end-of-text) from input `source`."""
        n = int(tokens.shape[0])
        if self._handle is not None and self._offsets[-1] + n > self.shard_tokens:
            self._finish_shard()
        if self._handle is None:
            self._start_shard()
        assert self._handle is not None
        self._handle.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        if n:
            self._max_id = max(self._max_id, int(tokens.max()))
        self._offsets.append(self._offsets[-1] + n)
        self._sources.append(source)

    @property
    def finished_shards(self) -> int:
        """How many shards are complete (the open one, if any, is not counted)."""
        return len(self._entries)

    def close(self) -> SplitEntry:
        """Finish the open shard and return the split's entry for the manifest."""
        if self._handle is not None:
            self._finish_shard()
        return SplitEntry(tuple(self._entries))

    def abort(self) -> None:
        """Close the open shard without finishing it (the caller discards the directory)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def _path(self, suffix: str) -> Path:
        return self.directory / f"{shard_stem(self.split, len(self._entries))}{suffix}"

    def _start_shard(self) -> None:
        self._handle = open(self._path(".bin"), "wb")  # noqa: SIM115 - closed in _finish_shard
        # The token count is unknown until the shard closes; the header is rewritten then.
        self._handle.write(pack_bin_header(self.dtype, 0))
        self._offsets = array("q", [0])
        self._sources = array("i")
        self._max_id = -1

    def _finish_shard(self) -> None:
        assert self._handle is not None
        n_tokens, n_docs = self._offsets[-1], len(self._sources)
        self._handle.seek(0)
        self._handle.write(pack_bin_header(self.dtype, n_tokens))
        self._handle.close()
        self._handle = None
        bin_path, idx_path = self._path(".bin"), self._path(".idx")
        with open(idx_path, "wb") as idx:
            idx.write(pack_idx_header(n_docs, n_tokens))
            idx.write(np.frombuffer(self._offsets, dtype=np.int64).astype(OFFSET_DTYPE).tobytes())
            idx.write(np.frombuffer(self._sources, dtype=np.int32).astype(SOURCE_DTYPE).tobytes())
        self._entries.append(
            ShardEntry(
                name=bin_path.stem,
                tokens=n_tokens,
                documents=n_docs,
                sha256=sha256_file(bin_path),
                idx_sha256=sha256_file(idx_path),
                max_id=self._max_id,
            )
        )
