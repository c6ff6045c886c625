"""Teacher top-k shards: written once beside the token shards, sized, refused when stale, the
loss from them equal to the online teacher's top-k loss, and resume still bit for bit."""

# ruff: noqa: F811

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.cli import main
from kiln.errors import KilnError
from kiln.model.loss import distill_loss, topk_distill_loss
from kiln.posttrain.distill import build_trainer
from kiln.train.trainer import Trainer

# the dataset and teacher fixtures are test_distill's (imported, so F401/F811 are expected)
from tests.posttrain.test_distill import CONFIG, _config, dataset, teacher  # noqa: F401

K = 8


def test_topk_loss_is_the_kl_from_the_renormalised_topk_to_the_full_student_by_hand() -> None:
    student = torch.tensor([[[1.0, -0.5, 2.0, 0.3]]])  # (1, 1, 4)
    teacher_all = torch.tensor([[[0.2, 1.5, -0.7, 1.0]]])
    ids = torch.tensor([[[1, 3]]])  # the teacher's top-2
    tau = 2.0
    t = [math.exp(1.5 / tau), math.exp(1.0 / tau)]
    everything = sum(math.exp(v / tau) for v in (1.0, -0.5, 2.0, 0.3))  # the student's whole vocab
    p = [v / sum(t) for v in t]
    q = [math.exp(-0.5 / tau) / everything, math.exp(0.3 / tau) / everything]
    want = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True)) * tau**2
    got = topk_distill_loss(student, ids, teacher_all.gather(-1, ids), torch.tensor([[0]]),
                            "forward_kl", tau)  # fmt: skip
    assert got.item() == pytest.approx(want, rel=1e-6)
    full = torch.arange(4).reshape(1, 1, 4)  # K = V: the full KL
    assert topk_distill_loss(student, full, teacher_all, torch.tensor([[0]]), "reverse_kl", tau
                             ).item() == pytest.approx(distill_loss(
                                 student, teacher_all, torch.tensor([[0]]), "reverse_kl", tau
                             ).item(), rel=1e-6)  # fmt: skip


def test_training_from_shards_equals_the_online_teachers_topk_loss(
    teacher: Path, dataset: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = _config(teacher, dataset, run, f"distill.topk={K}", "model.dropout=0.0",
                  f"distill.topk_dir={tmp_path / 'topk'}")  # fmt: skip
    trainer = build_trainer(cfg, run)
    step = trainer.train_model
    x, y, ids, logits = trainer.loader.next_batch().to_torch(trainer.device)
    assert ids.shape == (*x.shape, K)
    with torch.no_grad():
        online = step.teacher(x).topk(K, dim=-1)
        assert torch.allclose(logits, online.values, rtol=1e-5, atol=1e-5)
        want = topk_distill_loss(trainer.model(x), online.indices, online.values, y,
                                 "forward_kl", 2.0)  # fmt: skip
        got = step(x, y, ids, logits)
        assert got.item() == pytest.approx(want.item(), rel=1e-5)
        full = distill_loss(trainer.model(x), step.teacher(x), y, "forward_kl", 2.0)
        assert got.item() != pytest.approx(full.item(), rel=1e-3)  # the top-k really is used
    result = trainer.run()
    assert result.step == 6 and all(math.isfinite(v) for v in result.losses)


def test_the_shards_are_sized_and_reused_and_a_stale_teacher_is_refused_in_one_line(
    teacher: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "topk"
    sets = [f"distill.teacher={teacher}", f"data.dataset={dataset}", "data.seq_len=32",
            f"distill.topk_dir={folder}"]  # fmt: skip
    argv = ["distill", str(CONFIG), *[a for s in sets for a in ("--set", s)]]
    assert main([*argv, "--precompute-topk", str(K)]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((folder / "manifest.json").read_text())
    ids = np.load(folder / "ids.npy")
    n, T = manifest["windows"], 32
    assert ids.shape == (n, T, K) and manifest["k"] == K and len(manifest["teacher_sha256"]) == 64
    assert (
        manifest["bytes"]
        == (folder / "ids.npy").stat().st_size + (folder / "logits.npy").stat().st_size
    )
    assert n * T * K * 8 <= manifest["bytes"] < n * T * K * 8 + 1024  # int32 ids + fp32 logits
    assert f"{manifest['bytes']:,} bytes" in out
    assert main([*argv, "--precompute-topk", str(K)]) == 0  # up to date: reused
    assert "wrote" not in capsys.readouterr().out
    manifest["teacher_sha256"] = "0" * 64  # shards of another teacher
    (folder / "manifest.json").write_text(json.dumps(manifest))
    run = tmp_path / "run"
    with pytest.raises(KilnError) as caught:
        build_trainer(_config(teacher, dataset, run, f"distill.topk={K}",
                              f"distill.topk_dir={folder}"), run)  # fmt: skip
    message = str(caught.value)
    assert "\n" not in message and "stale top-k shards: teacher_sha256" in message
    assert "--force" in message
    assert main([*argv, "--precompute-topk", str(K), "--force"]) == 0  # rebuilt
    assert "wrote" in capsys.readouterr().out
    build_trainer(_config(teacher, dataset, run, f"distill.topk={K}",
                          f"distill.topk_dir={folder}"), run)  # fmt: skip


def test_the_default_folder_is_beside_the_token_shards(
    teacher: Path, dataset: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    trainer = build_trainer(_config(teacher, dataset, run, "distill.topk=4"), run)
    assert (dataset / "teacher_topk" / "k4_T32" / "manifest.json").is_file()
    assert trainer.cfg.distill.topk_dir == str(dataset / "teacher_topk" / "k4_T32")


def test_resume_from_topk_shards_is_bit_exact(teacher: Path, dataset: Path, tmp_path: Path) -> None:
    topk = [f"distill.topk={K}", f"distill.topk_dir={tmp_path / 'topk'}", "distill.ce_weight=0.5"]
    straight_run, cut_run = tmp_path / "straight", tmp_path / "cut"
    uninterrupted = build_trainer(
        _config(teacher, dataset, straight_run, *topk), straight_run
    ).run()

    def stop(trainer: Trainer, step: int, loss: float) -> None:
        if step == 2:
            trainer.request_stop()

    cfg = _config(teacher, dataset, cut_run, *topk)
    first = build_trainer(cfg, cut_run, on_step=stop).run()
    second = build_trainer(cfg, cut_run, resume=True).run()
    assert first.step == 2 and second.step == 6
    assert first.losses + second.losses == uninterrupted.losses


def test_reverse_kl_from_topk_shards_is_refused_in_one_line() -> None:
    from kiln.config import ConfigError
    from kiln.posttrain.distill import DistillSection

    with pytest.raises(ConfigError, match=r"distill.topk = 8 needs distill.loss = forward_kl"):
        DistillSection(teacher="runs/t", topk=8, loss="reverse_kl")
