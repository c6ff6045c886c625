"""Shared test fixtures: where the project's shared data lives; a private kiln cache per test."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures import live_process, require_shared

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
_test_numbers = itertools.count()


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
