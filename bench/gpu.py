"""The GPU figures in one run: GPT-2-124M training MFU in bf16 and fp8, kiln's Triton flash kernel
against SDPA. One JSON line per figure; under 10 minutes on one H100/H200.

    .venv/bin/python bench/gpu.py                  # on a CUDA machine: every entry
    .venv/bin/python bench/gpu.py --only mfu_bf16  # some entries
    .venv/bin/python bench/gpu.py --dry-run        # on a CPU: check every path, measure nothing

Each figure is an `Entry` in `ENTRIES`: a name, what it measures, a `check` for --dry-run (the
configs build, the model's shapes, the kernels it selects, a tiny CPU run of the same code) and a
`run` that measures on the device and returns the figure's records. Other work adds entries
there (the serving race below; the CPU speedrun's recipe at one H200-hour, which alone trains
60 minutes, so it is `long`: measured only with --only speedrun_h200_60m, checked by --dry-run
like the others; --speedrun-minutes shortens it). The MFU runs are bench/mfu.py's: kiln's Trainer on
bench/train.py's TinyStories shards, tokens/s and MFU from the trainer's own metrics.jsonl (MFU
against the device's bf16 dense peak, for fp8 too: it says how much faster the same model
trains, not how full the fp8 units are). The attention figure is bench/attention.py's
measurement at the GPT-2 shape (B=8, H=12, T=1024, D=64) and at T=8192, D=128.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._load import add_noisy_flag, begin  # noqa: E402

GPT2 = ["model.preset=gpt2-124m", "model.vocab_size=50304", "model.block_size=1024",
        "data.seq_len=1024"]  # fmt: skip
ATTENTION_SHAPES = [(8, 12, 1024, 64), (4, 16, 8192, 128)]  # (B, H, T, D)


@dataclass
class Entry:
    """One figure: `check(args)` proves the path on a CPU, `run(args)` measures on the device."""

    name: str
    what: str
    check: Callable[[argparse.Namespace], dict[str, Any]]
    run: Callable[[argparse.Namespace], list[dict[str, Any]]]
    long: bool = False  # over the 10 minutes: measured only when --only names it


# ---- MFU: GPT-2-124M training --------------------------------------------------------------------


def mfu_settings(args: argparse.Namespace, fp8: str, compile_: bool) -> list[str]:
    """The --set overrides of one measured GPT-2-124M run."""
    return [
        *GPT2, f"batch.micro_batch={args.micro_batch}", f"batch.global_tokens={args.global_tokens}",
        f"train.max_steps={args.steps}", "train.device=cuda", "train.dtype=bf16",
        f"train.compile={str(compile_).lower()}", f"train.fp8={fp8}", "logging.every=5",
        "optim.fused=true", "logging.progress=false", "eval.batches=0", "eval.sample_tokens=0",
        "checkpoint.every=0",
    ]  # fmt: skip


def mfu_config(args: argparse.Namespace, fp8: str, compile_: bool, data: str, run: str) -> Any:
    """The TrainConfig of one MFU run (configs/tiny.toml with GPT-2-124M settings)."""
    from kiln.train.config import load_train_config

    sets = [f"data.dataset={data}", f"logging.run_dir={run}", *mfu_settings(args, fp8, compile_)]
    return load_train_config(ROOT / "configs" / "tiny.toml", sets)


def check_mfu(fp8: str, compile_: bool) -> Callable[[argparse.Namespace], dict[str, Any]]:
    """--dry-run of an MFU entry: config, 124M parameters on meta, fp8 layers, a tiny CPU step."""

    def check(args: argparse.Namespace) -> dict[str, Any]:
        import torch

        from kiln.model import Transformer
        from kiln.quant import fp8_train

        cfg = mfu_config(args, fp8, compile_, "/nonexistent/data", "/nonexistent/run")
        model_cfg = cfg.model_config(50304)
        n = model_cfg.num_params()
        assert 120e6 < n < 130e6, f"gpt2-124m has {n:,} parameters"
        with torch.device("meta"):
            model = Transformer(model_cfg)
        out: dict[str, Any] = {"params": n, "flops_per_token": model_cfg.flops_per_token(1024)}
        if fp8 != "off":
            info = fp8_train.enable_fp8_training(model, fp8, torch.device("cpu"))
            layers = [m for m in model.modules() if isinstance(m, fp8_train.Fp8TrainLinear)]
            bad = [m for m in layers if m.in_features % 16 or m.out_features % 16]
            assert not bad, f"{len(bad)} fp8 layers have dims _scaled_mm cannot take (% 16)"
            recipe = fp8_train.TRAIN_MODES[fp8]
            out |= {"fp8_layers": info["layers"], "cpu_backend": info["backend"],
                    "cuda_backend": "scaled_mm" if recipe != "blockwise" else "emulated"}  # fmt: skip
            out["tiny_step_loss"] = tiny_fp8_step(fp8)
        return out

    return check


def tiny_fp8_step(mode: str) -> float:
    """Two optimizer steps of a tiny model under train.fp8 = mode on the CPU (the same layers)."""
    import torch

    from kiln.model import ModelConfig, Transformer
    from kiln.quant.fp8_train import enable_fp8_training

    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny", vocab_size=256, block_size=32))
    enable_fp8_training(model, mode, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 256, (2, 33))
    for _ in range(2):
        loss = model(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert math.isfinite(loss.item())
    return round(loss.item(), 4)


def run_mfu(fp8: str, compile_: bool) -> Callable[[argparse.Namespace], list[dict[str, Any]]]:
    """Train GPT-2-124M for --steps on the device; the median tokens/s and MFU after warm-up."""

    def run(args: argparse.Namespace) -> list[dict[str, Any]]:
        from bench.train import prepare
        from kiln.train.trainer import Trainer

        data = prepare(args.cache)
        run_dir = Path(tempfile.mkdtemp(prefix="kiln-gpu-mfu-"))
        trainer = Trainer(mfu_config(args, fp8, compile_, str(data), str(run_dir)), run_dir)
        trainer.run()
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        steady = [json.loads(line) for line in lines][1:]  # the first window: compile, warm-up
        mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
        return [{
            "value": statistics.median(mfus) if mfus else None, "unit": "MFU (bf16 peak)",
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "params": trainer.model_cfg.num_params(), "fp8": trainer.fp8,
            "compile": compile_, "micro_batch": trainer.cfg.batch.micro_batch,
            "windows": len(steady),
        }]  # fmt: skip

    return run


# ---- attention: the Triton flash kernel against SDPA --------------------------------------------


def check_attention(args: argparse.Namespace) -> dict[str, Any]:
    """--dry-run: triton importable, the bench shapes accepted, the kernel == SDPA on a tiny CPU case
    (TRITON_INTERPRET=1, set by main before kiln.kernels is imported)."""
    import torch
    import torch.nn.functional as F

    from kiln import kernels

    if not kernels.triton_available():
        return {"triton": False, "note": "triton is not installed: the entry would fail"}
    from kiln.kernels.attention import check_inputs

    for B, H, T, D in ATTENTION_SHAPES:
        q = torch.empty(B, H, T, D, dtype=torch.bfloat16)
        check_inputs(q, q, q)  # the interpreter accepts CPU tensors; the shapes are the device's
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 64, generator=gen) for _ in range(3))
    ours = kernels.flash_attention(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    err = float((ours - ref).abs().max())
    assert err < 1e-4, f"the interpreted kernel differs from SDPA by {err}"
    return {"triton": True, "shapes": ATTENTION_SHAPES, "interpreted_max_abs_err": err}


def run_attention(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Forward+backward TFLOP/s of kiln's Triton kernel and SDPA flash at ATTENTION_SHAPES."""
    import torch

    from bench.attention import attention_flops, kiln_triton, measure, sdpa_flash

    records = []
    for B, H, T, D in ATTENTION_SHAPES:
        tflops = {}
        for name, fn in (("triton", kiln_triton), ("sdpa_flash", sdpa_flash)):
            q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))  # fmt: skip
            ms, _ = measure(fn, q, k, v, backward=True)
            tflops[name] = attention_flops(B, H, T, D, True, True) / (ms * 1e-3) / 1e12
            del q, k, v
        records.append({
            "value": tflops["triton"] / tflops["sdpa_flash"], "unit": "triton / sdpa (fwd+bwd)",
            "shape": [B, H, T, D], "triton_tflops": tflops["triton"],
            "sdpa_flash_tflops": tflops["sdpa_flash"],
        })  # fmt: skip
    return records


# ---- the CPU speedrun's recipe at one H200-hour ------------------------------------------------

SPEEDRUN_H200 = ROOT / "configs" / "speedrun_h200_60m.toml"
# The plan's prediction for the holdout bpb (docs/speedrun.md, "At larger budgets"): the fit of
# real CPU runs, data-constrained (1.44M unique tokens), extrapolated far beyond its runs.
SPEEDRUN_H200_EXPECTED_BPB = 0.70


def speedrun_h200_config(args: argparse.Namespace, data: str, run: str) -> Any:
    """configs/speedrun_h200_60m.toml on the speedrun's data, --speedrun-minutes of training."""
    from kiln.train.config import load_train_config

    sets = [f"data.dataset={data}", f"logging.run_dir={run}", "logging.progress=false",
            f"train.time_budget={args.speedrun_minutes * 60:g}"]  # fmt: skip
    return load_train_config(SPEEDRUN_H200, sets)


def check_speedrun_h200(args: argparse.Namespace) -> dict[str, Any]:
    """--dry-run: the config loads, its shape on meta, its memory fits the H200, a bpb expected."""
    import torch

    from kiln.hardware import accelerator
    from kiln.model import Transformer
    from kiln.model.accounting import memory_estimate

    cfg = speedrun_h200_config(args, "/nonexistent/data", "/nonexistent/run")
    model_cfg = cfg.model_config(4096)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    params = sum(p.numel() for p in model.parameters())
    assert params == model_cfg.num_params(), "the accounting and the model disagree"
    mem = memory_estimate(model_cfg, cfg.batch.micro_batch, cfg.data.seq_len)
    h200 = accelerator("h200")
    assert mem.total < 0.8 * h200.memory_bytes, f"{mem.total / 2**30:.1f} GiB will not fit"
    assert cfg.train.device == "cuda" and cfg.train.dtype == "bf16"
    assert model_cfg.mup_base_width == 256, "the lr is µP-transferred from the 256-wide demo"
    assert 0.3 < SPEEDRUN_H200_EXPECTED_BPB < 2.0, "the entry states the fit's expected bpb"
    return {"params": params, "n_layer": model_cfg.n_layer, "n_embd": model_cfg.n_embd,
            "memory_gib": round(mem.total / 2**30, 2), "expected_bpb": SPEEDRUN_H200_EXPECTED_BPB,
            "budget_s": cfg.train.budget_seconds}  # fmt: skip


def run_speedrun_h200(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train the H200 recipe for --speedrun-minutes; holdout and valid bpb as the CPU speedrun."""
    import torch

    from bench.speedrun import EOT, VALID_TEXT, prepare, split_stories
    from kiln.eval.lm import stream_bits_per_byte
    from kiln.eval.scoring import Scorer
    from kiln.tokenizer import Tokenizer
    from kiln.train.trainer import Trainer

    cache = Path("/tmp/kiln-speedrun")
    prep = prepare(cache, "4096")
    run_dir = Path(tempfile.mkdtemp(prefix="kiln-gpu-speedrun-"))
    trainer = Trainer(speedrun_h200_config(args, f"{prep['dir']}/data", str(run_dir)), run_dir)
    result = trainer.run()
    tok = Tokenizer.load(Path(prep["dir"]) / "tokenizer.json")
    scorer = Scorer(trainer.model.eval(), batch_size=64, progress=False)
    bpb = {}
    with torch.no_grad():
        for name, path in (("holdout", split_stories(cache)[1]), ("valid", VALID_TEXT)):
            bpb[name] = stream_bits_per_byte(scorer, tok, path, tok.special_tokens[EOT])
    return [{
        "value": bpb["valid"].bits_per_byte, "unit": "valid bits per byte",
        "holdout_bpb": bpb["holdout"].bits_per_byte, "expected_bpb": SPEEDRUN_H200_EXPECTED_BPB,
        "steps": result.step, "tokens": result.tokens, "train_s": trainer.train_seconds,
        "epochs": result.tokens / prep["train_tokens"], "params": trainer.model_cfg.num_params(),
    }]  # fmt: skip


# ---- serving: kiln's engine against HF generate and vLLM ---------------------------------------


SERVE_REQUESTS, SERVE_NEW_TOKENS = 32, 64


def serve_systems(device: str, cfg: Any, dtype: Any) -> dict[str, Callable[[Any], float]]:
    """kiln's engine (invariant and fast path), HF generate and, where installed, vLLM: each a
    function of the workload returning seconds, all on the same weights."""
    import torch

    from bench.serve import run_kiln
    from kiln.model import Transformer
    from kiln.model.hf import save_hf_dir, to_hf
    from kiln.serve.engine import Engine, EngineConfig

    torch.manual_seed(0)
    model = Transformer(cfg).to(device=device, dtype=dtype).eval()
    systems: dict[str, Callable[[Any], float]] = {}
    for name, invariant in (("kiln", True), ("kiln-variant", False)):
        engine = Engine(model, None, EngineConfig(batch_invariant=invariant, max_num_seqs=64))
        systems[name] = lambda work, engine=engine: run_kiln(engine, work)
    hf = to_hf(model).to(device=device, dtype=dtype).eval()

    def run_hf(work: Any) -> float:
        prompts, outs = work
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, device=device)
            mask[row, width - len(prompt) :] = 1
        started = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(outs),
                        min_new_tokens=max(outs), do_sample=False, pad_token_id=0)  # fmt: skip
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    systems["hf"] = run_hf
    try:
        import vllm  # type: ignore[import-not-found]
    except ImportError:
        return systems
    folder = Path(tempfile.mkdtemp(prefix="kiln-vllm-"))
    save_hf_dir(model.float(), folder)
    llm = vllm.LLM(model=str(folder), dtype="bfloat16", skip_tokenizer_init=True)

    def run_vllm(work: Any) -> float:
        prompts, outs = work
        params = [vllm.SamplingParams(max_tokens=o, min_tokens=o, temperature=0.0,
                                      ignore_eos=True) for o in outs]  # fmt: skip
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - started

    systems["vllm"] = run_vllm
    return systems


def check_serve(args: argparse.Namespace) -> dict[str, Any]:
    """--dry-run: every system runs a tiny model's workload on the CPU, and kiln's engine gives
    `kiln.model.generate`'s greedy tokens."""
    import torch

    from bench.serve import workload
    from kiln.model import ModelConfig, Transformer
    from kiln.serve.engine import Engine, EngineConfig, SamplingParams

    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=256, block_size=128)
    work = workload(4, cfg, quick=True, seed=0)
    work = (work[0], [8] * len(work[0]))
    seconds = {name: run(work) for name, run in serve_systems("cpu", cfg, torch.float32).items()}
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    engine = Engine(model, None, EngineConfig(batch_invariant=False))
    done = engine.generate(work[0], [SamplingParams(max_tokens=8, temperature=0) for _ in work[0]])
    from kiln.model.generate import generate

    reference = generate(model, work[0], 8, temperature=0.0)
    assert [list(c[0].token_ids) for c in done] == [list(r) for r in reference], (
        "engine != generate"
    )
    return {
        "systems": sorted(seconds),
        "vllm": "vllm" in seconds,
        "note": "vLLM runs only where it is installed (its wheel is over the device's 64 MiB carry)",
    }


def run_serve(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Decode tokens/s at 32 requests (16-128-token prompts) x 64 new tokens, GPT-2-124M, bf16."""
    import torch

    from bench.serve import workload
    from kiln.model import ModelConfig

    cfg = ModelConfig()
    work = workload(SERVE_REQUESTS, cfg, quick=False, seed=0)
    work = (work[0], [SERVE_NEW_TOKENS] * SERVE_REQUESTS)
    systems = serve_systems("cuda", cfg, torch.bfloat16)
    tokens = SERVE_REQUESTS * SERVE_NEW_TOKENS
    rates = {}
    for name, run in systems.items():
        run(work)  # warm-up: kernels, allocator, CUDA graphs where a system makes them
        rates[name] = tokens / statistics.median(run(work) for _ in range(3))
    return [{"value": rates[name], "unit": "tokens/s", "system": name,
             "ratio_kiln": rates["kiln-variant"] / rates[name]} for name in rates]  # fmt: skip


ENTRIES: list[Entry] = [
    Entry("mfu_bf16", "GPT-2-124M training MFU, bf16 autocast, torch.compile",
          check_mfu("off", True), run_mfu("off", True)),
    Entry("mfu_bf16_eager", "the same without compile (the fp8 runs' baseline)",
          check_mfu("off", False), run_mfu("off", False)),
    Entry("mfu_fp8_tensor", "GPT-2-124M MFU, train.fp8 = tensor (torch._scaled_mm), eager",
          check_mfu("tensor", False), run_mfu("tensor", False)),
    Entry("mfu_fp8_tensor_delayed", "GPT-2-124M MFU, train.fp8 = tensor_delayed, eager",
          check_mfu("tensor_delayed", False), run_mfu("tensor_delayed", False)),
    Entry("attention_triton_vs_sdpa", "kiln's Triton flash kernel against SDPA flash, causal bf16",
          check_attention, run_attention),
    Entry("serve_engine_vs_hf_vllm", "decode tokens/s, 32 requests x 64 tokens, GPT-2-124M bf16: "
          "kiln's engine vs HF generate (and vLLM where installed)", check_serve, run_serve),
    Entry("speedrun_h200_60m", "the CPU speedrun's recipe at 1 H200-hour (configs/"
          "speedrun_h200_60m.toml): valid bpb against the fit's expected bpb; 60 min + scoring",
          check_speedrun_h200, run_speedrun_h200, long=True),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Check (--dry-run) or measure the chosen entries; one JSON line per figure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check every path on a CPU")
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=[e.name for e in ENTRIES])
    parser.add_argument("--steps", type=int, default=30, help="steps of each MFU run")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--global-tokens", type=int, default=16 * 1024 * 4)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/kiln-bench-train"))
    parser.add_argument(
        "--speedrun-minutes",
        type=float,
        default=60.0,
        help="training minutes of speedrun_h200_60m (default 60, its recipe's)",
    )
    add_noisy_flag(parser)
    args = parser.parse_args(argv)
    entries = [e for e in ENTRIES if e.name in args.only] if args.only else ENTRIES
    if not args.dry_run and not args.only:
        entries = [e for e in entries if not e.long]
    if args.dry_run:  # before kiln.kernels is imported: the Triton kernels run interpreted
        os.environ.setdefault("TRITON_INTERPRET", "1")
        failed = 0
        for entry in entries:
            started = time.perf_counter()
            try:
                detail, ok = entry.check(args), True
            except Exception as exc:  # a broken path is reported as this entry's result
                detail, ok = {"error": f"{type(exc).__name__}: {exc}"}, False
                failed += 1
            seconds = round(time.perf_counter() - started, 2)
            print(json.dumps({"entry": entry.name, "dry_run": True, "ok": ok,
                              "seconds": seconds, **detail}))  # fmt: skip
        return 1 if failed else 0
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA device (or --dry-run on a CPU); nothing measured")
        return 1
    measured = begin("bench/gpu.py", args.noisy)
    device = torch.cuda.get_device_name()
    for entry in entries:
        started = time.perf_counter()
        try:
            records = entry.run(args)
        except Exception as exc:  # one failed figure must not lose the others
            records = [{"error": f"{type(exc).__name__}: {exc}"}]
        for record in records:
            doc = {"figure": entry.name, "what": entry.what, "device": device, **record,
                   "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
            print(json.dumps(measured.stamp(doc)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
