"""Checkpoints, write side: `checkpoints/step_<N>/` written whole or not at all, plus `latest`.

What a checkpoint holds, how it is listed and read, is kiln/checkpoint_format.py (below train,
for every reader). A checkpoint is written under a temporary name (`.tmp-step_N-PID`,
state.json last) and renamed, so a reader never sees half of one; `checkpoints/latest` (a one-line text file) names the
newest complete one. Pruning renames a checkpoint out of sight (`.trash-step_N-PID`) before
deleting it. Only complete directories (all three files) are listed as checkpoints, and
`clean_leftovers` removes what a killed run left behind (trash, temp folders of dead processes)
but never a `step_<N>` holding weights. The run's main process holds `<run_dir>/.lock` (flock)
while it trains, so a second trainer on the same folder is refused before it tidies.

The files are the same whether one process, DDP or FSDP2 trained: a sharded model's tensors are
gathered to rank 0 (torch.distributed.checkpoint.state_dict, full state dicts) before writing,
and scattered again on load, so a checkpoint resumes on any world size.
"""

from __future__ import annotations

import base64
import contextlib
import os
import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from kiln import __version__
from kiln.checkpoint_format import (
    FILES,
    LATEST,
    SHARDED_DIR,
    STATE_FORMAT,
    STATE_VERSION,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    load_model_tensors,
    read_optimizer,
    read_tensors,
    resume_checkpoint,
    step_dir,
    unique_tensors,
)
from kiln.errors import KilnError
from kiln.fault_points import kill_point
from kiln.folders import abandoned_by, remove_entry
from kiln.io import atomic_write, write_json_atomic

_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


@dataclass
class TrainState:
    """What `state.json` holds beyond the tensors."""

    step: int  # optimizer updates done (including skipped non-finite ones)
    tokens: int  # training tokens consumed
    cursor: dict[str, int]  # the loader's resume point
    config: dict[str, Any]  # the fully resolved TrainConfig
    dataset: dict[str, Any]  # `dataset_fingerprint` of the training data
    skipped_steps: int = 0
    rng: dict[str, Any] | None = None  # rank (as text) -> RNG states
    precision: dict[str, Any] | None = None  # kiln.devices.Precision.to_dict() of the run
    mup: dict[str, Any] | None = None  # kiln.train.mup.mup_record: per-role lr and init (µP)


# ---- RNG --------------------------------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _from_b64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _u32_b64(values: Any) -> str:
    return base64.b64encode(np.asarray(values, dtype="<u4").tobytes()).decode("ascii")


def _u32_from_b64(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<u4")


def capture_rng() -> dict[str, Any]:
    """This process's Python, NumPy and torch (CPU and every CUDA device) RNG states, as JSON.

    The Mersenne Twister states (624 32-bit words and a position) are stored base64-encoded.
    """
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": _u32_b64(internal), "gauss": gauss},
        "numpy": {
            "kind": kind, "keys": _u32_b64(keys), "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": _b64(torch.get_rng_state()),
    }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the RNGs to states captured by `capture_rng`."""
    py = state["python"]
    internal = tuple(int(v) for v in _u32_from_b64(py["state"]))
    random.setstate((py["version"], internal, py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["kind"], _u32_from_b64(npy["keys"]).astype(np.uint32), npy["pos"],
         npy["has_gauss"], npy["cached_gaussian"])
    )  # fmt: skip
    torch.set_rng_state(_from_b64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_from_b64(s) for s in state["cuda"]])


# ---- paths ------------------------------------------------------------------------------------


def git_commit() -> str | None:
    """The commit of the kiln source tree, when it is a git checkout and git is installed."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


# ---- save -------------------------------------------------------------------------------------


def save_checkpoint(
    checkpoints: Path,
    model: nn.Module | dict[str, torch.Tensor],
    optimizer: Any,
    state: TrainState,
    scheduler: dict[str, Any],
    keep_last: int,
    extra_tensors: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write the checkpoint of `state.step` atomically, point `latest` at it, prune old ones.

    `model` is the module or its `full_model_state`; `optimizer` the optimizer or its
    `full_optimizer_state` (what a sharded run's main process passes after gathering).
    `extra_tensors` maps further file names to tensors saved beside the model (e.g. a value model).
    """
    final = step_dir(checkpoints, state.step)
    tmp = make_temp_dir(checkpoints, final, os.getpid())
    try:
        tensors = model if isinstance(model, dict) else unique_tensors(model)[0]
        save_file(tensors, str(tmp / "model.safetensors"))
        kill_point("save:mid-write")
        umask = os.umask(0)  # safetensors creates the file 0600; give it a plain open()'s mode
        os.umask(umask)
        os.chmod(tmp / "model.safetensors", 0o666 & ~umask)
        for name, extra in (extra_tensors or {}).items():
            save_file(extra, str(tmp / name))
            os.chmod(tmp / name, 0o666 & ~umask)
        optim_state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
        torch.save(optim_state, tmp / "optimizer.pt")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(checkpoints, tmp, final, state, scheduler, keep_last)


def make_temp_dir(checkpoints: Path, final: Path, pid: int) -> Path:
    """A fresh, hidden folder that becomes checkpoint `final` once everything is in it."""
    checkpoints.mkdir(parents=True, exist_ok=True)
    tmp = checkpoints / f"{_TMP_PREFIX}{final.name}-{pid}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def publish(
    checkpoints: Path,
    tmp: Path,
    final: Path,
    state: TrainState,
    scheduler: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write state.json into `tmp` (last), rename it to `final`, point `latest` at it, prune."""
    try:
        doc = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "step": state.step,
            "tokens": state.tokens,
            "skipped_steps": state.skipped_steps,
            "cursor": state.cursor,
            "rng": state.rng if state.rng is not None else {"0": capture_rng()},
            "scheduler": scheduler,
            "kiln_version": __version__,
            "git_commit": git_commit(),
            "dataset": state.dataset,
            "config": state.config,
            "precision": state.precision,
            "mup": state.mup,
        }
        write_json_atomic(tmp / "state.json", doc)
        _fsync_dir(tmp)
        kill_point("save:before-rename")
        if final.exists():  # re-saving a step (e.g. after a resume): swap, never half-delete
            old = _trash_name(final)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kill_point("save:after-rename")
    with atomic_write(checkpoints / LATEST) as handle:
        handle.write(final.name + "\n")
    _fsync_dir(checkpoints)
    kill_point("save:before-prune")
    prune(checkpoints, keep_last)
    return final


def prune(checkpoints: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (never the one `latest` names).

    Each is renamed out of sight first, so a kill mid-deletion leaves a hidden trash folder
    (removed by `clean_leftovers`), never a partial `step_<N>`.
    """
    keep = latest_checkpoint(checkpoints)
    for _, path in list_checkpoints(checkpoints)[:-keep_last]:
        if keep is None or path.resolve() != keep.resolve():
            trash = _trash_name(path)
            path.rename(trash)
            kill_point("prune:after-rename")
            shutil.rmtree(trash)


def clean_leftovers(checkpoints: Path) -> tuple[list[str], list[str]]:
    """Remove what killed runs left in `checkpoints`: (names removed, incomplete steps kept).

    Removed: trash and temp folders of processes that are gone (or bore our own PID: see
    `kiln.folders.abandoned_by`), `latest` temp files, and `step_<N>` folders holding nothing of
    value (empty, or only `optimizer.pt` / `state.json`: what older kilns' in-place pruning
    left). A `step_<N>` that still holds `model.safetensors` is never deleted, complete or not
    (a user may have removed optimizer.pt to save disk): it stays, is not listed as a
    checkpoint, and is returned among the kept. Nothing is done to the one `latest` names (it
    gets its clear error). Call it from the run's one main process, at start, holding the run
    lock (`kiln.folders.lock_folder`): trash and `latest` temp files are removed whatever their
    PID, which is only safe while no other trainer can use the folder.
    """
    if not checkpoints.is_dir():
        return [], []
    pointer = checkpoints / LATEST
    named = pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else None
    removed, kept = [], []
    for entry in sorted(checkpoints.iterdir()):
        name = entry.name
        if name.startswith(_TRASH_PREFIX):
            doomed = True  # on its way out; the run lock keeps any live trainer away
        elif name.startswith(_TMP_PREFIX):
            pid = name.rpartition("-")[2]
            doomed = not pid.isdigit() or abandoned_by(int(pid))
        elif name.startswith(f".{LATEST}.") and name.endswith(".tmp"):
            doomed = True  # atomic_write's temp file for the pointer
        elif name.startswith("step_") and name[5:].isdigit() and entry.is_dir():
            if name == named or is_complete(entry):
                continue
            if (entry / "model.safetensors").exists() or (entry / SHARDED_DIR).exists():
                kept.append(name)
                continue
            doomed = all(p.name in FILES and p.is_file() for p in entry.iterdir())
        else:
            doomed = False
        if not doomed:
            continue
        remove_entry(entry)
        removed.append(name)
    return removed, kept


def tidy(checkpoints: Path, keep_last: int | None) -> list[str]:
    """At a run's start: `clean_leftovers`, then prune to `keep_last` (None: no pruning).

    A kill during the pruning after the final save would otherwise leave the extra checkpoints
    forever (a resume with nothing to do saves nothing, so never prunes). Returns notes.
    """
    removed, kept = clean_leftovers(checkpoints)
    notes = [f"removed leftover {name} from {checkpoints}" for name in removed]
    repaired = repair_latest(checkpoints)
    if repaired is not None:
        notes.append(f"{checkpoints / LATEST} was missing: it now names {repaired.name}")
    for name in kept:
        missing = [f for f in FILES if not (checkpoints / name / f).is_file()]
        notes.append(
            f"{checkpoints / name} is incomplete (no {', '.join(missing)}): not a checkpoint, "
            "left in place"
        )
    if keep_last is not None:
        prune(checkpoints, keep_last)
    return notes


def repair_latest(checkpoints: Path) -> Path | None:
    """Point a missing `latest` at the newest complete checkpoint; returns it (None: no change)."""
    if (checkpoints / LATEST).exists() or (target := resume_checkpoint(checkpoints)) is None:
        return None
    with atomic_write(checkpoints / LATEST) as handle:
        handle.write(target.name + "\n")
    _fsync_dir(checkpoints)
    return target


def _trash_name(path: Path) -> Path:
    """Where `path` goes to be deleted: a hidden name that no listing takes for a checkpoint."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{os.getpid()}")
    if trash.exists():
        shutil.rmtree(trash)
    return trash


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (a directory's entries are flushed by fsync on the directory)."""
    with contextlib.suppress(OSError):  # not every filesystem allows opening a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_weights(path: Path, model: nn.Module, optimizer: Any, device: torch.device) -> None:
    """Load the model weights and the optimizer state of checkpoint `path` in place.

    A sharded (FSDP2) model takes the same full-tensor files: every rank reads them and keeps
    its own shard, so a checkpoint loads on any world size.
    """
    if is_sharded(model):
        _load_sharded(path, model, optimizer)
        return
    load_model_tensors(path / "model.safetensors", model, device, "the model")
    state = read_optimizer(path / "optimizer.pt", device)
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as exc:
        raise KilnError(f"{path}/optimizer.pt does not match the optimizer: {exc}") from None


# ---- sharded (FSDP2) models ------------------------------------------------------------------
# A sharded run gathers full tensors to rank 0 and writes the very files a single process
# writes (model.safetensors, optimizer.pt), so any world size, or one process, can load them.
# The price: rank 0 holds the whole model and optimizer state in CPU memory while saving
# (about 12 bytes per parameter with AdamW), which suits the models kiln trains today (up to
# ~1.5B parameters); much larger models would want torch.distributed.checkpoint's sharded
# format instead (see docs/distributed.md).


def is_sharded(model: nn.Module) -> bool:
    """Whether the model's parameters are DTensor shards (FSDP2)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """alias -> name for parameters registered under two names (a tied head -> the embedding)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def full_model_state(model: nn.Module, is_main: bool) -> dict[str, torch.Tensor]:
    """The whole model's tensors on the CPU of the main rank (each tied tensor once); {} elsewhere.

    A collective for a sharded model: every rank must call it.
    """
    if not is_sharded(model):
        return unique_tensors(model)[0] if is_main else {}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    tensors = get_model_state_dict(model, options=options)
    aliases = tied_aliases(model)
    return {k: v.contiguous() for k, v in tensors.items() if k not in aliases} if is_main else {}


def full_optimizer_state(optimizer: Any) -> dict[str, Any]:
    """`optimizer.state_dict()` with every DTensor gathered to a full CPU tensor.

    A collective for a sharded model (every rank must call it, in the same order); the result
    has the single-process layout, so `load_weights` reads it on any world size.
    """
    state = optimizer.state_dict()

    def gathered(value: Any) -> Any:
        return value.full_tensor().cpu() if isinstance(value, DTensor) else value

    # New dicts: state_dict() shares the per-parameter dicts with the live optimizer.
    return {
        "optimizers": [
            {
                **o,
                "state": {i: {k: gathered(v) for k, v in s.items()} for i, s in o["state"].items()},
            }
            for o in state["optimizers"]
        ]
    }


def _load_sharded(path: Path, model: nn.Module, optimizer: Any) -> None:
    """Load full-tensor checkpoint files into a sharded model and its optimizer."""
    tensors = read_tensors(path / "model.safetensors", "cpu")
    for alias, name in tied_aliases(model).items():
        if name in tensors:
            tensors[alias] = tensors[name]
    try:
        set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True))
    except (RuntimeError, KeyError, ValueError) as exc:
        raise KilnError(f"{path}/model.safetensors does not match the model: {exc}") from None
    state = read_optimizer(path / "optimizer.pt", "cpu")
    try:
        for opt, saved in zip(optimizer, state["optimizers"], strict=True):
            params = [p for g in opt.param_groups for p in g["params"]]
            for index, values in saved["state"].items():
                p = params[int(index)]
                if not isinstance(p, DTensor):
                    continue
                for key, value in values.items():
                    if isinstance(value, torch.Tensor) and value.shape == p.shape:
                        # Every rank read the whole file: keep this rank's shard, no traffic.
                        values[key] = distribute_tensor(
                            value.to(p.device), p.device_mesh, p.placements, src_data_rank=None
                        )
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, IndexError) as exc:
        raise KilnError(f"{path}/optimizer.pt does not match the optimizer: {exc}") from None
