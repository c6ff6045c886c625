"""LoRA: low-rank adapters on chosen linear layers, saved in PEFT's format, merged for use.

`add_lora(model, cfg)` replaces each target `nn.Linear` (kiln names: attn.qkv, attn.proj, mlp.fc,
mlp.proj) by a `LoRALinear` that computes W·x + b + (alpha / rank)·B·A·dropout(x), with A
(rank, in) initialised as PEFT does (Kaiming-uniform) and B (out, rank) at zero, so training
starts from the base model exactly. Every base parameter is frozen (requires_grad False), so the
optimizer, which takes only trainable parameters, holds no state for them. The module keeps the
base's parameter names (`weight`, `bias`) beside `lora_A.weight` and `lora_B.weight`, so a
checkpoint's state dict is the base's plus the adapters; `kiln.loading` merges such a checkpoint
when it loads it (for eval, export, serving and chat).

`save_adapter` writes `adapter_config.json` + `adapter_model.safetensors` under the module names
of kiln's HF export (kiln/model/hf/), so `peft.PeftModel.from_pretrained(export, adapter)`
computes what the kiln model computes. kiln fuses Q, K, V (and SwiGLU's gate and up) into one
matrix; LoRA on the fused matrix, ΔW = B·A, splits exactly into one adapter per HF projection:
each keeps the whole A and takes its rows of B. GPT-2's HF layers are Conv1D (fan_in_fan_out).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.config import require
from kiln.errors import KilnError
from kiln.loading import LORA_A, LORA_B
from kiln.model.config import ModelConfig
from kiln.model.transformer import Transformer

TARGETS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAConfig:
    """The `[lora]` section: rank 0 is full fine-tuning; rank >= 1 trains adapters only."""

    rank: int = 0
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input only
    targets: list[str] = field(default_factory=lambda: ["attn.qkv", "attn.proj"])

    def __post_init__(self) -> None:
        require(self.rank >= 0, f"lora.rank must be >= 0 (0: full fine-tuning), got {self.rank}")
        require(self.alpha > 0, f"lora.alpha must be > 0, got {self.alpha}")
        require(0 <= self.dropout < 1, f"lora.dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in TARGETS]
        require(
            not unknown and bool(self.targets),
            f"lora.targets: {unknown or 'none given'}; choose from {', '.join(TARGETS)}",
        )

    @property
    def enabled(self) -> bool:
        """Whether this is a LoRA run (else full fine-tuning)."""
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor on B·A."""
        return self.alpha / self.rank


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (see the module doc)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the base's own Parameters: names and storage unchanged
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        """W·x + b + scaling·B·A·dropout(x)."""
        base = F.linear(x, self.weight, self.bias)
        return base + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    def merged(self) -> nn.Linear:
        """A plain nn.Linear holding W + scaling·B·A (and the bias)."""
        linear = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None,
            device=self.weight.device, dtype=self.weight.dtype,
        )  # fmt: skip
        with torch.no_grad():
            delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
            linear.weight.copy_((self.weight.float() + self.scaling * delta).to(self.weight.dtype))
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear


def target_layers(model: Transformer, targets: list[str]) -> list[tuple[str, nn.Module, str]]:
    """(kiln name, parent module, attribute) of every target linear layer, block by block."""
    found = []
    for i, block in enumerate(model.blocks):
        for target in targets:
            owner, attr = target.split(".")
            parent = getattr(block, owner)
            found.append((f"blocks.{i}.{target}", parent, attr))
    return found


def add_lora(model: Transformer, cfg: LoRAConfig) -> list[str]:
    """Freeze `model` and put adapters on `cfg.targets` in place; the adapted layers' names."""
    if not cfg.enabled:
        raise KilnError("lora.rank is 0: nothing to add (full fine-tuning)")
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for name, parent, attr in target_layers(model, cfg.targets):
        layer = getattr(parent, attr)
        if not isinstance(layer, nn.Linear):
            raise KilnError(f"{name}: a {type(layer).__name__}, not a linear layer to adapt")
        setattr(parent, attr, LoRALinear(layer, cfg.rank, cfg.alpha, cfg.dropout))
        names.append(name)
    return names


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear by its merged nn.Linear, in place; the same model returned."""
    for module in list(model.modules()):
        for attr, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, attr, child.merged())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def adapter_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The adapters alone, under kiln names ("blocks.0.attn.qkv.lora_A.weight", ...)."""
    return {k: v for k, v in model.state_dict().items() if k.endswith((LORA_A, LORA_B))}


def trainable_parameters(model: nn.Module) -> int:
    """Parameters that require grad (a tied head counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of tensors held in an optimizer's state (AdamW: two moments per trainable value)."""
    optimizers = getattr(optimizer, "optimizers", [optimizer])
    return sum(
        t.numel() * t.element_size()
        for o in optimizers
        for state in o.state.values()
        for t in state.values()
        if isinstance(t, Tensor)
    )


# ---- PEFT's format ----------------------------------------------------------------------------


def _hf_modules(cfg: ModelConfig, target: str, layer: int) -> list[tuple[str, int, int]]:
    """(HF module name, first row, rows) of each HF projection a kiln target feeds."""
    if cfg.pos_emb == "learned":  # GPT-2: one Conv1D per kiln layer
        name = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc",
                "mlp.proj": "mlp.c_proj"}[target]  # fmt: skip
        return [(f"transformer.h.{layer}.{name}", 0, -1)]
    h = f"model.layers.{layer}."
    q, kv, ff = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size, cfg.ff_size
    return {
        "attn.qkv": [(h + "self_attn.q_proj", 0, q), (h + "self_attn.k_proj", q, kv),
                     (h + "self_attn.v_proj", q + kv, kv)],
        "attn.proj": [(h + "self_attn.o_proj", 0, -1)],
        "mlp.fc": [(h + "mlp.gate_proj", 0, ff), (h + "mlp.up_proj", ff, ff)],
        "mlp.proj": [(h + "mlp.down_proj", 0, -1)],
    }[target]  # fmt: skip


def peft_tensors(model: Transformer, cfg: LoRAConfig) -> dict[str, Tensor]:
    """The adapters under PEFT's key names for kiln's HF export of the model."""
    from kiln.model.hf import config_to_hf

    config_to_hf(model.cfg)  # a model with no HF export is refused here, in one line
    sd = adapter_tensors(model)
    out: dict[str, Tensor] = {}
    for i in range(model.cfg.n_layer):
        for target in cfg.targets:
            a, b = sd[f"blocks.{i}.{target}{LORA_A}"], sd[f"blocks.{i}.{target}{LORA_B}"]
            for name, start, rows in _hf_modules(model.cfg, target, i):
                part = b if rows < 0 else b[start : start + rows]
                out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().clone().contiguous()
                out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = part.detach().clone().contiguous()
    return out


def peft_config(model: Transformer, cfg: LoRAConfig, base: str = "") -> dict[str, Any]:
    """adapter_config.json for `peft` (LoRA on the HF modules the targets map to)."""
    modules = sorted(
        {name.rsplit(".", 1)[1] for t in cfg.targets for name, _, _ in _hf_modules(model.cfg, t, 0)}
    )
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
        "target_modules": modules, "fan_in_fan_out": model.cfg.pos_emb == "learned",
        "bias": "none", "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
    }  # fmt: skip


def save_adapter(model: Transformer, cfg: LoRAConfig, out: str | Path, base: str = "") -> Path:
    """Write `out`/adapter_config.json + adapter_model.safetensors (PEFT's format); `out`."""
    from safetensors.torch import save_file

    from kiln.io import atomic_write

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.cpu() for k, v in peft_tensors(model, cfg).items()}
    tmp = out / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(out / ADAPTER_WEIGHTS)
    with atomic_write(out / ADAPTER_CONFIG) as handle:
        handle.write(json.dumps(peft_config(model, cfg, base), indent=2) + "\n")
    return out
