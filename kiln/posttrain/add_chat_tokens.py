"""`kiln posttrain add-chat-tokens MODEL OUT`: a base model and tokenizer with the chat tokens.

The tokens missing from the tokenizer are appended after its largest id (no existing id is
renumbered). The embedding (and an untied head) gains the rows those ids need; every row of a new
token, grown or one of the padding rows a model may already have, starts as the mean of the rows
of the tokenizer's existing tokens, so the model sees something like an average token rather
than noise. OUT is a new run folder (`tokenizer.json`, `checkpoints/step_N/`, `chat_tokens.json`
recording what was done) that `kiln.loading.load_model` loads; the source is never modified.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kiln import __version__
from kiln.chat.tokens import with_chat_tokens
from kiln.checkpoint_format import read_state
from kiln.errors import KilnError
from kiln.io import sha256_file, write_json_atomic
from kiln.loading import LoadedModel, find_checkpoint, folder_kind, load_model
from kiln.model.transformer import Transformer
from kiln.posttrain.output import check_output_folder, output_folder
from kiln.train import checkpoint as ckpt

RECORD = (
    "chat_tokens.json"  # what marks OUT as this command's output (the only kind --force replaces)
)


@dataclass(frozen=True)
class AddedChatTokens:
    """What `add_chat_tokens` did, for the CLI's report."""

    out: Path
    added: dict[str, int]  # token -> its new id (empty: the tokenizer had them all)
    rows_added: int  # embedding rows grown (0 when the model's vocab already had room)
    vocab_size: int  # the model's vocab_size after
    checkpoint: Path


@torch.no_grad()
def grow_vocab(model: Transformer, old_ids: list[int], new_ids: list[int]) -> Transformer:
    """A copy of `model` whose vocab holds `new_ids`, their rows the mean of the `old_ids` rows."""
    cfg = model.cfg
    vocab_size = max(cfg.vocab_size, max(new_ids, default=-1) + 1)
    grown = Transformer(replace(cfg, vocab_size=vocab_size))
    state = model.state_dict()
    for name, tensor in grown.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # the same storage as wte.weight, already set
        if name in ("wte.weight", "lm_head.weight"):
            tensor.zero_()
            tensor[: cfg.vocab_size] = state[name][: cfg.vocab_size]
            tensor[new_ids] = state[name][old_ids].mean(dim=0)
        elif name in state:
            tensor.copy_(state[name])
    grown.init_rope()
    return grown.eval()


def _source_state(path: Path, loaded: LoadedModel) -> dict[str, Any]:
    """The source checkpoint's state.json, or a minimal one for an HF model folder."""
    if folder_kind(path) != "hf":
        return read_state(find_checkpoint(path))
    return {"step": 0, "tokens": 0, "config": {"model": loaded.model.cfg.to_dict()}}


def _check_out(source: Path, out: Path, force: bool) -> None:
    """Refuse an OUT that is (or is inside) the source, or that holds something not ours."""
    src, dst = source.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        raise KilnError(
            f"{out}: inside the source {source}; choose a new folder (it is never modified)"
        )
    check_output_folder(out, force, RECORD)


def add_chat_tokens(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    force: bool = False,
    tokenizer: str | os.PathLike[str] | None = None,
) -> AddedChatTokens:
    """Write OUT: the model of `source` and its tokenizer, both with the chat tokens."""
    source, out = Path(source), Path(out)
    _check_out(source, out, force)
    loaded = load_model(source, tokenizer=tokenizer, device="cpu", dtype="fp32")
    assert loaded.tokenizer is not None and loaded.tokenizer_path is not None
    tok, added = with_chat_tokens(loaded.tokenizer)
    old_ids = sorted(i for i in loaded.tokenizer.vocab if i < loaded.model.cfg.vocab_size)
    model = grow_vocab(loaded.model, old_ids, sorted(added.values()))
    state = _source_state(source, loaded)
    config = {**state.get("config", {}), "model": model.cfg.to_dict()}
    with output_folder(out, force, RECORD) as tmp:
        tok.save(tmp / "tokenizer.json")
        dataset = {
            **state.get("dataset", {}),
            "tokenizer_sha256": sha256_file(tmp / "tokenizer.json"),
            "vocab_size": tok.n_vocab,
        }
        train_state = ckpt.TrainState(
            step=int(state.get("step", 0)), tokens=int(state.get("tokens", 0)), cursor={},
            config=config, dataset=dataset, precision=state.get("precision"),
        )  # fmt: skip
        written = ckpt.save_checkpoint(tmp / "checkpoints", model, {}, train_state, {}, keep_last=1)
        write_json_atomic(
            tmp / RECORD,
            {
                "source": str(source.resolve()), "source_tokenizer": str(loaded.tokenizer_path),
                "added": added, "rows_added": model.cfg.vocab_size - loaded.model.cfg.vocab_size,
                "vocab_size": model.cfg.vocab_size, "row_init": "mean of the existing tokens' rows",
                "kiln_version": __version__,
            },
        )  # fmt: skip
    return AddedChatTokens(
        out=out, added=added, rows_added=model.cfg.vocab_size - loaded.model.cfg.vocab_size,
        vocab_size=model.cfg.vocab_size, checkpoint=out / "checkpoints" / written.name,
    )  # fmt: skip


def describe(result: AddedChatTokens, source: str | os.PathLike[str]) -> str:
    """The CLI's report: which tokens got which ids, how many rows were added, where it went."""
    if not result.added:
        tokens = "the tokenizer already had every chat token; none added"
    else:
        tokens = "added " + ", ".join(f"{t} = {i}" for t, i in result.added.items())
    return (
        f"kiln posttrain add-chat-tokens: {tokens}; {result.rows_added} embedding row(s) added "
        f"(vocab_size {result.vocab_size}; new tokens' rows = mean of the existing rows); "
        f"{source} -> {result.out} (checkpoint {result.checkpoint.name}, tokenizer.json)"
    )
