"""The cost of batch invariance: engine tokens/s with and without it, side by side in one process.

The demo-sized model (kiln/assets/demo.toml's shape, 4k vocabulary, random weights, fp32) at
batch 1 and batch 32, each request 64 new tokens after a 16-token prompt, greedy with
ignore_eos. Engine settings compared: batch_invariant=False (the fast path) and True with row
tiles of each `--rows` (16 is the default tile). The old padding-to-4 engine is measured by
running this same script against an older checkout (PYTHONPATH=/path/to/it). Rounds alternate
the settings so load from other processes hits them alike; the median round is reported.

    .venv/bin/python bench/invariance.py                 # refuses a record on a busy machine
    .venv/bin/python bench/invariance.py --noisy --out /tmp/invariance.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tomllib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kiln and bench

from bench._load import add_noisy_flag, begin
from kiln.io import write_json_atomic
from kiln.model import ModelConfig, Transformer
from kiln.serve.engine import Engine, EngineConfig, SamplingParams


def demo_config() -> ModelConfig:
    """The demo's model shape with a 4k vocabulary (as bench/serve.py)."""
    demo_toml = Path(__file__).resolve().parents[1] / "kiln" / "assets" / "demo.toml"
    demo = tomllib.loads(demo_toml.read_text())["model"]
    preset = demo.pop("preset")
    return ModelConfig.preset(preset, **demo, vocab_size=4096)


def tokens_per_second(engine: Engine, prompts: list[list[int]], new: int) -> float:
    """Generated tokens/s of one offline batch through the engine."""
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(c[0].token_ids) for c in out) / elapsed


def main() -> int:
    """Measure, print the table and ratios, optionally write the record."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[16], help="invariant tiles to try")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="write the record (JSON) here")
    add_noisy_flag(ap)
    args = ap.parse_args()
    measured = begin("bench/invariance.py", args.noisy)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = demo_config()
    model = Transformer(cfg).eval()
    settings = {"variant": EngineConfig(batch_invariant=False)}
    for rows in args.rows:
        settings[f"invariant/{rows}"] = EngineConfig(batch_invariant=True, invariant_rows=rows)
    g = torch.Generator().manual_seed(1)
    results: dict[str, dict[int, float]] = {name: {} for name in settings}
    for batch in args.batches:
        prompts = [torch.randint(0, cfg.vocab_size, (16,), generator=g).tolist()] * batch
        prompts = [[(t + i) % cfg.vocab_size for t in p] for i, p in enumerate(prompts)]
        runs: dict[str, list[float]] = {name: [] for name in settings}
        for config in settings.values():  # warm-up, not counted
            tokens_per_second(Engine(model, None, config), prompts[:2], 4)
        for _ in range(args.rounds):
            for name, config in settings.items():
                engine = Engine(model, None, config)
                runs[name].append(tokens_per_second(engine, prompts, args.new_tokens))
        for name in settings:
            results[name][batch] = statistics.median(runs[name])
    print(f"\ndemo-size model, fp32, {args.threads} thread(s), {args.new_tokens} new tokens each")
    print(f"{'engine':<16}" + "".join(f"{'batch ' + str(b) + ' tok/s':>18}" for b in args.batches)
          + "".join(f"{'vs variant b' + str(b):>16}" for b in args.batches))  # fmt: skip
    for name, by_batch in results.items():
        ratios = [by_batch[b] / results["variant"][b] for b in args.batches]
        print(f"{name:<16}" + "".join(f"{by_batch[b]:>18.1f}" for b in args.batches)
              + "".join(f"{r:>16.2f}" for r in ratios))  # fmt: skip
    print(measured.line())
    if args.out:
        record = {
            "bench": "invariance", "threads": args.threads, "new_tokens": args.new_tokens,
            "tokens_per_s": {n: {str(b): v for b, v in r.items()} for n, r in results.items()},
        }  # fmt: skip
        write_json_atomic(args.out, measured.stamp(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
