"""Hugging Face interop: GPT2LMHeadModel and LlamaForCausalLM to and from kiln's Transformer
(and Mixtral, Qwen3-MoE and DeepSeek-V3, whose extra fields and tensors are in hf_families.py).

Directories are read and written without `transformers` (config.json + safetensors), so a kiln
install can load HF checkpoints; `from_hf` / `to_hf` convert live `transformers` objects. kiln
fuses Q, K, V (and SwiGLU's gate and up) into one matrix, so conversion concatenates or splits
them; HF GPT-2 stores its linear weights transposed (Conv1D). Both use the same split-half RoPE
layout, so no permutation is needed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.model.config import ModelConfig, RopeScaling
from kiln.model.hf_families import (
    FAMILIES,
    family_config_to_hf,
    family_fields_from_hf,
    family_of,
    layer_from_hf,
    layer_to_hf,
)
from kiln.model.hf_neox_gemma import (
    SWITCH_FAMILIES,
    switch_config_from_hf,
    switch_config_to_hf,
    switch_family_of,
    switch_state_from_hf,
    switch_state_to_hf,
)
from kiln.model.transformer import Transformer

# kiln fields with no HF counterpart. The whole kiln config is kept in config.json under "kiln"
# so a round trip is exact; when the HF fields were edited since, only these are taken from it.
_KILN_ONLY = ("vocab_multiple", "z_loss", "attention_backend", "dropout", "init_std")


def from_hf(hf_model: Any) -> Transformer:
    """A kiln Transformer with the weights of a `transformers` causal LM of a supported family."""
    hf_cfg = hf_model.config.to_dict()
    return _build(config_from_hf(hf_cfg), dict(hf_model.state_dict()), "cpu", _interleaved(hf_cfg))


def to_hf(model: Transformer) -> Any:
    """The equivalent `transformers` model (GPT2LMHeadModel or LlamaForCausalLM), same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = config_to_hf(model.cfg)
    model_type = hf_cfg.pop("model_type")
    hf_cfg.pop("architectures")
    hf_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **hf_cfg))
    state = state_dict_to_hf(model)
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not model.cfg.tie_embeddings]
    if missing or unexpected:
        raise KilnError(f"HF model did not take the weights: missing {missing}, extra {unexpected}")
    return hf_model.to(next(model.parameters()).dtype).eval()


def load_hf_dir(path: str | Path, device: torch.device | str = "cpu") -> Transformer:
    """Load an HF model directory (config.json + model.safetensors, sharded or not)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise KilnError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KilnError(f"{config_file}: not a JSON model config ({exc})") from None
    if not isinstance(hf_config, dict):
        raise KilnError(f"{config_file}: expected a JSON object, got {type(hf_config).__name__}")
    return _build(config_from_hf(hf_config), _read_weights(path), device, _interleaved(hf_config))


def save_hf_dir(model: Transformer, path: str | Path, eos_token_id: int | None = None) -> None:
    """Write config.json + model.safetensors that `AutoModelForCausalLM.from_pretrained` loads."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_cfg = config_to_hf(model.cfg)
    hf_cfg.update(bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    hf_cfg["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    state = {k: v.detach().contiguous().cpu() for k, v in state_dict_to_hf(model).items()}
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")


# ---- configs ---------------------------------------------------------------------------------


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The kiln config of an HF config dict (model_type "gpt2" or "llama")."""
    model_type = hf.get("model_type")
    if model_type == "gpt2":
        cfg = _gpt2_config(hf)
    elif model_type == "llama":
        cfg = _llama_config(hf)
    elif model_type in FAMILIES:  # Llama plus experts / latent attention (hf_families.py)
        cfg = _llama_config(hf)
        if cfg.bias:
            raise KilnError(f"HF {model_type} with attention_bias is not supported")
        cfg = dataclasses.replace(cfg, **family_fields_from_hf(hf, model_type))
    elif model_type in SWITCH_FAMILIES:  # GPT-NeoX, Gemma 2 (hf_neox_gemma.py)
        cfg = switch_config_from_hf(hf, model_type)
    else:
        raise KilnError(
            f"unsupported HF model_type {model_type!r}; kiln reads 'gpt2', 'llama', "
            f"{', '.join(repr(f) for f in FAMILIES + SWITCH_FAMILIES)}"
        )
    saved = hf.get("kiln") or {}
    try:
        kiln_cfg = ModelConfig.from_dict(saved) if saved else None
    except KilnError:
        kiln_cfg = None
    if kiln_cfg is not None and _hf_fields(kiln_cfg) == _hf_fields(cfg):
        return kiln_cfg  # describes the very same model, and keeps kiln's own settings
    extras = {k: v for k, v in saved.items() if k in _KILN_ONLY}
    return ModelConfig.from_dict({**cfg.to_dict(), **extras})


def _hf_fields(cfg: ModelConfig) -> dict[str, Any] | None:
    """The HF representation of a config without kiln's extras (None if it has none)."""
    try:
        fields = config_to_hf(cfg)
    except KilnError:
        return None
    fields.pop("kiln")
    return fields


def _gpt2_config(hf: dict[str, Any]) -> ModelConfig:
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


def _llama_config(hf: dict[str, Any]) -> ModelConfig:
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
    scaling, block_size = _rope_scaling_from_hf(rope, hf["max_position_embeddings"])
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


def _rope_scaling_from_hf(
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


def _rope_to_hf(cfg: ModelConfig) -> tuple[dict[str, Any], int]:
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


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """An HF config dict for the family the config belongs to; a clear error if it fits neither."""
    if (switch_family := switch_family_of(cfg)) is not None:  # GPT-NeoX, Gemma 2
        return {**switch_config_to_hf(cfg, switch_family), "kiln": cfg.to_dict()}
    unsupported = [
        name
        for name, on in (
            ("qk_norm", cfg.qk_norm and family_of(cfg) != "qwen3_moe"),
            ("attn_sinks", cfg.attn_sinks),
            ("logit_softcap", cfg.logit_softcap is not None),
            ("sliding_window", cfg.sliding_window is not None),
            ("norm_placement", cfg.norm_placement != "pre"),  # issue #21's switches
            ("parallel_block", cfg.parallel_block),
            ("rotary_fraction", cfg.rotary_fraction != 1.0),
            ("norm_scale=false", not cfg.norm_scale),
            ("embed_scale", cfg.embed_scale),
            ("attn_scale", cfg.attn_scale is not None),
            ("attn_softcap", cfg.attn_softcap is not None),
            ("mup_base_width", cfg.mup_base_width is not None),
        )
        if on
    ]
    if unsupported:
        raise KilnError(f"no HF GPT-2/Llama equivalent for {', '.join(unsupported)}")
    kiln_only = cfg.to_dict()
    gpt2_like = (cfg.pos_emb, cfg.norm, cfg.mlp, cfg.bias) == ("learned", "layernorm", "gelu", True)
    llama_like = (cfg.pos_emb, cfg.norm, cfg.mlp) == ("rope", "rmsnorm", "swiglu")
    if (
        gpt2_like
        and cfg.kv_heads == cfg.n_head
        and cfg.head_dim in (None, cfg.n_embd // cfg.n_head)
    ):
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
            "kiln": kiln_only,
        }
    if llama_like:
        rope, max_positions = _rope_to_hf(cfg)
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
            "kiln": kiln_only,
        }
        family = family_of(cfg)
        if family is not None:  # Mixtral / Qwen3-MoE / DeepSeek-V3: Llama's fields and these
            arch = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}
            out.update(model_type=family, architectures=[f"{arch[family]}ForCausalLM"])
            out.update(family_config_to_hf(cfg, family))
        return out
    raise KilnError(
        "config matches neither HF GPT-2 (learned positions, LayerNorm with bias, GELU, "
        "multi-head) nor Llama (RoPE, RMSNorm, SwiGLU)"
    )


# ---- weights ---------------------------------------------------------------------------------


def state_dict_to_hf(model: Transformer) -> dict[str, Tensor]:
    """kiln weights under HF names (fused matrices split, GPT-2's transposed, padding removed)."""
    cfg, sd = model.cfg, model.state_dict()
    if (switch_family := switch_family_of(cfg)) is not None:  # GPT-NeoX, Gemma 2
        return {k: v.contiguous() for k, v in switch_state_to_hf(cfg, sd, switch_family).items()}
    V, q_out, kv_out = cfg.vocab_size, cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
    out: dict[str, Tensor] = {}
    if cfg.pos_emb == "learned":  # GPT-2
        out["transformer.wte.weight"] = sd["wte.weight"][:V]
        out["transformer.wpe.weight"] = sd["wpe.weight"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = (
            sd["norm_f.weight"],
            sd["norm_f.bias"],
        )
        for i in range(cfg.n_layer):
            k, h = f"blocks.{i}.", f"transformer.h.{i}."
            for kiln_name, hf_name in _GPT2_LAYER:
                tensor = sd[k + kiln_name]
                out[h + hf_name] = (
                    tensor.T if hf_name.endswith("weight") and tensor.dim() == 2 else tensor
                )
    else:  # Llama
        out["model.embed_tokens.weight"] = sd["wte.weight"][:V]
        out["model.norm.weight"] = sd["norm_f.weight"]
        for i in range(cfg.n_layer):
            k, h = f"blocks.{i}.", f"model.layers.{i}."
            out[h + "input_layernorm.weight"] = sd[k + "norm1.weight"]
            out[h + "post_attention_layernorm.weight"] = sd[k + "norm2.weight"]
            out.update(layer_to_hf(cfg, sd, i))  # MLA, experts, q/k norms (hf_families.py)
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
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"][:V]
    return {k: v.contiguous() for k, v in out.items()}


_GPT2_LAYER = (
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
)


def state_dict_from_hf(
    cfg: ModelConfig, hf: dict[str, Tensor], rope_interleave: bool = False
) -> dict[str, Tensor]:
    """HF weights under kiln names (fused, GPT-2's transposed back, vocab padded with zeros).

    rope_interleave: DeepSeek's interleaved RoPE rows, permuted to kiln's split halves.
    """
    hf = {k.removeprefix("module."): v for k, v in hf.items()}
    out: dict[str, Tensor] = {}
    if (switch_family := switch_family_of(cfg)) is not None:  # GPT-NeoX, Gemma 2
        out = switch_state_from_hf(cfg, hf, switch_family, _take)
    elif cfg.pos_emb == "learned":
        out["wte.weight"] = _take(hf, "transformer.wte.weight")
        out["wpe.weight"] = _take(hf, "transformer.wpe.weight")
        out["norm_f.weight"] = _take(hf, "transformer.ln_f.weight")
        out["norm_f.bias"] = _take(hf, "transformer.ln_f.bias")
        for i in range(cfg.n_layer):
            for kiln_name, hf_name in _GPT2_LAYER:
                tensor = _take(hf, f"transformer.h.{i}.{hf_name}")
                out[f"blocks.{i}.{kiln_name}"] = tensor.T if tensor.dim() == 2 else tensor
    else:
        out["wte.weight"] = _take(hf, "model.embed_tokens.weight")
        out["norm_f.weight"] = _take(hf, "model.norm.weight")
        for i in range(cfg.n_layer):
            k, h = f"blocks.{i}.", f"model.layers.{i}."
            out[k + "norm1.weight"] = _take(hf, h + "input_layernorm.weight")
            out[k + "norm2.weight"] = _take(hf, h + "post_attention_layernorm.weight")
            out.update(layer_from_hf(cfg, hf, i, rope_interleave))  # MLA, experts, q/k norms
            for kind in ("weight", "bias") if cfg.bias else ("weight",):
                if cfg.mla is None:
                    qkv = [_take(hf, f"{h}self_attn.{p}_proj.{kind}") for p in "qkv"]
                    out[f"{k}attn.qkv.{kind}"] = torch.cat(qkv)
                    out[f"{k}attn.proj.{kind}"] = _take(hf, f"{h}self_attn.o_proj.{kind}")
                if not cfg.is_moe_layer(i):
                    gate_up = [_take(hf, f"{h}mlp.{p}_proj.{kind}") for p in ("gate", "up")]
                    out[f"{k}mlp.fc.{kind}"] = torch.cat(gate_up)
                    out[f"{k}mlp.proj.{kind}"] = _take(hf, f"{h}mlp.down_proj.{kind}")
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["wte.weight"]
    else:
        out["lm_head.weight"] = _take(hf, "lm_head.weight")
    pad = cfg.padded_vocab_size - cfg.vocab_size
    for name in ("wte.weight", "lm_head.weight"):
        out[name] = torch.nn.functional.pad(out[name], (0, 0, 0, pad))
    return out


def _take(hf: dict[str, Tensor], name: str) -> Tensor:
    """One tensor of an HF state dict, or an error naming the missing key."""
    if name not in hf:
        raise KilnError(f"HF checkpoint has no tensor {name!r}")
    return hf[name]


def _interleaved(hf: dict[str, Any]) -> bool:
    """Whether an HF config lays RoPE out in interleaved pairs (DeepSeek's default)."""
    return hf.get("model_type") == "deepseek_v3" and bool(hf.get("rope_interleave", True))


def _build(
    cfg: ModelConfig,
    hf_state: dict[str, Tensor],
    device: torch.device | str = "cpu",
    rope_interleave: bool = False,
) -> Transformer:
    """A Transformer holding the converted weights, without spending time on random init."""
    state = state_dict_from_hf(cfg, hf_state, rope_interleave)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.load_state_dict(state)
    model.init_rope()
    dtype = state["wte.weight"].dtype
    return model.to(dtype) if dtype.is_floating_point else model


def _read_weights(path: Path) -> dict[str, Tensor]:
    """All tensors of an HF directory: model.safetensors, its sharded index, or pytorch_model.bin."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file as load_safetensors

    def load_file(file: Path) -> dict[str, Tensor]:
        try:
            return load_safetensors(file)
        except (SafetensorError, OSError) as exc:
            raise KilnError(f"{file}: not a readable safetensors file ({exc})") from None

    if (path / "model.safetensors").is_file():
        return load_file(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(path / shard).items()}
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise KilnError(
        f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )
