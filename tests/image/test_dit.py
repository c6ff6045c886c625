"""The DiT: patches, adaLN-Zero, caption conditioning and padding, and the sampling loop."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ConfigError
from kiln.image.dit import DiT, DiTConfig, TextToImage, sincos_2d
from kiln.image.sampler import noise_for, sample_latents
from kiln.image.schedules import DiffusionConfig, Schedule
from kiln.image.vqvae import VQVAEConfig


def _cfg(**kw) -> DiTConfig:
    return DiTConfig(**{"width": 32, "depth": 2, "heads": 2, "text_layers": 1, "vocab_size": 300,
                        "max_caption_tokens": 8, **kw})  # fmt: skip


def _ids(rows: list[list[int]], cfg: DiTConfig, width: int | None = None) -> torch.Tensor:
    width = width or max(len(r) for r in rows) + 1
    out = torch.full((len(rows), width), cfg.vocab_size + 1)
    for i, r in enumerate(rows):
        out[i, : len(r) + 1] = torch.tensor([cfg.vocab_size, *r])
    return out


def _perturb(model: torch.nn.Module) -> None:
    # adaLN-Zero starts every block as the identity and the output at zero; give them weights.
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ada" in name or "patch_out" in name:
                p.normal_(std=0.1)


@pytest.mark.parametrize("patch", [1, 2])
def test_patchify_inverts_and_tokens_follow_raster_order(patch: int) -> None:
    dit = DiT(_cfg(patch=patch), channels=3, side=4)
    z = torch.randn(2, 3, 4, 4)
    tokens = dit.patchify(z)
    assert tokens.shape == (2, (4 // patch) ** 2, 3 * patch * patch)
    assert torch.equal(dit.unpatchify(tokens), z)
    # Token 1 is the patch right of the first (raster order).
    assert torch.equal(tokens[0, 1].reshape(3, patch, patch), z[0, :, :patch, patch : 2 * patch])


def test_adaln_zero_starts_as_zero_output_and_identity_blocks() -> None:
    torch.manual_seed(0)
    dit = DiT(_cfg(), channels=4, side=4)
    z, t, ids = torch.randn(2, 4, 4, 4), torch.tensor([3.0, 900.0]), _ids([[5, 6], [7]], dit.cfg)
    assert torch.equal(dit(z, t, ids), torch.zeros_like(z))
    x, c = torch.randn(2, 5, 32), torch.randn(2, 32)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    assert torch.equal(dit.blocks[0](x, c, mask), x)


def test_the_caption_and_the_time_change_the_output_but_padding_does_not() -> None:
    torch.manual_seed(1)
    dit = DiT(_cfg(), channels=4, side=4).eval()
    _perturb(dit)
    z, t = torch.randn(1, 4, 4, 4), torch.tensor([500.0])
    base = dit(z, t, _ids([[5, 6]], dit.cfg))
    assert not torch.allclose(base, dit(z, t, _ids([[6, 5]], dit.cfg)), atol=1e-4)  # word order
    assert not torch.allclose(base, dit(z, torch.tensor([20.0]), _ids([[5, 6]], dit.cfg)))
    padded = dit(z, t, _ids([[5, 6]], dit.cfg, width=7))
    assert torch.allclose(base, padded, atol=1e-5)


def test_sincos_positions_differ_per_cell() -> None:
    pos = sincos_2d(4, 32)
    assert pos.shape == (16, 32)
    assert torch.cdist(pos, pos).add(torch.eye(16)).min() > 0.1


@pytest.mark.parametrize("objective", ["v", "epsilon", "flow"])
def test_sampling_is_seeded_previews_each_step_and_per_picture(objective: str) -> None:
    torch.manual_seed(2)
    model = TextToImage(_cfg(), VQVAEConfig(image_size=16, hidden=8, codebook_size=16, code_dim=4))
    _perturb(model.dit)
    model.eval()
    sched = Schedule(DiffusionConfig(objective=objective))
    ids = _ids([[5, 6], [7, 8, 9]], model.config)
    seen: list[int] = []
    a = sample_latents(model, ids, sched, 4, 3.0, seed=11, on_step=lambda i, z: seen.append(i))
    assert seen == [0, 1, 2, 3] and a.shape == (2, 4, 4, 4)
    assert torch.equal(a, sample_latents(model, ids, sched, 4, 3.0, seed=11))
    assert not torch.equal(a, sample_latents(model, ids, sched, 4, 3.0, seed=12))
    alone = sample_latents(model, ids[:1, :3], sched, 4, 3.0, seed=11)
    assert torch.allclose(alone[0], a[0], atol=1e-5)  # picture 0 does not depend on the batch
    unguided = sample_latents(model, ids, sched, 4, 1.0, seed=11)
    assert not torch.allclose(unguided, a)  # guidance moves the result
    pictures = model.decode(a)
    assert pictures.shape == (2, 3, 16, 16) and pictures.abs().max() <= 1


def test_noise_is_a_function_of_seed_picture_and_call() -> None:
    assert torch.equal(noise_for(3, (2,), 5, 1)[2], noise_for(4, (2,), 5, 1)[2])
    assert not torch.equal(noise_for(1, (2,), 5, 1), noise_for(1, (2,), 5, 2))


def test_bad_sizes_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"model\.width 30 must be divisible by model\.heads"):
        DiTConfig(width=30, heads=4)
    with pytest.raises(ConfigError, match=r"model\.caption_dropout"):
        DiTConfig(caption_dropout=1.0)
