"""CPU speedrun (issue 18): the best TinyStories model a 2-core CPU trains in a time budget.

Metric (docs/speedrun.md): bits per byte over the whole of ../shared/data/tinystories/valid.txt.gz
by `kiln.eval.lm.stream_bits_per_byte` (every byte of the file counted, the stories read as one
stream with the end-of-text token after each, every token after the first scored once, disjoint
windows of the block size). Tuning reads the same metric on a held-out split of the *training*
stories (every 50th story, never trained on); the valid file is scored only with --valid (once
per record).

Each recipe trains with kiln's Trainer for --budget seconds of training steps (`train.time_budget`:
evaluation and checkpoints excluded; the schedule is planned from the measured step time). The
recipes of one invocation run side by side, each in its own process with --threads torch threads,
so the ratio to the baseline is measured on the same machine at the same time. Tokenizer training
and tokenization are timed separately (and cached under --cache).

- the candidate: kiln/assets/demo.toml (the demo's recipe), with --set overrides;
- --variant NAME:KEY=V;KEY=V: more candidates, each demo.toml with its overrides (the key `vocab`
  picks the tokenizer's vocabulary size, `threads` the torch threads of that run);
- --baseline: the GPT-2/nanoGPT recipe in kiln (4 layers, 4 heads, width 256, learned positions,
  LayerNorm, GELU, tied head, GPT-2's BPE, fp32, AdamW lr 1e-3 with 100 warmup steps and cosine
  to 1e-4, betas (0.9, 0.95), weight decay 0.1, batch 16 x 256, grad clip 1).

--subset K trains on every K-th training story only (the tokenizer stays the full data's): at the
same compute that is K times the epochs, a cheap proxy for what a K times longer run does to a
data-bound recipe (round 7 in docs/speedrun.md). It also shrinks the data against the model, so it
exaggerates over-fitting: compare recipes within one subset, never across.

--clock cpu counts the budget in the process's CPU seconds instead of wall seconds: on a machine
other jobs load, a 1-thread run then gets the training a quiet core would give it in that time
(used for screening; records use the wall clock). Every run appends one JSON line to --log.

    .venv/bin/python bench/speedrun.py --baseline --valid --label "record"          # 10 min each
    .venv/bin/python bench/speedrun.py --budget 90 --clock cpu --baseline \\
        --variant "muon:optim.name=muon;optim.lr=0.02" --label "screening"
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import MAX_START_LOAD, add_noisy_flag, begin
from kiln.io import atomic_write

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
TRAIN_TEXT = SHARED / "tinystories" / "train.txt.gz"
VALID_TEXT = SHARED / "tinystories" / "valid.txt.gz"
GPT2_DIR = SHARED / "gpt2"
DEFAULT_CACHE = Path("/tmp/kiln-speedrun")
DEFAULT_LOG = ROOT / "bench" / "speedrun_log.jsonl"
HOLDOUT_EVERY = 50  # every 50th training story is held out for tuning (2%)
EOT = "<|endoftext|>"

GPT2_MODEL: dict[str, Any] = dict(
    block_size=256, n_layer=4, n_head=4, n_embd=256, vocab_multiple=64,
    pos_emb="learned", norm="layernorm", bias=True, mlp="gelu", tie_embeddings=True,
)  # fmt: skip
BASELINE_SETTINGS = [
    "optim.name=adamw", "optim.lr=1e-3", "optim.betas=[0.9, 0.95]", "optim.weight_decay=0.1",
    "schedule.name=warmup_cosine", "schedule.warmup_steps=100", "schedule.min_lr_ratio=0.1",
    "batch.global_tokens=4096", "batch.micro_batch=16", "data.seq_len=256", "train.dtype=fp32",
    "train.grad_clip=1.0",
]  # fmt: skip


# ---- data ---------------------------------------------------------------------------------------


def split_stories(cache: Path) -> tuple[Path, Path]:
    """train.txt (the stories trained on) and holdout.txt (every 50th story), written once."""
    from kiln.data.documents import iter_documents

    out = cache / "split"
    train, holdout = out / "train.txt", out / "holdout.txt"
    if not holdout.is_file():
        out.mkdir(parents=True, exist_ok=True)
        parts: tuple[list[str], list[str]] = ([], [])
        for i, story in enumerate(iter_documents(str(TRAIN_TEXT), EOT)):
            parts[i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1].append(f"{story}\n{EOT}\n")
        train.write_text("".join(parts[0]), encoding="utf-8")
        holdout.write_text("".join(parts[1]), encoding="utf-8")
    return train, holdout


def subset_stories(cache: Path, every: int) -> Path:
    """Every `every`-th story of train.txt (the first of each group), written once."""
    from kiln.data.documents import iter_documents

    train, _ = split_stories(cache)
    out = cache / "split" / f"train-every{every}.txt"
    if not out.is_file():
        stories = [s for i, s in enumerate(iter_documents(str(train), EOT)) if i % every == 0]
        with atomic_write(out) as handle:
            handle.write("".join(f"{story}\n{EOT}\n" for story in stories))
    return out


def prepare(cache: Path, tokenizer: str, subset: int = 1) -> dict[str, Any]:
    """Tokenizer (`gpt2` or a kiln BPE vocabulary size) and shards of the training stories.

    With subset K > 1 the shards hold every K-th training story, tokenized by the full data's
    tokenizer: K times the epochs at the same compute, a cheap proxy for a K times longer run.
    """
    from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
    from kiln.tokenizer import Tokenizer, train_bpe

    train, _ = split_stories(cache)
    root = cache / (f"tok-{tokenizer}" if subset == 1 else f"tok-{tokenizer}-every{subset}")
    info_path = root / "prepared.json"
    if info_path.is_file():
        return json.loads(info_path.read_text())
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if subset > 1:
        full = prepare(cache, tokenizer)
        tok = Tokenizer.load(Path(full["dir"]) / "tokenizer.json")
        train = subset_stories(cache, subset)
    elif tokenizer == "gpt2":
        tok = Tokenizer.from_gpt2(GPT2_DIR / "vocab.json", GPT2_DIR / "merges.txt")
    else:
        tok = train_bpe([train], int(tokenizer), [EOT], workers=2)
    tok.save(root / "tokenizer.json")
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    manifest = tokenize_to_shards(
        TokenizeConfig(
            tokenizer=str(root / "tokenizer.json"), inputs=(str(train),), out=str(root / "data"),
            val_docs=8, workers=2, progress=False, force=True,
        )
    )  # fmt: skip
    info = {
        "tokenizer": tokenizer, "vocab_size": tok.n_vocab,
        "tokenizer_s": round(tokenizer_s, 2), "tokenize_s": round(time.perf_counter() - t0, 2),
        "train_tokens": manifest.splits["train"].tokens, "dir": str(root), "subset": subset,
    }  # fmt: skip
    info_path.write_text(json.dumps(info) + "\n")
    return info


# ---- one recipe (a child process) ---------------------------------------------------------------


def recipe_config(spec: dict[str, Any], data_dir: Path) -> Any:
    """The TrainConfig of a recipe spec: demo.toml + overrides, or the baseline."""
    from kiln.demo import asset
    from kiln.train.config import load_train_config

    common = [f"data.dataset={data_dir}", "logging.progress=false", "checkpoint.every=0"]
    common += ["eval.sample_tokens=0", "eval.batches=0", "logging.every=25"]
    common += [f"train.time_budget={spec['budget']}", "train.max_steps=none"]
    if spec["baseline"]:
        cfg = load_train_config(asset("demo.toml"), [*common, *BASELINE_SETTINGS])
        return dataclasses.replace(cfg, model=dict(GPT2_MODEL))
    return load_train_config(spec.get("config") or asset("demo.toml"), [*common, *spec["set"]])


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one recipe for its budget and score the held-out (and valid) text."""
    import torch

    torch.set_num_threads(spec["threads"])
    from kiln.eval.lm import stream_bits_per_byte
    from kiln.eval.scoring import Scorer
    from kiln.tokenizer import Tokenizer
    from kiln.train.trainer import Trainer

    prep = spec["prep"]
    cfg = recipe_config(spec, Path(prep["dir"]) / "data")
    clock = time.process_time if spec["clock"] == "cpu" else time.perf_counter
    trainer = Trainer(cfg, spec["run_dir"], clock=clock)
    wall0 = time.perf_counter()
    result = trainer.run()
    wall = time.perf_counter() - wall0
    model = trainer.model.eval()
    tok = Tokenizer.load(Path(prep["dir"]) / "tokenizer.json")
    eot = tok.special_tokens[EOT]
    scorer = Scorer(model, batch_size=16, progress=False)  # fp32 weights, fp32 scoring
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "steps": result.step, "tokens": result.tokens,
        "train_s": round(trainer.train_seconds, 1), "train_wall_s": round(wall, 1),
        "tokens_per_s": round(result.tokens / trainer.train_seconds),
        "final_train_loss": round(result.losses[-1], 4) if result.losses else None,
        "dtype": trainer.precision.name,
    }  # fmt: skip
    _, holdout = split_stories(Path(spec["cache"]))
    with torch.no_grad():
        scored = stream_bits_per_byte(scorer, tok, holdout, eot)
        out["holdout_bpb"] = round(scored.bits_per_byte or 0.0, 4)
        if spec["valid"]:
            scored = stream_bits_per_byte(scorer, tok, VALID_TEXT, eot)
            out["valid_bpb"] = round(scored.bits_per_byte or 0.0, 4)
            out["valid_tokens"], out["valid_bytes"] = scored.n_tokens, scored.n_bytes
    return out


# ---- the invocation -----------------------------------------------------------------------------


def parse_variant(text: str, common: list[str]) -> tuple[str, list[str]]:
    """NAME:KEY=V;KEY=V -> (name, overrides)."""
    name, _, rest = text.partition(":")
    return name.strip(), [*common, *(s.strip() for s in rest.split(";") if s.strip())]


def plan_specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The recipes this invocation runs: candidate(s) then the baseline."""
    runs = [] if args.no_candidate else [(args.name, list(args.set))]
    runs += [parse_variant(v, args.set) for v in args.variant]
    specs = []
    for name, overrides in runs:
        extra = {
            k: v for k, _, v in (o.partition("=") for o in overrides) if k in ("vocab", "threads")
        }
        sets = [o for o in overrides if o.partition("=")[0] not in ("vocab", "threads")]
        specs.append({"name": name, "baseline": False, "set": sets, "config": args.config,
                      "tokenizer": extra.get("vocab", str(args.vocab)),
                      "threads": int(extra.get("threads", args.threads))})  # fmt: skip
    if args.baseline:
        specs.append({"name": "baseline (nanoGPT recipe)", "baseline": True, "set": [],
                      "config": None, "tokenizer": "gpt2", "threads": args.threads})  # fmt: skip
    return specs


def score_model(model: str) -> dict[str, Any]:
    """Valid bpb of a trained model folder (e.g. a `kiln demo` run), by the record's metric."""
    import torch

    from kiln.eval.lm import stream_bits_per_byte
    from kiln.eval.scoring import Scorer
    from kiln.loading import load_model

    loaded = load_model(model, dtype="fp32")
    if loaded.tokenizer is None:
        raise SystemExit(f"{model}: no tokenizer found")
    scorer = Scorer(loaded.model.eval(), batch_size=16, progress=False)
    with torch.no_grad():
        scored = stream_bits_per_byte(
            scorer, loaded.tokenizer, VALID_TEXT, loaded.tokenizer.special_tokens[EOT]
        )
    return {"model": model, "valid_bpb": round(scored.bits_per_byte or 0.0, 4),
            "valid_tokens": scored.n_tokens, "valid_bytes": scored.n_bytes}  # fmt: skip


def main() -> None:
    """Prepare data, run the recipes side by side, print the table and append to the log."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="10m", help="training time per recipe (10m, 90s)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per recipe")
    parser.add_argument("--vocab", type=int, default=4096, help="candidate's BPE vocabulary")
    parser.add_argument("--config", help="candidate config (default kiln/assets/demo.toml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--name", default="candidate", help="the candidate's name in the log")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:K=V;K=V")
    parser.add_argument("--no-candidate", action="store_true", help="only the variants")
    parser.add_argument("--baseline", action="store_true", help="also the nanoGPT recipe")
    parser.add_argument("--sequential", action="store_true", help="one recipe at a time")
    parser.add_argument("--valid", action="store_true", help="score valid.txt.gz (records)")
    parser.add_argument("--label", default="", help="what this invocation is, for the log")
    parser.add_argument("--subset", type=int, default=1, metavar="K",
                        help="train on every K-th story only: K x the epochs (a proxy for K x the budget)")  # fmt: skip
    parser.add_argument("--cache", default=str(DEFAULT_CACHE))
    parser.add_argument("--log", default=str(DEFAULT_LOG))
    parser.add_argument("--table", action="store_true", help="print the log as markdown")
    parser.add_argument("--score", metavar="MODEL", help="score a trained model (a kiln demo run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_noisy_flag(parser)
    args = parser.parse_args()
    if args.table:
        log_table(Path(args.log))
        return
    if args.child:  # runs under its parent's measurement
        print("RESULT " + json.dumps(run_child(json.loads(args.child))), flush=True)
        return
    measured = begin("bench/speedrun.py", args.noisy)
    if args.score:
        print(json.dumps(measured.stamp(score_model(args.score))))
        return
    if args.subset < 1:
        raise SystemExit(f"--subset must be a whole number >= 1, got {args.subset}")
    cache = Path(args.cache)
    specs = plan_specs(args)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for i, spec in enumerate(specs):
        spec["prep"] = prepare(cache, spec["tokenizer"], args.subset)
        spec.update(budget=args.budget, clock=args.clock, valid=args.valid, cache=str(cache))
        spec["run_dir"] = str(cache / "runs" / f"{stamp}-{i}")
        print(f"{spec['name']}: data {spec['prep']}", flush=True)
    load0, started = os.getloadavg(), time.time()
    results = run_all(specs, args.sequential)
    load1 = os.getloadavg()
    base = next((r for s, r in zip(specs, results, strict=True) if s["baseline"]), None)
    lines = []
    for spec, res in zip(specs, results, strict=True):
        entry = {
            "date": datetime.datetime.fromtimestamp(started, datetime.UTC).strftime(
                "%Y-%m-%d %H:%M UTC"
            ),
            "invocation": stamp, "label": args.label, "name": spec["name"],
            "baseline": spec["baseline"], "overrides": spec["set"],
            "tokenizer": spec["tokenizer"], "threads": spec["threads"], "budget": args.budget,
            "clock": args.clock, "side_by_side": len(specs) if not args.sequential else 1,
            "tokenizer_s": spec["prep"]["tokenizer_s"], "tokenize_s": spec["prep"]["tokenize_s"],
            "train_tokens_available": spec["prep"]["train_tokens"], "subset": args.subset,
            "loadavg_start": [round(x, 1) for x in load0],
            "loadavg_end": [round(x, 1) for x in load1], **res,
            "command": "bench/speedrun.py " + shlex.join(sys.argv[1:]),
            "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        }  # fmt: skip
        if base is not None and "error" not in res and "error" not in base:
            entry["holdout_ratio"] = round(res["holdout_bpb"] / base["holdout_bpb"], 4)
            if "valid_bpb" in res:
                entry["valid_ratio"] = round(res["valid_bpb"] / base["valid_bpb"], 4)
        lines.append(entry)
    lines = [measured.stamp(entry) for entry in lines]
    log = Path(args.log)
    old = log.read_text(encoding="utf-8") if log.exists() else ""
    # The log as it was plus this invocation's lines, or (on a failure) the log as it was.
    with atomic_write(log) as handle:
        handle.write(old + "".join(json.dumps(entry) + "\n" for entry in lines))
    report(lines)
    print(measured.line())


def run_all(specs: list[dict[str, Any]], sequential: bool) -> list[dict[str, Any]]:
    """Each spec in its own process (all at once unless sequential); their result dicts."""
    procs: list[Any] = []
    results: list[dict[str, Any]] = []

    def launch(spec: dict[str, Any]) -> Any:
        env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
        cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip

    def collect(spec: dict[str, Any], proc: Any) -> dict[str, Any]:
        output, _ = proc.communicate()
        found = [ln for ln in output.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not found:
            print(f"{spec['name']} failed:\n{output[-3000:]}", flush=True)
            return {"error": output[-500:]}
        res = json.loads(found[-1][len("RESULT ") :])
        print(f"{spec['name']}: {res}", flush=True)
        return res

    if sequential:
        return [collect(s, launch(s)) for s in specs]
    procs = [launch(s) for s in specs]
    results = [collect(s, p) for s, p in zip(specs, procs, strict=True)]
    return results


def report(lines: list[dict[str, Any]]) -> None:
    """The invocation's table (markdown)."""
    print("\n| recipe | tokenizer | params | steps | tokens | train s | tok/s | holdout bpb "
          "| valid bpb | × baseline |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in lines:
        if "error" in e:
            print(f"| {e['name']} | failed | | | | | | | | |")
            continue
        ratio = e.get("valid_ratio", e.get("holdout_ratio", ""))
        print(
            f"| {e['name']} | {e['tokenizer']} | {e['params'] / 1e6:.2f}M | {e['steps']} | "
            f"{e['tokens']:,} | {e['train_s']:.0f} | {e['tokens_per_s']:,} | "
            f"{e['holdout_bpb']:.4f} | {e.get('valid_bpb', '-')} | {ratio} |"
        )
    print(f"load average {lines[0]['loadavg_start']} -> {lines[0]['loadavg_end']}")


def log_table(log: Path) -> None:
    """Every entry of the log as one markdown table, oldest first."""
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    print("| date | label | recipe | vocab | budget (clock) | side by side | steps | tokens | tok/s "
          "| holdout bpb | valid bpb | × baseline |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e in entries:
        if "error" in e:
            continue
        ratio = e.get("valid_ratio", e.get("holdout_ratio", "-"))
        change = e["name"] + (f" (`{'; '.join(e['overrides'])}`)" if e["overrides"] else "")
        # Entries from before bench/_load.py carry only loadavg_start (taken as training began).
        start = e.get("measured", {}).get("loadavg_start", e["loadavg_start"])[0]
        label = e["label"]
        if e.get("noisy") or start > MAX_START_LOAD:
            label = f"**noisy** (load {start:.1f}) {label}"
        print(
            f"| {e['date']} | {label} | {change} | {e['tokenizer']} | {e['budget']} ({e['clock']}, "
            f"{e['threads']} thr) | {e['side_by_side']} | {e['steps']} | {e['tokens']:,} | "
            f"{e['tokens_per_s']:,} | {e['holdout_bpb']:.4f} | {e.get('valid_bpb', '-')} | "
            f"{ratio} |"
        )


if __name__ == "__main__":
    main()
