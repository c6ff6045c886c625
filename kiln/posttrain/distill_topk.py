"""The teacher's top-k logits, computed once into shards beside the token shards.

`distill.topk = K` (or `kiln distill CONFIG --precompute-topk K`) runs the teacher once over
every training window of the dataset's train split and keeps, per position, its K largest
logits and their token ids:

    DATASET/teacher_topk/k{K}_T{seq_len}/   (or distill.topk_dir)
        manifest.json   k, seq_len, windows, the teacher's weights and sha256, the data's
                        fingerprint, the size in bytes
        ids.npy         (windows, T, K) int32, token ids, largest logit first
        logits.npy      (windows, T, K) float32, the teacher's raw logits (τ is applied later)

The loader's windows are fixed (window w is tokens [w·T, w·T + T + 1) of the split), so a
window's top-k does not depend on the epoch or the seed and is read back by window index. The
folder is written under a temporary name and renamed when complete. A folder made by another
teacher, dataset, K or seq_len is refused in one line (rebuild it with --force).

The loss over the shards is the forward KL from the teacher's top-k *renormalised* to the
student's full softmax read at those K ids (`topk_distill_loss`): the teacher's tail mass goes
to its top-k, and the student is pulled to put its mass there; with K = V it is the full KL.
(Renormalising the student over the K ids too, as a first version did, leaves its mass outside
them free: on bench/distill.py a student trained so reached 5.49 nats/token where the same
steps from scratch reached 4.51.)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib.format import open_memmap
from torch import Tensor, nn

from kiln.data import LoaderCursor
from kiln.data.loader import window_stream
from kiln.errors import KilnError
from kiln.folders import remove_dir
from kiln.io import write_json_atomic

FORMAT = 1


def default_dir(dataset_root: str | Path, k: int, seq_len: int) -> Path:
    """Where the shards of K and seq_len live when distill.topk_dir is not given."""
    return Path(dataset_root) / "teacher_topk" / f"k{k}_T{seq_len}"


def expected_manifest(
    k: int, seq_len: int, teacher_sha256: str, data_fingerprint: dict[str, Any]
) -> dict[str, Any]:
    """The fields a usable manifest must hold (besides sizes and paths)."""
    return {
        "format": FORMAT, "k": k, "seq_len": seq_len, "split": "train",
        "teacher_sha256": teacher_sha256, "data": data_fingerprint,
    }  # fmt: skip


def check_manifest(folder: Path, want: dict[str, Any]) -> dict[str, Any]:
    """The folder's manifest if it matches `want`; a stale or broken one is one clear line."""
    path = folder / "manifest.json"
    try:
        have = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise KilnError(
            f"{path}: unreadable top-k manifest ({exc}); rebuild with --force"
        ) from None
    for key, value in want.items():
        if have.get(key) != value:
            got, need = have.get(key), value
            if key == "teacher_sha256":
                got, need = str(got)[:12] + "…", str(need)[:12] + "…"
            elif key == "data":
                got, need = "other shards", "this dataset's"
            raise KilnError(
                f"{folder}: stale top-k shards: {key} is {got}, this run needs {need}; rebuild "
                "them with `kiln distill CONFIG --precompute-topk K --force`"
            )
    return have


@torch.no_grad()
def precompute(
    teacher: nn.Module,
    split: Any,
    folder: Path,
    want: dict[str, Any],
    teacher_weights: str,
    batch: int = 8,
    say: Any = print,
) -> dict[str, Any]:
    """Run the teacher over every window of `split`; write ids.npy, logits.npy, manifest.json."""
    k, T = want["k"], want["seq_len"]
    n = (split.n_tokens - 1) // T
    if n < 1:
        raise KilnError(f"the train split has {split.n_tokens} tokens, fewer than one window")
    vocab = teacher.cfg.vocab_size
    if not 1 <= k <= vocab:
        raise KilnError(f"distill.topk must be in [1, {vocab}] (the teacher's vocab), got {k}")
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    if tmp.exists():
        remove_dir(tmp)
    tmp.mkdir(parents=True)
    ids = open_memmap(tmp / "ids.npy", mode="w+", dtype=np.int32, shape=(n, T, k))
    logits = open_memmap(tmp / "logits.npy", mode="w+", dtype=np.float32, shape=(n, T, k))
    teacher.eval()
    device = next(teacher.parameters()).device
    started, shown = time.perf_counter(), 0.0
    for lo in range(0, n, batch):
        hi = min(n, lo + batch)
        rows = np.stack([split.read(w * T, T) for w in range(lo, hi)]).astype(np.int64)
        out = teacher(torch.from_numpy(rows).to(device)).float()  # (b, T, V)
        values, index = out.topk(k, dim=-1)
        ids[lo:hi], logits[lo:hi] = index.cpu().numpy(), values.cpu().numpy()
        elapsed = time.perf_counter() - started
        if elapsed - shown > 5 or hi == n:
            shown, rate = elapsed, hi / max(elapsed, 1e-9)
            say(f"kiln distill: top-{k} of the teacher {hi:,}/{n:,} windows, {rate:,.1f} "
                f"windows/s, ETA {(n - hi) / rate:,.0f}s")  # fmt: skip
    ids.flush(), logits.flush()
    del ids, logits
    size = sum((tmp / f).stat().st_size for f in ("ids.npy", "logits.npy"))
    manifest = {**want, "windows": n, "teacher_weights": teacher_weights, "bytes": size}
    write_json_atomic(tmp / "manifest.json", manifest)
    if folder.exists():
        remove_dir(folder)
    os.replace(tmp, folder)
    return manifest


def ensure(
    folder: Path, want: dict[str, Any], force: bool, build: Any, say: Any = print
) -> dict[str, Any]:
    """Use the shards in `folder` if they match `want`; else build them (`build()`), or refuse."""
    if (folder / "manifest.json").exists():
        if not force:
            have = check_manifest(folder, want)
            say(f"kiln distill: teacher top-{want['k']} shards {folder} "
                f"({have['bytes'] / 1e6:,.1f} MB, {have['windows']:,} windows)")  # fmt: skip
            return have
    elif folder.exists() and any(folder.iterdir()):
        raise KilnError(f"{folder} exists and holds no top-k manifest; choose another topk_dir")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every rank would write the same folder
        raise KilnError(f"{folder}: no teacher top-{want['k']} shards yet; write them once "
                        f"before torchrun with `kiln distill CONFIG --precompute-topk {want['k']}`")  # fmt: skip
    made = build()
    say(f"kiln distill: wrote teacher top-{want['k']} shards {folder}: {made['bytes']:,} bytes "
        f"({made['bytes'] / 1e6:,.1f} MB) for {made['windows']:,} windows")  # fmt: skip
    return made


class TopkShards:
    """The shards of one folder, memory-mapped: (ids, logits) of given windows."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ids = np.load(folder / "ids.npy", mmap_mode="r")
        self.logits = np.load(folder / "logits.npy", mmap_mode="r")

    def rows(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, logits) of these windows, (len(windows), T, K) each."""
        order = np.asarray(windows, dtype=np.int64)
        return np.ascontiguousarray(self.ids[order]), np.ascontiguousarray(self.logits[order])


class TopkBatch:
    """A loader batch plus the teacher's top-k of its windows."""

    def __init__(self, batch: Any, ids: np.ndarray, logits: np.ndarray) -> None:
        self.batch, self.ids, self.logits = batch, ids, logits
        self.cursor = batch.cursor

    def to_torch(self, device: str | torch.device | None = None) -> tuple[Tensor, ...]:
        """(inputs, targets, ids (B, T, K) int64, teacher logits (B, T, K))."""
        x, y = self.batch.to_torch(device)
        ids = torch.from_numpy(self.ids).long()
        logits = torch.from_numpy(self.logits)
        return x, y, ids.to(x.device), logits.to(x.device)


class TopkLoader:
    """A kiln.data.Loader whose batches carry the top-k of their windows (same cursor, same rows)."""

    def __init__(self, inner: Any, shards: TopkShards) -> None:
        self.inner, self.shards = inner, shards
        if shards.ids.shape[0] != inner.n_windows or shards.ids.shape[1] != inner.seq_len:
            raise KilnError(f"{shards.folder}: shards hold {shards.ids.shape[:2]} windows × "
                            f"positions, the loader reads ({inner.n_windows}, {inner.seq_len})")  # fmt: skip

    @property
    def cursor(self) -> LoaderCursor:
        """The inner loader's cursor (the resume point)."""
        return self.inner.cursor

    def next_batch(self) -> TopkBatch:
        """The inner loader's next batch with the top-k rows of the same windows."""
        inner = self.inner
        windows, _ = window_stream(
            inner.n_windows, inner.seed, inner.cursor, inner.batch_size, inner._order
        )  # the windows Loader.next_batch is about to read, in its order
        local = inner.batch_size // inner.world_size
        mine = windows[inner.rank * local : (inner.rank + 1) * local]
        batch = inner.next_batch()
        return TopkBatch(batch, *self.shards.rows(mine))
