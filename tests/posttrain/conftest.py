"""Fixtures for the post-training tests: run folders of tiny models, with and without the chat
tokens (the tokenizers themselves are tests/conftest.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.tokenizer import Tokenizer
from tests.fixtures import single_torch_thread

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)


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
    from kiln.posttrain.add_chat_tokens import add_chat_tokens

    return add_chat_tokens(base_run, tmp_path_factory.mktemp("chat") / "run").out
