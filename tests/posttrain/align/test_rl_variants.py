"""The RL switches against hand-worked numbers: loss normalisations (GRPO / DAPO / Dr. GRPO),
advantage scaling and epsilon, REINFORCE with and without a baseline, whitening, explained
variance, the adaptive KL controller; and PPO with several epochs per rollout clips."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kiln.config import ConfigError
from kiln.posttrain.align.rl import RLConfig
from kiln.posttrain.align.rl_losses import (
    AdaptiveKL,
    aggregate,
    clipped_policy_loss,
    explained_variance,
    group_advantages,
    reinforce_advantages,
    reinforce_loss,
    whiten,
)
from tests.fixtures import single_torch_thread
from tests.posttrain.align.test_rl import trainer

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# A batch of two responses: one of 1 token (loss 2), one of 3 tokens (loss 1 each).
PER_TOKEN = t([2, 0, 0], [1, 1, 1])
MASK = t([1, 0, 0], [1, 1, 1]).bool()


@pytest.mark.parametrize(
    ("norm", "expected"),
    [
        ("sequence", (2 / 1 + 3 / 3) / 2),  # each response's mean, then their mean: 1.5
        ("token", (2 + 3) / 4),  # every token alike: 1.25
        ("constant", (2 + 3) / (2 * 4)),  # over B·max_len = 2·4: 0.625
    ],
)
def test_loss_normalisations(norm: str, expected: float) -> None:
    assert float(aggregate(PER_TOKEN, MASK, norm, max_len=4)) == pytest.approx(expected)


def test_the_policy_loss_on_policy_uses_the_chosen_normalisation() -> None:
    # ratio 1 everywhere, so each token's loss is -A: response 1 has A = 1 (1 token), response
    # 2 has A = 3 (3 tokens). sequence: (-1 - 3) / 2; token: (-1 - 9) / 4; constant: -10 / 8.
    logp = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, 3.0], dtype=torch.float64)
    got = {
        n: float(clipped_policy_loss(logp, logp, adv, MASK, 0.2, n, 4).loss)
        for n in ("sequence", "token", "constant")
    }
    assert got == pytest.approx({"sequence": -2.0, "token": -2.5, "constant": -1.25})


def test_the_advantage_epsilon_and_std_scaling() -> None:
    rewards = torch.tensor([1.0, 0.0])
    # centred ±0.5; the unbiased std of (1, 0) is 1/√2; with eps 0.5: 0.5 / (1/√2 + 1/2) = √2 - 1
    scaled = group_advantages(rewards, 2, "group", eps=0.5)
    assert scaled.tolist() == pytest.approx([math.sqrt(2) - 1, 1 - math.sqrt(2)])
    assert group_advantages(rewards, 2, "group", eps=1e-8).tolist() == pytest.approx(
        [math.sqrt(0.5), -math.sqrt(0.5)]
    )
    assert group_advantages(rewards, 2, "none").tolist() == [0.5, -0.5]  # std scaling off


def test_reinforce_with_and_without_a_baseline() -> None:
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    assert reinforce_advantages(rewards, 2, "none").tolist() == [1.0, 0.0, 3.0, 1.0]
    assert reinforce_advantages(rewards, 2, "group").tolist() == [0.5, -0.5, 1.0, -1.0]
    # -A·log π per token: row 0 (A 2): 2, 4; row 1 (A -1): -0.5 (its second token is padding)
    logp = t([-1, -2], [-0.5, 0])
    mask = t([1, 1], [1, 0]).bool()
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    assert float(reinforce_loss(logp, adv, mask, "token")) == pytest.approx(5.5 / 3)
    assert float(reinforce_loss(logp, adv, mask, "sequence")) == pytest.approx((3 - 0.5) / 2)
    assert float(reinforce_loss(logp, adv, mask, "constant", 2)) == pytest.approx(5.5 / 4)


def test_whitening_over_the_masked_tokens() -> None:
    # real values 1, 2, 3: mean 2, variance 2/3; the padding stays 0
    out = whiten(t([1, 2], [3, 0]), t([1, 1], [1, 0]).bool())
    s = math.sqrt(2 / 3)
    assert out.flatten().tolist() == pytest.approx([-1 / s, 0.0, 1 / s, 0.0], abs=1e-6)


def test_explained_variance() -> None:
    returns, mask = t([1, 2, 3]), t([1, 1, 1]).bool()
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(t([2, 2, 2]), returns, mask) == pytest.approx(0.0)
    # errors (0, 0, -1): variance 2/9, against the returns' 2/3
    assert explained_variance(t([1, 2, 4]), returns, mask) == pytest.approx(2 / 3)


def test_the_adaptive_kl_controller() -> None:
    # β·(1 + clip(KL/target - 1, ±0.2)·n/horizon) with β 0.1, target 6, n 100, horizon 10,000
    for kl, expected in ((9.0, 0.1 * 1.002), (3.0, 0.1 * 0.998), (6.6, 0.1 * 1.001)):
        assert AdaptiveKL(0.1, 6.0, 10_000).update(kl, 100) == pytest.approx(expected)
    controller = AdaptiveKL(0.1, 6.0, 100)
    controller.update(12.0, 50)  # 0.1·1.1 = 0.11
    assert controller.update(0.0, 50) == pytest.approx(0.11 * 0.9)


def test_ppo_clips_only_with_several_epochs_per_rollout(tmp_path: Path) -> None:
    common = dict(algorithm="ppo", steps=2, lr=3e-2, save_every=10)
    one = trainer(tmp_path / "one", epochs=1, minibatch=0, **common).run()
    assert all(r["clip_fraction"] == 0.0 for r in one)  # one on-policy update: the ratio is 1
    many = trainer(tmp_path / "many", epochs=4, minibatch=4, **common).run()
    assert max(r["clip_fraction"] for r in many) > 0.0
    for key in ("explained_variance", "kl_coef", "value_loss"):
        assert key in many[-1]


def test_the_adaptive_kl_coefficient_moves_and_resumes(tmp_path: Path) -> None:
    common = dict(algorithm="ppo", kl_coef=0.1, kl_target=0.5, kl_horizon=400, epochs=2)
    whole = trainer(tmp_path / "whole", steps=4, **common).run()
    coefs = [r["kl_coef"] for r in whole]
    # The first rollout's policy is the reference (KL 0): e = -0.2, 16 samples, horizon 400
    assert coefs[:2] == pytest.approx([0.1, 0.1 * (1 - 0.2 * 16 / 400)])
    assert len(set(coefs)) == 4  # it moves every step
    part = trainer(tmp_path / "part", steps=2, **common)
    part.run()
    resumed = trainer(tmp_path / "part", steps=4, **common)
    assert resumed.resume()
    assert [r["kl_coef"] for r in resumed.run()] == pytest.approx(coefs[2:])


def test_ppo_without_whitening_keeps_the_raw_advantages(tmp_path: Path) -> None:
    for whiten_on in (True, False):
        tr = trainer(tmp_path / str(whiten_on), algorithm="ppo", whiten_advantages=whiten_on)
        from kiln.posttrain.align.rollout import sample_rollout

        rollout = sample_rollout(
            tr.policy, tr.reference, [tr.prompts[0]] * 4, [0] * 4, tr.reward_fn,
            max_new_tokens=4, temperature=1.0, seed=0, eot_id=tr.eot_id,
        )  # fmt: skip
        adv, _, _ = tr._advantages(rollout)
        real = adv[rollout.mask]
        if whiten_on:
            assert float(real.mean()) == pytest.approx(0.0, abs=1e-5)
            assert float(real.var(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
        else:
            assert float(real.var(unbiased=False)) != pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("loss_norm", "mean", "rl.loss_norm must be one of"),
        ("baseline", "median", "rl.baseline must be one of"),
        ("value_init", "scratch", "rl.value_init must be one of"),
        ("kl_target", -1.0, "rl.kl_target must be >= 0"),
        ("adv_eps", 0.0, "rl.adv_eps must be > 0"),
    ],
)
def test_bad_switches_are_named(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RLConfig(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"rl\.epochs must be 1 for reinforce"):
        RLConfig(algorithm="reinforce", epochs=2)


def test_reinforce_raises_the_reward(tmp_path: Path) -> None:
    records = trainer(tmp_path, algorithm="reinforce", baseline="group", lr=1e-2).run()
    first = sum(r["reward_mean"] for r in records[:3]) / 3
    last = sum(r["reward_mean"] for r in records[-3:]) / 3
    assert last > first + 0.15, [round(r["reward_mean"], 2) for r in records]


def test_the_value_model_can_start_from_the_reward_model(tmp_path: Path) -> None:
    from kiln.errors import KilnError
    from kiln.posttrain.align.reward_model import RewardModel
    from tests.posttrain.align.test_rl import policy, prompts, reward

    rm = RewardModel(policy())
    with torch.no_grad():
        rm.head.bias.fill_(0.75)
        next(rm.lm.parameters()).add_(1.0)  # a body unlike the policy's
    ids = torch.tensor([[1, 2, 3]])
    cfg = RLConfig(algorithm="ppo", value_init="reward", steps=1)
    from kiln.posttrain.align.rl import RLTrainer

    tr = RLTrainer(policy(), prompts(), reward, cfg, tmp_path, eot_id=63, value_from=rm)
    assert tr.value is not None
    assert torch.allclose(tr.value(ids), rm(ids))  # the critic's first values are the rewards
    plain = trainer(tmp_path / "plain", algorithm="ppo")
    assert plain.value is not None and not torch.allclose(plain.value(ids), rm(ids))
    with pytest.raises(KilnError, match=r"data\.reward_model"):
        RLTrainer(policy(), prompts(), reward, cfg, tmp_path / "x", eot_id=63)


def test_ppo_with_several_epochs_per_rollout_learns_faster(tmp_path: Path) -> None:
    # On the toy task, 8 steps at lr 1e-2: one on-policy pass barely moves the reward (~0.3);
    # four passes of minibatches (clipping active) reach ~0.6, and the critic explains more.
    def last3(records: list[dict]) -> float:
        return sum(r["reward_mean"] for r in records[-3:]) / 3

    common = dict(algorithm="ppo", lr=1e-2, steps=8, save_every=100)
    one = trainer(tmp_path / "one", epochs=1, minibatch=0, **common).run()
    four = trainer(tmp_path / "four", epochs=4, minibatch=4, **common).run()
    assert last3(four) > last3(one) + 0.1, (last3(one), last3(four))
    assert four[-1]["explained_variance"] > one[-1]["explained_variance"]


@pytest.mark.parametrize("unfinished", ["score", "zero"])
def test_a_response_cut_at_its_budget_scores_zero_when_asked(
    tmp_path: Path, unfinished: str
) -> None:
    from kiln.posttrain.align.rollout import finished, sample_rollout

    tr = trainer(tmp_path, unfinished=unfinished)
    rollout = sample_rollout(
        tr.policy, tr.reference, [tr.prompts[0]] * 64, [0] * 64, lambda i, r: 1.0,
        max_new_tokens=2, temperature=1.0, seed=0, eot_id=tr.eot_id,
        score_unfinished=unfinished == "score",
    )  # fmt: skip
    ended = [finished(r, tr.eot_id) for r in rollout.responses]
    assert not all(ended)  # an untrained policy of 64 tokens rarely stops within 2
    expected = [1.0 if unfinished == "score" or e else 0.0 for e in ended]
    assert rollout.rewards.tolist() == expected
    assert finished([5, tr.eot_id], tr.eot_id) and not finished([5], tr.eot_id)
    assert finished([5], None)  # nothing to end on: every response is whole


def test_a_long_prompt_gets_the_context_it_leaves(tmp_path: Path) -> None:
    from kiln.posttrain.align.rollout import sample_responses

    tr = trainer(tmp_path)
    block = tr.policy.cfg.block_size
    long_prompt = [20] * (block - 3)
    out = sample_responses(tr.policy, [long_prompt, tr.prompts[0]], 6, 1.0, 0, None)
    assert len(out[0]) == 3 and len(out[1]) == 6  # no stop token: each runs to its budget


def test_unfinished_must_be_known() -> None:
    with pytest.raises(ConfigError, match=r"rl\.unfinished must be one of"):
        RLConfig(unfinished="mask")
