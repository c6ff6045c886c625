"""Batch-invariant matmuls: every linear layer multiplies a row count that is a multiple of 4.

CPU GEMM kernels pick their algorithm from the matrix shape: the same row multiplied inside a
batch of 1, 7 or 40 rows gives slightly different results (M = 1 is a matrix-vector kernel,
M = 2 or odd M take other paths). Measured with torch's MKL sgemm (1 and 2 threads, GPT-2 and
demo shapes): once M is a multiple of 4, a row's output is bitwise the same for every such M
and every position in the batch (multiples of 2 are not enough). So the engine pads each
step's packed tokens with dummy rows up to a multiple of `invariant_rows` (default 4), and the
rows it takes logits of likewise: every linear layer of the model then multiplies a multiple
of 4 rows, with no change to the model. The cost: decode of one request does 4 times the matmul work (memory-bound matrix-vector products partly hide it);
from a few rows on it is at most 3 wasted rows. tests/serve/test_engine.py checks the property
end to end, bitwise (and fails with `invariant_rows = 1`).
"""

from __future__ import annotations


def pad_rows(n: int, rows: int) -> int:
    """n rounded up to a multiple of rows (at least rows)."""
    return max(1, -(-n // rows)) * rows
