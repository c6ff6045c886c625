"""Image datasets on disk: the procedural scenes or a folder of pictures, in one format.

A dataset directory, written once (built under a temporary name beside it, then renamed):
- `manifest.json`: format `kiln-images` and version; the side in pixels; for each split the
  ordered shards with image count and both files' sha256; where the pictures came from (the
  scene grammar's seed and held-out pairs, or the folder); the config; kiln version, date.
- `<split>_<NNNNNN>.npy`: uint8 (N, side, side, 3), NumPy's own format (memory-mappable).
- `<split>_<NNNNNN>.jsonl`: one record per image, in order: its caption and, for scenes, the
  ground truth (groups, relation, objects with kind, colour and box as fractions of the side).

Splits: `train`, `val` (new pictures of seen compositions) and, for scenes, `heldout` (unseen
compositions, see kiln/image/scenes.py). A folder gives `train` and `val`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln import __version__
from kiln.data.manifest import creation_time
from kiln.data.tokenize_shards import install_dataset, remove_abandoned_builds
from kiln.errors import KilnError, not_found
from kiln.io import iter_json_lines, sha256_file, write_json_atomic

FORMAT = "kiln-images"
VERSION = 1
MANIFEST_NAME = "manifest.json"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
MAX_ASPECT = 2.0  # a folder's picture may be at most twice as long as it is wide (or tall)


@dataclass(frozen=True)
class ScenesSpec:
    """What `kiln image data` draws: images per split, their side, the seed."""

    size: int = 32
    train: int = 8000
    val: int = 500
    heldout: int = 500
    seed: int = 0
    shard_images: int = 4096

    def __post_init__(self) -> None:
        if self.size not in (32, 64):
            raise KilnError(f"--size must be 32 or 64, got {self.size}")
        for name in ("train", "val", "heldout"):
            if getattr(self, name) < 0:
                raise KilnError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.train < 1:
            raise KilnError("--train must be >= 1")
        if self.shard_images < 1:
            raise KilnError(f"--shard-images must be >= 1, got {self.shard_images}")


def is_image_dataset(directory: Path) -> bool:
    """Whether `directory` holds a kiln image dataset's manifest (what --force may replace)."""
    try:
        doc = json.loads((Path(directory) / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("format") == FORMAT


def _check_output(out: Path, force: bool) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise KilnError(f"{out} exists and is not a directory; choose another --out")
    if not any(out.iterdir()):
        return
    if not force:
        raise KilnError(f"{out} already exists; pass --force to replace it")
    if not is_image_dataset(out):
        raise KilnError(
            f"{out} exists and is not a kiln image dataset (no {MANIFEST_NAME} of format "
            f"{FORMAT!r}); refusing to replace it"
        )


class _SplitWriter:
    """Appends one split's images and records to shards of at most `shard_images` images."""

    def __init__(self, directory: Path, split: str, shard_images: int) -> None:
        self.directory, self.split, self.shard_images = directory, split, shard_images
        self.shards: list[dict[str, Any]] = []
        self._images: list[np.ndarray] = []
        self._records: list[dict[str, Any]] = []

    def add(self, image: np.ndarray, record: dict[str, Any]) -> None:
        self._images.append(image)
        self._records.append(record)
        if len(self._images) >= self.shard_images:
            self._flush()

    def close(self) -> dict[str, Any]:
        if self._images:
            self._flush()
        return {"images": sum(s["images"] for s in self.shards), "shards": self.shards}

    def _flush(self) -> None:
        stem = f"{self.split}_{len(self.shards):06d}"
        npy, jsonl = self.directory / f"{stem}.npy", self.directory / f"{stem}.jsonl"
        np.save(npy, np.stack(self._images).astype(np.uint8), allow_pickle=False)
        with jsonl.open("w", encoding="utf-8") as handle:
            for record in self._records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.shards.append(
            {"name": stem, "images": len(self._images), "sha256": sha256_file(npy),
             "records_sha256": sha256_file(jsonl)}
        )  # fmt: skip
        self._images, self._records = [], []


def _build(
    out: Path,
    force: bool,
    size: int,
    shard_images: int,
    splits: dict[str, Iterator[tuple[np.ndarray, dict[str, Any]]]],
    source: dict[str, Any],
    config: dict[str, Any],
) -> dict[str, Any]:
    """Write the dataset in a temporary folder beside `out`, then rename it into place."""
    remove_abandoned_builds(out)
    _check_output(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".tmp", dir=out.parent)
    )
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        written = {}
        for split, items in splits.items():
            writer = _SplitWriter(tmp, split, shard_images)
            for image, record in items:
                writer.add(image, record)
            written[split] = writer.close()
        manifest = {
            "format": FORMAT, "version": VERSION, "size": size, "channels": 3,
            "splits": written, "source": source, "config": config,
            "created": creation_time(), "kiln_version": __version__,
        }  # fmt: skip
        write_json_atomic(tmp / MANIFEST_NAME, manifest)
        install_dataset(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _scenes(spec: ScenesSpec, split: str, n: int, tick: Callable[[], None]):
    from kiln.image.render import render
    from kiln.image.scenes import sample_scene

    for index in range(n):
        # One generator per picture: a picture depends on (seed, split, index) only.
        rng = random.Random(f"{spec.seed}:{split}:{index}")
        scene = sample_scene(rng, unseen=split == "heldout")
        image, truth = render(scene, spec.size, rng)
        tick()
        yield np.asarray(image, dtype=np.uint8), {"caption": scene.caption(), **truth}


def build_scenes(
    out: str | os.PathLike[str], spec: ScenesSpec, force: bool = False,
    tick: Callable[[], None] = lambda: None,
) -> dict[str, Any]:  # fmt: skip
    """Draw the procedural scene dataset of `spec` into `out`; returns its manifest."""
    from kiln.image.scenes import HELDOUT

    counts = {"train": spec.train, "val": spec.val, "heldout": spec.heldout}
    splits = {s: _scenes(spec, s, n, tick) for s, n in counts.items() if n > 0}
    source = {
        "kind": "scenes", "seed": spec.seed,
        "heldout_pairs": [list(p) for p in sorted(HELDOUT)],
    }  # fmt: skip
    config = {k: getattr(spec, k) for k in ScenesSpec.__dataclass_fields__}
    return _build(Path(out), force, spec.size, spec.shard_images, splits, source, config)


# ---- a folder of pictures ----------------------------------------------------------------------


def _folder_entries(folder: Path) -> list[tuple[str, Path, str]]:
    """(where, image path, caption) for each line of `folder/captions.jsonl`, checked."""
    captions = folder / "captions.jsonl"
    if not folder.is_dir():
        raise not_found(folder, "image folder")
    if not captions.is_file():
        raise KilnError(f"{captions}: missing; the folder needs one line per picture, e.g. "
                        '{"file": "cat.png", "caption": "a black cat on the grass"}')  # fmt: skip
    entries, seen = [], set()
    for where, record in iter_json_lines(captions):
        if not isinstance(record, dict) or not all(
            isinstance(record.get(k), str) and record.get(k) for k in ("file", "caption")
        ):
            raise KilnError(f"{where}: expected an object with string 'file' and 'caption'")
        path = folder / record["file"]
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            raise KilnError(f"{where}: {record['file']!r} is not a .png, .jpg or .jpeg file")
        if not path.is_file():
            raise KilnError(f"{where}: {path} does not exist")
        if record["file"] in seen:
            raise KilnError(f"{where}: {record['file']!r} is listed twice")
        seen.add(record["file"])
        entries.append((where, path, record["caption"]))
    if not entries:
        raise KilnError(f"{captions}: no pictures listed")
    return entries


def load_picture(path: Path, size: int) -> np.ndarray:
    """A PNG or JPEG as uint8 (size, size, 3): centre-cropped to a square, then resized.

    A file that is not a readable PNG/JPEG, is smaller than `size`, or is more than MAX_ASPECT
    times as long as wide is one KilnError naming the file.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            kind = im.format
            im.load()
            picture = im.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise KilnError(f"{path}: not a readable PNG or JPEG image ({exc})") from None
    except Image.DecompressionBombError:
        raise KilnError(f"{path}: too many pixels to be a picture to train on") from None
    if kind not in ("PNG", "JPEG"):
        raise KilnError(f"{path}: a {kind} image; expected PNG or JPEG")
    w, h = picture.size
    if min(w, h) < size or max(w, h) > MAX_ASPECT * min(w, h):
        raise KilnError(
            f"{path}: {w}×{h} pixels; expected at least {size}×{size}, sides within "
            f"{MAX_ASPECT:g}:1"
        )
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    square = picture.crop((left, top, left + side, top + side))
    return np.asarray(square.resize((size, size), Image.Resampling.LANCZOS), dtype=np.uint8)


def build_folder(
    folder: str | os.PathLike[str], out: str | os.PathLike[str], size: int = 32,
    val_fraction: float = 0.1, seed: int = 0, force: bool = False, shard_images: int = 4096,
) -> dict[str, Any]:  # fmt: skip
    """A folder of PNG/JPEG pictures plus captions.jsonl as an image dataset in `out`.

    Every picture is read and checked before anything is written, so a bad one stops the build
    with nothing half-written.
    """
    if size < 8:
        raise KilnError(f"--size must be >= 8, got {size}")
    if not 0 <= val_fraction < 1:
        raise KilnError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    root = Path(folder)
    entries = _folder_entries(root)
    pictures = [load_picture(path, size) for _, path, _ in entries]
    n_val = round(val_fraction * len(entries)) if len(entries) > 1 else 0
    val = set(random.Random(seed).sample(range(len(entries)), n_val))

    def split(in_val: bool):
        for i, ((_, path, caption), picture) in enumerate(zip(entries, pictures, strict=True)):
            if (i in val) == in_val:
                yield picture, {"caption": caption, "file": path.relative_to(root).as_posix()}

    splits = {"train": split(False), **({"val": split(True)} if n_val else {})}
    source = {"kind": "folder", "path": os.path.abspath(root), "pictures": len(entries)}
    config = {"size": size, "val_fraction": val_fraction, "seed": seed}
    return _build(Path(out), force, size, shard_images, splits, source, config)


# ---- reading -----------------------------------------------------------------------------------


@dataclass
class ImageDataset:
    """A dataset directory read back: its manifest, and each split's images and records."""

    root: Path
    manifest: dict[str, Any]
    _cache: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> ImageDataset:
        """Read and check `directory/manifest.json`; problems name the file and the field."""
        root = Path(directory)
        path = root / MANIFEST_NAME
        if not root.is_dir():
            raise not_found(root, "image dataset directory")
        if not path.is_file():
            raise KilnError(f"{path}: missing; {root} is not a kiln image dataset")
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise KilnError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise KilnError(f"{path}: format is {found!r}, expected {FORMAT!r}")
        if doc.get("version") != VERSION:
            raise KilnError(f"{path}: version {doc.get('version')!r}, this kiln reads {VERSION}")
        if not isinstance(doc.get("size"), int) or not isinstance(doc.get("splits"), dict):
            raise KilnError(f"{path}: malformed manifest (needs an integer 'size' and 'splits')")
        return cls(root, doc)

    @property
    def size(self) -> int:
        """The side of every picture, in pixels."""
        return int(self.manifest["size"])

    @property
    def splits(self) -> list[str]:
        """The split names, in the manifest's order."""
        return list(self.manifest["splits"])

    def _split(self, split: str) -> dict[str, Any]:
        if split not in self.manifest["splits"]:
            raise KilnError(f"{self.root}: no split {split!r}; it has {', '.join(self.splits)}")
        return self.manifest["splits"][split]

    def images(self, split: str) -> np.ndarray:
        """uint8 (N, side, side, 3) of a split (shards memory-mapped, joined once)."""
        if split not in self._cache:
            arrays = []
            for shard in self._split(split)["shards"]:
                file = self.root / f"{shard['name']}.npy"
                try:
                    array = np.load(file, mmap_mode="r", allow_pickle=False)
                except (OSError, ValueError) as exc:
                    raise KilnError(f"{file}: not a readable image shard ({exc})") from None
                expected = (shard["images"], self.size, self.size, 3)
                if array.shape != expected or array.dtype != np.uint8:
                    raise KilnError(
                        f"{file}: holds {array.dtype}{list(array.shape)}, the manifest says "
                        f"uint8{list(expected)}"
                    )
                arrays.append(array)
            self._cache[split] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        return self._cache[split]

    def records(self, split: str) -> list[dict[str, Any]]:
        """Each image's record (caption, ground truth), in order."""
        out: list[dict[str, Any]] = []
        for shard in self._split(split)["shards"]:
            out.extend(
                record for _, record in iter_json_lines(self.root / f"{shard['name']}.jsonl")
            )
        return out

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the contents wherever the folder lives: size and shard checksums."""
        import hashlib

        out: dict[str, Any] = {"size": self.size}
        for name, split in sorted(self.manifest["splits"].items()):
            digest = hashlib.sha256("".join(s["sha256"] for s in split["shards"]).encode())
            out[f"{name}_images"] = split["images"]
            out[f"{name}_sha256"] = digest.hexdigest()
        return out
