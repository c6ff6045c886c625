"""The depth-derived preset family: one knob (`depth-N`) sets depth, width and heads.

nanochat's idea: instead of editing n_layer, n_embd, n_head (and the learning rates) together,
derive them from the depth at a fixed aspect ratio. `depth-N-mup` adds µP relative to depth 4,
so learning rates tuned there carry to any depth-N (kiln/train/mup.py derives each group's).
"""

from __future__ import annotations

from typing import Any

from kiln.model.config import _LLAMA, _require

DEPTH_ASPECT = 64  # n_embd per layer in the depth family (nanochat's aspect ratio)
DEPTH_HEAD_DIM = 64
DEPTH_MUP_BASE = 4  # depth-N-mup: µP relative to depth 4's width (256)


def depth_preset(name: str) -> dict[str, Any]:
    """The config fields of `depth-N` (or `depth-N-mup`): N layers, width 64·N, heads of 64."""
    body = name.removeprefix("depth-").removesuffix("-mup")
    _require(
        body.isdigit() and int(body) >= 1,
        f"depth preset must be depth-N or depth-N-mup with N >= 1, got {name!r}",
    )
    depth = int(body)
    width = DEPTH_ASPECT * depth
    out = {**_LLAMA, "n_layer": depth, "n_embd": width, "n_head": width // DEPTH_HEAD_DIM}
    if name.endswith("-mup"):
        out["mup_base_width"] = DEPTH_ASPECT * DEPTH_MUP_BASE
    return out
