"""Shared test fixtures: where the project's shared data lives."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures import live_process, require_shared

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The read-only shared data directory (../shared/data from the repository root)."""
    return require_shared(SHARED_DATA)


live_pid = pytest.fixture(live_process)  # another live process's PID, for "kept while alive" cases
