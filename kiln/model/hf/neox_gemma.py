"""Hugging Face interop for the families that are kiln's block switches: GPT-NeoX and Gemma 2.

GPTNeoXForCausalLM is kiln with parallel blocks and two norms (use_parallel_residual; without
it, plain pre-norm), partial RoPE (partial_rotary_factor), LayerNorm with biases and exact GELU.
Its fused query_key_value interleaves per head, rows (H, 3, D), where kiln's qkv is (3, H, D).

Gemma2ForCausalLM is kiln with sandwich norms, GeGLU (tanh GELU), embeddings × √C, the query
scale query_pre_attn_scalar^-½, attention and final-logit soft-capping and alternating
sliding/full layers. Gemma's RMSNorm multiplies by (1 + w): kiln stores the scale itself, so
import adds one and export subtracts it (a kiln → HF → kiln trip may move a scale by one ulp).
convert.py calls these when `switch_family_of` names a family.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.model.config import ModelConfig
from kiln.model.hf.tensors import take

SWITCH_FAMILIES = ("gpt_neox", "gemma2")

_NEOX_ACT = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
_GEMMA_NORMS = (
    ("norm1", "input_layernorm"),
    ("norm1_post", "post_attention_layernorm"),
    ("norm2", "pre_feedforward_layernorm"),
    ("norm2_post", "post_feedforward_layernorm"),
)


def switch_family_of(cfg: ModelConfig) -> str | None:
    """gemma2 for sandwich norms; gpt_neox for parallel blocks with two norms, or for sequential
    pre-norm blocks with RoPE, LayerNorm with biases and an ungated MLP; else None."""
    if cfg.norm_placement == "sandwich":
        return "gemma2"
    neox_like = cfg.pos_emb == "rope" and cfg.norm == "layernorm" and cfg.bias and not cfg.gated
    if (cfg.parallel_block and cfg.parallel_norms == 2) or (neox_like and not cfg.parallel_block):
        return "gpt_neox"
    return None


# ---- configs ---------------------------------------------------------------------------------


def switch_config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    """The kiln config of a GPT-NeoX or Gemma 2 config dict; unsupported options are refused."""
    rope = dict(hf.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise KilnError(f"HF {model_type} with RoPE type {rope['rope_type']!r} is not supported")
    return _neox_from_hf(hf, rope) if model_type == "gpt_neox" else _gemma2_from_hf(hf, rope)


def _neox_from_hf(hf: dict[str, Any], rope: dict[str, Any]) -> ModelConfig:
    """GPT-NeoX: parallel (or sequential) pre-norm blocks, partial RoPE, biases everywhere."""
    act = hf.get("hidden_act", "gelu")
    if act not in _NEOX_ACT:
        raise KilnError(f"GPT-NeoX activation {act!r}: kiln has {', '.join(_NEOX_ACT)}")
    if not hf.get("attention_bias", True):
        raise KilnError(
            "GPT-NeoX with attention_bias = false is not supported (its MLP has biases)"
        )
    parallel = bool(hf.get("use_parallel_residual", True))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        block_size=hf["max_position_embeddings"],
        n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"],
        n_embd=hf["hidden_size"],
        mlp=_NEOX_ACT[act],
        d_ff=hf["intermediate_size"],
        norm="layernorm",
        norm_eps=hf.get("layer_norm_eps", 1e-5),
        bias=True,
        pos_emb="rope",
        rope_theta=float(rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0))),
        rotary_fraction=float(rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        parallel_block=parallel,
        parallel_norms=2,
    )


def _gemma2_from_hf(hf: dict[str, Any], rope: dict[str, Any]) -> ModelConfig:
    """Gemma 2: sandwich RMSNorms, GeGLU, scaled embeddings, soft-caps, sliding/full layers."""
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_new"):
        raise KilnError(f"Gemma 2 activation {hf['hidden_activation']!r}: kiln's GeGLU is tanh")
    if hf.get("attention_bias", False):
        raise KilnError("Gemma 2 with attention_bias = true is not supported")
    n_layer = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)
    ]
    pattern = "".join("L" if t == "sliding_attention" else "G" for t in types)
    window = hf.get("sliding_window") if "L" in pattern else None
    if window is not None and pattern != ("LG" * n_layer)[:n_layer]:
        raise KilnError(f"Gemma 2 layer_types {types}: kiln supports alternating sliding/full")
    n_head, head_dim = hf["num_attention_heads"], hf.get("head_dim", 256)
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        block_size=hf["max_position_embeddings"],
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head,
        n_embd=hf["hidden_size"],
        head_dim=None if head_dim * n_head == hf["hidden_size"] else head_dim,
        mlp="geglu",
        d_ff=hf["intermediate_size"],
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        bias=False,
        pos_emb="rope",
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        norm_placement="sandwich",
        embed_scale=True,
        attn_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        attn_softcap=hf.get("attn_logit_softcapping"),
        logit_softcap=hf.get("final_logit_softcapping"),
        sliding_window=window,
        window_pattern="LG" if window is not None else "L",
    )


def switch_config_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """The HF config dict of a kiln config in one of SWITCH_FAMILIES; a clear error if it differs."""
    expected = _NEOX_EXPECTED if family == "gpt_neox" else _GEMMA2_EXPECTED
    wrong = [
        f"{k}={getattr(cfg, k)!r} (needs {v!r})"
        for k, v in expected.items()
        if getattr(cfg, k) != v
    ]
    if family == "gpt_neox" and cfg.mlp not in _NEOX_ACT.values():
        wrong.append(f"mlp={cfg.mlp!r}")
    if cfg.sliding_window is not None and (family == "gpt_neox" or cfg.window_pattern != "LG"):
        wrong.append(f"sliding_window with window_pattern={cfg.window_pattern!r}")
    if wrong or cfg.rope_scaling is not None or cfg.mup_base_width is not None:
        raise KilnError(f"no HF {family} equivalent: {', '.join(wrong) or 'rope_scaling / µP'}")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    common = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": cfg.ff_size,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "max_position_embeddings": cfg.block_size, "tie_word_embeddings": cfg.tie_embeddings,
    }  # fmt: skip
    if family == "gpt_neox":
        act = {v: k for k, v in _NEOX_ACT.items() if k != "gelu_new"}[cfg.mlp]
        rope["partial_rotary_factor"] = cfg.rotary_fraction
        return {
            **common, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
            "hidden_act": act, "layer_norm_eps": cfg.norm_eps, "use_parallel_residual": cfg.parallel_block,
            "attention_bias": True, "rope_parameters": rope,
        }  # fmt: skip
    return {
        **common, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope, "query_pre_attn_scalar": _query_pre_attn_scalar(cfg),
        "attn_logit_softcapping": cfg.attn_softcap, "final_logit_softcapping": cfg.logit_softcap,
        "sliding_window": cfg.sliding_window or cfg.block_size,  # HF always builds its mask
        "layer_types": [
            "sliding_attention" if cfg.layer_window(i) is not None else "full_attention"
            for i in range(cfg.n_layer)
        ],
    }  # fmt: skip


_NEOX_EXPECTED = {
    "norm_placement": "pre", "norm": "layernorm", "bias": True, "pos_emb": "rope", "n_kv_head": None, "qk_norm": False,
    "norm_scale": True, "embed_scale": False, "attn_scale": None, "attn_softcap": None,
    "logit_softcap": None, "moe": None, "mla": None, "attn_sinks": False,
}  # fmt: skip
_GEMMA2_EXPECTED = {
    "norm": "rmsnorm", "bias": False, "pos_emb": "rope", "mlp": "geglu", "qk_norm": False,
    "norm_scale": True, "embed_scale": True, "parallel_block": False, "moe": None, "mla": None,
    "attn_sinks": False, "rotary_fraction": 1.0,
}  # fmt: skip


def _query_pre_attn_scalar(cfg: ModelConfig) -> float:
    """Gemma's query_pre_attn_scalar s for kiln's query scale (scale = s^-½; None: head_dim)."""
    if cfg.attn_scale is None:
        return cfg.head_size
    s = cfg.attn_scale**-2
    return round(s) if abs(s - round(s)) < 1e-6 else s


# ---- weights ---------------------------------------------------------------------------------


def switch_state_to_hf(cfg: ModelConfig, sd: dict[str, Tensor], family: str) -> dict[str, Tensor]:
    """kiln weights under the family's HF names (vocab padding removed)."""
    V, out = cfg.vocab_size, {}
    if family == "gpt_neox":
        H, D, C = cfg.n_head, cfg.head_size, cfg.n_embd
        out["gpt_neox.embed_in.weight"] = sd["wte.weight"][:V]
        for kind in ("weight", "bias"):
            out[f"gpt_neox.final_layer_norm.{kind}"] = sd[f"norm_f.{kind}"]
        for i in range(cfg.n_layer):
            k, h = f"blocks.{i}.", f"gpt_neox.layers.{i}."
            for kind in ("weight", "bias"):
                for kiln_name, hf_name in _NEOX_LAYER:
                    out[h + f"{hf_name}.{kind}"] = sd[k + f"{kiln_name}.{kind}"]
                qkv = sd[k + f"attn.qkv.{kind}"]  # rows (3, H, D) -> HF's (H, 3, D)
                shape = (3, H, D, C) if kind == "weight" else (3, H, D)
                out[h + f"attention.query_key_value.{kind}"] = (
                    qkv.view(shape).transpose(0, 1).reshape(qkv.shape)
                )
    else:
        out["model.embed_tokens.weight"] = sd["wte.weight"][:V]
        out["model.norm.weight"] = sd["norm_f.weight"] - 1
        q_out, kv_out = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
        for i in range(cfg.n_layer):
            k, h = f"blocks.{i}.", f"model.layers.{i}."
            for kiln_name, hf_name in _GEMMA_NORMS:
                out[h + f"{hf_name}.weight"] = sd[k + f"{kiln_name}.weight"] - 1
            q, kk, v = sd[k + "attn.qkv.weight"].split([q_out, kv_out, kv_out])
            out.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": kk})
            out[h + "self_attn.v_proj.weight"] = v
            out[h + "self_attn.o_proj.weight"] = sd[k + "attn.proj.weight"]
            gate, up = sd[k + "mlp.fc.weight"].chunk(2)
            out.update({h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up})
            out[h + "mlp.down_proj.weight"] = sd[k + "mlp.proj.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"][:V]
    return out


_NEOX_LAYER = (
    ("norm1", "input_layernorm"),
    ("norm2", "post_attention_layernorm"),
    ("attn.proj", "attention.dense"),
    ("mlp.fc", "mlp.dense_h_to_4h"),
    ("mlp.proj", "mlp.dense_4h_to_h"),
)


def switch_state_from_hf(cfg: ModelConfig, hf: dict[str, Tensor], family: str) -> dict[str, Tensor]:
    """HF weights of the family under kiln names (embeddings and blocks; the head is the caller's)."""
    out: dict[str, Tensor] = {}
    if family == "gpt_neox":
        H, D, C = cfg.n_head, cfg.head_size, cfg.n_embd
        out["wte.weight"] = take(hf, "gpt_neox.embed_in.weight")
        for kind in ("weight", "bias"):
            out[f"norm_f.{kind}"] = take(hf, f"gpt_neox.final_layer_norm.{kind}")
        for i in range(cfg.n_layer):
            k, h = f"blocks.{i}.", f"gpt_neox.layers.{i}."
            for kind in ("weight", "bias"):
                for kiln_name, hf_name in _NEOX_LAYER:
                    out[k + f"{kiln_name}.{kind}"] = take(hf, h + f"{hf_name}.{kind}")
                qkv = take(hf, h + f"attention.query_key_value.{kind}")  # (H, 3, D) -> (3, H, D)
                shape = (H, 3, D, C) if kind == "weight" else (H, 3, D)
                out[k + f"attn.qkv.{kind}"] = qkv.view(shape).transpose(0, 1).reshape(qkv.shape)
        if "embed_out.weight" in hf:  # the older name of GPT-NeoX's head
            hf["lm_head.weight"] = hf["embed_out.weight"]
        return out
    out["wte.weight"] = take(hf, "model.embed_tokens.weight")
    out["norm_f.weight"] = take(hf, "model.norm.weight") + 1
    for i in range(cfg.n_layer):
        k, h = f"blocks.{i}.", f"model.layers.{i}."
        for kiln_name, hf_name in _GEMMA_NORMS:
            out[k + f"{kiln_name}.weight"] = take(hf, h + f"{hf_name}.weight") + 1
        qkv = [take(hf, f"{h}self_attn.{p}_proj.weight") for p in "qkv"]
        out[k + "attn.qkv.weight"] = torch.cat(qkv)
        out[k + "attn.proj.weight"] = take(hf, h + "self_attn.o_proj.weight")
        gate_up = [take(hf, f"{h}mlp.{p}_proj.weight") for p in ("gate", "up")]
        out[k + "mlp.fc.weight"] = torch.cat(gate_up)
        out[k + "mlp.proj.weight"] = take(hf, h + "mlp.down_proj.weight")
    return out
