"""The documents that reach the output: compact arrays in memory, their records on disk.

The writer needs, for every surviving document, where its tokens are, its split, source and
length (a few NumPy numbers, ~40 bytes), and at write time its document-map record (id, input
place, history, merged duplicates: often a kilobyte). So the tokenize tasks write the records as
plain JSON lines with a byte-offset array (`DocRecords` reads any one by seeking), plus a small
table of ids and sources; ids are read a task at a time, only to compute the seeded keys.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from kiln.data.pipeline.config import PipelineConfig
from kiln.data.pipeline.mix.plan import SourceMix, plan_mixture
from kiln.data.pipeline.records import hash64, load_arrays, save_array, save_arrays, unit_interval
from kiln.io import atomic_write

RECORDS = "docs.jsonl"
OFFSETS = "docs.offsets.npy"
TABLE = "table.npz"


def write_doc_records(folder: Path, docs: list[dict[str, Any]], is_val: np.ndarray) -> None:
    """A tokenize task's document records (JSON lines with offsets) and its id/source/split
    table."""
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    with atomic_write(folder / RECORDS, "wb") as handle:
        for i, doc in enumerate(docs):
            line = json.dumps(doc, ensure_ascii=False).encode("utf-8") + b"\n"
            handle.write(line)
            offsets[i + 1] = offsets[i] + len(line)
    save_array(folder / OFFSETS, offsets)
    save_arrays(
        folder / TABLE,
        ids=np.array([d["id"] for d in docs], dtype=str),
        sources=np.array([d["source"] for d in docs], dtype=str),
        is_val=is_val,
    )


class DocRecords:
    """Random access to the tokenize tasks' document records (a few files kept open)."""

    def __init__(self, work: Path, keep_open: int = 64) -> None:
        self.work = work
        self.keep_open = keep_open
        self._open: OrderedDict[int, tuple[IO[bytes], np.ndarray]] = OrderedDict()

    def get(self, task: int, index: int) -> dict[str, Any]:
        """Record `index` of tokenize task `task`."""
        if task not in self._open:
            folder = self.work / "tokens" / f"{task:06d}"
            self._open[task] = (open(folder / RECORDS, "rb"), np.load(folder / OFFSETS))  # noqa: SIM115
            if len(self._open) > self.keep_open:
                self._open.popitem(last=False)[1][0].close()
        self._open.move_to_end(task)
        handle, offsets = self._open[task]
        handle.seek(int(offsets[index]))
        return json.loads(handle.readline())

    def close(self) -> None:
        """Close every open file."""
        for handle, _ in self._open.values():
            handle.close()
        self._open.clear()


@dataclass
class Survivors:
    """Every surviving document, in task order, as parallel arrays."""

    task: np.ndarray  # (n,) int32
    local: np.ndarray  # (n,) int32, index within the task's records
    start: np.ndarray  # (n,) int64, first token in the task's tokens.npy
    length: np.ndarray  # (n,) int64, tokens (end-of-text included)
    is_val: np.ndarray  # (n,) bool
    source: np.ndarray  # (n,) int16, index into cfg.sources
    mix_key: np.ndarray  # (n,) float64, the seeded key that orders a source's extra copies

    def __len__(self) -> int:
        return len(self.task)


def _table(work: Path, task: int) -> dict[str, np.ndarray]:
    return load_arrays(work / "tokens" / f"{task:06d}" / TABLE)


def surviving_documents(cfg: PipelineConfig, work: Path, tasks: list[int]) -> Survivors:
    """The survivors of every task, from the tokenize tasks' outputs."""
    names = {s.name: i for i, s in enumerate(cfg.sources)}
    parts: dict[str, list[np.ndarray]] = {k: [] for k in Survivors.__dataclass_fields__}
    for t in tasks:
        lengths = np.load(work / "tokens" / f"{t:06d}" / "lengths.npy")
        table = _table(work, t)
        parts["task"].append(np.full(len(lengths), t, dtype=np.int32))
        parts["local"].append(np.arange(len(lengths), dtype=np.int32))
        parts["start"].append((np.cumsum(lengths) - lengths).astype(np.int64))
        parts["length"].append(lengths.astype(np.int64))
        parts["is_val"].append(table["is_val"])  # line dedup may have emptied some
        parts["source"].append(np.array([names[s] for s in table["sources"]], dtype=np.int16))
        mix = [unit_interval(cfg.seed, "mix", doc_id) for doc_id in table["ids"].tolist()]
        parts["mix_key"].append(np.array(mix, dtype=np.float64))
    empty = {"task": np.int32, "local": np.int32, "start": np.int64, "length": np.int64,
             "is_val": bool, "source": np.int16, "mix_key": np.float64}  # fmt: skip
    return Survivors(
        **{k: np.concatenate(v) if v else np.zeros(0, dtype=empty[k]) for k, v in parts.items()}
    )


def plan_copies(cfg: PipelineConfig, docs: Survivors) -> tuple[np.ndarray, dict[str, Any]]:
    """How many times each document is written (validation: once), and the mixture summary."""
    train = ~docs.is_val
    of_source = [np.flatnonzero(train & (docs.source == k)) for k in range(len(cfg.sources))]
    mixes = [
        SourceMix(
            name=spec.name,
            share=spec.share,
            rate=spec.rate,
            order_keys=docs.mix_key[of_source[k]],
            lengths=docs.length[of_source[k]],
        )
        for k, spec in enumerate(cfg.sources)
    ]
    repeats, summary = plan_mixture(mixes)
    copies = np.ones(len(docs), dtype=np.int64)
    for k, spec in enumerate(cfg.sources):
        copies[of_source[k]] = repeats[spec.name]
    return copies, summary


def output_order(
    cfg: PipelineConfig, work: Path, docs: Survivors, copies: np.ndarray, split: str
) -> tuple[np.ndarray, np.ndarray]:
    """(document index, copy) of every copy written to `split`, in output order: sorted by a
    seeded hash of (id, copy), ties by document then copy."""
    keys, doc_index, copy_of = [], [], []
    wanted = docs.is_val if split == "val" else ~docs.is_val
    bounds = [*np.searchsorted(docs.task, np.unique(docs.task), side="left").tolist(), len(docs)]
    for lo, hi in itertools.pairwise(bounds):
        ids = _table(work, int(docs.task[lo]))["ids"]
        for i in range(lo, hi):
            if wanted[i]:
                for copy in range(int(copies[i])):
                    keys.append(hash64(cfg.seed, "order", str(ids[docs.local[i]]), copy))
                    doc_index.append(i)
                    copy_of.append(copy)
    key = np.array(keys, dtype=np.uint64)
    doc = np.array(doc_index, dtype=np.int64)
    copy_arr = np.array(copy_of, dtype=np.int32)
    order = np.lexsort((copy_arr, doc, key))
    return doc[order], copy_arr[order]
