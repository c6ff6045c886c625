"""The measured premise of batch invariance: padded matmul rows do not depend on the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.serve.invariant import BatchInvariant, tiled_linear


def test_a_row_gets_the_same_bits_in_any_batch() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(384, 64), torch.randn(384)
    x = torch.randn(70, 64)
    alone = tiled_linear(x[5:6], weight, bias, 4)
    for m in (6, 7, 9, 33, 70):
        assert torch.equal(tiled_linear(x[:m], weight, bias, 4)[5:6], alone)
    assert torch.allclose(alone, F.linear(x[5:6], weight, bias), atol=1e-5)


def test_the_mode_routes_linear_layers_only() -> None:
    layer = torch.nn.Linear(8, 3)
    x = torch.randn(2, 5, 8)
    with BatchInvariant(4):
        y = layer(x)
        z = x + 1  # other ops pass through
    assert y.shape == (2, 5, 3) and torch.allclose(y, layer(x), atol=1e-6)
    assert torch.equal(z, x + 1)
