"""Training the diffusion transformer: `kiln image train-dit CONFIG.toml`.

The VQ-VAE of `vqvae` (a `kiln image train-vqvae` run) is loaded, frozen and copied into the
DiT's checkpoint, so a DiT run draws on its own. At the start the training pictures are encoded
once into quantised latents (normalised per channel) and the captions into token ids (a BPE
trained on the training captions, saved as the run's tokenizer.json). Each step draws times,
noise and the caption dropout from torch's RNG, whose state every checkpoint keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kiln import checkpoint_format as fmt
from kiln import config as cfgio
from kiln.config import require
from kiln.errors import KilnError
from kiln.image.captions import encode_captions, train_caption_tokenizer
from kiln.image.dataset import ImageDataset
from kiln.image.dit import DiTConfig, TextToImage
from kiln.image.schedules import DiffusionConfig, Schedule
from kiln.image.vqvae import VQVAEConfig, to_unit
from kiln.train.config import OptimConfig, ScheduleConfig
from kiln.train.image_loop import (
    CheckpointSection,
    ImageDataSection,
    ImageRun,
    ImageTrainConfig,
    ImageTrainSection,
)
from kiln.train.optim import build_optimizer, set_lr
from kiln.train.schedule import lr_multiplier


@dataclass
class DiTTrainSection(ImageTrainSection):
    """The shared [train] fields, with the DiT's defaults."""

    max_steps: int = 3000
    eval_images: int = 256  # of the first eval split: the validation loss's pictures


@dataclass
class DiTTrainConfig(ImageTrainConfig):
    """A `kiln image train-dit` TOML file."""

    data: ImageDataSection
    vqvae: str = ""  # the VQ-VAE run folder (its latest checkpoint is used)
    model: DiTConfig = field(default_factory=DiTConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-4, weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_steps=100))
    train: DiTTrainSection = field(default_factory=DiTTrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run_dir: str = "runs/dit"

    def __post_init__(self) -> None:
        require(bool(self.vqvae), "vqvae: give the VQ-VAE run folder the DiT draws through")


def load_vqvae(run: str | Path) -> tuple[VQVAEConfig, dict[str, torch.Tensor], Path]:
    """The VQ-VAE config and weights of a `kiln image train-vqvae` run's latest checkpoint."""
    checkpoints = Path(run) / "checkpoints"
    path = fmt.latest_checkpoint(checkpoints)
    if path is None:
        raise KilnError(f"vqvae = {run!s}: no checkpoint in {checkpoints}; train it first")
    state = fmt.read_state(path)
    model = state.get("config", {}).get("model", {})
    if "codebook_size" not in model:
        raise KilnError(f"vqvae = {run!s}: {path} is not a VQ-VAE checkpoint")
    names = set(VQVAEConfig.__dataclass_fields__)
    cfg = VQVAEConfig(**{k: v for k, v in model.items() if k in names})
    return cfg, fmt.read_tensors(path / "model.safetensors"), path


class DiTRun(ImageRun):
    """One DiT training run: fresh, or resumed from its latest checkpoint."""

    command = "kiln image train-dit"
    fixed_sections = ("model", "data", "diffusion", "vq_model")

    def __init__(self, cfg: DiTTrainConfig, resume: bool = False, quiet: bool = False) -> None:
        self.data = ImageDataset.open(cfg.data.dataset)
        vq_cfg, vq_weights, self.vq_path = load_vqvae(cfg.vqvae)
        self.vq_weights_file = self.vq_path / "model.safetensors"
        if self.data.size != vq_cfg.image_size:
            raise KilnError(
                f"the VQ-VAE of {cfg.vqvae} draws {vq_cfg.image_size}×{vq_cfg.image_size}, but "
                f"{cfg.data.dataset} holds {self.data.size}×{self.data.size} pictures"
            )
        records = self.data.records(cfg.data.train_split)
        super().__init__(cfg, len(records), resume)
        self.vq_cfg = vq_cfg
        from kiln.devices import resolve_device

        self.device = resolve_device(cfg.train.device)
        torch.manual_seed(cfg.train.seed)
        self.model = TextToImage(cfg.model, vq_cfg)
        self.model.vqvae.load_state_dict(vq_weights)
        self.model.to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.schedule = Schedule(cfg.diffusion)
        self.tokenizer = self._tokenizer([r["caption"] for r in records])
        self.ids = self.caption_ids([r["caption"] for r in records], "train captions")
        self.latents = self._encode(self.data.images(cfg.data.train_split), set_stats=True)
        self.eval_split = next((s for s in cfg.data.eval_splits if s in self.data.splits), None)
        self.start()

    def _tokenizer(self, captions: list[str]) -> Any:
        from kiln.tokenizer import Tokenizer

        path = self.run_dir / "tokenizer.json"
        if self.saved is not None and path.is_file():
            tok = Tokenizer.load(path)
        else:
            tok = train_caption_tokenizer(captions, self.cfg.model.vocab_size, path)
        if tok.n_vocab > self.cfg.model.vocab_size:
            raise KilnError(f"{path}: {tok.n_vocab} ids, more than model.vocab_size")
        return tok

    def caption_ids(self, captions: list[str], what: str) -> torch.Tensor:
        """Token ids (N, L) of captions, padded, on the run's device."""
        text = self.model.dit.text
        return encode_captions(
            self.tokenizer, captions, self.cfg.model.max_caption_tokens, text.start_id,
            text.pad_id, what,
        ).to(self.device)  # fmt: skip

    @torch.no_grad()
    def _encode(self, images: np.ndarray, set_stats: bool = False) -> torch.Tensor:
        chunks = []
        for start in range(0, len(images), 256):
            x = to_unit(torch.from_numpy(np.array(images[start : start + 256])))
            chunks.append(self.model.quantised(x.to(self.device)))
        z = torch.cat(chunks)
        if set_stats:
            self.model.set_latent_stats(z)
        return self.model._norm(z)

    def state_config(self) -> dict[str, Any]:
        """The resolved config plus the VQ-VAE's (what the sampler rebuilds the model from)."""
        return {**self.cfg.to_dict(), "vq_model": cfgio.to_dict(self.vq_cfg)}

    def fingerprint(self) -> dict[str, Any]:
        """The image dataset's identity and the VQ-VAE weights' (the latents come from both)."""
        from kiln.io import sha256_file

        return {**self.data.fingerprint(), "vqvae_sha256": sha256_file(self.vq_weights_file)}

    def loss(self, z0: torch.Tensor, ids: torch.Tensor, generator=None) -> torch.Tensor:
        """The objective's mean squared error on latents z0 (B, C, h, w) with captions ids."""
        b = z0.shape[0]
        t = self.schedule.sample_t(b, generator)
        noise = torch.randn(z0.shape, generator=generator).to(self.device)
        t = t.to(self.device)
        zt = self.schedule.add_noise(z0, noise, t)
        out = self.model.dit(zt, self.schedule.model_time(t), ids)
        return F.mse_loss(out, self.schedule.target(z0, noise, t))

    def _drop_captions(self, ids: torch.Tensor) -> torch.Tensor:
        """Replace a `caption_dropout` share of captions by the empty one (guidance's uncond)."""
        drop = torch.rand(ids.shape[0]) < self.cfg.model.caption_dropout
        if not drop.any():
            return ids
        ids = ids.clone()
        text = self.model.dit.text
        ids[drop.to(ids.device), 1:] = text.pad_id
        return ids

    def train_step(self) -> dict[str, float]:
        """One optimizer update on a batch of latents."""
        cfg = self.cfg
        self.model.train()
        lr = set_lr(self.optimizer, lr_multiplier(cfg.schedule, self.step, self.max_steps))
        idx = torch.from_numpy(self.next_indices()).to(self.device)
        ids = self._drop_captions(self.ids[idx])
        loss = self.loss(self.latents[idx], ids)
        grad_norm = self.clip_and_step(loss)
        self.step += 1
        return {"loss": loss.item(), "lr": lr, "grad_norm": grad_norm}

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """The objective's loss on the eval split's first pictures, with fixed times and noise."""
        if self.eval_split is None:
            return {}
        self.model.eval()
        n = self.cfg.train.eval_images
        records = self.data.records(self.eval_split)[:n]
        z0 = self._encode(self.data.images(self.eval_split)[:n])
        ids = self.caption_ids([r["caption"] for r in records], f"{self.eval_split} captions")
        g = torch.Generator().manual_seed(1234)  # the same times and noise at every eval
        losses = [self.loss(z0[i : i + 128], ids[i : i + 128], g).item() * len(z0[i : i + 128])
                  for i in range(0, len(z0), 128)]  # fmt: skip
        return {f"{self.eval_split}_loss": round(sum(losses) / len(z0), 5)}
