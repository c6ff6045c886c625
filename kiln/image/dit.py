"""The diffusion transformer (Peebles & Xie, 2023) over the VQ-VAE's quantised latents.

A picture's latent is the VQ-VAE's z_q (B, C, h, w): the codebook vectors of its codes, which
the decoder turns back into pixels; normalised per channel by the training set's mean and std.
The DiT cuts it into p×p patches (tokens), adds fixed 2-D sin-cos positions, and runs `depth`
blocks of kiln's own attention, norm and MLP (kiln.model.layers) with adaLN-Zero: each block's
norms are shifted and scaled, and its two residual branches gated, by a vector of the timestep
and the caption; the gates start at zero, so every block starts as the identity.

The caption: kiln's tokenizer (a byte-level BPE trained on the training captions), then a small
bidirectional Transformer text encoder trained jointly with the DiT. Its tokens condition the
picture two ways: their mean joins the timestep in adaLN, and the tokens themselves are
prepended to the patch sequence so every patch attends to every word (in-context conditioning:
which colour goes with which thing is in the words' order, which a mean alone blurs). A caption
dropped for classifier-free guidance is the empty caption (the start token alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.config import require
from kiln.image.vqvae import VQVAE, VQVAEConfig
from kiln.model.config import ModelConfig
from kiln.model.layers import MLP, CausalSelfAttention, make_norm


@dataclass
class DiTConfig:
    """The DiT's and its text encoder's sizes, and the caption dropout for guidance."""

    width: int = 128
    depth: int = 4
    heads: int = 4
    patch: int = 1  # p: a p×p square of latent cells is one token
    mlp_ratio: int = 4
    text_layers: int = 2
    vocab_size: int = 384  # of the caption tokenizer (trained on the training captions)
    max_caption_tokens: int = 32  # longer captions are refused (the sampler's --prompt)
    caption_dropout: float = 0.1  # share of training captions replaced by the empty one

    def __post_init__(self) -> None:
        for name in ("width", "depth", "heads", "patch", "mlp_ratio", "max_caption_tokens"):
            require(getattr(self, name) >= 1, f"model.{name} must be >= 1")
        require(self.text_layers >= 0, f"model.text_layers must be >= 0, got {self.text_layers}")
        require(
            self.width % self.heads == 0,
            f"model.width {self.width} must be divisible by model.heads {self.heads}",
        )
        require(self.vocab_size >= 257, f"model.vocab_size must be >= 257, got {self.vocab_size}")
        require(0 <= self.caption_dropout < 1, "model.caption_dropout must be in [0, 1)")


def _block_config(cfg: DiTConfig, layers: int, affine: bool) -> ModelConfig:
    """A kiln ModelConfig for blocks of this width (LayerNorm; no positions: we add our own)."""
    return ModelConfig(
        vocab_size=1, block_size=4096, n_layer=max(layers, 1), n_head=cfg.heads,
        n_embd=cfg.width, d_ff=cfg.mlp_ratio * cfg.width, mlp="gelu", norm="layernorm",
        norm_eps=1e-6, norm_scale=affine, pos_emb="none",
    )  # fmt: skip


def sincos_2d(side: int, dim: int) -> Tensor:
    """Fixed 2-D sin-cos position embeddings (side², dim): half the channels per axis."""
    quarter = dim // 4
    freq = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    coords = torch.arange(side, dtype=torch.float64)
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")

    def axis(pos: Tensor) -> Tensor:
        angles = pos.flatten()[:, None] * freq[None]  # (side², dim/4)
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    out = torch.cat([axis(ys), axis(xs)], dim=1)  # (side², 4·quarter)
    return F.pad(out, (0, dim - out.shape[1])).float()


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal features (B, dim) of (possibly fractional) times t (B,)."""
    half = dim // 2
    freq = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
    angles = t.float()[:, None] * freq[None]
    return torch.cat([angles.cos(), angles.sin()], dim=1)


class EncoderLayer(nn.Module):
    """A pre-norm bidirectional Transformer layer of kiln's attention, norm and MLP."""

    def __init__(self, mcfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = make_norm(mcfg, mcfg.n_embd), make_norm(mcfg, mcfg.n_embd)
        self.attn, self.mlp = CausalSelfAttention(mcfg, layer), MLP(mcfg)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """(B, L, W) -> (B, L, W); mask (B, 1, L, L), True where a token may attend."""
        x = x + self.attn(self.norm1(x), None, mask)
        return x + self.mlp(self.norm2(x))


class TextEncoder(nn.Module):
    """Caption ids (B, L) -> token features (B, L, W) and their mean over the real tokens (B, W)."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        # Two ids past the tokenizer's: the start token every caption begins with, and padding.
        self.start_id, self.pad_id = cfg.vocab_size, cfg.vocab_size + 1
        self.embed = nn.Embedding(cfg.vocab_size + 2, cfg.width)
        self.pos = nn.Embedding(cfg.max_caption_tokens + 1, cfg.width)
        mcfg = _block_config(cfg, cfg.text_layers, affine=True)
        self.layers = nn.ModuleList(EncoderLayer(mcfg, i) for i in range(cfg.text_layers))
        self.norm = make_norm(mcfg, cfg.width)

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Features (B, L, W), pooled (B, W) and the real-token mask (B, L)."""
        real = ids != self.pad_id  # (B, L)
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        mask = real[:, None, None, :]  # (B, 1, 1, L): attend to real tokens only
        for layer in self.layers:
            x = layer(x, mask)
        x = self.norm(x)
        pooled = (x * real[..., None]).sum(1) / real.sum(1, keepdim=True)
        return x, pooled, real


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: x·(1 + scale) + shift, per sample: x (B, T, W), shift and scale (B, W)."""
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    """Attention and MLP over [caption tokens; patches], adaLN-Zero modulated by c."""

    def __init__(self, cfg: DiTConfig, layer: int) -> None:
        super().__init__()
        mcfg = _block_config(cfg, cfg.depth, affine=False)  # adaLN supplies scale and shift
        self.norm1, self.norm2 = make_norm(mcfg, cfg.width), make_norm(mcfg, cfg.width)
        self.attn, self.mlp = CausalSelfAttention(mcfg, layer), MLP(mcfg)
        self.ada = nn.Linear(cfg.width, 6 * cfg.width)  # zeroed at init: adaLN-Zero

    def forward(self, x: Tensor, c: Tensor, mask: Tensor) -> Tensor:
        """x (B, T, W), c (B, W), mask (B, 1, 1, T) -> (B, T, W)."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(c)).chunk(6, dim=1)
        x = x + gate1[:, None] * self.attn(modulate(self.norm1(x), shift1, scale1), None, mask)
        return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))


class DiT(nn.Module):
    """Noisy latents (B, C, h, w), times (B,) and a caption -> the objective's output (B, C, h, w)."""

    def __init__(self, cfg: DiTConfig, channels: int, side: int) -> None:
        super().__init__()
        require(
            side % cfg.patch == 0, f"model.patch {cfg.patch} must divide the latent side {side}"
        )
        self.cfg, self.channels, self.side = cfg, channels, side
        p, w = cfg.patch, cfg.width
        self.grid = side // p
        self.patch_in = nn.Linear(channels * p * p, w)
        self.register_buffer("pos", sincos_2d(self.grid, w), persistent=False)
        self.time_mlp = nn.Sequential(nn.Linear(256, w), nn.SiLU(), nn.Linear(w, w))
        self.text = TextEncoder(cfg)
        self.text_in = nn.Linear(w, w)  # the caption tokens as they enter the patch sequence
        self.pooled_in = nn.Linear(w, w)
        self.blocks = nn.ModuleList(DiTBlock(cfg, i) for i in range(cfg.depth))
        self.final_norm = make_norm(_block_config(cfg, 1, affine=False), w)
        self.final_ada = nn.Linear(w, 2 * w)
        self.patch_out = nn.Linear(w, channels * p * p)
        self._init_weights()

    def _init_weights(self) -> None:
        """DiT's initialisation, in one place: Xavier linears, adaLN and output zeroed."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
        for m in [*(b.ada for b in self.blocks), self.final_ada, self.patch_out]:
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    def patchify(self, z: Tensor) -> Tensor:
        """(B, C, h, w) -> (B, N, C·p·p), patches in raster order."""
        B, C, _, _ = z.shape
        p, g = self.cfg.patch, self.grid
        z = z.reshape(B, C, g, p, g, p).permute(0, 2, 4, 1, 3, 5)  # (B, g, g, C, p, p)
        return z.reshape(B, g * g, C * p * p)

    def unpatchify(self, x: Tensor) -> Tensor:
        """(B, N, C·p·p) -> (B, C, h, w), the inverse of patchify."""
        B = x.shape[0]
        p, g, C = self.cfg.patch, self.grid, self.channels
        x = x.reshape(B, g, g, C, p, p).permute(0, 3, 1, 4, 2, 5)  # (B, C, g, p, g, p)
        return x.reshape(B, C, g * p, g * p)

    def forward(self, z: Tensor, t: Tensor, ids: Tensor) -> Tensor:
        """The output for noisy latents z (B, C, h, w) at times t (B,) under captions ids (B, L)."""
        words, pooled, real = self.text(ids)  # (B, L, W), (B, W), (B, L)
        c = self.time_mlp(timestep_embedding(t, 256)) + self.pooled_in(pooled)  # (B, W)
        patches = self.patch_in(self.patchify(z)) + self.pos  # (B, N, W)
        x = torch.cat([self.text_in(words), patches], dim=1)  # (B, L + N, W)
        keep = torch.cat([real, real.new_ones(patches.shape[:2])], dim=1)
        mask = keep[:, None, None, :]  # (B, 1, 1, L + N): no token attends to padding
        for block in self.blocks:
            x = block(x, c, mask)
        shift, scale = self.final_ada(F.silu(c)).chunk(2, dim=1)
        x = self.patch_out(modulate(self.final_norm(x[:, ids.shape[1] :]), shift, scale))
        return self.unpatchify(x)  # (B, C, h, w)


class TextToImage(nn.Module):
    """The DiT with its frozen VQ-VAE and the latents' normalisation: what a checkpoint holds."""

    def __init__(self, cfg: DiTConfig, vq: VQVAEConfig) -> None:
        super().__init__()
        self.config, self.vq_config = cfg, vq
        self.vqvae = VQVAE(vq).requires_grad_(False).eval()
        self.dit = DiT(cfg, vq.code_dim, vq.latent_size)
        self.register_buffer("latent_mean", torch.zeros(vq.code_dim))
        self.register_buffer("latent_std", torch.ones(vq.code_dim))

    def train(self, mode: bool = True) -> TextToImage:
        """Train the DiT; the VQ-VAE stays in eval mode (its codebook is fixed)."""
        super().train(mode)
        self.vqvae.eval()
        return self

    def _norm(self, z: Tensor) -> Tensor:
        return (z - self.latent_mean[:, None, None]) / self.latent_std[:, None, None]

    @torch.no_grad()
    def quantised(self, images: Tensor) -> Tensor:
        """Pictures (B, 3, S, S) in [-1, 1] -> the VQ-VAE's z_q (B, C, h, w), not normalised."""
        codes = self.vqvae.encode(images)
        return self.vqvae.quantizer.codebook[codes].permute(0, 3, 1, 2)

    @torch.no_grad()
    def latents(self, images: Tensor) -> Tensor:
        """Pictures (B, 3, S, S) in [-1, 1] -> normalised quantised latents (B, C, h, w)."""
        return self._norm(self.quantised(images))

    @torch.no_grad()
    def set_latent_stats(self, z_q: Tensor) -> None:
        """Per-channel mean and std of un-normalised latents (N, C, h, w) of the training set."""
        self.latent_mean.copy_(z_q.mean(dim=(0, 2, 3)))
        self.latent_std.copy_(z_q.std(dim=(0, 2, 3)).clamp_min(1e-6))

    @torch.no_grad()
    def decode(self, z: Tensor) -> Tensor:
        """Normalised latents (B, C, h, w) -> pictures (B, 3, S, S) in [-1, 1]."""
        z = z * self.latent_std[:, None, None] + self.latent_mean[:, None, None]
        return self.vqvae.decoder(z).clamp(-1, 1)
