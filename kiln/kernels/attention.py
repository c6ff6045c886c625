"""flash_attention: input checks, kernel launches and the autograd.Function around the kernels."""

import contextlib
import math

import torch
import triton
import triton.language as tl

from kiln.kernels import attention_kernels as kernels

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
LOG2E = 1.4426950408889634


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError naming the argument when (q, k, v) is something the kernels can't take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"flash_attention: {name} must be 4-D (B, heads, T, D), got shape {tuple(t.shape)}"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"flash_attention: {name}.dtype must be float16, bfloat16 or float32, got {t.dtype}"
            )
        if t.stride(-1) != 1:
            raise ValueError(
                f"flash_attention: {name} must have a contiguous last (head-dim) axis (stride 1), "
                f"got strides {t.stride()}; pass {name}.contiguous()"
            )
        if t.device.type != "cuda" and not kernels.INTERPRET:
            raise ValueError(
                f"flash_attention: {name} is on {t.device}, the Triton kernels need CUDA tensors "
                "(or TRITON_INTERPRET=1 set before kiln.kernels is first used)"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"flash_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"flash_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    B, H, T, D = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"flash_attention: k and v must have the same shape, got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(
            f"flash_attention: k must have shape (B={B}, H_kv, T={T}, D={D}) to match q, "
            f"got {tuple(k.shape)}"
        )
    H_kv = k.shape[1]
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(
            f"flash_attention: q's heads ({H}) must be a multiple of k/v's heads ({H_kv})"
        )
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"flash_attention: head dim D must be one of {SUPPORTED_HEAD_DIMS}, got {D}"
        )
    if B * H * T == 0:
        raise ValueError(f"flash_attention: q must be non-empty, got shape {tuple(q.shape)}")


_TRITON_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _dot_options(dtype: torch.dtype) -> dict:
    """The kernels' PRECISION and DOT constexprs for inputs of this dtype."""
    # fp32 inputs get exact fp32 products (like SDPA's default), not tf32.
    precision = "ieee" if dtype == torch.float32 else "tf32"
    # The interpreter's tl.dot is wrong for bf16 (it multiplies bit patterns): use fp32 there.
    dot = tl.float32 if kernels.INTERPRET and dtype == torch.bfloat16 else _TRITON_DTYPES[dtype]
    return {"PRECISION": precision, "DOT": dot}


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel; return the output (B, H, T, D) and the log2-domain LSE (B, H, T)."""
    B, H, T, D = q.shape
    o = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(T, meta["BLOCK_M"]), B * H)

    kernels.attn_fwd_kernel[grid](
        q, k, v, o, lse,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        H, H // k.shape[1], T, scale * LOG2E,
        D=D, CAUSAL=causal, **_dot_options(q.dtype),
    )  # fmt: skip
    return o, lse


def attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the backward kernels (preprocess, dK/dV, dQ); return (dq, dk, dv)."""
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = torch.empty_like(lse)  # (B, H, T) fp32: rowsum(dO * O)
    block = kernels.PREPROCESS_BLOCK
    kernels.attn_bwd_preprocess_kernel[(triton.cdiv(T, block), B * H)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], H, T, D=D, BLOCK_M=block
    )

    dq = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, H_kv, T, D), dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)  # same strides as dk: the kernel takes one set for both
    common = dict(D=D, CAUSAL=causal, **_dot_options(q.dtype))

    def grid_kv(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(T, meta["BLOCK_N"]), B * H_kv)

    kernels.attn_bwd_dkdv_kernel[grid_kv](
        q, k, v, do, dk, dv, lse, delta,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3],
        H, H_kv, H // H_kv, T, scale * LOG2E, scale, **common,
    )  # fmt: skip

    def grid_q(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(T, meta["BLOCK_M"]), B * H)

    kernels.attn_bwd_dq_kernel[grid_q](
        q, k, v, do, dq, lse, delta,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
        H, H // H_kv, T, scale * LOG2E, scale, **common,
    )  # fmt: skip
    return dq, dk, dv


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make t's GPU current: Triton launches on the current device, not the tensors'."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


class FlashAttention(torch.autograd.Function):
    """Exact attention whose backward recomputes probabilities from the saved LSE (FA-2)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:
        """Attention output (B, H, T, D); saves q, k, v, o and the LSE for backward."""
        with _on_device(q):
            o, lse = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.scale = scale
        return o

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, do: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        """Gradients for q, k, v (none for causal and scale)."""
        q, k, v, o, lse = ctx.saved_tensors
        with _on_device(q):
            dq, dk, dv = attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention like SDPA: q (B, H, T, D), k/v (B, H_kv, T, D), H % H_kv == 0 -> (B, H, T, D)."""
    check_inputs(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return FlashAttention.apply(q, k, v, causal, float(scale))
