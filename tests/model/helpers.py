"""Small configs and random-weight helpers shared by the model tests."""

from __future__ import annotations

import torch

from kiln.model import ModelConfig, Transformer


def gpt2_small(**overrides: object) -> ModelConfig:
    """A GPT-2-style config small enough for fast CPU tests."""
    base = dict(vocab_size=300, block_size=64, n_layer=2, n_head=4, n_embd=64)
    return ModelConfig(**{**base, **overrides})


def llama_small(**overrides: object) -> ModelConfig:
    """A Llama-style config (GQA, non-default theta) small enough for fast CPU tests."""
    return ModelConfig.preset(
        "tiny", **{"vocab_size": 300, "block_size": 64, "rope_theta": 50000.0, **overrides}
    )


@torch.no_grad()
def randomize(model: torch.nn.Module, std: float = 0.2, seed: int = 0) -> torch.nn.Module:
    """Give every parameter (norm scales and biases too) clearly non-trivial random values.

    Default initialisation leaves norms at one and biases at zero, which would hide a mapping
    bug in exactly those tensors; larger weights make small numerical slips visible.
    """
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * std + (1.0 if p.dim() == 1 else 0.0))
    return model


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A randomized model in eval mode (vocabulary padding rows left at zero, as initialised)."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    randomize(model, seed=seed)
    with torch.no_grad():
        model.wte.weight[cfg.vocab_size :] = 0
        model.lm_head.weight[cfg.vocab_size :] = 0
    return model.eval()
