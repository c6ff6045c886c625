"""Training the checker on rendered scenes: `kiln image train-checker CONFIG.toml`.

Only rendered pictures and their ground truth are used, never generated ones. To score unseen
compositions it must know them: `train.extra_splits` adds splits (the held-out compositions of
a dataset drawn with another seed) to what it learns from; it is then measured on pictures it
never saw. Each step flips a random half of the
batch left-right (mirroring the centres' x) so the checker sees layouts the grammar rarely
draws; the flips come from torch's RNG, which every checkpoint keeps. Its accuracy on the
eval splits (held-out compositions included) is what says whether its scores mean anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.image.checker import Checker, CheckerConfig, checker_loss, predict, score, targets
from kiln.image.vqvae import to_unit
from kiln.train.config import OptimConfig, ScheduleConfig
from kiln.train.image_loop import (
    CheckpointSection,
    ImageDataSection,
    ImageRun,
    ImageTrainConfig,
    ImageTrainSection,
    open_images,
)
from kiln.train.optim import build_optimizer, set_lr
from kiln.train.schedule import lr_multiplier


@dataclass
class CheckerTrainSection(ImageTrainSection):
    """The shared [train] fields, the flips, and the extra splits learnt from."""

    max_steps: int = 1500
    flip: bool = True  # mirror a random half of each batch (left of <-> right of)
    # More splits to learn from beside data.train_split, e.g. ["heldout"] of a dataset drawn
    # with another seed: a checker that never saw a yellow car cannot say a car is yellow.
    extra_splits: tuple[str, ...] = ()


@dataclass
class CheckerTrainConfig(ImageTrainConfig):
    """A `kiln image train-checker` TOML file."""

    data: ImageDataSection
    model: CheckerConfig = field(default_factory=CheckerConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-3, weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_steps=50))
    train: CheckerTrainSection = field(default_factory=CheckerTrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run_dir: str = "runs/checker"


def _flip_records(truth: dict[str, torch.Tensor], flip: torch.Tensor) -> dict[str, torch.Tensor]:
    centre = truth["centre"].clone()
    centre[flip, :, 0] = torch.where(
        truth["centre_mask"][flip] > 0, 1 - centre[flip, :, 0], centre[flip, :, 0]
    )
    return {**truth, "centre": centre}


class CheckerRun(ImageRun):
    """One checker training run: fresh, or resumed from its latest checkpoint."""

    command = "kiln image train-checker"

    def __init__(self, cfg: CheckerTrainConfig, resume: bool = False) -> None:
        self.data = open_images(cfg.data.dataset, cfg.model.image_size, "model.image_size")
        splits = [cfg.data.train_split, *cfg.train.extra_splits]
        records = [r for split in splits for r in self.data.records(split)]
        if not records or "objects" not in records[0]:
            raise KilnError(
                f"{cfg.data.dataset}: the checker needs rendered scenes with ground truth "
                "(kiln image data), not a folder of pictures"
            )
        super().__init__(cfg, len(records), resume)
        from kiln.devices import resolve_device

        self.device = resolve_device(cfg.train.device)
        torch.manual_seed(cfg.train.seed)
        self.model = Checker(cfg.model).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        parts = [self.data.images(split) for split in splits]
        self.images = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.truth = targets(records)
        self.eval_splits = [s for s in cfg.data.eval_splits if s in self.data.splits]
        self.start()

    def fingerprint(self) -> dict[str, Any]:
        """The image dataset's identity."""
        return self.data.fingerprint()

    def train_step(self) -> dict[str, float]:
        """One optimizer update on a batch of rendered pictures."""
        cfg = self.cfg
        self.model.train()
        lr = set_lr(self.optimizer, lr_multiplier(cfg.schedule, self.step, self.max_steps))
        idx = self.next_indices()
        x = to_unit(torch.from_numpy(np.array(self.images[idx])))
        truth = {k: v[torch.from_numpy(idx)] for k, v in self.truth.items()}
        if cfg.train.flip:
            flip = torch.rand(len(idx)) < 0.5
            x[flip] = x[flip].flip(-1)
            truth = _flip_records(truth, flip)
        out = self.model(x.to(self.device))
        loss = checker_loss(out, {k: v.to(self.device) for k, v in truth.items()}, cfg.model)
        grad_norm = self.clip_and_step(loss)
        self.step += 1
        return {"loss": loss.item(), "lr": lr, "grad_norm": grad_norm}

    def evaluate(self) -> dict[str, Any]:
        """Per-attribute accuracy on each eval split's first `eval_images` renders."""
        out: dict[str, Any] = {}
        for split in self.eval_splits:
            n = self.cfg.train.eval_images
            x = to_unit(torch.from_numpy(np.array(self.data.images(split)[:n])))
            scores = score(predict(self.model, x), self.data.records(split)[:n])
            out.update({f"{split}_{k}": round(v, 4) for k, v in scores.items()})
        return out


def load_checker(run: str | Path) -> Checker:
    """The checker of a `kiln image train-checker` run's latest checkpoint, in eval mode."""
    from kiln import checkpoint_format as fmt

    path = fmt.latest_checkpoint(Path(run) / "checkpoints")
    if path is None:
        raise KilnError(f"{run}: no checkpoint; train it with `kiln image train-checker`")
    model_cfg = fmt.read_state(path).get("config", {}).get("model", {})
    if "centre_weight" not in model_cfg:
        raise KilnError(f"{run}: {path} is not a checker checkpoint")
    # Checkpoints from before model.head existed hold the flat head.
    checker = Checker(CheckerConfig(**{"head": "flat", **model_cfg}))
    checker.load_state_dict(fmt.read_tensors(path / "model.safetensors"))
    return checker.eval()
