"""Mixture-of-experts MLP: a router picks top_k of n_experts SwiGLU (or GELU) experts per token.

    scores = softmax(x·Wrᵀ) or sigmoid(x·Wrᵀ)                      (N, E), fp32
    chosen = top_k(scores + b)          b: DeepSeek-V3's balancing bias (choice only, no gradient)
    w = scores[chosen] (/ their sum if norm_topk) · routed_scale        (N, k)
    y = Σ_j w_j · expert_{chosen_j}(x) + shared(x)

Tokens are dispatched by sorting their (token, expert) assignments by expert, so each expert's
rows are contiguous, and running one grouped matmul over the segments (`torch._grouped_mm` on
CUDA in bf16, a per-expert loop elsewhere). `dispatch` is the one function that moves tokens to
experts and back, so expert parallelism can replace it. Dropless by default; a capacity factor
drops the assignments past ceil(cf·N·k/E) per expert (later tokens first).

Training-only terms (added to the loss by `Transformer.forward` in train mode): the
load-balancing loss E/(N·k)·Σ_i count_i·P_i (1 when balanced) and the router z-loss
mean(logsumexp(logits)²). `balance_experts` (called by the trainer after each optimizer step)
updates the balancing bias outside autograd and returns per-layer load statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.model.config import ModelConfig
from kiln.model.layers import MLP, activate


class GroupedLinear(nn.Module):
    """n independent bias-free linear maps, weight (n, out, in) as nn.Linear stores one."""

    def __init__(self, n: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features))

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """Rows x (A, in), grouped by expert (counts (n,) rows each, in order) -> (A, out)."""
        return grouped_matmul(x, self.weight, counts)


def grouped_mm_available(x: Tensor) -> bool:
    """Whether torch._grouped_mm runs these inputs: CUDA, bf16, Hopper or newer."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


def grouped_matmul(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """x (A, in) row segments times their expert's weight (E, out, in)ᵀ -> (A, out)."""
    w = weight.to(x.dtype)
    if grouped_mm_available(x):
        offs = counts.cumsum(0).to(torch.int32)  # end row of each expert's segment
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    # The fallback: one matmul per expert over its contiguous rows. Empty segments still run
    # (0 FLOPs) so every expert's weight gets a (zero) gradient, as DDP expects of each step.
    segments = x.split(counts.tolist())
    return torch.cat([seg @ w[e].T for e, seg in enumerate(segments)])


class Experts(nn.Module):
    """The routed experts' weights: fused gate+up (E, 2F, C) (or fc (E, F, C)) and proj (E, C, F)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.moe is not None
        E, C, F_ = cfg.moe.n_experts, cfg.n_embd, cfg.expert_size
        self.n_experts = E
        self.kind = cfg.mlp
        self.fc = GroupedLinear(E, C, (2 if cfg.gated else 1) * F_)
        self.proj = GroupedLinear(E, F_, C)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """Rows x (A, C) grouped by expert -> each row through its expert (A, C)."""
        h = self.fc(x, counts)  # (A, 2F) or (A, F)
        return self.proj(activate(self.kind, h), counts)


def dispatch(
    x: Tensor,
    expert_idx: Tensor,
    weights: Tensor,
    experts: Experts,
    capacity: int | None = None,
) -> Tensor:
    """Σ_j weights[:, j] · expert_{expert_idx[:, j]}(x) for tokens x (N, C): sort, compute, combine.

    The one token-dispatch function (expert parallelism swaps this). expert_idx, weights (N, k).
    With a capacity, each expert keeps its first `capacity` assignments in token order.
    """
    _N, k = expert_idx.shape
    flat = expert_idx.reshape(-1)  # (N·k,)
    order = flat.argsort(stable=True)  # assignments grouped by expert, token order kept
    counts = torch.bincount(flat, minlength=experts.n_experts)  # (E,)
    sorted_expert = flat[order]
    if capacity is not None:
        starts = counts.cumsum(0) - counts
        rank = torch.arange(order.numel(), device=x.device) - starts[sorted_expert]
        order = order[rank < capacity]
        counts = counts.clamp(max=capacity)
    token = order // k  # (A,) the token of each kept assignment
    out = experts(x[token], counts) * weights.reshape(-1)[order, None].to(x.dtype)  # (A, C)
    return torch.zeros_like(x).index_add_(0, token, out)  # (N, C)


def route(
    logits: Tensor, top_k: int, score: str, norm_topk: bool, scale: float, bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(scores (N, E), chosen experts (N, k), their weights (N, k)) from router logits (N, E)."""
    scores = logits.softmax(dim=-1) if score == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias  # the bias steers the choice only
    chosen = choice.topk(top_k, dim=-1).indices  # (N, k)
    weights = scores.gather(1, chosen)
    if norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return scores, chosen, weights * scale


class MoE(nn.Module):
    """Router + routed experts (+ shared experts): a drop-in for the dense MLP of a block."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.cfg = m = cfg.moe
        self.router = nn.Linear(cfg.n_embd, m.n_experts, bias=False)
        self.experts = Experts(cfg)
        self.shared = MLP(cfg, m.n_shared * cfg.expert_size) if m.n_shared else None
        if m.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(m.n_experts))
        else:
            self.expert_bias: Tensor | None = None
        # Assignments per expert since the last `balance_experts` (training forwards only); a
        # plain attribute, not a buffer, so a meta-built model has nothing to materialise.
        self.load: Tensor | None = None
        self.layer = layer
        self.aux_loss: Tensor | None = None  # this forward's balancing terms (train mode)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, C)."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        with torch.autocast(x.device.type, enabled=False):  # routing decisions in fp32
            logits = F.linear(flat.float(), self.router.weight.float())  # (N, E)
        m = self.cfg
        scores, chosen, weights = route(
            logits, m.top_k, m.score, m.norm_topk, m.routed_scale, self.expert_bias
        )
        capacity = None
        if m.capacity_factor is not None:
            capacity = math.ceil(m.capacity_factor * flat.size(0) * m.top_k / m.n_experts)
        y = dispatch(flat, chosen, weights, self.experts, capacity)  # (N, C)
        if self.shared is not None:
            y = y + self.shared(flat)
        if self.training:
            self.aux_loss = self._balancing_terms(logits, scores, chosen)
        return y.view(B, T, C)

    def _balancing_terms(self, logits: Tensor, scores: Tensor, chosen: Tensor) -> Tensor:
        """aux_loss·E/(N·k)·Σ count_i·P_i + router_z_loss·mean(lse²); records the load."""
        m = self.cfg
        counts = torch.bincount(chosen.reshape(-1), minlength=m.n_experts).float()  # (E,)
        self.load = counts.detach() if self.load is None else self.load + counts.detach()
        probs = scores if m.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        n_assign = chosen.numel()
        balance = m.n_experts / n_assign * (counts * probs.mean(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).square().mean()
        return m.aux_loss * balance + m.router_z_loss * z


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE MLPs of a model, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> Tensor:
    """The sum of every MoE layer's balancing terms from the last (training) forward."""
    terms = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(terms).sum() if terms else torch.zeros(())


@torch.no_grad()
def balance_experts(
    model: nn.Module, reduce: Callable[[Tensor], Tensor] | None = None
) -> dict[str, float]:
    """After an optimizer step: update the balancing biases, reset the loads, return load stats.

    Per MoE layer i: `moe.L{i}.load_min` / `load_max` (an expert's share of the assignments
    times n_experts: 1 is perfectly balanced, 0 a dead expert) and `load_entropy` (of the
    shares, divided by ln E: 1 when balanced), plus `moe.dead_experts` (experts that got no
    token, summed over layers). `reduce` sums the loads over data-parallel ranks so every rank
    moves its bias alike.
    """
    stats: dict[str, float] = {}
    dead = 0
    for layer in moe_layers(model):
        if layer.load is None:
            continue
        load = layer.load if reduce is None else reduce(layer.load.clone())
        layer.load = None
        total, m, i = float(load.sum()), layer.cfg, layer.layer
        if layer.expert_bias is not None and m.bias_update_rate > 0:
            layer.expert_bias += m.bias_update_rate * torch.sign(load.mean() - load)
        share = load / total
        entropy = -(share * share.clamp(min=1e-12).log()).sum() / math.log(max(m.n_experts, 2))
        stats[f"moe.L{i}.load_min"] = float(share.min()) * m.n_experts
        stats[f"moe.L{i}.load_max"] = float(share.max()) * m.n_experts
        stats[f"moe.L{i}.load_entropy"] = float(entropy)
        dead += int((load == 0).sum())
    if stats:
        stats["moe.dead_experts"] = float(dead)
    return stats
