"""`kiln data synth generate|rewrite` and `kiln data annotate` (they run a model, so they live
above kiln.data, in the `kiln data` group)."""

from __future__ import annotations

import argparse
from typing import Any

from kiln.commands import add_command_group, add_subcommand, command_group

_EXAMPLES = {
    "generate": """examples:
  kiln data synth generate configs/synth_generate.toml
  kiln data synth generate configs/synth_generate.toml --set documents=5000 --out data/synth
  kiln data synth generate configs/synth_generate.toml    # again after a kill: resumes""",
    "rewrite": """examples:
  kiln data synth rewrite configs/synth_rewrite.toml
  kiln data synth rewrite configs/synth_rewrite.toml --set style=qa --out data/wrap-qa""",
    "annotate": """examples:
  kiln data annotate configs/annotate.toml
  kiln data annotate configs/annotate.toml --set max_documents=2000 --out data/edu-scores
  kiln data classifier train configs/quality_classifier_annotated.toml   # then train on them""",
}

_WHAT = {
    "generate": "write TinyStories-style documents with a model (random words and features)",
    "rewrite": "paraphrase documents into a style with a model (WRAP)",
    "annotate": "score a sample of documents 0-5 with a model and a rubric (FineWeb-Edu)",
}


def register(sub: Any) -> None:
    """Add `kiln data synth generate|rewrite` and `kiln data annotate` to the `kiln data` group."""
    data = command_group(sub, "data")
    synth = add_command_group(
        data,
        "synth",
        "synthetic documents from a kiln model through the engine",
        "Synthetic data: generate (TinyStories) or rewrite (WRAP) documents; the output folder "
        "holds documents.jsonl, a source the pipeline reads, with each document's provenance.",
        "kiln data synth generate configs/synth_generate.toml",
    )
    for name, commands in (("generate", synth), ("rewrite", synth), ("annotate", data)):
        p = add_subcommand(commands, name, _WHAT[name], _EXAMPLES[name])
        p.add_argument("config", metavar="CONFIG.toml", help="the config")
        p.add_argument("--out", default="", help="the output folder (default: `output`)")
        p.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE", help="override a value"
        )
        p.add_argument(
            "--force", action="store_true", help="replace an output made with another config"
        )
        p.add_argument("--quiet", action="store_true", help="no progress line")
        p.set_defaults(handler=run_synth_command, synth_command_name=name)


def run_synth_command(args: argparse.Namespace) -> int:
    """Handler of the three commands: run (or resume) and print what was written."""
    from kiln.data.procs import sigterm_as_interrupt
    from kiln.posttrain.synth import run

    command = getattr(run, args.synth_command_name)
    with sigterm_as_interrupt():  # a killed run keeps its finished parts; the next run resumes
        m = command(args.config, tuple(args.set), args.out, args.force, not args.quiet)
    line = f"wrote {m['documents']:,} documents to {m['path']} (sha256 "
    print(f"{line}{m['sha256'][:12]}…, model {m['model']['model_sha256'][:12]}…)")
    if m.get("parts_found"):
        print(f"resumed: {m['parts_found']} part(s) found done, {m['parts_made']} made now")
    if "scores" in m:
        s = m["scores"]
        print(
            f"scores: mean {s['mean']:.3f}, std {s['std']:.3f}; argmax digit counts "
            f"{s['argmax_digits']}"
        )
    return 0
