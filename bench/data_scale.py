"""The dedup global pass at scale: a synthetic fingerprint set clustered in a fixed memory budget.

    python bench/data_scale.py --docs 20000000 --memory-mb 512 --workers 2
    python bench/data_scale.py --docs 1000000 --compare      # also 2 and 4 partitions: same labels

The documents are not text: each has 14 MinHash band keys (uint64) made by a counter-based hash
of (seed, document, band), so any range of documents is generated on its own, in chunks that
are the "filter tasks" (one producer file each, written as the pipeline's tasks write theirs).
90% of documents are originals; 7% are near copies of an earlier original (sharing 1-3 bands
with it); 3% are bridges sharing bands with two earlier originals, which joins their clusters
into chains that no single band (and no single partition) sees whole. Clustering runs
`kiln.data.pipeline.dedup.partitioned.components` on a local process pool with the number of
partitions the budget gives (`partitions_for`), then reports wall time, the peak RSS of the
driver and of the largest worker (getrusage, measured right after the budgeted run; the data is
generated in a separate process first, so neither inherits the generator's memory), clusters
and a checksum of the labels. --compare reruns at 2 and 4 partitions (over the budget at this
size: they only check that the labels are the same).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Run as a script from a plain checkout too (this checkout's kiln, and bench._load).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.data.pipeline.dedup import partitioned
from kiln.data.pipeline.dedup.minhash import mix64
from kiln.data.pipeline.executors import LocalExecutor

BANDS = 14


def _hash(seed: int, salt: int, values: np.ndarray) -> np.ndarray:
    """A counter-based 64-bit hash of each value (independent per seed and salt)."""
    x = values.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    x ^= np.uint64((seed * 1_000_003 + salt) & (2**64 - 1))
    return mix64(mix64(x))


def _is_original(seed: int, docs: np.ndarray) -> np.ndarray:
    return (_hash(seed, 1, docs) % np.uint64(100)) < np.uint64(90)


def synthetic_band_keys(lo: int, hi: int, seed: int = 0) -> np.ndarray:
    """(hi - lo, BANDS) uint64 band keys of documents [lo, hi) of the synthetic set."""
    docs = np.arange(lo, hi, dtype=np.int64)
    kind = _hash(seed, 1, docs) % np.uint64(100)  # < 90 original, < 97 copy, else bridge
    owner = np.repeat(docs[:, None], BANDS, axis=1)  # whose key each band carries
    earlier = np.maximum(docs, 1).astype(np.uint64)
    first = (_hash(seed, 2, docs) % earlier).astype(np.int64)
    second = (_hash(seed, 3, docs) % earlier).astype(np.int64)
    band_a = (_hash(seed, 4, docs) % np.uint64(BANDS)).astype(np.int64)
    shared = 1 + (_hash(seed, 5, docs) % np.uint64(3)).astype(np.int64)  # 1-3 bands
    copy = (kind >= 90) & (docs > 0) & _is_original(seed, first)
    bridge = (kind >= 97) & copy & _is_original(seed, second)
    rows = np.arange(len(docs))
    for k in range(3):
        band = (band_a + k) % BANDS
        take = copy & (k < shared)
        owner[rows[take], band[take]] = first[take]
        other = (band_a + 7 + k) % BANDS  # bridges: bands 7 apart, shared with `second`
        tb = bridge & (k < shared)
        owner[rows[tb], other[tb]] = second[tb]
    band_index = np.arange(BANDS, dtype=np.int64)[None, :]
    return _hash(seed, 6, owner * BANDS + band_index)


def write_producers(folder: Path, docs: int, chunk: int, seed: int = 0) -> tuple[list[str], int]:
    """Write the synthetic set as producer files of `chunk` documents; (paths, rows)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, rows = [], 0
    for t, lo in enumerate(range(0, docs, chunk)):
        hi = min(lo + chunk, docs)
        nodes = np.arange(lo, hi, dtype=np.int64)
        path = str(folder / f"{t:06d}.npy")
        rows += partitioned.write_near_rows(path, synthetic_band_keys(lo, hi, seed), nodes)
        paths.append(path)
    return paths, rows


def mapper(workers: int):
    """Run jobs on a local pool; results in job order."""
    executor = LocalExecutor(workers, progress=False)

    def run(fn, jobs):
        return [r for _, r in sorted(executor.map(fn, jobs, desc="cluster"), key=lambda x: x[0])]

    return run


def cluster(
    paths: list[str], folder: Path, partitions: int, workers: int, buckets: int, shift: int
) -> tuple[np.ndarray, dict]:
    """Cluster; return (labels (k, 2) for non-root nodes, components' info)."""
    labels, info = partitioned.components(
        mapper(workers), paths, folder, partitions, buckets, shift
    )
    rows = [partitioned.read_results(labels, b) for b in range(buckets)]
    return np.concatenate(rows), info


def checksum(labels: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(labels).tobytes()).hexdigest()[:16]


def run(docs: int, memory_mb: int, workers: int, compare: bool, root: Path) -> dict:
    """Generate, cluster in the budget (and at 2 and 4 partitions with --compare); report."""
    chunk = 250_000
    shift = max(int(np.ceil(np.log2(max(docs, 2)))) - 4, 0)  # ~16 consumer buckets
    buckets = (docs >> shift) + 1
    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        paths, rows = pool.apply(write_producers, (root / "rows", docs, chunk))
    generate_s = time.perf_counter() - t0
    partitions = partitioned.partitions_for(rows, memory_mb << 20)
    runs: dict[int, dict] = {}
    for p in [partitions] + ([2, 4] if compare else []):
        if p in runs:
            continue
        t0 = time.perf_counter()
        labels, info = cluster(paths, root / f"p{p}", p, workers, buckets, shift)
        wall = time.perf_counter() - t0
        runs[p] = {
            "wall_s": round(wall, 1),
            "rounds": info["rounds"],
            "peak_rss_mb_of_a_job_process": info["peak_rss_mb"],
            "clusters_with_duplicates": len(np.unique(labels[:, 1])) if len(labels) else 0,
            "documents_removed": len(labels),
            "clusters": docs - len(labels),
            "labels_sha256": checksum(labels),
        }
        if len(runs) == 1:  # the budgeted run, before any comparison run
            driver = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        shutil.rmtree(root / f"p{p}")
    return {
        "docs": docs,
        "bands": BANDS,
        "rows": rows,
        "memory_budget_mb": memory_mb,
        "partitions": partitions,
        "workers": workers,
        "generate_s": round(generate_s, 1),
        "runs": {str(k): v for k, v in runs.items()},
        "peak_rss_mb_of_the_driver": driver,
        "identical_across_partitions": len({r["labels_sha256"] for r in runs.values()}) == 1,
    }


def main() -> None:
    """Parse arguments, run, print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--memory-mb", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--compare", action="store_true", help="also 2 and 4 partitions")
    parser.add_argument("--tmp", default=None, help="scratch folder (default: a temp dir)")
    add_noisy_flag(parser)
    args = parser.parse_args()
    measured = begin("bench/data_scale.py", args.noisy)
    root = Path(tempfile.mkdtemp(prefix="kiln_scale_", dir=args.tmp))
    try:
        result = run(args.docs, args.memory_mb, args.workers, args.compare, root)
        print(json.dumps(measured.stamp(result), indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
