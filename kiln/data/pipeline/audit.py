"""From a training token back to its document, its source, and the removals around it."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.pipeline.records import read_records
from kiln.data.pipeline.writer import DOC_MAP_SUFFIX
from kiln.data.shard_reader import Dataset
from kiln.errors import KilnError


def document_at_token(ds: Dataset, split: str, position: int) -> tuple[int, int, int]:
    """(shard number, document index within the shard, document index within the split)."""
    sp = ds.split(split)
    if not 0 <= position < sp.n_tokens:
        raise KilnError(f"--token {position}: split {split!r} has {sp.n_tokens:,} tokens")
    starts = np.cumsum([0] + [s.tokens.shape[0] for s in sp.shards])
    shard = int(np.searchsorted(starts, position, side="right")) - 1
    local_pos = position - int(starts[shard])
    local_doc = int(np.searchsorted(sp.shards[shard].offsets, local_pos, side="right")) - 1
    before = sum(s.n_documents for s in sp.shards[:shard])
    return shard, local_doc, before + local_doc


def document_record(root: Path, split: str, shard: int, local_doc: int) -> dict[str, Any]:
    """The document map entry (id, source, file, ordinal, copy) of one shard document."""
    path = root / f"{split}_{shard:06d}{DOC_MAP_SUFFIX}"
    if not path.is_file():
        raise KilnError(f"{path}: missing; only datasets made by `kiln data run` map documents")
    record = next(itertools.islice(read_records(path), local_doc, None), None)
    if record is None:
        raise KilnError(f"{path}: has no entry {local_doc}; the dataset is damaged")
    return record


def removed_near(root: Path, file: str, ordinal: int, window: int) -> list[dict[str, Any]]:
    """Removal records of the same input file within `window` records of `ordinal`."""
    path = root / "pipeline" / "removed.jsonl.zst"
    if not path.is_file():
        raise KilnError(f"{path}: missing; the dataset has no removal log")
    near = [
        r
        for r in read_records(path)
        if r["file"] == file and abs(int(r["ordinal"]) - ordinal) <= window
    ]
    return sorted(near, key=lambda r: r["ordinal"])


def explain_token(ds: Dataset, split: str, position: int, window: int = 5) -> str:
    """A few lines: the token's document, where it came from, and removals next to it."""
    shard, local_doc, index = document_at_token(ds, split, position)
    record = document_record(ds.root, split, shard, local_doc)
    lines = [
        f"token {position:,} of {split}: document {index:,} (shard {shard}, #{local_doc})",
        f"  id {record['id']}  source {record['source']}  copy {record['copy']}",
        f"  input {record['file']} record {record['ordinal']}",
    ]
    near = removed_near(ds.root, record["file"], int(record["ordinal"]), window)
    if not near:
        lines.append(f"  no document within {window} records of it was removed")
    else:
        lines.append(f"  removed within {window} records of it:")
        for r in near:
            dup = f" (duplicate of {r['duplicate_of']})" if r.get("duplicate_of") else ""
            lines.append(f"    record {r['ordinal']}: {r['stage']}: {r['reason']}{dup}")
    return "\n".join(lines)
