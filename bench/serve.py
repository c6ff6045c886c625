"""kiln's engine against HF transformers generate, CTranslate2 and llama.cpp, side by side.

Offline throughput (generated tokens/s) for 1, 8, 32 and 64 concurrent requests with mixed
prompt and output lengths, on the demo-sized model (kiln/assets/demo.toml's shape, random
weights) and a GPT-2-124M-shaped random model; every system runs the very same weights (HF
through kiln's export, CTranslate2 converted from that export at fp32 and int8, llama.cpp from
`kiln export --gguf` at f32, f16 and q8_0; kiln's engine batch-invariant, not, and int8). Then
latency of the engine under a Poisson arrival stream: time to first token and time per token.

    .venv/bin/python bench/serve.py --tiny             # a few seconds: proves every column runs
    .venv/bin/python bench/serve.py --race --threads 1  # the CPU race (docs/export.md); then 2
    .venv/bin/python bench/serve.py --quick            # seconds per configuration
    .venv/bin/python bench/serve.py --models gpt2 --concurrency 32 --rounds 3 --threads 1,2

llama.cpp runs through llama-cpp-python (the llamacpp extra; its columns are left out with a
note when it is not installed). Its own server takes one request at a time, so the concurrent
runs drive its batch API the way llama-server's parallel slots do (bench/_llamacpp.py):
"llama-*" columns decode every live request in one llama_decode per step; "llama-seq-f16" runs
the requests one after another, as llama-cpp-python's server would.

Counting: every system is credited with the tokens the requests asked for. HF and CTranslate2
decode one static batch (left-padded) until its longest request is done; the engine lets each
request leave when it is done and fills its place. One torch thread and one CTranslate2 thread
by default (a shared 2-core machine); rounds alternate the systems so load from other processes
hits them alike, and the median round is reported. `--threads 1,2` repeats every table per
thread count (torch, CTranslate2 and llama.cpp alike).
"""

from __future__ import annotations

import argparse
import copy
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

from bench._llamacpp import LlamaCpp, available
from bench._load import add_noisy_flag, begin
from kiln.model import ModelConfig, Transformer
from kiln.model.hf import save_hf_dir, to_hf
from kiln.quant.quantize import quantize_model
from kiln.serve.engine import Engine, EngineConfig, SamplingParams
from kiln.tokenizer import Tokenizer
from kiln.tokenizer.special import EOT

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
LLAMA_FILES = {"llama-f32": "f32", "llama-f16": "f16", "llama-q8_0": "q8_0", "llama-seq-f16": "f16"}
# The 8-bit columns kiln-int8 is compared with, beside kiln (fp32) against every column.
EIGHT_BIT = ("ct2-int8", "llama-q8_0")
DEFAULT_SYSTEMS = "kiln,kiln-variant,kiln-int8,hf,ct2-fp32,ct2-int8,llama-f32,llama-f16,llama-q8_0"

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


def gpt2_tokenizer(vocab_size: int) -> Tokenizer:
    """GPT-2's tokenizer cut to vocab_size ids (its first merges, end-of-text last): llama.cpp
    needs a vocabulary in the file, though the runs here feed it token ids."""
    full = Tokenizer.from_gpt2(SHARED / "gpt2" / "vocab.json", SHARED / "gpt2" / "merges.txt")
    if vocab_size == full.n_vocab:
        return full
    keep = vocab_size - 1
    vocab = {i: b for i, b in full.vocab.items() if i < keep}
    return Tokenizer(vocab, full.merges[: keep - 256], {EOT: keep})


def llama_runners(
    model: Transformer, folder: Path, systems: list[str], threads: int, n_seq: int, seq_len: int
) -> dict[str, Callable[[Workload], float]]:
    """llama.cpp runners for the llama-* systems asked for, from kiln's GGUF exports."""
    from kiln.train.export_gguf import export_gguf

    tok = gpt2_tokenizer(model.cfg.vocab_size)
    out: dict[str, Callable[[Workload], float]] = {}
    for name in (s for s in systems if s in LLAMA_FILES):
        path = folder / f"{LLAMA_FILES[name]}.gguf"
        if not path.exists():
            export_gguf(model, tok, EOT, path, LLAMA_FILES[name])
        seq = name.startswith("llama-seq")
        llm = LlamaCpp(path, threads, n_seq=1 if seq else n_seq, seq_len=seq_len)
        out[name] = lambda w, m=llm, one=seq: run_llama(m, w, one)
    return out


def run_llama(llm: LlamaCpp, work: Workload, one_at_a_time: bool) -> float:
    """Seconds for llama.cpp to finish every request (together, or one after another)."""
    prompts, outs = work
    t = time.perf_counter()
    if one_at_a_time:
        done = [llm.greedy([p], [o])[0] for p, o in zip(prompts, outs, strict=True)]
    else:
        done = llm.greedy(prompts, outs)
    dt = time.perf_counter() - t
    assert [len(d) for d in done] == outs
    return dt


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
    ap.add_argument("--threads", help="thread counts, each its own tables: 1,2 (default 1)")
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS,
                    help="of: " + DEFAULT_SYSTEMS + ",llama-seq-f16")  # fmt: skip
    ap.add_argument("--poisson-seconds", type=float, default=10.0, help="0 skips the latency run")
    ap.add_argument("--tiny", action="store_true",
                    help="demo model, 1 and 4 requests, short lengths, no latency run: proves "
                         "every column runs, in seconds")  # fmt: skip
    ap.add_argument("--race", action="store_true",
                    help="issue 32's CPU race: 1 and 32 requests, 1 and 2 threads (or --threads), "
                         "every system, no latency run; demo and gpt2 (or --models)")  # fmt: skip
    add_noisy_flag(ap)
    args = ap.parse_args()
    if args.tiny:
        args.quick, args.models, args.concurrency, args.poisson_seconds = True, "demo", "1,4", 0
    if args.race:
        args.concurrency, args.poisson_seconds = "1,32", 0  # --models picks one of the two
        args.threads = args.threads or "1,2"
    measured = begin("bench/serve.py", args.noisy)
    systems = args.systems.split(",")
    if not available() and any(s in LLAMA_FILES for s in systems):
        print("# llama.cpp columns left out: llama-cpp-python is not installed "
              "(pip install -e '.[llamacpp]')")  # fmt: skip
        systems = [s for s in systems if s not in LLAMA_FILES]
    print(f"# bench/serve.py {' '.join(sys.argv[1:])}: torch {torch.__version__}")
    for threads in map(int, (args.threads or "1").split(",")):
        torch.set_num_threads(threads)
        for name in args.models.split(","):
            run_model(name, args, systems, threads)
    print(measured.line())


def run_model(name: str, args: argparse.Namespace, systems: list[str], threads: int) -> None:
    """The throughput table (and the latency line) of one model at one thread count."""
    started = time.perf_counter()
    cfg = model_config(name)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    runners: dict[str, Callable[[Workload], float]] = {}
    engines = {
        "kiln": Engine(model, None, EngineConfig()),
        "kiln-variant": Engine(model, None, EngineConfig(batch_invariant=False)),
    }
    if "kiln-int8" in systems:
        int8 = copy.deepcopy(model)
        paths = quantize_model(int8, "int8").paths  # the kernel a timed probe picked
        print(f"\n# kiln-int8 ({name}, {threads} thread(s)): {paths}")
        engines["kiln-int8"] = Engine(int8, None, EngineConfig())
    for key, engine in engines.items():
        runners[key] = lambda w, e=engine: run_kiln(e, w)
    hf = to_hf(model)
    hf.config._attn_implementation = "sdpa"
    runners["hf"] = lambda w, m=hf: run_hf(m, w)
    tmp = tempfile.TemporaryDirectory()
    if any(s.startswith("ct2") for s in systems):
        for key, gen in ct2_generators(model, Path(tmp.name), threads).items():
            runners[key] = lambda w, g=gen: run_ct2(g, w)
    concurrency = list(map(int, args.concurrency.split(",")))
    longest = 2 * (48 if args.quick else 128)
    runners.update(llama_runners(model, Path(tmp.name), systems, threads, max(2, *concurrency),
                                 longest))  # fmt: skip
    runners = {k: runners[k] for k in systems if k in runners}
    for run in runners.values():  # warm-up (2 requests): first-call allocations, kernel choices
        run(workload(2, cfg, True, seed=99))
    ratio_cols = [("kiln", s) for s in runners if s != "kiln" and "kiln" in runners]
    if "kiln-int8" in runners:
        ratio_cols += [("kiln-int8", s) for s in EIGHT_BIT if s in runners]
    print(f"\n## {name}: {cfg.num_params() / 1e6:.1f}M parameters, vocab {cfg.vocab_size}, "
          f"{threads} thread(s)")  # fmt: skip
    print("| requests | " + " | ".join(f"{s} tok/s" for s in runners) + " | "
          + " | ".join(f"{a} ÷ {b}" for a, b in ratio_cols) + " |")  # fmt: skip
    print("|---" * (1 + len(runners) + len(ratio_cols)) + "|")
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
        ratios = [tps[a] / tps[b] for a, b in ratio_cols]
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
    print(f"({name}, {threads} thread(s): {time.perf_counter() - started:.0f} s with set-up)")


if __name__ == "__main__":
    main()
