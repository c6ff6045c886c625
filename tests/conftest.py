"""Shared test fixtures: where the project's shared data lives; a private kiln cache per test;
small BPE tokenizers with and without the chat tokens (tests/chat and tests/posttrain use them),
KILN_TEST_THREADS and the `kernels` marker of `make test-kernels` (docs/testing.md)."""

from __future__ import annotations

import gzip
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.fixtures import EOT, import_kernels, kiln_test_threads, live_process, require_shared

if TYPE_CHECKING:
    from kiln.tokenizer import Tokenizer

import_kernels()  # before any test module is collected (see tests/kernels/conftest.py)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
ASSETS = Path(__file__).resolve().parents[1] / "kiln" / "assets"
_test_numbers = itertools.count()

# Kernel-sensitive tests in files whose owners do not mark them (pytest node ids, no params):
# `make test-kernels` reruns them with the `kernels`-marked ones.
KERNEL_SENSITIVE = frozenset(
    {
        "tests/serve/engine/test_engine.py::test_seeded_request_is_bitwise_independent_of_the_batch",
        "tests/serve/engine/test_engine.py::test_greedy_equals_generate_alone_for_mixed_lengths",
        "tests/serve/engine/test_invariant.py::test_a_tiled_row_has_the_same_bits_alone_and_amid_1_to_40_others",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    """Under KILN_TEST_THREADS, every test runs with that many torch threads (not only those
    whose directory pins one thread), so `make test-kernels` varies the reduction order."""
    if "KILN_TEST_THREADS" in os.environ:
        import torch

        torch.set_num_threads(kiln_test_threads())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests listed in KERNEL_SENSITIVE as `kernels`."""
    for item in items:
        if item.nodeid.split("[")[0] in KERNEL_SENSITIVE:
            item.add_marker(pytest.mark.kernels)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The read-only shared data directory (../shared/data from the repository root)."""
    return require_shared(SHARED_DATA)


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """KILN_CACHE_DIR under the session's temp dir: tests never write to ~/.cache."""
    root = tmp_path_factory.mktemp("kiln-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("KILN_CACHE_DIR", str(root / "session"))
    yield root
    patch.undo()


@pytest.fixture(autouse=True)
def _test_cache(_session_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache of each test's own (made when first written), so no test sees another's stamps."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(_session_cache / f"t{next(_test_numbers)}"))


live_pid = pytest.fixture(live_process)  # another live process's PID, for "kept while alive" cases


@pytest.fixture(scope="session")
def stories_text() -> str:
    """About 20 KB of the embedded TinyStories (whole stories)."""
    with gzip.open(ASSETS / "tinystories_train.txt.gz", "rt", encoding="utf-8") as handle:
        text = handle.read(20_000)
    return text[: text.rfind(EOT) + len(EOT)]


@pytest.fixture(scope="session")
def chat_tok_path(tmp_path_factory: pytest.TempPathFactory, stories_text: str) -> Path:
    """A 320-token BPE trained with the end-of-text and the four chat tokens reserved."""
    from kiln.chat.tokens import CHAT_TOKENS
    from kiln.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("chat_tok")
    (root / "corpus.txt").write_text(stories_text, encoding="utf-8")
    train_bpe(root / "corpus.txt", 320, special_tokens=[EOT, *CHAT_TOKENS], workers=1).save(
        root / "tok.json"
    )
    return root / "tok.json"


@pytest.fixture(scope="session")
def chat_tok(chat_tok_path: Path) -> Tokenizer:
    """The tokenizer of `chat_tok_path`."""
    from kiln.tokenizer import Tokenizer

    return Tokenizer.load(chat_tok_path)


@pytest.fixture(scope="session")
def base_tok(tmp_path_factory: pytest.TempPathFactory, stories_text: str) -> Tokenizer:
    """A 300-token BPE with only the end-of-text token (a base model's tokenizer)."""
    from kiln.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("base_tok")
    (root / "corpus.txt").write_text(stories_text, encoding="utf-8")
    return train_bpe(root / "corpus.txt", 300, special_tokens=[EOT], workers=1)
