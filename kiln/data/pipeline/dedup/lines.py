"""Exact line (or paragraph) dedup across the corpus: units that repeat in many documents go.

Boilerplate — navigation, cookie banners, "Share this story", a site's footer — is the same line
on thousands of pages; each page is otherwise its own. So a unit (a line, or a paragraph: lines
up to a blank line) that occurs in at least `min_documents` distinct documents is removed from
every document, and the document is kept (a document left with nothing is removed). This is
CCNet's paragraph dedup (Wenzek et al. 2020, Sec. 3.1) and datatrove's sentence dedup with a
count threshold; RefinedWeb (Penedo et al. 2023) also runs it after document dedup.

Units are counted over the documents that survive document-level dedup and decontamination: a
document copied ten times would otherwise mark all of its own lines as boilerplate. A unit's key
is BLAKE2b-64 of its text with surrounding whitespace stripped; units shorter than `min_chars`
(blank lines, "The end.") are never counted or removed.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

from kiln.errors import KilnError

UNITS = ("line", "paragraph")
_PARAGRAPH_BREAK = re.compile(r"\n[^\S\n]*\n\s*")


@dataclass(frozen=True)
class LineDedupConfig:
    """Cross-document line/paragraph dedup (off by default: it rewrites documents)."""

    enabled: bool = False
    unit: str = "line"  # "line" or "paragraph" (lines up to a blank line)
    min_documents: int = 3  # a unit in at least this many distinct documents is removed
    min_chars: int = 10  # shorter units are left alone (blank lines, "The end.")

    def __post_init__(self) -> None:
        where = "dedup.lines"
        if self.unit not in UNITS:
            raise KilnError(f"{where}.unit = {self.unit!r}: expected one of {UNITS}")
        if self.min_documents < 2:
            raise KilnError(
                f"{where}.min_documents = {self.min_documents}: expected an integer >= 2 "
                f"(a unit in one document is not a repeat)"
            )
        if self.min_chars < 1:
            raise KilnError(f"{where}.min_chars = {self.min_chars}: expected an integer >= 1")


def split_units(text: str, unit: str) -> list[str]:
    """The text cut into units, separators kept at each unit's end, so "".join() gives it back."""
    if unit == "line":
        return text.splitlines(keepends=True)
    parts, start = [], 0
    for match in _PARAGRAPH_BREAK.finditer(text):
        parts.append(text[start : match.end()])
        start = match.end()
    if start < len(text):
        parts.append(text[start:])
    return parts


def unit_key(piece: str, min_chars: int) -> int | None:
    """The unit's 64-bit key, or None for a unit too short to count."""
    stripped = piece.strip()
    if len(stripped) < min_chars:
        return None
    digest = hashlib.blake2b(stripped.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    # int64 so that keys sit in the same arrays as the pipeline's int64 nodes.
    return int.from_bytes(digest, "little", signed=True)


def document_keys(text: str, config: LineDedupConfig) -> np.ndarray:
    """(k,) int64 distinct unit keys of one document, sorted (a document counts a unit once)."""
    keys = {unit_key(p, config.min_chars) for p in split_units(text, config.unit)}
    keys.discard(None)
    return np.array(sorted(keys), dtype=np.int64)  # type: ignore[type-var]


def remove_units(text: str, frequent: set[int], config: LineDedupConfig) -> tuple[str, int]:
    """The text without its frequent units, and how many units were removed."""
    if not frequent:
        return text, 0
    kept, removed = [], 0
    for piece in split_units(text, config.unit):
        if unit_key(piece, config.min_chars) in frequent:
            removed += 1
        else:
            kept.append(piece)
    if not removed:
        return text, 0
    return "".join(kept).strip(), removed


def frequent_keys(rows: np.ndarray, min_documents: int) -> tuple[np.ndarray, np.ndarray]:
    """From (key, node) rows (one per distinct unit of a document): the rows whose key is in at
    least `min_documents` documents, sorted by (key, node), and those distinct keys."""
    if len(rows) == 0:
        return rows.reshape(0, 2), np.zeros(0, dtype=np.int64)
    rows = rows[np.lexsort((rows[:, 1], rows[:, 0]))]
    keys = rows[:, 0]
    new = np.concatenate(([True], keys[1:] != keys[:-1]))
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, len(keys)))  # (distinct keys,)
    frequent = counts >= min_documents
    row_frequent = np.repeat(frequent, counts)
    return rows[row_frequent], keys[starts[frequent]]


@dataclass(frozen=True)
class LineCountJob:
    """Count one partition's unit keys over the surviving documents; write the frequent ones."""

    inputs: tuple[str, ...]  # the filter tasks' unit rows, hash-sliced
    decided: str  # the global pass's folder: `<task>.npz` holds each task's keep mask
    lo: int
    hi: int
    out: str
    buckets: int  # one per task: each tokenize task reads only its own documents' keys
    node_shift: int
    min_documents: int


def run_line_count_job(job: LineCountJob) -> dict[str, int]:
    """Write (node, key) of every surviving document's frequent units, bucketed by task; return
    {"frequent": distinct frequent keys, "rows": rows written}."""
    from kiln.data.pipeline.dedup.partitioned import node_bucket, read_buckets, write_bucketed
    from kiln.data.pipeline.records import load_arrays

    rows = read_buckets(job.inputs, job.lo, job.hi, 2, np.int64)  # (key, node)
    if len(rows):
        task = node_bucket(rows[:, 1], job.node_shift)
        local = rows[:, 1] & np.int64((1 << job.node_shift) - 1)
        alive = np.zeros(len(rows), dtype=bool)
        for t in np.unique(task).tolist():
            keep = load_arrays(f"{job.decided}/{t:06d}.npz")["keep"]
            mine = task == t
            alive[mine] = keep[local[mine]]
        rows = rows[alive]
    hits, keys = frequent_keys(rows, job.min_documents)
    result = hits[:, ::-1].copy()  # (node, key)
    write_bucketed(job.out, result, node_bucket(result[:, 0], job.node_shift), job.buckets)
    return {"frequent": len(keys), "rows": len(result)}
