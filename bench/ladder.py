"""The ladder from a bigram up (issue 29): one table, one plot, in the speedrun's bits per byte.

bigram (add-k counts) → Kneser–Ney n-gram → learned bigram → Bengio's n-gram MLP → Mamba-2 →
Gated DeltaNet → hybrid (DDDA: three DeltaNet layers to one attention layer) → Transformer
(the demo's model) → the same Transformer over raw bytes. Every rung trains on the demo's data
(kiln/assets' TinyStories: the demo's 4096-token BPE and shards, 2% of stories held out; the
byte rung on byte shards of the same stories) and is scored by the speedrun's metric,
`kiln.eval.lm.stream_bits_per_byte` on the whole of ../shared/data/tinystories/valid.txt.gz
(the count rungs score the identical stream, windows and bytes; see kiln/eval/baselines).

Equal CPU time: each neural rung trains for --budget seconds of its own process's CPU time
(`time.process_time`; the Transformer family through kiln's Trainer with `train.time_budget`,
the two small rungs through kiln.eval.baselines' AdamW loop), one torch thread each, --jobs
rungs side by side. The count rungs need no budget (their fit time is reported).

Peer, side by side: NLTK's KneserNeyInterpolated fitted on the same slice of training tokens as
kiln's Kneser–Ney (NLTK's definition, no uniform floor); the table prints the largest
probability difference over scored targets and the time ratio.

    .venv/bin/python bench/ladder.py                       # ~6 min on a quiet 2-core CPU
    .venv/bin/python bench/ladder.py --tiny --noisy        # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.io import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
VALID_TEXT = ROOT.parent / "shared" / "data" / "tinystories" / "valid.txt.gz"
EOT = "<|endoftext|>"
COUNT = ["bigram", "kn"]
SMALL = ["bigram-nn", "mlp"]
# name -> demo.toml overrides (layer_pattern), and which shards
FAMILY: dict[str, tuple[list[str], str]] = {
    "mamba2": (["model.layer_pattern=M"], "bpe"),
    "deltanet": (["model.layer_pattern=D"], "bpe"),
    "hybrid": (["model.layer_pattern=DDDA"], "bpe"),
    "transformer": ([], "bpe"),
    "transformer-bytes": ([], "bytes"),
}
RUNGS = COUNT + SMALL + list(FAMILY)


def prepare(cache: Path, tiny: bool) -> dict[str, Path]:
    """The demo's tokenizer and shards (and byte shards) of the embedded stories, made once."""
    from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
    from kiln.demo import asset
    from kiln.tokenizer import train_bpe

    cache.mkdir(parents=True, exist_ok=True)
    source = asset("tinystories_train.txt.gz")
    vocab = 4096
    if tiny:  # 150 KB of stories, a 512-token BPE
        with gzip.open(source, "rt", encoding="utf-8") as handle:
            text = handle.read(150_000)
        source = cache / "stories.txt"
        source.write_text(text[: text.rfind(EOT) + len(EOT)], encoding="utf-8")
        vocab = 512
    tok_path = cache / "tokenizer.json"
    if not tok_path.is_file():
        train_bpe([source], vocab, [EOT], holdout=0.01, progress=False).save(tok_path)
    out = {}
    for name, tokenizer in (("bpe", str(tok_path)), ("bytes", "bytes")):
        out[name] = cache / f"data-{name}"
        if not (out[name] / "manifest.json").is_file():
            tokenize_to_shards(
                TokenizeConfig(tokenizer=tokenizer, inputs=(str(source),), out=str(out[name]),
                               val_fraction=0.02, progress=False, force=True)
            )  # fmt: skip
    return out


def valid_file(cache: Path, tiny: bool) -> Path:
    """The file every rung is scored on: the speedrun's valid stories (tiny: the first 15 KB)."""
    if not tiny:
        return VALID_TEXT
    path = cache / "valid-tiny.txt"
    if not path.is_file():
        with gzip.open(VALID_TEXT, "rt", encoding="utf-8") as handle:
            text = handle.read(15_000)
        path.write_text(text[: text.rfind(EOT) + len(EOT)], encoding="utf-8")
    return path


def run_family(
    name: str, data: Path, valid: Path, budget: float, run_dir: Path, tiny: bool
) -> dict[str, Any]:
    """Train one Transformer-family rung with kiln's Trainer for `budget` CPU seconds; score it."""
    import torch

    from kiln.data.shard_reader import Dataset
    from kiln.demo import asset
    from kiln.eval.lm import stream_bits_per_byte
    from kiln.eval.scoring import Scorer
    from kiln.tokenizer.formats import read_any
    from kiln.train.config import load_train_config
    from kiln.train.trainer import Trainer

    sets = [f"data.dataset={data}", "logging.progress=false", "checkpoint.every=0",
            "eval.every=0", "eval.sample_tokens=0", f"train.time_budget={budget}",
            "train.max_steps=none", "train.dtype=fp32", *FAMILY[name][0]]  # fmt: skip
    if tiny:
        sets += ["model.n_layer=4", "model.n_embd=64", "model.n_head=2", "model.n_kv_head=1",
                 "data.seq_len=64", "model.block_size=64", "batch.global_tokens=512",
                 "batch.micro_batch=8", "model.ssm.head_dim=32", "model.ssm.state_size=16"]  # fmt: skip
    cfg = load_train_config(asset("demo.toml"), sets)
    trainer = Trainer(cfg, run_dir, clock=time.process_time)
    result = trainer.run()
    ds = Dataset.open(data)
    tok = read_any(ds.manifest.tokenizer.locate(data))
    with torch.no_grad():
        scored = stream_bits_per_byte(
            Scorer(trainer.model.eval(), progress=False), tok, valid, ds.eot_id
        )
    return {
        "rung": name, "params": sum(p.numel() for p in trainer.model.parameters()),
        "settings": {"layer_pattern": trainer.model.cfg.layer_pattern, "tokenizer": FAMILY[name][1]},
        "train_s": round(trainer.train_seconds, 1), "valid_bpb": round(scored.bits_per_byte or 0.0, 4),
        "n_tokens": scored.n_tokens, "n_bytes": scored.n_bytes,
        "extra": {"steps": result.step, "tokens": result.tokens},
    }  # fmt: skip


def run_child(name: str, args: argparse.Namespace) -> None:
    """One rung in this process (one torch thread); its result as JSON under --out-dir."""
    import torch

    torch.set_num_threads(1)
    from kiln.eval.baselines.ladder import NeuralSettings, run_rung

    data = prepare(args.cache, args.tiny)
    valid = valid_file(args.cache, args.tiny)
    block = 64 if args.tiny else 256
    if name in COUNT + SMALL:
        res = run_rung(
            name, data["bpe"], valid, block, NeuralSettings(budget_s=args.budget)
        ).to_dict()
    else:
        shards = data[FAMILY[name][1]]
        res = run_family(name, shards, valid, args.budget, args.out_dir / f"run-{name}", args.tiny)
    write_json_atomic(args.out_dir / f"{name}.json", res)


def nltk_side_by_side(data: Path, n_train: int, n_score: int) -> dict[str, Any]:
    """kiln's and NLTK's Kneser–Ney (order 3, d 0.75) on the same tokens: max |Δp| and times."""
    import numpy as np
    from nltk.lm import KneserNeyInterpolated
    from nltk.util import everygrams

    from kiln.data.shard_reader import Dataset
    from kiln.eval.baselines.counts import KneserNey

    ds = Dataset.open(data)
    ids = np.asarray(ds.split("train").read(0, n_train + n_score), dtype=np.int64)
    train, test = ids[:n_train], ids[n_train:]
    t0 = time.perf_counter()
    ours = KneserNey(ds.manifest.tokenizer.vocab_size, 3, 0.75, uniform_floor=False).fit(train)
    ctx = np.stack([test[i : i + 2] for i in range(len(test) - 2)])
    p_ours = np.exp(ours.logprob(ctx, test[2:]))
    kiln_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    words = [str(t) for t in train]
    ref = KneserNeyInterpolated(3, discount=0.75)
    ref.fit([list(everygrams(words, max_len=3))], vocabulary_text=words)
    p_ref, diffs = [], []
    for row, (c, w) in enumerate(zip(ctx, test[2:], strict=True)):
        try:
            p = ref.score(str(w), [str(c[0]), str(c[1])])
        except ZeroDivisionError:
            continue
        p_ref.append(p)
        diffs.append(abs(p - p_ours[row]))
    nltk_s = time.perf_counter() - t0
    return {"train_tokens": n_train, "scored": len(diffs), "max_abs_diff": float(max(diffs)),
            "kiln_s": round(kiln_s, 3), "nltk_s": round(nltk_s, 2),
            "speedup": round(nltk_s / max(kiln_s, 1e-9), 1)}  # fmt: skip


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Bits per byte by rung, bottom to top of the ladder."""
    from kiln.plotting import pyplot, save_png

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["rung"] for r in results]
    values = [r["valid_bpb"] for r in results]
    ax.bar(
        range(len(names)), values, color=["#999"] * 2 + ["#69c"] * 2 + ["#c96"] * (len(names) - 4)
    )
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("valid bits per byte (lower is better)")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_title("The ladder on TinyStories at equal CPU time per neural rung")
    save_png(fig, path)


def main() -> int:
    """Run the rungs (--jobs at a time), print the table, write JSON and the plot."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/kiln-bench-ladder"))
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/kiln-bench-ladder/out"))
    ap.add_argument("--budget", type=float, default=30.0, help="CPU seconds per neural rung")
    ap.add_argument("--jobs", type=int, default=2, help="rungs trained side by side")
    ap.add_argument("--only", help="comma-separated rungs (default: all)")
    ap.add_argument("--tiny", action="store_true", help="150 KB of stories, tiny models (tests)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    add_noisy_flag(ap)
    args = ap.parse_args()
    if args.child:
        run_child(args.child, args)
        return 0
    measured = begin("bench/ladder.py", args.noisy)
    names = [r for r in RUNGS if not args.only or r in args.only.split(",")]
    if not names or args.jobs < 1 or args.budget <= 0:
        raise SystemExit("bench/ladder.py: --only names no rung, or --jobs/--budget below 1/0")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    data = prepare(args.cache, args.tiny)  # once, before the children read it
    started = time.perf_counter()
    pending, running = list(names), []
    while pending or running:
        while pending and len(running) < args.jobs:
            name = pending.pop(0)
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", name]
            running.append((name, subprocess.Popen(cmd)))
        time.sleep(0.5)
        for name, proc in list(running):
            if proc.poll() is not None:
                running.remove((name, proc))
                if proc.returncode != 0:
                    raise SystemExit(f"bench/ladder.py: rung {name} failed ({proc.returncode})")
                done = len(names) - len(pending) - len(running)
                elapsed = time.perf_counter() - started
                print(f"[{done}/{len(names)}] {name} done, {elapsed:.0f} s elapsed, "
                      f"ETA {elapsed / done * (len(names) - done):.0f} s", flush=True)  # fmt: skip
    results = [json.loads((args.out_dir / f"{n}.json").read_text()) for n in names]
    peer = nltk_side_by_side(
        data["bpe"], 3_000 if args.tiny else 20_000, 500 if args.tiny else 2_000
    )
    top = next((r for r in results if r["rung"] == "transformer"), results[-1])
    print(f"\n| rung | params | settings | CPU s | valid bpb | × {top['rung']} |")
    print("|---|---:|---|---:|---:|---:|")
    for r in results:
        settings = ", ".join(f"{k}={v}" for k, v in r["settings"].items())
        print(f"| {r['rung']} | {r['params']:,} | {settings} | {r['train_s']:.1f} | "
              f"{r['valid_bpb']:.4f} | {r['valid_bpb'] / top['valid_bpb']:.2f} |")  # fmt: skip
    print(f"\nKneser–Ney, kiln vs NLTK on the same {peer['train_tokens']:,} tokens: max |Δp| "
          f"{peer['max_abs_diff']:.1e} over {peer['scored']:,} targets; kiln {peer['kiln_s']} s, "
          f"NLTK {peer['nltk_s']} s (kiln {peer['speedup']}× faster)")  # fmt: skip
    plot(results, args.out_dir / "ladder.png")
    doc = {"budget_s": args.budget, "tiny": args.tiny, "rungs": results, "nltk_peer": peer}
    write_json_atomic(args.out_dir / "ladder.json", measured.stamp(doc))
    print(measured.line())
    print(f"wrote {args.out_dir / 'ladder.json'} and ladder.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
