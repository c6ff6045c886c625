"""Fixtures for the trainer tests: a tiny TinyStories dataset and configs that train in seconds."""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
from kiln.tokenizer import train_bpe
from kiln.train.config import TrainConfig, load_train_config

EOT = "<|endoftext|>"
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: a tiny model's ops are too small to share, and the order is fixed."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 40 KB of TinyStories (valid split) as a 300-token BPE and a token-shard dataset."""
    source = SHARED_DATA / "tinystories" / "valid.txt.gz"
    if not source.is_file():
        pytest.skip(f"shared data not found at {source}")
    with gzip.open(source, "rt", encoding="utf-8") as handle:
        text = handle.read(40_000)
    text = text[: text.rfind(EOT) + len(EOT)]  # whole stories only
    root = tmp_path_factory.mktemp("tinystories")
    corpus = root / "stories.txt"
    corpus.write_text(text, encoding="utf-8")
    tok = train_bpe(corpus, 300, special_tokens=[EOT])
    tok.save(root / "tok.json")
    out = root / "shards"
    tokenize_to_shards(
        TokenizeConfig(
            tokenizer=str(root / "tok.json"), inputs=(str(corpus),), out=str(out), val_docs=4,
            workers=1, progress=False,
        )
    )  # fmt: skip
    return out


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
