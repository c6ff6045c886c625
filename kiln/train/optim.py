"""Optimizers: AdamW with decayed and undecayed parameter groups, or Muon + AdamW.

Weight decay pulls matrices toward zero; on embeddings (rows that see few updates), biases and
norm scales it only hurts, so those go in an undecayed group. Muon orthogonalises the update of
2-D hidden matrices; embeddings and the output head stay with AdamW, as its authors advise.
Every group carries `peak_lr`, and the trainer sets `lr = peak_lr · schedule(step)`. Under µP
(the model config's mup_base_width) hidden matrices get their own group at the rate
kiln/train/mup.py derives; the other roles keep optim.lr.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kiln.train.config import OptimConfig
from kiln.train.mup import lr_multipliers
from kiln.train.param_roles import split_parameters


def decay_groups(
    named: list[tuple[str, nn.Parameter]],
    no_decay: list[tuple[str, nn.Parameter]],
    cfg: OptimConfig,
    lr_scale: float = 1.0,
) -> list[dict[str, Any]]:
    """AdamW parameter groups: `named` decayed by cfg.weight_decay, `no_decay` not at all."""
    groups = [
        {"params": [p for _, p in named], "names": [n for n, _ in named],
         "weight_decay": cfg.weight_decay},
        {"params": [p for _, p in no_decay], "names": [n for n, _ in no_decay],
         "weight_decay": 0.0},
    ]  # fmt: skip
    for g in groups:
        g["peak_lr"] = g["lr"] = cfg.lr * lr_scale
    return [g for g in groups if g["params"]]


class OptimizerSet:
    """One or more torch optimizers stepped together, with one state dict (Muon + AdamW)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every group of every optimizer."""
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        """One update of every optimizer."""
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient."""
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The optimizers' states, in order."""
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore states saved by `state_dict` from an optimizer set built the same way."""
        saved = state["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"{len(saved)} saved optimizers, {len(self.optimizers)} here")
        for o, s in zip(self.optimizers, saved, strict=True):
            o.load_state_dict(s)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> OptimizerSet:
    """The optimizer(s) of `cfg` over `model`'s parameters, placed for `device`."""
    roles = split_parameters(model)
    no_decay = roles["embedding"] + roles["vector"]
    fused = cfg.fused if cfg.fused is not None else device.type in ("cuda", "cpu")
    adamw_kwargs = dict(betas=cfg.betas, eps=cfg.eps, fused=fused)
    model_cfg = getattr(model, "cfg", None)
    mup = model_cfg is not None and model_cfg.mup_base_width is not None
    hidden_scale = lr_multipliers(model_cfg, cfg.name)["hidden"] if mup else 1.0
    if cfg.name == "adamw" and mup:  # µP: the hidden matrices' group at lr / width_mult
        groups = decay_groups(roles["hidden"], [], cfg, hidden_scale)
        groups += decay_groups(roles["head"], no_decay, cfg)
        return OptimizerSet([torch.optim.AdamW(groups, lr=cfg.lr, **adamw_kwargs)])
    if cfg.name == "adamw":
        groups = decay_groups(roles["hidden"] + roles["head"], no_decay, cfg)
        return OptimizerSet([torch.optim.AdamW(groups, lr=cfg.lr, **adamw_kwargs)])
    # Muon: its "match_rms_adamw" scaling lets it share AdamW's lr and weight decay.
    muon_group = {
        "params": [p for _, p in roles["hidden"]],
        "names": [n for n, _ in roles["hidden"]],
        "peak_lr": cfg.lr * hidden_scale,  # µP: lr / √width_mult (kiln/train/mup.py)
        "lr": cfg.lr * hidden_scale,
    }
    muon = torch.optim.Muon(
        [muon_group], lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
        adjust_lr_fn="match_rms_adamw",
    )  # fmt: skip
    adamw = torch.optim.AdamW(decay_groups(roles["head"], no_decay, cfg), lr=cfg.lr, **adamw_kwargs)
    return OptimizerSet([muon, adamw])


def set_lr(optimizer: OptimizerSet, multiplier: float) -> float:
    """Set every group's lr to its peak times `multiplier`; returns the first group's lr."""
    for g in optimizer.param_groups:
        g["lr"] = g["peak_lr"] * multiplier
    return optimizer.param_groups[0]["lr"]
