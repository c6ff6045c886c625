"""Benchmark kiln's Triton flash attention against SDPA's flash backend and naive attention.

Forward and forward+backward TFLOP/s for causal bf16 attention at (B, H, T, D), the ratio to SDPA
flash, and the peak extra memory of one forward+backward (naive materialises the T×T scores).
Prints a markdown table for bench/RESULTS.md. Needs CUDA; on a CPU-only machine it says so and
exits 0.

    python bench/attention.py                         # B=8, H=16, T=1k..16k, D=64 and 128
    python bench/attention.py --lengths 1024 8192 --head-dims 128 --no-naive
"""

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# Run as a script from a plain checkout too (kiln not pip-installed on a freshly lent GPU machine).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin


def attention_flops(B: int, H: int, T: int, D: int, causal: bool, backward: bool) -> float:
    """Matmul FLOPs of attention: 2 matmuls of 2·T²·D forward, 2.5× that backward, /2 causal."""
    forward = 4.0 * B * H * T * T * D
    total = forward * (3.5 if backward else 1.0)
    return total / 2 if causal else total


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention the textbook way, materialising (B, H, T, T) scores."""
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v  # (B, H, T, D)


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch SDPA restricted to its flash-attention backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def kiln_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """kiln.kernels.flash_attention, causal."""
    from kiln.kernels import flash_attention

    return flash_attention(q, k, v, causal=True)


def measure(
    fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool
) -> tuple[float, float]:
    """(milliseconds per call, peak extra GiB) of fn, forward only or forward+backward."""
    import triton.testing

    do = torch.randn_like(q)

    def step() -> None:
        if backward:
            torch.autograd.grad(fn(q, k, v), (q, k, v), do)
        else:
            with torch.no_grad():  # nothing kept for a backward: the inference footprint
                fn(q, k, v)

    step()  # compile / autotune outside the timing and the memory peak
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    ms = triton.testing.do_bench(step, warmup=25, rep=100)
    return ms, peak_gib


def run_one(
    name: str, fn: Callable, shape: tuple[int, int, int, int], backward: bool
) -> tuple[float, float] | None:
    """TFLOP/s and peak GiB for one implementation and shape; None when it runs out of memory."""
    B, H, T, D = shape
    q, k, v = (
        torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    try:
        ms, gib = measure(fn, q, k, v, backward)
    except torch.cuda.OutOfMemoryError:
        print(f"  {name} {shape} backward={backward}: out of memory", file=sys.stderr)
        return None
    finally:
        del q, k, v
        torch.cuda.empty_cache()
    return attention_flops(B, H, T, D, True, backward) / (ms * 1e-3) / 1e12, gib


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and print the table; exit 0 with a note when there is no CUDA."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--no-naive", action="store_true", help="skip naive attention (slow, big)")
    add_noisy_flag(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench/attention.py needs a CUDA GPU (the Triton kernels are compiled for it); skipped"
        )
        return 0
    # The GPU runs the kernels, but the CPU launches them: a busy CPU delays every launch.
    measured = begin("bench/attention.py", args.noisy)

    impls: dict[str, Callable] = {"triton": kiln_triton, "sdpa-flash": sdpa_flash}
    if not args.no_naive:
        impls["naive"] = naive_attention
    print(
        f"# causal bf16 attention, B={args.batch}, H={args.heads}, {torch.cuda.get_device_name()}"
    )
    print()
    header = ["T", "D", "pass", *(f"{n} TFLOP/s" for n in impls), "triton / sdpa"]
    header += [f"{n} GiB" for n in impls]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    memory_notes = []
    for D in args.head_dims:
        for T in args.lengths:
            for backward in (False, True):
                shape = (args.batch, args.heads, T, D)
                results = {n: run_one(n, fn, shape, backward) for n, fn in impls.items()}
                tflops = [f"{r[0]:.1f}" if r else "OOM" for r in results.values()]
                gib = [f"{r[1]:.2f}" if r else "OOM" for r in results.values()]
                ours, ref = results["triton"], results["sdpa-flash"]
                ratio = f"{ours[0] / ref[0]:.2f}×" if ours and ref else "-"
                pass_name = "fwd+bwd" if backward else "fwd"
                cells = " | ".join([str(T), str(D), pass_name, *tflops, ratio, *gib])
                print(f"| {cells} |", flush=True)
                naive = results.get("naive")
                if backward and ours and naive:
                    memory_notes.append(
                        f"T={T}, D={D}: naive uses {naive[1] / ours[1]:.1f}× triton's memory"
                    )
    print()
    print("\n".join(f"- {note} (fwd+bwd)" for note in memory_notes))
    print(measured.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
