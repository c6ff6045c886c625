"""Post-training against the anchor: kiln's GRPO and DPO beside trl's GRPOTrainer and DPOTrainer.

Both start from the same SFT model (trl from kiln's HF export of it, `kiln export --hf`), on the
same train prompts of a `kiln data chat` folder, with kiln's task checks as the reward (trl: a
reward function calling `kiln.posttrain.tasks.score`), the same preference pairs, the same number
of updates and the same optimiser settings (AdamW, constant learning rate after the same warmup,
gradient-norm clip 1, no weight decay):

- GRPO: P prompts × G samples per update, k3 KL β in the loss, clip ε, group-std advantage
  scaling, token-level loss normalisation (kiln `rl.loss_norm = "token"`, trl `loss_type="dapo"`),
  one optimisation pass per rollout, temperature 1, replies of at most --max-new-tokens ending at
  `<|end|>` (trl is told that `<|end|>` is the end of a reply, as kiln is);
- DPO: sigmoid loss, β, pairs per update; the pairs are `kiln posttrain preferences` of the SFT
  model (full mode) or the reference replies against their first three words (--tiny, where a
  random model's samples give no pair).

Each trained model is then scored by the same `kiln eval --chat-tasks` code (greedy replies to
the held-out prompts, success = the task's check passes). The table: success and training wall
time of each, and kiln ÷ trl. Both run in this process, on the same threads, one after the
other. trl's generation is transformers' `generate` (no vLLM on CPU); kiln's is its engine.

    .venv/bin/python bench/posttrain_trl.py --sft runs/sft --chat data/chat      # ~6 min quiet
    .venv/bin/python bench/posttrain_trl.py --tiny --out /tmp/ptrl --noisy       # seconds
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._load import add_noisy_flag, begin  # noqa: E402
from kiln.io import write_json_atomic  # noqa: E402


def build_tiny(out: Path) -> tuple[Path, Path]:
    """A random tiny chat model (run folder) and a small `kiln data chat` folder, in `out`."""
    import torch

    from kiln.chat.tokens import CHAT_TOKENS
    from kiln.io import sha256_file
    from kiln.model import ModelConfig
    from kiln.model.transformer import Transformer
    from kiln.posttrain.chat_data import ChatDataConfig, write_chat_data
    from kiln.tokenizer import train_bpe
    from kiln.tokenizer.special import EOT
    from kiln.train.checkpoint import TrainState, save_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(ROOT / "kiln" / "assets" / "tinystories_train.txt.gz", "rt") as handle:
        text = handle.read(40_000)
    text = text[: text.rfind(EOT) + len(EOT)]
    (out / "stories.txt").write_text(text, encoding="utf-8")
    tok = train_bpe(out / "stories.txt", 320, special_tokens=[EOT, *CHAT_TOKENS], workers=1)
    run = out / "sft"
    run.mkdir(exist_ok=True)
    tok.save(run / "tokenizer.json")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny", vocab_size=tok.n_vocab, block_size=256))
    dataset = {"tokenizer_sha256": sha256_file(run / "tokenizer.json"), "vocab_size": tok.n_vocab}
    state = TrainState(step=1, tokens=0, cursor={}, config={"model": model.cfg.to_dict()},
                       dataset=dataset)  # fmt: skip
    save_checkpoint(run / "checkpoints", model, {}, state, scheduler={}, keep_last=1)  # type: ignore[arg-type]
    chat = out / "chat"
    write_chat_data(ChatDataConfig(sources=(str(out / "stories.txt"),), heldout=14), chat,
                    force=True)  # fmt: skip
    return run, chat


def reference_pairs(chat: Path, out: Path, n: int) -> Path:
    """Pairs of (the reference reply, its first three words) for the first n train prompts."""
    from kiln.chat import iter_conversations
    from kiln.posttrain.chat_data import split_file

    records = list(iter_conversations(split_file(chat, "train")))[:n]
    pairs = []
    for r in records:  # a shorter chosen reply (its first 30 words), so more pairs fit
        reply = r["messages"][-1]["content"].split()
        pairs.append({"messages": r["messages"][:-1], "chosen": " ".join(reply[:30]),
                      "rejected": " ".join(reply[:3])})  # fmt: skip
    path = out / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    return path


def fitting_pairs(pairs: Path, sft: Path, out: Path) -> Path:
    """The pairs whose prompt and longer reply fit the model's context (kiln leaves the others
    out, trl would cut them: both train on these)."""
    from kiln.loading import load_model
    from kiln.posttrain.align.preferences import read_pairs, tokenize_pair

    loaded = load_model(sft, dtype="fp32")
    block = loaded.model.cfg.block_size
    kept = []
    for n, pair in enumerate(read_pairs(pairs), start=1):
        tp = tokenize_pair(pair, loaded.tokenizer, f"{pairs}: pair {n}")
        if len(tp.prompt) + max(len(tp.chosen), len(tp.rejected)) <= block:
            kept.append(pair)
    if not kept:
        raise SystemExit(
            f"bench/posttrain_trl.py: no pair of {pairs} fits the {block}-token context"
        )
    path = out / "pairs-fit.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in kept), encoding="utf-8")
    return path


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn's result and its wall time in seconds."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def chat_success(model: Path, chat: Path, limit: int, max_tokens: int) -> dict[str, Any]:
    """`kiln eval --chat-tasks`'s success of a model folder (kiln run or HF folder)."""
    from kiln.eval.chat_tasks import evaluate_chat_records, heldout_records
    from kiln.loading import load_model
    from kiln.posttrain.replies import ReplySettings

    loaded = load_model(model, dtype="fp32")
    settings = ReplySettings(temperature=0.0, top_p=None, max_tokens=max_tokens)
    doc = evaluate_chat_records(loaded, heldout_records(chat, limit), settings, 16, False)
    return {"success": doc["all"]["success_rate"], "n": doc["all"]["n"],
            "stop_rate": doc["all"]["stop_rate"],
            "tasks": {t: r["success_rate"] for t, r in doc["tasks"].items()}}  # fmt: skip


# ---- kiln ---------------------------------------------------------------------------------------


def kiln_grpo(args: argparse.Namespace, sft: Path, chat: Path, run: Path) -> Path:
    """`kiln rl configs/grpo.toml` with the bench's settings; the run folder."""
    from kiln.posttrain.align.run import run_from_config

    sets = [f"policy.base={sft}", f"data.chat={chat}", f"run_dir={run}", "rl.algorithm=grpo",
            f"rl.steps={args.steps}", f"rl.prompts_per_step={args.prompts_per_step}",
            f"rl.group_size={args.group_size}", f"rl.max_new_tokens={args.max_new_tokens}",
            f"rl.lr={args.rl_lr}", f"rl.kl_coef={args.beta_rl}", "rl.clip=0.2",
            "rl.loss_norm=token", "rl.scale_rewards=group", "rl.epochs=1", "rl.minibatch=0",
            f"rl.save_every={args.steps}", f"rl.seed={args.seed}"]  # fmt: skip
    print(run_from_config("rl", str(ROOT / "configs" / "grpo.toml"), sets, False, True, False))
    return run


def kiln_dpo(args: argparse.Namespace, sft: Path, pairs: Path, run: Path) -> Path:
    """`kiln dpo configs/dpo.toml` with the bench's settings; the run folder."""
    from kiln.posttrain.align.run import run_from_config

    sets = [f"policy.base={sft}", f"data.pairs={pairs}", f"run_dir={run}", "data.heldout=0",
            f"dpo.steps={args.steps}", f"dpo.pairs_per_step={args.pairs_per_step}",
            f"dpo.lr={args.dpo_lr}", f"dpo.beta={args.beta_dpo}", f"dpo.warmup_steps={args.warmup}",
            f"dpo.save_every={args.steps}", f"dpo.seed={args.seed}"]  # fmt: skip
    print(run_from_config("dpo", str(ROOT / "configs" / "dpo.toml"), sets, False, True, False))
    return run


# ---- trl ----------------------------------------------------------------------------------------


def hf_chat_model(hf: Path) -> tuple[Any, Any]:
    """The exported model and tokenizer, told that `<|end|>` ends a reply (kiln's stop token)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.chat.tokens import END
    from kiln.tokenizer.special import EOT

    tok = AutoTokenizer.from_pretrained(hf)
    tok.eos_token, tok.pad_token = END, EOT
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(END)
    model.generation_config.pad_token_id = tok.convert_tokens_to_ids(EOT)
    return model, tok


def save_trl_model(model: Any, hf: Path, out: Path) -> Path:
    """The trained weights beside the export's own tokenizer files (kiln loads the folder)."""
    from kiln.train.export import HF_TOKENIZER_FILES

    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    for name in HF_TOKENIZER_FILES:
        shutil.copyfile(hf / name, out / name)
    return out


def task_reward(prompts: Sequence[Any], completions: Sequence[Any], task: Sequence[str],
                params: Sequence[str], **_: Any) -> list[float]:  # fmt: skip
    """kiln's graded task score of each completion (trl's reward-function signature)."""
    from kiln.posttrain.tasks import score

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [score({"task": t, "params": json.loads(p)}, text)
            for t, p, text in zip(task, params, texts, strict=True)]  # fmt: skip


def trl_grpo(args: argparse.Namespace, hf: Path, chat: Path, out: Path, block: int) -> Path:
    """trl's GRPOTrainer with the same settings as kiln_grpo; the saved HF folder."""
    import datasets
    import trl

    from kiln.chat import iter_conversations
    from kiln.posttrain.chat_data import split_file

    model, tok = hf_chat_model(hf)
    rows = [r for r in iter_conversations(split_file(chat, "train"))
            if len(tok.apply_chat_template(r["messages"][:-1], add_generation_prompt=True))
            <= block - args.max_new_tokens]  # fmt: skip
    ds = datasets.Dataset.from_list([
        {"prompt": r["messages"][:-1], "task": r["task"], "params": json.dumps(r["params"])}
        for r in rows
    ])  # fmt: skip
    cfg = trl.GRPOConfig(
        output_dir=str(out / "trl-grpo-work"), per_device_train_batch_size=args.prompts_per_step
        * args.group_size, num_generations=args.group_size, steps_per_generation=1,
        num_iterations=1, max_completion_length=args.max_new_tokens, max_steps=args.steps,
        learning_rate=args.rl_lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=args.beta_rl, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", temperature=1.0, top_p=1.0, use_cpu=True, bf16=False,
        report_to=[], save_strategy="no", logging_steps=1, seed=args.seed,
        disable_dropout=True,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(model=model, reward_funcs=task_reward, args=cfg, train_dataset=ds,
                              processing_class=tok)  # fmt: skip
    trainer.train()
    return save_trl_model(trainer.model, hf, out / "trl-grpo")


def trl_dpo(args: argparse.Namespace, hf: Path, pairs: Path, out: Path, block: int) -> Path:
    """trl's DPOTrainer on the same pairs and settings as kiln_dpo; the saved HF folder."""
    import datasets
    import trl

    model, tok = hf_chat_model(hf)
    ref, _ = hf_chat_model(hf)
    rows = [json.loads(line) for line in pairs.read_text().splitlines() if line]
    ds = datasets.Dataset.from_list([
        {"prompt": p["messages"], "chosen": [{"role": "assistant", "content": p["chosen"]}],
         "rejected": [{"role": "assistant", "content": p["rejected"]}]}
        for p in rows
    ])  # fmt: skip
    cfg = trl.DPOConfig(
        output_dir=str(out / "trl-dpo-work"), per_device_train_batch_size=args.pairs_per_step,
        max_steps=args.steps, learning_rate=args.dpo_lr, beta=args.beta_dpo,
        lr_scheduler_type="constant_with_warmup", warmup_steps=args.warmup, weight_decay=0.0,
        max_grad_norm=1.0, loss_type=["sigmoid"], max_length=block, use_cpu=True, bf16=False,
        report_to=[], save_strategy="no", logging_steps=1, seed=args.seed,
    )  # fmt: skip
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=cfg, train_dataset=ds,
                             processing_class=tok)  # fmt: skip
    trainer.train()
    return save_trl_model(trainer.model, hf, out / "trl-dpo")


# ---- the run ------------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    """kiln beside trl for each method: success, wall time, and kiln ÷ trl."""
    sft = results["sft"]
    lines = [f"SFT start: success {sft['success']:.1%} of {sft['n']} held-out prompts",
             "| method | kiln success | trl success | kiln s | trl s | kiln ÷ trl time |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for method in ("grpo", "dpo"):
        if method not in results:
            continue
        k, t = results[method]["kiln"], results[method]["trl"]
        lines.append(
            f"| {method} | {k['success']:.1%} | {t['success']:.1%} | {k['seconds']:.1f} | "
            f"{t['seconds']:.1f} | {k['seconds'] / t['seconds']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Build or take the SFT model, train with kiln and with trl, evaluate, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", help="the SFT model (a `kiln sft` run); not with --tiny")
    parser.add_argument("--chat", help="the `kiln data chat` folder; not with --tiny")
    parser.add_argument("--tiny", action="store_true", help="a random tiny model (seconds)")
    parser.add_argument("--out", default="out/posttrain_trl", help="work folder")
    parser.add_argument("--methods", nargs="+", default=["grpo", "dpo"], choices=["grpo", "dpo"])
    parser.add_argument("--steps", type=int, default=None, help="updates (20; --tiny: 2)")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="(96; --tiny: 16)")
    parser.add_argument("--rl-lr", type=float, default=2e-5)
    parser.add_argument("--beta-rl", type=float, default=0.02)
    parser.add_argument("--pairs-per-step", type=int, default=8)
    parser.add_argument("--dpo-lr", type=float, default=1e-5)
    parser.add_argument("--beta-dpo", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=0, help="DPO warmup steps (0)")
    parser.add_argument("--pref-prompts", type=int, default=300, help="prompts sampled for pairs")
    parser.add_argument("--limit", type=int, default=None, help="held-out per task (20; tiny 2)")
    parser.add_argument("--seed", type=int, default=0)
    add_noisy_flag(parser)
    args = parser.parse_args(argv)
    if not args.tiny and not (args.sft and args.chat):
        parser.error("give --sft and --chat, or --tiny")
    args.steps = args.steps or (2 if args.tiny else 20)
    args.max_new_tokens = args.max_new_tokens or (16 if args.tiny else 96)
    args.limit = args.limit or (2 if args.tiny else 20)
    measured = begin("bench/posttrain_trl.py", args.noisy)

    from kiln.cli import main as kiln_main
    from kiln.loading import load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sft, chat = build_tiny(out / "tiny") if args.tiny else (Path(args.sft), Path(args.chat))
    hf = out / "hf-sft"
    if kiln_main(["export", str(sft), "--hf", str(hf), "--force"]) != 0:
        raise SystemExit(f"bench/posttrain_trl.py: kiln export {sft} failed")
    block = load_model(sft, dtype="fp32").model.cfg.block_size
    evaluate = lambda model: chat_success(model, chat, args.limit, args.max_new_tokens)  # noqa: E731
    results: dict[str, Any] = {"settings": vars(args), "sft": evaluate(sft)}
    if "grpo" in args.methods:
        kiln_run, kiln_s = timed(lambda: kiln_grpo(args, sft, chat, out / "kiln-grpo"))
        trl_run, trl_s = timed(lambda: trl_grpo(args, hf, chat, out, block))
        results["grpo"] = {"kiln": {**evaluate(kiln_run), "seconds": kiln_s},
                           "trl": {**evaluate(trl_run), "seconds": trl_s}}  # fmt: skip
    if "dpo" in args.methods:
        if args.tiny:
            pairs = reference_pairs(chat, out, 64)
        else:
            prefs = out / "prefs"
            kiln_main(["posttrain", "preferences", str(sft), str(chat), str(prefs), "--samples",
                       "4", "--max-new-tokens", str(args.max_new_tokens), "--max-prompts",
                       str(args.pref_prompts), "--seed", str(args.seed), "--force",
                       "--no-progress"])  # fmt: skip
            pairs = prefs / "pairs.jsonl"
        pairs = fitting_pairs(pairs, sft, out)
        kiln_run, kiln_s = timed(lambda: kiln_dpo(args, sft, pairs, out / "kiln-dpo"))
        trl_run, trl_s = timed(lambda: trl_dpo(args, hf, pairs, out, block))
        results["dpo"] = {"kiln": {**evaluate(kiln_run), "seconds": kiln_s},
                          "trl": {**evaluate(trl_run), "seconds": trl_s}}  # fmt: skip
    write_json_atomic(out / "results.json", measured.stamp(results))
    print(table(results))
    print(measured.line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
