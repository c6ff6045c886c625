"""The two routes to a picture at equal CPU time: kiln's DiT on latents vs kiln's Transformer on
VQ codes (images as tokens), over one VQ-VAE, scored by one checker.

    python bench/image_tokens.py                  # full: 32×32, ~7 minutes on 2 cores
    python bench/image_tokens.py --tiny --noisy   # seconds: proves the path (the test runs this)

One run, side by side (data, checker and the DiT side are bench/image.py's own functions):
1. `kiln image data` scenes (8000 train, 500 held-out compositions) and the checker, trained on
   renders only (its own, as in bench/image.py: never the pictures it scores); its
   per-attribute accuracy on the held-out renders comes first.
2. The VQ-VAE for --prep-minutes (shared by both routes), then the DiT on its latents for
   --minutes (bench/image.py's train_kiln).
3. The token route: `kiln image tokens` over that VQ-VAE (timed), then `kiln train`'s Trainer
   (configs/imgtok_32.toml, fp32 like the DiT) with train.time_budget = --minutes, so the two
   routes get the same CPU minutes after the shared VQ-VAE.
Both draw one picture per held-out caption (the DiT with DDIM and guidance, the tokens with
h·w constrained code samples); the checker scores them (object, colour, relation, all) and a
Fréchet distance on its penultimate features against the held-out renders. Also CPU minutes,
sampling seconds per picture, peak RSS growth while training, a grid PNG (render | DiT |
tokens) and the ratios tokens / DiT.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from bench.image import (
    FULL,
    TINY,
    PeakRSS,
    evaluate,
    prepare,
    train_checker,
    train_kiln,
    write_grid,
)

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "imgtok_32.toml"


def train_tokens(work: Path, scenes: Path, seconds: float, tiny: bool) -> dict[str, Any]:
    """`kiln image tokens` over work/vqvae, then kiln's Trainer for `seconds` of training."""
    from kiln.image.tokens import build_image_tokens
    from kiln.train.config import load_train_config
    from kiln.train.trainer import Trainer

    wall, cpu = time.perf_counter(), time.process_time()
    manifest = build_image_tokens(work / "vqvae", scenes, work / "tokens", progress=False)
    encode_cpu = time.process_time() - cpu
    doc = manifest.config["layout"]["doc_tokens"]
    sets = [f"data.dataset={work / 'tokens'}", f"data.seq_len={doc}",
            f"logging.run_dir={work / 'imgtok'}", "logging.progress=false",
            f"train.time_budget={seconds}", "train.max_steps=1000000", "train.dtype=fp32",
            "train.device=cpu", "eval.every=0", "eval.batches=2", "checkpoint.every=1000000",
            f"model.block_size={max(128, doc)}"]  # fmt: skip
    if tiny:
        sets += ["model.n_layer=1", "model.n_embd=32", f"batch.global_tokens={4 * doc}",
                 "batch.micro_batch=4", "schedule.warmup_steps=1"]  # fmt: skip
    else:
        sets += [f"batch.global_tokens={32 * doc}", "batch.micro_batch=32"]
    cfg = load_train_config(CONFIG, sets)
    with PeakRSS() as rss:
        trainer = Trainer(cfg, work / "imgtok")
        start = time.process_time()
        result = trainer.run()
        train_cpu = time.process_time() - start
    params = sum(p.numel() for p in trainer.model.parameters())
    return {"steps": result.step, "wall_s": time.perf_counter() - wall,
            "cpu_s": encode_cpu + train_cpu, "encode_cpu_s": encode_cpu, "peak_mib": rss.growth,
            "params": params, "doc_tokens": doc}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole comparison; returns the record."""
    from kiln.image.checker import predict, score
    from kiln.image.dataset import ImageDataset
    from kiln.image.sampler import load_image_model
    from kiln.image.vqvae import to_unit

    sizes = dict(TINY if args.tiny else FULL)
    minutes = args.minutes if args.minutes is not None else sizes["minutes"]
    prep = args.prep_minutes if args.prep_minutes is not None else sizes["prep"]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    scenes, checker_scenes = prepare(work, sizes, 32)
    data = ImageDataset.open(scenes)
    checker_steps = args.checker_steps or sizes["checker_steps"]
    checker_run, checker_time = train_checker(work, checker_scenes, 32, checker_steps, args.tiny)
    checker = checker_run.model.eval()
    held = data.records("heldout")
    renders = to_unit(torch.from_numpy(np.array(data.images("heldout"))))
    real = predict(checker, renders)
    checker_acc = score(real, held)
    print(f"checker on {len(held)} held-out renders: {checker_acc}", file=sys.stderr)
    dit, _ = train_kiln(work, scenes, 32, prep * 60, minutes * 60, args.tiny)
    tokens = train_tokens(work, scenes, minutes * 60, args.tiny)
    records = held[: sizes["eval"]]
    captions = [r["caption"] for r in records]
    drawn = {}
    for name, record, folder, knobs in (
        ("dit", dit, "dit", {"steps": args.steps or sizes["steps"]}),
        ("tokens", tokens, "imgtok", {"temperature": args.temperature}),
    ):
        model = load_image_model(work / folder)
        start = time.perf_counter()
        drawn[name] = torch.cat([model.sample(captions[i : i + 50], seed=i, **knobs)
                                 for i in range(0, len(captions), 50)])  # fmt: skip
        record["sample_s"] = (time.perf_counter() - start) / len(captions)
        record.update(evaluate(checker, drawn[name], records, real["features"]))
    render01 = (renders[: len(records)] + 1) / 2
    grid = Path(args.grid) if args.grid else work / "image_tokens_grid.png"
    write_grid(grid, [render01[:8], drawn["dit"][:8], drawn["tokens"][:8]])
    return {
        "size": 32, "train_images": sizes["train"], "eval_captions": len(records),
        "dit_sample_steps": args.steps or sizes["steps"], "temperature": args.temperature,
        "minutes": minutes, "prep_minutes": prep,
        "checker": {**checker_acc, **checker_time}, "dit": dit, "tokens": tokens,
        "grid": str(grid), "total_s": time.perf_counter() - t0,
    }  # fmt: skip


def table(doc: dict[str, Any]) -> str:
    """The markdown table of the record."""
    c, d, t = doc["checker"], doc["dit"], doc["tokens"]
    lines = [
        f"checker on held-out renders: object {c['object']:.3f}, colour {c['colour']:.3f}, "
        f"relation {c['relation']:.3f}, all {c['all']:.3f}",
        "",
        "| route | object | colour | relation | all | Fréchet | CPU min | train steps | "
        "s / picture | peak RSS MiB | params |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in (("kiln DiT on latents (+VQ-VAE)", d), ("kiln Transformer on VQ codes", t)):
        lines.append(
            f"| {name} | {r['object']:.3f} | {r['colour']:.3f} | {r['relation']:.3f} | "
            f"{r['all']:.3f} | {r['frechet']:.2f} | {r['cpu_s'] / 60:.1f} | {r['steps']} | "
            f"{r['sample_s']:.3f} | {r['peak_mib']:.0f} | {r['params']:,} |"
        )
    ratios = ", ".join(f"{m} {t[m] / d[m]:.2f}×" for m in ("object", "colour", "relation", "all")
                       if d[m] > 0)  # fmt: skip
    lines += ["", f"tokens / DiT: {ratios}; Fréchet {t['frechet'] / max(d['frechet'], 1e-9):.2f}× "
              f"(lower is better); sampling time {t['sample_s'] / d['sample_s']:.2f}×. CPU min: "
              f"the DiT's include the VQ-VAE both routes share ({doc['prep_minutes']} min), the "
              "tokens' include encoding the pictures with it"]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run both routes, print the table and the JSON record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="seconds, tiny models (a smoke run)")
    parser.add_argument("--minutes", type=float, help="training minutes per route (full: 2)")
    parser.add_argument("--prep-minutes", type=float, help="the shared VQ-VAE's minutes (full: 1)")
    parser.add_argument("--steps", type=int, help="DiT sampling steps (full: 20)")
    parser.add_argument("--temperature", type=float, default=1.0, help="token sampling (1)")
    parser.add_argument("--checker-steps", type=int, help="checker training steps (full: 1000)")
    parser.add_argument("--work", help="folder for data and runs (default: a new temporary one)")
    parser.add_argument("--grid", help="the grid PNG (default WORK/image_tokens_grid.png)")
    parser.add_argument("--out", help="also write the JSON record here")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    add_noisy_flag(parser)
    args = parser.parse_args(argv)
    measured = begin("bench/image_tokens.py", args.noisy)
    if args.work is None:
        import tempfile

        args.work = tempfile.mkdtemp(prefix="kiln-bench-image-tokens-")
    work = Path(args.work)
    if work.exists() and any((work / n).exists() for n in ("checker", "vqvae", "dit", "imgtok")):
        sys.exit(
            f"bench/image_tokens.py: {work} holds runs of an earlier bench; give another --work"
        )
    doc = measured.stamp(run(args))
    print(table(doc))
    print(measured.line())
    print(json.dumps(doc, indent=2))
    if args.out:
        from kiln.io import write_json_atomic

        write_json_atomic(args.out, doc)


if __name__ == "__main__":
    main()
