"""kiln.kernels.flash_attention against torch SDPA: output and dq, dk, dv; and its input errors."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.kernels import attention_kernels, flash_attention

# Interpreter blocks are (32, 16); these lengths cover one partial block, exact multiples of the
# blocks and ragged tails across several blocks.
# (B, H, H_kv, T, D)
SHAPES = [
    pytest.param(1, 2, 2, 64, 64, id="mha-even"),
    pytest.param(2, 4, 2, 50, 64, id="gqa2-ragged-batch2"),
    pytest.param(1, 8, 2, 45, 64, id="gqa4-ragged"),
    pytest.param(2, 4, 1, 37, 64, id="mqa-ragged"),
    pytest.param(1, 2, 1, 7, 64, id="shorter-than-a-block"),
    pytest.param(1, 2, 1, 40, 128, id="d128"),
    pytest.param(1, 2, 2, 33, 32, id="d32"),
]


def _inputs(
    B: int, H: int, H_kv: int, T: int, D: int, dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v (leaf tensors needing grad) and an upstream gradient dO."""
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, H, T, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, H_kv, T, D, generator=g) for _ in range(2))
    q, k, v = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
    return q, k, v, do.to(device, dtype)


def _run(fn, q, k, v, do) -> list[torch.Tensor]:
    """[output, dq, dk, dv] of fn(q, k, v) for the upstream gradient do."""
    o = fn(q, k, v)
    return [o, *torch.autograd.grad(o, (q, k, v), do)]


def _sdpa_fp32(q, k, v, do, causal: bool, scale: float | None = None) -> list[torch.Tensor]:
    """The reference: SDPA in fp32 on copies of the inputs, GQA by SDPA's own head mapping."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )

    return _run(sdpa, q, k, v, do.float())


def _assert_matches(got: list[torch.Tensor], want: list[torch.Tensor], atol: float, rtol: float):
    """Output and the three gradients agree, with shapes and dtypes as the inputs'."""
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape, name
        torch.testing.assert_close(
            g.float(), w, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("B", "H", "H_kv", "T", "D"), SHAPES)
def test_fp32_matches_sdpa(B, H, H_kv, T, D, causal, device):
    q, k, v, do = _inputs(B, H, H_kv, T, D, torch.float32, device)
    got = _run(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, do)
    _assert_matches(got, _sdpa_fp32(q, k, v, do, causal), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_half_precision_matches_sdpa(dtype, causal, device):
    q, k, v, do = _inputs(2, 4, 2, 50, 64, dtype, device)
    got = _run(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, do)
    assert all(t.dtype == dtype for t in got)
    # bf16 has 8 mantissa bits (~4e-3 relative): a few roundings of O(1) values, no more.
    _assert_matches(got, _sdpa_fp32(q, k, v, do, causal), atol=5e-2, rtol=5e-2)


def test_explicit_scale(device):
    q, k, v, do = _inputs(1, 2, 1, 40, 64, torch.float32, device)
    got = _run(lambda q, k, v: flash_attention(q, k, v, causal=True, scale=0.3), q, k, v, do)
    _assert_matches(got, _sdpa_fp32(q, k, v, do, True, scale=0.3), atol=2e-5, rtol=1e-4)


def test_strided_layout_from_b_t_h_d(device):
    # A model projects to (B, T, H, D) and transposes: a view with head-dim stride 1, no copy.
    B, T, H, D = 2, 40, 4, 64
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, T, H, D, generator=g).to(device).transpose(1, 2) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = torch.randn(B, H, T, D, generator=g).to(device)
    assert not q.is_contiguous()
    got = _run(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, do)
    _assert_matches(got, _sdpa_fp32(q, k, v, do, True), atol=2e-5, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # later query blocks: NaN
def test_causal_never_reads_tiles_past_the_diagonal(device):
    # NaN keys/values after the first query block: a kernel that computed and then discarded
    # those tiles would spread NaN (0 * NaN) into the first block's rows; skipping them can't.
    block_m = attention_kernels.FWD_CONFIGS[0].kwargs["BLOCK_M"]
    T = 3 * block_m
    q, k, v, _ = _inputs(1, 2, 2, T, 64, torch.float32, device)
    q, k, v = (t.detach().clone() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, :block_m]
    k[:, :, block_m:] = float("nan")
    v[:, :, block_m:] = float("nan")
    got = flash_attention(q, k, v, causal=True)[:, :, :block_m]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def _qkv(shape_q=(1, 2, 16, 64), shape_kv=(1, 2, 16, 64), dtype=torch.float32):
    """Small random q, k, v on the CPU."""
    return torch.randn(shape_q, dtype=dtype), *(torch.randn(shape_kv, dtype=dtype) for _ in "kv")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: _qkv(dtype=torch.float64), r"q\.dtype must be float16, bfloat16 or float32"),
        (lambda: _qkv((1, 2, 16, 48), (1, 2, 16, 48)), r"head dim D must be one of .* got 48"),
        (lambda: _qkv((2, 16, 64), (2, 16, 64)), r"q must be 4-D"),
        (lambda: _qkv((1, 3, 16, 64), (1, 2, 16, 64)), r"q's heads \(3\) must be a multiple"),
        (lambda: _qkv((1, 2, 16, 64), (1, 2, 12, 64)), r"k must have shape \(B=1, H_kv, T=16"),
        (
            lambda: (torch.randn(1, 2, 16, 64), *(torch.randn(1, 2, 64, 16).mT for _ in "kv")),
            r"k must have a contiguous last \(head-dim\) axis",
        ),
        (
            lambda: (
                torch.randn(1, 2, 16, 64),
                torch.randn(1, 2, 16, 64).half(),
                torch.randn(1, 2, 16, 64),
            ),
            r"q, k, v must share a dtype",
        ),
    ],
    ids=["dtype", "head-dim", "rank", "heads", "length", "layout", "mixed-dtype"],
)
def test_unsupported_inputs_raise_value_error(make, match, device):
    q, k, v = (t.to(device) for t in make())
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v)


def test_cpu_tensors_outside_the_interpreter_raise(monkeypatch):
    monkeypatch.setattr(attention_kernels, "INTERPRET", False)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q is on cpu, the Triton kernels need CUDA tensors"):
        flash_attention(q, k, v)


def test_missing_triton_is_an_import_error(monkeypatch):
    import kiln.kernels

    monkeypatch.setattr(kiln.kernels, "triton_available", lambda: False)
    with pytest.raises(ImportError, match=r"pip install 'kiln\[kernels\]'"):
        kiln.kernels.flash_attention(*_qkv())


# One case of each edge of the slow sweep below, small enough for the default run.
@pytest.mark.parametrize(
    ("T", "D", "causal", "dtype"),
    [
        pytest.param(1, 64, True, torch.float32, id="one-token-causal"),
        pytest.param(128, 64, True, torch.bfloat16, id="exact-blocks-bf16-causal"),
        pytest.param(31, 16, False, torch.float32, id="d16-ragged"),
    ],
)
def test_sweep_edges_match_sdpa(T, D, causal, dtype, device):
    q, k, v, do = _inputs(1, 4, 2, T, D, dtype, device, seed=T * D)
    got = _run(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, do)
    tol = 2e-5 if dtype == torch.float32 else 5e-2
    _assert_matches(got, _sdpa_fp32(q, k, v, do, causal), atol=tol, rtol=max(tol, 1e-4))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("D", [16, 64, 128])
@pytest.mark.parametrize("T", [1, 16, 31, 97, 128])
@pytest.mark.parametrize(("H", "H_kv"), [(4, 4), (4, 2), (8, 2), (4, 1)])
def test_sweep_matches_sdpa(H, H_kv, T, D, causal, dtype, device):
    q, k, v, do = _inputs(2, H, H_kv, T, D, dtype, device, seed=T * D + H_kv)
    got = _run(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, do)
    tol = 2e-5 if dtype == torch.float32 else 5e-2
    _assert_matches(got, _sdpa_fp32(q, k, v, do, causal), atol=tol, rtol=max(tol, 1e-4))
