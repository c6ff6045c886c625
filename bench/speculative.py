"""Speculative decoding on the demo model: acceptance rate and speed-up per drafter and k.

Target: a trained demo run (4 layers). Drafters: prompt lookup (n-gram, no model) and a 2-layer
draft model trained briefly by the demo recipe on the same dataset (same tokenizer). For each
drafter and draft length k (2, 4, 8), greedy and sampled (temperature 1): acceptance rate
(accepted / drafted), tokens per target forward, and the wall-time speed-up over target-only
decoding (`kiln.model.generate`) on the same prompts. Every configuration runs once per round,
the baseline among them, so load from other processes hits all alike; times are summed over
rounds and prompts, and greedy outputs are checked to be identical to the baseline's.

    .venv/bin/python bench/speculative.py --draft runs/draft2
    .venv/bin/python bench/speculative.py --draft runs/draft2 --prompts 4 --new-tokens 64 --rounds 1

One torch thread, fp32, batch 1.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.io import write_json_atomic
from kiln.loading import load_model
from kiln.model.generate import generate
from kiln.serve.engine.speculative import (
    DraftModelDrafter,
    PromptLookupDrafter,
    SpeculativeDecoder,
    Warp,
)
from kiln.tokenizer.special import EOT

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
DEMO_RUN = Path("/work/main/runs/demo-20261201-110757")
KS = (2, 4, 8)


def prompts(tok: Any, eot_id: int, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first n TinyStories validation stories (after an EOT)."""
    with gzip.open(SHARED / "tinystories" / "valid.txt.gz", "rt", encoding="utf-8") as f:
        stories = [s.strip() for s in f.read().split(EOT) if len(s.strip()) > 200]
    return [[eot_id, *tok.encode_ordinary(s)[:length]] for s in stories[:n]]


class OracleDrafter:
    """Proposes the target's own greedy continuation, known in advance: every draft is kept and
    drafting costs nothing, so its speed-up is the ceiling that batching k+1 tokens per target
    forward allows on this machine."""

    def __init__(self, sequences: dict[tuple[int, ...], list[int]]) -> None:
        self.sequences = sequences  # prompt -> prompt + the target's greedy output

    def propose(self, context_ids: list[int], k: int) -> tuple[list[int], None]:
        for prompt, full in self.sequences.items():
            if tuple(context_ids[: len(prompt)]) == prompt:
                return full[len(context_ids) : len(context_ids) + k], None
        return [], None


def main() -> int:
    """Run every configuration; print the table and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=DEMO_RUN, help="the target: a trained run")
    p.add_argument("--draft", type=Path, required=True, help="the draft model's run")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    add_noisy_flag(p)
    args = p.parse_args()
    measured = begin("bench/speculative.py", args.noisy)
    torch.set_num_threads(1)
    target = load_model(args.model, dtype="fp32")
    draft = load_model(args.draft, dtype="fp32")
    print(f"target: {target.source}\ndraft: {draft.source}", flush=True)
    assert target.eot_id is not None
    batch = prompts(target.tokenizer, target.eot_id, args.prompts, args.prompt_tokens)
    rows: list[dict[str, Any]] = []
    for temperature in (0.0, 1.0):
        rows += measure(target.model, draft.model, batch, temperature, args)
    print_table(rows, args)
    print(measured.line())
    doc = {"target": target.source, "draft": draft.source, "rows": rows}
    if args.out is not None:
        write_json_atomic(args.out, measured.stamp(doc))
    return 0


def measure(
    target: Any, draft: Any, batch: list[list[int]], temperature: float, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Baseline and every (drafter, k) at one temperature, interleaved round by round."""
    n = args.new_tokens

    def baseline(prompt: list[int], seed: int) -> list[int]:
        return generate(target, [prompt], n, temperature=temperature, seed=seed, stop_tokens=[])[0]

    def draft_only(prompt: list[int], seed: int) -> list[int]:  # the drafter's own cost
        return generate(draft, [prompt], n, temperature=temperature, seed=seed, stop_tokens=[])[0]

    configs: dict[str, tuple[Callable[[list[int], int], list[int]], Any]] = {
        "target only": (baseline, None),
        "draft model only (no target)": (draft_only, None),
    }
    makers: list[tuple[str, Callable[[], Any]]] = [
        ("prompt lookup", PromptLookupDrafter),
        ("draft model", lambda: DraftModelDrafter(draft, Warp(temperature), seed=0)),
    ]
    if temperature == 0:
        known = {tuple(q): [*q, *baseline(q, 0)] for q in batch}
        makers.append(("oracle (free, always right)", lambda: OracleDrafter(known)))
    for k in KS:
        for name, make in makers:
            decoder = SpeculativeDecoder(target, make(), k)

            def run(prompt: list[int], seed: int, d: SpeculativeDecoder = decoder) -> list[int]:
                return d.generate(prompt, n, Warp(temperature), seed=seed, stop_tokens=[])

            configs[f"{name} k={k}"] = (run, decoder)
    seconds = dict.fromkeys(configs, 0.0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for seed, prompt in enumerate(batch):
            for name, (fn, _) in configs.items():
                start = time.perf_counter()
                outputs[name].append(fn(prompt, seed))
                seconds[name] += time.perf_counter() - start
    rows = []
    base = seconds["target only"]
    for name, (_, decoder) in configs.items():
        tokens = sum(len(o) for o in outputs[name])
        row = {
            "temperature": temperature, "config": name, "seconds": seconds[name],
            "tokens": tokens, "tok_s": tokens / seconds[name], "speedup": base / seconds[name],
            "identical_to_target": outputs[name] == outputs["target only"],
        }  # fmt: skip
        if decoder is not None:
            row["acceptance"] = decoder.stats.acceptance_rate
            row["tokens_per_forward"] = decoder.stats.tokens_per_forward
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The RESULTS.md table."""
    print(f"\n{args.prompts} prompts × {args.rounds} rounds, {args.new_tokens} new tokens each, "
          "batch 1, fp32, 1 thread\n")  # fmt: skip
    print("| sampling | config | acceptance | tokens / target forward | tok/s | speed-up | "
          "same tokens as target |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mode = "greedy" if r["temperature"] == 0 else f"T={r['temperature']:g}"
        acc = f"{r['acceptance']:.3f}" if "acceptance" in r else "—"
        tpf = f"{r['tokens_per_forward']:.2f}" if "tokens_per_forward" in r else "1.00"
        same = ("yes" if r["identical_to_target"] else "NO") if r["temperature"] == 0 else "n/a"
        if r["config"].startswith("draft model only"):
            tpf, same = "—", "—"
        print(f"| {mode} | {r['config']} | {acc} | {tpf} | {r['tok_s']:.1f} | "
              f"{r['speedup']:.2f}× | {same} |")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
