"""On-disk layout of one token shard: the `.bin` and `.idx` headers and how to read them back.

`<split>_<NNNNNN>.bin`: a 32-byte header, then the tokens (little-endian uint16 or uint32).

    offset  size  field
    0       8     magic b"KILNTOK\\0"
    8       4     format version (uint32, little-endian)
    12      4     dtype code: bytes per token (2 = uint16, 4 = uint32)
    16      8     token count (uint64)
    24      8     reserved (zero)

`<split>_<NNNNNN>.idx`: a 32-byte header, then `documents + 1` int64 offsets (the start of every
document within the shard, plus the end of the last one), then `documents` int32 source indices
(positions in the manifest's `sources` list). The source array lives in the idx file rather than
the manifest so each document's origin is recovered without scanning anything else.

    offset  size  field
    0       8     magic b"KILNIDX\\0"
    8       4     format version (uint32)
    12      4     reserved (zero)
    16      8     document count (uint64)
    24      8     token count (uint64), the same as the `.bin` header's
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

SHARD_VERSION = 1
HEADER_BYTES = 32
BIN_MAGIC = b"KILNTOK\0"
IDX_MAGIC = b"KILNIDX\0"
_HEADER = struct.Struct("<8sIIQQ")
assert _HEADER.size == HEADER_BYTES

DTYPES: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
OFFSET_DTYPE = np.dtype("<i8")
SOURCE_DTYPE = np.dtype("<i4")


def dtype_for_vocab(n_vocab: int) -> np.dtype:
    """uint16 when every id fits in 16 bits, else uint32."""
    return DTYPES[2] if n_vocab <= 1 << 16 else DTYPES[4]


def dtype_name(dtype: np.dtype) -> str:
    """The manifest's name for a token dtype (`uint16` or `uint32`)."""
    return f"uint{dtype.itemsize * 8}"


def dtype_from_name(name: str) -> np.dtype:
    """Inverse of `dtype_name`; an unknown name is a KilnError."""
    for dtype in DTYPES.values():
        if dtype_name(dtype) == name:
            return dtype
    raise KilnError(f"unknown token dtype {name!r}; expected uint16 or uint32")


def shard_stem(split: str, index: int) -> str:
    """`train_000003`: the file name of a shard without its suffix."""
    return f"{split}_{index:06d}"


def pack_bin_header(dtype: np.dtype, n_tokens: int) -> bytes:
    """The 32-byte header of a `.bin` file."""
    return _HEADER.pack(BIN_MAGIC, SHARD_VERSION, dtype.itemsize, n_tokens, 0)


def pack_idx_header(n_documents: int, n_tokens: int) -> bytes:
    """The 32-byte header of an `.idx` file."""
    return _HEADER.pack(IDX_MAGIC, SHARD_VERSION, 0, n_documents, n_tokens)


@dataclass(frozen=True)
class BinHeader:
    """What a `.bin` header says."""

    dtype: np.dtype
    n_tokens: int


def _read_header(path: Path, magic: bytes, kind: str) -> tuple[int, int, int]:
    if not path.is_file():
        raise KilnError(f"{path}: missing {kind} file")
    with open(path, "rb") as handle:
        raw = handle.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise KilnError(f"{path}: truncated header ({len(raw)} of {HEADER_BYTES} bytes)")
    found, version, field_a, field_b, field_c = _HEADER.unpack(raw)
    if found != magic:
        raise KilnError(f"{path}: not a kiln {kind} file (magic {found!r}, expected {magic!r})")
    if version != SHARD_VERSION:
        raise KilnError(f"{path}: {kind} format version {version}, this kiln reads {SHARD_VERSION}")
    return field_a, field_b, field_c


def read_bin_header(path: Path) -> BinHeader:
    """Read and check a `.bin` header, including that the file holds exactly its tokens."""
    code, n_tokens, _ = _read_header(path, BIN_MAGIC, "token shard (.bin)")
    if code not in DTYPES:
        raise KilnError(f"{path}: dtype code {code} in header, expected 2 (uint16) or 4 (uint32)")
    dtype = DTYPES[code]
    expected = HEADER_BYTES + n_tokens * dtype.itemsize
    actual = os.path.getsize(path)
    if actual != expected:
        raise KilnError(
            f"{path}: file is {actual} bytes but its header promises {n_tokens} "
            f"{dtype_name(dtype)} tokens ({expected} bytes); the shard is truncated or corrupt"
        )
    return BinHeader(dtype, n_tokens)


def read_idx(path: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """Read and check an `.idx` file: (offsets[documents + 1], sources[documents], n_tokens)."""
    _, n_docs, n_tokens = _read_header(path, IDX_MAGIC, "document index (.idx)")
    expected = HEADER_BYTES + (n_docs + 1) * OFFSET_DTYPE.itemsize + n_docs * SOURCE_DTYPE.itemsize
    actual = os.path.getsize(path)
    if actual != expected:
        raise KilnError(
            f"{path}: file is {actual} bytes but its header promises {n_docs} documents "
            f"({expected} bytes); the index is truncated or corrupt"
        )
    offsets = np.fromfile(path, OFFSET_DTYPE, count=n_docs + 1, offset=HEADER_BYTES)
    sources_at = HEADER_BYTES + (n_docs + 1) * OFFSET_DTYPE.itemsize
    sources = np.fromfile(path, SOURCE_DTYPE, count=n_docs, offset=sources_at)
    if offsets[0] != 0 or offsets[-1] != n_tokens or np.any(np.diff(offsets) <= 0):
        raise KilnError(
            f"{path}: document offsets must rise strictly from 0 to the token count {n_tokens}"
        )
    return offsets, sources, n_tokens
