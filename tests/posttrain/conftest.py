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


def save_run(root: Path, model: object, tok: Tokenizer, step: int = 5) -> Path:
    """`root` as a run folder: one checkpoint of `model`, the tokenizer beside it (by sha256)."""
    from kiln.io import sha256_file
    from kiln.train.checkpoint import TrainState, save_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    tok.save(root / "tokenizer.json")
    dataset = {"tokenizer_sha256": sha256_file(root / "tokenizer.json"), "vocab_size": tok.n_vocab}
    state = TrainState(
        step=step, tokens=step * 64, cursor={}, config={"model": model.cfg.to_dict()},  # type: ignore[attr-defined]
        dataset=dataset,
    )  # fmt: skip
    save_checkpoint(root / "checkpoints", model, {}, state, scheduler={}, keep_last=1)  # type: ignore[arg-type]
    return root


def tiny_model(vocab_size: int, seed: int = 0, **overrides: object) -> object:
    """A random `tiny` Transformer (block 128) with this vocab size, in eval mode."""
    import torch

    from kiln.model import ModelConfig
    from kiln.model.transformer import Transformer

    torch.manual_seed(seed)
    return Transformer(ModelConfig.preset("tiny", vocab_size=vocab_size, **overrides)).eval()


@pytest.fixture(scope="session")
def base_run(tmp_path_factory: pytest.TempPathFactory, base_tok: Tokenizer) -> Path:
    """A run of a random tiny model (untied head) whose vocab is exactly the base tokenizer's."""
    return save_run(
        tmp_path_factory.mktemp("base") / "run",
        tiny_model(base_tok.n_vocab, tie_embeddings=False),
        base_tok,
    )


@pytest.fixture(scope="session")
def chat_run(tmp_path_factory: pytest.TempPathFactory, base_run: Path) -> Path:
    """`base_run` with the chat tokens added (what `kiln posttrain add-chat-tokens` writes)."""
    from kiln.posttrain.chat_tokens import add_chat_tokens

    return add_chat_tokens(base_run, tmp_path_factory.mktemp("chat") / "run").out
