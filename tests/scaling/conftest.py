"""Fixtures for the scaling tests: one torch thread and a tiny TinyStories token dataset."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures import single_torch_thread, tiny_story_dataset

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)


@pytest.fixture(scope="session")
def tiny_dataset(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 60 KB of TinyStories as a 300-token BPE and a token-shard dataset."""
    source = shared_data / "tinystories" / "valid.txt.gz"
    return tiny_story_dataset(source, tmp_path_factory.mktemp("scaling_data"), 60_000)
