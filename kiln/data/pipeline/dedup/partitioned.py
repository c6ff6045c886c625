"""Dedup clustering on disk-backed, hash-partitioned data, in bounded memory per process.

Producers (the filter tasks, or a synthetic generator) write their rows — (key, node) for near
dedup's band keys, (key high, key low, node) for exact keys — to one `.npy` file each, sorted
into `SLICES` hash slices with an offsets file beside it. A clustering job reads one contiguous
range of slices from every producer's file (memory-mapped: only that range is loaded), so the
number of jobs (`partitions`) is set by the memory budget, not by the corpus.

- Exact groups: equal keys meet in one slice; each group's smallest node is its head.
- Near-duplicate components: rows with equal keys become edges to the group's smallest node;
  the components of those edges (documents linked through different bands, possibly found in
  different partitions) are found by alternating large-star and small-star rounds (Kiveris et
  al., "Connected Components in MapReduce and Beyond", 2014) over edge lists partitioned by
  node; each round is one job per partition, and they stop when every component is a star
  around its smallest node, which is its label.

Nodes are int64 order keys, so "smallest" is the pipeline's rank (validation documents first,
then input order); the labels are unique properties of the graph, so they are the same, byte
for byte, for any number of partitions and on any executor. Results are written bucketed by
the consumer's index (`node_bucket`), so each pipeline task reads only its own documents'.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.pipeline.dedup import verify
from kiln.data.pipeline.dedup.minhash import mix64
from kiln.data.pipeline.records import save_array

SLICES = 1024  # hash slices per producer file; a partition is a contiguous range of them
_SLICE_SHIFT = np.uint64(64 - int(math.log2(SLICES)))
BYTES_PER_ROW = 160  # working memory per edge row in a job: the rows, sort orders, outputs
_EMPTY = np.zeros((0, 2), dtype=np.int64)

Mapper = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]


def slice_of(values: np.ndarray) -> np.ndarray:
    """(n,) int64 hash slice of each value (top bits of a 64-bit mix), in [0, SLICES)."""
    mixed = mix64(np.asarray(values).astype(np.uint64, copy=True))
    return (mixed >> _SLICE_SHIFT).astype(np.int64)


def write_bucketed(
    path: str | os.PathLike[str], rows: np.ndarray, bucket: np.ndarray, n: int
) -> None:
    """Write `rows` grouped by `bucket` (in [0, n)), with `<path>.offsets.npy` beside it."""
    order = np.argsort(bucket, kind="stable")
    save_array(path, np.ascontiguousarray(rows[order]))
    offsets = np.searchsorted(bucket[order], np.arange(n + 1)).astype(np.int64)
    save_array(_offsets_path(path), offsets)


def _offsets_path(path: str | os.PathLike[str]) -> str:
    return os.fspath(path).removesuffix(".npy") + ".offsets.npy"


def read_buckets(paths: Sequence[str], lo: int, hi: int, width: int, dtype: Any) -> np.ndarray:
    """Rows of buckets [lo, hi) from every file (memory-mapped; only that range is read)."""
    parts = []
    for path in paths:
        offsets = np.load(_offsets_path(path))
        if offsets[hi] > offsets[lo]:
            rows = np.load(path, mmap_mode="r")
            parts.append(np.array(rows[offsets[lo] : offsets[hi]]))
    if not parts:
        return np.zeros((0, width), dtype=dtype)
    return np.concatenate(parts)


def write_near_rows(path: str | os.PathLike[str], band_keys: np.ndarray, nodes: np.ndarray) -> int:
    """A producer's near-dedup rows: (band-salted key, node) per document and band."""
    bands = band_keys.shape[1]
    salts = mix64(np.arange(1, bands + 1, dtype=np.uint64))  # (B,)
    keys = mix64((band_keys ^ salts[None, :]).reshape(-1))  # (n * B,)
    rows = np.stack([keys, np.repeat(nodes, bands).astype(np.uint64)], axis=1)
    write_bucketed(path, rows, slice_of(keys), SLICES)
    return len(rows)


def write_exact_rows(path: str | os.PathLike[str], exact: np.ndarray, nodes: np.ndarray) -> int:
    """A producer's exact-dedup rows: (key high, key low, node) per document."""
    pairs = np.ascontiguousarray(exact).view(np.uint64).reshape(len(nodes), 2)
    rows = np.concatenate([pairs, nodes.astype(np.uint64)[:, None]], axis=1)
    write_bucketed(path, rows, slice_of(pairs[:, 0]), SLICES)
    return len(rows)


def partitions_for(rows: int, memory_bytes: int) -> int:
    """How many partitions keep one job's rows within `memory_bytes` (at most SLICES)."""
    need = math.ceil(rows * BYTES_PER_ROW / max(memory_bytes, 1))
    return int(min(max(need, 1), SLICES))


def slice_range(partition: int, partitions: int) -> tuple[int, int]:
    """The slices [lo, hi) of one partition."""
    return partition * SLICES // partitions, (partition + 1) * SLICES // partitions


@dataclass(frozen=True)
class Job:
    """One partition's work in one round: read slices [lo, hi) of `inputs`, write `out`."""

    kind: str  # "exact", "group", "large", "small", "label"
    inputs: tuple[str, ...]
    lo: int
    hi: int
    out: str
    buckets: int  # consumer buckets of the results ("exact", "label")
    node_shift: int  # node >> shift (after masking the rank bit) is its consumer bucket
    shingle_dirs: tuple[str, ...] = ()  # "group" with `jaccard`: the producers' shingle folders
    jaccard: float = 0.0  # "group": keep only candidate edges of at least this exact Jaccard


def node_bucket(nodes: np.ndarray, shift: int) -> np.ndarray:
    """The consumer bucket of each node: its order key without the validation bit, shifted."""
    return (nodes & np.int64((1 << 62) - 1)) >> np.int64(shift)


def _group_heads(keys: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """For rows sorted by (key, node): the head (first node) of each row's key group."""
    new = np.ones(len(keys), dtype=bool)
    if len(keys) > 1:
        new[1:] = np.any(keys[1:] != keys[:-1], axis=1) if keys.ndim == 2 else keys[1:] != keys[:-1]
    return nodes[np.flatnonzero(new)][np.cumsum(new) - 1]


def _both_ways(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Undirected edges (u, v) as sorted unique directed pairs, both directions, no loops."""
    pairs = np.stack([np.concatenate([u, v]), np.concatenate([v, u])], axis=1)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    return np.unique(pairs, axis=0) if len(pairs) else _EMPTY


def _write_edges(out: str, pairs: np.ndarray) -> int:
    write_bucketed(out, pairs, slice_of(pairs[:, 0]), SLICES)
    return len(pairs)


def run_job(job: Job) -> dict[str, Any]:
    """Run one partition's job; return {"edges": written, "star": input already stars,
    "peak_rss_mb": this process's peak resident memory so far}."""
    result = _run_job(job)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def _run_job(job: Job) -> dict[str, Any]:
    if job.kind == "exact":
        rows = read_buckets(job.inputs, job.lo, job.hi, 3, np.uint64)
        rows = rows[np.lexsort((rows[:, 2].astype(np.int64), rows[:, 1], rows[:, 0]))]
        nodes = rows[:, 2].astype(np.int64)
        heads = _group_heads(rows[:, :2], nodes)
        dup = heads != nodes
        result = np.stack([nodes[dup], heads[dup]], axis=1)
        write_bucketed(job.out, result, node_bucket(result[:, 0], job.node_shift), job.buckets)
        return {"edges": int(dup.sum()), "star": True}
    if job.kind == "group":
        rows = read_buckets(job.inputs, job.lo, job.hi, 2, np.uint64)
        rows = rows[np.lexsort((rows[:, 1].astype(np.int64), rows[:, 0]))]
        nodes = rows[:, 1].astype(np.int64)
        if job.jaccard > 0.0:
            return _verified_group(job, rows[:, 0], nodes)
        heads = _group_heads(rows[:, 0], nodes)
        return {"edges": _write_edges(job.out, _both_ways(nodes, heads)), "star": False}
    pairs = read_buckets(job.inputs, job.lo, job.hi, 2, np.int64)
    if len(pairs):
        pairs = np.unique(pairs, axis=0)  # sorted by node, then neighbour
    a, b = pairs[:, 0], pairs[:, 1]
    first = np.flatnonzero(np.concatenate(([True], a[1:] != a[:-1]))) if len(a) else a
    group = np.cumsum(np.concatenate(([False], a[1:] != a[:-1]))) if len(a) else a
    smaller = b < a
    if job.kind == "label":  # the input is stars: every leaf's one smaller neighbour is its label
        result = pairs[smaller]
        write_bucketed(job.out, result, node_bucket(result[:, 0], job.node_shift), job.buckets)
        return {"edges": len(result), "star": True}
    n_small = np.add.reduceat(smaller.astype(np.int64), first) if len(a) else a
    n_large = np.add.reduceat((~smaller).astype(np.int64), first) if len(a) else a
    star = bool(np.all((n_small <= 1) & ((n_small == 0) | (n_large == 0))))
    if job.kind == "large":
        # Every strictly larger neighbour is connected to the smallest of N(a) and a.
        m = np.minimum(np.minimum.reduceat(b, first), a[first]) if len(a) else a
        keep = ~smaller
        out = _both_ways(b[keep], m[group[keep]])
    else:
        # a and its smaller neighbours are connected to the smallest of them.
        big = np.iinfo(np.int64).max
        m = (
            np.minimum(np.minimum.reduceat(np.where(smaller, b, big), first), a[first])
            if len(a)
            else a
        )
        has = n_small > 0 if len(a) else np.zeros(0, bool)
        out = _both_ways(
            np.concatenate([b[smaller], a[first][has]]),
            np.concatenate([m[group[smaller]], m[has]]),
        )
    return {"edges": _write_edges(job.out, out), "star": star}


def _verified_group(job: Job, keys: np.ndarray, nodes: np.ndarray) -> dict[str, Any]:
    """A "group" job that links only candidate pairs whose exact Jaccard passes (`verify`)."""
    u, v = verify.anchor_pairs(keys, nodes)
    pairs, inverse = np.unique(np.stack([u, v], axis=1), axis=0, return_inverse=True)
    lookup = verify.shingle_lookup(job.shingle_dirs, job.node_shift)
    ok = verify.verify_pairs(pairs[:, 0], pairs[:, 1], lookup, job.jaccard)
    edges = _write_edges(job.out, _both_ways(pairs[ok, 0], pairs[ok, 1]))
    passed = int(ok[inverse.reshape(-1)].sum())
    return {"edges": edges, "star": False, "candidates": len(u), "verified": passed}


def _round(
    mapper: Mapper, kind: str, inputs: Sequence[str], folder: Path, partitions: int,
    buckets: int = 1, node_shift: int = 62, **extra: Any,
) -> tuple[list[str], list[dict[str, Any]]]:  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [
        Job(kind, tuple(inputs), *slice_range(p, partitions), str(folder / f"{p:05d}.npy"),
            buckets, node_shift, **extra)
        for p in range(partitions)
    ]  # fmt: skip
    return [j.out for j in jobs], mapper(run_job, jobs)


def exact_groups(
    mapper: Mapper, inputs: Sequence[str], folder: Path, partitions: int, buckets: int, shift: int
) -> list[str]:
    """Files of (node, head) for every non-head node of an exact-key group, by consumer bucket."""
    outputs, _ = _round(mapper, "exact", inputs, folder, partitions, buckets, shift)
    return outputs


def components(
    mapper: Mapper, inputs: Sequence[str], folder: Path, partitions: int, buckets: int, shift: int,
    shingle_dirs: Sequence[str] = (), jaccard: float = 0.0,
) -> tuple[list[str], dict[str, Any]]:  # fmt: skip
    """Files of (node, label) for every node whose component's smallest node is another one,
    by consumer bucket; and {"rounds", "peak_rss_mb" (the most of any job's process)}, plus
    "candidates" and "verified" (pair checks) when edges are verified by exact Jaccard (a
    `jaccard` > 0 and each producer's shingles in `shingle_dirs`, in producer order)."""
    verify_args: dict[str, Any] = {}
    if jaccard > 0.0:
        verify_args = {"shingle_dirs": tuple(shingle_dirs), "jaccard": jaccard, "node_shift": shift}
    edges, stats = _round(mapper, "group", inputs, folder / "r000-group", partitions, **verify_args)
    checks = {k: sum(s.get(k, 0) for s in stats) for k in ("candidates", "verified")}
    seen = list(stats)
    rounds = 0
    while True:
        rounds += 1
        large, stats = _round(mapper, "large", edges, folder / f"r{rounds:03d}-large", partitions)
        seen += stats
        if all(s["star"] for s in stats):
            break
        edges, stats = _round(mapper, "small", large, folder / f"r{rounds:03d}-small", partitions)
        seen += stats
    labels, stats = _round(mapper, "label", edges, folder / "labels", partitions, buckets, shift)
    seen += stats
    info: dict[str, Any] = {
        "rounds": rounds,
        "peak_rss_mb": round(max(s["peak_rss_mb"] for s in seen)),
    }
    if jaccard > 0.0:
        info.update(checks)
    return labels, info


def read_results(paths: Sequence[str], bucket: int) -> np.ndarray:
    """(k, 2) int64 (node, head-or-label) pairs of one consumer bucket, sorted by node."""
    rows = read_buckets(paths, bucket, bucket + 1, 2, np.int64)
    return rows[np.argsort(rows[:, 0], kind="stable")]
