"""Per-token and per-sequence log-probabilities of responses, the quantity every preference and
RL loss is built from."""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) (B, T) from logits (B, T, V) scored against next-token targets (B, T).

    Targets < 0 (ignored positions) get 0 so sums over a mask stay finite.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    picked = logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)  # (B, T)
    return picked.masked_fill(targets < 0, 0.0)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution (B, T) from logits (B, T, V), in nats."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of x over the last dimension where mask is true: (B, T) -> (B,)."""
    return (x * mask.to(x.dtype)).sum(-1)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over every masked-in element (a scalar); 0 when the mask is empty."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)
