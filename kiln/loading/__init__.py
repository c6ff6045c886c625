"""The one way to load a model and its tokenizer, whatever folder a user points at.

`load_model(path)` takes any of these and returns the model in eval mode, its tokenizer, its
end-of-text id and where they came from:

- a `kiln demo` folder (runs/demo-<time>/, whose run is train/ and tokenizer tokenizer.json),
- a run folder, or a run's train/ folder (`checkpoints/` inside: the latest checkpoint),
- a run's checkpoints/ folder (`latest`, `step_N/`),
- a checkpoint directory (checkpoints/step_N, with state.json and model.safetensors),
- an HF model directory (config.json + safetensors: `kiln export`'s output, or GPT-2/Llama saved
  by transformers' `save_pretrained`), with its tokenizer beside it (kiln or HF tokenizer.json,
  or GPT-2's vocab.json + merges.txt).

A checkpoint's tokenizer is the one its dataset was encoded with, found through the dataset's
manifest and checked by sha256. `kiln export` needs the checkpoint itself (state, step):
`load_checkpoint` is the lower-level step that `load_model` builds on.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kiln import checkpoint_format as ckpt
from kiln.devices import Precision, choose_precision, resolve_device
from kiln.errors import KilnError, not_found
from kiln.model.config import ModelConfig
from kiln.model.transformer import Transformer
from kiln.tokenizer.special import EOT
from kiln.tokenizer.tokenizer import Tokenizer

TOKENIZER_HINT = "; pass --tokenizer PATH"
# Tokenizer files looked for beside an HF model, in this order.
HF_TOKENIZER_NAMES = ("tokenizer.json", "vocab.json")

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode, its tokenizer and end-of-text id, and where they came from."""

    model: Transformer
    tokenizer: Tokenizer | None  # None only under need_tokenizer=False when none was found
    eot_id: int | None
    source: str  # e.g. "checkpoint runs/demo/train/checkpoints/step_500 (step 500, ...)"
    tokenizer_path: Path | None
    precision: Precision
    stop_ids: tuple[int, ...] = ()  # end-of-sequence ids (an HF config may name several)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype forward passes autocast to (None: plain fp32), as the trainer's do."""
        return torch.bfloat16 if self.precision.name == "bf16" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision for this model's forward passes: weights stay fp32, matmuls autocast."""
        device = next(self.model.parameters()).device
        dtype = self.autocast_dtype
        return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A kiln checkpoint: its model (fp32, eval mode), state.json and the run's tokenizer."""

    path: Path  # the checkpoint directory (checkpoints/step_N)
    state: dict[str, Any]
    model: Transformer
    tokenizer: Tokenizer | None  # None only under need_tokenizer=False when none was found
    tokenizer_path: Path | None
    eot_token: str

    @property
    def run(self) -> Path:
        """The run folder the checkpoint belongs to."""
        return self.path.parent.parent


# ---- what a folder is ------------------------------------------------------------------------


def folder_kind(path: Path) -> str:
    """The kind of model folder `path` is: hf, checkpoint, checkpoints, run or demo.

    An unrecognised folder gets one KilnError line saying what was looked for, and where.
    """
    if not path.exists():
        raise KilnError(f"{path}: no such model folder")
    if not path.is_dir():
        raise KilnError(f"{path}: not a folder (expected a run, checkpoint or HF model folder)")
    if (path / "config.json").is_file():
        return "hf"
    if (path / "state.json").is_file():
        return "checkpoint"
    if (path / ckpt.LATEST).is_file() or ckpt.list_checkpoints(path):
        return "checkpoints"
    if (path / "checkpoints").is_dir():
        return "run"
    if (path / "train" / "checkpoints").is_dir():
        return "demo"
    raise KilnError(
        f"{path}: not a model folder; looked for config.json (an HF model) and state.json (a "
        f"checkpoint) in {path}, for {ckpt.LATEST} or step_N/ (a checkpoints folder) in {path}, "
        f"for {path / 'checkpoints'}/ (a run or its train/ folder) and for "
        f"{path / 'train' / 'checkpoints'}/ (a kiln demo folder)"
    )


def find_checkpoint(path: PathLike, step: int | None = None) -> Path:
    """The checkpoint directory a demo, run, train/, checkpoints/ or step_N folder names.

    `step` picks a saved step; by default the one `latest` names (else the newest).
    """
    return _locate_checkpoint(Path(path), step)[0]


def _locate_checkpoint(path: Path, step: int | None) -> tuple[Path, dict[str, Any] | None]:
    """`find_checkpoint`'s answer, with the state.json it had to read to check `step` (or None)."""
    kind = folder_kind(path)
    if kind == "hf":
        raise KilnError(
            f"{path}: an HF model folder (config.json), not a kiln checkpoint; point at the run "
            "or checkpoint it came from"
        )
    if kind == "checkpoint":
        if step is None:
            return path, None
        state = ckpt.read_state(path)
        if state.get("step") != step:
            raise KilnError(
                f"{path} is the checkpoint of step {state.get('step')}, not of step {step}"
            )
        return path, state
    checkpoints = {
        "checkpoints": path,
        "run": path / "checkpoints",
        "demo": path / "train" / "checkpoints",
    }[kind]
    found = ckpt.list_checkpoints(checkpoints)
    if step is not None:
        chosen = ckpt.step_dir(checkpoints, step)
        if not ckpt.is_complete(chosen):  # a partial folder (a kill mid-prune) is not one
            have = ", ".join(str(s) for s, _ in found) or "none"
            raise KilnError(f"{chosen}: no checkpoint of step {step} (steps saved: {have})")
        return chosen, None
    latest = ckpt.latest_checkpoint(checkpoints)
    if latest is None:
        if not found:
            raise KilnError(
                f"{path}: no checkpoints yet (expected {checkpoints / ckpt.LATEST}); has the "
                "run saved one?"
            )
        latest = found[-1][1]  # steps exist but no pointer: take the newest
    return latest, None


# ---- kiln checkpoints ------------------------------------------------------------------------

# A LoRA fine-tune (kiln.posttrain.sft.lora) saves its frozen base under the base's names plus, per
# adapted layer X, X.lora_A.weight (rank, in) and X.lora_B.weight (out, rank); its config's
# [lora] section gives rank and alpha. Loading merges them: one model for eval, export, serving.
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def merge_lora_tensors(tensors: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A LoRA state dict with every adapter merged: X.weight + scaling · B·A (in fp32)."""
    out = {k: v for k, v in tensors.items() if not k.endswith((LORA_A, LORA_B))}
    for key, a in tensors.items():
        if key.endswith(LORA_A):
            layer = key.removesuffix(LORA_A)
            w, b = out[f"{layer}.weight"], tensors[layer + LORA_B]
            out[f"{layer}.weight"] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return out


def load_checkpoint_model(
    path: Path,
    device: str | torch.device = "cpu",
    weights_too: bool = True,
    state: dict[str, Any] | None = None,
) -> Transformer:
    """A Transformer with the config and weights of checkpoint `path`, in eval mode (fp32).

    With `weights_too=False`, the model on the meta device: its config and shapes only (what
    exporting a sharded checkpoint tensor by tensor needs). `state`: the checkpoint's state.json
    when the caller has read it already.
    """
    state = state if state is not None else ckpt.read_state(path)
    try:
        cfg = ModelConfig.from_dict(dict(state["config"]["model"]))
    except (KeyError, TypeError) as exc:
        raise KilnError(f"{path}/state.json: no usable config.model ({exc})") from None
    if not weights_too:
        with torch.device("meta"):
            return Transformer(cfg).eval()
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise KilnError(f"{weights}: missing (a checkpoint holds its weights in model.safetensors)")

    with torch.device("meta"):  # no random init of weights that are overwritten at once
        model = Transformer(cfg)
    model.to_empty(device=device)
    lora = state["config"].get("lora") or {}
    merge = None
    if lora.get("rank"):  # a LoRA fine-tune's checkpoint: the frozen base and the adapters
        scaling = float(lora["alpha"]) / int(lora["rank"])
        merge = functools.partial(merge_lora_tensors, scaling=scaling)
    ckpt.load_model_tensors(weights, model, device, "the config in state.json", merge)
    model.init_rope()
    return model.eval()


def find_run_tokenizer(checkpoint: Path, state: dict[str, Any]) -> tuple[Path, str]:
    """The tokenizer file the run's dataset was encoded with (sha256 checked), and its EOT token.

    Found through the manifest of the dataset the checkpoint's config names (looked for where
    it was and beside the run, as in a moved demo folder); the file must be the one the
    checkpoint's dataset fingerprint recorded.
    """
    from kiln.data.manifest import MANIFEST_NAME, Manifest, TokenizerEntry

    run = checkpoint.parent.parent
    recorded = state.get("dataset", {}).get("tokenizer_sha256")
    dataset = state.get("config", {}).get("data", {}).get("dataset")
    roots = [Path(dataset), run.parent / Path(dataset).name] if dataset else []
    root = next((r for r in roots if (r / MANIFEST_NAME).is_file()), None)
    entry: TokenizerEntry | None = None
    if root is not None:
        entry = Manifest.read(root).tokenizer
        if recorded is not None:  # the run's own record wins over a manifest rewritten since
            entry = replace(entry, sha256=recorded)
    elif recorded is not None:  # no manifest: a tokenizer beside the run may still be the one
        root = run
        entry = TokenizerEntry(str(run.parent / "tokenizer.json"), recorded, 0, EOT, -1)
    no_manifest = f"no manifest.json in {' or '.join(map(str, roots))}" if roots else ""
    if entry is None or root is None:
        raise KilnError(
            f"cannot find the run's tokenizer: {no_manifest or f'{checkpoint} names no dataset'}"
            f"{TOKENIZER_HINT}"
        )
    beside = (run / "tokenizer.json", run.parent / "tokenizer.json")  # kiln demo: beside train/
    path = entry.locate(root, beside, TOKENIZER_HINT)
    if path is None:
        looked = dict.fromkeys([Path(entry.path), root / Path(entry.path).name, *beside])
        manifest_note = (
            f" ({no_manifest}: the dataset moved?)" if no_manifest and root == run else ""
        )
        raise KilnError(
            f"cannot find the run's tokenizer: looked for {', '.join(map(str, looked))}"
            f"{manifest_note}{TOKENIZER_HINT}"
        )
    return path, entry.eot_token


def load_tokenizer(path: Path, state: dict[str, Any], cfg: ModelConfig) -> Tokenizer:
    """Read a tokenizer file (any format kiln reads) and check it fits the model."""
    from kiln.tokenizer.formats import read_any

    if not path.is_file():
        raise not_found(path, "tokenizer file")
    tok = read_any(path)
    trained = state.get("dataset", {}).get("vocab_size")
    if trained is not None and tok.n_vocab != trained:
        raise KilnError(
            f"{path}: {tok.n_vocab} tokens, but the run was trained on a {trained}-token vocabulary"
        )
    if tok.n_vocab > cfg.vocab_size:
        raise KilnError(f"{path}: {tok.n_vocab} tokens, more than the model's {cfg.vocab_size}")
    return tok


def load_checkpoint(
    path: PathLike,
    step: int | None = None,
    tokenizer: PathLike | None = None,
    device: str | torch.device = "cpu",
    need_tokenizer: bool = True,
    weights_too: bool = True,
) -> LoadedCheckpoint:
    """The checkpoint a folder names (see `find_checkpoint`), its model and the run's tokenizer.

    With `need_tokenizer=False` a run whose tokenizer cannot be found (or is not the one it
    trained with) still loads, with tokenizer None: scoring the val split needs no tokenizer.
    """
    checkpoint, state = _locate_checkpoint(Path(path), step)
    state = state if state is not None else ckpt.read_state(checkpoint)  # once per load
    model = load_checkpoint_model(checkpoint, device, weights_too, state)
    if tokenizer is not None:
        tok_path, eot_token = _tokenizer_file(Path(tokenizer)), EOT
    else:
        try:
            tok_path, eot_token = find_run_tokenizer(checkpoint, state)
        except KilnError:
            if need_tokenizer:
                raise
            return LoadedCheckpoint(checkpoint, state, model, None, None, EOT)
    tok = load_tokenizer(tok_path, state, model.cfg)  # checks it is the run's vocabulary
    return LoadedCheckpoint(checkpoint, state, model, tok, tok_path, eot_token)


# ---- HF directories --------------------------------------------------------------------------


def hf_eos_ids(model_dir: Path) -> list[int]:
    """The end-of-sequence id(s) named in an HF model's config.json, if any."""
    file = model_dir / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KilnError(f"{file}: not a readable JSON model config ({exc})") from None
    eos = config.get("eos_token_id") if isinstance(config, dict) else None
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]


def hf_tokenizer_file(model_dir: Path) -> Path | None:
    """The tokenizer file beside an HF model: tokenizer.json (kiln or HF), or GPT-2's vocab.json."""
    return next((model_dir / n for n in HF_TOKENIZER_NAMES if (model_dir / n).is_file()), None)


def _tokenizer_file(path: Path) -> Path:
    """A tokenizer given by the user: a file, or a folder holding one."""
    if path.is_dir():
        found = hf_tokenizer_file(path)
        if found is None:
            raise KilnError(f"{path}: no {' or '.join(HF_TOKENIZER_NAMES)} in this folder")
        return found
    return path


def _load_hf(
    path: Path, tokenizer: PathLike | None, device: torch.device, need_tokenizer: bool
) -> tuple[Transformer, Tokenizer | None, Path | None, list[int], str]:
    """An HF directory's model, the tokenizer beside it (or given), its eos ids, its description."""
    from kiln.model.hf import load_hf_dir

    eos = hf_eos_ids(path)  # reads config.json first: a broken one is one clear line
    model = load_hf_dir(path, device=device)
    tok_path = _tokenizer_file(Path(tokenizer)) if tokenizer is not None else None
    tok_path = tok_path or hf_tokenizer_file(path)
    tok = None
    if tok_path is not None:
        tok = load_tokenizer(tok_path, {}, model.cfg)
    elif need_tokenizer:
        raise KilnError(
            f"{path}: no tokenizer.json or vocab.json beside the model (looked for "
            f"{', '.join(str(path / n) for n in HF_TOKENIZER_NAMES)}){TOKENIZER_HINT}"
        )
    if not eos and tok is not None and EOT in tok.special_tokens:
        eos = [tok.special_tokens[EOT]]
    source = f"HF model folder {path}"
    record = path / "kiln_export.json"
    if record.is_file():
        try:
            doc = json.loads(record.read_text())
            source += f" (kiln export of step {doc['step']:,} of {doc['run']})"
        except (OSError, ValueError, KeyError, TypeError):
            pass  # only a description; the model loaded from config.json and safetensors
    return model, tok, tok_path, eos, source


# ---- the one entry point ---------------------------------------------------------------------


def load_model(
    path: PathLike,
    tokenizer: PathLike | None = None,
    device: str = "auto",
    dtype: str = "auto",
    need_tokenizer: bool = True,
) -> LoadedModel:
    """Load a demo, run, train/, checkpoints/, checkpoint or HF folder (see the module doc).

    `dtype` is auto, fp32 or bf16 (kiln.devices' rule); `device` is auto, cpu, cuda or cuda:N.
    With `need_tokenizer=False` a folder whose tokenizer cannot be found still loads (tokenizer
    None), for work that needs none (scoring a val split, sampling from token ids).
    """
    path = Path(path)
    torch_device = resolve_device(device)
    precision = choose_precision(dtype, torch_device)  # a bad dtype fails before any loading
    kind = folder_kind(path)
    if kind == "hf":
        model, tok, tok_path, eos, source = _load_hf(path, tokenizer, torch_device, need_tokenizer)
        eot_id = eos[0] if eos else None
    else:
        loaded = load_checkpoint(path, None, tokenizer, torch_device, need_tokenizer)
        model, tok, tok_path = loaded.model, loaded.tokenizer, loaded.tokenizer_path
        eot_id = tok.special_tokens.get(loaded.eot_token) if tok is not None else None
        eos = [eot_id] if eot_id is not None else []
        step = loaded.state.get("step")
        source = f"checkpoint {loaded.path} (step {step:,})" if isinstance(step, int) else (
            f"checkpoint {loaded.path}"
        )  # fmt: skip
        if kind != "checkpoint":
            source += f" of the {'kiln demo' if kind == 'demo' else kind} folder {path}"
    # Weights stay fp32 and bf16 runs under autocast (`LoadedModel.autocast`), as in training,
    # so `kiln eval --val` measures what the trainer's val loss measured.
    model.eval()
    return LoadedModel(model, tok, eot_id, source, tok_path, precision, tuple(eos))
