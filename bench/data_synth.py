"""Synthetic data against real data alone, at equal training tokens, side by side in one run.

    python bench/data_synth.py OUT [--tiny] [--noisy]

1. A 1,024-token BPE; a small real pool (the first --real-chars of TinyStories' train split)
   and a disjoint, larger teacher corpus (the rest of that split, shared data).
2. Teacher: the demo recipe, narrowed, trained on the teacher corpus for --teacher-steps.
3. `kiln data synth generate`: --synth-docs TinyStories-method stories by the teacher through
   the engine (random noun, verb, adjective and features per prompt).
4. `kiln data run` twice: the real pool alone, and real + synthetic with `share = 0.5` each
   (in tokens); the synthetic documents pass the same dedup, decontamination and quality stages.
5. Two students of one shape, one seed, --student-steps steps of the same batch (equal tokens):
   one on each dataset; both scored in bits per byte on real held-out stories (TinyStories'
   valid split, which neither saw), with `kiln eval --bpb`.

The peer is the real-only student: the printed ratio is bpb(real + synthetic) / bpb(real only),
below 1 when the synthetic stories help. --tiny runs every step at a toy size (for a test).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._load import add_noisy_flag, begin  # noqa: E402

SHARED = ROOT.parent / "shared" / "data" / "tinystories"
EOT = "<|endoftext|>"  # the separator line of the shared files (kiln.tokenizer.special.EOT)
COMMON = [
    "train.time_budget=none", "train.dtype=fp32", "logging.progress=false", "eval.batches=2",
    "checkpoint.keep_last=1", "logging.every=50", "train.device=cpu",
]  # fmt: skip
FULL = {"real_chars": 400_000, "teacher_chars": 3_000_000, "valid_chars": 200_000,
        "teacher_steps": 300, "synth_docs": 384, "synth_tokens": 160, "student_steps": 150,
        "width": 192, "layers": 4, "student_width": 128, "student_layers": 2}  # fmt: skip
TINY = {"real_chars": 20_000, "teacher_chars": 40_000, "valid_chars": 6_000,
        "teacher_steps": 2, "synth_docs": 6, "synth_tokens": 12, "student_steps": 2,
        "width": 64, "layers": 1, "student_width": 64, "student_layers": 1}  # fmt: skip


def _stories(path: Path, start: int, chars: int) -> str:
    """Whole stories from character `start` of a shared file, about `chars` long."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        text = handle.read(start + chars)[start:]
    first = text.find(EOT + "\n") + len(EOT) + 1 if start else 0
    return text[first : text.rfind(EOT) + len(EOT)] + "\n"


def prepare(out: Path, size: dict[str, int]) -> dict[str, Path]:
    """The text files, the tokenizer, the teacher's shards."""
    from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
    from kiln.tokenizer import train_bpe

    files = {
        "real": out / "real.txt",
        "teacher_text": out / "teacher.txt",
        "valid": out / "valid.txt",
        "tok": out / "tok.json",
        "teacher_shards": out / "teacher_shards",
    }
    files["real"].write_text(_stories(SHARED / "train.txt.gz", 0, size["real_chars"]))
    files["teacher_text"].write_text(
        _stories(SHARED / "train.txt.gz", size["real_chars"], size["teacher_chars"])
    )
    files["valid"].write_text(_stories(SHARED / "valid.txt.gz", 0, size["valid_chars"]))
    if not files["tok"].is_file():
        train_bpe(files["teacher_text"], 1024, special_tokens=[EOT], workers=1).save(files["tok"])
    if not (files["teacher_shards"] / "manifest.json").is_file():
        tokenize_to_shards(
            TokenizeConfig(tokenizer=str(files["tok"]), inputs=(str(files["teacher_text"]),),
                           out=str(files["teacher_shards"]), val_docs=20, workers=1,
                           progress=False)
        )  # fmt: skip
    return files


def train(
    run: Path, dataset: Path, steps: int, width: int, layers: int, extra: tuple[str, ...] = ()
) -> float:
    """The demo recipe at this shape for `steps` steps of 2,048 tokens; its train seconds."""
    from kiln.train.config import load_train_config
    from kiln.train.trainer import Trainer

    if (run / "checkpoints" / "latest").exists():
        return 0.0
    sets = [*COMMON, f"data.dataset={dataset}", f"logging.run_dir={run}",
            f"train.max_steps={steps}", f"eval.every={steps}", f"checkpoint.every={steps}",
            f"model.n_embd={width}", f"model.n_layer={layers}", f"model.head_dim={width // 4}",
            "train.seed=0", *extra]  # fmt: skip
    cfg = load_train_config(ROOT / "kiln" / "assets" / "demo.toml", sets)
    started = time.perf_counter()
    Trainer(cfg, run).run()
    return time.perf_counter() - started


def synthesize(out: Path, teacher: Path, size: dict[str, int]) -> dict[str, Any]:
    """`kiln data synth generate` with the teacher; its manifest and seconds."""
    from kiln.posttrain.synth import run

    config = out / "synth.toml"
    config.write_text(
        f"""output = "synth"
documents = {size["synth_docs"]}
template = "Once upon a time, there was a {{adjective}} {{noun}}. It liked to {{verb}}."
keep_prompt = true
[model]
path = "{teacher}"
batch_size = 32
[sampling]
max_tokens = {size["synth_tokens"]}
temperature = 0.8
top_k = 50
""",
        encoding="utf-8",
    )
    started = time.perf_counter()
    manifest = run.generate(config, progress=False)
    return {**manifest, "seconds": time.perf_counter() - started}


def pipeline(out: Path, name: str, files: dict[str, Path], synth: Path | None) -> dict[str, Any]:
    """`kiln data run` on the real pool (and the synthetic stories, half the tokens each)."""
    from kiln.data.pipeline.config import load_pipeline_config
    from kiln.data.pipeline.runner import RunOptions, run_pipeline

    sources = f'[[sources]]\nname = "real"\npaths = ["{files["real"]}"]\n'
    if synth is not None:
        sources += "share = 0.5\n"
        sources += f'[[sources]]\nname = "synth"\npaths = ["{synth}"]\nid_field = "id"\n'
        sources += "share = 0.5\n"
    config = out / f"{name}.toml"
    config.write_text(
        f'{sources}[split]\nval_fraction = 0.02\n[tokenize]\ntokenizer = "{files["tok"]}"\n',
        encoding="utf-8",
    )
    cfg = load_pipeline_config(config)
    manifest = run_pipeline(cfg, RunOptions(out=str(out / name), workers=1, progress=False))
    return {s.path: s.tokens.get("train", 0) for s in manifest.sources}


def bpb(run: Path, valid: Path) -> float:
    """`kiln eval RUN --bpb VALID`: bits per byte on the real held-out stories."""
    from kiln.cli import main

    result = run / "eval_valid.json"
    code = main(["eval", str(run), "--bpb", str(valid), "--dtype", "fp32", "--out", str(result),
                 "--force", "--no-progress"])  # fmt: skip
    if code != 0:
        raise SystemExit(f"kiln eval failed on {run}")
    data = json.loads(result.read_text())
    return float(data["bpb"]["bits_per_byte"])


def main() -> int:
    """Run both arms and print JSON lines and the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tiny", action="store_true", help="toy sizes: proves every step runs")
    for key, value in FULL.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"({value})")
    add_noisy_flag(p)
    args = p.parse_args()
    size = {k: getattr(args, k) if getattr(args, k) is not None else v
            for k, v in (TINY if args.tiny else FULL).items()}  # fmt: skip
    measured = begin("bench/data_synth.py", args.noisy)
    args.out.mkdir(parents=True, exist_ok=True)
    files = prepare(args.out, size)
    started = time.perf_counter()
    teacher = args.out / "teacher"
    teacher_s = train(teacher, files["teacher_shards"], size["teacher_steps"], size["width"],
                      size["layers"])  # fmt: skip
    synth = synthesize(args.out, teacher, size)
    print(json.dumps(measured.stamp({"teacher_train_s": round(teacher_s, 1),
          "synth_documents": synth["documents"], "synth_s": round(synth["seconds"], 1)})),
          flush=True)  # fmt: skip
    rows = []
    for arm, source in (("real only", None), ("real + synthetic", Path(synth["path"]))):
        name = "real_only" if source is None else "real_synth"
        tokens = pipeline(args.out, f"data_{name}", files, source)
        run = args.out / f"student_{name}"
        # Scored on the real valid stories afterwards, not on each dataset's own val split.
        seconds = train(run, args.out / f"data_{name}", size["student_steps"],
                        size["student_width"], size["student_layers"], ("eval.batches=0",))  # fmt: skip
        row = {"arm": arm, "dataset_tokens": tokens, "steps": size["student_steps"],
               "train_tokens": size["student_steps"] * 2048,
               "bpb_real_valid": round(bpb(run, files["valid"]), 4),
               "train_s": round(seconds, 1)}  # fmt: skip
        rows.append(row)
        print(json.dumps(measured.stamp(row)), flush=True)
    ratio = rows[1]["bpb_real_valid"] / rows[0]["bpb_real_valid"]
    print(json.dumps(measured.stamp({"ratio_bpb_synth_over_real": round(ratio, 4),
          "total_s": round(time.perf_counter() - started, 1)})))  # fmt: skip
    print(measured.line())
    print("| arm | dataset tokens (real / synth) | train tokens | bpb on real valid |")
    print("|---|---:|---:|---:|")
    for r in rows:
        mix = " / ".join(f"{v:,}" for v in r["dataset_tokens"].values())
        print(f"| {r['arm']} | {mix} | {r['train_tokens']:,} | {r['bpb_real_valid']:.4f} |")
    print(f"ratio real+synthetic / real only: {ratio:.4f}x (below 1: the synthetic data helps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
