"""GRPO and PPO on a toy task: the reward rises, the logs say what happened, resume is exact."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kiln.checkpoint_format import latest_checkpoint
from kiln.config import ConfigError
from kiln.model import ModelConfig
from kiln.model.transformer import Transformer
from kiln.posttrain.align.rl import RLConfig, RLTrainer
from tests.fixtures import single_torch_thread

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)

V, EOT = 64, 63
GOOD = set(range(16))  # the toy task: a response scores the share of its tokens below 16


def reward(_prompt: int, response: list[int]) -> float:
    body = [t for t in response if t != EOT]
    return sum(t in GOOD for t in body) / max(1, len(body))


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(16, 60) for _ in range(rng.randrange(2, 5))] for _ in range(16)]


def policy() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.preset("tiny", vocab_size=V, vocab_multiple=1, block_size=32))


def trainer(tmp: Path, **overrides: object) -> RLTrainer:
    settings = dict(steps=12, prompts_per_step=4, group_size=4, max_new_tokens=6, lr=3e-3,
                    kl_coef=0.0, save_every=2, seed=3)  # fmt: skip
    cfg = RLConfig(**{**settings, **overrides})  # type: ignore[arg-type]
    return RLTrainer(policy(), prompts(), reward, cfg, tmp, eot_id=EOT)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_reward_rises(tmp_path: Path, algorithm: str) -> None:
    records = trainer(tmp_path, algorithm=algorithm, lr=3e-2 if algorithm == "ppo" else 1e-2).run()
    first = sum(r["reward_mean"] for r in records[:3]) / 3
    last = sum(r["reward_mean"] for r in records[-3:]) / 3
    assert last > first + 0.15, [round(r["reward_mean"], 2) for r in records]
    for key in ("reward_std", "kl", "clip_fraction", "entropy", "response_length", "loss"):
        assert key in records[-1]
    if algorithm == "ppo":
        assert "value_loss" in records[-1]


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_resume_equals_uninterrupted(tmp_path: Path, algorithm: str) -> None:
    whole = trainer(tmp_path / "whole", algorithm=algorithm, steps=4, epochs=2, minibatch=8)
    whole.run()
    first = trainer(tmp_path / "cut", algorithm=algorithm, steps=2, epochs=2, minibatch=8)
    first.run()
    torch.manual_seed(12345)  # whatever the process did in between
    again = trainer(tmp_path / "cut", algorithm=algorithm, steps=4, epochs=2, minibatch=8)
    assert again.resume() and again.step == 2
    again.run()
    assert whole.metrics.read() == again.metrics.read()
    for a, b in zip(whole.policy.state_dict().values(), again.policy.state_dict().values(),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)


def test_an_rl_checkpoint_holds_the_policy_where_loaders_look(tmp_path: Path) -> None:
    t = trainer(tmp_path, algorithm="ppo", steps=2)
    t.run()
    ckpt = latest_checkpoint(t.run_dir.checkpoints)
    assert ckpt is not None
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "value.safetensors").is_file()


def test_kl_to_the_reference_is_zero_before_the_first_update(tmp_path: Path) -> None:
    record = trainer(tmp_path, steps=1, kl_coef=0.1).train_step()
    assert record["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at the first pass
    assert record["clip_fraction"] == 0.0  # on-policy: every ratio is exactly 1


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("algorithm", "a2c", "rl.algorithm must be grpo, ppo or reinforce"),
     ("group_size", 1, "rl.group_size must be >= 2 for grpo"),
     ("temperature", 0.0, "rl.temperature must be > 0")],
)  # fmt: skip
def test_bad_settings_are_named(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RLConfig(**{field: value})  # type: ignore[arg-type]


def test_a_policy_the_engine_cannot_page_rolls_out_on_the_fixed_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=V, vocab_multiple=1, block_size=32,
                             mla={"kv_rank": 16, "rope_dim": 8})  # fmt: skip
    t = RLTrainer(Transformer(cfg), prompts(), reward, RLConfig(steps=1, max_new_tokens=4),
                  tmp_path, eot_id=EOT)  # fmt: skip
    record = t.train_step()
    assert record["response_length"] > 0 and record["kl"] == pytest.approx(0.0, abs=1e-6)
