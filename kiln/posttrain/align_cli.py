"""`kiln posttrain preferences`, `kiln dpo`, `kiln reward` and `kiln rl`: preferences and RL
from an SFT model (see kiln/posttrain/align.py for the run folder they write)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kiln.commands import add_subcommand, command_group

PREFERENCES_EXAMPLES = """examples:
  kiln posttrain preferences runs/sft data/chat data/prefs
  kiln posttrain preferences runs/sft data/chat data/prefs --samples 8 --max-prompts 400 --force

Samples --samples replies per TRAIN prompt of a `kiln data chat` folder (never the held-out
split), judges them with the task checks, and keeps a pair where one reply does all that was
asked and another does not. Writes OUT/pairs.jsonl (prompt, chosen, rejected, scores, sampling)
and OUT/manifest.json."""

DPO_EXAMPLES = """examples:
  kiln dpo configs/dpo.toml --set policy.base=runs/sft --set data.pairs=data/prefs/pairs.jsonl
  kiln dpo configs/dpo.toml --set dpo.beta=0.2 --set dpo.loss_type=ipo --set run_dir=runs/ipo
  kiln dpo configs/dpo.toml --resume"""

REWARD_EXAMPLES = """examples:
  kiln reward configs/reward.toml --set policy.base=runs/sft --set data.pairs=data/prefs/pairs.jsonl
  kiln reward configs/reward.toml --resume"""

RL_EXAMPLES = """examples:
  kiln rl configs/grpo.toml --set policy.base=runs/sft --set data.chat=data/chat
  kiln rl configs/grpo.toml --set rl.algorithm=ppo --set run_dir=runs/ppo
  kiln rl configs/grpo.toml --set data.reward_model=runs/reward --set data.reward_model_weight=0.5
  kiln rl configs/grpo.toml --resume"""


def register(sub: Any) -> None:
    """Add the preference and RL commands to the `kiln` parser."""
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
    p.add_argument("--max-prompts", type=int, default=0, help="first N train prompts (0: all)")
    p.add_argument("--force", action="store_true", help="replace an OUT this command wrote")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_preferences)


def run_preferences(args: argparse.Namespace) -> int:
    """Sample, judge and write the pairs; print how many prompts gave a pair, per task."""
    from kiln.posttrain.preferences import SamplingConfig, write_preferences

    cfg = SamplingConfig(
        samples=args.samples, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k or None, seed=args.seed,
    )  # fmt: skip
    summary = write_preferences(
        args.model, args.chat, Path(args.out), cfg, args.max_prompts, args.force,
        progress=not args.no_progress,
    )  # fmt: skip
    print(summary)
    return 0


def _run(args: argparse.Namespace, kind: str) -> int:
    from kiln.posttrain.align import run_from_config

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
