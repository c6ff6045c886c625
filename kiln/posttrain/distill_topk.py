"""The teacher's top-k, computed once into shards beside the token shards.

`distill.topk = K` (or `kiln distill CONFIG --precompute-topk K`) runs the teacher once over
every training window of the dataset's train split and keeps, per position, its K most likely
token ids, their log-probabilities at the run's temperature τ, and the log of the mass left
outside them:

    DATASET/teacher_topk/k{K}_T{seq_len}_tau{τ}/   (or distill.topk_dir)
        manifest.json   format 2, k, seq_len, temperature, windows, the teacher's weights and
                        sha256, the data's fingerprint, the size in bytes
        ids.npy         (windows, T, K) int32, token ids, most likely first
        logprobs.npy    (windows, T, K) float32, log softmax(teacher logits / τ) at the ids
        tail.npy        (windows, T) float32, log(1 − Σ p_k) (−inf when K = V)

The loader's windows are fixed (window w is tokens [w·T, w·T + T + 1) of the split), so a
window's top-k does not depend on the epoch or the seed and is read back by window index. The
folder is written under a temporary name and renamed when complete. A folder made by another
teacher, dataset, K, seq_len or τ is refused in one line (rebuild it with --force), and so is
a format-1 folder (raw top-k logits with no tail mass, which this loss cannot be computed from).

The loss over the shards (`kiln.model.loss.topk_distill_loss`) is the forward KL over K + 1
buckets, the K ids and "everything else", between the teacher's and the student's
distributions, both summing to one; K = V gives the full-vocabulary KL. Earlier versions
renormalised the teacher over its top-k (no tail bucket): on bench/distill.py its students
lost to scratch even at equal steps (4.98 vs 4.51 nats/token, τ = 2).
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
from kiln.model.loss import teacher_topk

FILES = ("ids.npy", "logprobs.npy", "tail.npy")
FORMAT = 2  # 1: raw top-k logits, no tail mass (refused: the K + 1 bucket KL needs it)


def default_dir(dataset_root: str | Path, k: int, seq_len: int, temperature: float) -> Path:
    """Where the shards of K, seq_len and τ live when distill.topk_dir is not given."""
    return Path(dataset_root) / "teacher_topk" / f"k{k}_T{seq_len}_tau{temperature:g}"


def expected_manifest(
    k: int,
    seq_len: int,
    temperature: float,
    teacher_sha256: str,
    data_fingerprint: dict[str, Any],
) -> dict[str, Any]:
    """The fields a usable manifest must hold (besides sizes and paths)."""
    return {
        "format": FORMAT, "k": k, "seq_len": seq_len, "temperature": temperature,
        "split": "train", "teacher_sha256": teacher_sha256, "data": data_fingerprint,
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
    if have.get("format") != FORMAT:
        raise KilnError(
            f"{folder}: top-k shards of format {have.get('format')} (raw top-k logits, no tail "
            f"mass); this kiln needs format {FORMAT} (log-probs at τ and the tail mass): rebuild "
            "them with `kiln distill CONFIG --precompute-topk K --force`"
        )
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
    """Run the teacher over every window of `split`; write the ids, log-probs, tail, manifest."""
    k, T, tau = want["k"], want["seq_len"], want["temperature"]
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
    logp = open_memmap(tmp / "logprobs.npy", mode="w+", dtype=np.float32, shape=(n, T, k))
    tail = open_memmap(tmp / "tail.npy", mode="w+", dtype=np.float32, shape=(n, T))
    teacher.eval()
    device = next(teacher.parameters()).device
    started, shown = time.perf_counter(), 0.0
    for lo in range(0, n, batch):
        hi = min(n, lo + batch)
        rows = np.stack([split.read(w * T, T) for w in range(lo, hi)]).astype(np.int64)
        out = teacher(torch.from_numpy(rows).to(device))  # (b, T, V)
        index, values, rest = teacher_topk(out, k, tau)
        ids[lo:hi], logp[lo:hi] = index.cpu().numpy(), values.cpu().numpy()
        tail[lo:hi] = rest.cpu().numpy()
        elapsed = time.perf_counter() - started
        if elapsed - shown > 5 or hi == n:
            shown, rate = elapsed, hi / max(elapsed, 1e-9)
            say(f"kiln distill: top-{k} of the teacher {hi:,}/{n:,} windows, {rate:,.1f} "
                f"windows/s, ETA {(n - hi) / rate:,.0f}s")  # fmt: skip
    ids.flush(), logp.flush(), tail.flush()
    del ids, logp, tail
    size = sum((tmp / f).stat().st_size for f in FILES)
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
    """The shards of one folder, memory-mapped: (ids, log-probs, tail) of given windows."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        missing = [f for f in FILES if not (folder / f).is_file()]
        if missing:
            raise KilnError(f"{folder}: top-k shards without {', '.join(missing)}; rebuild "
                            "them with `kiln distill CONFIG --precompute-topk K --force`")  # fmt: skip
        self.ids, self.logp, self.tail = (np.load(folder / f, mmap_mode="r") for f in FILES)

    def rows(self, windows: np.ndarray) -> tuple[np.ndarray, ...]:
        """(ids, log-probs) (len(windows), T, K) and the tail (len(windows), T) of these windows."""
        order = np.asarray(windows, dtype=np.int64)
        return tuple(np.ascontiguousarray(a[order]) for a in (self.ids, self.logp, self.tail))


class TopkBatch:
    """A loader batch plus the teacher's top-k of its windows."""

    def __init__(self, batch: Any, ids: np.ndarray, logp: np.ndarray, tail: np.ndarray) -> None:
        self.batch, self.ids, self.logp, self.tail = batch, ids, logp, tail
        self.cursor = batch.cursor

    def to_torch(self, device: str | torch.device | None = None) -> tuple[Tensor, ...]:
        """(inputs, targets, ids (B, T, K) int64, log-probs (B, T, K), log tail mass (B, T))."""
        x, y = self.batch.to_torch(device)
        ids = torch.from_numpy(self.ids).long().to(x.device)
        return (
            x,
            y,
            ids,
            torch.from_numpy(self.logp).to(x.device),
            torch.from_numpy(self.tail).to(x.device),
        )


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
