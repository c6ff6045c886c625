"""Training the VQ-VAE on an image dataset: `kiln image train-vqvae CONFIG.toml`.

kiln's Trainer is built around a token stream and a Transformer LM (windows, tokens/s, MFU), so
the image models get this small loop instead, made of the same parts: the TOML dataclass config
with --set overrides (kiln.config), AdamW groups and the lr schedule (optim, schedule), atomic
checkpoints with `latest`, pruning and leftovers tidied (checkpoint), metrics.jsonl (metrics),
the run-folder lock (kiln.folders). The batch order is a pure function of (seed, epoch,
position), and the cursor, the RNG states (dead-code restarts draw from torch's) and the EMA
codebook are in every checkpoint, so a resumed run takes the same steps bit for bit.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln import checkpoint_format as fmt
from kiln import config as cfgio
from kiln.config import require
from kiln.errors import KilnError
from kiln.folders import lock_folder
from kiln.image.dataset import ImageDataset
from kiln.image.vqvae import VQVAE, VQVAEConfig, psnr, to_uint8, to_unit
from kiln.io import atomic_write, write_json_atomic
from kiln.train import checkpoint as ckpt
from kiln.train.config import OptimConfig, ScheduleConfig
from kiln.train.metrics import MetricsLog
from kiln.train.optim import build_optimizer, set_lr
from kiln.train.schedule import lr_multiplier


@dataclass
class ImageDataSection:
    """Which image dataset, which split trains, which are evaluated."""

    dataset: str = ""
    train_split: str = "train"
    eval_splits: tuple[str, ...] = ("val", "heldout")  # those the dataset lacks are skipped

    def __post_init__(self) -> None:
        require(bool(self.dataset), "data.dataset: give the image dataset directory")


@dataclass
class VQVAETrainSection:
    """Length, batch, evaluation and logging cadence, device, seed."""

    max_steps: int = 2000
    batch_size: int = 64
    grad_clip: float = 1.0  # 0 turns clipping off
    eval_every: int = 250
    eval_images: int = 500  # per eval split (the first N, so every eval sees the same)
    log_every: int = 25
    restart_every: int = 50  # steps between dead-code restarts; 0: never
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "eval_every", "eval_images", "log_every"):
            require(getattr(self, name) >= 1, f"train.{name} must be >= 1")
        require(self.grad_clip >= 0, f"train.grad_clip must be >= 0, got {self.grad_clip}")
        require(self.restart_every >= 0, "train.restart_every must be >= 0")


@dataclass
class CheckpointSection:
    """How often to save and how many to keep."""

    every: int = 500
    keep_last: int = 2

    def __post_init__(self) -> None:
        require(self.every >= 1, f"checkpoint.every must be >= 1, got {self.every}")
        require(self.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {self.keep_last}")


@dataclass
class VQVAETrainConfig:
    """A `kiln image train-vqvae` TOML file."""

    data: ImageDataSection
    model: VQVAEConfig = field(default_factory=VQVAEConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_steps=50))
    train: VQVAETrainSection = field(default_factory=VQVAETrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run_dir: str = "runs/vqvae"

    @classmethod
    def load(cls, path: str | Path | None, overrides: Sequence[str] = ()) -> VQVAETrainConfig:
        """Read the TOML file, apply --set overrides, check it."""
        return cfgio.load(cls, path, overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what config.toml and state.json hold)."""
        return cfgio.to_dict(self)


def batch_indices(n: int, batch: int, seed: int, epoch: int, position: int) -> np.ndarray:
    """The batch at `position` of `epoch`: a slice of that epoch's seeded permutation."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return np.sort(order[position : position + batch])


class VQVAERun:
    """One training run in `cfg.run_dir`: fresh, or resumed from its latest checkpoint."""

    def __init__(self, cfg: VQVAETrainConfig, resume: bool = False) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.checkpoints = self.run_dir / "checkpoints"
        self.data = ImageDataset.open(cfg.data.dataset)
        if self.data.size != cfg.model.image_size:
            raise KilnError(
                f"model.image_size = {cfg.model.image_size}, but {cfg.data.dataset} holds "
                f"{self.data.size}×{self.data.size} pictures"
            )
        self.train_images = self.data.images(cfg.data.train_split)
        if len(self.train_images) < cfg.train.batch_size:
            raise KilnError(
                f"train.batch_size = {cfg.train.batch_size} is more than the "
                f"{len(self.train_images)} pictures of split {cfg.data.train_split!r}"
            )
        self.eval_splits = [s for s in cfg.data.eval_splits if s in self.data.splits]
        from kiln.devices import resolve_device

        self.device = resolve_device(cfg.train.device)
        torch.manual_seed(cfg.train.seed)
        self.model = VQVAE(cfg.model).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.step, self.epoch, self.position, self.images_seen = 0, 0, 0, 0
        self._lock = lock_folder(self.run_dir, "kiln image train-vqvae", "run folder")
        saved = fmt.resume_checkpoint(self.checkpoints)
        if saved is not None and not resume:
            raise KilnError(
                f"{self.checkpoints} already holds checkpoints; pass --resume to continue that "
                "run, or set run_dir to start a new one"
            )
        if resume and saved is None:
            raise KilnError(f"nothing to resume: {self.checkpoints} has no checkpoint")
        self.notes = ckpt.tidy(self.checkpoints, cfg.checkpoint.keep_last if saved else None)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        if saved is not None:
            self._resume(saved)
        with atomic_write(self.run_dir / "config.toml") as handle:
            handle.write(cfgio.to_toml(cfg.to_dict(), "kiln image train-vqvae: resolved config"))

    def _resume(self, path: Path) -> None:
        state = fmt.read_state(path)
        fixed = {k: v for k, v in self.cfg.to_dict().items() if k in ("model", "data")}
        saved = {k: v for k, v in state["config"].items() if k in ("model", "data")}
        changed = fmt.config_differences(saved, fixed)
        if state.get("dataset") != self.data.fingerprint():
            changed.append("the dataset's contents")
        if changed:
            raise KilnError(
                f"cannot resume from {path}: the model or data changed ({'; '.join(changed)})"
            )
        ckpt.load_weights(path, self.model, self.optimizer, self.device)
        self.step = int(state["step"])
        self.images_seen = int(state["tokens"])
        self.epoch, self.position = int(state["cursor"]["epoch"]), int(state["cursor"]["position"])
        ckpt.restore_rng(state["rng"]["0"])
        self.metrics.truncate_after(self.step)
        self.notes.append(f"resumed from {path} (step {self.step})")

    def _next_batch(self) -> torch.Tensor:
        n, b = len(self.train_images), self.cfg.train.batch_size
        if self.position + b > n:  # the epoch's remainder is dropped: every batch is full
            self.epoch, self.position = self.epoch + 1, 0
        idx = batch_indices(n, b, self.cfg.train.seed, self.epoch, self.position)
        self.position += b
        return to_unit(torch.from_numpy(np.asarray(self.train_images[idx]))).to(self.device)

    def train_step(self) -> dict[str, float]:
        """One optimizer update; returns the step's scalars."""
        cfg = self.cfg
        self.model.train()
        lr = set_lr(self.optimizer, lr_multiplier(cfg.schedule, self.step, cfg.train.max_steps))
        x = self._next_batch()
        _, stats = self.model(x)
        self.optimizer.zero_grad()
        stats["loss"].backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), cfg.train.grad_clip if cfg.train.grad_clip > 0 else 1e30
        )
        self.optimizer.step()
        restarted = 0
        if cfg.train.restart_every and (self.step + 1) % cfg.train.restart_every == 0:
            restarted = self.model.quantizer.restart_dead(stats["z_e"])
        self.step += 1
        self.images_seen += x.shape[0]
        if not torch.isfinite(stats["loss"]):
            raise KilnError(f"step {self.step}: the loss is not finite; lower optim.lr")
        return {
            "loss": stats["loss"].item(), "recon": stats["recon"].item(),
            "commit": stats["commit"].item(), "perplexity": stats["perplexity"].item(),
            "codes_in_batch": int(stats["used"]), "restarted": restarted, "lr": lr,
            "grad_norm": float(grad_norm),
        }  # fmt: skip

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

    def save(self) -> Path:
        """Checkpoint the current step (weights, EMA codebook, optimizer, cursor, RNG)."""
        state = ckpt.TrainState(
            step=self.step,
            tokens=self.images_seen,  # images, for this model
            cursor={"epoch": self.epoch, "position": self.position},
            config=self.cfg.to_dict(),
            dataset=self.data.fingerprint(),
        )
        return ckpt.save_checkpoint(
            self.checkpoints, self.model, self.optimizer, state, {"name": self.cfg.schedule.name},
            self.cfg.checkpoint.keep_last,
        )  # fmt: skip

    def run(self, progress: bool = True) -> dict[str, Any]:
        """Train to max_steps (saving, logging, evaluating); returns the final evaluation."""
        cfg = self.cfg.train
        from tqdm import tqdm

        interrupted: list[int] = []
        # Ctrl-C and SIGTERM end the loop between steps (never inside an update), then it saves.
        previous = {
            sig: signal.signal(sig, lambda s, f: interrupted.append(s))
            for sig in (signal.SIGINT, signal.SIGTERM)
        }
        bar = tqdm(total=cfg.max_steps, initial=self.step, disable=not progress, unit="step")
        start, start_step = time.perf_counter(), self.step
        try:
            while self.step < cfg.max_steps and not interrupted:
                scalars = self.train_step()
                bar.update()
                if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                    elapsed = time.perf_counter() - start
                    record = {"step": self.step, "images": self.images_seen, **scalars,
                              "images_per_s": (self.step - start_step) * cfg.batch_size / elapsed}  # fmt: skip
                    if self.step % cfg.eval_every == 0 or self.step == cfg.max_steps:
                        record.update(self.evaluate())
                    self.metrics.write(record)
                    bar.set_postfix(
                        loss=f"{scalars['loss']:.4f}", ppl=f"{scalars['perplexity']:.0f}"
                    )
                if self.step % self.cfg.checkpoint.every == 0 and self.step < cfg.max_steps:
                    self.save()
        finally:
            bar.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.save()
        if interrupted:
            raise KilnError(
                f"stopped at step {self.step}; saved {self.checkpoints} (continue with --resume)"
            )
        final = {"step": self.step, **self.evaluate()}
        write_json_atomic(self.run_dir / "eval.json", final)
        self._lock.release()
        return final

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
