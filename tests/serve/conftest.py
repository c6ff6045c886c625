"""Engine test fixtures: small models, and a KV-block audit after every engine test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kiln.model import Transformer
from kiln.serve.engine import Engine, EngineConfig
from kiln.tokenizer.tokenizer import Tokenizer
from tests.fixtures import single_torch_thread
from tests.model.helpers import build, gpt2_small, llama_small

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)

EOT = 256


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def llama() -> Transformer:
    """A Llama-style model (RoPE, RMSNorm, SwiGLU, GQA 4 heads over 2) with random weights."""
    return build(llama_small(vocab_size=300, block_size=96, n_embd=64, n_head=4, n_kv_head=2))


@pytest.fixture(scope="session")
def gpt2() -> Transformer:
    """A GPT-2-style model (learned positions, LayerNorm, GELU) with random weights."""
    return build(gpt2_small(block_size=96))


@pytest.fixture(scope="session")
def byte_tokenizer() -> Tokenizer:
    """Bytes as tokens (no merges) plus <|endoftext|> = 256."""
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], {"<|endoftext|>": EOT})


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """Build engines; afterwards each must be idle with its KV block books balanced."""
    made: list[Engine] = []

    def make(model: Transformer, tokenizer: Tokenizer | None = None, **config: Any) -> Engine:
        eot = config.pop("eot_id", None)
        drafter = config.pop("drafter", None)
        cls = config.pop("engine_cls", Engine)
        engine = cls(model, tokenizer, EngineConfig(**config), eot_id=eot, drafter=drafter)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.stop(timeout=10)
        assert_no_leaks(engine)


def assert_no_leaks(engine: Engine) -> None:
    """Every request done, and the only used blocks are those the prefix cache keeps."""
    engine.audit()
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (0, 0), stats
    assert stats.blocks_used == stats.blocks_cached, stats
    if not engine.config.prefix_caching:
        assert stats.blocks_used == 0, stats
    if engine.windowed is not None:  # a mixed-window model's windowed layers' own pool
        local = engine.windowed.pool
        assert local.used == local.cached, (local.used, local.cached)


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of random lengths in [lo, hi] over token ids [0, vocab)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]
