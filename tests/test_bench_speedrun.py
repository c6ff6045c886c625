"""bench/speedrun.py's data split: the held-out stories and the --subset proxy (every K-th
training story), read from ../shared/data as the benchmark reads them. No training runs here."""

from pathlib import Path

import pytest

from tests.fixtures import bench_script, require_shared


@pytest.fixture(scope="module")
def speedrun():
    module = bench_script("speedrun", "bench_speedrun_test")
    require_shared(module.TRAIN_TEXT)
    return module


def _stories(module, path: Path) -> list[str]:
    from kiln.data.documents import iter_documents

    return list(iter_documents(str(path), module.EOT))


def test_holdout_is_every_50th_story_and_disjoint_from_training(speedrun, tmp_path) -> None:
    train, holdout = speedrun.split_stories(tmp_path)
    kept, held = _stories(speedrun, train), _stories(speedrun, holdout)
    assert len(held) == (len(kept) + len(held)) // 50
    assert not set(held) & set(kept)


def test_subset_keeps_every_kth_training_story_in_order(speedrun, tmp_path) -> None:
    train, _ = speedrun.split_stories(tmp_path)
    kept = _stories(speedrun, train)
    subset = _stories(speedrun, speedrun.subset_stories(tmp_path, 16))
    assert subset == kept[::16]
    assert len(subset) == -(-len(kept) // 16)
    again = speedrun.subset_stories(tmp_path, 16)  # written once, then read back as it is
    assert _stories(speedrun, again) == subset
