"""`kiln distill`: the KL arithmetic by hand, exact resume, the teacher's tokenizer checked, the
student actually pulled towards the teacher, and the run loading like any run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.cli import main
from kiln.errors import KilnError
from kiln.loading import load_model
from kiln.model.loss import distill_loss
from kiln.posttrain.distill import DistillConfig, build_trainer, load_distill_config
from kiln.train.config import load_train_config
from kiln.train.trainer import Trainer
from tests.fixtures import require_shared, tiny_story_dataset
from tests.posttrain.conftest import save_run

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "distill.toml"
SHARED = ROOT.parent / "shared" / "data" / "tinystories" / "valid.txt.gz"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 KB of TinyStories as a 300-token BPE and shards."""
    return tiny_story_dataset(require_shared(SHARED), tmp_path_factory.mktemp("stories"), 40_000)


@pytest.fixture(scope="module")
def teacher(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model trained for 12 steps on the dataset (a kiln train run folder)."""
    run = tmp_path_factory.mktemp("teacher") / "run"
    cfg = load_train_config(
        ROOT / "configs" / "tiny.toml",
        [f"data.dataset={dataset}", f"logging.run_dir={run}", "logging.progress=false",
         "train.max_steps=12", "eval.batches=0", "checkpoint.every=12"],
    )  # fmt: skip
    Trainer(cfg, run).run()
    return run


def _config(teacher: Path, dataset: Path, run: Path, *overrides: str) -> DistillConfig:
    return load_distill_config(
        CONFIG,
        [
            f"distill.teacher={teacher}", f"data.dataset={dataset}", "data.seq_len=32",
            "model.block_size=64", "model.n_layer=1", "model.n_embd=32", "model.head_dim=8",
            "model.vocab_multiple=1", "batch.global_tokens=256", "batch.micro_batch=4",
            "train.time_budget=none", "train.max_steps=6", "train.dtype=fp32", "eval.every=3",
            "eval.batches=1", "checkpoint.every=3", "logging.every=1", "logging.progress=false",
            f"logging.run_dir={run}", "schedule.warmup_steps=2", "model.dropout=0.1", *overrides,
        ],
    )  # fmt: skip


def _hand_kl(p_logits: list[float], q_logits: list[float], tau: float) -> float:
    """KL(softmax(p/τ) ‖ softmax(q/τ)) · τ², written out term by term."""

    def softmax(z: list[float]) -> list[float]:
        e = [math.exp(v / tau) for v in z]
        return [v / sum(e) for v in e]

    p, q = softmax(p_logits), softmax(q_logits)
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True)) * tau**2


@pytest.mark.parametrize("tau", [1.0, 2.5])
def test_the_kl_losses_match_a_hand_computation(tau: float) -> None:
    student = torch.tensor([[[1.0, -0.5, 2.0], [0.0, 0.3, -1.2], [5.0, 5.0, 5.0]]])  # (1, 3, 3)
    teacher = torch.tensor([[[0.2, 1.5, -0.7], [2.0, -1.0, 0.5], [0.0, 9.0, 0.0]]])
    targets = torch.tensor([[2, 0, -1]])  # the last position is ignored
    rows = [(student[0, i].tolist(), teacher[0, i].tolist()) for i in range(2)]
    forward = sum(_hand_kl(t, s, tau) for s, t in rows) / 2
    reverse = sum(_hand_kl(s, t, tau) for s, t in rows) / 2
    got_f = distill_loss(student, teacher, targets, "forward_kl", tau)
    got_r = distill_loss(student, teacher, targets, "reverse_kl", tau)
    assert got_f.item() == pytest.approx(forward, rel=1e-5)
    assert got_r.item() == pytest.approx(reverse, rel=1e-5)
    assert forward != pytest.approx(reverse, rel=1e-2)  # the two directions differ here
    assert distill_loss(teacher, teacher, targets).item() == pytest.approx(0.0, abs=1e-6)


def test_the_kl_gradient_pulls_the_student_towards_the_teacher() -> None:
    teacher = torch.tensor([[[3.0, 0.0, -3.0]]])
    student = torch.zeros(1, 1, 3, requires_grad=True)
    distill_loss(
        student, teacher, torch.zeros(1, 1, dtype=torch.long), "forward_kl", 1.0
    ).backward()
    assert student.grad is not None
    # d KL / d z = softmax(z) - softmax(teacher): negative where the teacher puts more mass
    expected = torch.softmax(student.detach(), -1) - torch.softmax(teacher, -1)
    torch.testing.assert_close(student.grad, expected)


@pytest.mark.parametrize("mix", [[], ["distill.loss=reverse_kl", "distill.ce_weight=0.5"]],
                         ids=["forward", "reverse+ce"])  # fmt: skip
def test_interrupted_then_resumed_distillation_equals_an_uninterrupted_one(
    teacher: Path, dataset: Path, tmp_path: Path, mix: list[str]
) -> None:
    straight_run, cut_run = tmp_path / "straight", tmp_path / "cut"
    uninterrupted = build_trainer(_config(teacher, dataset, straight_run, *mix), straight_run).run()

    def stop(trainer: Trainer, step: int, loss: float) -> None:
        if step == 2:
            trainer.request_stop()

    cfg = _config(teacher, dataset, cut_run, *mix)
    first = build_trainer(cfg, cut_run, on_step=stop).run()
    assert first.interrupted and first.step == 2
    second = build_trainer(cfg, cut_run, resume=True).run()
    assert second.step == 6
    assert first.losses + second.losses == uninterrupted.losses  # bitwise on CPU fp32
    wa = load_file(straight_run / "checkpoints" / "step_6" / "model.safetensors")
    wb = load_file(cut_run / "checkpoints" / "step_6" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_student_trains_on_the_kl_and_loads_like_any_run(
    teacher: Path, dataset: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    trainer = build_trainer(_config(teacher, dataset, run, "model.dropout=0.0"), run)
    teacher_model = trainer.train_model.teacher
    x, y = trainer.loader.next_batch().to_torch(trainer.device)[:2]
    with torch.no_grad():
        before = distill_loss(trainer.model(x), teacher_model(x), y, "forward_kl", 2.0).item()
        # the logged loss is the KL, not the cross-entropy
        assert trainer.train_model(x, y).item() == pytest.approx(before, rel=1e-5)
    trainer.run()
    with torch.no_grad():
        after = distill_loss(trainer.model(x), teacher_model(x), y, "forward_kl", 2.0).item()
    assert after < before
    resolved = load_distill_config(run / "config.toml").distill
    weights = teacher / "checkpoints" / "step_12" / "model.safetensors"
    assert resolved.teacher_weights == str(weights) and len(resolved.teacher_sha256) == 64
    loaded = load_model(run, dtype="fp32")  # the tokenizer is found through the dataset
    assert loaded.model.cfg.n_embd == 32 and loaded.tokenizer is not None


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line_naming_both(
    teacher: Path, tmp_path: Path
) -> None:
    (tmp_path / "other").mkdir()
    other = tiny_story_dataset(require_shared(SHARED), tmp_path / "other", 30_000)
    # the same vocabulary size, other merges: the tokenizer's contents are compared, not sizes
    with pytest.raises(KilnError) as caught:
        build_trainer(_config(teacher, other, tmp_path / "run"), tmp_path / "run")
    message = str(caught.value)
    assert "\n" not in message and str(teacher) in message and str(other) in message
    assert "same tokenizer" in message


def test_a_changed_teacher_is_refused_on_resume(
    teacher: Path, dataset: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    build_trainer(_config(teacher, dataset, run, "train.max_steps=3"), run).run()
    loaded = load_model(teacher, dtype="fp32")
    with torch.no_grad():
        loaded.model.norm_f.weight.mul_(1.5)  # another teacher, with the same tokenizer
    assert loaded.tokenizer is not None
    other = save_run(tmp_path / "teacher2", loaded.model, loaded.tokenizer)
    with pytest.raises(KilnError, match=r"cannot resume.*teacher_sha256"):
        build_trainer(_config(other, dataset, run, "train.max_steps=4"), run, resume=True)
    build_trainer(_config(teacher, dataset, run, "train.max_steps=4"), run, resume=True).run()


def test_kiln_distill_runs_from_the_command_line(
    teacher: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "cli"
    sets = [
        f"distill.teacher={teacher}", f"data.dataset={dataset}", "data.seq_len=32",
        "model.block_size=64", "model.n_layer=1", "model.n_embd=32", "model.head_dim=8",
        "batch.global_tokens=128", "batch.micro_batch=4", "train.time_budget=none",
        "train.max_steps=2", "train.dtype=fp32", "eval.batches=0", f"logging.run_dir={run}",
    ]  # fmt: skip
    argv = ["distill", str(CONFIG), *[a for s in sets for a in ("--set", s)], "--no-progress"]
    assert main(argv) == 0
    assert "kiln distill: teacher" in capsys.readouterr().out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2
    assert main([*argv[:-1], "--set", "distill.temperature=0"]) != 0
    assert "distill.temperature must be > 0" in capsys.readouterr().err
