"""Shared test fixtures: where the project's shared data lives; a private kiln cache per test;
KILN_TEST_THREADS and the `kernels` marker of `make test-kernels` (docs/testing.md)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures import kiln_test_threads, live_process, require_shared

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
_test_numbers = itertools.count()

# Kernel-sensitive tests in files whose owners do not mark them (pytest node ids, no params):
# `make test-kernels` reruns them with the `kernels`-marked ones.
KERNEL_SENSITIVE = frozenset(
    {
        "tests/serve/test_engine.py::test_seeded_request_is_bitwise_independent_of_the_batch",
        "tests/serve/test_engine.py::test_greedy_equals_generate_alone_for_mixed_lengths",
        "tests/serve/test_invariant.py::test_a_row_gets_the_same_bits_in_any_padded_batch",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    """Under KILN_TEST_THREADS, every test runs with that many torch threads (not only those
    whose directory pins one thread), so `make test-kernels` varies the reduction order."""
    if "KILN_TEST_THREADS" in os.environ:
        import torch

        torch.set_num_threads(kiln_test_threads())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests listed in KERNEL_SENSITIVE as `kernels`."""
    for item in items:
        if item.nodeid.split("[")[0] in KERNEL_SENSITIVE:
            item.add_marker(pytest.mark.kernels)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The read-only shared data directory (../shared/data from the repository root)."""
    return require_shared(SHARED_DATA)


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """KILN_CACHE_DIR under the session's temp dir: tests never write to ~/.cache."""
    root = tmp_path_factory.mktemp("kiln-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("KILN_CACHE_DIR", str(root / "session"))
    yield root
    patch.undo()


@pytest.fixture(autouse=True)
def _test_cache(_session_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache of each test's own (made when first written), so no test sees another's stamps."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(_session_cache / f"t{next(_test_numbers)}"))


live_pid = pytest.fixture(live_process)  # another live process's PID, for "kept while alive" cases
