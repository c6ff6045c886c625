"""Hugging Face interop, one module per family: gpt2, llama, moe_mla (Mixtral, Qwen3-MoE,
DeepSeek-V3), neox_gemma (GPT-NeoX, Gemma 2); convert.py dispatches to them and reads and
writes HF directories; tensors.py looks tensors up by name and reads weight files."""

from kiln.model.hf.convert import (
    config_from_hf,
    config_to_hf,
    from_hf,
    load_hf_dir,
    save_hf_dir,
    state_dict_from_hf,
    state_dict_to_hf,
    to_hf,
)

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "from_hf",
    "load_hf_dir",
    "save_hf_dir",
    "state_dict_from_hf",
    "state_dict_to_hf",
    "to_hf",
]
