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

import kiln.model.loss
from kiln.cli import main
from kiln.errors import KilnError
from kiln.model.loss import distill_loss, teacher_topk, topk_distill_loss, topk_lm_loss
from kiln.posttrain.distill import build_trainer
from kiln.train.trainer import Trainer

# the dataset and teacher fixtures are test_distill's (imported, so F401/F811 are expected)
from tests.posttrain.test_distill import CONFIG, _config, dataset, teacher  # noqa: F401

K = 8


def test_topk_loss_is_the_kl_over_the_topk_ids_and_a_tail_bucket_by_hand() -> None:
    student = torch.tensor([[[1.0, -0.5, 2.0, 0.3]]])  # (1, 1, 4)
    teacher_all = torch.tensor([[[0.2, 1.5, -0.7, 1.0]]])
    tau = 2.0
    ids, logp, tail = teacher_topk(teacher_all, 2, tau)
    assert ids.tolist() == [[[1, 3]]]

    def softmax(z: list[float]) -> list[float]:
        e = [math.exp(v / tau) for v in z]
        return [v / sum(e) for v in e]

    p, q = softmax(teacher_all[0, 0].tolist()), softmax(student[0, 0].tolist())
    # buckets: token 1, token 3, and everything else (tokens 0 and 2), both sides summing to 1
    P = [p[1], p[3], p[0] + p[2]]
    Q = [q[1], q[3], q[0] + q[2]]
    want = sum(pi * math.log(pi / qi) for pi, qi in zip(P, Q, strict=True)) * tau**2
    assert math.exp(tail.item()) == pytest.approx(p[0] + p[2], rel=1e-6)
    got = topk_distill_loss(student, ids, logp, tail, torch.tensor([[0]]), tau)
    assert got.item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_topk_loss_with_k_equal_to_the_vocab_is_the_full_kl_and_its_gradient(tau: float) -> None:
    torch.manual_seed(0)
    teacher_logits = torch.randn(2, 5, 11) * 3
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 1] = -1  # ignored by both
    ids, logp, tail = teacher_topk(teacher_logits, 11, tau)
    assert torch.isinf(tail).all()  # no tail when K = V
    a = torch.randn(2, 5, 11, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    full = distill_loss(a, teacher_logits, targets, "forward_kl", tau)
    topk = topk_distill_loss(b, ids, logp, tail, targets, tau)
    assert topk.item() == pytest.approx(full.item(), rel=1e-5)
    full.backward(), topk.backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)  # and finite, though the tail is empty


@pytest.mark.parametrize(("tau", "kl", "ce", "k"), [(1.0, 1.0, 0.0, 5), (2.0, 0.7, 0.3, 5),
                                                    (1.0, 0.5, 0.5, 30)])  # fmt: skip
def test_the_chunked_topk_loss_from_hidden_states_equals_the_plain_one_and_its_gradients(
    tau: float, kl: float, ce: float, k: int
) -> None:
    torch.manual_seed(0)
    V, C = 30, 8
    h = torch.randn(2, 6, C, requires_grad=True)
    w = torch.randn(32, C, requires_grad=True)  # 2 padding rows, never scored
    y = torch.randint(0, V, (2, 6))
    y[0, 2] = -1
    topk = teacher_topk(torch.randn(2, 6, V) * 2, k, tau)
    chunked = topk_lm_loss(h, w, V, topk, y, tau, kl, ce)
    chunked.backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    z = h @ w[:V].T
    plain = kl * topk_distill_loss(z, *topk, y, tau)
    if ce:
        plain = plain + ce * torch.nn.functional.cross_entropy(
            z.reshape(-1, V), y.reshape(-1), ignore_index=-1
        )
    plain.backward()
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    assert torch.allclose(grads[0], h.grad, atol=1e-6) and torch.allclose(
        grads[1], w.grad, atol=1e-6
    )


def test_the_topk_loss_over_several_chunks_equals_it_in_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    V, C = 30, 8
    h = torch.randn(2, 100, C, requires_grad=True)
    w = torch.randn(32, C, requires_grad=True)
    y = torch.randint(0, V, (2, 100))
    y[:, ::9] = -1
    topk = teacher_topk(torch.randn(2, 100, V) * 2, 5, 2.0)
    results = []
    for rows in (200, 64):  # one chunk, then 64 + 64 + 64 + 8 rows
        monkeypatch.setattr(kiln.model.loss, "CHUNK_ELEMENTS", rows * V)
        loss = topk_lm_loss(h, w, V, topk, y, 2.0, 0.7, 0.3)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
        h.grad = w.grad = None
    for one, several in zip(*results, strict=True):
        assert torch.allclose(one, several, rtol=1e-6, atol=1e-7)


def test_training_from_shards_equals_the_online_teachers_topk_loss_with_the_ce_mixed_in(
    teacher: Path, dataset: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = _config(teacher, dataset, run, f"distill.topk={K}", "model.dropout=0.0",
                  f"distill.topk_dir={tmp_path / 'topk'}", "distill.kl_weight=0.7",
                  "distill.ce_weight=0.3")  # fmt: skip
    trainer = build_trainer(cfg, run)
    step = trainer.train_model
    assert step.fused(step.student)  # the chunked loss, checked against the plain one below
    x, y, ids, logp, tail = trainer.loader.next_batch().to_torch(trainer.device)
    assert ids.shape == (*x.shape, K) and tail.shape == x.shape
    with torch.no_grad():
        online = teacher_topk(step.teacher(x), K, 2.0)
        assert torch.equal(ids, online[0])
        assert torch.allclose(logp, online[1], atol=1e-5) and torch.allclose(tail, online[2])
        logits = trainer.model(x)
        kl = topk_distill_loss(logits, *online, y, 2.0)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        got = step(x, y, ids, logp, tail)
        assert got.item() == pytest.approx(0.7 * kl.item() + 0.3 * ce.item(), rel=1e-5)
        full = distill_loss(logits, step.teacher(x), y, "forward_kl", 2.0)
        assert kl.item() != pytest.approx(full.item(), rel=1e-3)  # the top-k really is used
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
    files = ("ids.npy", "logprobs.npy", "tail.npy")
    assert manifest["bytes"] == sum((folder / f).stat().st_size for f in files)
    assert manifest["temperature"] == 2.0 and manifest["format"] == 2
    size = n * T * (K * 8 + 4)  # int32 ids + fp32 log-probs, fp32 tail per position
    assert size <= manifest["bytes"] < size + 3 * 1024
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
    assert (dataset / "teacher_topk" / "k4_T32_tau2" / "manifest.json").is_file()
    assert trainer.cfg.distill.topk_dir == str(dataset / "teacher_topk" / "k4_T32_tau2")


def test_old_shards_without_the_tail_and_shards_of_another_temperature_are_refused(
    teacher: Path, dataset: Path, tmp_path: Path
) -> None:
    folder, run = tmp_path / "topk", tmp_path / "run"
    sets = [f"distill.topk={K}", f"distill.topk_dir={folder}"]
    build_trainer(_config(teacher, dataset, run, *sets), run)  # writes them at τ = 2
    with pytest.raises(
        KilnError, match=r"stale top-k shards: temperature is 2.0, this run needs 1.0"
    ):
        build_trainer(_config(teacher, dataset, run, *sets, "distill.temperature=1"), run)
    manifest = json.loads((folder / "manifest.json").read_text())
    old = {k: v for k, v in manifest.items() if k != "temperature"} | {"format": 1}
    (folder / "manifest.json").write_text(json.dumps(old))  # what the first version wrote
    (folder / "tail.npy").unlink()
    (folder / "logprobs.npy").rename(folder / "logits.npy")
    with pytest.raises(KilnError) as caught:
        build_trainer(_config(teacher, dataset, run, *sets), run)
    message = str(caught.value)
    assert "\n" not in message and "format 1" in message and "no tail mass" in message
    assert "--precompute-topk K --force" in message
    (folder / "manifest.json").write_text(json.dumps(manifest))  # a current manifest, files gone
    with pytest.raises(KilnError, match=r"without logprobs.npy, tail.npy; rebuild"):
        build_trainer(_config(teacher, dataset, run, *sets), run)


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
