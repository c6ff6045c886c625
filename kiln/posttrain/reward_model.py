"""A Bradley–Terry reward model: the language model's final hidden state at a response's last
token, through a scalar head. Trained on preference pairs so that σ(r_chosen - r_rejected) is the
probability the chosen response is preferred; the same head shape gives PPO's per-token values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.model.transformer import Transformer


class ScalarHead(nn.Module):
    """The LM's hidden states (B, T, C) -> one scalar per position (B, T)."""

    def __init__(self, lm: Transformer) -> None:
        super().__init__()
        self.lm = lm
        self.head = nn.Linear(lm.cfg.n_embd, 1, bias=True)
        nn.init.normal_(self.head.weight, std=1.0 / (lm.cfg.n_embd + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids: Tensor) -> Tensor:
        """A scalar per position (B, T) of token ids (B, T), in fp32."""
        return self.head(self.lm.hidden(ids)).squeeze(-1).float()


class RewardModel(ScalarHead):
    """Scores a whole sequence by the scalar at its last real token."""

    def score(self, ids: Tensor, lengths: Tensor) -> Tensor:
        """Rewards (B,) of right-padded sequences ids (B, T) with `lengths` real tokens each."""
        per_position = self(ids)  # (B, T)
        return per_position.gather(1, (lengths.long() - 1).clamp(min=0)[:, None]).squeeze(1)


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> Tensor:
    """Mean -log σ(r_chosen - r_rejected) over pairs."""
    return -F.logsigmoid(chosen - rejected).mean()


def pairwise_accuracy(chosen: Tensor, rejected: Tensor) -> float:
    """Fraction of pairs where the chosen response scores strictly higher (ties count half)."""
    wins = (chosen > rejected).float() + 0.5 * (chosen == rejected).float()
    return float(wins.mean())


def right_padded(
    sequences: Sequence[list[int]], pad_id: int = 0, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """Token sequences of any lengths as ids (N, T_max), right-padded, and their lengths (N,)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq)
    return ids.to(device), torch.tensor([len(s) for s in sequences], device=device)


def score_sequences(model: RewardModel, sequences: Sequence[list[int]]) -> Tensor:
    """Rewards (N,) of token sequences of any lengths (differentiable; wrap in no_grad to score)."""
    return model.score(*right_padded(sequences, device=next(model.parameters()).device))
