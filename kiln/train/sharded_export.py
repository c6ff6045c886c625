"""A sharded (DCP) checkpoint as HF `config.json` + `model.safetensors`, one tensor at a time.

The safetensors header is written first, from the shapes in DCP's metadata (each HF tensor's
shape worked out on the meta device); then each HF tensor is read from the shards (only the
kiln tensors it is made of: one, or GPT-2's q, k, v for its fused c_attn), converted, written
and freed. So no process ever holds more than about one tensor of the model, whatever its size.
The names are those of `kiln.model.hf.state_dict_to_hf`; the test checks both exports agree.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.model.config import ModelConfig

Convert = Callable[[list[Tensor]], Tensor]
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_GPT2_LAYER = {  # kiln name -> HF name (2-D weights transposed: GPT-2's Conv1D layout)
    "norm1": "ln_1", "attn.proj": "attn.c_proj", "norm2": "ln_2", "mlp.fc": "mlp.c_fc",
    "mlp.proj": "mlp.c_proj",
}  # fmt: skip
_LLAMA_LAYER = {
    "norm1": "input_layernorm", "norm2": "post_attention_layernorm",
    "attn.qkv.q": "self_attn.q_proj", "attn.qkv.k": "self_attn.k_proj",
    "attn.qkv.v": "self_attn.v_proj", "attn.proj": "self_attn.o_proj",
    "mlp.fc.gate": "mlp.gate_proj", "mlp.fc.up": "mlp.up_proj", "mlp.proj": "mlp.down_proj",
}  # fmt: skip


def hf_plan(cfg: ModelConfig, names: set[str]) -> list[tuple[str, list[str], Convert]]:
    """(HF name, the kiln tensors it is made of, how) for every HF tensor, in a fixed order.

    `names` are the tensor names in the checkpoint (a bias or a norm bias may be absent).
    """
    V = cfg.vocab_size
    rows: Convert = lambda ts: ts[0][:V]  # noqa: E731  vocabulary padding removed
    same: Convert = lambda ts: ts[0]  # noqa: E731
    plan: list[tuple[str, list[str], Convert]] = []
    gpt2 = cfg.pos_emb == "learned"
    if gpt2:
        plan += [("transformer.wte.weight", ["wte.weight"], rows),
                 ("transformer.wpe.weight", ["wpe.weight"], same)]  # fmt: skip
    else:
        plan.append(("model.embed_tokens.weight", ["wte.weight"], rows))
    for i in range(cfg.n_layer):
        k = f"blocks.{i}."
        h = f"transformer.h.{i}." if gpt2 else f"model.layers.{i}."
        for kind in ("weight", "bias"):
            if gpt2:
                qkv = [f"{k}attn.qkv.{p}.{kind}" for p in ("q", "k", "v")]
                if all(n in names for n in qkv):
                    plan.append((f"{h}attn.c_attn.{kind}", qkv, _gpt2_fused))
                for kiln_name, hf_name in _GPT2_LAYER.items():
                    if f"{k}{kiln_name}.{kind}" in names:
                        plan.append(
                            (f"{h}{hf_name}.{kind}", [f"{k}{kiln_name}.{kind}"], _gpt2_conv1d)
                        )
            else:
                for kiln_name, hf_name in _LLAMA_LAYER.items():
                    if f"{k}{kiln_name}.{kind}" in names:
                        plan.append((f"{h}{hf_name}.{kind}", [f"{k}{kiln_name}.{kind}"], same))
    final = "transformer.ln_f" if gpt2 else "model.norm"
    plan += [(f"{final}.{kind}", [f"norm_f.{kind}"], same) for kind in ("weight", "bias")
             if f"norm_f.{kind}" in names]  # fmt: skip
    if not cfg.tie_embeddings:
        plan.append(("lm_head.weight", ["lm_head.weight"], rows))
    return plan


def _gpt2_fused(ts: list[Tensor]) -> Tensor:
    """q, k, v (out, in) -> GPT-2's c_attn (in, 3·out); a bias is concatenated."""
    fused = torch.cat(ts)
    return fused.T if fused.dim() == 2 else fused


def _gpt2_conv1d(ts: list[Tensor]) -> Tensor:
    return ts[0].T if ts[0].dim() == 2 else ts[0]


def save_sharded_hf_dir(
    cfg: ModelConfig, dcp_dir: Path, out: Path, hf_config: dict[str, Any]
) -> None:
    """Write config.json + model.safetensors of the DCP checkpoint in `dcp_dir` into `out`."""
    from torch.distributed.checkpoint import FileSystemReader

    from kiln.model.hf.moe_mla import family_of
    from kiln.model.hf.neox_gemma import switch_family_of

    family = family_of(cfg) or switch_family_of(cfg)
    if family is not None:  # the streaming plan knows GPT-2's and Llama's tensor names only
        raise KilnError(
            f"{dcp_dir}: exporting a sharded {family} checkpoint is not supported yet; resume it "
            "in one process (a resume reshards onto any mesh), save, and export that checkpoint"
        )

    meta = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    shapes = {k.removeprefix("model."): v for k, v in meta.items() if k.startswith("model.")}
    names = set(shapes)
    plan = hf_plan(cfg, names)
    missing = sorted({n for _, sources, _ in plan for n in sources} - names)
    if missing:
        raise KilnError(f"{dcp_dir}: not a kiln model checkpoint (missing {missing[:3]})")
    dtype = shapes["wte.weight"].properties.dtype
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for hf_name, sources, convert in plan:
        like = [torch.empty(tuple(shapes[n].size), dtype=dtype, device="meta") for n in sources]
        shaped = convert(like)
        size = shaped.numel() * shaped.element_size()
        header[hf_name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shaped.shape),
            "data_offsets": [offset, offset + size],
        }  # fmt: skip
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "model.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(text)))
        handle.write(text)
        for _, sources, convert in plan:
            tensors = [_read_one(dcp_dir, n, tuple(shapes[n].size), dtype) for n in sources]
            tensor = convert(tensors).contiguous()
            handle.write(tensor.view(torch.uint8).reshape(-1).numpy().tobytes())
            del tensors, tensor
    hf_config = {**hf_config, "dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


def _read_one(dcp_dir: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """One tensor of a DCP checkpoint, assembled from every rank's pieces, in this process."""
    import torch.distributed.checkpoint as dcp

    tensor = torch.empty(shape, dtype=dtype)
    dcp.load({"model": {name: tensor}}, checkpoint_id=str(dcp_dir), no_dist=True)
    return tensor
