"""Fixtures for the evaluation tests: a small BPE tokenizer and random-weight `tiny` models."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch

from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
from kiln.model import ModelConfig
from kiln.model.transformer import Transformer
from kiln.tokenizer import Tokenizer, train_bpe
from tests.fixtures import single_torch_thread

EOT = "<|endoftext|>"
TEXT = "Once upon a time, a little fox found a red ball. 🦊 She was happy!"
ASSET = Path(__file__).resolve().parents[2] / "kiln" / "assets" / "tinystories_valid.txt.gz"


_one_thread = pytest.fixture(autouse=True)(single_torch_thread)


@pytest.fixture(scope="session")
def tok_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 400-token byte-level BPE (end-of-text = 399) trained on 20 KB of the embedded stories."""
    with gzip.open(ASSET, "rt", encoding="utf-8") as handle:
        text = handle.read(20_000)
    root = tmp_path_factory.mktemp("tok")
    (root / "corpus.txt").write_text(text, encoding="utf-8")
    tok = train_bpe(root / "corpus.txt", 400, special_tokens=[EOT])
    tok.save(root / "tok.json")
    return root / "tok.json"


@pytest.fixture(scope="session")
def tok(tok_path: Path) -> Tokenizer:
    """The tokenizer of `tok_path`."""
    return Tokenizer.load(tok_path)


def random_tiny(seed: int = 0, **overrides: object) -> Transformer:
    """The `tiny` preset (Llama-style) with random weights, in eval mode."""
    return random_model(ModelConfig.preset("tiny", **overrides), seed)


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A model with clearly non-trivial random weights (norm scales and biases too), eval mode.

    Default initialisation gives near-uniform predictions, under which every choice scores
    alike; larger weights make the log-probs (and so the accuracies) differ between choices.
    """
    torch.manual_seed(seed)
    model = Transformer(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
        model.wte.weight[model.cfg.vocab_size :] = 0
    return model.eval()


@pytest.fixture(scope="session")
def tiny() -> Transformer:
    """A random `tiny` model (block size 128)."""
    return random_tiny()


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory, tok_path: Path) -> Path:
    """A token-shard dataset of 30 short stories, 6 of them in the val split."""
    root = tmp_path_factory.mktemp("shards")
    stories = [f"Story {i}: {TEXT[: 20 + 3 * i]}" for i in range(30)]
    (root / "stories.txt").write_text(f"\n{EOT}\n".join(stories), encoding="utf-8")
    tokenize_to_shards(
        TokenizeConfig(
            tokenizer=str(tok_path), inputs=(str(root / "stories.txt"),), out=str(root / "ds"),
            val_docs=6, workers=1, progress=False,
        )
    )  # fmt: skip
    return root / "ds"
