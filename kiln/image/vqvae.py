"""VQ-VAE (van den Oord et al., 2017): a conv encoder, a codebook, a conv decoder.

x (B, 3, S, S) in [-1, 1] -> encoder -> z_e (B, D, S/f, S/f) -> nearest code -> z_q -> decoder.
The gradient passes the quantizer straight through (z_e + sg(z_q - z_e)). The codebook learns
either by EMA of the vectors assigned to each code (`ema = true`, the paper's appendix; the loss
is then reconstruction + β·commitment) or by gradient (`ema = false`: + ||sg(z_e) - e||²).
Dead codes, whose EMA usage falls below `dead_threshold`, are restarted on random encoder
outputs of the current batch, so the codebook does not collapse onto a few entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import require


@dataclass
class VQVAEConfig:
    """The autoencoder's shape and the codebook's learning rule."""

    image_size: int = 32
    hidden: int = 64  # conv channels
    downsample: int = 2  # stride-2 stages: the latent grid is image_size / 2**downsample
    res_blocks: int = 1  # residual blocks at the latent resolution, in encoder and decoder
    codebook_size: int = 256
    code_dim: int = 32
    commitment: float = 0.25  # β
    ema: bool = True  # EMA codebook updates; false: codebook loss by gradient
    ema_decay: float = 0.99
    dead_threshold: float = 1.0  # a code chosen fewer times per step than this (EMA) is dead

    def __post_init__(self) -> None:
        require(self.image_size >= 8, f"model.image_size must be >= 8, got {self.image_size}")
        require(self.downsample >= 1, f"model.downsample must be >= 1, got {self.downsample}")
        require(
            self.image_size % 2**self.downsample == 0,
            f"model.image_size {self.image_size} must be divisible by 2**model.downsample",
        )
        for name in ("hidden", "codebook_size", "code_dim"):
            require(getattr(self, name) >= 1, f"model.{name} must be >= 1")
        require(self.res_blocks >= 0, f"model.res_blocks must be >= 0, got {self.res_blocks}")
        require(0 < self.ema_decay < 1, f"model.ema_decay must be in (0, 1): {self.ema_decay}")
        require(self.commitment >= 0, f"model.commitment must be >= 0: {self.commitment}")
        require(self.dead_threshold >= 0, "model.dead_threshold must be >= 0")

    @property
    def latent_size(self) -> int:
        """Side of the code grid."""
        return self.image_size // 2**self.downsample


class ResBlock(nn.Module):
    """x + conv1x1(relu(conv3x3(relu(x))))."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, C, H, W)."""
        return x + self.conv2(F.relu(self.conv1(F.relu(x))))


def _encoder(cfg: VQVAEConfig) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(3, cfg.hidden, 3, padding=1)]
    for _ in range(cfg.downsample):
        layers += [nn.ReLU(), nn.Conv2d(cfg.hidden, cfg.hidden, 4, stride=2, padding=1)]
    layers += [ResBlock(cfg.hidden) for _ in range(cfg.res_blocks)]
    layers += [nn.ReLU(), nn.Conv2d(cfg.hidden, cfg.code_dim, 1)]
    return nn.Sequential(*layers)


def _decoder(cfg: VQVAEConfig) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cfg.code_dim, cfg.hidden, 3, padding=1)]
    layers += [ResBlock(cfg.hidden) for _ in range(cfg.res_blocks)]
    for _ in range(cfg.downsample):
        layers += [nn.ReLU(), nn.ConvTranspose2d(cfg.hidden, cfg.hidden, 4, stride=2, padding=1)]
    layers += [nn.ReLU(), nn.Conv2d(cfg.hidden, 3, 3, padding=1)]
    return nn.Sequential(*layers)


class Quantizer(nn.Module):
    """Nearest-code lookup with EMA or gradient codebook learning and dead-code restarts."""

    def __init__(self, cfg: VQVAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        k, d = cfg.codebook_size, cfg.code_dim
        init = torch.empty(k, d).uniform_(-1 / k, 1 / k)
        if cfg.ema:
            self.register_buffer("codebook", init)
            self.register_buffer("ema_sum", init.clone())  # EMA of Σ assigned vectors per code
        else:
            self.codebook = nn.Parameter(init)
        # EMA of assignments per code per step: the usage that decides which codes are dead.
        self.register_buffer("ema_count", torch.ones(k))

    def codes(self, z: torch.Tensor) -> torch.Tensor:
        """Nearest code of each vector: (N, D) -> (N,) indices."""
        e = self.codebook
        distance = (z * z).sum(1, keepdim=True) - 2 * z @ e.t() + (e * e).sum(1)  # (N, K)
        return distance.argmin(1)

    def forward(self, z_e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(B, D, H, W) -> z_q (straight-through), indices (B, H, W), losses and usage stats."""
        b, d, h, w = z_e.shape
        flat = z_e.permute(0, 2, 3, 1).reshape(-1, d)  # (N, D)
        idx = self.codes(flat.detach())
        onehot = F.one_hot(idx, self.cfg.codebook_size).type(flat.dtype)  # (N, K)
        quantized = self.codebook[idx]  # (N, D)
        commit = F.mse_loss(flat, quantized.detach())
        stats: dict[str, torch.Tensor] = {"commit": commit}
        if self.cfg.ema:
            loss = self.cfg.commitment * commit
        else:
            stats["codebook"] = F.mse_loss(quantized, flat.detach())
            loss = stats["codebook"] + self.cfg.commitment * commit
        if self.training:
            self._update(flat.detach(), onehot)
        probs = onehot.mean(0)
        stats["perplexity"] = torch.exp(-(probs * torch.log(probs + 1e-10)).sum())
        stats["used"] = (probs > 0).sum()
        stats["loss"] = loss
        z_q = flat + (quantized - flat).detach()  # straight-through gradient
        return z_q.reshape(b, h, w, d).permute(0, 3, 1, 2), idx.reshape(b, h, w), stats

    @torch.no_grad()
    def _update(self, flat: torch.Tensor, onehot: torch.Tensor) -> None:
        decay = self.cfg.ema_decay
        counts = onehot.sum(0)  # (K,)
        self.ema_count.mul_(decay).add_(counts, alpha=1 - decay)
        if self.cfg.ema:
            self.ema_sum.mul_(decay).add_(onehot.t() @ flat, alpha=1 - decay)
            # Laplace smoothing keeps a code no vector chose from dividing by zero.
            n = self.ema_count.sum()
            k = self.cfg.codebook_size
            smoothed = (self.ema_count + 1e-5) / (n + k * 1e-5) * n
            self.codebook.copy_(self.ema_sum / smoothed.unsqueeze(1))

    @torch.no_grad()
    def restart_dead(self, z_e: torch.Tensor) -> int:
        """Move each dead code onto a random encoder output of this batch; returns how many."""
        dead = (self.ema_count < self.cfg.dead_threshold).nonzero().flatten()
        if dead.numel() == 0:
            return 0
        flat = z_e.detach().permute(0, 2, 3, 1).reshape(-1, self.cfg.code_dim)
        pick = torch.randint(0, flat.shape[0], (dead.numel(),), device=flat.device)
        fresh = flat[pick]
        self.codebook.data[dead] = fresh
        self.ema_count[dead] = 1.0
        if self.cfg.ema:
            self.ema_sum[dead] = fresh
        return int(dead.numel())


class VQVAE(nn.Module):
    """Encoder, quantizer and decoder; `forward` returns the reconstruction and the losses."""

    def __init__(self, config: VQVAEConfig) -> None:
        super().__init__()
        self.config = config  # not `cfg`: kiln.train.optim reads µP settings from a model's cfg
        self.encoder = _encoder(config)
        self.quantizer = Quantizer(config)
        self.decoder = _decoder(config)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, S, S) in [-1, 1] -> code indices (B, S/f, S/f)."""
        return self.quantizer(self.encoder(x))[1]

    def decode(self, idx: torch.Tensor) -> torch.Tensor:
        """Code indices (B, h, w) -> images (B, 3, S, S), clamped to [-1, 1]."""
        z_q = self.quantizer.codebook[idx].permute(0, 3, 1, 2)  # (B, D, h, w)
        return self.decoder(z_q).clamp(-1, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(B, 3, S, S) -> reconstruction (B, 3, S, S) and stats: loss, recon, commit, ..."""
        z_e = self.encoder(x)
        z_q, idx, stats = self.quantizer(z_e)
        x_hat = self.decoder(z_q)
        stats["recon"] = F.mse_loss(x_hat, x)
        stats["loss"] = stats["recon"] + stats["loss"]
        stats["z_e"] = z_e
        stats["codes"] = idx
        return x_hat, stats


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, S, S, 3) -> float (B, 3, S, S) in [-1, 1]."""
    return images.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Float (B, 3, S, S) in [-1, 1] -> uint8 (B, S, S, 3) (rounded, clamped)."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)


def psnr(reference: torch.Tensor, image: torch.Tensor) -> float:
    """PSNR in dB of two uint8 image batches (peak 255, mean squared error over all pixels)."""
    mse = (reference.double() - image.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)
