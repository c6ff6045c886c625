"""`kiln export RUN --hf DIR`: a run's checkpoint as a Hugging Face model directory.

The directory holds what `transformers` needs to load the model and its tokenizer offline:
`config.json` + `model.safetensors` (kiln.model.hf), the tokenizer as HF `tokenizer.json` with a
`tokenizer_config.json` and `special_tokens_map.json` (a `PreTrainedTokenizerFast`, eos = the
dataset's end-of-text token), and `kiln_export.json` saying which run and step it came from. It is
written under a temporary name beside DIR and renamed, so DIR never holds half an export.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln import __version__
from kiln.errors import KilnError
from kiln.io import check_can_replace_dir, sha256_file, write_json_atomic
from kiln.model.config import ModelConfig
from kiln.model.transformer import Transformer
from kiln.tokenizer.tokenizer import Tokenizer
from kiln.train import checkpoint as ckpt

EOT = "<|endoftext|>"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class ExportResult:
    """What `export_hf` wrote, for the CLI to report."""

    out: Path
    checkpoint: Path
    step: int
    tokens: int
    model_type: str
    tokenizer: Path
    eos_token: str
    eos_id: int


# ---- checkpoint -> model -------------------------------------------------------------------------


def find_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The checkpoint directory of `run_dir` at `step`, or the one `latest` names."""
    if not run_dir.is_dir():
        raise KilnError(f"{run_dir}: no such run directory")
    checkpoints = run_dir / "checkpoints"
    found = ckpt.list_checkpoints(checkpoints)
    if step is not None:
        path = ckpt.step_dir(checkpoints, step)
        if not ckpt.is_complete(path):  # a partial folder (a kill mid-prune) is not one
            have = ", ".join(str(s) for s, _ in found) or "none"
            raise KilnError(f"{path}: no checkpoint of step {step} (steps saved: {have})")
        return path
    latest = ckpt.latest_checkpoint(checkpoints)
    if latest is None:
        if not found:
            raise KilnError(
                f"{run_dir}: no checkpoints (expected {checkpoints}/{ckpt.LATEST}); "
                "is it a `kiln train` run directory?"
            )
        latest = found[-1][1]  # steps exist but no pointer: take the newest
    return latest


def load_checkpoint_model(path: Path, device: str | torch.device = "cpu") -> Transformer:
    """A Transformer with the config and weights of checkpoint `path`, in eval mode."""
    state = ckpt.read_state(path)
    try:
        cfg = ModelConfig.from_dict(dict(state["config"]["model"]))
    except (KeyError, TypeError) as exc:
        raise KilnError(f"{path}/state.json: no usable config.model ({exc})") from None
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise KilnError(
            f"{weights}: missing (a sharded checkpoint? export reads model.safetensors)"
        )
    with torch.device("meta"):  # no random init of weights that are overwritten at once
        model = Transformer(cfg)
    model.to_empty(device=device)
    _, aliases = ckpt.unique_tensors(model)  # a tied head is stored once, as the embedding
    tensors = ckpt.read_tensors(weights, device)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [name for name in missing if name not in aliases]
    if missing or unexpected:
        raise KilnError(
            f"{weights} does not match the config in state.json: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    model.init_rope()
    return model.eval()


# ---- the run's tokenizer -------------------------------------------------------------------------


def find_tokenizer(checkpoint: Path, state: dict[str, Any]) -> tuple[Path, str]:
    """The tokenizer file the run's dataset was encoded with, and its end-of-text token.

    Found through the dataset manifest that the checkpoint's config names; the file must still be
    the one the manifest (and the checkpoint's dataset fingerprint) recorded.
    """
    from kiln.data.manifest import Manifest

    dataset = state.get("config", {}).get("data", {}).get("dataset")
    if not dataset:
        raise KilnError(f"{checkpoint}/state.json names no data.dataset; pass --tokenizer PATH")
    try:
        manifest = Manifest.read(Path(dataset))
    except KilnError as exc:
        raise KilnError(f"cannot find the run's tokenizer: {exc}; pass --tokenizer PATH") from None
    entry = manifest.tokenizer
    path = Path(entry.path)
    if not path.is_file():
        raise KilnError(
            f"{path}: the tokenizer named in {dataset}/manifest.json is missing; "
            "pass --tokenizer PATH"
        )
    trained = state.get("dataset", {}).get("tokenizer_sha256", entry.sha256)
    actual = sha256_file(path)
    if actual != trained or actual != entry.sha256:
        raise KilnError(
            f"{path}: sha256 {actual[:12]}… is not the tokenizer the run was trained with "
            f"({trained[:12]}…); pass --tokenizer PATH"
        )
    return path, entry.eot_token


def load_tokenizer(path: Path, state: dict[str, Any], cfg: ModelConfig) -> Tokenizer:
    """Read a tokenizer file (any format kiln reads) and check it fits the model."""
    from kiln.tokenizer.formats import read_any

    tok = read_any(path)
    trained = state.get("dataset", {}).get("vocab_size")
    if trained is not None and tok.n_vocab != trained:
        raise KilnError(
            f"{path}: {tok.n_vocab} tokens, but the run was trained on a {trained}-token vocabulary"
        )
    if tok.n_vocab > cfg.vocab_size:
        raise KilnError(f"{path}: {tok.n_vocab} tokens, more than the model's {cfg.vocab_size}")
    return tok


def write_hf_tokenizer(tok: Tokenizer, out: Path, eos_token: str, max_length: int) -> None:
    """tokenizer.json + the two small files `AutoTokenizer` needs for a PreTrainedTokenizerFast."""
    from kiln.tokenizer.formats import write_hf

    write_hf(tok, out / "tokenizer.json", force=True)
    special = {"bos_token": eos_token, "eos_token": eos_token}
    added = {
        str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for name, i in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    }  # fmt: skip
    write_json_atomic(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "added_tokens_decoder": added,
            "model_max_length": max_length,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
        },
    )
    write_json_atomic(out / "special_tokens_map.json", special)


# ---- the export ----------------------------------------------------------------------------------


def export_hf(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    tokenizer: str | Path | None = None,
    force: bool = False,
) -> ExportResult:
    """Write checkpoint `step` (default: latest) of `run_dir` as an HF model directory `out`."""
    from kiln.model.hf import config_to_hf, save_hf_dir

    run_dir, out = Path(run_dir), Path(out)
    check_can_replace_dir(out, force, is_export_dir, "a kiln export (no kiln_export.json)")
    checkpoint = find_checkpoint(run_dir, step)
    state = ckpt.read_state(checkpoint)
    model = load_checkpoint_model(checkpoint)
    model_type = config_to_hf(model.cfg)["model_type"]  # refuses a config HF cannot express
    if tokenizer is not None:
        tok_path, eos_token = Path(tokenizer), EOT
    else:
        tok_path, eos_token = find_tokenizer(checkpoint, state)
    tok = load_tokenizer(tok_path, state, model.cfg)
    if eos_token not in tok.special_tokens:
        raise KilnError(
            f"{tok_path}: no special token {eos_token!r} to use as eos "
            f"(has {sorted(tok.special_tokens)})"
        )
    eos_id = tok.special_tokens[eos_token]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_hf_dir(model, tmp, eos_token_id=eos_id)
        write_hf_tokenizer(tok, tmp, eos_token, model.cfg.block_size)
        write_json_atomic(
            tmp / "kiln_export.json",
            {
                "run": str(run_dir.resolve()), "checkpoint": checkpoint.name,
                "step": state["step"], "tokens": state["tokens"],
                "tokenizer": str(tok_path.resolve()), "kiln_version": __version__,
            },
        )  # fmt: skip
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(
        out=out, checkpoint=checkpoint, step=state["step"], tokens=state["tokens"],
        model_type=model_type, tokenizer=tok_path, eos_token=eos_token, eos_id=eos_id,
    )  # fmt: skip


def is_export_dir(path: Path) -> bool:
    """Whether `path` is an HF directory `kiln export` wrote (the only kind --force replaces)."""
    return (path / "kiln_export.json").is_file()


def _replace(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`, moving an existing `out` aside first (never half)."""
    if not out.exists() and not out.is_symlink():
        tmp.rename(out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    tmp.rename(out)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


def describe(result: ExportResult) -> str:
    """One line for the CLI: what was exported, from where."""
    files = ", ".join(["config.json", "model.safetensors", *HF_TOKENIZER_FILES])
    return (
        f"kiln export: step {result.step:,} ({result.tokens:,} tokens) of {result.checkpoint} as "
        f"an HF {result.model_type} model in {result.out} ({files}; eos "
        f"{result.eos_token} = {result.eos_id}; tokenizer from {result.tokenizer})"
    )
