"""The trainer against an independent, hand-written torch loop and against kiln.eval.

Tests that compare kiln's trainer with itself (resume == uninterrupted) cannot see a schedule
that is never applied, clipping that is off or micro-step losses that are summed: both runs are
wrong alike. These compare it with the textbook loop, written out here from the config.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kiln.eval.scoring import Scorer
from kiln.train.optim import OptimizerSet
from kiln.train.trainer import Trainer

from .conftest import MakeConfig

# Every config here sets its dtype: the default may become "auto" (bf16 where it is fast).
FP32 = ("train.dtype=fp32", "train.device=cpu", "logging.every=1")


class _Recorder(nn.Module):
    """The model, recording every (inputs, targets) micro-batch it is called with."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.batches.append((x.clone(), y.clone()))
        return self.model(x, y)


def _hand_lr(step: int, peak: float, warmup: int, max_steps: int, floor: float) -> float:
    """warmup_cosine written out: (s+1)/W during warmup, then a half cosine down to the floor."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - 1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _hand_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups by the usual rule: decay 2-D matrices, not embeddings, norms or biases."""
    embeddings = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    decay, no_decay = [], []
    for p in model.parameters():  # a tied head is the embedding's Parameter, listed once
        (no_decay if p.dim() < 2 or id(p) in embeddings else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _train_and_record(
    cfg: Any,
) -> tuple[Trainer, nn.Module, list[dict[str, torch.Tensor]], _Recorder]:
    """Run the trainer; return it, its initial model, the weights after each step, the batches."""
    trainer = Trainer(cfg, cfg.logging.run_dir)
    initial = copy.deepcopy(trainer.model)
    recorder = _Recorder(trainer.train_model)
    trainer.train_model = recorder
    weights: list[dict[str, torch.Tensor]] = []

    def snapshot(t: Trainer, step: int, loss: float) -> None:
        weights.append({k: v.detach().clone() for k, v in t.model.state_dict().items()})

    trainer.on_step = snapshot
    trainer.run()
    return trainer, initial, weights, recorder


def _records(run_dir: str) -> list[dict[str, Any]]:

    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.kernels
def test_trainer_equals_a_hand_written_loop(make_config: MakeConfig) -> None:
    """5 steps, 2 micro-steps each: weights, lr and gradient norm equal the textbook loop's."""
    steps, warmup, peak, floor, clip = 5, 2, 3e-3, 0.1, 0.5
    cfg = make_config(
        *FP32, f"train.max_steps={steps}", f"schedule.warmup_steps={warmup}",
        f"optim.lr={peak}", f"schedule.min_lr_ratio={floor}", f"train.grad_clip={clip}",
        "schedule.name=warmup_cosine", "optim.name=adamw", "optim.weight_decay=0.1",
        "model.dropout=0.0", "eval.batches=0", "checkpoint.every=0",
    )  # fmt: skip
    _, model, weights, recorder = _train_and_record(cfg)
    records = _records(cfg.logging.run_dir)
    accum = 2
    assert len(recorder.batches) == steps * accum and len(weights) == steps

    groups = _hand_groups(model, 0.1)
    # kiln's default on the CPU is the fused AdamW kernel: the same update rule, one kernel.
    opt = torch.optim.AdamW(groups, lr=peak, betas=(0.9, 0.95), eps=1e-8, fused=True)
    clipped = 0
    for step in range(steps):
        lr = _hand_lr(step, peak, warmup, steps, floor)
        for g in opt.param_groups:
            g["lr"] = lr
        losses = []
        for x, y in recorder.batches[step * accum : (step + 1) * accum]:
            loss = model(x, y)
            (loss / accum).backward()  # the gradient of the mean over micro-steps
            losses.append(loss.item())
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        clipped += norm > clip
        opt.step()
        opt.zero_grad(set_to_none=True)

        record = records[step]
        assert record["step"] == step + 1
        assert math.isclose(record["lr"], lr, rel_tol=1e-12), (step, record["lr"], lr)
        assert math.isclose(record["grad_norm"], norm, rel_tol=1e-5), (
            step,
            record["grad_norm"],
            norm,
        )
        assert math.isclose(record["loss"], sum(losses) / accum, rel_tol=1e-5), step
        for name, value in model.state_dict().items():
            torch.testing.assert_close(
                weights[step][name], value, rtol=1e-5, atol=1e-6, msg=f"step {step + 1}: {name}"
            )
    assert clipped > 0  # the clipping threshold was reached (else clipping went untested)


def test_clipping_hands_the_optimizer_a_clipped_gradient(make_config: MakeConfig) -> None:
    """A step whose gradient norm is above train.grad_clip updates with a norm-clip gradient."""
    clip = 0.05
    cfg = make_config(
        *FP32,
        "train.max_steps=2",
        f"train.grad_clip={clip}",
        "eval.batches=0",
        "checkpoint.every=0",
    )
    trainer = Trainer(cfg, cfg.logging.run_dir)
    seen: list[float] = []
    step = trainer.optimizer.step

    def measured_step() -> None:
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        seen.append(
            float(
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            )
        )
        step()

    trainer.optimizer.step = measured_step  # type: ignore[method-assign]
    trainer.run()
    norms = [r["grad_norm"] for r in _records(cfg.logging.run_dir)]
    assert len(seen) == 2 and all(n > 2 * clip for n in norms)  # the reported norm: before clipping
    assert all(math.isclose(s, clip, rel_tol=1e-4) for s in seen), seen


def _run_recording_grads(
    cfg: Any, sgd_lr: float | None = None
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run the trainer: the gradients it hands the optimizer each step, initial, final weights.

    With `sgd_lr` the optimizer is plain SGD (no momentum): an update linear in the gradient.
    """
    trainer = Trainer(cfg, cfg.logging.run_dir)
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    if sgd_lr is not None:
        params = list(trainer.model.parameters())
        group = {"params": params, "peak_lr": sgd_lr}  # set_lr scales peak_lr by the schedule
        trainer.optimizer = OptimizerSet([torch.optim.SGD([group], lr=sgd_lr)])
    grads: list[dict[str, torch.Tensor]] = []
    step = trainer.optimizer.step

    def recording_step() -> None:
        named = trainer.model.named_parameters()
        grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})
        step()

    trainer.optimizer.step = recording_step  # type: ignore[method-assign]
    trainer.run()
    final = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return grads, initial, final


# Accumulation vs one big batch is a numerical equivalence, not a bitwise one: the matmuls see
# other shapes and sum in another order. Tolerances from the measured noise floor (fp32, this
# config, 3 steps; 2 × 4, 4 × 2 and 8 × 1 windows vs 1 × 8, torch threads 1 and 2, under each
# cell of `make test-kernels` and MKL_DEBUG_CPU_TYPE=5 / MKL_ENABLE_INSTRUCTIONS=AVX512):
#   step-1 gradients: max |Δg| ≤ 6.0e-7 × the tensor's max |g|     -> 1e-5 × max |g| (16×)
#   losses, grad norms (SGD, all steps): rel ≤ 1.7e-7, ≤ 1.1e-7      -> rel 1e-5 (60×)
#   weights after 3 SGD steps at lr 0.1: max |Δw| ≤ 6.0e-8 (moved 2.1e-2) -> atol 1e-6 (16×)
# Weights after AdamW are not compared: at step 1 its update is lr·g/(|g|+eps), so an element
# whose |g| is below the rounding noise moves by ±lr with the noise's sign (measured: up to
# up to 1.4e-5 apart here, 4 × 2 split under MKL_CBWR=COMPATIBLE; on Intel AVX-512 MKL kernels
# the 2 × 4 split went beyond the old 1e-5).
# The gradients before any update and an update linear in them carry the test's intent.
GRAD_REL_TO_MAX = 1e-5
RECORD_REL = 1e-5
SGD_WEIGHT_ATOL = 1e-6


@pytest.mark.kernels
def test_accumulating_two_micro_batches_of_4_equals_one_of_8(make_config: MakeConfig) -> None:
    """The same 256-token steps as 2 × 4 windows or 1 × 8: equal gradients, losses, norms and
    (under an update linear in the gradient) weights."""
    common = (
        *FP32,
        "train.max_steps=3",
        "model.dropout=0.0",
        "eval.batches=0",
        "checkpoint.every=0",
    )
    runs = {}
    for optimizer, sgd_lr in (("adamw", None), ("sgd", 0.1)):
        for micro in (4, 8):
            cfg = make_config(*common, f"batch.micro_batch={micro}", run=f"{optimizer}{micro}")
            grads, initial, final = _run_recording_grads(cfg, sgd_lr)
            runs[optimizer, micro] = grads, initial, final, _records(cfg.logging.run_dir)

    # AdamW, step 1: the same weights, so the gradients differ only by the accumulation.
    two, one = runs["adamw", 4][0][0], runs["adamw", 8][0][0]
    assert two.keys() == one.keys()
    for name, g in one.items():
        atol = GRAD_REL_TO_MAX * float(g.abs().max())
        torch.testing.assert_close(two[name], g, rtol=GRAD_REL_TO_MAX, atol=atol, msg=name)
    for optimizer in ("adamw", "sgd"):
        ra, rb = runs[optimizer, 4][3], runs[optimizer, 8][3]
        steps = len(ra) if optimizer == "sgd" else 1  # AdamW's later steps: see above
        for x, y in zip(ra[:steps], rb[:steps], strict=True):
            assert math.isclose(x["loss"], y["loss"], rel_tol=RECORD_REL), (optimizer, x, y)
            assert math.isclose(x["grad_norm"], y["grad_norm"], rel_tol=RECORD_REL), (x, y)
    _, initial, wa, _ = runs["sgd", 4]
    wb = runs["sgd", 8][2]
    moved = max(float((wb[k] - initial[k]).abs().max()) for k in wb)
    assert moved > 1000 * SGD_WEIGHT_ATOL  # the weights moved far beyond the tolerance
    for name in wb:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=SGD_WEIGHT_ATOL, msg=name)


def test_val_loss_equals_kiln_eval_on_the_same_windows(make_config: MakeConfig) -> None:
    """Trained with dropout; the val loss is the dropout-free mean over windows, as kiln.eval
    scores them, also when the passes hold different numbers of windows (as across ranks)."""
    cfg = make_config(
        *FP32,
        "train.max_steps=2",
        "model.dropout=0.3",
        "eval.every=0",
        "eval.batches=3",
        "checkpoint.every=0",
    )
    trainer = Trainer(cfg, cfg.logging.run_dir)
    result = trainer.run()
    x = torch.cat([b[0] for b in trainer.val_batches])  # (N, T)
    y = torch.cat([b[1] for b in trainer.val_batches])  # (N, T)
    assert len(x) == trainer.val_windows == 3 * 4
    windows = [(torch.cat([xi, yi[-1:]]).tolist(), len(xi)) for xi, yi in zip(x, y, strict=True)]
    scored = Scorer(copy.deepcopy(trainer.model), progress=False).score_windows(windows)
    expected = -sum(s.logprob for s in scored) / sum(s.n_tokens for s in scored)
    assert result.val_loss is not None
    assert math.isclose(result.val_loss, expected, rel_tol=1e-5), (result.val_loss, expected)
    assert trainer.model.training  # back in training mode after the eval
    # Uneven passes (3 windows, then 9): still the mean over windows, not over passes.
    trainer.val_batches = [(x[:3], y[:3], 3), (x[3:], y[3:], 9)]
    value = trainer.evaluate()
    assert value is not None and math.isclose(value, expected, rel_tol=1e-5), (value, expected)


def test_bf16_val_loss_equals_kiln_eval_under_the_same_autocast(make_config: MakeConfig) -> None:
    """With train.dtype = bf16 the trainer evaluates under autocast with fp32 weights; kiln eval
    (Scorer with the loaded model's autocast dtype) scores the same windows the same way."""
    cfg = make_config(
        "train.dtype=bf16", "train.max_steps=1", "eval.every=0", "eval.batches=2",
        "checkpoint.every=0",
    )  # fmt: skip
    trainer = Trainer(cfg, cfg.logging.run_dir)
    result = trainer.run()
    x = torch.cat([b[0] for b in trainer.val_batches])  # (N, T)
    y = torch.cat([b[1] for b in trainer.val_batches])  # (N, T)
    windows = [(torch.cat([xi, yi[-1:]]).tolist(), len(xi)) for xi, yi in zip(x, y, strict=True)]
    model = copy.deepcopy(trainer.model)
    bf16 = Scorer(model, progress=False, autocast_dtype=torch.bfloat16).score_windows(windows)
    fp32 = Scorer(model, progress=False).score_windows(windows)

    def mean(scored: list) -> float:
        return -sum(s.logprob for s in scored) / sum(s.n_tokens for s in scored)

    assert result.val_loss is not None
    assert math.isclose(result.val_loss, mean(bf16), rel_tol=1e-4), (result.val_loss, mean(bf16))
    assert mean(fp32) != mean(bf16)  # the autocast really ran: fp32 scores differ
