"""`kiln scaling plan`: compute-optimal N and D for a budget, a model shape, time and cost.

Given one of C (FLOPs), N (parameters) or D (tokens), a law fixes the other two (C = 6·N·D).
A shape near N is then searched over the presets' own proportions: width per layer
(n_embd / n_layer) within the range the family's presets span, head_dim 64 and the family's
switches, so the result looks like the models kiln already ships. Time uses the exact training
FLOPs of that shape (`ModelConfig.flops_per_token`, attention included) at the given MFU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError
from kiln.hardware import Accelerator
from kiln.model.accounting import memory_estimate
from kiln.model.config import PRESETS, ModelConfig
from kiln.scaling.laws import ScalingLaw, TokensPerParam

FAMILIES = {"llama": "llama-", "gpt2": "gpt2-"}
HEAD_DIM = 64


@dataclass(frozen=True)
class Shape:
    """A model shape found for a target parameter count."""

    config: ModelConfig
    params: int

    @property
    def label(self) -> str:
        """n_layer × n_embd, e.g. 12x768."""
        return f"{self.config.n_layer}x{self.config.n_embd}"


@dataclass(frozen=True)
class Plan:
    """The compute-optimal allocation and what it costs on the given hardware."""

    law: str
    flops: float  # 6·N·D of the law's optimum
    params: float
    tokens: float
    loss: float | None  # the law's prediction (None for the 20x rule)
    shape: Shape
    train_flops: float  # exact FLOPs of training `shape` on `tokens` tokens
    gpu: str
    n_gpus: int
    mfu: float
    precision: str
    seconds: float  # from the exact FLOPs (the count kiln's trainer measures MFU against)
    memory_per_gpu: float  # weights+grads+optimizer sharded over the GPUs, plus activations

    @property
    def seconds_6nd(self) -> float:
        """Wall-clock seconds if training cost exactly C = 6·N·D (the textbook estimate)."""
        return self.seconds * self.flops / self.train_flops

    @property
    def gpu_hours(self) -> float:
        """Wall-clock hours × GPUs."""
        return self.seconds * self.n_gpus / 3600

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return {
            "law": self.law, "flops": self.flops, "params": self.params, "tokens": self.tokens,
            "tokens_per_param": self.tokens / self.params, "loss": self.loss,
            "shape": self.shape.config.to_dict(), "shape_params": self.shape.params,
            "train_flops": self.train_flops, "gpu": self.gpu, "n_gpus": self.n_gpus,
            "mfu": self.mfu, "precision": self.precision, "seconds": self.seconds,
            "seconds_6nd": self.seconds_6nd,
            "gpu_hours": self.gpu_hours, "memory_per_gpu_bytes": self.memory_per_gpu,
        }  # fmt: skip


def family_aspect_range(family: str) -> tuple[float, float]:
    """Smallest and largest n_embd / n_layer among the family's presets."""
    prefix = _family_prefix(family)
    ratios = [
        ModelConfig.preset(name).n_embd / ModelConfig.preset(name).n_layer
        for name in PRESETS
        if name.startswith(prefix)
    ]
    return min(ratios), max(ratios)


def family_base(family: str, vocab_size: int | None, seq_len: int) -> dict[str, Any]:
    """The switches shared by the family's presets (the smallest one's), sized for seq_len."""
    prefix = _family_prefix(family)
    name = min((n for n in PRESETS if n.startswith(prefix)), key=lambda n: PRESETS[n]["n_layer"])
    base = {**PRESETS[name], "block_size": seq_len}
    for key in ("n_layer", "n_head", "n_kv_head", "n_embd", "d_ff", "rope_scaling"):
        base.pop(key, None)
    if vocab_size is not None:
        base["vocab_size"] = vocab_size
    return base


def find_shape(
    target: float, family: str = "llama", vocab_size: int | None = None, seq_len: int = 2048
) -> Shape:
    """The shape whose parameter count is nearest `target` (in log), within the aspect range.

    Widths are multiples of 64 (heads of 64); Llama shapes use grouped-query attention with
    a quarter as many kv heads when the head count allows, as the llama presets do.
    """
    if not (target > 0 and math.isfinite(target)):
        raise KilnError(f"target parameter count must be positive, got {target}")
    lo, hi = family_aspect_range(family)
    base = family_base(family, vocab_size, seq_len)
    best: Shape | None = None
    for n_layer in range(1, 161):
        first = math.ceil(lo * n_layer / HEAD_DIM) * HEAD_DIM
        for width in range(max(first, HEAD_DIM), int(hi * n_layer) + 1, HEAD_DIM):
            n_head = width // HEAD_DIM
            kv = {"n_kv_head": n_head // 4} if family == "llama" and n_head % 4 == 0 else {}
            cfg = ModelConfig.from_dict(
                {**base, "n_layer": n_layer, "n_embd": width, "n_head": n_head, **kv}
            )
            shape = Shape(cfg, cfg.num_params())
            if best is None or abs(math.log(shape.params / target)) < abs(
                math.log(best.params / target)
            ):
                best = shape
    if best is None:  # the aspect range always admits some width for 1..160 layers
        raise KilnError(f"no {family} shape found near {target:.3g} parameters")
    return best


def make_plan(
    law: ScalingLaw | TokensPerParam,
    *,
    flops: float | None = None,
    params: float | None = None,
    tokens: float | None = None,
    gpu: Accelerator,
    n_gpus: int = 1,
    mfu: float = 0.4,
    precision: str = "bf16",
    family: str = "llama",
    vocab_size: int | None = None,
    seq_len: int = 2048,
    micro_batch: int = 1,
) -> Plan:
    """Plan from exactly one of flops, params or tokens."""
    given = [v is not None for v in (flops, params, tokens)]
    if sum(given) != 1:
        raise KilnError("give exactly one of --flops, --params or --tokens")
    if not 0 < mfu <= 1:
        raise KilnError(f"--mfu must be in (0, 1], got {mfu}")
    if n_gpus < 1:
        raise KilnError(f"--n must be >= 1, got {n_gpus}")
    if params is not None:
        flops = law.flops_for_params(params)
    elif tokens is not None:
        flops = law.flops_for_tokens(tokens)
    assert flops is not None
    n_opt, d_opt = law.optimal(flops)
    shape = find_shape(n_opt, family, vocab_size, seq_len)
    train_flops = shape.config.flops_per_token(seq_len) * d_opt
    seconds = train_flops / (gpu.peak(precision) * n_gpus * mfu)
    # fp32 training keeps fp32 activations; every 16/8-bit peak assumes kiln's bf16 autocast.
    mem_precision = "fp32" if precision in ("fp32", "tf32") else "amp-bf16"
    mem = memory_estimate(shape.config, micro_batch, seq_len, mem_precision)
    loss = law.loss(n_opt, d_opt) if isinstance(law, ScalingLaw) else None
    return Plan(
        law=law.name, flops=flops, params=n_opt, tokens=d_opt, loss=loss, shape=shape,
        train_flops=train_flops, gpu=gpu.name, n_gpus=n_gpus, mfu=mfu, precision=precision,
        seconds=seconds, memory_per_gpu=mem.states / n_gpus + mem.activations,
    )  # fmt: skip


def _family_prefix(family: str) -> str:
    if family not in FAMILIES:
        raise KilnError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[family]
