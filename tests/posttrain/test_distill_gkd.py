"""On-policy distillation (GKD): the draws repeat with the seed, the student's samples are what
the loss reads, the loss is the KL over the sampled tokens by hand, and a run resumes exactly."""

# ruff: noqa: F811

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kiln.config import ConfigError
from kiln.errors import KilnError
from kiln.model import ModelConfig
from kiln.model.transformer import Transformer
from kiln.posttrain import distill_gkd as gkd
from kiln.posttrain.distill import DistillSection, DistillStep, build_trainer
from kiln.train.trainer import Trainer

# the dataset and teacher fixtures are test_distill's (imported, so F401/F811 are expected)
from tests.posttrain.test_distill import _config, _hand_kl, dataset, teacher  # noqa: F401

V = 11


def _tiny(seed: int) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("tiny", vocab_size=V, n_layer=1, n_embd=16, head_dim=8,
                             block_size=16, vocab_multiple=1)  # fmt: skip
    return Transformer(cfg).eval()


def test_the_on_policy_draws_follow_lambda_and_the_seed() -> None:
    picks = [gkd.draws(0, m, 0.25)[0] for m in range(800)]
    assert 0.2 < sum(picks) / 800 < 0.3
    assert picks == [gkd.draws(0, m, 0.25)[0] for m in range(800)]  # repeatable
    assert picks != [gkd.draws(1, m, 0.25)[0] for m in range(800)]  # the seed matters
    assert not any(gkd.draws(0, m, 0.0)[0] for m in range(100))
    assert all(gkd.draws(0, m, 1.0)[0] for m in range(100))


def test_generated_targets_count_only_the_sampled_tokens() -> None:
    seq = torch.tensor([[5, 6, 7, 8, 9]])
    assert gkd.generated_targets(seq, 3).tolist() == [
        [-1, -1, 8, 9, -1]
    ]  # position 2 predicts 8, …


def test_an_on_policy_batch_is_the_kl_on_the_students_samples_by_hand() -> None:
    student, teacher = _tiny(0), _tiny(1)
    section = DistillSection(teacher="t", on_policy=1.0, gen_tokens=3, temperature=1.5)
    x = torch.tensor([[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]])
    y = torch.zeros_like(x)
    step = DistillStep(student, teacher, section, seed=7, micro=4)
    loss = step(x, y)
    seq = step.last_sequence
    assert seq is not None and seq.shape == (2, 6)
    assert torch.equal(seq[:, :3], x[:, :3])  # the prompt is kept, the rest is the student's
    again = DistillStep(student, teacher, section, seed=7, micro=4)
    assert again(x, y).item() == loss.item() and torch.equal(again.last_sequence, seq)
    other = [DistillStep(student, teacher, section, seed=s, micro=4) for s in range(1, 6)]
    for o in other:
        o(x, y)
    assert any(not torch.equal(o.last_sequence, seq) for o in other)  # sampled, not fixed
    # by hand: the KL at the positions that predict tokens 3, 4, 5 (positions 2, 3, 4)
    with torch.no_grad():
        s_logits, t_logits = student(seq), teacher(seq)
    terms = [
        _hand_kl(t_logits[b, t].tolist(), s_logits[b, t].tolist(), 1.5)
        for b in range(2)
        for t in (2, 3, 4)
    ]
    # abs: the step's fp32 logits come from another batch shape than these (another GEMM
    # kernel, ~1e-7 apart per log-prob), and the KL is a small difference of such terms
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5, abs=5e-7)
    assert math.isfinite(loss.item()) and loss.requires_grad


def test_greedy_sampling_continues_with_the_argmax() -> None:
    student = _tiny(0)
    prompt = torch.tensor([[1, 2, 3]])
    seq = gkd.sample_continuation(student, prompt, 2, 0.0, V, seed=0)
    with torch.no_grad():
        first = student(prompt)[0, -1].argmax()
    assert seq[0, 3] == first and seq.shape == (1, 5)


def test_on_policy_needs_a_kl_and_a_prompt(teacher: Path, dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"on_policy > 0 needs distill\.kl_weight > 0"):
        DistillSection(teacher="t", on_policy=0.5, kl_weight=0, ce_weight=1)
    with pytest.raises(ConfigError, match=r"distill.on_policy must be in \[0, 1\]"):
        DistillSection(teacher="t", on_policy=1.5)
    run = tmp_path / "run"
    with pytest.raises(KilnError, match=r"distill.gen_tokens \(32\) must be < data.seq_len"):
        build_trainer(_config(teacher, dataset, run, "distill.on_policy=0.5",
                              "distill.gen_tokens=32"), run)  # fmt: skip


def test_a_gkd_run_resumes_bit_for_bit(teacher: Path, dataset: Path, tmp_path: Path) -> None:
    gkd_sets = ["distill.on_policy=0.5", "distill.gen_tokens=8", "distill.loss=reverse_kl"]
    straight_run, cut_run = tmp_path / "straight", tmp_path / "cut"
    straight = build_trainer(_config(teacher, dataset, straight_run, *gkd_sets), straight_run)
    uninterrupted = straight.run()
    assert straight.train_model.micro == 12  # 6 steps × 2 micro-steps, every one drawn

    def stop(trainer: Trainer, step: int, loss: float) -> None:
        if step == 2:
            trainer.request_stop()

    cfg = _config(teacher, dataset, cut_run, *gkd_sets)
    first = build_trainer(cfg, cut_run, on_step=stop).run()
    resumed = build_trainer(cfg, cut_run, resume=True)
    assert resumed.train_model.micro == 4
    second = resumed.run()
    assert first.losses + second.losses == uninterrupted.losses
    plain = build_trainer(_config(teacher, dataset, tmp_path / "plain"), tmp_path / "plain").run()
    assert plain.losses != uninterrupted.losses  # the switch changes the training
