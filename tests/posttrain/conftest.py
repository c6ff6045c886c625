"""Fixtures for the post-training tests: a small BPE with and without the chat tokens."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from kiln.tokenizer import Tokenizer, train_bpe
from kiln.tokenizer.special import CHAT_TOKENS, EOT
from tests.fixtures import single_torch_thread

ASSETS = Path(__file__).resolve().parents[2] / "kiln" / "assets"

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)


@pytest.fixture(scope="session")
def stories_text() -> str:
    """About 20 KB of the embedded TinyStories (whole stories)."""
    with gzip.open(ASSETS / "tinystories_train.txt.gz", "rt", encoding="utf-8") as handle:
        text = handle.read(20_000)
    return text[: text.rfind(EOT) + len(EOT)]


@pytest.fixture(scope="session")
def chat_tok_path(tmp_path_factory: pytest.TempPathFactory, stories_text: str) -> Path:
    """A 320-token BPE trained with the end-of-text and the four chat tokens reserved."""
    root = tmp_path_factory.mktemp("chat_tok")
    (root / "corpus.txt").write_text(stories_text, encoding="utf-8")
    train_bpe(root / "corpus.txt", 320, special_tokens=[EOT, *CHAT_TOKENS], workers=1).save(
        root / "tok.json"
    )
    return root / "tok.json"


@pytest.fixture(scope="session")
def chat_tok(chat_tok_path: Path) -> Tokenizer:
    """The tokenizer of `chat_tok_path`."""
    return Tokenizer.load(chat_tok_path)


@pytest.fixture(scope="session")
def base_tok(tmp_path_factory: pytest.TempPathFactory, stories_text: str) -> Tokenizer:
    """A 300-token BPE with only the end-of-text token (a base model's tokenizer)."""
    root = tmp_path_factory.mktemp("base_tok")
    (root / "corpus.txt").write_text(stories_text, encoding="utf-8")
    return train_bpe(root / "corpus.txt", 300, special_tokens=[EOT], workers=1)
