"""Distilled vs from-scratch student at equal CPU time (issue #30), side by side in one run.

    python bench/distill.py OUT --equal-cpu --teacher /tmp/quiet/q/demo --seeds 0,1 [--budget 150]

The teacher (any model folder kiln.loading reads; its dataset: --data, else TEACHER/data) runs
once over the train split into top-k shards (`kiln distill --precompute-topk`: ids, log-probs at
τ, tail mass), timed in process CPU seconds (P). Then, per seed, in separate processes of
--threads torch threads each, at the same time:

- distilled: configs/distill.toml's half-width student on the K + 1 bucket KL from the shards
  (weight 1 − α) plus the next-token cross-entropy (weight α), for --budget CPU seconds;
- scratch: the same shape (kiln/assets/demo.toml at configs/distill.toml's width) trained by
  `kiln train`'s own loss for the same CPU seconds;
- scratch + P (with --included): from scratch for --budget + P CPU seconds, the teacher's
  precompute charged to the one student that used it.

Budgets count the process's CPU time (`time.process_time`, as bench/speedrun.py --clock cpu), so
other jobs on the machine do not bias the race; the schedule (WSD) is planned from the measured
step time as in any budgeted run. Each arm is scored by the trainer's val loss over the same
val windows, printed in nats/token and bits per byte. The gap is scratch − distilled in bpb
(positive: distillation wins), per seed and its mean.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._load import add_noisy_flag, begin  # noqa: E402
from kiln.io import write_json_atomic  # noqa: E402

COMMON = [
    "logging.progress=false", "eval.sample_tokens=0", "eval.batches=16", "eval.every=1000000",
    "checkpoint.every=0", "logging.every=100", "train.max_steps=none", "data.seq_len=256",
]  # fmt: skip
# configs/distill.toml's student shape, on demo.toml (the teacher's recipe) for the scratch arm.
STUDENT = ["model.n_embd=160", "model.head_dim=40", "model.ff_multiple=32"]


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One arm in this process: precompute the shards, or train a student; what it measured."""
    import torch

    torch.set_num_threads(spec["threads"])
    from kiln.posttrain.distill import build_trainer, load_distill_config, precompute_topk
    from kiln.train.config import load_train_config
    from kiln.train.trainer import Trainer

    if spec["kind"] == "precompute":
        cfg = load_distill_config(ROOT / "configs" / "distill.toml", spec["sets"])
        if Path(cfg.distill.topk_dir).exists():  # their cost is known only when made here
            raise SystemExit(f"{cfg.distill.topk_dir}: shards with no recorded CPU cost; remove it")
        t0 = time.process_time()
        made = precompute_topk(cfg, spec["k"], force=False)
        return {"precompute_cpu_s": round(time.process_time() - t0, 1), "windows": made["windows"],
                "bytes": made["bytes"]}  # fmt: skip
    run = Path(spec["run_dir"])
    if spec["kind"] == "distilled":
        cfg = load_distill_config(ROOT / "configs" / "distill.toml", spec["sets"])
        trainer = build_trainer(cfg, run, clock=time.process_time)
    else:
        cfg = load_train_config(ROOT / "kiln" / "assets" / "demo.toml", spec["sets"])
        trainer = Trainer(cfg, run, clock=time.process_time)
    wall = time.perf_counter()
    result = trainer.run()
    wall = time.perf_counter() - wall
    if result.interrupted:  # a stopped arm's numbers are not its budget's
        raise SystemExit(f"{spec['name']}: interrupted at step {result.step}")
    val = result.val_loss if result.val_loss is not None else trainer.evaluate()
    return {
        "steps": result.step, "tokens": result.tokens, "val_loss": round(float(val), 4),
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "train_cpu_s": round(trainer.train_seconds, 1), "wall_s": round(wall, 1),
    }  # fmt: skip


def launch(spec: dict[str, Any], out: Path) -> subprocess.Popen[bytes]:
    """Start one arm as `python bench/distill_cpu.py --child SPEC.json` (its log beside it)."""
    path = out / f"{spec['name']}.spec.json"
    path.write_text(json.dumps(spec))
    log = open(out / f"{spec['name']}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(path)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def finish(procs: dict[str, subprocess.Popen[bytes]], out: Path) -> dict[str, dict[str, Any]]:
    """Wait for the arms; each one's result, or exit naming the arm and its log."""
    results = {}
    for name, proc in procs.items():
        if proc.wait() != 0:
            tail = (out / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise SystemExit(f"bench/distill_cpu.py: arm {name} failed ({out / f'{name}.log'}): "
                             + " | ".join(tail))  # fmt: skip
        results[name] = json.loads((out / f"{name}.result.json").read_text())
    return results


def train_prefix(data: Path, tokens: int, out: Path) -> Path:
    """A dataset of `data`'s first documents (about `tokens` train tokens) and its whole val split.

    A smaller train split makes the students run several epochs, over which the teacher's shards
    are amortised; the val split is `data`'s own (the same held-out windows as its teacher's).
    """
    import dataclasses
    import shutil

    import numpy as np

    from kiln.data import Dataset
    from kiln.data.manifest import SourceEntry
    from kiln.data.shard_writer import ShardWriter

    if (out / "manifest.json").is_file():
        return out
    full = Dataset.open(str(data))
    train = full.split("train")
    if tokens >= train.n_tokens:
        raise SystemExit(f"--train-tokens {tokens:,}: {data} holds only {train.n_tokens:,}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    manifest = full.manifest
    writer = ShardWriter(tmp, "train", np.dtype(manifest.dtype), 1 << 40)
    docs, kept = 0, 0
    while kept < tokens:
        doc = train.document(docs)
        writer.add(doc, 0)
        docs, kept = docs + 1, kept + len(doc)
    entry = writer.close()
    for shard in manifest.splits["val"].shards:
        for suffix in (".bin", ".idx"):
            shutil.copy(data / f"{shard.name}{suffix}", tmp / f"{shard.name}{suffix}")
    val = manifest.splits["val"]
    source = SourceEntry(path=f"{data} (train prefix)", documents={"train": docs,
                         "val": val.documents}, tokens={"train": kept, "val": val.tokens})  # fmt: skip
    config = {"train_prefix_of": str(data), "train_tokens": kept}
    splits = {"train": entry, "val": val}
    dataclasses.replace(manifest, splits=splits, sources=(source,), config=config).write(tmp)
    tmp.rename(out)
    return out


def bytes_per_token(dataset: Path) -> float:
    """Bytes of text per token on the dataset's val split (to turn nats/token into bpb)."""
    from kiln.data import Dataset
    from kiln.tokenizer.formats import read_any

    data = Dataset.open(str(dataset))
    entry = data.manifest.tokenizer
    path = entry.locate(dataset)
    if path is None:
        raise SystemExit(f"{dataset}: its tokenizer {entry.path} is gone; bpb needs it")
    val = data.split("val")
    ids = val.read(0, val.n_tokens).tolist()
    return len(read_any(path).decode_bytes(ids)) / len(ids)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The race's flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--teacher", type=Path, required=True, help="the teacher's model folder")
    p.add_argument("--data", type=Path, default=None, help="token shards (TEACHER/data)")
    p.add_argument(
        "--train-tokens",
        type=int,
        default=100_000,
        help="train on the first N tokens of the data's train split only (0: all)",
    )
    p.add_argument("--budget", type=float, default=90.0, help="CPU seconds per student")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--alpha", type=float, default=0.0, help="CE weight (KL weight 1 − α)")
    p.add_argument("--dtype", default="auto", choices=["fp32", "bf16", "auto"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per student")
    p.add_argument(
        "--included",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also scratch for budget + P (the shards' cost charged to one student)",
    )
    p.add_argument("--set", action="append", default=[], help="override for both students")
    p.add_argument("--distill-set", action="append", default=[], help="for the distilled one")
    p.add_argument("--tag", default="", help="names this configuration's run folders")
    add_noisy_flag(p)
    return p.parse_args(argv)


def shards_cost(args: argparse.Namespace, sets: list[str], topk_dir: Path) -> dict[str, Any]:
    """Write (or reuse) the teacher's top-k shards; their precompute CPU seconds, measured once."""
    cost_file = args.out / f"{topk_dir.name}.cpu.json"
    if not cost_file.is_file():
        # One thread: a multi-threaded run on a busy machine bills its spin-waits as CPU time.
        pre = {"name": f"precompute_{topk_dir.name}", "kind": "precompute", "k": args.topk,
               "sets": sets, "threads": 1}  # fmt: skip
        cost = finish(run_arms([pre], args.out), args.out)[pre["name"]]
        write_json_atomic(cost_file, cost)
    return json.loads(cost_file.read_text())


def run_arms(specs: list[dict[str, Any]], out: Path) -> dict[str, subprocess.Popen[bytes]]:
    """Start every arm not already raced with the same spec, all at once (CPU clocks: fair)."""
    procs = {}
    for spec in specs:
        done = out / f"{spec['name']}.result.json"
        old = out / f"{spec['name']}.spec.json"
        if done.is_file() and old.is_file() and json.loads(old.read_text()) == spec:
            continue
        procs[spec["name"]] = launch(spec, out)
    return procs


def main(argv: list[str] | None = None) -> int:
    """Precompute (or reuse) the shards, race every seed's arms at once, print the gaps."""
    if argv is None and sys.argv[1:2] == ["--child"]:
        spec = json.loads(Path(sys.argv[2]).read_text())
        result = child(spec)
        write_json_atomic(Path(sys.argv[2]).with_name(f"{spec['name']}.result.json"), result)
        return 0
    args = parse(argv)
    measured = begin("bench/distill_cpu.py", args.noisy)
    data = args.data or args.teacher / "data"
    if not (data / "manifest.json").is_file():
        raise SystemExit(f"--data {data}: no token shards (manifest.json) there")
    args.out.mkdir(parents=True, exist_ok=True)
    prefix = f"n{args.train_tokens}_" if args.train_tokens else ""
    if args.train_tokens:
        data = train_prefix(data, args.train_tokens, args.out / f"data_{prefix[:-1]}")
    bpt = bytes_per_token(data)
    topk_dir = args.out / f"{prefix}topk_k{args.topk}_tau{args.tau:g}"
    base = [*COMMON, f"data.dataset={data}", f"train.dtype={args.dtype}", *args.set]
    shard_sets = [*base, f"distill.teacher={args.teacher}", f"distill.topk_dir={topk_dir}",
                  f"distill.temperature={args.tau:g}"]  # fmt: skip
    cost = shards_cost(args, shard_sets, topk_dir)
    print(json.dumps(measured.stamp({"topk_shards": str(topk_dir), **cost})), flush=True)
    P, alpha = cost["precompute_cpu_s"], args.alpha
    distilled = [*shard_sets, f"distill.topk={args.topk}", f"distill.kl_weight={1 - alpha:g}",
                 f"distill.ce_weight={alpha:g}", *args.distill_set]  # fmt: skip
    scratch = [*base, *STUDENT]
    tag = prefix + (args.tag or f"k{args.topk}_tau{args.tau:g}_a{alpha:g}")
    seeds = [int(x) for x in args.seeds.split(",") if x]
    plan: dict[tuple[int, str], dict[str, Any]] = {}
    for seed in seeds:
        arms = {"distilled": (f"{tag}_distilled", "distilled", distilled, args.budget),
                "scratch": (f"{prefix}scratch", "scratch", scratch, args.budget)}  # fmt: skip
        if args.included:
            arms["scratch+P"] = (f"{prefix}scratch", "scratch", scratch, args.budget + P)
        for role, (name, kind, sets, budget) in arms.items():
            plan[seed, role] = {
                "name": f"{name}_s{seed}_b{budget:g}", "kind": kind, "threads": args.threads,
                "run_dir": str(args.out / f"{name}_s{seed}_b{budget:g}"),
                "sets": [*sets, f"train.seed={seed}", f"train.time_budget={budget:g}s"],
            }  # fmt: skip
    finish(run_arms(list(plan.values()), args.out), args.out)
    got = {}
    for (seed, role), spec in plan.items():
        r = {"arm": spec["name"], "role": role, "seed": seed,
             **json.loads((args.out / f"{spec['name']}.result.json").read_text())}  # fmt: skip
        r["bpb"] = round(r["val_loss"] / math.log(2) / bpt, 4)
        got[seed, role] = r
        print(json.dumps(measured.stamp(r)), flush=True)
    report(measured, args, P, seeds, got)
    plot(got, seeds, args.out / "distill_cpu.png")
    print(f"wrote {args.out / 'distill_cpu.png'}")
    return 0


def plot(got: dict[Any, Any], seeds: list[int], path: Path) -> None:
    """Bits per byte of each arm per seed, side by side (lower is better)."""
    from kiln.plotting import pyplot, save_png

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    roles = [r for r in ("distilled", "scratch", "scratch+P") if (seeds[0], r) in got]
    width = 0.8 / len(roles)
    for j, role in enumerate(roles):
        xs = [i + j * width for i in range(len(seeds))]
        values = [got[seed, role]["bpb"] for seed in seeds]
        ax.bar(xs, values, width, label=role)
        for x, v in zip(xs, values, strict=True):
            ax.text(x, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([i + width * (len(roles) - 1) / 2 for i in range(len(seeds))],
                  [f"seed {s}" for s in seeds])  # fmt: skip
    low = min(r["bpb"] for r in got.values())
    ax.set_ylim(low * 0.95, None)
    ax.set_ylabel("val bits per byte (lower is better)")
    ax.set_title("Distilled student vs the same student from scratch, equal CPU time")
    ax.legend()
    save_png(fig, path)


def report(
    measured: Any, args: argparse.Namespace, P: float, seeds: list[int], got: dict[Any, Any]
) -> None:
    """The table: per seed the bpb of each arm and the gaps, then their mean."""
    print(measured.line())
    print(f"distilled: top-{args.topk}, τ={args.tau:g}, α={args.alpha:g} "
          f"{' '.join(args.distill_set)}| {args.budget:g} CPU s per student, shards "
          f"(P) {P:g} CPU s")  # fmt: skip
    print("| seed | distilled bpb | scratch bpb | gap, P excluded | scratch + P bpb "
          "| gap, P included |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    gaps: dict[str, list[float]] = {"excluded": [], "included": []}
    for seed in seeds:
        d, s, sp = got[seed, "distilled"]["bpb"], got[seed, "scratch"]["bpb"], None
        gaps["excluded"].append(s - d)
        if (seed, "scratch+P") in got:
            sp = got[seed, "scratch+P"]["bpb"]
            gaps["included"].append(sp - d)
        plus = f"{sp:.4f} | {sp - d:+.4f}" if sp is not None else "- | -"
        print(f"| {seed} | {d:.4f} | {s:.4f} | {s - d:+.4f} | {plus} |")
    mean = {k: round(sum(v) / len(v), 4) for k, v in gaps.items() if v}
    print(json.dumps(measured.stamp({"mean_gap_bpb": mean, "seeds": len(seeds),
                                     "positive": "distillation better"})))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
