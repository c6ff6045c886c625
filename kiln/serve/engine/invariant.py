"""Batch-invariant matmuls: every matmul runs over row tiles of one fixed size, one GEMM per tile.

CPU GEMM libraries pick their kernel, blocking and threading from the shape: the same row
multiplied inside a batch of 1, 7 or 40 rows can come out with other bits. Padding the row count
to a multiple of 4 was enough for MKL's AVX2 sgemm on an AMD EPYC, but not under
`MKL_CBWR=COMPATIBLE` (measured here) nor, reportedly, on Intel AVX-512/AMX, where sgemm picks
its blocking from M. So in batch-invariant mode the engine runs the model under `TiledMatmuls`:
every `F.linear` (all linear layers, the LM head, the MoE router) and every 2-D matmul (MoE
experts) copies its rows into a fresh zero-padded buffer of whole tiles and multiplies tile by
tile, each tile its own GEMM call of shape (rows, K) x (K, N). The BLAS then sees one (M, K, N)
per weight whatever the batch, with 64-byte aligned inputs (rows = 16, fp32 or bf16 with even
K), so a row's bits depend only on the row. Tiles are separate calls rather than one bmm over a
tile dimension: a batched GEMM may thread or block by the batch count, separate calls cannot.

A torch-function mode (thread-local, entered by the engine around its forward) keeps this out
of the model: `kiln.model` never imports serve, and the same model trains and serves unchanged.
Attention is not a matmul the mode sees: `PagedStep.attend` computes it per sequence with
shapes fixed by the sequence alone (see paged_cache.py).

Guarantee: bitwise-equal logits rows for a seeded request alone or in any batch, fp32 and bf16,
1 and 2 threads, verified with torch 2.13 / MKL 2024.2 / oneDNN 3.12 under default and capped
ISAs and MKL_CBWR=COMPATIBLE (docs/engine.md). Cost: decode at batch 1 does 16 rows of GEMM
work for one token (0.40x the fast path, measured quiet on the demo-size model); at batch 32
0.68x (bench/RESULTS.md, "Quiet re-measurement"). A 1-row tile (`invariant_rows=1`: one GEMV
per row, as invariant) cuts a batch-1 step by about a third and slows batch 32 (docs/engine.md).

A fixed tile shape is not always enough: on an Intel AVX-512/AMX CPU, MKL's AVX2 sgemm with 2
threads gives rows 6, 7, 14 and 15 of a (16, 192) x (192, 64) tile other bits than the other
rows (each thread's 8 rows run as a 6-row kernel plus a 2-row edge). So each (shape, dtype,
layout, threads) is probed once, on first use: one row at every position of a tile. Where its
bits move with the position, that weight falls back to 1-row tiles (GEMVs: no position to
depend on); `fallbacks()` lists those.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

# The tile: 16 keeps every tile 64-byte aligned in fp32; 8 measured no faster (under load).
ROWS = 16

_MATMULS = {torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.mm, Tensor.mm}


def pad_rows(n: int, rows: int) -> int:
    """n rounded up to a multiple of rows (at least rows)."""
    return max(1, -(-n // rows)) * rows


def _tiles(x: Tensor, rows: int) -> Tensor:
    """x (N, K) as whole tiles (pad_rows(N), K), 64-byte aligned: x itself when it already is
    (the engine pads its rows to whole tiles), else a fresh zero buffer with x copied in."""
    n = x.size(0)
    if n and n % rows == 0 and x.is_contiguous() and x.data_ptr() % 64 == 0:
        return x  # the very call a copy would make: same shape, strides and alignment
    buf = x.new_zeros(pad_rows(n, rows), x.size(1))  # fresh: 64-byte aligned
    buf[:n] = x
    return buf


def _per_tile(buf: Tensor, rows: int, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """fn applied to each (rows, K) tile of buf, the results stacked (one tile: no copy)."""
    if len(buf) == rows:
        return fn(buf)
    return torch.cat([fn(buf[i : i + rows]) for i in range(0, len(buf), rows)])


def tiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, rows: int = ROWS) -> Tensor:
    """F.linear(x, weight, bias) computed one (rows, K) tile at a time: row bits batch-free."""
    lead, K = x.shape[:-1], x.size(-1)
    flat = x.reshape(-1, K)  # (N, K)
    n = flat.size(0)
    rows = _safe_rows(rows, "linear", weight, bias is not None, x.dtype)
    out = _per_tile(_tiles(flat, rows), rows, lambda tile: F.linear(tile, weight, bias))
    return out[:n].view(*lead, out.size(-1))  # (..., N_out)


def tiled_matmul(a: Tensor, b: Tensor, rows: int = ROWS) -> Tensor:
    """a (..., K) @ b (K, N) computed one (rows, K) tile of a's rows at a time."""
    lead = a.shape[:-1]
    flat = a.reshape(-1, a.size(-1))
    rows = _safe_rows(rows, "matmul", b, False, a.dtype)
    out = _per_tile(_tiles(flat, rows), rows, lambda tile: tile @ b)
    return out[: flat.size(0)].view(*lead, b.size(-1))


def fallbacks() -> list[tuple[str, tuple[int, ...], str, int, int]]:
    """The (op, weight shape, dtype, threads, rows) this process probed and runs as 1-row tiles."""
    return sorted(_FALLBACKS)


_FALLBACKS: set[tuple[str, tuple[int, ...], str, int, int]] = set()  # a record of probe results


def _safe_rows(rows: int, op: str, w: Tensor, bias: bool, dtype: torch.dtype) -> int:
    """rows, or 1 where this BLAS gives a row bits that depend on its place in the tile."""
    if rows == 1:
        return 1
    threads = torch.get_num_threads()
    key = (op, tuple(w.shape), w.is_contiguous(), bias, dtype, w.dtype, rows, threads)
    if _position_free(*key):
        return rows
    _FALLBACKS.add((op, tuple(w.shape), str(dtype), threads, rows))
    return 1


@functools.cache
def _position_free(
    op: str, shape: tuple[int, ...], contiguous: bool, bias: bool, dtype: torch.dtype,
    w_dtype: torch.dtype, rows: int, threads: int,
) -> bool:  # fmt: skip
    """Whether one row gets the same bits at every position of a (rows, K) tile (probed once:
    the kernel, not the values, decides; the key is all a CPU BLAS chooses its kernel by)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape[::-1] if not contiguous else shape, generator=g).to(w_dtype)
    w = w if contiguous else w.t()  # the same layout as the real weight
    b = torch.randn(shape[0], generator=g).to(w_dtype) if bias else None
    K = shape[1] if op == "linear" else shape[0]
    row = torch.randn(K, generator=g).to(dtype)
    first = None
    for pos in range(rows):
        tile = torch.randn(rows, K, generator=g).to(dtype)
        tile[pos] = row
        got = (F.linear(tile, w, b) if op == "linear" else tile @ w)[pos]
        if first is None:
            first = got
        elif not torch.equal(got, first):
            return False
    return True


class TiledMatmuls(TorchFunctionMode):
    """Inside this mode, F.linear and (..., K) @ (K, N) matmuls run as fixed-size row tiles."""

    def __init__(self, rows: int = ROWS) -> None:
        super().__init__()
        self.rows = rows

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        """Route linear layers and weight matmuls through the tiles; everything else as is."""
        kwargs = kwargs or {}
        if func is F.linear:
            given = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
            return tiled_linear(given["input"], given["weight"], given.get("bias"), self.rows)
        if func in _MATMULS and not kwargs:
            a, b = args
            if isinstance(b, Tensor) and b.dim() == 2 and a.dim() >= 2 and a.numel() > 0:
                return tiled_matmul(a, b, self.rows)
        return func(*args, **kwargs)
