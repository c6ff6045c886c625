"""Direct preference optimisation: the sigmoid (DPO) and squared (IPO) losses on sequence
log-probabilities of chosen and rejected responses under the policy and a frozen reference.

    logratio_c = log π(y_c|x) - log π_ref(y_c|x)      (summed over response tokens)
    DPO:  loss = -log σ(β · (logratio_c - logratio_r))
    IPO:  loss = (logratio_c / |y_c| - logratio_r / |y_r| - 1 / (2β))²   (per-token averages)

With `rpo_alpha` > 0 the loss adds α times the chosen replies' negative log-likelihood per
token (RPO, Pang et al. 2024, "Iterative Reasoning Preference Optimization"; trl's `rpo_alpha`,
in trl 1.16 `loss_type=["sigmoid", "sft"]` with `loss_weights=[1, α]`): the mean over every
chosen token of the batch, so DPO cannot lower the chosen reply's likelihood along with the
rejected one's.

The implicit rewards β·logratio are what the logs report (margin, accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from kiln.errors import KilnError

LOSS_TYPES = ("sigmoid", "ipo")


@dataclass
class DPOOutput:
    """The loss (scalar, differentiable) and the per-pair statistics the logs show."""

    loss: Tensor
    nll: Tensor  # the chosen replies' mean NLL per token (detached; added to loss times rpo_alpha)
    chosen_rewards: Tensor  # (B,) β · logratio of the chosen response (detached)
    rejected_rewards: Tensor  # (B,)

    @property
    def margins(self) -> Tensor:
        """Implicit reward of the chosen minus the rejected response, per pair."""
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracy(self) -> float:
        """Fraction of pairs whose chosen response the implicit reward prefers."""
        return float((self.margins > 0).float().mean())


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    rpo_alpha: float = 0.0,
) -> DPOOutput:
    """Mean preference loss over pairs from summed response log-probs (B,) of each model.

    IPO needs the response lengths in tokens (it compares per-token averages), and so does the
    RPO term (`rpo_alpha` > 0: α · the chosen replies' NLL per token).
    """
    if beta <= 0:
        raise KilnError(f"dpo beta must be > 0, got {beta}")
    if loss_type not in LOSS_TYPES:
        raise KilnError(f"dpo loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    chosen_ratio = policy_chosen - ref_chosen  # (B,)
    rejected_ratio = policy_rejected - ref_rejected
    if loss_type == "sigmoid":
        per_pair = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    else:
        if chosen_lengths is None or rejected_lengths is None:
            raise KilnError("the ipo loss needs chosen_lengths and rejected_lengths")
        delta = chosen_ratio / chosen_lengths.clamp(
            min=1
        ) - rejected_ratio / rejected_lengths.clamp(min=1)
        per_pair = (delta - 1 / (2 * beta)) ** 2
    loss = per_pair.mean()
    nll = -policy_chosen.sum() / (
        chosen_lengths.sum().clamp(min=1) if chosen_lengths is not None else policy_chosen.numel()
    )
    if rpo_alpha:
        if chosen_lengths is None:
            raise KilnError("the rpo term (rpo_alpha > 0) needs chosen_lengths")
        loss = loss + rpo_alpha * nll
    return DPOOutput(
        loss=loss,
        nll=nll.detach(),
        chosen_rewards=(beta * chosen_ratio).detach(),
        rejected_rewards=(beta * rejected_ratio).detach(),
    )
