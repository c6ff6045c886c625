"""Hugging Face interop: kiln's Transformer to and from HF directories and `transformers` models.

Directories are read and written without `transformers` (config.json + safetensors), so a kiln
install can load HF checkpoints; `from_hf` / `to_hf` convert live `transformers` objects. The
config and the weights go to the module of their family: gpt2.py, llama.py (and moe_mla.py for
Mixtral, Qwen3-MoE and DeepSeek-V3), neox_gemma.py (GPT-NeoX, Gemma 2), mamba2.py (Mamba-2).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.model.config import ModelConfig
from kiln.model.hf.gpt2 import (
    gpt2_config_from_hf,
    gpt2_config_to_hf,
    gpt2_state_from_hf,
    gpt2_state_to_hf,
    is_gpt2,
)
from kiln.model.hf.llama import (
    is_llama,
    llama_config_from_hf,
    llama_config_to_hf,
    llama_state_from_hf,
    llama_state_to_hf,
)
from kiln.model.hf.mamba2 import (
    is_mamba2,
    mamba2_config_from_hf,
    mamba2_config_to_hf,
    mamba2_state_from_hf,
    mamba2_state_to_hf,
)
from kiln.model.hf.moe_mla import FAMILIES, family_fields_from_hf, family_of
from kiln.model.hf.neox_gemma import (
    SWITCH_FAMILIES,
    switch_config_from_hf,
    switch_config_to_hf,
    switch_family_of,
    switch_state_from_hf,
    switch_state_to_hf,
)
from kiln.model.hf.tensors import read_weights, take
from kiln.model.transformer import Transformer

# kiln fields with no HF counterpart. The whole kiln config is kept in config.json under "kiln"
# so a round trip is exact; when the HF fields were edited since, only these are taken from it.
_KILN_ONLY = ("vocab_multiple", "z_loss", "attention_backend", "dropout", "init_std")


def from_hf(hf_model: Any) -> Transformer:
    """A kiln Transformer with the weights of a `transformers` causal LM of a supported family."""
    hf_cfg = hf_model.config.to_dict()
    return _build(config_from_hf(hf_cfg), dict(hf_model.state_dict()), "cpu", _interleaved(hf_cfg))


def to_hf(model: Transformer) -> Any:
    """The equivalent `transformers` model (GPT2LMHeadModel, LlamaForCausalLM, ...), same weights."""
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
    return _build(config_from_hf(hf_config), read_weights(path), device, _interleaved(hf_config))


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
    """The kiln config of an HF config dict of a supported model_type."""
    model_type = hf.get("model_type")
    if model_type == "gpt2":
        cfg = gpt2_config_from_hf(hf)
    elif model_type == "llama":
        cfg = llama_config_from_hf(hf)
    elif model_type in FAMILIES:  # Llama plus experts / latent attention (moe_mla.py)
        cfg = llama_config_from_hf(hf)
        if cfg.bias:
            raise KilnError(f"HF {model_type} with attention_bias is not supported")
        cfg = dataclasses.replace(cfg, **family_fields_from_hf(hf, model_type))
    elif model_type in SWITCH_FAMILIES:  # GPT-NeoX, Gemma 2 (neox_gemma.py)
        cfg = switch_config_from_hf(hf, model_type)
    elif model_type == "mamba2":
        cfg = mamba2_config_from_hf(hf)
    else:
        raise KilnError(
            f"unsupported HF model_type {model_type!r}; kiln reads 'gpt2', 'llama', "
            f"{', '.join(repr(f) for f in FAMILIES + SWITCH_FAMILIES)}, 'mamba2'"
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


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """An HF config dict for the family the config belongs to; a clear error if it fits none."""
    if (switch_family := switch_family_of(cfg)) is not None:  # GPT-NeoX, Gemma 2
        return {**switch_config_to_hf(cfg, switch_family), "kiln": cfg.to_dict()}
    if is_mamba2(cfg):
        return {**mamba2_config_to_hf(cfg), "kiln": cfg.to_dict()}
    if cfg.has_recurrent_layers or not cfg.has_mlp:
        raise KilnError(
            f"no HF equivalent for layer_pattern {cfg.layer_pattern!r} with mlp {cfg.mlp!r}: kiln "
            "exports recurrent layers only as Mamba-2 (every layer 'M', mlp 'none', RMSNorm, "
            "pos_emb 'none')"
        )
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
    if is_gpt2(cfg):
        return {**gpt2_config_to_hf(cfg), "kiln": cfg.to_dict()}
    if is_llama(cfg):
        return {**llama_config_to_hf(cfg), "kiln": cfg.to_dict()}
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
    if is_mamba2(cfg):
        out = mamba2_state_to_hf(cfg, sd)
    elif cfg.pos_emb == "learned":
        out = gpt2_state_to_hf(cfg, sd)
    else:
        out = llama_state_to_hf(cfg, sd)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"][: cfg.vocab_size]
    return {k: v.contiguous() for k, v in out.items()}


def state_dict_from_hf(
    cfg: ModelConfig, hf: dict[str, Tensor], rope_interleave: bool = False
) -> dict[str, Tensor]:
    """HF weights under kiln names (fused, GPT-2's transposed back, vocab padded with zeros).

    rope_interleave: DeepSeek's interleaved RoPE rows, permuted to kiln's split halves.
    """
    hf = {k.removeprefix("module."): v for k, v in hf.items()}
    if (switch_family := switch_family_of(cfg)) is not None:  # GPT-NeoX, Gemma 2
        out = switch_state_from_hf(cfg, hf, switch_family)
    elif is_mamba2(cfg):
        out = mamba2_state_from_hf(cfg, hf)
    elif cfg.pos_emb == "learned":
        out = gpt2_state_from_hf(cfg, hf)
    else:
        out = llama_state_from_hf(cfg, hf, rope_interleave)
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["wte.weight"]
    else:
        out["lm_head.weight"] = take(hf, "lm_head.weight")
    pad = cfg.padded_vocab_size - cfg.vocab_size
    for name in ("wte.weight", "lm_head.weight"):
        out[name] = torch.nn.functional.pad(out[name], (0, 0, 0, pad))
    return out


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
