"""The distilled student as a draft model: its acceptance rate against the teacher in the engine.

    .venv/bin/python bench/distill_draft.py OUT --teacher runs/demo            # ~6 min, 2 cores
    .venv/bin/python bench/distill_draft.py OUT --teacher runs/demo --tiny --noisy

1. `kiln distill` (configs/distill.toml: the demo's shape at half width) from --teacher on the
   teacher's own dataset for --minutes of training time.
2. The same student shape trained from scratch (`kiln train`) for exactly as many steps (the
   peer: what distillation buys a draft model at equal data).
3. The teacher decodes --prompts TinyStories openings (the first 32 tokens of the first val
   documents), greedy, --new-tokens each, in the engine with each drafter (`kiln serve --draft`'s
   ModelDrafter, k = 4 draft tokens, speculating at any batch size): the distilled student, the
   scratch student, and prompt lookup (ngram). Acceptance = accepted / drafted tokens, from the
   engine's counters; the outputs are checked equal to the plain engine's (greedy is lossless).

Prints one JSON line per drafter, a markdown table and the distilled/scratch acceptance ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._load import add_noisy_flag, begin  # noqa: E402

TINY = ["model.n_layer=2", "model.n_embd=64", "model.head_dim=16", "model.n_head=4",
        "model.n_kv_head=2", "data.seq_len=128", "eval.batches=2", "batch.global_tokens=1024"]  # fmt: skip


def teacher_dataset(teacher: Path) -> str:
    """The dataset the teacher run trained on (its resolved config.toml)."""
    cfg = tomllib.loads((teacher / "config.toml").read_text())
    return cfg["data"]["dataset"]


def students(args: argparse.Namespace, data: str) -> tuple[Path, Path, int]:
    """(the distilled run, the scratch run, their steps)."""
    from kiln.posttrain.distill import build_trainer, load_distill_config
    from kiln.train.config import TrainConfig
    from kiln.train.trainer import Trainer

    common = [f"data.dataset={data}", "logging.progress=false", "checkpoint.every=0",
              "eval.sample_tokens=0", "eval.every=0", "train.dtype=fp32",
              *(TINY if args.tiny else [])]  # fmt: skip
    length = [f"train.max_steps={args.steps}", "train.time_budget=none"] if args.steps else [
        f"train.time_budget={args.minutes * 60:.0f}", "train.max_steps=100000"]  # fmt: skip
    runs = {name: args.out / name for name in ("distilled", "scratch")}
    for run in runs.values():
        if run.exists():
            shutil.rmtree(run)  # this script's own bench runs, remade each time
    cfg = load_distill_config(ROOT / "configs" / "distill.toml", [
        f"distill.teacher={args.teacher}", f"logging.run_dir={runs['distilled']}", *common,
        *length])  # fmt: skip
    distilled = build_trainer(cfg, runs["distilled"]).run()
    print(f"distilled: {distilled.step} steps, val loss {distilled.val_loss:.4f}", flush=True)
    # the same sections ([model], schedule, data order), next-token loss alone, as many steps
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)}
    scratch_cfg = dataclasses.replace(
        TrainConfig(**base),
        train=dataclasses.replace(cfg.train, max_steps=distilled.step, time_budget=None),
        logging=dataclasses.replace(cfg.logging, run_dir=str(runs["scratch"])),
    )
    scratch = Trainer(scratch_cfg, runs["scratch"]).run()
    print(f"scratch: {scratch.step} steps, val loss {scratch.val_loss:.4f}", flush=True)
    return runs["distilled"], runs["scratch"], distilled.step


def prompts(tokenizer: Any, n: int, length: int = 32) -> list[list[int]]:
    """The first `length` tokens of the first n TinyStories val documents of >= length tokens."""
    import gzip

    from kiln.tokenizer.special import EOT

    path = ROOT.parent / "shared" / "data" / "tinystories" / "valid.txt.gz"
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        text = handle.read(400_000)
    out = []
    for doc in text.split(EOT):
        ids = tokenizer.encode(doc.strip())
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            break
    return out


def decode(teacher: Any, drafter: Any, ps: list[list[int]], new: int, k: int) -> dict[str, Any]:
    """Greedy decode of every prompt by the teacher with `drafter`; acceptance and outputs."""
    from kiln.serve.engine import Engine, EngineConfig, SamplingParams

    config = EngineConfig(batch_invariant=False, max_num_seqs=len(ps), speculative_k=k,
                          speculative_max_batch=1 << 20, prefix_caching=False)  # fmt: skip
    engine = Engine.from_loaded(teacher, config, drafter=drafter)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    handles = [engine.submit(p, params) for p in ps]
    while not all(h.done for h in handles):
        engine.step()
    seconds = time.perf_counter() - started
    stats = engine.stats()
    return {
        "acceptance": stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else None,
        "drafted": stats.draft_tokens, "accepted": stats.accepted_tokens,
        "tokens_per_s": engine.generated_tokens / seconds,
        "outputs": [h.result()[0].token_ids for h in handles],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Distil, train the peer, decode with each drafter; print the table and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--teacher", type=Path, required=True, help="the demo model's run folder")
    parser.add_argument("--minutes", type=float, default=2.0, help="distillation training time")
    parser.add_argument("--steps", type=int, help="train this many steps instead of --minutes")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--tiny", action="store_true", help="a 2 × 64 student, 20 steps, 4 prompts")
    add_noisy_flag(parser)
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps = args.steps or 20
        args.prompts, args.new_tokens = min(args.prompts, 4), min(args.new_tokens, 24)
    measured = begin("bench/distill_draft.py", args.noisy)
    import torch

    from kiln.loading import load_model
    from kiln.serve.engine.drafters import LookupDrafter, ModelDrafter

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    args.out.mkdir(parents=True, exist_ok=True)
    distilled, scratch, steps = students(args, teacher_dataset(args.teacher))
    teacher = load_model(args.teacher, dtype="fp32")
    ps = prompts(teacher.tokenizer, args.prompts)
    plain = decode(teacher, None, ps, args.new_tokens, args.k)
    rows: dict[str, dict[str, Any]] = {}
    for name, make in (
        ("distilled student", lambda: ModelDrafter(load_model(distilled, dtype="fp32").model)),
        ("scratch student", lambda: ModelDrafter(load_model(scratch, dtype="fp32").model)),
        ("ngram (prompt lookup)", LookupDrafter),
    ):
        row = decode(teacher, make(), ps, args.new_tokens, args.k)
        assert row.pop("outputs") == plain["outputs"], f"{name}: greedy output changed"
        rows[name] = row
        print(json.dumps({"drafter": name, **row}), flush=True)
    print(f"\nteacher {args.teacher}; students {steps} steps each; {len(ps)} prompts × "
          f"{args.new_tokens} greedy tokens, k = {args.k}\n")  # fmt: skip
    print("| drafter | acceptance | drafted | accepted | tokens/s |")
    print("|---|---|---|---|---|")
    print(f"| none | - | - | - | {plain['tokens_per_s']:.1f} |")
    for name, r in rows.items():
        print(f"| {name} | {r['acceptance']:.3f} | {r['drafted']} | {r['accepted']} | "
              f"{r['tokens_per_s']:.1f} |")  # fmt: skip
    ratio = rows["distilled student"]["acceptance"] / rows["scratch student"]["acceptance"]
    print(f"\ndistilled / scratch acceptance: {ratio:.3f}")
    print(measured.line())
    from kiln.io import write_json_atomic

    write_json_atomic(args.out / "distill_draft.json", measured.stamp({
        "teacher": str(args.teacher), "steps": steps, "k": args.k, "rows": rows,
        "plain_tokens_per_s": plain["tokens_per_s"], "ratio": ratio}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
