"""Which GGML type each tensor of a `--quant q4_k_m` GGUF file gets: llama.cpp's Q4_K_M mixture.

The rule, as llama.cpp's `llama-quantize` applies it to Llama and GPT-2 files (src/llama-quant.cpp):

- 1-D tensors (norms, biases) stay F32; GPT-2's position embedding is not quantized (F16).
- The output head is Q6_K, and so is the token embedding when it is also the head (tied, no
  `output.weight`); an untied token embedding is Q4_K.
- attn_v (GPT-2: the fused attn_qkv, which llama.cpp counts as attn_v) and ffn_down are Q6_K in
  the layers `more_bits` picks (the first and last eighth of the layers and every third one
  between), Q4_K in the others.
- Everything else (attn_q, attn_k, attn_output, ffn_gate, ffn_up) is Q4_K.

K-quant blocks cover 256 weights of a row. A tensor whose rows are not a multiple of 256 falls
back as llama.cpp does: Q4_K to Q5_0, Q6_K to Q8_0 (32-weight blocks, written by the gguf
package), and to F16 when the row is not a multiple of 32 either; each fallback is reported.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.quant.kquants import QK_K, quantize_q4_k, quantize_q6_k

FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class Fallback:
    """A tensor written in another type than the mixture's, because of its row length."""

    name: str
    cols: int
    wanted: str
    written: str


def more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers whose attn_v / ffn_down get Q6_K in Q4_K_M."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def q4_k_m_type(name: str, shape: tuple[int, ...], n_layer: int, tied: bool) -> str:
    """The mixture's GGML type name for one tensor, before any fallback."""
    if len(shape) < 2:
        return "F32"
    if name == "position_embd.weight":
        return "F16"
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    layer = _LAYER.match(name)
    if layer and re.search(r"\.(attn_v|attn_qkv|ffn_down)\.weight$", name):
        return "Q6_K" if more_bits(int(layer.group(1)), n_layer) else "Q4_K"
    return "Q4_K"


def fitted_type(wanted: str, cols: int) -> str:
    """`wanted`, or the type llama.cpp falls back to for rows of `cols` weights."""
    if wanted not in FALLBACK or cols % QK_K == 0:
        return wanted
    return FALLBACK[wanted] if cols % 32 == 0 else "F16"


def q4_k_m_plan(
    shapes: dict[str, tuple[int, ...]], n_layer: int
) -> tuple[dict[str, str], list[Fallback]]:
    """Each tensor's written type (PyTorch shapes: the row length is the last dimension)."""
    tied = "output.weight" not in shapes
    types, fallbacks = {}, []
    for name, shape in shapes.items():
        wanted = q4_k_m_type(name, shape, n_layer, tied)
        types[name] = fitted_type(wanted, shape[-1])
        if types[name] != wanted:
            fallbacks.append(Fallback(name, shape[-1], wanted, types[name]))
    return types, fallbacks


def encode(gguf: Any, array: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    """The array in GGML type `type_name`, as the bytes (or floats) GGUFWriter.add_tensor takes."""
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    x = array.astype(np.float32)
    if type_name == "F32":
        return x, qtype
    if type_name == "F16":
        return x.astype(np.float16), qtype
    if type_name == "Q4_K":
        return quantize_q4_k(x), qtype
    if type_name == "Q6_K":
        return quantize_q6_k(x), qtype
    return gguf.quants.quantize(x, qtype), qtype  # Q5_0, Q8_0: the gguf package's own


def describe_plan(types: dict[str, str], fallbacks: list[Fallback]) -> str:
    """One line: how many tensors of each type, and which fell back (layers folded together)."""
    counts = ", ".join(f"{n} {t}" for t, n in sorted(Counter(types.values()).items()))
    if not fallbacks:
        return f"q4_k_m: {counts}"
    folded = Counter((_LAYER.sub("blk.*.", f.name), f.cols, f.wanted, f.written) for f in fallbacks)
    parts = [
        f"{name} ({cols} columns) {wanted}->{written}" + (f" x{n}" if n > 1 else "")
        for (name, cols, wanted, written), n in folded.items()
    ]
    return f"q4_k_m: {counts}; rows not a multiple of {QK_K} fell back: {'; '.join(parts)}"
