"""The training loader: deterministic, exactly resumable, world-size invariant, epoch-permuted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.data import Dataset, Loader, LoaderCursor
from kiln.data.loader import window_stream
from kiln.errors import KilnError
from tests.data.conftest import EOT

T = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_file: Path) -> Dataset:
    """About 2,000 tokens over several shards (so windows cross shard boundaries)."""
    from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards

    root = tmp_path_factory.mktemp("loader")
    corpus = root / "docs.txt"
    words = ["the", "fox", "ran", "and", "a", "dog", "sat", "by", "tree", "while", "rain", "fell"]
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(words, size=rng.integers(5, 40))) for _ in range(120)]
    corpus.write_text("".join(f"{d}\n{EOT}\n" for d in docs))
    config = TokenizeConfig(
        tokenizer=str(tiny_tokenizer_file),
        inputs=(str(corpus),),
        out=str(root / "ds"),
        val_docs=3,
        shard_tokens=300,
        progress=False,
    )
    tokenize_to_shards(config)
    ds = Dataset.open(root / "ds")
    assert len(ds.split("train").shards) > 3
    return ds


def _take(loader: Loader, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(b.inputs, b.targets) for b in (loader.next_batch() for _ in range(n))]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x1, x2) and np.array_equal(y1, y2)
        for (x1, y1), (x2, y2) in zip(a, b, strict=True)
    )


def test_batches_are_shifted_windows_of_the_split(dataset: Dataset) -> None:
    loader = Loader(dataset, "train", seq_len=T, batch_size=4, seed=3)
    batch = loader.next_batch()
    assert batch.inputs.shape == batch.targets.shape == (4, T)
    assert batch.inputs.dtype == np.int64
    assert np.array_equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    windows, _ = window_stream(loader.n_windows, 3, LoaderCursor(), 4)
    split = dataset.split("train")
    for row, w in zip(batch.inputs, windows, strict=True):
        assert np.array_equal(row, split.read(int(w) * T, T))


def test_same_seed_same_batches_other_seed_other_batches(dataset: Dataset) -> None:
    a = _take(Loader(dataset, "train", T, 4, seed=1), 5)
    b = _take(Loader(dataset, "train", T, 4, seed=1), 5)
    c = _take(Loader(dataset, "train", T, 4, seed=2), 5)
    assert _same(a, b) and not _same(a, c)


@pytest.mark.parametrize("k", [1, 7, 70])  # 70 batches of 4 crosses an epoch boundary
def test_resume_from_cursor_equals_uninterrupted(dataset: Dataset, k: int) -> None:
    uninterrupted = Loader(dataset, "train", T, 4, seed=5)
    _take(uninterrupted, k)
    saved = json.loads(json.dumps(uninterrupted.cursor.to_dict()))  # as a checkpoint holds it
    expected = _take(uninterrupted, 10)
    resumed = Loader(dataset, "train", T, 4, seed=5, cursor=saved)
    assert _same(_take(resumed, 10), expected)
    assert resumed.cursor == uninterrupted.cursor


def test_batch_cursor_is_the_resume_point(dataset: Dataset) -> None:
    loader = Loader(dataset, "train", T, 6, seed=0)
    batches = [loader.next_batch() for _ in range(3)]
    again = Loader(dataset, "train", T, 6, seed=0, cursor=batches[1].cursor).next_batch()
    assert np.array_equal(again.inputs, batches[2].inputs)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_global_batch_is_the_same_for_any_world_size(dataset: Dataset, world_size: int) -> None:
    reference = _take(Loader(dataset, "train", T, 8, seed=9), 60)
    ranks = [
        Loader(dataset, "train", T, 8, 9, rank=r, world_size=world_size) for r in range(world_size)
    ]
    for step in range(60):
        parts = [loader.next_batch() for loader in ranks]
        assert all(p.inputs.shape == (8 // world_size, T) for p in parts)
        assert np.array_equal(np.concatenate([p.inputs for p in parts]), reference[step][0])
        assert np.array_equal(np.concatenate([p.targets for p in parts]), reference[step][1])


def test_each_epoch_visits_every_window_exactly_once(dataset: Dataset) -> None:
    loader = Loader(dataset, "train", T, 7, seed=4)  # 7 does not divide the window count
    n = loader.n_windows
    stream, cursor = window_stream(n, 4, LoaderCursor(), 3 * n)
    assert cursor == LoaderCursor(epoch=3, position=0)
    epochs = [stream[e * n : (e + 1) * n] for e in range(3)]
    for order in epochs:
        assert np.array_equal(np.sort(order), np.arange(n))
    assert not np.array_equal(epochs[0], epochs[1])
    # The loader's batches are exactly that stream, straddling epochs without dropping windows.
    split = dataset.split("train")
    rows = np.concatenate([loader.next_batch().inputs for _ in range(-(-2 * n // 7))])
    expected = np.stack([split.read(int(w) * T, T) for w in stream[: len(rows)]])
    assert np.array_equal(rows, expected)


@settings(max_examples=60, deadline=None)
@given(
    n_windows=st.integers(1, 50),
    batch=st.integers(1, 20),
    first=st.integers(0, 10),
    then=st.integers(1, 10),
    seed=st.integers(0, 2**32 - 1),
)
def test_window_stream_resumes_exactly(n_windows, batch, first, then, seed) -> None:
    whole, _ = window_stream(n_windows, seed, LoaderCursor(), batch * (first + then))
    cursor = LoaderCursor()
    for _ in range(first):
        _, cursor = window_stream(n_windows, seed, cursor, batch)
    rest, _ = window_stream(n_windows, seed, cursor, batch * then)
    assert np.array_equal(rest, whole[batch * first :])


def test_clear_errors(dataset: Dataset) -> None:
    val_tokens = dataset.split("val").n_tokens
    with pytest.raises(KilnError, match="fewer than one global batch"):
        Loader(dataset, "val", seq_len=val_tokens, batch_size=2)
    with pytest.raises(KilnError, match="does not divide among 4 ranks"):
        Loader(dataset, "train", T, 6, world_size=4, rank=0)
    with pytest.raises(KilnError, match="rank 2 is not in"):
        Loader(dataset, "train", T, 4, world_size=2, rank=2)
    with pytest.raises(KilnError, match="no split 'test'"):
        Loader(dataset, "test", T, 4)
    with pytest.raises(KilnError, match="'position' must be an integer"):
        Loader(dataset, "train", T, 4, cursor={"epoch": 0, "position": -1})
    with pytest.raises(KilnError, match="beyond the"):
        Loader(dataset, "train", T, 4, cursor={"epoch": 0, "position": 10**9})


def test_batches_as_torch_tensors(dataset: Dataset) -> None:
    torch = pytest.importorskip("torch")
    x, y = Loader(dataset, "train", T, 4).next_batch().to_torch("cpu")
    assert x.dtype == y.dtype == torch.int64 and x.shape == (4, T)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_kiln_data_imports_without_torch() -> None:
    code = "import sys, kiln.data, kiln.data.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
