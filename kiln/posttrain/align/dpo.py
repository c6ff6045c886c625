"""DPO training: a policy (the SFT model) against a frozen reference on preference pairs.

Each step takes `pairs_per_step` pairs in a seeded per-epoch order (a pure function of the step,
so resume is exact), scores chosen and rejected responses under both models and takes one AdamW
step on the sigmoid (DPO) or IPO loss; the logs carry the loss, the implicit reward margin and the
preference accuracy, on the training batch and on held-out pairs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from kiln.config import require
from kiln.model.transformer import Transformer
from kiln.posttrain.align.dpo_loss import LOSS_TYPES, DPOOutput, dpo_loss
from kiln.posttrain.align.logprobs import masked_sum
from kiln.posttrain.align.loop import LoopConfig, PosttrainLoop, PosttrainRun, epoch_slice
from kiln.posttrain.align.rollout import policy_logprobs, sequence_batch


@dataclass(frozen=True)
class TokenPair:
    """One preference pair as token ids: the rendered prompt and the two replies."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


@dataclass(frozen=True)
class DPOConfig(LoopConfig):
    """Every setting of a DPO run (recorded in each checkpoint as config.dpo)."""

    SECTION: ClassVar[str] = "dpo"
    COUNTS: ClassVar[tuple[str, ...]] = ("pairs_per_step", "eval_every")

    beta: float = 0.1
    loss_type: str = "sigmoid"  # "sigmoid" (DPO) | "ipo"
    pairs_per_step: int = 8
    lr: float = 5e-6
    warmup_steps: int = 10
    eval_every: int = 25
    rpo_alpha: float = 0.0  # > 0: add α · the chosen reply's NLL per token (RPO; trl's rpo_alpha)
    # Online / iterative DPO: every `resample_every` steps (0: never, the pairs file only) the
    # pairs are re-made from the current policy's own replies to `resample_prompts` train prompts
    # of data.chat: `resample_samples` each, one of them greedy when `resample_greedy`, the rest
    # at `resample_temperature` (low: pairs near the greedy policy, what evaluation sees).
    resample_every: int = 0
    resample_prompts: int = 64
    resample_samples: int = 4
    resample_temperature: float = 0.7
    resample_greedy: bool = True
    resample_max_new_tokens: int = 128

    def check(self) -> None:
        """DPO's own settings: a positive beta, a known loss, no negative warmup."""
        self.require(self.beta > 0, "beta", "must be > 0")
        self.require(
            self.loss_type in LOSS_TYPES, "loss_type", f"must be one of {', '.join(LOSS_TYPES)}"
        )
        self.require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        self.require(self.rpo_alpha >= 0, "rpo_alpha", "must be >= 0")
        self.require(self.resample_every >= 0, "resample_every", "must be >= 0 (0: never)")
        for name in ("resample_prompts", "resample_max_new_tokens"):
            self.require(getattr(self, name) >= 1, name, "must be >= 1")
        self.require(self.resample_samples >= 2, "resample_samples", "must be >= 2 (a pair)")
        self.require(self.resample_temperature > 0, "resample_temperature", "must be > 0")


def pair_logprobs(model: Transformer, pairs: Sequence[TokenPair]) -> tuple[Tensor, Tensor]:
    """Summed reply log-probs (2, B): chosen row 0, rejected row 1; and reply lengths (2, B).

    The batch is trl's layout: every chosen sequence, then every rejected one, right-padded.
    """
    prompts = [p.prompt for p in pairs] * 2
    replies = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    ids, mask = sequence_batch(prompts, replies)
    device = next(model.parameters()).device
    logp, _ = policy_logprobs(model, ids.to(device), mask.to(device))
    sums = masked_sum(logp, mask.to(device)).view(2, len(pairs))
    return sums, mask.sum(1).view(2, len(pairs)).float().to(device)


def preference_loss(
    policy: Transformer, reference: Transformer, pairs: Sequence[TokenPair], cfg: DPOConfig
) -> DPOOutput:
    """The configured DPO/IPO loss of a batch of pairs."""
    (chosen, rejected), (lc, lr) = pair_logprobs(policy, pairs)
    with torch.no_grad():
        (ref_c, ref_r), _ = pair_logprobs(reference, pairs)
    return dpo_loss(chosen, rejected, ref_c, ref_r, cfg.beta, cfg.loss_type, lc, lr, cfg.rpo_alpha)


class DPOTrainer(PosttrainLoop):
    """Runs DPO from a policy against a frozen copy of it (or a given reference)."""

    def __init__(
        self,
        policy: Transformer,
        pairs: Sequence[TokenPair],
        cfg: DPOConfig,
        out_dir: Path,
        *,
        held_out: Sequence[TokenPair] = (),
        reference: Transformer | None = None,
        base_state: dict[str, Any] | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        require(len(pairs) >= 1, "dpo needs at least one training pair")
        self.section = "dpo"
        self.cfg = cfg
        self.model = self.policy = policy
        self.reference = (reference or copy.deepcopy(policy)).eval().requires_grad_(False)
        self.pairs = list(pairs)
        self.held_out = list(held_out)
        self.optimizer = torch.optim.AdamW(
            policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.run_dir = PosttrainRun(Path(out_dir), base_state, cfg.keep_last)
        self.metrics = self.run_dir.metrics
        self.progress = progress
        self.step = 0
        self.notes: dict[str, Any] = {}  # extra fields for the next step's log line

    def before_step(self) -> None:
        """Called before each update (online DPO re-makes its pairs here)."""

    def batch_of(self, step: int) -> list[TokenPair]:
        """The pairs of `step` (a pure function of the step and seed)."""
        picked = epoch_slice(len(self.pairs), self.cfg.pairs_per_step, step, self.cfg.seed)
        return [self.pairs[i] for i in picked]

    def lr_at(self, step: int) -> float:
        """Linear warmup to cfg.lr, then constant."""
        if step < self.cfg.warmup_steps:
            return self.cfg.lr * (step + 1) / self.cfg.warmup_steps
        return self.cfg.lr

    @torch.no_grad()
    def evaluate(self, pairs: Sequence[TokenPair]) -> dict[str, float]:
        """Loss, reward margin and preference accuracy over pairs (batches of pairs_per_step)."""
        was_training = self.policy.training
        self.policy.eval()
        k = self.cfg.pairs_per_step
        chunks = [pairs[i : i + k] for i in range(0, len(pairs), k)]
        outs = [preference_loss(self.policy, self.reference, chunk, self.cfg) for chunk in chunks]
        self.policy.train(was_training)
        margins = torch.cat([o.margins for o in outs])
        loss = sum(float(o.loss) * len(c) for o, c in zip(outs, chunks, strict=True)) / len(pairs)
        return {
            "loss": loss,
            "margin": float(margins.mean()),
            "accuracy": float((margins > 0).float().mean()),
        }

    def train_step(self) -> dict[str, Any]:
        """One update on the step's pairs; logs and returns its metrics."""
        self.before_step()
        self.policy.train()
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        out = preference_loss(self.policy, self.reference, self.batch_of(self.step), self.cfg)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        record: dict[str, Any] = {
            "step": self.step, "lr": lr, "loss": float(out.loss.detach()),
            "margin": float(out.margins.mean()), "accuracy": out.accuracy,
            "chosen_reward": float(out.chosen_rewards.mean()),
            "rejected_reward": float(out.rejected_rewards.mean()), "grad_norm": float(grad_norm),
            "chosen_nll": float(out.nll), **self.notes,
        }  # fmt: skip
        self.notes = {}
        if self.held_out and (self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps):
            record |= {f"val_{k}": v for k, v in self.evaluate(self.held_out).items()}
        self.metrics.write(record)
        if self.progress is not None:
            self.progress(record)
        return record
