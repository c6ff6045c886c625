"""`kiln posttrain add-chat-tokens|preferences`, `kiln data chat`, `kiln chat`, `kiln sft`,
`kiln distill`, `kiln prune`, and the preference and RL commands `kiln dpo`, `kiln reward`,
`kiln rl` (kiln/posttrain/align/run.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kiln.commands import (
    add_command_group,
    add_device_options,
    add_subcommand,
    add_tokenizer_option,
    command_group,
)
from kiln.posttrain.synth.cli import register as register_synth

MODEL_HELP = "a kiln demo, run, train/, checkpoints/, checkpoint (step_N) or HF model folder"

ADD_TOKENS_EXAMPLES = """examples:
  kiln posttrain add-chat-tokens runs/demo runs/demo-chat
  kiln posttrain add-chat-tokens exports/demo runs/demo-chat --force

Writes a NEW run folder (tokenizer.json, checkpoints/step_N/, chat_tokens.json); the source is
never modified. The tokens get the ids after the tokenizer's largest (no id is renumbered); the
embedding and head rows of the new tokens start as the mean of the existing tokens' rows."""

DATA_CHAT_EXAMPLES = """examples:
  kiln data chat data/chat
  kiln data chat data/chat-big --source ../shared/data/tinystories --heldout 500 --seed 1
  kiln data chat data/chat-small --max-stories 2000 --tasks words,name --force

Writes OUT/train.jsonl and OUT/heldout.jsonl (one conversation per line: "messages", plus the
"task" and "params" its check needs) and OUT/manifest.json (counts per task, sha256). The
held-out split shares no story with train; the same sources and seed give the same files."""

CHAT_EXAMPLES = """examples:
  kiln chat runs/demo-sft
  kiln chat exports/demo-sft --system "You tell short stories." --temperature 0.7
  kiln chat runs/demo-sft --seed 1 --max-tokens 200 < questions.txt

In the chat: /reset, /system TEXT, /temperature X, /help, /quit (or Ctrl-D). Ctrl-C stops a
reply and returns to the prompt. MODEL needs the chat tokens (kiln posttrain add-chat-tokens)."""


def register(sub: Any) -> None:
    """Add `kiln posttrain ...`, `kiln data chat` and `kiln chat` to the `kiln` parser."""
    commands = add_command_group(
        sub,
        "posttrain",
        "prepare a base model for post-training (chat tokens)",
        "Post-training preparation: give a base model and its tokenizer the chat tokens.",
        "kiln posttrain add-chat-tokens runs/demo runs/demo-chat",
    )
    _add_chat_tokens_command(commands)
    _register_alignment(sub)
    _add_data_chat_command(command_group(sub, "data"))
    register_synth(sub)
    _add_chat_command(sub)
    _add_sft_command(sub)
    _add_distill_command(sub)
    _add_prune_command(sub)


def _add_chat_tokens_command(commands: Any) -> None:
    p = add_subcommand(
        commands,
        "add-chat-tokens",
        "add the chat tokens to a model and its tokenizer (a new folder)",
        ADD_TOKENS_EXAMPLES,
    )
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("out", metavar="OUT", help="the new run folder to write")
    add_tokenizer_option(p)
    p.add_argument("--force", action="store_true", help="replace an OUT this command wrote before")
    p.set_defaults(handler=run_add_chat_tokens)


def run_add_chat_tokens(args: argparse.Namespace) -> int:
    """Write OUT and report the tokens and rows added."""
    from kiln.posttrain.add_chat_tokens import add_chat_tokens, describe

    result = add_chat_tokens(args.model, args.out, force=args.force, tokenizer=args.tokenizer)
    print(describe(result, args.model))
    return 0


def _add_data_chat_command(commands: Any) -> None:
    from kiln.posttrain.tasks import TASKS

    p = add_subcommand(
        commands,
        "chat",
        "build instruction conversations with checkable tasks from TinyStories",
        DATA_CHAT_EXAMPLES,
    )
    p.add_argument("out", metavar="OUT", help="the folder to write")
    p.add_argument(
        "--source",
        action="append",
        metavar="PATH",
        help="story file (.txt[.gz], <|endoftext|> lines between stories) or a folder of "
        "train*.txt[.gz] (repeatable; default: the shipped TinyStories)",
    )
    p.add_argument("--seed", type=int, default=0, help="shuffle and task seed (default 0)")
    p.add_argument("--heldout", type=int, default=250, help="held-out stories (default 250)")
    p.add_argument("--max-stories", type=int, help="train stories (default: all the rest)")
    p.add_argument(
        "--tasks-per-story",
        type=int,
        default=1,
        metavar="K",
        help="train examples per story, of K different tasks (default 1; held-out: always 1)",
    )
    p.add_argument(
        "--tasks", default=",".join(TASKS), help=f"comma-separated (default {','.join(TASKS)})"
    )
    p.add_argument("--force", action="store_true", help="replace an OUT this command wrote")
    p.set_defaults(handler=run_data_chat)


def run_data_chat(args: argparse.Namespace) -> int:
    """Build and write the conversations, print the counts."""
    from kiln.posttrain.chat_data import ChatDataConfig, format_summary, write_chat_data

    config = ChatDataConfig(
        seed=args.seed,
        heldout=args.heldout,
        max_stories=args.max_stories,
        tasks_per_story=args.tasks_per_story,
        tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()),
        **({"sources": tuple(args.source)} if args.source else {}),
    )
    print(format_summary(write_chat_data(config, args.out, args.force), args.out))
    return 0


def _add_chat_command(sub: Any) -> None:
    p = add_subcommand(sub, "chat", "chat with a chat model in the terminal", CHAT_EXAMPLES)
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    add_tokenizer_option(p)
    p.add_argument("--system", metavar="TEXT", help="a system message to start with")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top-k", type=int, help="sample among the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--max-tokens", type=int, default=256, help="longest reply (default 256)")
    p.add_argument("--seed", type=int, help="seed the sampler (replies then repeat exactly)")
    add_device_options(p)
    p.set_defaults(handler=run_chat_command)


def run_chat_command(args: argparse.Namespace) -> int:
    """Load the model and talk until EOF or /quit."""
    import sys

    from kiln.loading import load_model
    from kiln.posttrain.chat_session import ChatSession, run_chat
    from kiln.posttrain.replies import ReplySettings

    settings = ReplySettings(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        max_tokens=args.max_tokens, seed=args.seed,
    )  # fmt: skip
    loaded = load_model(args.model, args.tokenizer, args.device, args.dtype)
    session = ChatSession(loaded, settings, system=args.system)
    print(f"kiln chat: {loaded.source}", file=sys.stderr)
    print("\n".join(loaded.precision.lines("kiln chat")), file=sys.stderr)
    print("/help for commands, Ctrl-C stops a reply, Ctrl-D leaves", file=sys.stderr)
    return run_chat(session, input)


SFT_EXAMPLES = """examples:
  kiln sft configs/sft.toml --set sft.base=runs/demo-chat --set data.train=data/chat/train.jsonl
  kiln sft configs/sft.toml --set lora.rank=8 --set logging.run_dir=runs/sft-lora
  kiln sft configs/sft.toml --resume           # continue from the run's latest checkpoint
  kiln eval runs/sft --chat-tasks              # then score it (a LoRA run loads merged)"""


def _add_sft_command(sub: Any) -> None:
    """`kiln sft CONFIG.toml [--set k=v ...] [--resume]`: fine-tune a model on conversations."""
    p = add_subcommand(
        sub, "sft", "fine-tune a model on conversations (full or LoRA)", SFT_EXAMPLES
    )
    p.description = (
        "Supervised fine-tuning: start from sft.base (a model with the chat tokens, e.g. from\n"
        "`kiln posttrain add-chat-tokens`) and train on data.train's conversations, learning the\n"
        "assistant replies only. lora.rank > 0 trains LoRA adapters with the base frozen and\n"
        "writes RUN/adapter/ (PEFT's format). The run folder is a kiln run: config.toml (the\n"
        "base and data recorded by sha256), metrics.jsonl, checkpoints/ (exact --resume)."
    )
    from kiln.train.cli import add_run_arguments

    add_run_arguments(p, "SFT config (see configs/sft.toml)", "lora.rank=8")
    p.set_defaults(handler=run_sft)


def run_sft(args: argparse.Namespace) -> int:
    """Load the config, fine-tune (resuming if asked), write a LoRA run's adapter."""
    from kiln.posttrain.sft.run import build_trainer, load_sft_config, write_adapter
    from kiln.train.cli import load_run_config, train_and_report

    cfg, run_dir = load_run_config(args, load_sft_config)

    def after(trainer: Any, result: Any) -> None:
        written = write_adapter(trainer)
        if written is not None:
            trainer.say(f"kiln sft: LoRA adapter of step {result.step:,} in {written} (PEFT)")

    return train_and_report(cfg, run_dir, args, build=build_trainer, command="sft", after=after)


DISTILL_EXAMPLES = """examples:
  kiln distill configs/distill.toml --set distill.teacher=runs/demo --set data.dataset=data/stories
  kiln distill configs/distill.toml --set distill.loss=reverse_kl --set distill.ce_weight=0.5
  kiln distill configs/heal.toml --set distill.student=runs/pruned   # heal a pruned model
  kiln distill configs/distill.toml --resume
  kiln distill configs/distill.toml --precompute-topk 64            # teacher top-64 shards, once
  kiln distill configs/distill.toml --set distill.topk=64           # then train from them
  kiln distill configs/distill.toml --set distill.on_policy=0.5     # GKD: half on-policy"""


def _add_distill_command(sub: Any) -> None:
    """`kiln distill CONFIG.toml [--set k=v ...] [--resume]`: train a student on a teacher."""
    p = add_subcommand(
        sub, "distill", "train a student model on a teacher's logits (KL, reverse KL, + CE)",
        DISTILL_EXAMPLES,
    )  # fmt: skip
    p.description = (
        "Knowledge distillation: train [model] (or distill.student's weights) on the dataset\n"
        "with the KL to distill.teacher's temperature-softened logits, optionally mixed with the\n"
        "cross-entropy. The teacher must use the dataset's tokenizer. The run folder is a kiln\n"
        "run: config.toml, metrics.jsonl (val_loss: the student's own), checkpoints/ (--resume)."
    )
    from kiln.train.cli import add_run_arguments

    add_run_arguments(p, "distillation config (see configs/distill.toml)", "distill.temperature=1")
    p.add_argument(
        "--precompute-topk", type=int, metavar="K", default=None,
        help="only write the teacher's top-K log-probs (at distill.temperature) and tail mass "
        "beside the token shards (then train with --set distill.topk=K)",
    )  # fmt: skip
    p.add_argument("--force", action="store_true", help="with --precompute-topk: rebuild them")
    p.set_defaults(handler=run_distill)


def run_distill(args: argparse.Namespace) -> int:
    """Load the config and distill (resuming if asked)."""
    from kiln.posttrain.distill import build_trainer, load_distill_config
    from kiln.train.cli import load_run_config, train_and_report

    cfg, run_dir = load_run_config(args, load_distill_config)
    if args.precompute_topk is not None:
        from kiln.posttrain.distill import precompute_topk

        precompute_topk(cfg, args.precompute_topk, args.force)
        return 0
    return train_and_report(cfg, run_dir, args, build=build_trainer, command="distill")


PRUNE_EXAMPLES = """examples:
  kiln prune runs/demo runs/pruned --n-layer 3 --n-embd 192 --d-ff 448
  kiln prune runs/demo runs/pruned --n-head 2 --data data/tinystories --batches 16 --force
  kiln distill configs/heal.toml --set distill.teacher=runs/demo \\
      --set distill.student=runs/pruned                       # then heal it (Minitron)

Ranks attention heads (whole GQA groups with --n-kv-head; query heads within each group with
--n-head), MLP channels and embedding channels by their mean activation on calibration windows
of DATA's train split, and blocks by how little they change the residual stream (1 - cosine);
keeps the most important. OUT is a new run folder (tokenizer.json, checkpoints/step_0/,
prune.json) that every command loads; the source is never modified."""


def _add_prune_command(sub: Any) -> None:
    """`kiln prune MODEL OUT --n-layer/--n-head/--n-kv-head/--n-embd/--d-ff`."""
    p = add_subcommand(sub, "prune", "structured pruning: a smaller model of the same family",
                       PRUNE_EXAMPLES)  # fmt: skip
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("out", metavar="OUT", help="the new run folder to write")
    for flag, what in (
        ("--n-layer", "blocks to keep (depth)"), ("--n-head", "query heads to keep"),
        ("--n-kv-head", "key/value heads (GQA groups) to keep"),
        ("--n-embd", "embedding channels to keep"), ("--d-ff", "MLP channels to keep"),
    ):  # fmt: skip
        p.add_argument(flag, type=int, metavar="N", help=f"{what} (default: all)")
    p.add_argument("--data", metavar="DIR", help="token-shard dataset for calibration "
                   "(default: the one the model was trained on)")  # fmt: skip
    p.add_argument("--batches", type=int, default=8, help="calibration batches (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="calibration window (default 256)")
    add_tokenizer_option(p)
    p.add_argument("--force", action="store_true", help="replace an OUT this command wrote before")
    p.set_defaults(handler=run_prune)


def run_prune(args: argparse.Namespace) -> int:
    """Prune MODEL into OUT and report the shapes and parameter counts."""
    from kiln.posttrain.prune import PruneTargets, prune_to_folder

    targets = PruneTargets(
        n_layer=args.n_layer, n_head=args.n_head, n_kv_head=args.n_kv_head,
        n_embd=args.n_embd, d_ff=args.d_ff,
    )  # fmt: skip
    print(prune_to_folder(args.model, args.out, targets, args.data, args.batches, args.seq_len,
                          args.tokenizer, args.force))  # fmt: skip
    return 0


# ---- preferences and RL ---------------------------------------------------------------------

PREFERENCES_EXAMPLES = """examples:
  kiln posttrain preferences runs/sft data/chat data/prefs
  kiln posttrain preferences runs/sft data/chat data/prefs --samples 8 --max-prompts 400 --force
  kiln posttrain preferences runs/sft data/chat data/prefs-onpolicy --greedy --temperature 0.7

Samples --samples replies per TRAIN prompt of a `kiln data chat` folder (never the held-out
split), judges them with the task checks, and keeps a pair where one reply does all that was
asked and another does not. Writes OUT/pairs.jsonl (prompt, chosen, rejected, scores, sampling)
and OUT/manifest.json."""

DPO_EXAMPLES = """examples:
  kiln dpo configs/dpo.toml --set policy.base=runs/sft --set data.pairs=data/prefs/pairs.jsonl
  kiln dpo configs/dpo.toml --set dpo.beta=0.2 --set dpo.loss_type=ipo --set run_dir=runs/ipo
  kiln dpo configs/dpo.toml --set dpo.rpo_alpha=0.5 --set dpo.resample_every=20 --set data.chat=data/chat
  kiln dpo configs/dpo.toml --resume"""

REWARD_EXAMPLES = """examples:
  kiln reward configs/reward.toml --set policy.base=runs/sft --set data.pairs=data/prefs/pairs.jsonl
  kiln reward configs/reward.toml --resume"""

RL_EXAMPLES = """examples:
  kiln rl configs/grpo.toml --set policy.base=runs/sft --set data.chat=data/chat
  kiln rl configs/grpo.toml --set rl.algorithm=ppo --set run_dir=runs/ppo
  kiln rl configs/grpo.toml --set rl.algorithm=ppo --set rl.epochs=4 --set rl.minibatch=8 --set rl.kl_target=6
  kiln rl configs/grpo.toml --set rl.loss_norm=constant --set rl.scale_rewards=none   # Dr. GRPO
  kiln rl configs/grpo.toml --set data.reward_model=runs/reward --set data.reward_model_weight=0.5
  kiln rl configs/grpo.toml --resume"""


def _register_alignment(sub: Any) -> None:
    """Add `kiln posttrain preferences`, `kiln dpo`, `kiln reward` and `kiln rl`."""
    _preferences_command(command_group(sub, "posttrain"))
    for name, help_text, examples, handler in (
        ("dpo", "preference-tune a chat model on pairs (DPO or IPO)", DPO_EXAMPLES, run_dpo),
        ("reward", "train a Bradley-Terry reward model on pairs", REWARD_EXAMPLES, run_reward),
        ("rl", "reinforcement-learn a chat model on checkable tasks (GRPO or PPO)", RL_EXAMPLES,
         run_rl),
    ):  # fmt: skip
        p = add_subcommand(sub, name, help_text, examples)
        p.add_argument("config", metavar="CONFIG.toml", nargs="?", help="run config (configs/)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set dpo.beta=0.2 (repeatable)")  # fmt: skip
        p.add_argument("--resume", action="store_true", help="continue the run's latest checkpoint")
        p.add_argument(
            "--force", action="store_true", help="start over in a run_dir that has a run"
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.set_defaults(handler=handler)


def _preferences_command(commands: Any) -> None:
    p = add_subcommand(
        commands, "preferences", "sample and judge replies into preference pairs",
        PREFERENCES_EXAMPLES,
    )  # fmt: skip
    p.add_argument("model", metavar="MODEL", help="the chat model to sample (an SFT run)")
    p.add_argument("chat", metavar="CHAT_DATA", help="a `kiln data chat` folder")
    p.add_argument("out", metavar="OUT", help="the folder to write")
    p.add_argument("--samples", type=int, default=4, help="replies per prompt (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="reply length cap (192)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (1.0)")
    p.add_argument("--top-k", type=int, default=50, help="top-k sampling (50; 0: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--greedy", action="store_true",
        help="one of the replies is the greedy one (on-policy pairs; pair with a low temperature)",
    )  # fmt: skip
    p.add_argument("--max-prompts", type=int, default=0, help="first N train prompts (0: all)")
    p.add_argument("--force", action="store_true", help="replace an OUT this command wrote")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_preferences)


def run_preferences(args: argparse.Namespace) -> int:
    """Sample, judge and write the pairs; print how many prompts gave a pair, per task."""
    from kiln.posttrain.align.preferences import SamplingConfig, write_preferences

    cfg = SamplingConfig(
        samples=args.samples, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k or None, seed=args.seed, greedy=args.greedy,
    )  # fmt: skip
    summary = write_preferences(
        args.model, args.chat, Path(args.out), cfg, args.max_prompts, args.force,
        progress=not args.no_progress,
    )  # fmt: skip
    print(summary)
    return 0


def _run(args: argparse.Namespace, kind: str) -> int:
    from kiln.posttrain.align.run import run_from_config

    overrides = list(args.set)
    print(run_from_config(kind, args.config, overrides, args.resume, args.force,
                          progress=not args.no_progress))  # fmt: skip
    return 0


def run_dpo(args: argparse.Namespace) -> int:
    """`kiln dpo`."""
    return _run(args, "dpo")


def run_reward(args: argparse.Namespace) -> int:
    """`kiln reward`."""
    return _run(args, "reward")


def run_rl(args: argparse.Namespace) -> int:
    """`kiln rl`."""
    return _run(args, "rl")
