"""The partitioned global pass: the same clusters as the in-memory one, for any number of
partitions, on a local pool and on Ray, from disk-backed producer files."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.data.pipeline.dedup import partitioned
from kiln.data.pipeline.dedup.exact import first_occurrences
from kiln.data.pipeline.dedup.near import near_duplicate_clusters
from kiln.data.pipeline.executors import LocalExecutor, RayExecutor
from tests.data.pipeline.conftest import bench_module

N = 6000
CHUNK = 1000


def in_order(executor: Any) -> Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]:
    def run(fn: Callable[[Any], Any], jobs: Sequence[Any]) -> list[Any]:
        return [r for _, r in sorted(executor.map(fn, jobs, desc="jobs"), key=lambda x: x[0])]

    return run


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    bench = bench_module("data_scale")
    root = tmp_path_factory.mktemp("synthetic")
    paths, rows = bench.write_producers(root / "rows", N, CHUNK)
    keys = bench.synthetic_band_keys(0, N)
    representative, _ = near_duplicate_clusters(keys, np.arange(N))
    return {"root": root, "paths": paths, "rows": rows, "expected": representative}


def labels_of(paths: list[str], folder: Path, partitions: int, mapper: Any) -> np.ndarray:
    """label[node] for every node (its component's smallest node)."""
    files, _ = partitioned.components(mapper, paths, folder, partitions, N // CHUNK, 10)
    labels = np.arange(N)
    for bucket in range(N // CHUNK):
        for node, label in partitioned.read_results(files, bucket).tolist():
            labels[node] = label
    return labels


def test_components_equal_in_memory_clusters_for_any_partitions(
    synthetic: dict[str, Any], tmp_path: Path
) -> None:
    expected = synthetic["expected"]
    assert 0.05 * N < (expected != np.arange(N)).sum() < 0.2 * N  # there are clusters
    runs = {}
    for p in (1, 2, 4):
        runs[p] = labels_of(synthetic["paths"], tmp_path / f"p{p}", p, in_order(LocalExecutor()))
        np.testing.assert_array_equal(runs[p], expected)
    # Bridges join clusters that share no band: some component spans more than one band key.
    sizes = np.bincount(expected)
    assert sizes.max() >= 4


def test_components_on_a_process_pool_and_on_ray_are_byte_identical(
    synthetic: dict[str, Any], tmp_path: Path
) -> None:
    ray = pytest.importorskip("ray")
    pool = partitioned.components(
        in_order(LocalExecutor(workers=2, progress=False)), synthetic["paths"], tmp_path / "pool",
        4, N // CHUNK, 10,
    )[0]  # fmt: skip
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = partitioned.components(
            in_order(RayExecutor(None, 2, progress=False)), synthetic["paths"], tmp_path / "ray",
            4, N // CHUNK, 10,
        )[0]  # fmt: skip
    finally:
        ray.shutdown()
    for a, b in zip(pool, on_ray, strict=True):
        assert Path(a).read_bytes() == Path(b).read_bytes()


def test_exact_groups_equal_first_occurrences(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 50, size=(3000, 16), dtype=np.uint8)
    keys[:, 1:] = 0  # 50 distinct keys: large groups
    keys[1000:] = rng.integers(0, 255, size=(2000, 16), dtype=np.uint8)  # mostly unique
    is_val = rng.random(3000) < 0.05
    nodes = np.where(is_val, 0, np.int64(1) << 62) | np.arange(3000)
    partitioned.write_exact_rows(tmp_path / "a.npy", keys[:1500], nodes[:1500])
    partitioned.write_exact_rows(tmp_path / "b.npy", keys[1500:], nodes[1500:])
    rank = np.empty(3000, np.int64)
    rank[np.lexsort((np.arange(3000), ~is_val))] = np.arange(3000)
    _, kept_index = first_occurrences(keys, rank, protected=is_val)
    for p in (1, 3):
        files = partitioned.exact_groups(
            in_order(LocalExecutor()), [str(tmp_path / n) for n in ("a.npy", "b.npy")],
            tmp_path / f"x{p}", p, 1, 62,
        )  # fmt: skip
        head = np.arange(3000)
        mask = np.int64((1 << 62) - 1)
        for node, first in partitioned.read_results(files, 0).tolist():
            head[node & mask] = first & mask
        np.testing.assert_array_equal(head, kept_index)


def test_partitions_follow_the_memory_budget() -> None:
    assert partitioned.partitions_for(1000, 1 << 30) == 1
    rows = 280_000_000  # 20 M documents x 14 bands
    p = partitioned.partitions_for(rows, 512 << 20)
    assert rows / p * partitioned.BYTES_PER_ROW <= 512 << 20
    assert partitioned.partitions_for(10**12, 1) == partitioned.SLICES
