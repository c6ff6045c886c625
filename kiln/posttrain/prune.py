"""`kiln prune MODEL OUT`: structured pruning of a model folder into a new run folder.

The transform is kiln/quant/prune.py's (it knows nothing of runs or data); this module loads
the model (kiln.loading), reads calibration windows from a token-shard dataset's train split,
and writes OUT like any run (`tokenizer.json`, `checkpoints/step_0/`, plus `prune.json`: the
source, the sizes and parameter counts before and after, the calibration tokens). Every command
that loads a model loads OUT; heal it with `kiln distill` (`distill.student = OUT`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kiln import __version__
from kiln.checkpoint_format import read_state
from kiln.errors import KilnError
from kiln.io import sha256_file, write_json_atomic
from kiln.loading import find_checkpoint, folder_kind, load_model
from kiln.posttrain.distill import check_same_tokenizer
from kiln.posttrain.output import check_output_folder, output_folder
from kiln.quant.prune import PruneTargets, measure_importance, prune_model
from kiln.train import checkpoint as ckpt
from kiln.train.sources import TokenShards

RECORD = "prune.json"

__all__ = ["PruneTargets", "prune_to_folder"]


def calibration_dataset(source: Path, data: str | None) -> str:
    """The dataset to calibrate on: --data, else the one the source run was trained on."""
    if data:
        return data
    if folder_kind(source) != "hf":
        dataset = read_state(find_checkpoint(source)).get("config", {}).get("data", {})
        if dataset.get("dataset"):
            return str(dataset["dataset"])
    raise KilnError(f"{source}: names no dataset to calibrate on; pass --data DIR (token shards)")


def calibration_batches(
    data: TokenShards, batches: int, seq_len: int, batch_size: int = 8
) -> list[torch.Tensor]:
    """The first `batches` batches (B, T) of the train split, in the loader's seeded order."""
    loader = data.loader("train", seq_len, batch_size, seed=0)
    return [loader.next_batch().to_torch(torch.device("cpu"))[0] for _ in range(batches)]


def prune_to_folder(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    targets: PruneTargets,
    data: str | None = None,
    batches: int = 8,
    seq_len: int = 256,
    tokenizer: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> str:
    """Prune `source` to `targets` into the run folder OUT; a summary line for the user."""
    source, out = Path(source), Path(out)
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise KilnError(f"{out}: inside the source {source}; choose a new folder")
    check_output_folder(out, force, RECORD)
    if batches < 1:
        raise KilnError(f"--batches must be >= 1, got {batches}")
    loaded = load_model(source, tokenizer=tokenizer, device="cpu", dtype="fp32")
    assert loaded.tokenizer is not None
    dataset = calibration_dataset(source, data)
    shards = TokenShards(dataset)
    check_same_tokenizer(loaded, str(source), shards, "MODEL", "--data")
    seq_len = min(seq_len, loaded.model.cfg.block_size)
    imp = measure_importance(loaded.model, calibration_batches(shards, batches, seq_len))
    pruned = prune_model(loaded.model, imp, targets)
    before, after = loaded.model.cfg.num_params(), pruned.cfg.num_params()
    with output_folder(out, force, RECORD) as tmp:
        loaded.tokenizer.save(tmp / "tokenizer.json")
        fingerprint = {
            "tokenizer_sha256": sha256_file(tmp / "tokenizer.json"),
            "vocab_size": loaded.tokenizer.n_vocab,
        }
        state = ckpt.TrainState(
            step=0, tokens=0, cursor={}, config={"model": pruned.cfg.to_dict()},
            dataset=fingerprint,
        )  # fmt: skip
        ckpt.save_checkpoint(tmp / "checkpoints", pruned, {}, state, {}, keep_last=1)
        write_json_atomic(
            tmp / RECORD,
            {
                "source": str(source.resolve()), "calibration": dataset,
                "calibration_tokens": imp.tokens,
                "sizes_before": _sizes(loaded.model.cfg), "sizes_after": _sizes(pruned.cfg),
                "params_before": before, "params_after": after,
                "kept_blocks_score": imp.blocks.tolist(), "kiln_version": __version__,
            },
        )  # fmt: skip
    changed = ", ".join(
        f"{k} {a}→{b}"
        for (k, a), b in zip(
            _sizes(loaded.model.cfg).items(), _sizes(pruned.cfg).values(), strict=True
        )
        if a != b
    )
    return (
        f"kiln prune: {source} -> {out}: {changed or 'nothing pruned'}; parameters {before:,} → "
        f"{after:,} ({after / before:.0%}); calibrated on {imp.tokens:,} tokens of {dataset}"
    )


def _sizes(cfg: object) -> dict[str, int]:
    """The prunable sizes of a ModelConfig."""
    return {
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_kv_head": cfg.kv_heads,  # type: ignore[attr-defined]
        "n_embd": cfg.n_embd, "d_ff": cfg.ff_size,  # type: ignore[attr-defined]
    }  # fmt: skip
