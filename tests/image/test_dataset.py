"""Image datasets on disk: scenes and folders written whole, read back, bad pictures refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kiln.cli import main
from kiln.errors import KilnError
from kiln.image.dataset import ImageDataset, ScenesSpec, build_folder, build_scenes
from kiln.image.scenes import HELDOUT, Group, Scene


def test_scenes_dataset_round_trips_and_is_reproducible(tmp_path: Path) -> None:
    spec = ScenesSpec(size=32, train=12, val=4, heldout=5, seed=7, shard_images=5)
    build_scenes(tmp_path / "a", spec)
    build_scenes(tmp_path / "b", spec)
    a, b = ImageDataset.open(tmp_path / "a"), ImageDataset.open(tmp_path / "b")
    assert a.splits == ["train", "val", "heldout"]
    assert a.images("train").shape == (12, 32, 32, 3)  # three shards joined
    assert a.fingerprint() == b.fingerprint()
    assert np.array_equal(a.images("heldout"), b.images("heldout"))
    for record in a.records("heldout"):
        groups = tuple(Group(**g) for g in record["groups"])
        scene = Scene(groups, record["relation"])
        assert scene.caption() == record["caption"]
        assert scene.pairs() & HELDOUT
        assert all(len(o["box"]) == 4 for o in record["objects"])
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["format"] == "kiln-images"
    assert [s["images"] for s in manifest["splits"]["train"]["shards"]] == [5, 5, 2]
    assert sorted(map(tuple, manifest["source"]["heldout_pairs"])) == sorted(HELDOUT)


def test_cli_builds_scenes_and_refuses_to_overwrite_without_force(tmp_path: Path, capsys) -> None:
    out = tmp_path / "scenes"
    argv = ["image", "data", "--out", str(out), "--train", "6", "--val", "2", "--heldout", "2",
            "--quiet"]  # fmt: skip
    assert main(argv) == 0
    assert "train 6, val 2, heldout 2" in capsys.readouterr().out
    assert main(argv) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert main([*argv, "--force", "--size", "64"]) == 0
    assert ImageDataset.open(out).images("val").shape == (2, 64, 64, 3)
    unrelated = tmp_path / "mine"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("keep me")
    assert main(["image", "data", "--out", str(unrelated), "--train", "2", "--force",
                 "--quiet"]) == 2  # fmt: skip
    assert (unrelated / "notes.txt").read_text() == "keep me"


def _folder(tmp_path: Path, n: int = 5) -> Path:
    folder = tmp_path / "pictures"
    folder.mkdir()
    lines = []
    for i in range(n):
        name = f"p{i}.png" if i % 2 else f"p{i}.jpg"
        picture = Image.new("RGB", (80 + 10 * i, 70), (40 * i, 100, 200))
        picture.save(folder / name)
        lines.append(json.dumps({"file": name, "caption": f"picture {i}"}))
    (folder / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_a_folder_of_pictures_reads_as_a_dataset(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    build_folder(folder, tmp_path / "ds", size=32, val_fraction=0.4, seed=1)
    ds = ImageDataset.open(tmp_path / "ds")
    assert ds.images("train").shape == (3, 32, 32, 3) and ds.images("val").shape == (2, 32, 32, 3)
    captions = sorted(r["caption"] for s in ds.splits for r in ds.records(s))
    assert captions == [f"picture {i}" for i in range(5)]
    record = ds.records("train")[0]
    i = int(record["caption"].split()[1])
    assert np.abs(ds.images("train")[0].astype(int) - (40 * i, 100, 200)).max() <= 3


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda f: (f / "p1.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really"),
            "p1.png: not a readable",
        ),
        (lambda f: Image.new("RGB", (20, 20)).save(f / "p1.png"), "p1.png: 20×20 pixels"),
        (lambda f: Image.new("RGB", (300, 40)).save(f / "p1.png"), "p1.png: 300×40 pixels"),
        (lambda f: Image.new("RGB", (64, 64)).save(f / "p1.png", format="GIF"), "p1.png: a GIF"),
        (lambda f: (f / "p1.png").unlink(), "p1.png does not exist"),
        (lambda f: (f / "captions.jsonl").write_text('{"file": "p0.jpg"}\n'), "captions.jsonl:1"),
    ],
)
def test_a_bad_picture_is_one_line_naming_it_and_nothing_is_written(
    tmp_path: Path, damage, message: str, capsys
) -> None:
    folder = _folder(tmp_path)
    damage(folder)
    out = tmp_path / "ds"
    assert main(["image", "data", "--from", str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_reading_a_damaged_dataset_names_the_file(tmp_path: Path) -> None:
    build_scenes(tmp_path / "ds", ScenesSpec(size=32, train=3, val=0, heldout=0))
    ds = ImageDataset.open(tmp_path / "ds")
    with pytest.raises(KilnError, match="no split 'val'"):
        ds.images("val")
    np.save(tmp_path / "ds" / "train_000000.npy", np.zeros((2, 32, 32, 3), np.uint8))
    with pytest.raises(KilnError, match=r"train_000000.npy: holds uint8\[2, 32, 32, 3\]"):
        ImageDataset.open(tmp_path / "ds").images("train")
    with pytest.raises(KilnError, match="not a kiln image dataset"):
        ImageDataset.open(tmp_path)
