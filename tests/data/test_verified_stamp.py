"""sha256 verification runs on first use: a stamp in the user cache (never in the dataset) lets a
later open skip files whose size, mtime and inode are unchanged; anything else verifies again."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kiln.data import shard_reader
from kiln.data.shard_reader import Dataset
from kiln.errors import KilnError
from tests.data.test_bad_inputs_data import first_bin, poke_token


def _age(root: Path, seconds: int = 3600) -> None:
    """Date every file of `root` back: a file checked within a timestamp tick of its last change
    is not trusted (its mtime could survive a change), as a freshly built test dataset would be."""
    past = time.time_ns() - seconds * 10**9
    for path in root.iterdir():
        os.utime(path, ns=(past, past))


def _count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the shard files hashed from now on."""
    calls: list[str] = []
    real = shard_reader.sha256_file

    def counting(path, *args, **kwargs):
        calls.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shard_reader, "sha256_file", counting)
    return calls


def _shard_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".idx"))


def test_a_second_open_does_not_hash_the_shards_again(build_dataset, monkeypatch) -> None:
    root = build_dataset(shard_tokens=40)
    _age(root)
    listing = sorted(p.name for p in root.iterdir())
    calls = _count_hashes(monkeypatch)
    Dataset.open(root)
    assert sorted(calls) == _shard_files(root)  # first use: every file
    Dataset.open(root)
    Dataset.open(root)
    assert sorted(calls) == _shard_files(root)  # later opens: none again
    assert sorted(p.name for p in root.iterdir()) == listing  # the dataset is never written
    stamps = list((Path(os.environ["KILN_CACHE_DIR"]) / "verified").iterdir())
    assert len(stamps) == 1 and stamps[0].suffix == ".json"
    Dataset.open(root, verify=True)  # asked for explicitly (inspect --verify): hashed anyway
    assert len(calls) == 2 * len(_shard_files(root))


def test_a_shard_changed_after_its_check_is_hashed_again_and_refused(
    build_dataset, monkeypatch
) -> None:
    root = build_dataset()
    _age(root)
    Dataset.open(root)
    poke_token(first_bin(root), 3, 5)  # in range: only the sha256 can tell
    calls = _count_hashes(monkeypatch)
    with pytest.raises(KilnError, match=r"train_000000\.bin: sha256 differs"):
        Dataset.open(root)
    assert calls == ["train_000000.bin"]


def test_files_changed_just_before_their_check_are_not_trusted_later(
    build_dataset, monkeypatch
) -> None:
    root = build_dataset()  # just written: a change within the same mtime tick could hide
    Dataset.open(root)
    calls = _count_hashes(monkeypatch)
    Dataset.open(root)
    assert sorted(calls) == _shard_files(root)


def test_a_corrupt_or_unwritable_cache_means_verifying_again(
    build_dataset, monkeypatch, tmp_path
) -> None:
    root = build_dataset()
    _age(root)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    Dataset.open(root)
    (stamp,) = (tmp_path / "cache" / "verified").iterdir()
    calls = _count_hashes(monkeypatch)
    for junk in ("{not json", "[]", '{"format": "kiln-verified", "files": []}'):
        stamp.write_text(junk)
        Dataset.open(root)  # re-verified, and the stamp written anew
        assert sorted(calls) == _shard_files(root)
        calls.clear()
    Dataset.open(root)
    assert calls == []
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KILN_CACHE_DIR", str(blocker))
    Dataset.open(root)
    Dataset.open(root)  # nowhere to stamp: verified every time, never an error
    assert len(calls) == 2 * len(_shard_files(root))


def test_no_stamp_without_verification(build_dataset, monkeypatch, tmp_path) -> None:
    root = build_dataset()
    _age(root)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KILN_VERIFY_SHARDS", "0")
    Dataset.open(root)
    assert not (tmp_path / "cache").exists()
