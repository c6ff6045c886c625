"""`kiln export RUN --hf DIR | --gguf OUT.gguf`: a run's checkpoint, found and loaded by
kiln.loading, written as an HF directory by kiln.train.export or as a GGUF file for llama.cpp by
kiln.train.export_gguf (this command sits above both, so it lives here)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kiln.commands import add_subcommand, add_tokenizer_option
from kiln.errors import KilnError
from kiln.loading import find_checkpoint, load_checkpoint

EXPORT_EXAMPLES = """examples:
  kiln export runs/demo --hf exports/demo           # the latest checkpoint
  kiln export runs/demo --hf exports/demo-500 --step 500 --force
  kiln export runs/demo --hf exports/demo --tokenizer data/tok.json
  kiln export runs/demo --gguf exports/demo.gguf                # f16, for llama.cpp
  kiln export runs/demo --gguf exports/demo-q8.gguf --quant q8_0
  kiln export runs/demo --gguf exports/demo-q4km.gguf --quant q4_k_m   # llama.cpp's Q4_K_M mix
  kiln sample exports/demo --prompt 'Once upon a time'

then, in Python:
  AutoModelForCausalLM.from_pretrained("exports/demo"); AutoTokenizer.from_pretrained(...)"""


def register(sub: Any) -> None:
    """Add `kiln export RUN --hf DIR | --gguf OUT.gguf`."""
    p = add_subcommand(
        sub, "export", "export a run's checkpoint as a Hugging Face directory or a GGUF file",
        EXPORT_EXAMPLES,
    )  # fmt: skip
    p.description = (
        "Write a checkpoint of a training run (the latest by default) as a Hugging Face\n"
        "directory: config.json + model.safetensors, and the run's tokenizer as tokenizer.json\n"
        "(+ tokenizer_config.json, special_tokens_map.json) for AutoTokenizer. GPT-2 and\n"
        "Llama-style models only. DIR is written whole or not at all.\n"
        "With --gguf, one GGUF file for llama.cpp instead (weights, hyper-parameters and the\n"
        "tokenizer; Llama-style and GPT-2 models; needs the gguf extra)."
    )
    p.add_argument(
        "run",
        metavar="RUN",
        help="run, kiln demo, train/, checkpoints/ or checkpoint (step_N) folder",
    )
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--hf", metavar="DIR", help="output directory")
    out.add_argument("--gguf", metavar="OUT.gguf", help="output GGUF file (for llama.cpp)")
    p.add_argument(
        "--quant", default=None, metavar="TYPE",
        help="GGUF weight type: f32, f16 (default), q8_0, q4_0, q4_k_m (llama.cpp's Q4_K/Q6_K mix)",
    )  # fmt: skip
    p.add_argument("--step", type=int, help="checkpoint step to export (default: latest)")
    add_tokenizer_option(p, default="the one the run's dataset manifest names")
    p.add_argument(
        "--force", action="store_true", help="replace a DIR an earlier export wrote (or OUT.gguf)"
    )
    p.set_defaults(handler=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Export a checkpoint and say what was written."""
    if args.gguf is not None:
        return _run_gguf_export(args)
    if args.quant is not None:
        raise KilnError(
            "--quant applies to --gguf only (an HF export keeps the checkpoint's dtype)"
        )
    from kiln.folders import check_can_replace_dir
    from kiln.train.export import (
        EXPORT_KIND,
        ExportSource,
        describe,
        export_hf,
        is_export_dir,
        remove_abandoned_exports,
    )

    # Before loading, not after: a folder export may not replace fails at once (and one a
    # killed export had moved aside is back in place first).
    remove_abandoned_exports(Path(args.hf))
    check_can_replace_dir(Path(args.hf), args.force, is_export_dir, EXPORT_KIND)
    from kiln.checkpoint_format import is_sharded_checkpoint

    # A sharded checkpoint is converted tensor by tensor: the model is never loaded whole.
    sharded = is_sharded_checkpoint(find_checkpoint(args.run, args.step))
    loaded = load_checkpoint(args.run, args.step, args.tokenizer, weights_too=not sharded)
    source = ExportSource(
        model=loaded.model, tokenizer=loaded.tokenizer, tokenizer_path=loaded.tokenizer_path,
        eos_token=loaded.eot_token, run=loaded.run, checkpoint=loaded.path,
        step=loaded.state["step"], tokens=loaded.state["tokens"],
    )  # fmt: skip
    print(describe(export_hf(source, args.hf, args.force)))
    return 0


def _run_gguf_export(args: argparse.Namespace) -> int:
    """`--gguf`: load the checkpoint whole and write it as one GGUF file."""
    from kiln.checkpoint_format import is_sharded_checkpoint
    from kiln.io import check_can_write
    from kiln.train.export_gguf import check_quant, describe_gguf, export_gguf

    check_quant(args.quant or "f16")  # all three before the (slow) load
    check_can_write(Path(args.gguf), args.force)
    checkpoint = find_checkpoint(args.run, args.step)
    if is_sharded_checkpoint(checkpoint):
        raise KilnError(
            f"{checkpoint}: a sharded checkpoint; --gguf reads whole ones only (not yet "
            "supported: export it with --hf, which converts shards)"
        )
    loaded = load_checkpoint(args.run, args.step, args.tokenizer, weights_too=True)
    result = export_gguf(
        loaded.model, loaded.tokenizer, loaded.eot_token, args.gguf, args.quant or "f16",
        args.force, name=_run_name(Path(loaded.run)), progress=True,
    )  # fmt: skip
    print(describe_gguf(result))
    return 0


def _run_name(run: Path) -> str:
    """The run's name for general.name (a kiln demo's run is its folder, not its train/)."""
    return run.parent.name if run.name == "train" else run.name
