"""The stages that need every document at once: exact, near and line dedup, decontamination.

They run on the fingerprints the filter tasks wrote (exact keys and MinHash band keys, as
hash-sliced rows on disk, and the decontamination verdict), never on the text. Clustering is
`partitioned`'s: jobs over partitions sized by a memory budget, on the run's executor, so no
process holds the corpus's fingerprints; then one job per task decides its documents' fate and
writes its removal records and, for the kept documents of any task, the duplicates merged into
them. Every document is a node whose order key puts validation documents first, then input
order, so a training document that duplicates or nearly duplicates a validation document is the
one removed, and a cluster's representative is its first document by that order.

Near dedup clusters every document, exact duplicates included: an exact duplicate has the band
keys of the copy exact dedup kept, so the clusters of the survivors are the same, and the
document finally kept for any duplicate is its cluster's representative.

Line dedup (`lines`) comes last: its units are counted over the documents the other global
stages kept (so a document's own copies do not make its lines look like boilerplate), and the
tokenize tasks remove the frequent ones from each document.
"""

from __future__ import annotations

import functools
import shutil
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.pipeline.config import PipelineConfig
from kiln.data.pipeline.dedup import partitioned
from kiln.data.pipeline.dedup.bloom import BLOOM_HIT, BloomJob, run_bloom_job
from kiln.data.pipeline.dedup.lines import LineCountJob, run_line_count_job
from kiln.data.pipeline.records import load_arrays, read_records, save_arrays, write_records
from kiln.data.pipeline.task_outputs import (
    DECONTAM_CODES,
    EXACT_ROWS,
    EXCERPT_CHARS,
    LINE_ROWS,
    NEAR_ROWS,
)
from kiln.io import write_json_atomic

GLOBAL_STATS = "stats.json"
TASK_SHIFT = 32  # a node is (training bit << 62) | (task << 32) | index within the task
_TRAIN_BIT = np.int64(1) << np.int64(62)
_LOCAL_MASK = np.int64((1 << TASK_SHIFT) - 1)
STAGES = ("exact_dedup", "near_dedup", "decontaminate")

Mapper = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]


def nodes_of(task: int, is_val: np.ndarray) -> np.ndarray:
    """The order keys of one task's documents: validation first, then task, then position."""
    local = np.arange(len(is_val), dtype=np.int64)
    return np.where(is_val, np.int64(0), _TRAIN_BIT) | (np.int64(task) << TASK_SHIFT) | local


def _task_and_index(node: int) -> tuple[int, int]:
    plain = int(node) & ((1 << 62) - 1)
    return plain >> TASK_SHIFT, plain & ((1 << TASK_SHIFT) - 1)


def _serial(fn: Callable[[Any], Any], jobs: Sequence[Any]) -> list[Any]:
    return [fn(job) for job in jobs]


def run_global_stages(
    cfg: PipelineConfig,
    task_dirs: list[Path],
    out_dir: Path,
    mapper: Mapper = _serial,
    memory_bytes: int = 1 << 30,
    partitions: int = 0,
) -> None:
    """Decide which documents survive dedup and decontamination; write per-task keep masks,
    removal records, the duplicates merged into each kept document, and the funnel."""
    for stale in ("exact", "near", "decided", "lines"):  # a pass cut short starts again
        shutil.rmtree(out_dir / stale, ignore_errors=True)
    sizes = [int(np.load(d / f"{EXACT_ROWS}.offsets.npy")[-1]) for d in task_dirs]
    rows = sum(sizes) * max(cfg.dedup.near.bands if cfg.dedup.near.enabled else 1, 1)
    if cfg.dedup.lines.enabled:
        rows = max(rows, sum(int(np.load(d / f"{LINE_ROWS}.offsets.npy")[-1]) for d in task_dirs))
    parts = partitions or partitioned.partitions_for(rows, memory_bytes)
    n_tasks = len(task_dirs)
    exact: list[str] = []
    near: list[str] = []
    info: dict[str, Any] = {}
    if cfg.dedup.exact.enabled and sum(sizes) and cfg.dedup.exact.method == "bloom":
        (out_dir / "exact").mkdir(parents=True, exist_ok=True)
        job = BloomJob(
            tuple(str(d / f"{EXACT_ROWS}.npy") for d in task_dirs),
            str(out_dir / "exact" / "bloom.npy"),
            cfg.dedup.exact.false_positive_rate,
            TASK_SHIFT,
        )
        info["exact_dedup"] = mapper(run_bloom_job, [job])[0]
        exact = [job.out]
    elif cfg.dedup.exact.enabled and sum(sizes):
        inputs = [str(d / f"{EXACT_ROWS}.npy") for d in task_dirs]
        exact = partitioned.exact_groups(
            mapper, inputs, out_dir / "exact", parts, n_tasks, TASK_SHIFT
        )
    if cfg.dedup.near.enabled and sum(sizes):
        inputs = [str(d / f"{NEAR_ROWS}.npy") for d in task_dirs]
        near, near_info = partitioned.components(
            mapper, inputs, out_dir / "near", parts, n_tasks, TASK_SHIFT,
            shingle_dirs=[str(d) for d in task_dirs], jaccard=cfg.dedup.near.jaccard_threshold,
        )  # fmt: skip
        if "candidates" in near_info:
            info["near_dedup"] = {
                "jaccard_threshold": cfg.dedup.near.jaccard_threshold,
                "candidate_checks": near_info["candidates"],
                "verified": near_info["verified"],
            }
    jobs = [
        DecideJob(t, tuple(str(d) for d in task_dirs), str(out_dir), tuple(exact), tuple(near),
                  cfg.removed_samples)
        for t in range(n_tasks)
    ]  # fmt: skip
    decided = mapper(decide_task, jobs)
    if cfg.dedup.lines.enabled and sum(sizes):
        info["line_dedup"] = _count_lines(cfg, task_dirs, out_dir, mapper, parts)
    _write_removals(out_dir, n_tasks)
    _write_stats(out_dir, decided, cfg.removed_samples, info)


def _count_lines(
    cfg: PipelineConfig, task_dirs: list[Path], out_dir: Path, mapper: Mapper, parts: int
) -> dict[str, Any]:
    """Find the units in at least `min_documents` surviving documents (`lines`); the tokenize
    tasks remove them."""
    folder = out_dir / "lines"
    folder.mkdir(parents=True, exist_ok=True)
    inputs = tuple(str(d / f"{LINE_ROWS}.npy") for d in task_dirs)
    jobs = [
        LineCountJob(inputs, str(out_dir), *partitioned.slice_range(p, parts),
                     str(folder / f"{p:05d}.npy"), len(task_dirs), TASK_SHIFT,
                     cfg.dedup.lines.min_documents)
        for p in range(parts)
    ]  # fmt: skip
    results = mapper(run_line_count_job, jobs)
    return {
        "unit": cfg.dedup.lines.unit,
        "min_documents": cfg.dedup.lines.min_documents,
        "frequent_units": sum(r["frequent"] for r in results),
    }


def frequent_units(out_dir: Path, task: int) -> set[int]:
    """The keys of one task's units that line dedup removes (empty when it is off)."""
    folder = out_dir / "lines"
    paths = sorted(str(p) for p in folder.glob("*.npy") if not p.name.endswith(".offsets.npy"))
    if not paths:
        return set()
    rows = partitioned.read_buckets(paths, task, task + 1, 2, np.int64)
    return set(rows[:, 1].tolist())


@dataclass(frozen=True)
class DecideJob:
    """Decide one task's documents from the clustering results; write its records."""

    task: int
    task_dirs: tuple[str, ...]
    out_dir: str
    exact: tuple[str, ...]
    near: tuple[str, ...]
    samples: int


@functools.lru_cache(maxsize=64)
def _ids(path: str, identity: tuple[int, int]) -> np.ndarray:
    return load_arrays(path)["ids"]


def _lookup(task_dirs: Sequence[str], node: int) -> str:
    """The id of the document a node stands for (any task's; a few tasks' ids are cached)."""
    task, index = _task_and_index(node)
    path = Path(task_dirs[task]) / "keys.npz"
    st = path.stat()  # the cache is per process: a rerun in the same folder must not hit it
    return str(_ids(str(path), (st.st_mtime_ns, st.st_size))[index])


def _pairs(paths: Sequence[str], task: int, n: int) -> np.ndarray:
    """(n,) int64: each document's head (exact) or label (near), its own node where none."""
    out = np.full(n, -1, dtype=np.int64)
    rows = partitioned.read_results(paths, task) if paths else np.zeros((0, 2), np.int64)
    out[rows[:, 0] & _LOCAL_MASK] = rows[:, 1]
    return out


def decide_task(job: DecideJob) -> dict[str, Any]:
    """Keep masks and records of one task; return its funnel counts and sampled records."""
    t, out = job.task, Path(job.out_dir)
    keys = load_arrays(Path(job.task_dirs[t]) / "keys.npz")
    is_val, codes, cut = keys["is_val"], keys["decontam"], keys["cut"]
    n = len(is_val)
    nodes = nodes_of(t, is_val)
    head, label = _pairs(job.exact, t, n), _pairs(job.near, t, n)
    bloom_hit = head == BLOOM_HIT  # the Bloom filter had seen it; which copy, it cannot say
    head = np.where(head < 0, nodes, head)
    label = np.where(label < 0, nodes, label)
    exact_kept = ((head == nodes) & ~bloom_hit) | is_val
    near_kept = exact_kept & ((label == nodes) | is_val)
    keep = near_kept & (codes == 0)
    save_arrays(
        out / f"{t:06d}.npz",
        keep=keep,
        reached_decontam=near_kept,
        val_kept=is_val[keep],
    )
    final = label if job.near else head  # a cluster's smallest node is the one kept
    removals: list[dict[str, Any]] = []
    for i in np.flatnonzero(~keep).tolist():
        record: dict[str, Any] = {"id": str(keys["ids"][i]), "ordinal": int(keys["ordinal"][i])}
        if bloom_hit[i] and not exact_kept[i]:
            record.update(stage="exact_dedup", reason="exact_dedup.bloom_seen")
        elif not exact_kept[i]:
            record.update(_dedup_reason("exact_dedup", int(head[i])))
        elif not near_kept[i]:
            record.update(_dedup_reason("near_dedup", int(label[i])))
        else:
            record.update(stage="decontaminate", reason=DECONTAM_CODES[codes[i]])
        if "matched" in record:
            record["duplicate_of"] = _lookup(job.task_dirs, int(final[i]))
            matched = record.pop("matched")
            if matched != int(final[i]):  # it matched a document merged into another one
                record["matched"] = _lookup(job.task_dirs, matched)
            record["final"] = int(final[i])
        record["local"] = i
        removals.append(record)
    return _write_task_records(job, removals, int(n), keys, cut, keep, near_kept, exact_kept)


def _dedup_reason(stage: str, matched: int) -> dict[str, Any]:
    """Stage, reason and matched node of a duplicate (of a validation document, or not)."""
    of_val = not matched & int(_TRAIN_BIT)
    reasons = {
        "exact_dedup": ("exact_dedup.duplicate", "exact_dedup.duplicate_of_val"),
        "near_dedup": ("near_dedup.duplicate", "near_dedup.cluster_has_val"),
    }
    return {"stage": stage, "reason": reasons[stage][of_val], "matched": matched}


def _write_task_records(
    job: DecideJob,
    removals: list[dict[str, Any]],
    n: int,
    keys: dict[str, np.ndarray],
    cut: np.ndarray,
    keep: np.ndarray,
    near_kept: np.ndarray,
    exact_kept: np.ndarray,
) -> dict[str, Any]:
    """Fill in source, file and excerpts; write removal records by stage and cluster entries
    addressed to the kept documents' tasks; return counts and samples."""
    t, out = job.task, Path(job.out_dir)
    wanted = {r["local"]: r for r in removals}
    sampled: Counter[str] = Counter()
    samples: dict[str, list[dict[str, Any]]] = {}
    if wanted:
        for k, doc in enumerate(read_records(Path(job.task_dirs[t]) / "docs.jsonl.zst")):
            record = wanted.get(k)
            if record is None:
                continue
            record["source"], record["file"] = doc["source"], doc["meta"].get("file", "")
            if "provenance" in doc["meta"]:
                record["provenance"] = doc["meta"]["provenance"]
            sampled[record["reason"]] += 1
            if sampled[record["reason"]] <= job.samples:
                text = doc["meta"].get("decontam_excerpt") or doc["text"]
                record["excerpt"] = text[:EXCERPT_CHARS]
                samples.setdefault(f"{record['stage']}/{record['reason']}", []).append(record)
    clusters: dict[int, list[dict[str, Any]]] = {}
    by_stage: dict[str, list[dict[str, Any]]] = {stage: [] for stage in STAGES}
    for r in removals:
        final, local = r.pop("final", None), r.pop("local")
        record = {key: r[key] for key in ("id", "source", "file", "ordinal", "stage", "reason")}
        record.update(
            {key: r[key] for key in ("duplicate_of", "matched", "provenance") if key in r}
        )
        if "excerpt" in r:
            record["excerpt"] = r["excerpt"]
        by_stage[r["stage"]].append(record)
        if final is not None:
            entry = {key: record[key] for key in ("id", "source", "file", "ordinal")}
            entry.update(stage=record["stage"], reason=record["reason"], local=local)
            entry.update({"matched": record["matched"]} if "matched" in record else {})
            clusters.setdefault(final, []).append(entry)
    folder = out / "decided"
    for stage, records in by_stage.items():
        write_records(folder / f"removed.{stage}.{t:06d}.jsonl.zst", records)
    for dst, entries in _by_task(clusters).items():
        write_records(folder / "clusters" / f"{dst:06d}" / f"{t:06d}.jsonl.zst", entries)
    reasons = {stage: Counter(r["reason"] for r in rs) for stage, rs in by_stage.items()}
    sources = {stage: Counter(r["source"] for r in rs) for stage, rs in by_stage.items()}
    return {
        "documents": n,
        "val_documents": int(keys["is_val"].sum()),
        "alive": [n, int(exact_kept.sum()), int(near_kept.sum()), int(keep.sum())],
        "cut_kept": int((keep & cut).sum()),
        "reasons": {k: dict(v) for k, v in reasons.items()},
        "sources": {k: dict(v) for k, v in sources.items()},
        "samples": {k: [_public(r) for r in v] for k, v in samples.items()},
    }


def _public(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("final", "local")}


def _by_task(clusters: dict[int, list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    """Cluster entries grouped by the kept document's task, each naming its index there."""
    out: dict[int, list[dict[str, Any]]] = {}
    for final, entries in sorted(clusters.items()):
        task, index = _task_and_index(final)
        for entry in entries:
            entry.pop("local")
            out.setdefault(task, []).append({"doc": index, **entry})
    return out


def read_clusters(out_dir: Path, task: int) -> dict[int, list[dict[str, Any]]]:
    """The duplicates merged into each kept document of one task, by index in the task."""
    merged: dict[int, list[dict[str, Any]]] = {}
    folder = out_dir / "decided" / "clusters" / f"{task:06d}"
    for path in sorted(folder.glob("*.jsonl.zst")) if folder.is_dir() else []:
        for entry in read_records(path):
            merged.setdefault(entry.pop("doc"), []).append(entry)
    return merged


def _write_removals(out_dir: Path, n_tasks: int) -> None:
    """One removal log: exact, near, then decontamination removals, each in task order."""

    def records() -> Iterator[dict[str, Any]]:
        for stage in STAGES:
            for t in range(n_tasks):
                yield from read_records(out_dir / "decided" / f"removed.{stage}.{t:06d}.jsonl.zst")

    write_records(out_dir / "removed.jsonl.zst", records())


def _write_stats(
    out_dir: Path, decided: list[dict[str, Any]], limit: int, info: dict[str, Any]
) -> None:
    alive = np.sum([d["alive"] for d in decided], axis=0) if decided else np.zeros(4, int)
    samples: dict[str, list[dict[str, Any]]] = {}
    for d in decided:
        for key, records in d["samples"].items():
            bucket = samples.setdefault(key, [])
            bucket.extend(records[: limit - len(bucket)])
    funnel = []
    for k, stage in enumerate(STAGES):
        reasons: Counter[str] = Counter()
        sources: Counter[str] = Counter()
        for d in decided:
            reasons.update(d["reasons"][stage])
            sources.update(d["sources"][stage])
        funnel.append(
            {
                "stage": stage,
                "in": int(alive[k]),
                "kept": int(alive[k + 1]),
                "removed": dict(reasons),
                "by_source": dict(sources),
                "changed": sum(d["cut_kept"] for d in decided) if stage == "decontaminate" else 0,
                **({"details": info[stage]} if stage in info else {}),
            }
        )
    write_json_atomic(
        out_dir / GLOBAL_STATS,
        {
            "documents": int(alive[0]),
            "val_documents": sum(d["val_documents"] for d in decided),
            "funnel": funnel,
            "line_dedup": info.get("line_dedup"),
            "samples": dict(sorted(samples.items())),
        },
    )
