"""The reward model learns a planted preference and generalises it to held-out pairs."""

from __future__ import annotations

import random

import pytest
import torch

from kiln.model import ModelConfig
from kiln.model.transformer import Transformer
from kiln.posttrain.reward_model import (
    RewardModel,
    bradley_terry_loss,
    pairwise_accuracy,
    score_sequences,
)
from tests.fixtures import single_torch_thread

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)

MARK = 7  # the planted signal: a chosen response contains this token, a rejected one never does


def pairs(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(10, 60) for _ in range(rng.randrange(2, 6))]
        length = rng.randrange(3, 9)
        rejected = [rng.randrange(10, 60) for _ in range(length)]
        chosen = [rng.randrange(10, 60) for _ in range(length)]
        chosen[rng.randrange(length)] = MARK
        out.append((prompt + chosen, prompt + rejected))
    return out


def test_a_planted_signal_is_learned_and_holds_on_held_out_pairs() -> None:
    torch.manual_seed(0)
    rm = RewardModel(Transformer(ModelConfig.preset("tiny", vocab_size=64, block_size=32)))
    train, held_out = pairs(256, seed=1), pairs(128, seed=2)
    chosen, rejected = zip(*held_out, strict=True)
    with torch.no_grad():
        before = pairwise_accuracy(score_sequences(rm, chosen), score_sequences(rm, rejected))
    opt = torch.optim.AdamW(rm.parameters(), lr=3e-3)
    rm.train()
    for step in range(60):
        batch = train[(step * 32) % 256 :][:32]
        c, r = zip(*batch, strict=True)
        loss = bradley_terry_loss(score_sequences(rm, c), score_sequences(rm, r))
        opt.zero_grad()
        loss.backward()
        opt.step()
    rm.eval()
    with torch.no_grad():
        after = pairwise_accuracy(score_sequences(rm, chosen), score_sequences(rm, rejected))
    assert before < 0.75  # a random head has no reason to prefer the mark
    assert after > 0.9, f"held-out pairwise accuracy {after:.2f} after training"


def test_score_reads_the_last_real_token_whatever_the_padding() -> None:
    torch.manual_seed(0)
    rm = RewardModel(Transformer(ModelConfig.preset("tiny", vocab_size=64, block_size=32))).eval()
    seq = [11, 12, 13, 14]
    alone = score_sequences(rm, [seq])
    padded = score_sequences(rm, [seq, [*seq, 20, 21, 22, 23, 24]])
    torch.testing.assert_close(padded[0], alone[0])


def test_bradley_terry_is_log_two_when_the_rewards_tie() -> None:
    assert bradley_terry_loss(torch.zeros(3), torch.zeros(3)).item() == pytest.approx(
        0.693147, 1e-5
    )
    assert pairwise_accuracy(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])) == 0.75
