"""Rollouts for RL: sample responses to prompts, then score them under the policy and reference.

A rollout is a pure function of (policy weights, prompts, seed): the sampling generator is seeded
from the run seed and the step, so a resumed run draws exactly the responses an uninterrupted one
would have, whatever the process's global RNG did in between.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kiln.config import ConfigError
from kiln.errors import KilnError
from kiln.model.generate import generate
from kiln.model.transformer import Transformer
from kiln.posttrain.align.logprobs import token_entropy, token_logprobs
from kiln.serve.engine import Engine, EngineConfig, SamplingParams, check_servable

# (prompt index, response ids) -> scalar reward; the task checks and reward models both fit it.
RewardFn = Callable[[int, list[int]], float]


@dataclass
class Rollout:
    """N sampled responses, right-padded with their prompts into one batch."""

    ids: Tensor  # (N, T) prompt + response + padding
    mask: Tensor  # (N, T-1) bool: target position t+1 is a response token
    prompt_index: list[int]  # (N,) which prompt each row answers
    responses: list[list[int]]  # the sampled response ids (end-of-text included when sampled)
    rewards: Tensor  # (N,)
    old_logprobs: Tensor  # (N, T-1) under the sampling policy (zero outside the mask)
    ref_logprobs: Tensor  # (N, T-1) under the frozen reference

    def __len__(self) -> int:
        return self.ids.size(0)

    def rows(self, index: Tensor) -> Rollout:
        """The sub-rollout of some rows (a minibatch)."""
        picked = index.tolist()
        return Rollout(
            ids=self.ids[index], mask=self.mask[index],
            prompt_index=[self.prompt_index[i] for i in picked],
            responses=[self.responses[i] for i in picked], rewards=self.rewards[index],
            old_logprobs=self.old_logprobs[index], ref_logprobs=self.ref_logprobs[index],
        )  # fmt: skip


def sequence_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int = 0
) -> tuple[Tensor, Tensor]:
    """Right-padded ids (N, T) of prompt+response and the response-target mask (N, T-1)."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width - 1, dtype=torch.bool)
    for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[row, : len(p) + len(r)] = torch.tensor([*p, *r], dtype=torch.long)
        mask[row, len(p) - 1 : len(p) + len(r) - 1] = True  # targets that are response tokens
    return ids, mask


def policy_logprobs(
    model: Transformer, ids: Tensor, mask: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs and entropies (N, T-1) of ids' next tokens, zero outside the mask.

    Logits are divided by the sampling temperature, so the log-probs are those of the
    distribution the responses were actually drawn from.
    """
    logits = model(ids)[:, :-1] / temperature  # (N, T-1, V)
    logp = token_logprobs(logits, ids[:, 1:]) * mask
    return logp, token_entropy(logits) * mask


def engine_sample(
    policy: Transformer,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    eot_id: int | None,
) -> list[list[tuple[list[int], str]]] | None:
    """Each prompt's `n` samples (ids, finish reason), all batched on the inference engine.

    None when the engine refuses the model (check_servable; today it serves every architecture
    kiln.model builds): the caller then falls back to kiln.model.generate's fixed batch. Each sample draws from its own seeded
    generator, so the batch-invariant tiles are not needed and are off (they cost several times
    the decode time).
    """
    try:
        check_servable(policy.cfg)
    except ConfigError:
        return None
    bs = EngineConfig.block_size
    rows = [(len(p), sp) for p, sp in zip(prompts, params, strict=True)]
    blocks = sum(sp.n * -(-(n + sp.max_tokens) // bs) + 1 for n, sp in rows)
    engine = Engine(policy, None, EngineConfig(
        num_blocks=blocks, max_num_seqs=sum(sp.n for sp in params), prefix_caching=False,
        batch_invariant=False,
    ), eot_id=eot_id)  # fmt: skip
    out = []
    for samples in engine.generate(list(prompts), list(params)):
        for done in samples:
            if done.finish_reason == "error":
                raise KilnError(f"sampling failed: {done.error}")
        out.append([(list(done.token_ids), done.finish_reason) for done in samples])
    return out


def sample_responses(
    policy: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eot_id: int | None,
) -> list[list[int]]:
    """One sampled response per prompt, on the inference engine; row i draws from seed + i.

    Each response may use up to `max_new_tokens`, or the context its prompt leaves when that is
    less (a long prompt gets a shorter budget instead of being cut). A response that ended on the
    stop token keeps it, so the policy is credited for where it stopped. Each row has its own
    generator and the batch is the same on a resumed run, so the responses are a pure function of
    (weights, prompts, seed).
    """
    stops = () if eot_id is None else (eot_id,)
    block = policy.cfg.block_size
    budgets = [max(1, min(max_new_tokens, block - len(p))) for p in prompts]
    params = [SamplingParams(max_tokens=budget, temperature=temperature, seed=seed + i,
                             stop_token_ids=stops, ignore_eos=True)
              for i, budget in enumerate(budgets)]  # fmt: skip
    sampled = engine_sample(policy, prompts, params, eot_id)
    if sampled is None:  # MLA or sinks: the fixed batch of kiln.model.generate
        cap = min(budgets)
        new = generate(policy, prompts, cap, temperature=temperature, seed=seed,
                       stop_tokens=list(stops))  # fmt: skip
        return [[*r, eot_id] if eot_id is not None and len(r) < cap else r for r in new]
    ended = eot_id is not None
    return [[*ids, eot_id] if ended and why == "stop" else ids for ((ids, why),) in sampled]


def finished(response: Sequence[int], eot_id: int | None) -> bool:
    """Whether a sampled response ended on the stop token (True when there is none to end on)."""
    return eot_id is None or (len(response) > 0 and response[-1] == eot_id)


@torch.no_grad()
def sample_rollout(
    policy: Transformer,
    reference: Transformer,
    prompts: Sequence[Sequence[int]],
    prompt_index: Sequence[int],
    reward_fn: RewardFn,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eot_id: int | None,
    score_unfinished: bool = True,
) -> Rollout:
    """Sample one response per prompt row, reward it, and score it under both models.

    With `score_unfinished` False, a response cut at its length budget (no stop token) gets
    reward 0 instead of its reward function's: a check of a cut story rewards the part written
    (a story "of about K sentences" cut near K, a happier story cut before its happy ending),
    and nothing would teach the policy to finish.
    """
    was_training = policy.training
    policy.eval()
    responses = sample_responses(policy, prompts, max_new_tokens, temperature, seed, eot_id)
    ids, mask = sequence_batch(prompts, responses)
    device = next(policy.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    old, _ = policy_logprobs(policy, ids, mask, temperature)
    ref, _ = policy_logprobs(reference, ids, mask, temperature)
    rewards = torch.tensor(
        [
            float(reward_fn(i, r)) if score_unfinished or finished(r, eot_id) else 0.0
            for i, r in zip(prompt_index, responses, strict=True)
        ],
        device=device,
    )
    policy.train(was_training)
    return Rollout(ids, mask, list(prompt_index), responses, rewards, old, ref)
