"""On-policy RL for a language model: GRPO (group-normalised rewards, no value model), PPO
(a value model, GAE, clipped value loss) and REINFORCE (the plain policy gradient, with or
without a group-mean baseline), sharing rollouts, the KL to a frozen reference, the clipped
ratio, checkpoints and exact resume.

One step: draw `prompts_per_step` prompts (a seeded permutation per epoch over the prompt set),
sample `group_size` responses each, reward them, then `epochs` passes of minibatch updates
(with epochs > 1 the later passes are off-policy, so the ratio moves and clipping acts). The
switches and their papers are listed in docs/posttrain.md ("RL switches").
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

from kiln.errors import KilnError
from kiln.model.transformer import Transformer
from kiln.posttrain.align.logprobs import masked_mean
from kiln.posttrain.align.loop import LoopConfig, PosttrainLoop, PosttrainRun, epoch_slice
from kiln.posttrain.align.reward_model import ScalarHead
from kiln.posttrain.align.rl_losses import (
    BASELINES,
    LOSS_NORMS,
    SCALE_REWARDS,
    AdaptiveKL,
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    explained_variance,
    gae,
    group_advantages,
    kl_estimate,
    ppo_token_rewards,
    reinforce_advantages,
    reinforce_loss,
    whiten,
)
from kiln.posttrain.align.rollout import (
    RewardFn,
    Rollout,
    finished,
    policy_logprobs,
    sample_rollout,
)

ALGORITHMS = ("grpo", "ppo", "reinforce")
UNFINISHED = ("score", "zero")
VALUE_INITS = ("policy", "reward")


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

    algorithm: str = "grpo"  # "grpo" | "ppo" | "reinforce"
    steps: int = 20
    prompts_per_step: int = 4
    group_size: int = 4  # samples per prompt (GRPO's G; PPO may use 1)
    max_new_tokens: int = 32
    temperature: float = 1.0
    unfinished: str = "score"  # a response cut at max_new_tokens: its reward as scored, or 0
    epochs: int = 1  # optimisation passes over each step's rollout (1: strictly on-policy)
    minibatch: int = 0  # rows per update; 0: the whole rollout in one update
    clip: float = 0.2
    kl_coef: float = 0.02  # GRPO: k3 in the loss; PPO: k1 subtracted from the per-token reward
    scale_rewards: str = "group"  # GRPO's advantage scaling: group | batch | none (Dr. GRPO)
    adv_eps: float = 1e-4  # GRPO: added to the std the advantages are divided by
    loss_norm: str = "token"  # sequence (GRPO) | token (DAPO) | constant (Dr. GRPO)
    baseline: str = "group"  # REINFORCE: none | group (minus the group's mean reward)
    kl_target: float = 0.0  # > 0: adapt kl_coef toward this KL per response (Ziegler et al.)
    kl_horizon: int = 10_000  # the adaptive controller's horizon, in samples
    whiten_advantages: bool = True  # PPO: advantages to zero mean, unit variance per rollout
    value_init: str = "policy"  # PPO's value model: a copy of the policy, or of data.reward_model
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2
    vf_coef: float = 0.1
    save_every: int = 10

    def check(self) -> None:
        """RL's own settings: a known algorithm, sampling and clipping that can run."""
        self.require(self.algorithm in ALGORITHMS, "algorithm", "must be grpo, ppo or reinforce")
        self.require(self.loss_norm in LOSS_NORMS, "loss_norm", f"must be one of {LOSS_NORMS}")
        self.require(
            self.scale_rewards in SCALE_REWARDS, "scale_rewards", f"must be one of {SCALE_REWARDS}"
        )
        self.require(self.baseline in BASELINES, "baseline", f"must be one of {BASELINES}")
        self.require(self.value_init in VALUE_INITS, "value_init", f"must be one of {VALUE_INITS}")
        self.require(self.unfinished in UNFINISHED, "unfinished", f"must be one of {UNFINISHED}")
        self.require(self.adv_eps > 0, "adv_eps", "must be > 0")
        self.require(self.kl_target >= 0, "kl_target", "must be >= 0 (0: a fixed kl_coef)")
        self.require(self.kl_horizon >= 1, "kl_horizon", "must be >= 1")
        self.require(self.temperature > 0, "temperature", "must be > 0")
        self.require(self.clip > 0, "clip", "must be > 0")
        self.require(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        self.require(self.minibatch >= 0, "minibatch", "must be >= 0")
        self.require(
            self.algorithm != "grpo" or self.group_size >= 2,
            "group_size",
            "must be >= 2 for grpo (advantages compare samples)",
        )
        self.require(
            self.algorithm != "reinforce" or self.epochs == 1,
            "epochs",
            "must be 1 for reinforce (it has no ratio to correct a reused rollout)",
        )
        self.require(
            self.algorithm != "reinforce" or self.baseline == "none" or self.group_size >= 2,
            "group_size",
            "must be >= 2 for reinforce with baseline = group (the baseline is the others' mean)",
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
        value_from: ScalarHead | None = None,
        base_state: dict[str, Any] | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.section = "rl"
        self.cfg = cfg
        self.model = self.policy = policy
        self.reference = (reference or copy.deepcopy(policy)).eval().requires_grad_(False)
        self.value = self._value_model(policy, value_from) if cfg.algorithm == "ppo" else None
        self.kl = AdaptiveKL(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target else None
        self.kl_coef = cfg.kl_coef
        self.prompts = [list(p) for p in prompts]
        self.reward_fn = reward_fn
        self.eot_id = eot_id
        self.run_dir = PosttrainRun(Path(out_dir), base_state, cfg.keep_last)
        self.metrics = self.run_dir.metrics
        self.progress = progress
        params = list(policy.parameters()) + (list(self.value.parameters()) if self.value else [])
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0

    def _value_model(self, policy: Transformer, value_from: ScalarHead | None) -> ScalarHead:
        """PPO's critic: the policy's body and a fresh head, or a copy of the reward model."""
        if self.cfg.value_init == "policy":
            return ScalarHead(copy.deepcopy(policy))
        if value_from is None:
            raise KilnError("rl.value_init = reward: set data.reward_model (the critic's start)")
        value = ScalarHead(copy.deepcopy(value_from.lm))
        value.head.load_state_dict(value_from.head.state_dict())
        return value.train().requires_grad_(True)

    def resume(self) -> bool:
        """Continue from the latest checkpoint; the adaptive KL coefficient from the last log."""
        if not super().resume():
            return False
        records = self.metrics.read()
        if records and "kl_coef_next" in records[-1]:
            self.kl_coef = float(records[-1]["kl_coef_next"])
            if self.kl is not None:
                self.kl.value = self.kl_coef
        return True

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
            score_unfinished=cfg.unfinished == "score",
        )  # fmt: skip
        advantages, returns, old_values = self._advantages(rollout)
        stats: list[dict[str, float]] = []
        extra: dict[str, float] = {"kl_coef": self.kl_coef}
        if cfg.algorithm == "ppo":
            extra["explained_variance"] = explained_variance(old_values, returns, rollout.mask)
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
        seq_kl = float(
            ((rollout.old_logprobs - rollout.ref_logprobs) * rollout.mask).sum(-1).mean()
        )
        if self.kl is not None:  # Ziegler et al.: the KL per response, k1 summed over its tokens
            self.kl_coef = self.kl.update(seq_kl, n)
        record = self._record(rollout, stats) | extra | {
            "sequence_kl": seq_kl, "kl_coef_next": self.kl_coef,
        }  # fmt: skip
        self.metrics.write(record)
        if self.progress is not None:
            self.progress(record)
        return record

    def _advantages(self, rollout: Rollout) -> tuple[Tensor, Tensor, Tensor]:
        """GRPO, REINFORCE: one advantage per response; PPO: per-token GAE over the value model."""
        cfg = self.cfg
        zeros = torch.zeros_like(rollout.old_logprobs)
        if cfg.algorithm == "grpo":
            adv = group_advantages(rollout.rewards, cfg.group_size, cfg.scale_rewards, cfg.adv_eps)
            return adv, zeros, zeros
        if cfg.algorithm == "reinforce":
            return reinforce_advantages(rollout.rewards, cfg.group_size, cfg.baseline), zeros, zeros
        assert self.value is not None
        with torch.no_grad():
            values = (
                self.value(rollout.ids)[:, :-1] * rollout.mask
            )  # V of the state before each token
        rewards = ppo_token_rewards(
            rollout.rewards, rollout.old_logprobs, rollout.ref_logprobs, rollout.mask, self.kl_coef
        )
        adv, returns = gae(rewards, values, rollout.mask, cfg.gamma, cfg.lam)
        return (whiten(adv, rollout.mask) if cfg.whiten_advantages else adv), returns, values

    def _update(
        self, batch: Rollout, advantages: Tensor, returns: Tensor, old_values: Tensor
    ) -> dict[str, float]:
        """One optimizer step on a minibatch; returns its statistics."""
        cfg = self.cfg
        logp, entropy = policy_logprobs(self.policy, batch.ids, batch.mask, cfg.temperature)
        norm = (cfg.loss_norm, cfg.max_new_tokens)
        pg = clipped_policy_loss(logp, batch.old_logprobs, advantages, batch.mask, cfg.clip, *norm)
        k3 = kl_estimate(logp, batch.ref_logprobs, "k3")
        kl = masked_mean(k3, batch.mask)
        loss = pg.loss
        if cfg.algorithm == "reinforce":
            loss = reinforce_loss(logp, advantages, batch.mask, *norm)
        out = {"clip_fraction": float(pg.clip_fraction), "kl": float(kl.detach()),
               "ratio_mean": float(pg.ratio_mean)}  # fmt: skip
        if cfg.algorithm != "ppo":  # GRPO's KL in the loss, aggregated like the policy term
            loss = loss + self.kl_coef * aggregate(k3, batch.mask, *norm)
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
            "finished": sum(finished(r, self.eot_id) for r in rollout.responses) / len(rollout),
        }
        for key in stats[0]:
            values = [s[key] for s in stats if math.isfinite(s[key])]
            record[key] = sum(values) / len(values) if values else float("nan")
        return record
