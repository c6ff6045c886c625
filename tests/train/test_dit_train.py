"""`kiln image train-dit`, `train-checker` and `sample`: run folders, bit-exact resume, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.cli import main
from kiln.errors import KilnError
from kiln.image.dataset import ScenesSpec, build_scenes
from kiln.image.sampler import load_image_model
from kiln.train.checker import CheckerRun, CheckerTrainConfig, load_checker
from kiln.train.dit import DiTRun, DiTTrainConfig
from kiln.train.vqvae import VQVAERun, VQVAETrainConfig

DIT = [
    "model.width=32", "model.depth=1", "model.heads=2", "model.text_layers=1",
    "train.batch_size=8", "train.log_every=1", "train.eval_every=2", "train.eval_images=8",
    "checkpoint.every=2", "schedule.warmup_steps=1", "diffusion.sample_steps=3",
]  # fmt: skip
CHECKER = ["model.channels=8", "model.features=32", "train.batch_size=8", "train.log_every=1",
           "train.eval_every=2", "train.eval_images=8", "schedule.warmup_steps=1"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dit")
    build_scenes(root / "scenes", ScenesSpec(size=32, train=40, val=8, heldout=8, seed=5))
    vq = VQVAETrainConfig.load(None, [
        f"data.dataset={root / 'scenes'}", f"run_dir={root / 'vq'}", "model.hidden=8",
        "model.res_blocks=0", "model.codebook_size=16", "model.code_dim=4",
        "train.batch_size=8", "train.max_steps=3", "train.eval_images=4", "train.restart_every=1",
    ])  # fmt: skip
    VQVAERun(vq).run(progress=False)
    return root / "scenes", root / "vq"


def _dit(trained: tuple[Path, Path], run: Path, *extra: str) -> DiTTrainConfig:
    scenes, vq = trained
    return DiTTrainConfig.load(
        None, [f"data.dataset={scenes}", f"vqvae={vq}", f"run_dir={run}", *DIT, *extra]
    )


@pytest.mark.parametrize("objective", ["v", "flow"])
def test_a_resumed_dit_run_ends_bit_identical(trained, tmp_path: Path, objective: str) -> None:
    sets = ("train.max_steps=5", f"diffusion.objective={objective}", "model.caption_dropout=0.5")
    DiTRun(_dit(trained, tmp_path / "whole", *sets)).run(progress=False)
    first = DiTRun(_dit(trained, tmp_path / "split", *sets))
    for _ in range(3):
        first.train_step()
    first.save()
    first._lock.release()
    del first
    torch.manual_seed(99)  # the checkpoint's RNG state wins over whatever ran since
    second = DiTRun(_dit(trained, tmp_path / "split", *sets), resume=True)
    assert second.step == 3
    final = second.run(progress=False)
    a = load_file(tmp_path / "whole/checkpoints/step_5/model.safetensors")
    b = load_file(tmp_path / "split/checkpoints/step_5/model.safetensors")
    assert a.keys() == b.keys() and "vqvae.quantizer.codebook" in a  # self-contained
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert final["step"] == 5 and "val_loss" in final


def test_training_lowers_the_held_out_loss(trained, tmp_path: Path) -> None:
    run = DiTRun(_dit(trained, tmp_path / "r", "train.max_steps=40", "optim.lr=2e-3"))
    before = run.evaluate()["val_loss"]
    for _ in range(40):
        run.train_step()
    after = run.evaluate()["val_loss"]
    assert after < 0.8 * before, (before, after)


def test_the_cli_trains_samples_and_refuses(trained, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    config = tmp_path / "dit.toml"
    scenes, vq = trained
    config.write_text(f'run_dir = "{run}"\nvqvae = "{vq}"\n[data]\ndataset = "{scenes}"\n')
    argv = ["image", "train-dit", str(config), "--no-progress", "--set", "train.max_steps=2"]
    argv += [a for s in DIT for a in ("--set", s)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "val_loss" in out and "samples.png" in out
    assert (run / "tokenizer.json").is_file() and (run / "report/samples.png").stat().st_size
    assert main([*argv, "--resume", "--set", "model.width=64"]) == 2
    assert "model.width: 32 -> 64" in capsys.readouterr().err
    grid = tmp_path / "grid.png"
    sample = ["image", "sample", str(run), "--prompt", "a red ball under a tree", "-n", "2",
              "--out", str(grid), "--seed", "3"]  # fmt: skip
    assert main(sample) == 0 and grid.stat().st_size > 0
    first = grid.read_bytes()
    assert main(sample) == 2 and "--force" in capsys.readouterr().err  # never clobbered
    assert main([*sample, "--force"]) == 0 and grid.read_bytes() == first  # seeded
    assert main([*sample[:4], "a <|endoftext|>", *sample[5:], "--force"]) == 2
    assert "--prompt" in capsys.readouterr().err
    assert (
        main(["image", "sample", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "n.png")])
        == 2
    )
    assert "no checkpoints/latest" in capsys.readouterr().err


def test_the_image_model_api(trained, tmp_path: Path) -> None:
    DiTRun(_dit(trained, tmp_path / "r", "train.max_steps=1")).run(progress=False)
    model = load_image_model(tmp_path / "r")
    steps: list[tuple[int, tuple[int, ...]]] = []
    images = model.sample(["a sun in the sky", "a dog left of a cat"], seed=4, steps=3,
                          on_step=lambda i, p: steps.append((i, tuple(p.shape))))  # fmt: skip
    assert model.size == 32 and images.shape == (2, 3, 32, 32)
    assert images.min() >= 0 and images.max() <= 1
    assert steps == [(i, (2, 3, 32, 32)) for i in range(3)]
    again = model.sample(["a sun in the sky"], seed=4, steps=3)
    assert torch.allclose(again[0], images[0], atol=1e-5)
    with pytest.raises(KilnError, match="steps must be in"):
        model.sample(["a sun"], seed=0, steps=0 - 1)


def test_the_checker_learns_from_renders_and_loads_back(trained, tmp_path: Path) -> None:
    scenes, _ = trained
    # 40 pictures teach nothing that generalises: it is scored on what it trained on.
    sets = [f"data.dataset={scenes}", f"run_dir={tmp_path / 'c'}", *CHECKER, "train.max_steps=80",
            "optim.lr=3e-3", 'data.eval_splits=["train", "heldout"]', "train.eval_images=40"]  # fmt: skip
    run = CheckerRun(CheckerTrainConfig.load(None, sets))
    before = run.evaluate()
    final = run.run(progress=False)
    assert final["train_object"] > before["train_object"] + 0.3, (before, final)
    assert final["train_colour"] > before["train_colour"] + 0.2, (before, final)
    assert {"heldout_colour", "heldout_relation", "heldout_all"} <= final.keys()
    checker = load_checker(tmp_path / "c")
    assert checker.config.features == 32
    with pytest.raises(KilnError, match="not a checker checkpoint"):
        load_checker(trained[1])


def test_a_missing_or_wrong_vqvae_is_one_clear_error(trained, tmp_path: Path) -> None:
    scenes = trained[0]
    with pytest.raises(KilnError, match=r"vqvae = .*: no checkpoint in .*train it first"):
        DiTRun(_dit((scenes, tmp_path / "nothing"), tmp_path / "r"))
    DiTRun(_dit(trained, tmp_path / "d", "train.max_steps=1")).run(progress=False)
    with pytest.raises(KilnError, match="is not a VQ-VAE checkpoint"):
        DiTRun(_dit((scenes, tmp_path / "d"), tmp_path / "r2"))


def test_caption_dropout_empties_that_share_of_captions(trained, tmp_path: Path) -> None:
    run = DiTRun(_dit(trained, tmp_path / "r", "model.caption_dropout=0.3"))
    torch.manual_seed(0)
    ids = run.ids[:1].repeat(4000, 1)
    dropped = run._drop_captions(ids)
    pad = run.model.dit.text.pad_id
    empty = (dropped[:, 1:] == pad).all(1)
    assert 0.27 < empty.float().mean() < 0.33
    assert torch.equal(dropped[~empty], ids[~empty]) and (dropped[:, 0] == ids[:, 0]).all()


def test_the_checker_can_learn_from_more_splits(trained, tmp_path: Path) -> None:
    scenes = trained[0]
    sets = [f"data.dataset={scenes}", f"run_dir={tmp_path / 'c'}", *CHECKER,
            'train.extra_splits=["heldout"]', "data.eval_splits=[]"]  # fmt: skip
    run = CheckerRun(CheckerTrainConfig.load(None, sets))
    assert run.n_train == 40 + 8 and len(run.images) == 48 and len(run.truth["present"]) == 48
    assert run.evaluate() == {}
