"""Fixtures for the scaling tests: one torch thread and a tiny TinyStories token dataset."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import pytest

EOT = "<|endoftext|>"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: tiny models gain nothing from more, and the machine is shared."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dataset(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 60 KB of TinyStories as a 300-token BPE and a token-shard dataset."""
    from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
    from kiln.tokenizer import train_bpe

    with gzip.open(shared_data / "tinystories" / "valid.txt.gz", "rt", encoding="utf-8") as f:
        text = f.read(60_000)
    text = text[: text.rfind(EOT) + len(EOT)]  # whole stories only
    root = tmp_path_factory.mktemp("scaling_data")
    corpus = root / "stories.txt"
    corpus.write_text(text, encoding="utf-8")
    train_bpe(corpus, 300, special_tokens=[EOT], workers=1).save(root / "tok.json")
    out = root / "shards"
    tokenize_to_shards(
        TokenizeConfig(
            tokenizer=str(root / "tok.json"), inputs=(str(corpus),), out=str(out), val_docs=4,
            workers=1, progress=False,
        )
    )  # fmt: skip
    return out
