"""The reward model learns a planted preference and generalises it to held-out pairs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kiln.checkpoint_format import latest_checkpoint
from kiln.model import ModelConfig
from kiln.model.transformer import Transformer
from kiln.posttrain.align.reward_model import (
    RewardConfig,
    RewardModel,
    RewardTrainer,
    bradley_terry_loss,
    load_reward_model,
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


def trainer(out: Path, steps: int = 60) -> RewardTrainer:
    torch.manual_seed(0)
    rm = RewardModel(Transformer(ModelConfig.preset("tiny", vocab_size=64, block_size=32)))
    cfg = RewardConfig(steps=steps, pairs_per_step=32, lr=3e-3, eval_every=20, save_every=20)
    return RewardTrainer(rm, pairs(256, seed=1), cfg, out, held_out=pairs(128, seed=2))


def test_a_planted_signal_is_learned_and_holds_on_held_out_pairs(tmp_path: Path) -> None:
    t = trainer(tmp_path)
    before = t.evaluate(t.held_out)["accuracy"]
    after = t.run()[-1]["val_accuracy"]
    assert before < 0.75  # a random head has no reason to prefer the mark
    assert after > 0.9, f"held-out pairwise accuracy {after:.2f} after training"
    loaded = load_reward_model(latest_checkpoint(t.run_dir.checkpoints))
    chosen = [c for c, _ in t.held_out[:8]]
    with torch.no_grad():
        torch.testing.assert_close(
            score_sequences(loaded, chosen), score_sequences(t.reward_model.eval(), chosen)
        )


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    whole = trainer(tmp_path / "whole", steps=6)
    whole.run()
    trainer(tmp_path / "cut", steps=3).run()
    again = trainer(tmp_path / "cut", steps=6)
    assert again.resume() and again.step == 3
    again.run()
    for a, b in zip(whole.reward_model.parameters(), again.reward_model.parameters(), strict=True):
        assert torch.equal(a, b)


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
