"""The on-disk checkpoint, read side: what a `step_<N>/` folder holds and how to read it.

`runs/<name>/checkpoints/step_<N>/` holds `model.safetensors` (a tied head stored once),
`optimizer.pt` (torch optimizer state dicts, loaded with weights_only) and `state.json`: step,
tokens seen, loader cursor, RNG states per rank, the schedule, kiln version, git commit and the
fully resolved config. A sharded checkpoint (torch.distributed.checkpoint) holds `dcp/` and
`state.json` instead. `checkpoints/latest` (a one-line text file) names the newest complete one;
only complete folders are listed as checkpoints.

This is the low layer every reader of checkpoints uses (kiln.loading, post-training, scaling,
export); it imports nothing above kiln.model and kiln.data. Writing, pruning and tidying live in
kiln/train/checkpoint.py, which follows the rules stated here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from kiln.data.manifest import Manifest
from kiln.errors import KilnError

STATE_FORMAT = "kiln.checkpoint"
STATE_VERSION = 1
LATEST = "latest"
# Written in this order; state.json last, so its presence (with the others) marks completeness.
FILES = ("model.safetensors", "optimizer.pt", "state.json")
# A sharded checkpoint (torch.distributed.checkpoint, see sharded_checkpoint.py): DCP's folder,
# complete once its .metadata exists, and state.json, written after it.
SHARDED_DIR = "dcp"
SHARDED_FILES = (f"{SHARDED_DIR}/.metadata", "state.json")


# ---- paths and listing -------------------------------------------------------------------------


def step_dir(checkpoints: Path, step: int) -> Path:
    """The directory of the checkpoint after `step` updates."""
    return checkpoints / f"step_{step}"


def is_complete(path: Path) -> bool:
    """Whether checkpoint directory `path` holds every file of a checkpoint."""
    if not path.is_dir():
        return False
    return any(all((path / name).is_file() for name in files) for files in (FILES, SHARDED_FILES))


def _step_dirs(checkpoints: Path) -> list[tuple[int, Path]]:
    """Every `step_<N>` directory, complete or not, as (step, dir), oldest first."""
    found = []
    if checkpoints.is_dir():
        for entry in checkpoints.iterdir():
            name = entry.name
            if entry.is_dir() and name.startswith("step_") and name[5:].isdigit():
                found.append((int(name[5:]), entry))
    return sorted(found)


def list_checkpoints(checkpoints: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, dir), oldest first (a partial directory is not one)."""
    return [(step, path) for step, path in _step_dirs(checkpoints) if is_complete(path)]


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The checkpoint `latest` names, or None when there is none; a dangling pointer is an error."""
    pointer = checkpoints / LATEST
    if not pointer.is_file():
        return None
    target = checkpoints / pointer.read_text(encoding="utf-8").strip()
    if not is_complete(target):
        raise KilnError(f"{pointer} names {target.name}, which is missing or incomplete")
    return target


def resume_checkpoint(checkpoints: Path) -> Path | None:
    """The checkpoint a resume continues from: the one `latest` names, else the newest complete.

    A kill between a save's rename and its `latest` write (the first save has no older pointer)
    leaves a complete step_N and no `latest`; that step is the run's newest state.
    """
    latest = latest_checkpoint(checkpoints)
    if latest is None and not (checkpoints / LATEST).exists():
        listed = list_checkpoints(checkpoints)
        latest = listed[-1][1] if listed else None
    return latest


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether checkpoint directory `path` is in DCP's sharded format."""
    return (path / SHARDED_DIR / ".metadata").is_file()


def dataset_fingerprint(manifest: Manifest) -> dict[str, Any]:
    """What identifies a dataset's contents wherever it lives: tokenizer and shard checksums."""
    fingerprint: dict[str, Any] = {
        "tokenizer_sha256": manifest.tokenizer.sha256,
        "vocab_size": manifest.tokenizer.vocab_size,
    }
    for name, split in sorted(manifest.splits.items()):
        digest = hashlib.sha256("".join(s.sha256 for s in split.shards).encode()).hexdigest()
        fingerprint[f"{name}_tokens"] = split.tokens
        fingerprint[f"{name}_shards_sha256"] = digest
    return fingerprint


# ---- reading ---------------------------------------------------------------------------------


def read_state(path: Path) -> dict[str, Any]:
    """The `state.json` of checkpoint directory `path`, checked for format and version."""
    file = path / "state.json"
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise KilnError(f"{file}: cannot read checkpoint state ({exc})") from None
    if doc.get("format") != STATE_FORMAT or doc.get("version") != STATE_VERSION:
        raise KilnError(
            f"{file}: not a kiln checkpoint of version {STATE_VERSION} "
            f"(format {doc.get('format')!r}, version {doc.get('version')!r})"
        )
    return doc


def read_tensors(file: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's safetensors file; a damaged file is one clear error."""
    try:
        return load_file(str(file), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise KilnError(f"{file}: not a readable safetensors file ({exc})") from None


def read_optimizer(file: Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint's optimizer state (tensors only, no code); a damaged file is one clear error."""
    try:
        return torch.load(file, map_location=device, weights_only=True)
    except Exception as exc:  # torch raises many kinds (pickle, zip, key errors) for bad bytes
        raise KilnError(f"{file}: not a readable optimizer state ({type(exc).__name__})") from None


def load_model_tensors(
    file: Path, model: nn.Module, device: Any, against: str, transform: Any = None
) -> None:
    """Load `file`'s tensors into `model` in place; a tied head stored once is not missing.

    `transform` (tensors -> tensors), if given, rewrites them first (e.g. merges LoRA adapters).
    """
    _, aliases = unique_tensors(model)
    tensors = read_tensors(file, device)
    if transform is not None:
        tensors = transform(tensors)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [name for name in missing if name not in aliases]
    if missing or unexpected:
        raise KilnError(
            f"{file} does not match {against}: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )


def unique_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The state dict with each shared tensor once (under its first name), and the dropped names.

    A tied LM head is the embedding's own Parameter: it is stored once, as the embedding (the
    layout Hugging Face uses), and loading the embedding restores both.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: set[str] = set()
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            aliases.add(name)
            continue
        seen.add(key)
        tensors[name] = t.detach().contiguous()
    return tensors, aliases


def config_differences(
    saved: dict[str, Any], current: dict[str, Any], prefix: str = ""
) -> list[str]:
    """`key: old -> new` for every leaf that differs between two plain config dicts."""
    out = []
    for key in sorted(set(saved) | set(current)):
        name = f"{prefix}{key}"
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(config_differences(a, b, f"{name}."))
        elif _normal(a) != _normal(b):
            out.append(f"{name}: {a!r} -> {b!r}")
    return out


def _normal(value: Any) -> Any:
    """Tuples and lists compare equal (JSON turns one into the other)."""
    return [_normal(v) for v in value] if isinstance(value, list | tuple) else value
