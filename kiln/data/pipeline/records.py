"""Zstandard-compressed JSON lines: the pipeline's intermediate and audit records."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import zstandard

from kiln.io import atomic_write


def write_records(path: str | os.PathLike[str], records: Iterable[dict[str, Any]]) -> int:
    """Write records as zstd-compressed JSON lines, atomically; return how many."""
    n = 0
    with (
        atomic_write(path, "wb") as raw,
        zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False) as out,
    ):
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False).encode("utf-8"))
            out.write(b"\n")
            n += 1
    return n


def read_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the records of a file written by `write_records`."""
    with open(path, "rb") as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        for line in io.TextIOWrapper(reader, encoding="utf-8"):
            yield json.loads(line)


def save_arrays(path: str | os.PathLike[str], **arrays: np.ndarray) -> None:
    """Save NumPy arrays as one `.npz`, atomically."""
    with atomic_write(path, "wb") as handle:
        np.savez(handle, **arrays)


def save_array(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """Save one array as `.npy` (memory-mappable), atomically."""
    with atomic_write(path, "wb") as handle:
        np.save(handle, array)


def load_arrays(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Load every array of an `.npz` written by `save_arrays`."""
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def hash64(*parts: object) -> int:
    """A stable 64-bit hash of the parts' text (the same in every process and on every run)."""
    import hashlib

    text = "\x1f".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def unit_interval(*parts: object) -> float:
    """A stable pseudo-random number in [0, 1) drawn from the parts' text."""
    return hash64(*parts) / 2.0**64
