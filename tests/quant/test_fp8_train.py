"""Emulated fp8 training matmuls: forward and both gradients by hand, delayed scales, a short run."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kiln.errors import KilnError
from kiln.quant import formats
from kiln.quant.formats import E4M3, E5M2, Minifloat
from kiln.quant.fp8_train import Fp8TrainLinear, convert_for_fp8_training, qdq
from tests.fixtures import single_torch_thread
from tests.quant.test_quantize import tiny_model

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)


def test_forward_and_gradients_are_matmuls_of_fp8_rounded_operands() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(128, 48)
    layer = Fp8TrainLinear(linear, "tensor")
    assert layer.weight is linear.weight  # the fp32 master weight itself (a tied head stays tied)
    x = (torch.randn(3, 5, 128, generator=gen) * 3).requires_grad_()
    gy = torch.randn(3, 5, 48, generator=gen) * 1e-3
    y = layer(x)
    xq, wq = qdq(x.detach(), E4M3, "tensor"), qdq(linear.weight.detach(), E4M3, "tensor")
    assert not torch.equal(xq, x.detach())  # the rounding is really there
    assert torch.allclose(y, xq @ wq.T + linear.bias, atol=1e-6)
    y.backward(gy)
    gq = qdq(gy, E5M2, "tensor")  # output gradients in e5m2
    assert torch.allclose(x.grad, gq @ wq, atol=1e-8)
    assert torch.allclose(linear.weight.grad, gq.reshape(-1, 48).T @ xq.reshape(-1, 128), atol=1e-6)
    assert torch.allclose(linear.bias.grad, gy.sum((0, 1)), atol=1e-8)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_the_per_tensor_fast_path_equals_the_exact_codec(fmt: Minifloat) -> None:
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)) * 50
    for amax in (None, torch.tensor(1.0)):  # 1.0: a delayed scale far too small, so saturation
        a = x.abs().amax() if amax is None else amax
        scale = a / fmt.max_normal
        want = formats.decode(formats.encode(x / scale, fmt), fmt) * scale
        assert torch.equal(qdq(x, fmt, "tensor", amax), want)


@pytest.mark.parametrize("scaling", ["1x128", "128x128"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_the_block_fast_path_equals_the_exact_codec(fmt: Minifloat, scaling: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(130, 200, generator=gen) * torch.logspace(-4, 3, 200)  # partial blocks
    x[5, :128] = 0.0  # an all-zero block
    want = formats.quantize_fp8(x, fmt.name, scaling).decode()
    assert torch.equal(qdq(x, fmt, scaling), want)


def test_blockwise_rounds_activations_per_1x128_and_weights_per_tile() -> None:
    layer = Fp8TrainLinear(nn.Linear(256, 16), "blockwise")
    x = torch.randn(4, 256) * torch.logspace(-3, 1, 4)[:, None]  # rows of very different scales
    y = layer(x)
    want = qdq(x, E4M3, "1x128") @ qdq(layer.weight.detach(), E4M3, "128x128").T + layer.bias
    assert torch.allclose(y, want, atol=1e-6)
    per_tensor = qdq(x, E4M3, "tensor")
    assert (qdq(x, E4M3, "1x128") - x)[0].norm() < (per_tensor - x)[0].norm()  # small row kept


def test_delayed_scaling_uses_the_amax_history() -> None:
    layer = Fp8TrainLinear(nn.Linear(8, 8), "delayed")
    big, small = torch.full((2, 8), 100.0), torch.linspace(-1e-4, 1e-4, 16).reshape(2, 8)
    assert torch.equal(
        layer.round(big, "x", E4M3, "tensor"), qdq(big, E4M3, "tensor")
    )  # first: now
    got = layer.round(small, "x", E4M3, "tensor")  # next: the history's max, 100
    assert torch.equal(got, qdq(small, E4M3, "tensor", torch.tensor(100.0)))
    assert not torch.equal(got, qdq(small, E4M3, "tensor"))
    for _ in range(16):  # the big amax ages out after 16 steps
        layer.round(small, "x", E4M3, "tensor")
    assert torch.equal(layer.round(small, "x", E4M3, "tensor"), qdq(small, E4M3, "tensor"))


def test_a_short_fp8_run_tracks_fp32() -> None:
    base = tiny_model().train()
    data = torch.randint(0, 512, (8, 33), generator=torch.Generator().manual_seed(1))
    final = {}
    for recipe in (None, "tensor", "delayed", "blockwise"):
        model = copy.deepcopy(base)
        if recipe is not None:
            assert convert_for_fp8_training(model, recipe) == 4 * model.cfg.n_layer  # head kept
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(20):
            loss = model(data[:, :-1], data[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
        final[recipe] = float(loss.detach())
    assert final[None] < 3.0  # it learned (from ln 512 ≈ 6.2)
    for recipe in ("tensor", "delayed", "blockwise"):
        assert final[recipe] == pytest.approx(final[None], rel=0.05), recipe


def test_a_bad_recipe_fails_clearly() -> None:
    with pytest.raises(
        KilnError, match=r"fp8 training recipe must be one of tensor, delayed, blockwise"
    ):
        convert_for_fp8_training(tiny_model(), "rowwise")
