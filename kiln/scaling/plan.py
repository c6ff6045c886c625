"""`kiln scaling plan`: compute-optimal N and D for a budget, a model shape, time and cost.

Given one of C (FLOPs), N (parameters) or D (tokens), a law fixes the other two (C = 6·N·D).
A shape near N is then searched over the presets' own proportions: width per layer
(n_embd / n_layer) within the range the family's presets span, head_dim 64 and the family's
switches, so the result looks like the models kiln already ships. Time uses the exact training
FLOPs of that shape (`ModelConfig.flops_per_token`, attention included) at the given MFU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError
from kiln.hardware import Accelerator
from kiln.model.accounting import memory_estimate
from kiln.model.config import PRESETS, ModelConfig
from kiln.scaling.laws import ScalingLaw, TokensPerParam, effective_params, effective_tokens

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
    rate: float | None = None  # measured training FLOP/s that gave `seconds` (instead of peak·MFU)
    unique_tokens: float | None = None  # distinct tokens in the data (None: unlimited)

    @property
    def epochs(self) -> float | None:
        """Passes over the data the plan's tokens make (None without unique_tokens)."""
        return None if self.unique_tokens is None else self.tokens / self.unique_tokens

    effective_params: float | None = None  # N' of repeated data (None without unique_tokens)

    @property
    def effective_tokens(self) -> float:
        """Fresh-data equivalent of the plan's tokens (Muennighoff et al. 2023 when repeated)."""
        if self.unique_tokens is None:
            return self.tokens
        return effective_tokens(self.tokens, self.unique_tokens)

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
            "rate_flops_per_s": self.rate, "unique_tokens": self.unique_tokens,
            "epochs": self.epochs, "effective_tokens": self.effective_tokens,
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
    shapes = _candidate_shapes(family, vocab_size, seq_len)
    if not shapes:  # the aspect range always admits some width for 1..160 layers
        raise KilnError(f"no {family} shape found near {target:.3g} parameters")
    return min(shapes, key=lambda shape: abs(math.log(shape.params / target)))


@functools.lru_cache(maxsize=16)
def _candidate_shapes(family: str, vocab_size: int | None, seq_len: int) -> tuple[Shape, ...]:
    """Every shape find_shape may pick (built once per family, vocabulary and length)."""
    lo, hi = family_aspect_range(family)
    base = family_base(family, vocab_size, seq_len)
    shapes = []
    for n_layer in range(1, 161):
        first = math.ceil(lo * n_layer / HEAD_DIM) * HEAD_DIM
        for width in range(max(first, HEAD_DIM), int(hi * n_layer) + 1, HEAD_DIM):
            n_head = width // HEAD_DIM
            kv = {"n_kv_head": n_head // 4} if family == "llama" and n_head % 4 == 0 else {}
            cfg = ModelConfig.from_dict(
                {**base, "n_layer": n_layer, "n_embd": width, "n_head": n_head, **kv}
            )
            shapes.append(Shape(cfg, cfg.num_params()))
    return tuple(shapes)


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
    rate: float | None = None,
    unique_tokens: float | None = None,
    max_epochs: float | None = None,
) -> Plan:
    """Plan from exactly one of flops, params or tokens.

    `rate` (training FLOP/s measured on the machine) times the plan instead of the GPU's peak
    × MFU. `unique_tokens` bounds the data: with a fitted law, N is then chosen to minimise the
    loss at the repeated data's effective tokens (data_constrained_optimal), not L(N, D).
    `max_epochs` caps the tokens at that many passes over `unique_tokens`; the compute the cap
    leaves goes to the model's size (N = C / 6D), since past a few epochs the data over-fits
    before it teaches (docs/speedrun.md, round 7).
    """
    given = [v is not None for v in (flops, params, tokens)]
    if sum(given) != 1:
        raise KilnError("give exactly one of --flops, --params, --tokens or --hours")
    if not 0 < mfu <= 1:
        raise KilnError(f"--mfu must be in (0, 1], got {mfu}")
    if n_gpus < 1:
        raise KilnError(f"--n must be >= 1, got {n_gpus}")
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise KilnError(f"--rate must be a positive FLOP/s, got {rate}")
    if unique_tokens is not None and not (unique_tokens > 0 and math.isfinite(unique_tokens)):
        raise KilnError(f"--unique-tokens must be a positive count, got {unique_tokens}")
    if max_epochs is not None:
        if unique_tokens is None:
            raise KilnError("--max-epochs needs --unique-tokens (the data it counts passes over)")
        if not (max_epochs > 0 and math.isfinite(max_epochs)):
            raise KilnError(f"--max-epochs must be a positive number, got {max_epochs}")
    if params is not None:
        flops = law.flops_for_params(params)
    elif tokens is not None:
        flops = law.flops_for_tokens(tokens)
    assert flops is not None
    n_opt, d_opt = law.optimal(flops)
    if unique_tokens is not None and isinstance(law, ScalingLaw) and d_opt > unique_tokens:
        n_opt, d_opt = data_constrained_optimal(law, flops, unique_tokens)
    cap = None if max_epochs is None or unique_tokens is None else max_epochs * unique_tokens
    if cap is not None and d_opt > cap:
        if tokens is not None:
            raise KilnError(
                f"--tokens {tokens:.3g} is more than --max-epochs {max_epochs:g} of "
                f"--unique-tokens {unique_tokens:.3g} ({cap:.3g} tokens)"
            )
        # A given size keeps its N and trains fewer tokens; a given compute buys a larger N.
        d_opt = cap
        n_opt = params if params is not None else flops / (6 * d_opt)
        flops = 6 * n_opt * d_opt
    shape = find_shape(n_opt, family, vocab_size, seq_len)
    train_flops = shape.config.flops_per_token(seq_len) * d_opt
    seconds = train_flops / (rate if rate is not None else gpu.peak(precision) * n_gpus * mfu)
    # fp32 training keeps fp32 activations; every 16/8-bit peak assumes kiln's bf16 autocast.
    mem_precision = "fp32" if precision in ("fp32", "tf32") else "amp-bf16"
    mem = memory_estimate(shape.config, micro_batch, seq_len, mem_precision)
    n_eff, d_eff = n_opt, d_opt
    if unique_tokens is not None and isinstance(law, ScalingLaw):
        n_eff, d_eff = repeated_effective(law, n_opt, d_opt, unique_tokens)
    loss = law.loss(n_eff, d_eff) if isinstance(law, ScalingLaw) else None
    return Plan(
        law=law.name, flops=flops, params=n_opt, tokens=d_opt, loss=loss, shape=shape,
        train_flops=train_flops, gpu=gpu.name, n_gpus=n_gpus, mfu=mfu, precision=precision,
        seconds=seconds, memory_per_gpu=mem.states / n_gpus + mem.activations, rate=rate,
        unique_tokens=unique_tokens, effective_params=n_eff if unique_tokens else None,
    )  # fmt: skip


def repeated_effective(law: ScalingLaw, n: float, d: float, unique: float) -> tuple[float, float]:
    """(N', D'): Muennighoff et al.'s effective parameters and tokens for d tokens on `unique`."""
    unique_params = law.optimal(law.flops_for_tokens(unique))[0]
    return effective_params(n, unique_params), effective_tokens(d, unique)


def data_constrained_optimal(law: ScalingLaw, flops: float, unique: float) -> tuple[float, float]:
    """(N, D) with 6·N·D = flops minimising L(N', D'), the effective size and data on `unique`.

    A golden-section search over log N: the loss is unimodal in log N (the N term falls, the
    effective-data term rises as D = C/6N shrinks).
    """

    def loss(log_n: float) -> float:
        n = math.exp(log_n)
        return law.loss(*repeated_effective(law, n, flops / (6 * n), unique))

    lo, hi = math.log(1.0), math.log(flops / 6)  # from 1 parameter to 1 token
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if loss(a) < loss(b):
            hi = b
        else:
            lo = a
    n = math.exp((lo + hi) / 2)
    return n, flops / (6 * n)


def plan_for_time(law: ScalingLaw | TokensPerParam, seconds: float, **kwargs: Any) -> Plan:
    """The plan that trains for `seconds` on the given hardware (or measured rate).

    The budget is rescaled by the planned time's ratio until the shape settles; the shapes are
    discrete, so the returned plan then trains that shape for exactly the tokens the time buys
    (as the trainer's time budget does), its N the shape's and its loss the law's at that N, D.
    """
    if not (seconds > 0 and math.isfinite(seconds)):
        raise KilnError(f"--hours must be a positive number, got {seconds / 3600:g}")
    plan = make_plan(law, flops=1e12, **kwargs)
    for _ in range(8):
        plan = make_plan(law, flops=plan.flops * seconds / plan.seconds, **kwargs)
        if abs(plan.seconds / seconds - 1) < 1e-3:
            break
    n = float(plan.shape.params)
    tokens = plan.tokens * seconds / plan.seconds
    n_eff, d_eff = n, tokens
    if plan.unique_tokens is not None and isinstance(law, ScalingLaw):
        n_eff, d_eff = repeated_effective(law, n, tokens, plan.unique_tokens)
    return dataclasses.replace(
        plan, flops=6 * n * tokens, params=n, tokens=tokens, seconds=seconds,
        train_flops=plan.train_flops * seconds / plan.seconds,
        loss=law.loss(n_eff, d_eff) if isinstance(law, ScalingLaw) else None,
        effective_params=n_eff if plan.unique_tokens is not None else None,
    )  # fmt: skip


def _family_prefix(family: str) -> str:
    if family not in FAMILIES:
        raise KilnError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[family]
