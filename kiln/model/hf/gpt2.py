"""HF GPT2LMHeadModel <-> kiln: learned positions, LayerNorm with biases, tanh-GELU, multi-head.

HF GPT-2 stores its linear weights transposed (Conv1D) and its Q, K, V as one matrix, as kiln
does, so conversion transposes and renames.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from kiln.errors import KilnError
from kiln.model.config import ModelConfig
from kiln.model.hf.tensors import take


def is_gpt2(cfg: ModelConfig) -> bool:
    """Whether a kiln config has HF GPT-2's shape (the block switches are checked by the caller)."""
    gpt2_like = (cfg.pos_emb, cfg.norm, cfg.mlp, cfg.bias) == ("learned", "layernorm", "gelu", True)
    return (
        gpt2_like
        and cfg.kv_heads == cfg.n_head
        and cfg.head_dim in (None, cfg.n_embd // cfg.n_head)
    )


def gpt2_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """GPT-2 settings; options kiln does not implement are refused, not silently dropped."""
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise KilnError(f"GPT-2 activation {hf['activation_function']!r}: kiln has tanh-GELU only")
    for flag, expected in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
    ):
        if hf.get(flag, expected) != expected:
            raise KilnError(f"GPT-2 option {flag}={hf[flag]} is not supported")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        block_size=hf["n_positions"],
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        d_ff=hf.get("n_inner"),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


def gpt2_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF GPT-2 config fields of a config `is_gpt2` accepts."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.ff_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


GPT2_LAYER = (
    ("norm1.weight", "ln_1.weight"),
    ("norm1.bias", "ln_1.bias"),
    ("attn.qkv.weight", "attn.c_attn.weight"),
    ("attn.qkv.bias", "attn.c_attn.bias"),
    ("attn.proj.weight", "attn.c_proj.weight"),
    ("attn.proj.bias", "attn.c_proj.bias"),
    ("norm2.weight", "ln_2.weight"),
    ("norm2.bias", "ln_2.bias"),
    ("mlp.fc.weight", "mlp.c_fc.weight"),
    ("mlp.fc.bias", "mlp.c_fc.bias"),
    ("mlp.proj.weight", "mlp.c_proj.weight"),
    ("mlp.proj.bias", "mlp.c_proj.bias"),
)  # (kiln name, HF name) within one block


def gpt2_state_to_hf(cfg: ModelConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """kiln weights under GPT-2's names, linear weights transposed (the head is the caller's)."""
    out = {
        "transformer.wte.weight": sd["wte.weight"][: cfg.vocab_size],
        "transformer.wpe.weight": sd["wpe.weight"],
        "transformer.ln_f.weight": sd["norm_f.weight"],
        "transformer.ln_f.bias": sd["norm_f.bias"],
    }
    for i in range(cfg.n_layer):
        k, h = f"blocks.{i}.", f"transformer.h.{i}."
        for kiln_name, hf_name in GPT2_LAYER:
            tensor = sd[k + kiln_name]
            out[h + hf_name] = (
                tensor.T if hf_name.endswith("weight") and tensor.dim() == 2 else tensor
            )
    return out


def gpt2_state_from_hf(cfg: ModelConfig, hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """GPT-2's weights under kiln names, transposed back (the head is the caller's)."""
    out = {
        "wte.weight": take(hf, "transformer.wte.weight"),
        "wpe.weight": take(hf, "transformer.wpe.weight"),
        "norm_f.weight": take(hf, "transformer.ln_f.weight"),
        "norm_f.bias": take(hf, "transformer.ln_f.bias"),
    }
    for i in range(cfg.n_layer):
        for kiln_name, hf_name in GPT2_LAYER:
            tensor = take(hf, f"transformer.h.{i}.{hf_name}")
            out[f"blocks.{i}.{kiln_name}"] = tensor.T if tensor.dim() == 2 else tensor
    return out
