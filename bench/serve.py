"""kiln's engine against HF transformers generate and CTranslate2, side by side in one run.

Offline throughput (generated tokens/s) for 1, 8, 32 and 64 concurrent requests with mixed
prompt and output lengths, on the demo-sized model (kiln/assets/demo.toml's shape, random
weights) and a GPT-2-124M-shaped random model; all three run the very same weights (HF through
kiln's export, CTranslate2 converted from that export, fp32 and int8). Then latency of the
engine under a Poisson arrival stream: time to first token and time per output token.

    .venv/bin/python bench/serve.py --quick            # seconds per configuration
    .venv/bin/python bench/serve.py --models gpt2 --concurrency 32 --rounds 3

Counting: every system is credited with the tokens the requests asked for. HF and CTranslate2
decode one static batch (left-padded) until its longest request is done; the engine lets each
request leave when it is done and fills its place. One torch thread and one CTranslate2 thread
by default (a shared 2-core machine); rounds alternate the systems so load from other processes
hits them alike, and the median round is reported.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from kiln.model import ModelConfig, Transformer
from kiln.model.hf import save_hf_dir, to_hf
from kiln.serve.engine import Engine, EngineConfig, SamplingParams

Workload = tuple[list[list[int]], list[int]]  # prompts, output lengths


def model_config(name: str) -> ModelConfig:
    """The demo's model shape (4k vocabulary) or GPT-2 124M."""
    if name == "demo":
        import tomllib

        demo_toml = Path(__file__).resolve().parents[1] / "kiln" / "assets" / "demo.toml"
        demo = tomllib.loads(demo_toml.read_text())["model"]
        preset = demo.pop("preset")
        return ModelConfig.preset(preset, **demo, vocab_size=4096)
    return ModelConfig()


def workload(n: int, cfg: ModelConfig, quick: bool, seed: int) -> Workload:
    """n prompts and output lengths drawn uniformly (shorter ranges with --quick)."""
    rng = random.Random(seed)
    lo, hi = (8, 48) if quick else (16, 128)
    lengths = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n)]
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(p)] for p, _ in lengths]
    return prompts, [o for _, o in lengths]


def run_kiln(engine: Engine, work: Workload) -> float:
    """Seconds for the engine to finish every request."""
    prompts, outs = work
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outs]
    t = time.perf_counter()
    done = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    assert [len(c[0].token_ids) for c in done] == outs
    return dt


def run_hf(hf: Any, work: Workload) -> float:
    """Seconds for HF generate on one left-padded batch, up to the longest request."""
    prompts, outs = work
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    t = time.perf_counter()
    with torch.inference_mode():
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(outs),
                    min_new_tokens=max(outs), do_sample=False, pad_token_id=0)  # fmt: skip
    return time.perf_counter() - t


def run_ct2(gen: Any, work: Workload) -> float:
    """Seconds for CTranslate2's generate_batch on the whole batch, up to the longest request."""
    prompts, outs = work
    tokens = [[f"t{i}" for i in p] for p in prompts]
    t = time.perf_counter()
    gen.generate_batch(tokens, max_length=max(outs), min_length=max(outs),
                       include_prompt_in_result=False)  # fmt: skip
    return time.perf_counter() - t


def ct2_generators(model: Transformer, folder: Path, threads: int) -> dict[str, Any]:
    """CTranslate2 fp32 and int8 generators converted from kiln's HF export of the model."""
    import ctranslate2
    from ctranslate2.converters import TransformersConverter
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    hf_dir = folder / "hf"
    save_hf_dir(model, hf_dir, eos_token_id=0)
    # A word-level vocabulary "t0".."tN": CTranslate2 takes token strings, so ids map 1:1.
    vocab = {f"t{i}": i for i in range(model.cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="t0", eos_token="t0", unk_token="t0"
    ).save_pretrained(hf_dir)
    out = {}
    for name, quant in (("ct2-fp32", "float32"), ("ct2-int8", "int8")):
        path = folder / name
        TransformersConverter(str(hf_dir)).convert(str(path), quantization=quant, force=True)
        out[name] = ctranslate2.Generator(str(path), device="cpu", intra_threads=threads)
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def poisson_latency(engine: Engine, cfg: ModelConfig, rate: float, seconds: float,
                    quick: bool) -> dict[str, float]:  # fmt: skip
    """TTFT and TPOT (p50, p99, ms) of requests arriving at `rate` per second for `seconds`."""
    rng = random.Random(1)
    prompts, outs = workload(max(4, int(rate * seconds * 2)), cfg, quick, seed=2)
    engine.start()
    handles = []
    t0 = time.monotonic()
    at = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        at += rng.expovariate(rate)
        if at > seconds:
            break
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        handles.append(engine.submit(prompt, SamplingParams(max_tokens=out, temperature=0,
                                                            ignore_eos=True)))  # fmt: skip
    for h in handles:
        h.result()
    engine.stop()
    ttft = [(h.first_token_time - h.submit_time) * 1e3 for h in handles]
    tpot = [
        (h.finish_time - h.first_token_time) * 1e3 / (len(h.result()[0].token_ids) - 1)
        for h in handles
        if len(h.result()[0].token_ids) > 1
    ]
    return {"requests": len(handles), "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99), "tpot_p50": percentile(tpot, 50),
            "tpot_p99": percentile(tpot, 99)}  # fmt: skip


def main() -> None:
    """Run the configurations asked for and print the tables."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short prompts and outputs (8-48)")
    ap.add_argument("--models", default="demo,gpt2", help="demo,gpt2")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--systems", default="kiln,hf,ct2-fp32,ct2-int8",
                    help="also: kiln-variant (batch_invariant=False)")  # fmt: skip
    ap.add_argument("--poisson-seconds", type=float, default=10.0, help="0 skips the latency run")
    add_noisy_flag(ap)
    args = ap.parse_args()
    measured = begin("bench/serve.py", args.noisy)
    torch.set_num_threads(args.threads)
    systems = args.systems.split(",")
    print(f"# bench/serve.py {' '.join(sys.argv[1:])}: torch {torch.__version__}, "
          f"{args.threads} thread(s)")  # fmt: skip
    for name in args.models.split(","):
        cfg = model_config(name)
        torch.manual_seed(0)
        model = Transformer(cfg).eval()
        runners: dict[str, Callable[[Workload], float]] = {}
        engines = {
            "kiln": Engine(model, None, EngineConfig()),
            "kiln-variant": Engine(model, None, EngineConfig(batch_invariant=False)),
        }
        for key, engine in engines.items():
            runners[key] = lambda w, e=engine: run_kiln(e, w)
        hf = to_hf(model)
        hf.config._attn_implementation = "sdpa"
        runners["hf"] = lambda w, m=hf: run_hf(m, w)
        tmp = tempfile.TemporaryDirectory()
        if any(s.startswith("ct2") for s in systems):
            for key, gen in ct2_generators(model, Path(tmp.name), args.threads).items():
                runners[key] = lambda w, g=gen: run_ct2(g, w)
        runners = {k: v for k, v in runners.items() if k in systems}
        for run in runners.values():  # warm-up: first-call allocations and kernel choices
            run(workload(2, cfg, True, seed=99))
        print(f"\n## {name}: {cfg.num_params() / 1e6:.1f}M parameters, vocab {cfg.vocab_size}")
        print("| requests | " + " | ".join(f"{s} tok/s" for s in runners) + " | "
              + " | ".join(f"kiln ÷ {s}" for s in runners if s != "kiln") + " |")  # fmt: skip
        print("|---" * (2 * len(runners)) + "|")
        completed: dict[int, float] = {}  # requests/s the engine finished, by concurrency
        for n in map(int, args.concurrency.split(",")):
            work = workload(n, cfg, args.quick, seed=n)
            useful = sum(work[1])
            times: dict[str, list[float]] = {s: [] for s in runners}
            for r in range(args.rounds):
                order = list(runners)[r % len(runners) :] + list(runners)[: r % len(runners)]
                for s in order:
                    times[s].append(runners[s](work))
            tps = {s: useful / statistics.median(t) for s, t in times.items()}
            if "kiln" in times:
                completed[n] = n / statistics.median(times["kiln"])
            ratios = [tps["kiln"] / tps[s] for s in runners if s != "kiln" and "kiln" in tps]
            print(f"| {n} | " + " | ".join(f"{tps[s]:.0f}" for s in runners) + " | "
                  + " | ".join(f"{x:.2f}" for x in ratios) + " |", flush=True)  # fmt: skip
        if args.poisson_seconds > 0 and completed:
            # The stream draws its requests like the throughput runs did, so 80% of the best
            # completion rate measured above keeps the engine about 80% busy.
            peak_n = max(completed, key=completed.__getitem__)
            rate = 0.8 * completed[peak_n]
            stats = poisson_latency(engines["kiln"], cfg, rate, args.poisson_seconds, args.quick)
            print(f"\nPoisson arrivals at {rate:.2f} req/s (80% of the {completed[peak_n]:.2f} "
                  f"req/s the engine completed at {peak_n} concurrent requests) for "
                  f"{args.poisson_seconds:.0f} s "
                  f"({stats['requests']} requests): TTFT p50 {stats['ttft_p50']:.0f} ms, "
                  f"p99 {stats['ttft_p99']:.0f} ms; TPOT p50 {stats['tpot_p50']:.0f} ms, "
                  f"p99 {stats['tpot_p99']:.0f} ms", flush=True)  # fmt: skip
        tmp.cleanup()
    print(measured.line())


if __name__ == "__main__":
    main()
