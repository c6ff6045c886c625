"""The DPO trainer learns a planted preference that holds on held-out pairs; resume is exact."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kiln.config import ConfigError
from kiln.model import ModelConfig
from kiln.model.transformer import Transformer
from kiln.posttrain.align.dpo import DPOConfig, DPOTrainer, TokenPair
from tests.fixtures import single_torch_thread

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)

V = 64


def pairs(n: int, seed: int) -> list[TokenPair]:
    """Chosen replies are made of tokens 10-19, rejected ones of 20-29 (the planted preference)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(30, 60) for _ in range(rng.randrange(2, 5))]
        chosen = [rng.randrange(10, 20) for _ in range(rng.randrange(2, 6))]
        rejected = [rng.randrange(20, 30) for _ in range(rng.randrange(2, 6))]
        out.append(TokenPair(prompt, chosen, rejected))
    return out


def trainer(out: Path, steps: int = 20) -> DPOTrainer:
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", vocab_size=V, vocab_multiple=1, block_size=32))
    cfg = DPOConfig(beta=0.5, steps=steps, pairs_per_step=8, lr=3e-3, warmup_steps=2,
                    eval_every=5, save_every=3, seed=1)  # fmt: skip
    return DPOTrainer(policy, pairs(64, seed=1), cfg, out, held_out=pairs(32, seed=2))


def test_held_out_preference_accuracy_rises(tmp_path: Path) -> None:
    t = trainer(tmp_path)
    before = t.evaluate(t.held_out)
    assert before["margin"] == pytest.approx(0.0, abs=1e-5)  # policy == reference at the start
    records = t.run()
    after = records[-1]
    assert after["val_accuracy"] > 0.9, after
    assert after["val_margin"] > 0.5 and after["val_loss"] < before["loss"]
    for key in ("loss", "margin", "accuracy", "chosen_reward", "rejected_reward", "lr"):
        assert key in after


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    whole = trainer(tmp_path / "whole", steps=6)
    whole.run()
    cut = trainer(tmp_path / "cut", steps=3)
    cut.run()
    torch.manual_seed(999)
    again = trainer(tmp_path / "cut", steps=6)
    assert again.resume() and again.step == 3
    again.run()

    def train_only(records: list[dict]) -> list[dict]:  # the cut run also evaluated at its end
        return [{k: v for k, v in r.items() if not k.startswith("val_")} for r in records]

    assert train_only(whole.metrics.read()) == train_only(again.metrics.read())
    for a, b in zip(whole.policy.parameters(), again.policy.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("beta", 0.0, "dpo.beta must be > 0"), ("loss_type", "kto", "dpo.loss_type must be one of"),
     ("pairs_per_step", 0, "dpo.pairs_per_step must be >= 1")],
)  # fmt: skip
def test_bad_settings_are_named(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DPOConfig(**{field: value})  # type: ignore[arg-type]
