"""Batch-invariant linear layers: every matmul runs on tiles of a fixed number of rows.

CPU GEMM kernels pick their blocking (and so the order of the floating-point sums) from the
matrix shape: the same row multiplied inside a batch of 1, 7 or 40 rows gives slightly different
results. Inside this mode every `F.linear` on plain tensors pads its rows up to a multiple of
`rows` and runs one batched matmul over tiles of exactly `rows` rows, so a row's output depends
only on that row, not on how many others share the step. The cost: a step with fewer rows than
`rows` computes the padding too (decode of one request does `rows` times the matmul work, which
memory-bound matrix-vector products partly hide).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode


def tiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> Tensor:
    """x (..., K) @ weight (N, K)ᵀ + bias, computed as (tiles, rows, K) batched matmuls."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])  # (M, K)
    M = flat.size(0)
    tiles = max(1, -(-M // rows))
    if tiles * rows != M:
        flat = F.pad(flat, (0, 0, 0, tiles * rows - M))
    w = weight.t()  # (K, N)
    out = torch.bmm(flat.view(tiles, rows, -1), w.expand(tiles, *w.shape))  # (tiles, rows, N)
    out = out.view(tiles * rows, -1)[:M]
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], out.size(-1))


class BatchInvariant(TorchFunctionMode):
    """Run `F.linear` on plain tensors as `tiled_linear` (other ops and tensor types untouched)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Intercept F.linear; quantized weights (tensor subclasses) keep their own kernels."""
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            plain = type(weight) in (Tensor, torch.nn.Parameter)
            if plain and type(x) is Tensor:
                return tiled_linear(x, weight, bias, self.rows)
        return func(*args, **kwargs)
