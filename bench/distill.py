"""Distillation and pruning against training from scratch, side by side in one run.

    python bench/distill.py OUT [--teacher-steps 300] [--student-steps 200] [--seeds 0] [--noisy]

1. A 1,024-token BPE and shards from the first --chars of TinyStories (shared data).
2. Teacher: the demo recipe (kiln/assets/demo.toml, 4 x 256) for --teacher-steps steps.
3. Student (configs/distill.toml's half-width shape): `kiln distill` from the teacher vs the same
   shape trained from scratch, the same steps and for the distilled run's training seconds, per
   seed; with --topk K from the teacher's top-K logits written once into shards (their cost
   printed as `topk_shards_s`), so that a distillation step is not also a teacher forward.
4. `kiln prune` the teacher to about half its parameters; heal by distillation for 20% of the
   teacher's steps, vs the same shape from scratch for those steps.

Prints one JSON line per run (val loss in nats/token, bits per byte, parameters, train seconds)
and a markdown table. Under load the times are noisy; the losses are not (fp32, fixed seeds).

--equal-cpu (issue #30) instead races a given teacher's top-k student against the same student
from scratch for the same *CPU* seconds (bench/distill_cpu.py; process time, 1 thread each, side
by side), with the teacher's shard precompute excluded and included:

    python bench/distill.py OUT --equal-cpu --teacher /tmp/quiet/q/demo --seeds 0,1
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._load import add_noisy_flag, begin  # noqa: E402

SHARED = ROOT.parent / "shared" / "data" / "tinystories"
COMMON = [
    "train.time_budget=none", "train.dtype=fp32", "logging.progress=false", "eval.batches=8",
    "checkpoint.keep_last=1", "logging.every=50",
]  # fmt: skip


def dataset(out: Path, chars: int) -> tuple[Path, float]:
    """(the shards, bytes per token of the val split)."""
    from kiln.data import Dataset
    from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
    from kiln.tokenizer import Tokenizer, train_bpe
    from kiln.tokenizer.special import EOT

    shards = out / "shards"
    if not (shards / "manifest.json").is_file():
        with gzip.open(SHARED / "train.txt.gz", "rt", encoding="utf-8") as handle:
            text = handle.read(chars)
        corpus = out / "stories.txt"
        corpus.write_text(text[: text.rfind(EOT) + len(EOT)], encoding="utf-8")
        train_bpe(corpus, 1024, special_tokens=[EOT], workers=1).save(out / "tok.json")
        tokenize_to_shards(
            TokenizeConfig(
                tokenizer=str(out / "tok.json"), inputs=(str(corpus),), out=str(shards),
                val_docs=150, workers=1, progress=False,
            )
        )  # fmt: skip
    tok = Tokenizer.load(out / "tok.json")
    val = Dataset.open(str(shards)).split("val")
    ids = val.read(0, val.n_tokens).tolist()
    return shards, len(tok.decode_bytes(ids)) / len(ids)


def train(run: Path, sets: list[str]) -> dict[str, Any]:
    """`kiln train` with the demo recipe and `sets`; its last metrics record."""
    from kiln.train.config import load_train_config
    from kiln.train.trainer import Trainer

    cfg = load_train_config(ROOT / "kiln" / "assets" / "demo.toml", [*COMMON, *sets,
                            f"logging.run_dir={run}"])  # fmt: skip
    trainer = Trainer(cfg, run)
    trainer.run()
    return summary(run, trainer)


def distill(
    run: Path, sets: list[str], before: list[float] | None = None, config: str = "distill"
) -> dict[str, Any]:
    """`kiln distill configs/distill.toml` with `sets`; its last metrics record.

    `before` gets the student's val loss before its first step (a pruned model unhealed).
    """
    from kiln.posttrain.distill import build_trainer, load_distill_config

    cfg = load_distill_config(ROOT / "configs" / f"{config}.toml", [*COMMON, *sets,
                              f"logging.run_dir={run}"])  # fmt: skip
    started = time.perf_counter()
    trainer = build_trainer(cfg, run)  # with distill.topk: writes the teacher's shards if missing
    setup_s = time.perf_counter() - started
    if before is not None:
        before.append(trainer.evaluate())
    trainer.run()
    return {**summary(run, trainer), "setup_s": round(setup_s, 1)}


def summary(run: Path, trainer: Any) -> dict[str, Any]:
    """What the table shows of a finished run."""
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "val_loss" in r][-1]
    params = sum(p.numel() for p in trainer.model.parameters())
    return {"run": run.name, "steps": last["step"], "val_loss": last["val_loss"],
            "params": params, "train_s": round(last["train_s"], 1)}  # fmt: skip


def decode_speed(folder: Path, new_tokens: int = 128) -> float:
    """Greedy decode tokens/s of a model folder, batch 1, after one warm-up call."""
    import time

    from kiln.loading import load_model
    from kiln.model.generate import generate

    loaded = load_model(folder, dtype="fp32")
    prompt = [loaded.tokenizer.encode("Once upon a time")]  # type: ignore[union-attr]
    generate(loaded.model, prompt, 8, temperature=0.0)
    t0 = time.perf_counter()
    out = generate(loaded.model, prompt, new_tokens, temperature=0.0)
    return round(len(out[0]) / (time.perf_counter() - t0), 1)


def steps(n: int) -> list[str]:
    """A run of exactly n steps, evaluated and saved at its end."""
    return [f"train.max_steps={n}", f"eval.every={n}", f"checkpoint.every={n}"]


def main() -> int:
    """Run every arm, print JSON lines and the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--chars", type=int, default=2_000_000)
    p.add_argument("--teacher-steps", type=int, default=300)
    p.add_argument("--student-steps", type=int, default=200)
    p.add_argument("--seeds", default="0")
    p.add_argument("--width", type=int, default=256, help="the teacher's n_embd (demo: 256)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument(
        "--topk", type=int, default=0,
        help="distil from the teacher's top-K logits precomputed once into shards (distill.topk), "
        "so a distillation step costs about a scratch step; 0: the online teacher",
    )  # fmt: skip
    if "--equal-cpu" in sys.argv[1:]:  # the other race, with its own flags
        from bench.distill_cpu import main as equal_cpu

        return equal_cpu([a for a in sys.argv[1:] if a != "--equal-cpu"])
    add_noisy_flag(p)
    args = p.parse_args()
    measured = begin("bench/distill.py", args.noisy)
    args.out.mkdir(parents=True, exist_ok=True)
    shards, bytes_per_token = dataset(args.out, args.chars)
    micro = args.batch_tokens // args.seq_len
    data = [f"data.dataset={shards}", f"data.seq_len={args.seq_len}",
            f"batch.global_tokens={args.batch_tokens}", f"batch.micro_batch={micro}"]  # fmt: skip
    width = [f"model.n_embd={args.width}"]
    small = args.width * 5 // 8  # the demo's 256 -> configs/distill.toml's 160
    student = [f"model.n_embd={small}", f"model.head_dim={small // 4}", "model.ff_multiple=32"]
    rows: list[dict[str, Any]] = []

    def record(arm: str, result: dict[str, Any]) -> None:
        result = {"arm": arm, **result}
        result["bpb"] = round(result["val_loss"] / math.log(2) / bytes_per_token, 4)
        rows.append(result)
        print(json.dumps(measured.stamp(result)), flush=True)

    teacher = args.out / "teacher"
    if not (teacher / "checkpoints" / "latest").exists():
        record("teacher", train(teacher, [*data, *width, *steps(args.teacher_steps)]))
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        seeded = [*data, *steps(args.student_steps), f"train.seed={seed}"]
        record(f"student scratch s{seed}", train(args.out / f"scratch{seed}", [*seeded, *student]))
        topk = [f"distill.topk={args.topk}"] if args.topk else []
        distilled = distill(
            args.out / f"distilled{seed}",
            [*seeded, *student, f"distill.teacher={teacher}", *topk],
        )
        if args.topk and distilled["setup_s"] > 5:  # the first distilled arm wrote the shards
            print(json.dumps(measured.stamp({"topk_shards_s": distilled["setup_s"],
                                             "k": args.topk})), flush=True)  # fmt: skip
        record(f"student distilled{f' top-{args.topk}' if args.topk else ''} s{seed}", distilled)
        budget = [*data, f"train.seed={seed}", f"train.time_budget={max(distilled['train_s'], 0.1)}s",
                  f"train.max_steps={10 * args.student_steps}", "eval.every=1000000",
                  "checkpoint.every=1000000"]  # fmt: skip
        record(f"student scratch, distilled's time s{seed}",
               train(args.out / f"scratch_time{seed}", [*budget, *student]))  # fmt: skip
    from kiln.posttrain.prune import PruneTargets, prune_to_folder

    pruned = args.out / "pruned"
    from kiln.loading import load_model

    ff = load_model(teacher, dtype="fp32").model.cfg.ff_size
    d_ff = ff * 6 // 11 // 8 * 8  # the demo's 704 -> 384: with 3 of 4 blocks, about half
    targets = PruneTargets(n_layer=3, d_ff=d_ff)
    print(prune_to_folder(teacher, pruned, targets, str(shards), 8, 256, force=True), flush=True)
    heal = max(1, args.teacher_steps // 5)
    unhealed: list[float] = []
    healed = distill(args.out / "healed", [*data, *steps(heal),
           f"distill.teacher={teacher}", f"distill.student={pruned}"], unhealed, "heal")  # fmt: skip
    record("pruned, no heal", {**healed, "steps": 0, "val_loss": unhealed[0], "train_s": 0})
    record("pruned + heal (distill)", healed)
    shape = [*width, "model.n_layer=3", f"model.d_ff={d_ff}"]
    record(
        "pruned shape, scratch", train(args.out / "pruned_scratch", [*data, *steps(heal), *shape])
    )
    speeds = {"teacher": decode_speed(teacher), "healed": decode_speed(args.out / "healed")}
    print(json.dumps(measured.stamp({"decode_tokens_per_s": speeds})), flush=True)
    print(measured.line())
    print("| arm | params | steps | val loss (nats/token) | bpb | train s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['arm']} | {r['params']:,} | {r['steps']} | {r['val_loss']:.4f} | "
              f"{r['bpb']:.4f} | {r['train_s']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
