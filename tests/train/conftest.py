"""Fixtures for the trainer tests: a tiny TinyStories dataset and configs that train in seconds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.train.config import TrainConfig, load_train_config
from tests.fixtures import require_shared, single_torch_thread, tiny_story_dataset

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


_one_thread = pytest.fixture(autouse=True)(single_torch_thread)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 40 KB of TinyStories (valid split) as a 300-token BPE and a token-shard dataset."""
    source = require_shared(SHARED_DATA / "tinystories" / "valid.txt.gz")
    return tiny_story_dataset(source, tmp_path_factory.mktemp("tinystories"), 40_000)


MakeConfig = Callable[..., TrainConfig]


@pytest.fixture
def make_config(tiny_dataset: Path, tmp_path: Path) -> MakeConfig:
    """configs/tiny.toml on the test dataset, in a run dir under tmp_path, with --set overrides."""

    def make(*overrides: str, run: str = "run") -> TrainConfig:
        base = [
            f"data.dataset={tiny_dataset}",
            f"logging.run_dir={tmp_path / run}",
            "logging.progress=false",
        ]
        return load_train_config(CONFIGS / "tiny.toml", [*base, *overrides])

    return make
