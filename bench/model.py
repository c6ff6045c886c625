"""kiln's Transformer against HF transformers' GPT2LMHeadModel, side by side in one run.

Training step (forward + backward + AdamW) tokens/s and peak memory, fp32 eager and bf16
autocast + torch.compile, on the GPT-2-style config n_layer 4, n_head 4, n_embd 256, T 256,
B 8, vocab 50304; then greedy generation with the KV cache against `transformers` generate
(batch 1 and 8, 256 new tokens) on the same weights.

    .venv/bin/python bench/model.py              # everything (tens of minutes on 2 cores)
    .venv/bin/python bench/model.py --steps 2 --rounds 2 --skip-compile

One torch thread by default (as the nanoGPT reference figures in the issue): on a shared 2-core
machine two OpenMP threads stall each other whenever another process runs. Timings alternate between the two implementations round by round, so load from other
processes on a shared machine hits both alike; the median round is reported. Peak memory is
measured in a fresh subprocess per implementation: the peak rise of anonymous resident memory
(sampled every 2 ms) over the first training steps (activations, gradients, optimizer state,
logits), after the model is built.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.model import ModelConfig, Transformer
from kiln.model.generate import generate
from kiln.model.hf import to_hf

B, T, V = 8, 256, 50304
CONFIG = dict(n_layer=4, n_head=4, n_embd=256, vocab_size=V, block_size=T)


def build_pair(block_size: int = T) -> tuple[Transformer, torch.nn.Module]:
    """A kiln GPT-2-style model and the HF GPT2LMHeadModel with the very same weights."""
    torch.manual_seed(0)
    kiln_model = Transformer(ModelConfig(**{**CONFIG, "block_size": block_size}))
    hf_model = to_hf(kiln_model)
    hf_model.config._attn_implementation = "sdpa"  # HF's fastest CPU attention
    return kiln_model, hf_model


def train_step_fn(
    model: torch.nn.Module, is_hf: bool, compiled: bool
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One forward + backward + AdamW step (bf16 autocast + torch.compile when compiled)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    forward = torch.compile(model) if compiled else model

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if is_hf:
            return forward(input_ids=x, labels=x).loss  # HF shifts labels itself
        return forward(x, y)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compiled):
            loss = loss_of(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def bench_training(compiled: bool, steps: int, rounds: int, warmup: int) -> dict[str, float]:
    """Tokens/s of kiln and HF, alternating rounds of `steps` steps each."""
    kiln_model, hf_model = build_pair()
    steps_by_name = {
        "kiln": train_step_fn(kiln_model, False, compiled),
        "hf": train_step_fn(hf_model, True, compiled),
    }
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    for name, step in steps_by_name.items():
        start = time.perf_counter()
        for _ in range(warmup):
            step(x, y)
        print(f"  {name}: warm-up ({warmup} steps) {time.perf_counter() - start:.1f}s", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in steps_by_name}
    for r in range(rounds):
        for name, step in steps_by_name.items():
            start = time.perf_counter()
            for _ in range(steps):
                step(x, y)
            rates[name].append(B * T * steps / (time.perf_counter() - start))
        print(f"  round {r + 1}: " + ", ".join(f"{n} {v[-1]:.0f} tok/s" for n, v in rates.items()))
    return {name: statistics.median(v) for name, v in rates.items()}


def measure_memory(name: str, compiled: bool, steps: int) -> float:
    """Peak memory rise (MB) over training steps, in a fresh process (see --memory-child)."""
    cmd = [sys.executable, __file__, "--memory-child", name, "--steps", str(steps)]
    cmd += ["--threads", str(torch.get_num_threads())]
    cmd += ["--compiled"] if compiled else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["peak_mb"])


def memory_child(name: str, compiled: bool, steps: int) -> None:
    """Child process: build one model, train `steps` steps, print the peak memory rise as JSON."""
    kiln_model, hf_model = build_pair()
    model, is_hf = (hf_model, True) if name == "hf" else (kiln_model, False)
    del kiln_model, hf_model
    step = train_step_fn(model, is_hf, compiled)
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    if compiled:  # compile-time memory is not what a training run keeps paying
        step(x, y)
    before = _anon_mb()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], _anon_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for _ in range(steps):
        step(x, y)
    done.set()
    sampler.join()
    print(json.dumps({"peak_mb": peak[0] - before}))


def _anon_mb() -> float:
    """Anonymous resident memory (heap, tensors) in MB; unlike total RSS, shared-library pages
    that the kernel evicts and faults back in under memory pressure do not count."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def bench_generation(batch: int, new_tokens: int, rounds: int) -> dict[str, float]:
    """Greedy decode tokens/s (new tokens × batch / time): kiln KV cache vs HF generate."""
    kiln_model, hf_model = build_pair(block_size=512)
    kiln_model.eval()
    hf_model.eval()
    torch.manual_seed(1)
    prompts = torch.randint(0, V, (batch, 16))
    hf_kwargs = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        pad_token_id=0, eos_token_id=None,
    )  # fmt: skip

    def run_kiln() -> list[list[int]]:
        return generate(kiln_model, prompts.tolist(), new_tokens, temperature=0)

    def run_kiln_compiled() -> list[list[int]]:
        return generate(kiln_model, prompts.tolist(), new_tokens, temperature=0, compile=True)

    def run_hf() -> list[list[int]]:
        with torch.inference_mode():
            out = hf_model.generate(prompts, attention_mask=torch.ones_like(prompts), **hf_kwargs)
        return out[:, prompts.size(1) :].tolist()

    runs = {"kiln": run_kiln, "kiln+compile": run_kiln_compiled, "hf": run_hf}
    outputs = {name: fn() for name, fn in runs.items()}  # warm-up (and compilation)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            rates[name].append(batch * new_tokens / (time.perf_counter() - start))
    result = {name: statistics.median(v) for name, v in rates.items()}
    same = [a == b for a, b in zip(outputs["kiln"], outputs["hf"], strict=True)]
    print(f"  greedy tokens identical to HF for {sum(same)}/{batch} rows; "
          f"compiled == eager: {outputs['kiln+compile'] == outputs['kiln']}")  # fmt: skip
    return result


def main() -> None:
    """Run the benchmark and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="training steps per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps (more if compiled)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--skip-compile", action="store_true", help="fp32 eager training only")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--memory-child", choices=["kiln", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    add_noisy_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.memory_child, args.compiled, args.steps)
        return
    measured = begin("bench/model.py", args.noisy)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; config {CONFIG}, B={B}, T={T}")  # fmt: skip
    rows: list[str] = []
    modes = [("fp32 eager", False)] + ([] if args.skip_compile else [("bf16 + compile", True)])
    for label, compiled in modes:
        print(f"training, {label}:", flush=True)
        rate = bench_training(compiled, args.steps, args.rounds, args.warmup + int(compiled))
        mem = {"kiln": float("nan"), "hf": float("nan")}
        if not args.skip_memory:
            mem = {name: measure_memory(name, compiled, args.steps) for name in ("kiln", "hf")}
        rows.append(
            f"| train {label} | {rate['kiln']:,.0f} | {rate['hf']:,.0f} | "
            f"{rate['kiln'] / rate['hf']:.2f} | {mem['kiln']:,.0f} | {mem['hf']:,.0f} |"
        )
        print(rows[-1], flush=True)
    if not args.skip_generation:
        for batch in (1, 8):
            print(f"generation, batch {batch}, {args.new_tokens} new tokens:", flush=True)
            rate = bench_generation(batch, args.new_tokens, max(1, args.rounds - 1))
            rows.append(
                f"| greedy decode, batch {batch} | {rate['kiln']:,.0f} "
                f"(compiled {rate['kiln+compile']:,.0f}) | {rate['hf']:,.0f} | "
                f"{rate['kiln'] / rate['hf']:.2f} | | |"
            )
            print(rows[-1], flush=True)
    print("\n| measurement | kiln tok/s | HF tok/s | ratio | kiln peak MB | HF peak MB |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(measured.line())


if __name__ == "__main__":
    main()
