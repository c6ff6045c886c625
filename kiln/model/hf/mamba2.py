"""Mamba-2 (transformers' Mamba2ForCausalLM): a kiln model whose every layer is a Mamba-2 mixer.

HF's block is x + mixer(RMSNorm(x)) with no MLP, so the kiln side is layer_pattern = "M",
mlp = "none", RMSNorm, no positions. The mixer's tensors map one to one (kiln/model/ssm.py
keeps HF's in_proj order [z | x B C | Δ]); kiln's padded vocabulary rows are cut off on export.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from kiln.errors import KilnError
from kiln.model.config import ModelConfig
from kiln.model.hf.tensors import take

DEFAULT_BLOCK_SIZE = 1 << 20  # HF Mamba-2 has no context limit; kiln's config needs one

# kiln mixer tensor -> HF mixer tensor, per layer
_MIXER = {
    "w_in": "in_proj", "conv": "conv1d", "out_proj": "out_proj", "norm": "norm",
}  # fmt: skip
_PARAMS = ("dt_bias", "A_log", "D")


def is_mamba2(cfg: ModelConfig) -> bool:
    """Whether the config is HF Mamba-2's shape: Mamba-2 mixers only, RMSNorm, no MLP, no positions."""
    return (
        set(cfg.layer_pattern) == {"M"}
        and not cfg.has_mlp
        and cfg.norm == "rmsnorm"
        and cfg.pos_emb == "none"
        and cfg.norm_scale
        and not cfg.embed_scale
        and cfg.logit_softcap is None
        and cfg.mup_base_width is None
    )


def mamba2_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The Mamba2Config fields of a kiln config (`is_mamba2` must hold)."""
    s = cfg.ssm
    return {
        "model_type": "mamba2",
        "architectures": ["Mamba2ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "num_hidden_layers": cfg.n_layer,
        "num_heads": cfg.mamba_heads,
        "head_dim": s.head_dim,
        "state_size": s.state_size,
        "expand": s.expand,
        "n_groups": s.n_groups,
        "conv_kernel": s.conv_kernel,
        "chunk_size": s.chunk_size,
        "layer_norm_epsilon": cfg.norm_eps,
        "use_bias": cfg.bias,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "time_step_min": s.dt_min,
        "time_step_max": s.dt_max,
        "time_step_floor": s.dt_floor,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.block_size,
    }


def mamba2_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A kiln config from Mamba2Config fields; what kiln's mixer does not do is refused by name."""
    checks = (
        ("hidden_act", hf.get("hidden_act", "silu") == "silu", "'silu'"),
        ("use_conv_bias", hf.get("use_conv_bias", True), "true"),
        ("rms_norm", hf.get("rms_norm", True), "true"),
        ("time_step_limit", _no_limit(hf.get("time_step_limit", (0.0, math.inf))), "[0, inf]"),
    )
    for name, ok, expected in checks:
        if not ok:
            raise KilnError(f"HF mamba2 config: {name} = {hf.get(name)!r} is not supported "
                            f"(kiln's Mamba-2 needs {expected})")  # fmt: skip
    hidden, expand = hf.get("hidden_size", 4096), hf.get("expand", 2)
    head_dim = hf.get("head_dim", 64)
    if hf.get("num_heads", 128) * head_dim != hidden * expand:
        raise KilnError(f"HF mamba2 config: num_heads · head_dim must equal hidden_size · expand "
                        f"({hidden * expand}), got {hf.get('num_heads')} · {head_dim}")  # fmt: skip
    return ModelConfig.from_dict({
        "vocab_size": hf.get("vocab_size", 32768),
        "block_size": hf.get("max_position_embeddings", DEFAULT_BLOCK_SIZE),
        "n_layer": hf.get("num_hidden_layers", 64),
        "n_embd": hidden,
        "n_head": 1,  # no attention layers: heads are Mamba-2's, from ssm.head_dim
        "layer_pattern": "M",
        "mlp": "none",
        "norm": "rmsnorm",
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "pos_emb": "none",
        "bias": bool(hf.get("use_bias", False)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "ssm": {
            "state_size": hf.get("state_size", 128), "expand": expand, "head_dim": head_dim,
            "n_groups": hf.get("n_groups", 8), "conv_kernel": hf.get("conv_kernel", 4),
            "chunk_size": hf.get("chunk_size", 256), "dt_min": hf.get("time_step_min", 0.001),
            "dt_max": hf.get("time_step_max", 0.1), "dt_floor": hf.get("time_step_floor", 1e-4),
        },
    }, where="HF mamba2 config")  # fmt: skip


def _no_limit(limit: Any) -> bool:
    """Whether a time_step_limit clamps nothing (kiln's Mamba-2 does not clamp Δ)."""
    lo, hi = limit
    return float(lo) <= 0.0 and math.isinf(float(hi))


def mamba2_state_to_hf(cfg: ModelConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """kiln tensors under Mamba2ForCausalLM's names (the padded vocabulary rows dropped)."""
    out = {"backbone.embeddings.weight": sd["wte.weight"][: cfg.vocab_size]}
    out["backbone.norm_f.weight"] = sd["norm_f.weight"]
    for i in range(cfg.n_layer):
        hf, kl = f"backbone.layers.{i}.", f"blocks.{i}."
        out[hf + "norm.weight"] = sd[kl + "norm1.weight"]
        for name in _PARAMS:
            out[hf + f"mixer.{name}"] = sd[kl + f"attn.{name}"]
        for ours, theirs in _MIXER.items():
            for kind in ("weight", "bias"):
                if (key := kl + f"attn.{ours}.{kind}") in sd:
                    out[hf + f"mixer.{theirs}.{kind}"] = sd[key]
    return out


def mamba2_state_from_hf(cfg: ModelConfig, hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """Mamba2ForCausalLM tensors under kiln's names (the vocabulary padded by the caller)."""
    out = {"wte.weight": take(hf, "backbone.embeddings.weight")}
    out["norm_f.weight"] = take(hf, "backbone.norm_f.weight")
    for i in range(cfg.n_layer):
        pre, kl = f"backbone.layers.{i}.", f"blocks.{i}."
        out[kl + "norm1.weight"] = take(hf, pre + "norm.weight")
        for name in _PARAMS:
            out[kl + f"attn.{name}"] = take(hf, pre + f"mixer.{name}")
        for ours, theirs in _MIXER.items():
            out[kl + f"attn.{ours}.weight"] = take(hf, pre + f"mixer.{theirs}.weight")
            has_bias = ours == "conv" or (cfg.bias and ours in ("w_in", "out_proj"))
            if has_bias:
                out[kl + f"attn.{ours}.bias"] = take(hf, pre + f"mixer.{theirs}.bias")
    return out
