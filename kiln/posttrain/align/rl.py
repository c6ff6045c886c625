"""On-policy RL for a language model: GRPO (group-normalised rewards, no value model) and PPO
(a value model, GAE, clipped value loss), sharing rollouts, the KL to a frozen reference, the
clipped ratio, checkpoints and exact resume.

One step: draw `prompts_per_step` prompts (a seeded permutation per epoch over the prompt set),
sample `group_size` responses each, reward them, then `epochs` passes of minibatch updates.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from kiln.model.transformer import Transformer
from kiln.posttrain.align.logprobs import masked_mean
from kiln.posttrain.align.loop import LoopConfig, PosttrainLoop, PosttrainRun, epoch_slice
from kiln.posttrain.align.reward_model import ScalarHead
from kiln.posttrain.align.rl_losses import (
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    group_advantages,
    kl_estimate,
    ppo_token_rewards,
    whiten,
)
from kiln.posttrain.align.rollout import RewardFn, Rollout, policy_logprobs, sample_rollout

ALGORITHMS = ("grpo", "ppo")


@dataclass(frozen=True)
class RLConfig(LoopConfig):
    """Every setting of an RL run (recorded in each checkpoint)."""

    SECTION: ClassVar[str] = "rl"
    COUNTS: ClassVar[tuple[str, ...]] = (
        "prompts_per_step",
        "group_size",
        "max_new_tokens",
        "epochs",
    )

    algorithm: str = "grpo"  # "grpo" | "ppo"
    steps: int = 20
    prompts_per_step: int = 4
    group_size: int = 4  # samples per prompt (GRPO's G; PPO may use 1)
    max_new_tokens: int = 32
    temperature: float = 1.0
    epochs: int = 1  # optimisation passes over each step's rollout (1: strictly on-policy)
    minibatch: int = 0  # rows per update; 0: the whole rollout in one update
    clip: float = 0.2
    kl_coef: float = 0.02  # GRPO: k3 in the loss; PPO: k1 subtracted from the per-token reward
    scale_rewards: str = "group"  # GRPO's advantage scaling: group | batch | none
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2
    vf_coef: float = 0.1
    save_every: int = 10

    def check(self) -> None:
        """RL's own settings: a known algorithm, sampling and clipping that can run."""
        self.require(self.algorithm in ALGORITHMS, "algorithm", "must be grpo or ppo")
        self.require(self.temperature > 0, "temperature", "must be > 0")
        self.require(self.clip > 0, "clip", "must be > 0")
        self.require(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        self.require(self.minibatch >= 0, "minibatch", "must be >= 0")
        self.require(
            self.algorithm != "grpo" or self.group_size >= 2,
            "group_size",
            "must be >= 2 for grpo (advantages compare samples)",
        )


class RLTrainer(PosttrainLoop):
    """Runs GRPO or PPO from a policy (an SFT model) against a frozen copy of it."""

    def __init__(
        self,
        policy: Transformer,
        prompts: Sequence[Sequence[int]],
        reward_fn: RewardFn,
        cfg: RLConfig,
        out_dir: Path,
        *,
        eot_id: int | None,
        reference: Transformer | None = None,
        base_state: dict[str, Any] | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.section = "rl"
        self.cfg = cfg
        self.model = self.policy = policy
        self.reference = (reference or copy.deepcopy(policy)).eval().requires_grad_(False)
        self.value = ScalarHead(copy.deepcopy(policy)) if cfg.algorithm == "ppo" else None
        self.prompts = [list(p) for p in prompts]
        self.reward_fn = reward_fn
        self.eot_id = eot_id
        self.run_dir = PosttrainRun(Path(out_dir), base_state, cfg.keep_last)
        self.metrics = self.run_dir.metrics
        self.progress = progress
        params = list(policy.parameters()) + (list(self.value.parameters()) if self.value else [])
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0

    def extra_modules(self) -> dict[str, torch.nn.Module]:
        """PPO's value model, saved beside the policy."""
        return {"value": self.value} if self.value is not None else {}

    # ---- the loop ---------------------------------------------------------------------------

    def prompt_rows(self, step: int) -> list[int]:
        """Indices of the prompts of `step`, each repeated group_size times (a pure function)."""
        picked = epoch_slice(len(self.prompts), self.cfg.prompts_per_step, step, self.cfg.seed)
        return [i for i in picked for _ in range(self.cfg.group_size)]

    def train_step(self) -> dict[str, Any]:
        """One rollout and its updates; logs and returns the step's metrics."""
        cfg = self.cfg
        rows = self.prompt_rows(self.step)
        rollout = sample_rollout(
            self.policy, self.reference, [self.prompts[i] for i in rows], rows, self.reward_fn,
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            seed=cfg.seed * 1_000_003 + self.step, eot_id=self.eot_id,
        )  # fmt: skip
        advantages, returns, old_values = self._advantages(rollout)
        stats: list[dict[str, float]] = []
        n = len(rollout)
        size = cfg.minibatch or n
        self.policy.train()
        for epoch in range(cfg.epochs):
            order = torch.randperm(
                n, generator=torch.Generator().manual_seed(cfg.seed + 7919 * self.step + epoch)
            )
            for start in range(0, n, size):
                index = order[start : start + size]
                stats.append(self._update(rollout.rows(index), advantages[index],
                                          returns[index], old_values[index]))  # fmt: skip
        self.step += 1
        record = self._record(rollout, stats)
        self.metrics.write(record)
        if self.progress is not None:
            self.progress(record)
        return record

    def _advantages(self, rollout: Rollout) -> tuple[Tensor, Tensor, Tensor]:
        """GRPO: one advantage per response; PPO: per-token GAE over the value model."""
        cfg = self.cfg
        if cfg.algorithm == "grpo":
            adv = group_advantages(rollout.rewards, cfg.group_size, cfg.scale_rewards)
            zeros = torch.zeros_like(rollout.old_logprobs)
            return adv, zeros, zeros
        assert self.value is not None
        with torch.no_grad():
            values = (
                self.value(rollout.ids)[:, :-1] * rollout.mask
            )  # V of the state before each token
        rewards = ppo_token_rewards(
            rollout.rewards, rollout.old_logprobs, rollout.ref_logprobs, rollout.mask, cfg.kl_coef
        )
        adv, returns = gae(rewards, values, rollout.mask, cfg.gamma, cfg.lam)
        return whiten(adv, rollout.mask), returns, values

    def _update(
        self, batch: Rollout, advantages: Tensor, returns: Tensor, old_values: Tensor
    ) -> dict[str, float]:
        """One optimizer step on a minibatch; returns its statistics."""
        cfg = self.cfg
        logp, entropy = policy_logprobs(self.policy, batch.ids, batch.mask, cfg.temperature)
        pg = clipped_policy_loss(logp, batch.old_logprobs, advantages, batch.mask, cfg.clip)
        kl = masked_mean(kl_estimate(logp, batch.ref_logprobs, "k3"), batch.mask)
        loss = pg.loss
        out = {"clip_fraction": float(pg.clip_fraction), "kl": float(kl.detach())}
        if cfg.algorithm == "grpo":
            loss = loss + cfg.kl_coef * kl
        else:
            assert self.value is not None
            values = self.value(batch.ids)[:, :-1]
            v_loss, v_clipped = clipped_value_loss(
                values, old_values, returns, batch.mask, cfg.value_clip
            )
            loss = loss + cfg.vf_coef * v_loss
            out |= {"value_loss": float(v_loss.detach()), "value_clip_fraction": float(v_clipped)}
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        self.optimizer.step()
        out |= {
            "loss": float(loss.detach()),
            "entropy": float(masked_mean(entropy.detach(), batch.mask)),
            "grad_norm": float(grad_norm),
        }
        return out

    def _record(self, rollout: Rollout, stats: list[dict[str, float]]) -> dict[str, Any]:
        """The step's log line: reward mean and spread, KL, clipping, entropy, length."""
        record: dict[str, Any] = {
            "step": self.step,
            "reward_mean": float(rollout.rewards.mean()),
            "reward_std": float(rollout.rewards.std()) if len(rollout) > 1 else 0.0,
            "response_length": sum(map(len, rollout.responses)) / len(rollout),
        }
        for key in stats[0]:
            values = [s[key] for s in stats if math.isfinite(s[key])]
            record[key] = sum(values) / len(values) if values else float("nan")
        return record
