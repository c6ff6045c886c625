"""Batch-invariant linear layers: every matmul runs on a row count that is a multiple of 4.

CPU GEMM kernels pick their algorithm from the matrix shape: the same row multiplied inside a
batch of 1, 7 or 40 rows gives slightly different results (M = 1 is a matrix-vector kernel,
M = 2 or odd M take other paths). Measured with torch's MKL sgemm (1 and 2 threads, GPT-2 and
demo shapes): once M is a multiple of 4, a row's output is bitwise the same for every such M
and every position in the batch (multiples of 2 are not enough). So inside this mode every
`F.linear` on plain tensors pads its rows with zeros up to a multiple of `rows` (the engine's
`invariant_rows`, default 4) and then runs as one ordinary matmul. The cost: decode of one
request does 4 times the matmul work (memory-bound matrix-vector products partly hide it);
from a few rows on it is at most 3 wasted rows. tests/serve/test_engine.py checks the property
end to end, bitwise (and fails with `invariant_rows = 1`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode


def tiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> Tensor:
    """F.linear(x, weight, bias) with x's rows padded to a multiple of `rows` (then cut)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])  # (M, K)
    M = flat.size(0)
    padded = max(1, -(-M // rows)) * rows
    if padded != M:
        flat = F.pad(flat, (0, 0, 0, padded - M))
    out = F.linear(flat, weight, bias)[:M]  # (M, N)
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
