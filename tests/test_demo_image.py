"""`kiln demo --image`: scenes -> VQ-VAE -> DiT -> checker -> held-out samples -> scores, at a
tiny size; budgets and bad flags refused before anything runs; a killed run resumes at its stage."""

from __future__ import annotations

import json

import pytest

from kiln.cli import build_parser, main
from kiln.demo_chat import kiln_command
from kiln.demo_image import STAGES, run_image_demo

TINY = [
    "--train-images", "32", "--heldout-images", "8", "--eval-captions", "4",
    "--sample-steps", "2", "--vqvae-steps", "2", "--dit-steps", "2", "--checker-steps", "2",
    "--vqvae-set", "model.hidden=8", "--vqvae-set", "model.codebook_size=16",
    "--vqvae-set", "train.batch_size=8", "--vqvae-set", "train.eval_images=4",
    "--dit-set", "model.width=32", "--dit-set", "model.depth=1", "--dit-set", "model.heads=2",
    "--dit-set", "model.text_layers=1", "--dit-set", "train.batch_size=8",
    "--dit-set", "diffusion.sample_steps=2", "--dit-set", "train.eval_images=4",
    "--checker-set", "model.channels=8", "--checker-set", "model.features=32",
    "--checker-set", "train.batch_size=8",
]  # fmt: skip


def _args(out, *extra):
    return build_parser().parse_args(["demo", "--image", "--out", str(out), *TINY, *extra])


def test_image_demo_end_to_end_then_resume_after_a_kill(tmp_path, capsys) -> None:
    out = tmp_path / "img"
    ran: list[list[str]] = []

    def killed_in_dit(argv):
        ran.append(list(argv))
        if argv[:2] == ["image", "train-dit"]:
            raise KeyboardInterrupt  # the user's Ctrl-C, or a kill, during the DiT stage
        kiln_command(argv)

    with pytest.raises(KeyboardInterrupt):
        run_image_demo(_args(out), run=killed_in_dit)
    state = json.loads((out / "stages.json").read_text())
    assert state["stages"]["dit"]["status"] == "running"
    assert state["stages"]["vqvae"]["status"] == "done"
    assert [a[1] for a in ran] == ["data", "data", "train-vqvae", "train-dit"]

    ran.clear()

    def recording(argv):
        ran.append(list(argv))
        kiln_command(argv)

    assert run_image_demo(_args(out, "--resume"), run=recording) == 0
    assert [a[1] for a in ran] == ["train-dit", "train-checker"]  # nothing before the DiT again
    state = json.loads((out / "stages.json").read_text())
    assert list(state["stages"]) == list(STAGES)
    assert all(r["status"] == "done" for r in state["stages"].values())
    score = json.loads((out / "report" / "score.json").read_text())
    assert score["eval_captions"] == 4
    for row in ("samples", "renders"):
        assert set(score[row]) >= {"object", "colour", "relation", "all", "frechet"}
        assert 0.0 <= score[row]["object"] <= 1.0
    assert score["target_met"] == (score["samples"]["object"] >= 0.8)
    report = (out / "report" / "README.md").read_text()
    assert "object accuracy on unseen compositions" in report and "heldout_grid.png" in report
    assert (out / "report" / "heldout_grid.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert f"kiln serve LM --image-model {out / 'dit'}" in printed
    # The DiT folder is an ordinary run: the sampler opens it and draws a caption.
    from kiln.image.sampler import load_image_model

    pictures = load_image_model(out / "dit").sample(["a red ball under a tree"], seed=0, steps=1)
    assert pictures.shape == (1, 3, 32, 32)


def test_a_reused_checker_is_not_trained_again(tmp_path) -> None:
    first = tmp_path / "a"
    assert run_image_demo(_args(first)) == 0
    ran: list[list[str]] = []

    def recording(argv):
        ran.append(list(argv))
        kiln_command(argv)

    second = tmp_path / "b"
    assert run_image_demo(_args(second, "--checker", str(first / "checker")), run=recording) == 0
    assert "train-checker" not in [a[1] for a in ran]
    score = json.loads((second / "report" / "score.json").read_text())
    assert score["checker"] == str(first / "checker")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--minutes", "10", "--dit-minutes", "9"], "need 15.5 min, more than --minutes 10"),
        (["--chat"], "--image and --chat are two demos"),
        (["--eval-captions", "900"], "--eval-captions 900 is more than the --heldout-images"),
        (["--dit-minutes", "-1"], "--dit-minutes must be a positive number"),
        (["--checker", "nowhere"], "--checker nowhere: not a `kiln image train-checker` run"),
    ],
)
def test_bad_flags_are_one_line_before_anything_runs(tmp_path, capsys, extra, message) -> None:
    out = tmp_path / "img"
    argv = ["demo", "--image", "--out", str(out), "--train-images", "32", *extra]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()  # refused before the folder was made


def test_resume_and_clobbering_are_refused_in_one_line(tmp_path, capsys) -> None:
    out = tmp_path / "img"
    out.mkdir()
    (out / "mine.txt").write_text("not a demo")
    assert main(["demo", "--image", "--out", str(out), "--resume", *TINY]) != 0
    assert "is not a `kiln demo --image` run" in capsys.readouterr().err
    assert main(["demo", "--image", "--out", str(out), *TINY]) != 0
    assert "already exists and is not empty; pass --force" in capsys.readouterr().err
    assert main(["demo", "--image", "--out", str(out), "--force", *TINY]) != 0
    assert "a kiln demo --image run folder" in capsys.readouterr().err
    assert (out / "mine.txt").is_file()  # a folder kiln did not make is never replaced
    assert main(["demo", "--image", "--resume", *TINY]) != 0
    assert "--resume needs --out FOLDER" in capsys.readouterr().err
