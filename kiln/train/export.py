"""`kiln export RUN --hf DIR`: a run's checkpoint as a Hugging Face model directory.

The directory holds what `transformers` needs to load the model and its tokenizer offline:
`config.json` + `model.safetensors` (kiln.model.hf), the tokenizer as HF `tokenizer.json` with a
`tokenizer_config.json` and `special_tokens_map.json` (a `PreTrainedTokenizerFast`, eos = the
dataset's end-of-text token; for a tokenizer with the chat tokens, the chat format as a Jinja
`chat_template` that `apply_chat_template` turns into kiln's own ids), and `kiln_export.json` saying which run and step it came from. It is
written under a temporary name beside DIR and renamed, so DIR never holds half an export.
Finding and loading the checkpoint and its tokenizer is `kiln.loading`'s job.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.chat import CHAT_TOKENS, chat_template_of
from kiln.checkpoint_format import SHARDED_DIR, is_sharded_checkpoint
from kiln.errors import KilnError
from kiln.folders import abandoned_by, check_can_replace_dir, remove_entry
from kiln.io import write_json_atomic
from kiln.model.transformer import Transformer
from kiln.tokenizer.tokenizer import Tokenizer
from kiln.train.sharded_export import save_sharded_hf_dir

EXPORT_KIND = "a kiln export (no kiln_export.json)"  # the only kind of folder --force replaces
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


# ---- the tokenizer files ------------------------------------------------------------------------


def write_hf_tokenizer(tok: Tokenizer, out: Path, eos_token: str, max_length: int) -> None:
    """tokenizer.json + the two small files `AutoTokenizer` needs for a PreTrainedTokenizerFast."""
    from kiln.tokenizer.formats import write_hf

    write_hf(tok, out / "tokenizer.json", force=True)
    special: dict[str, Any] = {"bos_token": eos_token, "eos_token": eos_token}
    template = chat_template_of(tok)
    if template is not None:  # the chat format (kiln.chat) for apply_chat_template
        special["additional_special_tokens"] = list(CHAT_TOKENS)
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
            **({"chat_template": template.jinja} if template is not None else {}),
        },
    )
    write_json_atomic(out / "special_tokens_map.json", special)


# ---- the export ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportSource:
    """What is exported (a checkpoint's model and the run's tokenizer) and where it came from.

    `kiln.loading.load_checkpoint` finds and loads these; export only writes them.
    """

    model: Transformer
    tokenizer: Tokenizer
    tokenizer_path: Path
    eos_token: str
    run: Path
    checkpoint: Path
    step: int
    tokens: int


def export_hf(source: ExportSource, out: str | Path, force: bool = False) -> ExportResult:
    """Write `source` as an HF model directory `out` (whole or not at all)."""
    from kiln.model.hf import config_to_hf, save_hf_dir

    out = Path(out)
    remove_abandoned_exports(out)  # first: a previous export it restores needs --force too
    check_can_replace_dir(out, force, is_export_dir, EXPORT_KIND)
    model, tok, tok_path, eos_token = (
        source.model, source.tokenizer, source.tokenizer_path, source.eos_token
    )  # fmt: skip
    model_type = config_to_hf(model.cfg)["model_type"]  # refuses a config HF cannot express
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
        if is_sharded_checkpoint(source.checkpoint):
            hf_cfg = {**config_to_hf(model.cfg), "bos_token_id": eos_id, "eos_token_id": eos_id}
            save_sharded_hf_dir(model.cfg, source.checkpoint / SHARDED_DIR, tmp, hf_cfg)
        else:
            save_hf_dir(model, tmp, eos_token_id=eos_id)
        write_hf_tokenizer(tok, tmp, eos_token, model.cfg.block_size)
        write_json_atomic(
            tmp / "kiln_export.json",
            {
                "run": str(source.run.resolve()), "checkpoint": source.checkpoint.name,
                "step": source.step, "tokens": source.tokens,
                "tokenizer": str(tok_path.resolve()), "kiln_version": __version__,
            },
        )  # fmt: skip
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(
        out=out, checkpoint=source.checkpoint, step=source.step, tokens=source.tokens,
        model_type=model_type, tokenizer=tok_path, eos_token=eos_token, eos_id=eos_id,
    )  # fmt: skip


def is_export_dir(path: Path) -> bool:
    """Whether `path` is an HF directory `kiln export` wrote (the only kind --force replaces)."""
    return (path / "kiln_export.json").is_file()


def remove_abandoned_exports(out: Path) -> list[Path]:
    """Tidy the `.<out>.tmp-PID` / `.<out>.old-PID` folders an export killed mid-write left.

    A temp folder is deleted. An old one is the previous export moved aside: deleted when `out`
    is there (the new one was installed), renamed back to `out` when it is not (the kill came
    between `_replace`'s two renames), so the user's export is never lost. Returns the deleted.
    """
    removed = []
    for path in sorted(out.parent.glob(f".{out.name}.*-*")):
        kind, _, pid = path.name[len(out.name) + 2 :].partition("-")
        if kind not in ("tmp", "old") or not pid.isdigit() or not abandoned_by(int(pid)):
            continue
        if kind == "old" and not out.exists() and not out.is_symlink():
            path.rename(out)
            continue
        remove_entry(path)
        removed.append(path)
    return removed


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
