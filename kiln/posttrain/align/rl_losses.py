"""The arithmetic of PPO and GRPO: advantages (GAE, group-normalised), clipped policy and value
losses, and the KL estimators, each on (B, T) tensors of response tokens with a mask.

Shapes: B responses, T response positions; `mask` (B, T) is true on real response tokens
(contiguous from the first position). Everything here is pure tensor math, checked against
hand-worked examples in tests/posttrain/align/test_rl_losses.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.posttrain.align.logprobs import masked_mean

SCALE_REWARDS = ("group", "batch", "none")
# How a loss summed over response tokens becomes one number (see `aggregate`).
LOSS_NORMS = ("sequence", "token", "constant")
BASELINES = ("none", "group")


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimates and returns (B, T) from per-token rewards and values.

    δ_t = r_t + γ·V_{t+1} - V_t with V = 0 past the last response token; A_t = δ_t + γλ·A_{t+1}.
    Returns (advantages, returns = advantages + values), both zero outside the mask.
    """
    m = mask.to(values.dtype)
    B, T = rewards.shape
    adv = torch.zeros_like(values)
    running = torch.zeros(B, dtype=values.dtype, device=values.device)
    for t in reversed(range(T)):
        has_next = m[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        next_value = values[:, t + 1] * has_next if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running * has_next
        adv[:, t] = running * m[:, t]
    return adv, (adv + values) * m


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """x scaled to unit variance over the masked elements (and centred if shift_mean)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


def group_advantages(
    rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4
) -> Tensor:
    """GRPO advantages (N,): each reward minus its group's mean, over the group's (or batch's) std.

    Rewards come in consecutive groups of `group_size` samples of one prompt. The std is the
    unbiased one, with `eps` added so a group whose samples all scored the same gets advantage 0.
    `scale="none"` is Dr. GRPO's unscaled advantage (no std division: no question-difficulty bias).
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise KilnError(f"{rewards.numel()} rewards do not form groups of group_size {group_size}")
    if scale not in SCALE_REWARDS:
        raise KilnError(f"scale must be one of {', '.join(SCALE_REWARDS)}, got {scale!r}")
    grouped = rewards.float().view(-1, group_size)  # (P, G)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale == "none":
        return centred
    if group_size == 1 and scale == "group":
        return torch.zeros_like(centred)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    else:
        std = rewards.float().std() if rewards.numel() > 1 else torch.zeros(())
    return centred / (std + eps)


def reinforce_advantages(rewards: Tensor, group_size: int, baseline: str = "group") -> Tensor:
    """REINFORCE's weights (N,): the raw reward ("none"), or minus its group's mean ("group").

    The group-mean baseline keeps the gradient unbiased and lowers its variance; nothing is
    divided by a std (that is GRPO).
    """
    if baseline not in BASELINES:
        raise KilnError(f"baseline must be one of {', '.join(BASELINES)}, got {baseline!r}")
    if baseline == "none":
        return rewards.float().clone()
    return group_advantages(rewards, group_size, "none")


def aggregate(per_token: Tensor, mask: Tensor, norm: str = "token", max_len: int = 1) -> Tensor:
    """A per-token loss (B, T) as one number, by `norm`:

    - "sequence": each response's mean over its tokens, then the mean over responses (GRPO,
      Shao et al. 2024; CS336): a long response's tokens each weigh less;
    - "token": the sum over every response token over their count (DAPO, Yu et al. 2025);
    - "constant": the sum over every response token over B·max_len (Dr. GRPO, Liu et al. 2025):
      no length bias at all, the normaliser is the same for every batch.
    """
    m = mask.to(per_token.dtype)
    total = (per_token * m).sum()
    if norm == "token":
        return total / m.sum().clamp(min=1.0)
    if norm == "sequence":
        per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # (B,)
        return per_seq.mean()
    if norm == "constant":
        if max_len < 1:
            raise KilnError(f"the constant normaliser needs max_len >= 1, got {max_len}")
        return total / (per_token.size(0) * max_len)
    raise KilnError(f"loss norm must be one of {', '.join(LOSS_NORMS)}, got {norm!r}")


@dataclass
class PolicyLoss:
    """The clipped surrogate loss and the fraction of tokens whose ratio was clipped."""

    loss: Tensor
    clip_fraction: Tensor
    ratio_mean: Tensor


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip: float = 0.2,
    norm: str = "token",
    max_len: int = 1,
) -> PolicyLoss:
    """PPO's surrogate max(-A·ρ, -A·clip(ρ, 1-ε, 1+ε)), ρ = π/π_old, aggregated by `norm`.

    `advantages` is (B, T) per token, or (B,) per response (GRPO) broadcast over its tokens.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    return PolicyLoss(
        loss=aggregate(torch.maximum(unclipped, clipped), mask, norm, max_len),
        clip_fraction=masked_mean((clipped > unclipped).float(), mask).detach(),
        ratio_mean=masked_mean(ratio, mask).detach(),
    )


def reinforce_loss(
    logprobs: Tensor, advantages: Tensor, mask: Tensor, norm: str = "token", max_len: int = 1
) -> Tensor:
    """REINFORCE (Williams 1992): -A·log π of each response token, aggregated by `norm`.

    No ratio and no clipping: its gradient is the policy gradient of the samples just drawn.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    return aggregate(-advantages * logprobs, mask, norm, max_len)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked tokens (1: a perfect critic,
    0: no better than a constant, below 0: worse); nan when the returns do not vary."""
    var_returns = float(masked_mean((returns - masked_mean(returns, mask)) ** 2, mask))
    err = returns - values
    var_err = float(masked_mean((err - masked_mean(err, mask)) ** 2, mask))
    return 1.0 - var_err / var_returns if var_returns > 0 else float("nan")


class AdaptiveKL:
    """Ziegler et al. (2019)'s KL controller: β moves so the measured KL approaches a target.

    After a step of n samples with KL k: e = clip(k / target - 1, -0.2, 0.2) and
    β <- β · (1 + e · n / horizon).
    """

    def __init__(self, init: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon < 1:
            raise KilnError(
                f"adaptive KL needs target > 0 and horizon >= 1, got {target}, {horizon}"
            )
        self.value, self.target, self.horizon = float(init), float(target), int(horizon)

    def update(self, kl: float, n_samples: int) -> float:
        """The new β after a step whose mean KL per response was `kl`."""
        error = min(0.2, max(-0.2, kl / self.target - 1.0))
        self.value *= 1.0 + error * n_samples / self.horizon
        return self.value


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float = 0.2
) -> tuple[Tensor, Tensor]:
    """PPO's value loss ½·max((V-R)², (V_clip-R)²) with V_clip within ±clip of the old values.

    Returns (loss, fraction of tokens where the clipped error was the larger).
    """
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    err, err_clipped = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(err, err_clipped), mask)
    return loss, masked_mean((err_clipped > err).float(), mask).detach()


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(π‖π_ref) from sampled tokens' log-probs (Schulman's k1/k2/k3).

    k1 = log π - log π_ref (unbiased, can be negative); k2 = ½·k1²; k3 = e^(-k1) + k1 - 1 (unbiased
    and never negative: GRPO's choice).
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise KilnError(f"kl estimator must be k1, k2 or k3, got {kind!r}")


def ppo_token_rewards(
    scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kl_coef: float
) -> Tensor:
    """Per-token rewards (B, T): -kl_coef·k1 on every response token, the score on the last one."""
    m = mask.to(logprobs.dtype)
    rewards = -kl_coef * (logprobs - ref_logprobs) * m
    last = (m.sum(dim=1).long() - 1).clamp(min=0)  # (B,) index of each response's last token
    return rewards.scatter_add(1, last[:, None], scores.to(rewards.dtype)[:, None])
