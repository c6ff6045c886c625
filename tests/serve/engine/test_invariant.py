"""Fixed-size row tiles: a row's matmul bits do not depend on how many rows share the call
(and do without the tiles, which is why the engine needs them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.serve.engine.invariant import TiledMatmuls, pad_rows, tiled_linear, tiled_matmul
from tests.fixtures import thread_counts

SHAPES = [(256, 768), (256, 4096), (704, 256), (64, 384), (192, 64)]  # demo and test model (K, N)


def crowds(x: torch.Tensor, row: int):
    """Row `row` of x alone, then amid 1..40 other rows at changing positions."""
    yield x[row : row + 1], 0
    for others in range(1, 41):
        at = others // 2  # other rows before and after it
        batch = torch.cat([x[:at], x[row : row + 1], x[row + 1 : row + 1 + others - at]])
        yield batch, at


@pytest.mark.parametrize("rows", [16, 1])
@pytest.mark.parametrize("threads", thread_counts())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiled_row_has_the_same_bits_alone_and_amid_1_to_40_others(dtype, threads, rows) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    for K, N in [*SHAPES, (100, 72)]:  # bf16 1-row tiles of a crowd: unaligned addresses
        weight, bias = torch.randn(N, K).to(dtype), torch.randn(N).to(dtype)
        x = torch.randn(48, K).to(dtype)
        alone = tiled_linear(x[5:6], weight, bias, rows)
        alone_mm = tiled_matmul(x[5:6], weight.t(), rows)
        for batch, at in crowds(x, 5):
            got = tiled_linear(batch, weight, bias, rows)[at]
            assert torch.equal(got, alone[0]), (K, N, len(batch))
            assert torch.equal(tiled_matmul(batch, weight.t(), rows)[at], alone_mm[0])


def test_without_tiles_the_bits_move_with_the_batch() -> None:
    """The premise: one GEMM over all rows gives a row other bits for other row counts."""
    torch.manual_seed(0)
    weight = torch.randn(768, 256)
    x = torch.randn(48, 256)
    alone = F.linear(x[5:6], weight)
    same = [torch.equal(F.linear(b, weight)[at], alone[0]) for b, at in crowds(x, 5)]
    assert not all(same)


def test_tiled_linear_is_linear_to_rounding_and_keeps_the_leading_shape() -> None:
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 19, 32), torch.randn(24, 32), torch.randn(24)
    out = tiled_linear(x, weight, bias, rows=8)
    assert out.shape == (2, 19, 24)
    torch.testing.assert_close(out, F.linear(x, weight, bias))
    assert tiled_linear(x[:0].reshape(0, 32), weight).shape == (0, 24)


def test_the_mode_tiles_linear_layers_and_weight_matmuls_only() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(256, 768)
    w = torch.randn(256, 300)
    x = torch.randn(37, 256)
    with TiledMatmuls(16):
        got_linear, got_mm = layer(x), x @ w
        q, k = torch.randn(2, 5, 8), torch.randn(2, 8, 6)
        batched = q @ k  # not a weight matmul: passed through
    assert torch.equal(got_linear, tiled_linear(x, layer.weight, layer.bias, 16))
    assert torch.equal(got_mm, tiled_matmul(x, w, 16))
    assert torch.equal(batched, q @ k)


def test_pad_rows_rounds_up() -> None:
    assert [pad_rows(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [4, 4, 4, 8, 8, 12]
    assert [pad_rows(n, 16) for n in (1, 16, 17)] == [16, 16, 32]
