"""Parameter and FLOP accounting of Mamba-2 / Gated DeltaNet layers against the module itself."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kiln.model import ModelConfig, Transformer
from kiln.model.accounting import (
    PARAM_COMPONENTS,
    flop_count,
    recurrent_mixing_flops,
    recurrent_params,
)


def config(pattern: str, **overrides: object) -> ModelConfig:
    """A small hybrid; bias on so every optional tensor is counted."""
    ssm = {"state_size": 8, "head_dim": 16, "n_groups": 2, "chunk_size": 8}
    base = dict(vocab_size=97, block_size=64, n_layer=3, layer_pattern=pattern, ssm=ssm)
    return ModelConfig.preset("tiny", **{**base, **overrides})


def measured(model: Transformer) -> dict[str, int]:
    """The module's parameters by component: mixer norms are norms, the rest of a mixer attention."""
    out = dict.fromkeys(PARAM_COMPONENTS, 0)
    for name, p in model.named_parameters():
        if name.startswith("wte."):
            part = "embeddings"
        elif name.startswith("lm_head."):
            part = "head"
        elif "norm" in name:
            part = "norms"
        else:
            part = "attention" if ".attn." in name else "mlp"
        out[part] += p.numel()
    return out


@pytest.mark.parametrize(
    "overrides",
    [
        {"layer_pattern": "M"},
        {"layer_pattern": "D", "bias": True},
        {"layer_pattern": "MDA", "tie_embeddings": False, "bias": True},
        {"layer_pattern": "M", "mlp": "none", "ssm": {"state_size": 4, "head_dim": 8, "expand": 3}},
        {"layer_pattern": "DA", "ssm": {"delta_heads": 2, "delta_head_dim": 24}},
    ],
)
def test_parameter_breakdown_equals_the_module(overrides: dict) -> None:
    cfg = config(**{"pattern": overrides.pop("layer_pattern"), **overrides})
    assert cfg.param_breakdown() == measured(Transformer(cfg))


@pytest.mark.parametrize(("kind", "pattern"), [("mamba2", "M"), ("deltanet", "D")])
@pytest.mark.parametrize("T", [8, 32])
def test_mixer_flops_match_flop_counter_mode(kind: str, pattern: str, T: int) -> None:
    """Forward and forward+backward FLOPs of one mixer, as torch counts its matmuls and conv."""
    cfg = config(pattern, n_layer=1)
    mixer = Transformer(cfg).blocks[0].attn
    x = torch.randn(2, T, cfg.n_embd, requires_grad=True)
    matmul = 2 * recurrent_params(cfg, kind, bias=False, matmul_only=True)
    forward = matmul + recurrent_mixing_flops(cfg, 0, T)  # per token
    with FlopCounterMode(display=False) as fwd:
        y = mixer(x, None, None)
    assert fwd.get_total_flops() == 2 * T * forward
    with FlopCounterMode(display=False) as both:
        mixer(x, None, None).square().sum().backward()
    counts = {str(op): n for op, n in both.get_flop_counts()["Global"].items()}
    # torch's formula for a depthwise conv's backward ignores its groups; count it as 2× forward
    counts["aten.convolution_backward"] = 2 * counts["aten.convolution"]
    # the first chunk's state is a constant zero, so autograd skips a few products: within 5%
    assert sum(counts.values()) == pytest.approx(2 * T * 3 * forward, rel=0.05)
    assert counts["aten.mm"] == 3 * 2 * T * matmul  # the projections: exactly 3× forward
    assert y.shape == x.shape


def test_flop_count_counts_attention_only_in_attention_layers() -> None:
    T = 32
    hybrid, dense = config("DDA", n_layer=3), config("A", n_layer=3)
    h, d = flop_count(hybrid, T), flop_count(dense, T)
    assert h.forward_attention * 3 == d.forward_attention  # one attention layer of three
    assert h.forward_recurrent == 2 * recurrent_mixing_flops(hybrid, 0, T)
    assert d.forward_recurrent == 0
    assert hybrid.flops_per_token(T) == h.total
    # a recurrent layer's mixing cost does not grow with T once T spans a chunk
    assert recurrent_mixing_flops(hybrid, 0, 64) == recurrent_mixing_flops(hybrid, 0, 4096)
