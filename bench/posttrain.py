"""Post-training benchmark II: SFT vs DPO vs GRPO vs PPO on the checkable chat tasks.

The chain, each step a kiln command (what the README's "Preferences and RL" section shows):

1. `kiln posttrain preferences SFT CHAT OUT/prefs-sS --seed S`: sample the SFT model on train
   prompts, judge the replies with the task checks, keep (passing, failing) pairs;
2. `kiln dpo configs/dpo.toml` from the SFT model on those pairs;
3. `kiln rl configs/grpo.toml` (GRPO) and `--set rl.algorithm=ppo` (PPO) on the train prompts,
   rewarded by the task checks' graded scores;
4. `kiln eval MODEL --chat-tasks CHAT --limit N` for SFT, DPO, GRPO and PPO: success per task on
   the held-out prompts (never seen by any step above) and TinyStories-valid bits per byte.

Steps 1–4 repeat per seed (--seeds); the table gives each model's mean success and its spread
(min–max) over seeds. Results go to OUT/results.json and a Markdown table on stdout.

    .venv/bin/python bench/posttrain.py --sft runs/sft --chat data/chat --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._load import add_noisy_flag, begin  # noqa: E402
from kiln.io import write_json_atomic  # noqa: E402

MODELS = ("sft", "dpo", "grpo", "ppo")


def kiln(*args: str) -> None:
    """Run one kiln command (with this interpreter and this checkout), failing loudly."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    print("$ kiln " + " ".join(args), file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "kiln.cli", *args], check=True, env=env)


def evaluate(model: Path, chat: Path, result: Path, limit: int) -> dict[str, Any]:
    """`kiln eval MODEL --chat-tasks CHAT` (chat-task success and bits per byte)."""
    kiln("eval", str(model), "--chat-tasks", str(chat), "--out", str(result), "--force",
         "--no-progress", "--limit", str(limit))  # fmt: skip
    return json.loads(result.read_text())


def success(doc: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """Overall and per-task success rate of one eval result."""
    tasks = doc["chat_tasks"]["tasks"]
    rates = {name: t["success_rate"] for name, t in tasks.items()}
    passed = sum(t["successes"] for t in tasks.values())
    scored = sum(t["n"] for t in tasks.values())
    return passed / max(1, scored), rates


def run_seed(args: argparse.Namespace, seed: int, out: Path) -> dict[str, Path]:
    """Preferences and DPO, GRPO, PPO (those in --models) from the SFT model; the run folders."""
    runs = {"sft": Path(args.sft)}
    if "dpo" in args.models:
        prefs = out / f"prefs-s{seed}"
        if not (args.reuse_prefs and (prefs / "manifest.json").is_file()):
            kiln("posttrain", "preferences", args.sft, args.chat, str(prefs), "--seed", str(seed),
                 "--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens),
                 "--max-prompts", str(args.pref_prompts), "--force", "--no-progress",
                 *(["--greedy"] if args.greedy_pairs else []))  # fmt: skip
        runs["dpo"] = out / f"dpo-s{seed}"
        dpo(args, seed, prefs, runs["dpo"])
    for algorithm in ("grpo", "ppo"):
        if algorithm in args.models:
            runs[algorithm] = out / f"{algorithm}-s{seed}"
            rl(args, seed, algorithm, runs[algorithm])
    return runs


def dpo(args: argparse.Namespace, seed: int, prefs: Path, run: Path) -> None:
    """`kiln dpo` from the SFT model on one seed's pairs."""
    kiln("dpo", str(ROOT / "configs" / "dpo.toml"), "--force", "--no-progress",
         "--set", f"policy.base={args.sft}", "--set", f"data.pairs={prefs / 'pairs.jsonl'}",
         "--set", f"data.chat={args.chat}",
         "--set", f"run_dir={run}", "--set", f"dpo.steps={args.dpo_steps}",
         "--set", f"dpo.seed={seed}", "--set", f"dpo.lr={args.dpo_lr}",
         "--set", f"dpo.save_every={args.dpo_steps}",
         *[a for kv in args.dpo_set for a in ("--set", f"dpo.{kv}")])  # fmt: skip


def rl(args: argparse.Namespace, seed: int, algorithm: str, run: Path) -> None:
    """`kiln rl` (GRPO or PPO) from the SFT model; PPO draws group_size × as many prompts."""
    kiln("rl", str(ROOT / "configs" / "grpo.toml"), "--force", "--no-progress",
         "--set", f"policy.base={args.sft}", "--set", f"data.chat={args.chat}",
         "--set", f"run_dir={run}", "--set", f"rl.algorithm={algorithm}",
         "--set", f"rl.steps={args.rl_steps}", "--set", f"rl.seed={seed}",
         "--set", f"rl.lr={args.rl_lr}", "--set", f"rl.max_new_tokens={args.max_new_tokens}",
         "--set", f"rl.group_size={1 if algorithm == 'ppo' else args.group_size}",
         "--set", f"rl.prompts_per_step={args.prompts_per_step * (args.group_size if algorithm == 'ppo' else 1)}",
         "--set", f"rl.save_every={args.rl_steps}",
         *[a for kv in args.rl_set for a in ("--set", f"rl.{kv}")])  # fmt: skip


def main() -> int:
    """Run the chain for every seed, evaluate, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", required=True, help="the SFT model (a `kiln sft` run)")
    parser.add_argument("--chat", required=True, help="the `kiln data chat` folder")
    parser.add_argument("--out", default="out/posttrain", help="work folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--pref-prompts", type=int, default=200, help="prompts sampled for pairs")
    parser.add_argument("--samples", type=int, default=4, help="replies per prompt for pairs")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dpo-steps", type=int, default=100)
    parser.add_argument("--dpo-lr", type=float, default=5e-6)
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--rl-lr", type=float, default=5e-6)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--limit", type=int, default=20, help="held-out prompts per task")
    parser.add_argument(
        "--dpo-set", nargs="*", default=[], metavar="KEY=VALUE",
        help="more [dpo] settings, e.g. rpo_alpha=0.5 resample_every=20 (docs/posttrain.md)",
    )  # fmt: skip
    parser.add_argument(
        "--rl-set", nargs="*", default=[], metavar="KEY=VALUE",
        help="more [rl] settings, e.g. epochs=4 minibatch=8 kl_target=6 loss_norm=sequence",
    )  # fmt: skip
    parser.add_argument("--greedy-pairs", action="store_true", help="preferences --greedy")
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(MODELS[1:]),
        choices=MODELS[1:],
        help="which post-trained models to make (the SFT model is always scored)",
    )
    parser.add_argument(
        "--reuse-prefs",
        action="store_true",
        help="keep OUT/prefs-sS when it exists (made with the same settings)",
    )
    add_noisy_flag(parser)
    args = parser.parse_args()
    measured = begin("bench/posttrain.py", args.noisy)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results: dict[str, Any] = {"settings": vars(args), "machine": platform.processor() or
                               platform.machine(), "seeds": {}}  # fmt: skip
    for seed in args.seeds:
        runs = run_seed(args, seed, out)
        # The SFT model is the same for every seed and its evaluation greedy: scored once.
        evals = {name: evaluate(path, Path(args.chat), out / f"eval-{name}-s{seed}.json",
                                args.limit) for name, path in runs.items()
                 if name != "sft" or seed == args.seeds[0]}  # fmt: skip
        evals.setdefault("sft", json.loads((out / f"eval-sft-s{args.seeds[0]}.json").read_text()))
        results["seeds"][seed] = {
            name: {"success": success(doc)[0], "tasks": success(doc)[1],
                   "bpb": doc["bpb"]["bits_per_byte"]}
            for name, doc in evals.items()
        }  # fmt: skip
        write_json_atomic(out / "results.json", measured.stamp(results))
    results["minutes"] = (time.time() - started) / 60
    write_json_atomic(out / "results.json", measured.stamp(results))
    print(table(results))
    print(measured.line())
    return 0


def table(results: dict[str, Any]) -> str:
    """The Markdown table: success (mean, min–max over seeds) and bpb per model."""
    seeds = list(results["seeds"].values())
    tasks = list(seeds[0]["sft"]["tasks"])
    lines = ["| model | success, mean (min–max) | " + " | ".join(tasks) + " | bpb |",
             "|---|---|" + "---|" * len(tasks) + "---|"]  # fmt: skip
    for name in [m for m in MODELS if m in seeds[0]]:
        rates = [s[name]["success"] for s in seeds]
        per_task = [sum(s[name]["tasks"][t] for s in seeds) / len(seeds) for t in tasks]
        bpb = sum(s[name]["bpb"] for s in seeds) / len(seeds)
        lines.append(
            f"| {name} | {sum(rates) / len(rates):.1%} ({min(rates):.1%}–{max(rates):.1%}) | "
            + " | ".join(f"{r:.0%}" for r in per_task)
            + f" | {bpb:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
