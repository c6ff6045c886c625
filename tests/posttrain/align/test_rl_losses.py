"""PPO/GRPO arithmetic against hand-worked examples (numbers worked out on paper, not by the code)."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.errors import KilnError
from kiln.posttrain.align.rl_losses import (
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    group_advantages,
    kl_estimate,
    ppo_token_rewards,
)


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_with_lambda_one_is_the_monte_carlo_return_minus_the_value() -> None:
    adv, ret = gae(t([0, 0, 1]), t([0.5, 0.6, 0.7]), t([1, 1, 1]).bool(), gamma=1.0, lam=1.0)
    assert torch.allclose(adv, t([0.5, 0.4, 0.3]))
    assert torch.allclose(ret, t([1.0, 1.0, 1.0]))


def test_gae_with_lambda_zero_is_the_one_step_td_error() -> None:
    adv, _ = gae(t([0, 0, 1]), t([0.5, 0.6, 0.7]), t([1, 1, 1]).bool(), gamma=1.0, lam=0.0)
    assert torch.allclose(adv, t([0.1, 0.1, 0.3]))


def test_gae_discounted() -> None:
    # δ = (0 + .9·.6 - .5, 0 + .9·.7 - .6, 1 - .7) = (.04, .03, .3); γλ = .45
    # A2 = .3, A1 = .03 + .45·.3 = .165, A0 = .04 + .45·.165 = .11425
    adv, _ = gae(t([0, 0, 1]), t([0.5, 0.6, 0.7]), t([1, 1, 1]).bool(), gamma=0.9, lam=0.5)
    assert torch.allclose(adv, t([0.11425, 0.165, 0.3]))


def test_gae_never_bootstraps_from_a_padding_position() -> None:
    # The second response ends after two tokens; the value 9 at the padding must not leak in.
    rewards = t([0, 0, 1], [0, 1, 0])
    values = t([0.5, 0.6, 0.7], [0.5, 0.6, 9.0])
    mask = t([1, 1, 1], [1, 1, 0]).bool()
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv[1], t([0.5, 0.4, 0.0])[0])
    assert ret[1, 2] == 0


def test_group_advantages_centre_and_scale_each_group() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), group_size=2)
    s = 0.5 / (math.sqrt(0.5) + 1e-4)  # unbiased std of (1, 0) is √½
    assert torch.allclose(adv, torch.tensor([s, -s, -s, s, 0.0, 0.0]), atol=1e-6)


def test_group_advantages_unscaled_and_batch_scaled() -> None:
    r = torch.tensor([3.0, 1.0, 2.0, 2.0])
    assert torch.allclose(group_advantages(r, 2, scale="none"), torch.tensor([1.0, -1, 0, 0]))
    batch_std = r.std()
    want = torch.tensor([1.0, -1, 0, 0]) / (batch_std + 1e-4)
    assert torch.allclose(group_advantages(r, 2, scale="batch"), want)


def test_group_advantages_reject_a_ragged_group() -> None:
    with pytest.raises(KilnError, match="groups of group_size 4"):
        group_advantages(torch.zeros(6), group_size=4)


def test_policy_loss_clips_a_ratio_that_would_over_reward_a_good_token() -> None:
    # ρ = 1.5, A = 2: unclipped -3, clipped -2·1.2 = -2.4; the pessimistic max is -2.4.
    lp, old = torch.tensor([[math.log(1.5)]]), torch.tensor([[0.0]])
    out = clipped_policy_loss(lp, old, torch.tensor([[2.0]]), torch.tensor([[True]]), clip=0.2)
    assert out.loss.item() == pytest.approx(-2.4)
    assert out.clip_fraction.item() == 1.0


def test_policy_loss_never_clips_a_ratio_that_punishes_a_bad_token_harder() -> None:
    # ρ = 1.5, A = -1: unclipped 1.5, clipped 1.2; the max keeps the full 1.5.
    lp, old = torch.tensor([[math.log(1.5)]]), torch.tensor([[0.0]])
    out = clipped_policy_loss(lp, old, torch.tensor([-1.0]), torch.tensor([[True]]), clip=0.2)
    assert out.loss.item() == pytest.approx(1.5)
    assert out.clip_fraction.item() == 0.0


def test_policy_loss_on_policy_is_minus_the_mean_advantage_over_real_tokens() -> None:
    lp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = clipped_policy_loss(lp, lp, adv, mask)
    assert out.loss.item() == pytest.approx(-(1 + 2 + 3 + 4) / 4)


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_error() -> None:
    # old 0, new 1, return 0.1, clip 0.2: unclipped (0.9)² = .81, clipped (0.2-0.1)² = .01
    loss, frac = clipped_value_loss(
        torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[0.1]]), torch.tensor([[1]])
    )
    assert loss.item() == pytest.approx(0.5 * 0.81)
    assert frac.item() == 0.0
    # old 0, new 1, return 2: unclipped 1, clipped (0.2-2)² = 3.24 (the clip holds the value back)
    loss, frac = clipped_value_loss(
        torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.tensor([[1]])
    )
    assert loss.item() == pytest.approx(0.5 * 3.24)
    assert frac.item() == 1.0


def test_kl_estimators() -> None:
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    k1 = math.log(2)
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(k1)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * k1 * k1)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 + k1 - 1)
    assert (kl_estimate(torch.randn(100), torch.randn(100), "k3") >= 0).all()
    with pytest.raises(KilnError, match="k1, k2 or k3"):
        kl_estimate(lp, ref, "k4")


def test_ppo_token_rewards_put_the_score_on_each_responses_last_token() -> None:
    lp = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.0, 0.0, 0.0], [0.0, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
    rewards = ppo_token_rewards(torch.tensor([5.0, 7.0]), lp, ref, mask, kl_coef=0.1)
    assert torch.allclose(rewards, torch.tensor([[-0.1, 0.0, 5.0], [0.0, -0.2 + 7.0, 0.0]]))
