"""Where one decode step of kiln's engine spends its time, at batch 1 and 32 (issue #32).

The demo model's shape (kiln/assets/demo.toml, 4k vocabulary, random weights), fp32, one torch
thread. For each engine mode and batch size, `batch` requests are prefilled, then `--steps`
decode steps are timed twice:

1. CPU time of the stepping thread (time.thread_time: with one torch thread every op runs on
   it, and time other processes take from the cores is not counted), split by phase: scheduling (the scheduler's pick of work), step set-up (the
   PagedStep: positions, slots, block tables as tensors), the model's forward (`hidden`), the
   LM head (`logits`) and the rest (sampling, stop checks, events, bookkeeping);
2. under torch.profiler: the top ops by self CPU time, and the share of the step spent outside
   any torch op (Python: the engine, the model's module calls, the mode's dispatch). The
   profiler's times are wall clock: on a loaded machine a preemption lands on whichever op
   ran, so read this table from a quiet run (the op counts hold under any load).

The peer in the same run is HF transformers' generate on the same weights (through kiln's HF
export), one decode step at the same batch, timed by its own per-token rate: the ratio says how
far the engine's step is from a plain eager decoder's.

    .venv/bin/python bench/engine_profile.py --noisy --steps 20       # ~1 min under load
    .venv/bin/python bench/engine_profile.py --modes fast --batches 1 --top 25
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from bench.serve import model_config
from kiln.model.hf import to_hf
from kiln.model.transformer import Transformer
from kiln.serve.engine import Engine, EngineConfig, SamplingParams
from kiln.serve.engine import engine as engine_module

MODES = {
    "invariant": {"batch_invariant": True},
    "fast": {"batch_invariant": False},
    "invariant-tile1": {"batch_invariant": True, "invariant_rows": 1},  # batch-1 latency setting
}
PHASES = ("schedule", "setup", "forward", "head", "rest")


class Timers:
    """Seconds per phase, accumulated by wrappers around the engine's parts."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.on = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn, timed into `name` while the timers are on."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.thread_time() - t

        return timed


def engine_for(model: Transformer, mode: str, batch: int) -> Engine:
    """A fresh engine in `mode` with room for `batch` sequences."""
    config = EngineConfig(max_num_seqs=batch, prefix_caching=False, **MODES[mode])
    return Engine(model, None, config)


def prefilled(engine: Engine, batch: int, vocab: int, new: int) -> list[Any]:
    """Submit `batch` 32-token prompts asking for `new` tokens; step until all are decoding."""
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    handles = [
        engine.submit(torch.randint(0, vocab, (32,), generator=g).tolist(), params)
        for _ in range(batch)
    ]
    while any(h.first_token_time is None for h in handles):
        engine.step()
    return handles


def breakdown(model: Transformer, mode: str, batch: int, steps: int) -> dict[str, float]:
    """CPU milliseconds per decode step, per phase (no profiler), and the wall clock."""
    engine = engine_for(model, mode, batch)
    prefilled(engine, batch, model.cfg.vocab_size, 3 * steps + 8)
    for _ in range(steps):  # warm-up: first-call allocations, a compile if asked
        engine.step()
    timers = Timers()
    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)
    engine.model.hidden = timers.wrap("forward", model.hidden)  # instance attribute: this run
    engine.model.logits = timers.wrap("head", model.logits)
    paged = engine_module.PagedStep
    engine_module.PagedStep = timers.wrap("setup", paged)
    try:
        timers.on = True
        t, wall = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            engine.step()
        total, wall = time.thread_time() - t, time.perf_counter() - wall
    finally:
        engine_module.PagedStep = paged
        del engine.model.hidden, engine.model.logits
    ms = {k: timers.seconds[k] * 1e3 / steps for k in PHASES[:-1]}
    ms["total"] = total * 1e3 / steps
    ms["wall"] = wall * 1e3 / steps
    ms["rest"] = ms["total"] - sum(ms[k] for k in PHASES[:-1])
    return ms


def profile(model: Transformer, mode: str, batch: int, steps: int, top: int) -> list[str]:
    """The top ops by self CPU time over `steps` decode steps, and the share outside torch ops."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine = engine_for(model, mode, batch)
    prefilled(engine, batch, model.cfg.vocab_size, 3 * steps + 8)
    for _ in range(steps):
        engine.step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - t) * 1e6  # µs
    events = [e for e in prof.key_averages() if e.key != "ProfilerStep*"]
    inside = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    lines = ["| op | calls/step | self µs/step | share of step |", "|---|---:|---:|---:|"]
    for e in events[:top]:
        lines.append(f"| {e.key} | {e.count / steps:.0f} | {e.self_cpu_time_total / steps:.0f} | "
                     f"{e.self_cpu_time_total / wall:.1%} |")  # fmt: skip
    calls = sum(e.count for e in events) / steps
    lines.append(f"\n{calls:.0f} op calls per step; {wall / steps:.0f} µs per step under the "
                 f"profiler; outside any torch op (Python): {1 - inside / wall:.1%}")  # fmt: skip
    return lines


def hf_step_ms(model: Transformer, batch: int, steps: int) -> float:
    """HF generate's CPU milliseconds per decode step at `batch` (prompt 32 tokens, greedy)."""
    hf = to_hf(model)
    hf.config._attn_implementation = "sdpa"
    ids = torch.randint(0, model.cfg.vocab_size, (batch, 32), generator=torch.Generator())

    def run(new: int) -> float:
        t = time.thread_time()
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                        min_new_tokens=new, do_sample=False, pad_token_id=0)  # fmt: skip
        return time.thread_time() - t

    run(4)
    # The difference of two lengths leaves out the prefill and generate's set-up; at least 16
    # steps apart and the median of 3, or a few steps' difference drowns in the noise.
    n = max(steps, 16)
    return statistics.median(run(n + 8) - run(8) for _ in range(3)) * 1e3 / n


def main() -> int:
    """Print the phase table and the profiles of every mode at every batch size."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--modes", default="invariant,invariant-tile1,fast", help=",".join(MODES))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per measurement")
    ap.add_argument("--top", type=int, default=15, help="ops shown per profile")
    ap.add_argument("--threads", type=int, default=1)
    add_noisy_flag(ap)
    args = ap.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: {unknown[0]!r} is not one of {', '.join(MODES)}")
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    measured = begin("bench/engine_profile.py", args.noisy)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(model_config("demo")).eval()
    print(f"# demo shape, {model.cfg.num_params() / 1e6:.1f}M parameters, fp32, "
          f"{args.threads} thread(s), {args.steps} decode steps per measurement")  # fmt: skip
    batches = [int(b) for b in args.batches.split(",")]
    print("\nCPU ms per decode step by phase (wall ms beside: it counts other processes too)\n")
    print("| mode | batch | " + " | ".join(f"{p} ms" for p in PHASES)
          + " | step CPU ms | wall ms | tokens/CPU-s | HF step CPU ms | engine ÷ HF speed |")  # fmt: skip
    print("|---|---:|" + "---:|" * (len(PHASES) + 5))
    hf = {b: hf_step_ms(model, b, args.steps) for b in batches}
    for batch in batches:
        for mode in modes:
            ms = breakdown(model, mode, batch, args.steps)
            print(f"| {mode} | {batch} | " + " | ".join(f"{ms[p]:.2f}" for p in PHASES)
                  + f" | {ms['total']:.2f} | {ms['wall']:.2f} | {batch * 1e3 / ms['total']:.0f} | "
                  f"{hf[batch]:.2f} | "
                  f"{hf[batch] / ms['total']:.2f} |", flush=True)  # fmt: skip
    for batch in batches:
        for mode in modes:
            print(f"\n### torch.profiler: {mode}, batch {batch}\n")
            print("\n".join(profile(model, mode, batch, args.steps, args.top)), flush=True)
    print(measured.line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
