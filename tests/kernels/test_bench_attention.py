"""bench/attention.py: its FLOP count, its naive baseline, and its CPU-only behaviour."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F


def _load_bench():
    """Import bench/attention.py (a script, not a package) as a module."""
    path = Path(__file__).resolve().parents[2] / "bench" / "attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def test_attention_flops():
    # B=1, H=1, T=2, D=3: QKᵀ and PV are 2·T·T·D = 24 FLOPs each.
    assert bench.attention_flops(1, 1, 2, 3, causal=False, backward=False) == 48
    assert bench.attention_flops(1, 1, 2, 3, causal=True, backward=False) == 24
    assert bench.attention_flops(1, 1, 2, 3, causal=False, backward=True) == 48 * 3.5
    assert bench.attention_flops(8, 16, 1024, 64, causal=True, backward=False) == (
        8 * 16 * 4 * 1024**2 * 64 / 2
    )


def test_naive_attention_is_causal_attention():
    q, k, v = torch.randn(3, 2, 3, 10, 8).unbind(0)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(bench.naive_attention(q, k, v), want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the benchmark runs for real")
def test_without_cuda_it_says_so_and_exits_0(capsys):
    assert bench.main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
