"""Find and load the model and tokenizer that `kiln eval` scores: an HF directory, a checkpoint
directory, or a training run directory (its latest checkpoint)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.model.transformer import Transformer
from kiln.tokenizer.tokenizer import Tokenizer

EOT = "<|endoftext|>"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode, its tokenizer and end-of-text id, and where they came from."""

    model: Transformer
    tokenizer: Tokenizer
    eot_id: int | None
    source: str  # e.g. "checkpoint runs/demo/checkpoints/step_500"
    tokenizer_path: Path


def resolve_device(name: str) -> torch.device:
    """cpu, cuda[:N], or auto (the GPU when there is one)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise KilnError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KilnError("--device cuda: no CUDA device is available")
    return device


def load_model(
    path: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | None = None,
    device: str = "cpu",
    dtype: str = "fp32",
) -> LoadedModel:
    """Load an HF model directory, a checkpoint directory or a run's latest checkpoint."""
    path = Path(path)
    if dtype not in DTYPES:
        raise KilnError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch_device = resolve_device(device)
    if (path / "config.json").is_file():
        loaded = _load_hf_dir(path, tokenizer, torch_device)
    elif (path / "state.json").is_file() or (path / "checkpoints").is_dir():
        loaded = _load_checkpoint(path, tokenizer, torch_device)
    elif not path.exists():
        raise KilnError(f"{path}: no such model directory")
    else:
        raise KilnError(
            f"{path}: not a model directory (expected an HF directory with config.json, a "
            "checkpoint with state.json, or a run directory with checkpoints/)"
        )
    loaded.model.to(DTYPES[dtype]).eval()
    return loaded


def _load_hf_dir(
    path: Path, tokenizer: str | os.PathLike[str] | None, device: torch.device
) -> LoadedModel:
    """An HF directory (as `kiln sample` reads it); the tokenizer is looked for beside it."""
    from kiln.model.cli import eos_ids, tokenizer_file_in
    from kiln.model.hf import load_hf_dir
    from kiln.train.export import load_tokenizer

    model = load_hf_dir(path, device=device)
    tok_path = Path(tokenizer) if tokenizer is not None else tokenizer_file_in(path)
    if not tok_path.is_file():
        raise KilnError(f"{tok_path}: no such tokenizer file")
    tok = load_tokenizer(tok_path, {}, model.cfg)  # checks it fits the model's vocabulary
    eos = eos_ids(path)
    eot_id = eos[0] if eos else tok.special_tokens.get(EOT)
    return LoadedModel(model, tok, eot_id, f"HF directory {path}", tok_path)


def _load_checkpoint(
    path: Path, tokenizer: str | os.PathLike[str] | None, device: torch.device
) -> LoadedModel:
    """A kiln checkpoint (or a run's latest), with the tokenizer its dataset was encoded with."""
    from kiln.train import checkpoint as ckpt
    from kiln.train.export import (
        find_checkpoint,
        find_tokenizer,
        load_checkpoint_model,
        load_tokenizer,
    )

    checkpoint = path if (path / "state.json").is_file() else find_checkpoint(path)
    state = ckpt.read_state(checkpoint)
    model = load_checkpoint_model(checkpoint, device=device)
    if tokenizer is not None:
        tok_path, eot_token = Path(tokenizer), EOT
    else:
        tok_path, eot_token = find_tokenizer(checkpoint, state)
    if not tok_path.is_file():
        raise KilnError(f"{tok_path}: no such tokenizer file")
    tok = load_tokenizer(tok_path, state, model.cfg)  # checks it is the run's vocabulary
    return LoadedModel(
        model, tok, tok.special_tokens.get(eot_token), f"checkpoint {checkpoint}", tok_path
    )
