"""`kiln demo --chat`: from nothing to a served chat model in one command.

The stages, each one ordinary kiln command run in this process (printed as `$ kiln ...`, so the
chain can be repeated by hand) into one run folder:

1. `tokenizer`: a byte-level BPE tokenizer with the chat tokens reserved from the start, and the
   embedded TinyStories as token shards;
2. `pretrain`: `kiln train` of the demo model on its time budget;
3. `chat-data`: `kiln data chat`, the conversations and held-out prompts of the checkable tasks;
4. `sft`: `kiln sft` of the pre-trained model on the conversations, on its time budget;
5. `align`: GRPO, PPO or DPO by `--align`, on its time budget; by default none, because on a
   2-core CPU five more minutes of SFT beat five minutes of GRPO after it (bench/RESULTS.md,
   "Session 11");
6. after the pre-training, SFT and alignment stages, `kiln eval --chat-tasks` on the held-out
   prompts: the success table before and after each stage, in `report/`.

Stage budgets are checked against `--minutes` before anything is trained; every stage's state
is in `stages.json`, so `--resume` continues a killed run at the stage it was in (the training
stages from their latest checkpoint). The last stage's folder is the chat model that
`kiln serve` and `kiln chat` open.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.io import asset
from kiln.posttrain.tasks import TASKS

TRAINED = ("pretrain", "sft", "align")  # the stages with a time budget, each followed by an eval
STAGES = ("tokenizer", "chat-data", *(f"{k}{e}" for k in TRAINED for e in ("", "-eval")))
ALIGN_METHODS = ("grpo", "ppo", "dpo", "none")
CHAT_MARKER = ".kiln-demo-chat"
STATE_FILE = "stages.json"
# Minutes the untimed work takes at the default sizes (tokenizer and shards, chat data, three
# evaluations of 20 prompts per task, DPO's pairs): what the stage budgets must leave of --minutes.
UNTIMED_MINUTES = 4.0
TOTAL_MINUTES = 30.0  # --minutes with --chat: the whole chain, not only pre-training
# Every task a train story fits: ~39,000 conversations instead of ~6,800 (7 tasks), so the SFT
# budget reads new conversations instead of four epochs of the same ones (bench/RESULTS.md).
TASKS_PER_STORY = len(TASKS)
# Every held-out prompt of the default build (35-36 per task, ~250): 20 per task gave intervals of
# +-8.6 points over all tasks, too wide to tell a stage's gain from the seed's noise.
EVAL_LIMIT = 36
# The settings a resumed run must share with the run it continues (everything that shapes it).
RESUME_KEYS = (
    "vocab_size", "pretrain_minutes", "sft_minutes", "align_minutes", "pretrain_steps",
    "sft_steps", "align_steps", "align", "eval_limit", "eval_max_tokens", "eval_bpb", "set",
    "sft_set", "align_set", "tasks_per_story", "seed",
)  # fmt: skip

Runner = Callable[[Sequence[str]], None]


def kiln_command(argv: Sequence[str]) -> None:
    """Run one kiln command in this process; its KilnError propagates (one line for the user)."""
    from kiln.cli import build_parser

    print(f"\n$ kiln {' '.join(argv)}", flush=True)
    args = build_parser().parse_args(list(argv))
    args.handler(args)


def run_chat_demo(args: argparse.Namespace, run: Runner = kiln_command) -> int:
    """Run (or resume) every stage, then print the tables and where the time went."""
    out = Path(args.out) if args.out else Path("runs") / time.strftime("demo-chat-%Y%m%d-%H%M%S")
    if args.steps is not None:
        raise KilnError("--steps is the plain demo's; with --chat give --pretrain-steps N")
    if args.resume and not args.out:
        raise KilnError("--resume needs --out FOLDER: the `kiln demo --chat` run to continue")
    if args.minutes is None:
        args.minutes = TOTAL_MINUTES
    check_plan(args)
    state = _open_state(out, args)
    started = time.perf_counter()
    from kiln.folders import run_stages

    def do(stage: str, resuming: bool) -> None:
        if stage.endswith("-eval"):
            _evaluate(out, stage.removesuffix("-eval"), args, run)
        else:
            STAGE_FUNCTIONS[stage](out, args, run, resuming)

    run_stages(out, state, STAGES, do)
    table = write_report(out, state, args.align)
    print("\n" + table)
    print(f"\nthis invocation: {(time.perf_counter() - started) / 60:.1f} min")
    final = out / final_stage(args.align)
    print(f"chat model        {final}\n  kiln chat {final}\n  kiln serve {final}   # the page's "
          "'Ask for a change' talks to it")  # fmt: skip
    return 0


def final_stage(align: str) -> str:
    """The folder of the model the demo ends with."""
    return "sft" if align == "none" else "align"


# ---------------------------------------------------------------------------------- the plan
def stage_budgets(args: argparse.Namespace) -> dict[str, float | None]:
    """Minutes of each trained stage (None: sized by its --*-steps instead)."""
    budgets: dict[str, float | None] = {}
    for stage in TRAINED:
        steps = getattr(args, f"{stage}_steps")
        minutes = getattr(args, f"{stage}_minutes")
        if stage == "align" and args.align == "none":
            budgets[stage] = 0.0
        else:
            budgets[stage] = None if steps is not None else minutes
    return budgets


def check_plan(args: argparse.Namespace) -> None:
    """Refuse, in one line and before anything is trained, a plan that cannot run."""
    if args.vocab_size < 300:
        raise KilnError(f"--vocab-size {args.vocab_size} is too small for the chat demo (>= 300)")
    for flag in ("eval_limit", "eval_max_tokens", "tasks_per_story"):
        if getattr(args, flag) < 1:
            raise KilnError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not (math.isfinite(args.minutes) and args.minutes > 0):
        raise KilnError(f"--minutes must be a positive number, got {args.minutes}")
    for stage in TRAINED:
        minutes, steps = getattr(args, f"{stage}_minutes"), getattr(args, f"{stage}_steps")
        if not (math.isfinite(minutes) and minutes > 0):
            raise KilnError(f"--{stage}-minutes must be a positive number, got {minutes}")
        if steps is not None and steps < 1:
            raise KilnError(f"--{stage}-steps must be >= 1, got {steps}")
    timed = {k: v for k, v in stage_budgets(args).items() if v}
    needed = sum(timed.values()) + UNTIMED_MINUTES
    if timed and needed > args.minutes:
        parts = " + ".join(f"{k} {v:g}" for k, v in timed.items())
        raise KilnError(
            f"the stage budgets ({parts} min) plus about {UNTIMED_MINUTES:g} min of untimed work "
            f"(tokenizer, chat data, evaluations) need {needed:g} min, more than --minutes "
            f"{args.minutes:g}: lower a --*-minutes flag or raise --minutes"
        )
    _check_model(args)


def _check_model(args: argparse.Namespace) -> None:
    """The pre-training config builds, and every later stage can run on its model."""
    from kiln.train.config import load_train_config

    cfg = load_train_config(asset("demo.toml"), _pretrain_overrides(Path("."), args))
    pattern = str(cfg.model.get("layer_pattern", "A"))
    if set(pattern) != {"A"}:
        raise KilnError(
            f"model.layer_pattern {pattern!r} has recurrent layers: the SFT stage packs several "
            "conversations per row, which they do not support, and the engine does not serve "
            'them yet; the chat demo needs an attention-only model (layer_pattern = "A")'
        )
    if args.align != "none" and args.align not in ALIGN_METHODS:
        raise KilnError(f"--align must be one of {', '.join(ALIGN_METHODS)}, got {args.align!r}")


# ------------------------------------------------------------------------------- the stages
def _tokenizer(out: Path, args: argparse.Namespace, run: Runner, resuming: bool) -> None:
    corpus = str(asset("tinystories_train.txt.gz"))
    run(["tokenizer", "train", corpus, "--vocab-size", str(args.vocab_size), "--chat",
         "-o", str(out / "tokenizer.json"), "--force"])  # fmt: skip
    run(["data", "tokenize", corpus, "--tokenizer", str(out / "tokenizer.json"),
         "--out", str(out / "data"), "--val-fraction", "0.02", "--force"])  # fmt: skip


def _pretrain_overrides(out: Path, args: argparse.Namespace) -> list[str]:
    length = (
        [f"train.max_steps={args.pretrain_steps}", "train.time_budget=none"]
        if args.pretrain_steps is not None
        else [f"train.time_budget={args.pretrain_minutes * 60:g}"]
    )
    return [f"data.dataset={out / 'data'}", f"logging.run_dir={out / 'pretrain'}", *length,
            *_seeds(args, "train", "data"), *args.set]  # fmt: skip


def _seeds(args: argparse.Namespace, *sections: str) -> list[str]:
    """--seed as each section's seed override (before the user's --set, which wins)."""
    return [f"{section}.seed={args.seed}" for section in sections] if args.seed else []


def _pretrain(out: Path, args: argparse.Namespace, run: Runner, resuming: bool) -> None:
    overrides = [x for o in _pretrain_overrides(out, args) for x in ("--set", o)]
    resume = _resume_flag(out / "pretrain", resuming)
    run(["train", str(asset("demo.toml")), *overrides, *resume, "--no-progress"])


def _chat_data(out: Path, args: argparse.Namespace, run: Runner, resuming: bool) -> None:
    run(["data", "chat", str(out / "chat"), "--tasks-per-story", str(args.tasks_per_story),
         "--force"])  # fmt: skip


def _sft(out: Path, args: argparse.Namespace, run: Runner, resuming: bool) -> None:
    length = (
        [f"train.max_steps={args.sft_steps}", "train.time_budget=none"]
        if args.sft_steps is not None
        else [f"train.time_budget={args.sft_minutes * 60:g}"]
    )
    settings = [
        f"sft.base={out / 'pretrain'}", f"data.train={out / 'chat' / 'train.jsonl'}",
        f"data.val={out / 'chat' / 'heldout.jsonl'}", f"logging.run_dir={out / 'sft'}",
        *length, *_seeds(args, "train", "data"), *args.sft_set,
    ]  # fmt: skip
    resume = _resume_flag(out / "sft", resuming)
    run(["sft", str(asset("demo_chat_sft.toml")), *[x for s in settings for x in ("--set", s)],
         *resume, "--no-progress"])  # fmt: skip


def _align(out: Path, args: argparse.Namespace, run: Runner, resuming: bool) -> None:
    if args.align == "none":
        print("--align none: the SFT model is the chat model")
        return
    kind = "dpo" if args.align == "dpo" else "rl"
    length = [] if args.align_steps is None else [f"{kind}.steps={args.align_steps}"]
    if args.align_steps is None:
        length.append(f"{kind}.time_budget={args.align_minutes * 60:g}")
    settings = [f"policy.base={out / 'sft'}", f"run_dir={out / 'align'}", *length]
    if kind == "dpo":
        run(["posttrain", "preferences", str(out / "sft"), str(out / "chat"), str(out / "prefs"),
             "--max-prompts", "200", "--max-new-tokens", "128", "--seed", str(args.seed),
             "--force", "--no-progress"])  # fmt: skip
        settings.append(f"data.pairs={out / 'prefs' / 'pairs.jsonl'}")
    else:
        settings += [f"data.chat={out / 'chat'}", f"rl.algorithm={args.align}"]
        if args.align == "ppo":
            settings.append("rl.group_size=1")
    settings += _seeds(args, "data", "dpo") if kind == "dpo" else _seeds(args, "rl")
    settings += args.align_set
    resume = _resume_flag(out / "align", resuming) or ["--force"]
    run([kind, str(asset(f"demo_chat_{kind}.toml")), *[x for s in settings for x in ("--set", s)],
         *resume, "--no-progress"])  # fmt: skip


def _resume_flag(run_dir: Path, resuming: bool) -> list[str]:
    """["--resume"] when a killed stage left a checkpoint; else start it over in a clean folder."""
    from kiln.checkpoint_format import resume_checkpoint
    from kiln.folders import remove_dir

    # resume_checkpoint, not latest_checkpoint: a kill between a first save's rename and its
    # `latest` write leaves a complete step_N that must be resumed, not deleted.
    if resuming and resume_checkpoint(run_dir / "checkpoints") is not None:
        return ["--resume"]
    if run_dir.exists():  # the demo's own folder, from a stage killed before its first checkpoint
        remove_dir(run_dir)
    return []


STAGE_FUNCTIONS: dict[str, Callable[[Path, argparse.Namespace, Runner, bool], None]] = {
    "tokenizer": _tokenizer,
    "pretrain": _pretrain,
    "chat-data": _chat_data,
    "sft": _sft,
    "align": _align,
}


def _evaluate(out: Path, stage: str, args: argparse.Namespace, run: Runner) -> None:
    if stage == "align" and args.align == "none":
        return
    bpb = ["--bpb", args.eval_bpb] if args.eval_bpb else []  # default: TinyStories valid
    run(["eval", str(out / stage), "--chat-tasks", str(out / "chat"), "--limit",
         str(args.eval_limit), "--chat-max-tokens", str(args.eval_max_tokens), *bpb,
         "--out", str(out / "report" / f"eval-{stage}.json"), "--force", "--no-progress"])  # fmt: skip


# ------------------------------------------------------------------------------ state, report
def _open_state(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The stages.json of a run to resume, or a fresh run folder (replacing one with --force)."""
    from kiln.folders import open_stage_state

    settings = {key: getattr(args, key) for key in RESUME_KEYS}
    return open_stage_state(out, settings, args.resume, args.force, CHAT_MARKER, "kiln demo --chat")


def success_rows(out: Path, align: str) -> list[tuple[str, dict[str, Any]]]:
    """(stage, its eval document) for each evaluated stage, in order."""
    rows = []
    for stage in TRAINED:  # each `<stage>-eval` wrote report/eval-<stage>.json
        path = out / "report" / f"eval-{stage}.json"
        if path.is_file() and not (stage == "align" and align == "none"):
            rows.append((stage, json.loads(path.read_text(encoding="utf-8"))))
    return rows


def write_report(out: Path, state: dict[str, Any], align: str) -> str:
    """The success table (before and after each stage) and the time table; report/ files."""
    from kiln.io import write_json_atomic

    rows = success_rows(out, align)
    tasks = list(rows[0][1]["chat_tasks"]["tasks"]) if rows else []
    lines = [
        "| after | all (95% CI) | " + " | ".join(tasks) + " | replies stopped | bpb |",
        "|---|---|" + "---|" * len(tasks) + "---|---|",
    ]
    for stage, doc in rows:
        chat = doc["chat_tasks"]
        low, high = chat["all"]["ci95"]
        label = stage if stage != "align" else f"align ({align})"
        lines.append(
            f"| {label} | {chat['all']['success_rate']:.1%} [{low:.1%}, {high:.1%}] | "
            + " | ".join(f"{chat['tasks'][t]['success_rate']:.0%}" for t in tasks)
            + f" | {chat['all'].get('stop_rate', 0.0):.0%} | {doc['bpb']['bits_per_byte']:.3f} |"
        )
    total = sum(r["seconds"] for r in state["stages"].values())
    lines += ["", "| stage | minutes | share |", "|---|---|---|"]
    for stage, record in state["stages"].items():
        share = record["seconds"] / total if total else 0.0
        lines.append(f"| {stage} | {record['seconds'] / 60:.1f} | {share:.0%} |")
    lines.append(f"| all | {total / 60:.1f} | 100% |")
    table = "\n".join(lines)
    summary = {
        "stages": state["stages"],
        "settings": state["settings"],
        "success": {stage: doc["chat_tasks"]["all"] for stage, doc in rows},
        "tasks": {stage: doc["chat_tasks"]["tasks"] for stage, doc in rows},
        "chat_model": str(out / final_stage(align)),
    }
    write_json_atomic(out / "report" / "summary.json", summary)
    (out / "report").mkdir(parents=True, exist_ok=True)
    (out / "report" / "tables.md").write_text(table + "\n", encoding="utf-8")
    return table


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kiln demo --chat` (stage budgets, methods, resume)."""
    group = parser.add_argument_group("kiln demo --chat (pre-training -> SFT -> alignment)")
    group.add_argument("--chat", action="store_true", help="go on to a chat model (see below)")
    group.add_argument("--pretrain-minutes", type=float, default=15.0, help="default 15")
    group.add_argument("--sft-minutes", type=float, default=11.0, help="default 11")
    group.add_argument("--align-minutes", type=float, default=5.0,
                       help="default 5 (with --align METHOD; lower --sft-minutes to make room)")  # fmt: skip
    group.add_argument("--pretrain-steps", type=int, help="exactly N steps instead of minutes")
    group.add_argument("--sft-steps", type=int, help="exactly N steps instead of minutes")
    group.add_argument("--align-steps", type=int, help="exactly N steps instead of minutes")
    group.add_argument("--align", default="none", choices=ALIGN_METHODS,
                       help="after SFT (default none: SFT's extra minutes beat GRPO's, "
                       "bench/RESULTS.md)")  # fmt: skip
    group.add_argument("--tasks-per-story", type=int, default=TASKS_PER_STORY, metavar="K",
                       help=f"SFT examples per train story, of K tasks (default {TASKS_PER_STORY})")  # fmt: skip
    group.add_argument("--seed", type=int, default=0,
                       help="the seed of pre-training, SFT and alignment (default 0); the "
                       "held-out prompts are the same whatever it is")  # fmt: skip
    group.add_argument("--eval-limit", type=int, default=EVAL_LIMIT,
                       help=f"held-out prompts per task (default {EVAL_LIMIT}: all of them)")  # fmt: skip
    group.add_argument("--eval-max-tokens", type=int, default=256, help="reply cap (256)")
    group.add_argument("--eval-bpb", metavar="FILE", help="bpb text (default TinyStories valid)")
    group.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE",
                       help="an SFT config override")  # fmt: skip
    group.add_argument("--align-set", action="append", default=[], metavar="KEY=VALUE",
                       help="an alignment config override")  # fmt: skip
    group.add_argument("--resume", action="store_true", help="continue a killed --chat run")
