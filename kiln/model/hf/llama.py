"""HF LlamaForCausalLM <-> kiln: RoPE (with its scaling types), RMSNorm, SwiGLU, grouped heads.

kiln fuses Q, K, V and SwiGLU's gate and up into one matrix each, so conversion concatenates or
splits them; both use the same split-half RoPE layout, so no permutation is needed. The Llama
families with experts or latent attention (moe_mla.py) share these names and add their own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.model.config import ModelConfig, RopeScaling
from kiln.model.hf.moe_mla import family_config_to_hf, family_of, layer_from_hf, layer_to_hf
from kiln.model.hf.tensors import take

ARCHITECTURES = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}


def is_llama(cfg: ModelConfig) -> bool:
    """Whether a kiln config has Llama's shape (the block switches are checked by the caller)."""
    return (cfg.pos_emb, cfg.norm, cfg.mlp) == ("rope", "rmsnorm", "swiglu")


def llama_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Llama settings, from the current (rope_parameters) or the older (rope_theta) layout."""
    if hf.get("hidden_act", "silu") != "silu":
        raise KilnError(f"Llama activation {hf['hidden_act']!r}: kiln's SwiGLU uses silu")
    bias = bool(hf.get("attention_bias", False))
    if bool(hf.get("mlp_bias", False)) != bias:
        raise KilnError(
            "Llama with attention_bias != mlp_bias is not supported (kiln has one bias switch)"
        )
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling, block_size = rope_scaling_from_hf(rope, hf["max_position_embeddings"])
    n_head = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        block_size=block_size,
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head,
        n_embd=hf["hidden_size"],
        head_dim=None if head_dim * n_head == hf["hidden_size"] else head_dim,
        mlp="swiglu",
        d_ff=hf["intermediate_size"],
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        bias=bias,
        pos_emb="rope",
        rope_theta=float(theta),
        rope_scaling=scaling,
        tie_embeddings=hf.get("tie_word_embeddings", False),
    )


def rope_scaling_from_hf(
    rope: dict[str, Any], max_positions: int
) -> tuple[RopeScaling | None, int]:
    """kiln's RopeScaling and block_size for HF rope parameters (rope_type's HF meaning).

    HF's dynamic NTK treats max_position_embeddings as the original length and has no limit
    beyond it; kiln's block_size for it is that length times the factor.
    """
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None, max_positions
    if rope_type not in ("linear", "dynamic", "yarn", "llama3"):
        raise KilnError(
            f"RoPE type {rope_type!r} is not supported (kiln has default, linear, dynamic, "
            "yarn and llama3)"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0 or rope.get("truncate", True) is not True:
        raise KilnError("RoPE partial_rotary_factor / truncate = false are not supported")
    factor = float(rope["factor"])
    fields: dict[str, Any] = {"type": rope_type, "factor": factor}
    block_size = max_positions
    if rope_type == "llama3":
        fields.update(
            low_freq_factor=rope["low_freq_factor"], high_freq_factor=rope["high_freq_factor"],
            original_max_seq_len=rope["original_max_position_embeddings"],
        )  # fmt: skip
    elif rope_type == "dynamic":
        fields["original_max_seq_len"] = max_positions
        block_size = int(max_positions * max(factor, 1.0))
    elif rope_type == "yarn":
        fields["original_max_seq_len"] = rope["original_max_position_embeddings"]
        for key in ("beta_fast", "beta_slow"):
            if rope.get(key):
                fields[key] = float(rope[key])
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if rope.get(key) is not None:
                fields[key] = float(rope[key])
    else:  # linear: the original length plays no part
        fields["original_max_seq_len"] = max_positions
    return RopeScaling(**fields), block_size


def rope_to_hf(cfg: ModelConfig) -> tuple[dict[str, Any], int]:
    """HF rope_parameters and max_position_embeddings for a kiln config."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    s = cfg.rope_scaling
    if s is None:
        return rope, cfg.block_size
    rope.update(rope_type=s.type, factor=s.factor)
    if s.type == "llama3":
        rope.update(
            low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_seq_len,
        )  # fmt: skip
    elif s.type == "yarn":
        rope.update(
            original_max_position_embeddings=s.original_max_seq_len, beta_fast=s.beta_fast,
            beta_slow=s.beta_slow,
        )  # fmt: skip
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(s, key) is not None:
                rope[key] = getattr(s, key)
    elif s.type == "dynamic":
        return rope, s.original_max_seq_len
    return rope, cfg.block_size


def llama_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config fields of a config `is_llama` accepts (Mixtral / Qwen3-MoE / DeepSeek-V3's
    when it has experts or latent attention)."""
    rope, max_positions = rope_to_hf(cfg)
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": max_positions,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ff_size,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # older transformers read these two keys...
        "rope_scaling": None if cfg.rope_scaling is None else rope,
        "rope_parameters": rope,  # ...newer ones this
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "tie_word_embeddings": cfg.tie_embeddings,
    }
    family = family_of(cfg)
    if family is not None:  # Llama's fields and these
        out.update(model_type=family, architectures=[f"{ARCHITECTURES[family]}ForCausalLM"])
        out.update(family_config_to_hf(cfg, family))
    return out


def llama_state_to_hf(cfg: ModelConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """kiln weights under Llama's names, fused matrices split (the head is the caller's)."""
    q_out, kv_out = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
    out = {
        "model.embed_tokens.weight": sd["wte.weight"][: cfg.vocab_size],
        "model.norm.weight": sd["norm_f.weight"],
    }
    for i in range(cfg.n_layer):
        k, h = f"blocks.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = sd[k + "norm1.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[k + "norm2.weight"]
        out.update(layer_to_hf(cfg, sd, i))  # MLA, experts, q/k norms (moe_mla.py)
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            if cfg.mla is None:
                q, kk, v = sd[f"{k}attn.qkv.{kind}"].split([q_out, kv_out, kv_out])
                out[f"{h}self_attn.q_proj.{kind}"] = q
                out[f"{h}self_attn.k_proj.{kind}"] = kk
                out[f"{h}self_attn.v_proj.{kind}"] = v
                out[f"{h}self_attn.o_proj.{kind}"] = sd[f"{k}attn.proj.{kind}"]
            if not cfg.is_moe_layer(i):
                gate, up = sd[f"{k}mlp.fc.{kind}"].chunk(2)
                out[f"{h}mlp.gate_proj.{kind}"], out[f"{h}mlp.up_proj.{kind}"] = gate, up
                out[f"{h}mlp.down_proj.{kind}"] = sd[f"{k}mlp.proj.{kind}"]
    return out


def llama_state_from_hf(
    cfg: ModelConfig, hf: dict[str, Tensor], rope_interleave: bool = False
) -> dict[str, Tensor]:
    """Llama's weights under kiln names, fused (the head is the caller's).

    rope_interleave: DeepSeek's interleaved RoPE rows, permuted to kiln's split halves.
    """
    out = {
        "wte.weight": take(hf, "model.embed_tokens.weight"),
        "norm_f.weight": take(hf, "model.norm.weight"),
    }
    for i in range(cfg.n_layer):
        k, h = f"blocks.{i}.", f"model.layers.{i}."
        out[k + "norm1.weight"] = take(hf, h + "input_layernorm.weight")
        out[k + "norm2.weight"] = take(hf, h + "post_attention_layernorm.weight")
        out.update(layer_from_hf(cfg, hf, i, rope_interleave))  # MLA, experts, q/k norms
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            if cfg.mla is None:
                qkv = [take(hf, f"{h}self_attn.{p}_proj.{kind}") for p in "qkv"]
                out[f"{k}attn.qkv.{kind}"] = torch.cat(qkv)
                out[f"{k}attn.proj.{kind}"] = take(hf, f"{h}self_attn.o_proj.{kind}")
            if not cfg.is_moe_layer(i):
                gate_up = [take(hf, f"{h}mlp.{p}_proj.{kind}") for p in ("gate", "up")]
                out[f"{k}mlp.fc.{kind}"] = torch.cat(gate_up)
                out[f"{k}mlp.proj.{kind}"] = take(hf, f"{h}mlp.down_proj.{kind}")
    return out
