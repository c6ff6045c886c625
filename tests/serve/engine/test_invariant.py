"""The measured premise of batch invariance: a row's matmul bits do not depend on the batch
once the row count is a multiple of 4 (and do when it is not)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.serve.engine.invariant import pad_rows


def padded_linear(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    m = x.size(0)
    return F.linear(F.pad(x, (0, 0, 0, pad_rows(m, rows) - m)), weight)[:m]


def test_a_row_gets_the_same_bits_in_any_padded_batch() -> None:
    torch.manual_seed(0)
    weight = torch.randn(384, 64)
    x = torch.randn(70, 64)
    alone = padded_linear(x[5:6], weight, 4)
    for m in (6, 7, 9, 33, 70):
        assert torch.equal(padded_linear(x[:m], weight, 4)[5:6], alone)
    unpadded = [torch.equal(padded_linear(x[:m], weight, 1)[5:6], x[5:6] @ weight.t())
                for m in (6, 7, 9, 33, 70)]  # fmt: skip
    assert not all(unpadded)  # the premise is needed: without padding the bits move


def test_pad_rows_rounds_up() -> None:
    assert [pad_rows(n, 4) for n in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 12]
