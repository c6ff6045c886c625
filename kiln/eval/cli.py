"""`kiln eval MODEL --tasks ...`: benchmark tasks, val loss and bits-per-byte of a model."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kiln.commands import add_device_options, add_tokenizer_option
from kiln.errors import KilnError
from kiln.quant import options as quantize

# ../shared/data/eval beside the repository, when kiln runs from a checkout that has it.
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "eval"
# The shipped TinyStories validation stories: --chat-tasks reports their bits per byte.
VALID_STORIES = Path(__file__).resolve().parents[1] / "assets" / "tinystories_valid.txt.gz"

EXAMPLES = """examples:
  kiln eval runs/demo --tasks hellaswag,arc_easy --limit 200
  kiln eval exports/demo --tasks all --out results/demo.json
  kiln eval runs/demo --val data/stories --bpb data/valid.txt
  kiln eval runs/demo --bpb book.txt.gz --context 128,256,512,1024 --rope-scaling none,yarn:4 \
      --plot context.png                 # bpb by context length and position (extrapolation)
  kiln eval runs/demo --lm-eval-tasks my_task --lm-eval-include tasks/   # lm-eval-harness
  kiln eval runs/demo-sft --chat-tasks data/chat --limit 20   # instruction following + bpb
  kiln eval --list-tasks

MODEL is a kiln demo folder, a run folder or its train/ (the latest checkpoint), a run's
checkpoints/ or one checkpoint (step_N), or an HF model folder (kiln export, or GPT-2/Llama
saved by transformers, with its tokenizer beside it)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kiln eval` to the `kiln` command."""
    from kiln.commands import add_subcommand

    p = add_subcommand(sub, "eval", "evaluate a model: tasks, val loss, bits-per-byte", EXAMPLES)
    p.description = (
        "Score a model on multiple-choice tasks (accuracy by summed and per-byte log-prob,\n"
        "centred against chance, a CORE-style mean), LAMBADA, val loss/perplexity of a token\n"
        "dataset, bits-per-byte of a text file, and lm-evaluation-harness tasks.\n"
        "Prints a table; --out writes the results as JSON."
    )
    p.add_argument(
        "model", nargs="?", metavar="MODEL", help="demo, run, checkpoint or HF model folder"
    )
    p.add_argument("--tasks", help="comma-separated task names, or 'all' (see --list-tasks)")
    p.add_argument("--list-tasks", action="store_true", help="list the known tasks and exit")
    p.add_argument("--limit", type=int, help="score only the first N items of each task")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR if DEFAULT_DATA_DIR.is_dir() else None,
        help=f"directory of the task files (default: {DEFAULT_DATA_DIR} when present)",
    )
    p.add_argument("--val", metavar="DATASET", help="token-shard dataset: loss on its val split")
    p.add_argument("--val-split", default="val", help="split for --val (default val)")
    p.add_argument("--val-tokens", type=int, help="score only the split's first N tokens")
    p.add_argument("--bpb", metavar="FILE", help="text file (.txt, .jsonl; .gz/.zst/.bz2 too)")
    p.add_argument(
        "--stride",
        type=int,
        help="sliding-window stride for --val/--bpb (default: the block size; smaller gives "
        "each token more context and costs block_size/stride times more)",
    )
    p.add_argument(
        "--context",
        help="with --bpb: comma-separated context lengths; bpb by length and position bucket",
    )
    p.add_argument(
        "--context-tokens", type=int, default=32768,
        help="tokens of the --bpb text each --context length scores (default 32768)",
    )  # fmt: skip
    p.add_argument(
        "--rope-scaling",
        help="with --context: comma-separated TYPE:FACTOR (linear, dynamic, yarn, llama3) or "
        "none, one curve each, applied from the model's block size",
    )
    p.add_argument("--plot", type=Path, help="with --context: write the curves as this PNG")
    p.add_argument("--lm-eval-tasks", help="lm-evaluation-harness task names (needs kiln[eval])")
    p.add_argument("--lm-eval-include", help="directory of extra lm-eval task YAML files")
    p.add_argument(
        "--chat-tasks",
        nargs="?",
        const="",
        metavar="DATA",
        help="success per chat task on the held-out prompts of a `kiln data chat` folder (no "
        "DATA: the default held-out split), plus TinyStories-valid bits per byte (or --bpb)",
    )
    p.add_argument(
        "--chat-max-tokens", type=int, default=256, help="longest reply per prompt (default 256)"
    )
    p.add_argument(
        "--chat-temperature", type=float, default=0.0, help="reply temperature (default 0: greedy)"
    )
    p.add_argument("--chat-seed", type=int, help="sampler seed when --chat-temperature > 0")
    add_tokenizer_option(p)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward (default 16)")
    add_device_options(p)
    quantize.add_quantize_options(p)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    """Load the model, run what was asked, print the table, write the JSON."""
    from kiln.eval.tasks import TASKS, parse_task_names

    if args.list_tasks:
        for spec in TASKS.values():
            print(f"{spec.name:<14} {spec.filename:<24} {spec.description}")
        return 0
    if args.model is None:
        raise KilnError("MODEL is required (a demo, run, checkpoint or HF model folder)")
    if not (args.tasks or args.val or args.bpb or args.lm_eval_tasks or _chat(args)):
        hint = (
            f"; {args.model} is a file, and MODEL is a model folder (score a text file with "
            "--bpb FILE)"
            if os.path.isfile(args.model)
            else ""
        )
        raise KilnError(
            f"nothing to evaluate for {args.model}: pass --tasks, --val, --bpb or "
            f"--lm-eval-tasks (or --chat-tasks){hint}"
        )
    if args.limit is not None and args.limit < 1:
        raise KilnError(f"--limit must be >= 1, got {args.limit}")
    if (args.context or args.rope_scaling or args.plot) and not (args.context and args.bpb):
        raise KilnError("--context needs --bpb FILE; --rope-scaling and --plot need --context")
    if args.stride is not None and args.stride < 1:
        raise KilnError(
            f"--stride must be >= 1 (or left out for the block size), got {args.stride}"
        )
    _chat_settings(args)  # a bad --chat-* flag fails before anything loads
    if _chat(args) and args.bpb is None:
        args.bpb = str(VALID_STORIES)  # what fine-tuning cost the language model
    names = parse_task_names(args.tasks) if args.tasks else []
    if names and args.data_dir is None:
        raise KilnError(f"no task data at {DEFAULT_DATA_DIR}; pass --data-dir DIR")
    if args.out is not None:
        from kiln.io import check_can_write

        check_can_write(args.out, args.force)  # before minutes of scoring, not after
    doc, table = evaluate(args, names)
    print(table)
    if args.out is not None:
        from kiln.io import write_json_atomic

        write_json_atomic(args.out, doc)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _chat(args: argparse.Namespace) -> bool:
    return args.chat_tasks is not None


def _chat_settings(args: argparse.Namespace) -> Any:
    """The reply settings of --chat-tasks (a bad value is one KilnError line)."""
    from kiln.posttrain.replies import ReplySettings

    return ReplySettings(
        temperature=args.chat_temperature, top_p=None, max_tokens=args.chat_max_tokens,
        seed=args.chat_seed,
    )  # fmt: skip


def evaluate(args: argparse.Namespace, names: list[str]) -> tuple[dict[str, Any], str]:
    """Run the requested evaluations; the results document and its table."""
    from kiln.eval.lm import bits_per_byte, val_loss
    from kiln.eval.multiple_choice import evaluate_task
    from kiln.eval.report import format_table, results_json
    from kiln.eval.scoring import Scorer
    from kiln.eval.tasks import load_task
    from kiln.loading import load_model

    loaded_tasks = [load_task(name, args.data_dir, args.limit) for name in names]  # fail fast
    if _chat(args):
        from kiln.eval.chat_tasks import evaluate_chat_records, heldout_records

        chat_records = heldout_records(args.chat_tasks or None, args.limit)
    # Scoring the val split needs no tokenizer: a run whose tokenizer moved still loads for it.
    need_tokenizer = bool(names or args.bpb or args.lm_eval_tasks or _chat(args))
    loaded = load_model(args.model, args.tokenizer, args.device, args.dtype, need_tokenizer)
    tok = f"tokenizer {loaded.tokenizer_path}" if loaded.tokenizer_path else "no tokenizer needed"
    print(f"kiln eval: {loaded.source} ({tok})", file=sys.stderr)
    print("\n".join(loaded.precision.lines("kiln eval")), file=sys.stderr)
    quantized = quantize.quantize_from_args(loaded.model, args, "kiln eval")
    device = next(loaded.model.parameters()).device
    scorer = Scorer(
        loaded.model, args.batch_size, not args.no_progress, autocast_dtype=loaded.autocast_dtype
    )
    chat = None
    if _chat(args):  # first: a model without the chat tokens fails before minutes of scoring
        chat = evaluate_chat_records(
            loaded, chat_records, _chat_settings(args), args.batch_size, not args.no_progress
        )
    tasks = []
    for task in loaded_tasks:
        result = evaluate_task(task, scorer, loaded.tokenizer, loaded.eot_id)
        tasks.append((result, str(task.path)))
    val = bpb = None
    if args.val:
        val = val_loss(scorer, args.val, args.val_split, args.val_tokens, args.stride)
    context = None
    if args.bpb and args.context:
        from kiln.eval.context import run_context_curves

        context = run_context_curves(loaded.model, loaded.tokenizer, args)
    elif args.bpb:
        bpb = bits_per_byte(scorer, loaded.tokenizer, args.bpb, loaded.eot_id, args.stride)
    harness = None
    if args.lm_eval_tasks:
        from kiln.eval.lm_eval_adapter import run_lm_eval

        harness = run_lm_eval(
            loaded, args.lm_eval_tasks.split(","), args.lm_eval_include, args.limit,
            args.batch_size, progress=not args.no_progress,
        )  # fmt: skip
    settings = {
        "limit": args.limit, "batch_size": args.batch_size, "device": str(device),
        "dtype": loaded.precision.name, "precision": loaded.precision.to_dict(), "stride": args.stride, "data_dir": str(args.data_dir),
        "quantize": quantized and quantized.to_dict(),
    }  # fmt: skip
    doc = results_json(
        loaded.source,
        loaded.tokenizer_path and str(loaded.tokenizer_path),
        settings,
        tasks,
        val,
        bpb,
        harness,
    )
    table = format_table([r for r, _ in tasks], val, bpb)
    if chat is not None:
        from kiln.eval.chat_tasks import format_chat_table

        doc["chat_tasks"] = chat
        table = format_chat_table(chat) + ("\n" + table if table else "")
    if context is not None:
        doc["context"] = context[0]
        table += ("\n" if table else "") + context[1]
    if harness is not None:
        table += ("\n" if table else "") + _harness_lines(harness)
    return doc, table


def _harness_lines(harness: dict[str, Any]) -> str:
    """lm-eval's metrics, one line per task."""
    lines = []
    for task, metrics in harness.items():
        shown = ", ".join(
            f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k
        )
        lines.append(f"lm-eval {task}: {shown}")
    return "\n".join(lines)
