"""Training the VQ-VAE on an image dataset: `kiln image train-vqvae CONFIG.toml`.

kiln's Trainer is built around a token stream and a Transformer LM (windows, tokens/s, MFU), so
the image models get a small loop instead (kiln/train/image_loop.py, shared with the DiT and
the checker), made of the same parts: the TOML dataclass config
with --set overrides (kiln.config), AdamW groups and the lr schedule (optim, schedule), atomic
checkpoints with `latest`, pruning and leftovers tidied (checkpoint), metrics.jsonl (metrics),
the run-folder lock (kiln.folders). The batch order is a pure function of (seed, epoch,
position), and the cursor, the RNG states (dead-code restarts draw from torch's) and the EMA
codebook are in every checkpoint, so a resumed run takes the same steps bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.config import require
from kiln.image.vqvae import VQVAE, VQVAEConfig, psnr, to_uint8, to_unit
from kiln.io import atomic_write
from kiln.train.config import OptimConfig, ScheduleConfig
from kiln.train.image_loop import (
    CheckpointSection,
    ImageDataSection,
    ImageRun,
    ImageTrainConfig,
    ImageTrainSection,
    batch_indices,
    open_images,
)
from kiln.train.optim import build_optimizer, set_lr
from kiln.train.schedule import lr_multiplier

__all__ = ["CheckpointSection", "ImageDataSection", "VQVAERun", "VQVAETrainConfig", "batch_indices"]


@dataclass
class VQVAETrainSection(ImageTrainSection):
    """The shared [train] fields, and how often dead codes restart."""

    restart_every: int = 50  # steps between dead-code restarts; 0: never

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.restart_every >= 0, "train.restart_every must be >= 0")


@dataclass
class VQVAETrainConfig(ImageTrainConfig):
    """A `kiln image train-vqvae` TOML file."""

    data: ImageDataSection
    model: VQVAEConfig = field(default_factory=VQVAEConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_steps=50))
    train: VQVAETrainSection = field(default_factory=VQVAETrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run_dir: str = "runs/vqvae"


class VQVAERun(ImageRun):
    """One training run in `cfg.run_dir`: fresh, or resumed from its latest checkpoint."""

    command = "kiln image train-vqvae"

    def __init__(self, cfg: VQVAETrainConfig, resume: bool = False) -> None:
        self.data = open_images(cfg.data.dataset, cfg.model.image_size, "model.image_size")
        self.train_images = self.data.images(cfg.data.train_split)
        super().__init__(cfg, len(self.train_images), resume)
        self.eval_splits = [s for s in cfg.data.eval_splits if s in self.data.splits]
        from kiln.devices import resolve_device

        self.device = resolve_device(cfg.train.device)
        torch.manual_seed(cfg.train.seed)
        self.model = VQVAE(cfg.model).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.start()

    def fingerprint(self) -> dict[str, Any]:
        """The image dataset's identity."""
        return self.data.fingerprint()

    def train_step(self) -> dict[str, float]:
        """One optimizer update; returns the step's scalars."""
        cfg = self.cfg
        self.model.train()
        lr = set_lr(self.optimizer, lr_multiplier(cfg.schedule, self.step, self.max_steps))
        idx = self.next_indices()
        x = to_unit(torch.from_numpy(np.asarray(self.train_images[idx]))).to(self.device)
        _, stats = self.model(x)
        grad_norm = self.clip_and_step(stats["loss"])
        restarted = 0
        if cfg.train.restart_every and (self.step + 1) % cfg.train.restart_every == 0:
            restarted = self.model.quantizer.restart_dead(stats["z_e"])
        self.step += 1
        return {
            "loss": stats["loss"].item(), "recon": stats["recon"].item(),
            "commit": stats["commit"].item(), "perplexity": stats["perplexity"].item(),
            "codes_in_batch": int(stats["used"]), "restarted": restarted, "lr": lr,
            "grad_norm": grad_norm,
        }  # fmt: skip

    def postfix(self, scalars: dict[str, float]) -> dict[str, str]:
        """Loss and batch perplexity beside the step count."""
        return {"loss": f"{scalars['loss']:.4f}", "ppl": f"{scalars['perplexity']:.0f}"}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """PSNR, codes used and perplexity on each eval split's first `eval_images` pictures."""
        self.model.eval()
        out: dict[str, float] = {}
        k = self.cfg.model.codebook_size
        for split in self.eval_splits:
            images = np.array(self.data.images(split)[: self.cfg.train.eval_images])
            reference = torch.from_numpy(images)
            recon, counts = [], torch.zeros(k, dtype=torch.long)
            for start in range(0, len(images), 256):
                x = to_unit(reference[start : start + 256]).to(self.device)
                codes = self.model.encode(x)
                recon.append(to_uint8(self.model.decode(codes)).cpu())
                counts += torch.bincount(codes.flatten().cpu(), minlength=k)
            probs = counts.double() / counts.sum()
            nonzero = probs[probs > 0]
            out[f"{split}_psnr"] = round(psnr(reference, torch.cat(recon)), 3)
            out[f"{split}_codes_used"] = int((counts > 0).sum())
            out[f"{split}_perplexity"] = round(
                float(torch.exp(-(nonzero * nonzero.log()).sum())), 2
            )
        return out

    @torch.no_grad()
    def reconstruction_grid(self, out: Path, split: str, n: int = 16, scale: int = 3) -> Path:
        """A PNG of `n` pictures of `split` (top row) over their reconstructions (bottom)."""
        from PIL import Image

        self.model.eval()
        images = torch.from_numpy(np.array(self.data.images(split)[:n]))
        recon = to_uint8(self.model.decode(self.model.encode(to_unit(images).to(self.device))))
        side = self.data.size * scale
        grid = Image.new("RGB", (side * len(images), side * 2), "white")
        for i, (a, b) in enumerate(zip(images.numpy(), recon.cpu().numpy(), strict=True)):
            for row, picture in enumerate((a, b)):
                tile = Image.fromarray(picture).resize((side, side), Image.Resampling.NEAREST)
                grid.paste(tile, (i * side, row * side))
        with atomic_write(out, "wb", encoding=None) as handle:
            grid.save(handle, format="PNG")
        return out
