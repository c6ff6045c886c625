"""A Bradley–Terry reward model: the language model's final hidden state at a response's last
token, through a scalar head. Trained on preference pairs so that σ(r_chosen - r_rejected) is the
probability the chosen response is preferred; the same head shape gives PPO's per-token values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.checkpoint_format import load_model_tensors
from kiln.config import require
from kiln.loading import load_checkpoint_model
from kiln.model.transformer import Transformer
from kiln.posttrain.align.loop import LoopConfig, PosttrainLoop, PosttrainRun, epoch_slice


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


@dataclass(frozen=True)
class RewardConfig(LoopConfig):
    """Every setting of a reward-model run (recorded in each checkpoint as config.reward)."""

    SECTION: ClassVar[str] = "reward"
    COUNTS: ClassVar[tuple[str, ...]] = ("pairs_per_step", "eval_every")

    steps: int = 200
    pairs_per_step: int = 16
    lr: float = 1e-4
    eval_every: int = 50
    save_every: int = 100


class RewardTrainer(PosttrainLoop):
    """Trains a RewardModel on (chosen, rejected) full sequences with the Bradley–Terry loss.

    The LM body is `model.safetensors` (the base run's format) and the scalar head
    `reward_head.safetensors` beside it; `load_reward_model` reads both.
    """

    def __init__(
        self,
        reward_model: RewardModel,
        pairs: Sequence[tuple[list[int], list[int]]],
        cfg: RewardConfig,
        out_dir: Path,
        *,
        held_out: Sequence[tuple[list[int], list[int]]] = (),
        base_state: dict[str, Any] | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        require(len(pairs) >= 1, "reward training needs at least one pair")
        self.progress = progress
        self.section = "reward"
        self.cfg = cfg
        self.reward_model = reward_model
        self.model = reward_model.lm
        self.pairs = list(pairs)
        self.held_out = list(held_out)
        self.optimizer = torch.optim.AdamW(
            reward_model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.run_dir = PosttrainRun(Path(out_dir), base_state, cfg.keep_last)
        self.metrics = self.run_dir.metrics
        self.step = 0

    def extra_modules(self) -> dict[str, nn.Module]:
        """The scalar head, saved beside the LM body."""
        return {"reward_head": self.reward_model.head}

    @torch.no_grad()
    def evaluate(self, pairs: Sequence[tuple[list[int], list[int]]]) -> dict[str, float]:
        """Pairwise accuracy and mean Bradley–Terry loss over pairs."""
        was_training = self.reward_model.training
        self.reward_model.eval()
        k = self.cfg.pairs_per_step
        chunks = [pairs[i : i + k] for i in range(0, len(pairs), k)]
        chosen = torch.cat(
            [score_sequences(self.reward_model, [c for c, _ in ch]) for ch in chunks]
        )
        rejected = torch.cat(
            [score_sequences(self.reward_model, [r for _, r in ch]) for ch in chunks]
        )
        self.reward_model.train(was_training)
        return {
            "accuracy": pairwise_accuracy(chosen, rejected),
            "loss": float(bradley_terry_loss(chosen, rejected)),
        }

    def train_step(self) -> dict[str, Any]:
        """One update on the step's pairs; logs and returns its metrics."""
        self.reward_model.train()
        picked = epoch_slice(len(self.pairs), self.cfg.pairs_per_step, self.step, self.cfg.seed)
        batch = [self.pairs[i] for i in picked]
        chosen = score_sequences(self.reward_model, [c for c, _ in batch])
        rejected = score_sequences(self.reward_model, [r for _, r in batch])
        loss = bradley_terry_loss(chosen, rejected)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.reward_model.parameters(), self.cfg.grad_clip
        )
        self.optimizer.step()
        self.step += 1
        record: dict[str, Any] = {
            "step": self.step, "loss": float(loss.detach()),
            "accuracy": pairwise_accuracy(chosen.detach(), rejected.detach()),
            "margin": float((chosen - rejected).mean().detach()), "grad_norm": float(grad_norm),
        }  # fmt: skip
        if self.held_out and (self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps):
            record |= {f"val_{k}": v for k, v in self.evaluate(self.held_out).items()}
        self.metrics.write(record)
        if self.progress is not None:
            self.progress(record)
        return record


def load_reward_model(checkpoint: Path, device: str = "cpu") -> RewardModel:
    """A RewardModel from a RewardTrainer checkpoint directory (LM body + scalar head)."""
    rm = RewardModel(load_checkpoint_model(Path(checkpoint), device=device))
    load_model_tensors(Path(checkpoint) / "reward_head.safetensors", rm.head, device, "the head")
    return rm.eval()
