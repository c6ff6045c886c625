"""µP, the maximal-update parameterisation (Yang & Hu 2021; Tensor Programs V), in one place.

A model is in µP when `ModelConfig.mup_base_width` is set; m = n_embd / mup_base_width. At the
base width (m = 1) µP and standard parameterisation (SP) are the same model, so learning rates
tuned there carry to any width. Relative to SP (roles from `param_roles.split_parameters`):

    role         init std      AdamW lr    Muon lr      forward (kiln.model, from the config)
    hidden       σ / √m        lr / m      lr / √m      attention scores · √D₀/D (1/D, not 1/√D)
    embedding    σ             lr          (AdamW) lr
    head         σ             lr          (AdamW) lr   logits of h / m (output multiplier)
    vector       as SP         lr          (AdamW) lr   biases, norm scales

Hidden AdamW updates have entries of size lr whatever the width, so a width-m matrix moves
activations by Θ(m·lr): lr / m keeps that constant. kiln's Muon update is orthogonal and
RMS-matched to AdamW (0.2·√max(fan_out, fan_in) times the orthogonal factor), whose spectral
norm grows as √m; lr / √m keeps the spectral norm of the update constant (the spectral
condition of Yang, Simon & Bernstein 2023). The head's input is divided by m, so a Θ(1) Adam
step on its weights changes logits by Θ(1) however wide the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.model.config import ModelConfig
from kiln.train.param_roles import split_parameters

ROLES = ("hidden", "head", "embedding", "vector")


def lr_multipliers(cfg: ModelConfig, optimizer: str) -> dict[str, float]:
    """Each role's learning rate as a multiple of optim.lr (all 1 under SP)."""
    m = cfg.width_mult
    hidden = 1.0 / m if optimizer == "adamw" else m**-0.5
    return {"hidden": hidden, "head": 1.0, "embedding": 1.0, "vector": 1.0}


def init_multipliers(cfg: ModelConfig) -> dict[str, float]:
    """Each role's initial standard deviation as a multiple of SP's (all 1 under SP)."""
    return {"hidden": cfg.width_mult**-0.5, "head": 1.0, "embedding": 1.0, "vector": 1.0}


@torch.no_grad()
def apply_mup_init(model: nn.Module) -> None:
    """Rescale a freshly initialised (SP) model's weights to µP's init; no-op under SP."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    if cfg.mup_base_width is None:
        return
    mults = init_multipliers(cfg)
    for role, named in split_parameters(model).items():
        if role != "vector" and mults[role] != 1.0:
            for _, p in named:
                p.mul_(mults[role])  # N(0, σ²) scaled by c is N(0, (cσ)²)


def mup_record(cfg: ModelConfig, optimizer: str, lr: float) -> dict[str, Any] | None:
    """What a checkpoint records of µP: the base, the multiplier, each role's lr and init std."""
    if cfg.mup_base_width is None:
        return None
    lrs, inits = lr_multipliers(cfg, optimizer), init_multipliers(cfg)
    return {
        "base_width": cfg.mup_base_width,
        "width_mult": cfg.width_mult,
        "attention_scale": cfg.attention_scale,
        "output_multiplier": 1.0 / cfg.width_mult,
        "optimizer": optimizer,
        "lr": {role: lr * lrs[role] for role in ROLES},
        # residual output projections are further scaled by 1/√(2·n_layer), as under SP
        "init_std": {role: cfg.init_std * inits[role] for role in ("hidden", "embedding", "head")},
    }
