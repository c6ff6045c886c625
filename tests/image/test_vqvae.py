"""The VQ-VAE: shapes, nearest codes, straight-through gradients, EMA, dead-code restarts, PSNR."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.config import ConfigError
from kiln.image.vqvae import VQVAE, Quantizer, VQVAEConfig, psnr, to_uint8, to_unit


def _tiny(**kw) -> VQVAEConfig:
    return VQVAEConfig(**{"image_size": 16, "hidden": 8, "codebook_size": 16, "code_dim": 4, **kw})


def test_codes_are_a_grid_and_decode_to_images() -> None:
    torch.manual_seed(0)
    model = VQVAE(_tiny()).eval()
    x = torch.rand(3, 3, 16, 16) * 2 - 1
    codes = model.encode(x)
    assert codes.shape == (3, 4, 4) and codes.dtype == torch.long
    out = model.decode(codes)
    assert out.shape == (3, 3, 16, 16) and out.min() >= -1 and out.max() <= 1


def test_nearest_code_is_the_closest_codebook_row() -> None:
    torch.manual_seed(1)
    q = Quantizer(_tiny())
    z = torch.randn(50, 4)
    expected = torch.cdist(z, q.codebook).argmin(1)
    assert torch.equal(q.codes(z), expected)


@pytest.mark.parametrize("ema", [True, False])
def test_gradients_pass_the_quantizer_to_the_encoder(ema: bool) -> None:
    torch.manual_seed(2)
    model = VQVAE(_tiny(ema=ema)).train()
    _, stats = model(torch.rand(4, 3, 16, 16) * 2 - 1)
    stats["loss"].backward()
    assert model.encoder[0].weight.grad is not None
    assert model.encoder[0].weight.grad.abs().sum() > 0
    codebook = model.quantizer.codebook
    assert isinstance(codebook, torch.nn.Parameter) != ema  # EMA: a buffer, not learnt by SGD
    if not ema:
        assert codebook.grad is not None and codebook.grad.abs().sum() > 0


def test_ema_moves_the_chosen_code_toward_its_vectors() -> None:
    cfg = _tiny(codebook_size=2, code_dim=2, ema_decay=0.5)
    q = Quantizer(cfg).train()
    with torch.no_grad():
        q.codebook.copy_(torch.tensor([[0.0, 0.0], [10.0, 10.0]]))
        q.ema_sum.copy_(q.codebook * q.ema_count.unsqueeze(1))
    z = torch.full((1, 2, 1, 4), 1.0)  # four vectors at (1, 1): all nearest code 0
    for _ in range(12):
        q(z)
    assert torch.allclose(q.codebook[0], torch.tensor([1.0, 1.0]), atol=1e-2)
    assert torch.allclose(q.codebook[1], torch.tensor([10.0, 10.0]), rtol=0.05)  # unchosen: kept


def test_dead_codes_restart_on_encoder_outputs() -> None:
    torch.manual_seed(3)
    cfg = _tiny(codebook_size=8, code_dim=2, dead_threshold=1.0)
    q = Quantizer(cfg).train()
    z = torch.randn(2, 2, 4, 4) * 0.01 + 5.0  # every vector picks the same code
    _, _, stats = q(z)
    assert int(stats["used"]) == 1
    restarted = q.restart_dead(z)
    assert restarted == 7
    rows = z.permute(0, 2, 3, 1).reshape(-1, 2)
    moved = [c for c in q.codebook if (rows == c).all(1).any()]
    assert len(moved) == 7  # the dead ones now sit on batch vectors
    _, _, stats = q(z + torch.randn_like(z))
    assert int(stats["used"]) > 1


def test_perplexity_counts_equally_used_codes() -> None:
    cfg = _tiny(codebook_size=4, code_dim=1)
    q = Quantizer(cfg).eval()
    with torch.no_grad():
        q.codebook.copy_(torch.tensor([[0.0], [1.0], [2.0], [3.0]]))
    _, idx, stats = q(torch.tensor([0.0, 1.0, 2.0, 3.0]).reshape(1, 1, 2, 2))
    assert idx.flatten().tolist() == [0, 1, 2, 3]
    assert math.isclose(float(stats["perplexity"]), 4.0, rel_tol=1e-5)
    assert int(stats["used"]) == 4


def test_psnr_and_pixel_conversions() -> None:
    a = torch.full((2, 4, 4, 3), 100, dtype=torch.uint8)
    assert psnr(a, a) == math.inf
    assert math.isclose(psnr(a, a + 1), 10 * math.log10(255**2), rel_tol=1e-9)  # mse 1
    assert math.isclose(psnr(a, a + 16), 10 * math.log10(255**2 / 256), rel_tol=1e-9)
    pixels = torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8)
    assert torch.equal(to_uint8(to_unit(pixels)), pixels)


def test_bad_shapes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"divisible by 2\*\*model\.downsample"):
        VQVAEConfig(image_size=36, downsample=3)
    with pytest.raises(ConfigError, match=r"model\.ema_decay"):
        VQVAEConfig(ema_decay=1.0)
