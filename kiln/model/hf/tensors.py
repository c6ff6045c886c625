"""HF tensors by name and from disk: the one lookup every family's import uses, and the reader
of a model directory's weight files (safetensors, sharded or not, or pytorch_model.bin)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from kiln.errors import KilnError


def take(hf: dict[str, Tensor], name: str) -> Tensor:
    """One tensor of an HF state dict, or an error naming the missing key."""
    if name not in hf:
        raise KilnError(f"HF checkpoint has no tensor {name!r}")
    return hf[name]


def read_weights(path: Path) -> dict[str, Tensor]:
    """All tensors of an HF directory: model.safetensors, its sharded index, or pytorch_model.bin."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file as load_safetensors

    def load_file(file: Path) -> dict[str, Tensor]:
        try:
            return load_safetensors(file)
        except (SafetensorError, OSError) as exc:
            raise KilnError(f"{file}: not a readable safetensors file ({exc})") from None

    if (path / "model.safetensors").is_file():
        return load_file(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(path / shard).items()}
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise KilnError(
        f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )
