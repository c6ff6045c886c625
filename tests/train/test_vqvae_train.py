"""`kiln image train-vqvae`: a run folder, checkpoints, bit-exact resume, refusals, learning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.cli import main
from kiln.errors import KilnError
from kiln.image.dataset import ScenesSpec, build_scenes
from kiln.train.vqvae import VQVAERun, VQVAETrainConfig, batch_indices

TINY = [
    "model.image_size=32", "model.hidden=8", "model.res_blocks=0", "model.codebook_size=16",
    "model.code_dim=4", "train.batch_size=4", "train.log_every=1", "train.eval_every=2",
    "train.eval_images=4", "train.restart_every=1", "checkpoint.every=2", "schedule.warmup_steps=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vq") / "scenes"
    build_scenes(out, ScenesSpec(size=32, train=24, val=4, heldout=4, seed=3))
    return out


def _cfg(scenes: Path, run: Path, *extra: str) -> VQVAETrainConfig:
    sets = [f"data.dataset={scenes}", f"run_dir={run}", *TINY, *extra]
    return VQVAETrainConfig.load(None, sets)


def test_batches_are_a_pure_function_of_the_cursor() -> None:
    a = batch_indices(24, 4, seed=0, epoch=1, position=8)
    assert list(a) == list(batch_indices(24, 4, seed=0, epoch=1, position=8))
    epoch = [i for p in range(0, 24, 4) for i in batch_indices(24, 4, 0, 1, p)]
    assert sorted(epoch) == list(range(24))  # an epoch sees every picture once
    assert list(batch_indices(24, 4, 0, 2, 0)) != list(batch_indices(24, 4, 0, 1, 0))


def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(
    scenes: Path, tmp_path: Path
) -> None:
    steps = "train.max_steps=6"
    whole = VQVAERun(_cfg(scenes, tmp_path / "whole", steps))
    whole.run(progress=False)
    first = VQVAERun(_cfg(scenes, tmp_path / "split", steps))
    for _ in range(3):  # 3: an odd step, so the cursor sits mid-epoch
        first.train_step()
    first.save()
    first._lock.release()
    del first
    torch.manual_seed(123)  # whatever this process's RNG did since, the checkpoint's RNG wins
    second = VQVAERun(_cfg(scenes, tmp_path / "split", steps), resume=True)
    assert second.step == 3
    final = second.run(progress=False)
    a = load_file(tmp_path / "whole/checkpoints/step_6/model.safetensors")
    b = load_file(tmp_path / "split/checkpoints/step_6/model.safetensors")
    assert a.keys() == b.keys()
    assert "quantizer.ema_count" in a  # the EMA codebook state is saved with the weights
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert final["step"] == 6 and "heldout_psnr" in final and "val_codes_used" in final
    records = [r["step"] for r in second.metrics.read()]
    assert records == [1, 2, 3, 4, 5, 6] or records == [4, 5, 6]


def test_run_folder_holds_config_metrics_checkpoints_and_a_picture(
    scenes: Path, tmp_path: Path, capsys
) -> None:
    run = tmp_path / "run"
    config = tmp_path / "vq.toml"
    config.write_text(f'run_dir = "{run}"\n[data]\ndataset = "{scenes}"\n')
    argv = ["image", "train-vqvae", str(config), "--no-progress", "--set", "train.max_steps=2"]
    argv += [a for s in TINY for a in ("--set", s)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "heldout_psnr" in out and "reconstructions.png" in out
    assert (run / "config.toml").is_file() and (run / "eval.json").is_file()
    assert (run / "report" / "reconstructions.png").stat().st_size > 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    record = [line for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    for key in ("perplexity", "codes_in_batch", "val_psnr", "heldout_codes_used"):
        assert f'"{key}"' in record
    # Again without --resume: refused, the run is kept.
    assert main(argv) == 2
    assert "pass --resume" in capsys.readouterr().err
    # A resume with another model is refused with the field that changed.
    assert main([*argv, "--resume", "--set", "model.codebook_size=32"]) == 2
    assert "model.codebook_size: 16 -> 32" in capsys.readouterr().err
    # A config typo is one line naming the key.
    assert main([*argv, "--set", "model.codebok_size=32"]) == 2
    assert "unknown config key model.codebok_size" in capsys.readouterr().err


def test_a_model_of_another_size_than_the_data_is_refused(scenes: Path, tmp_path: Path) -> None:
    with pytest.raises(KilnError, match=r"model\.image_size = 64, but .* holds 32×32"):
        VQVAERun(_cfg(scenes, tmp_path / "r", "model.image_size=64"))


def test_training_lowers_the_reconstruction_error(scenes: Path, tmp_path: Path) -> None:
    sets = ("train.max_steps=60", "optim.lr=3e-3", "train.restart_every=10", "model.hidden=16")
    run = VQVAERun(_cfg(scenes, tmp_path / "r", *sets))
    before = run.evaluate()
    for _ in range(60):
        run.train_step()
    after = run.evaluate()
    assert after["val_psnr"] > before["val_psnr"] + 2, (before, after)
    assert after["val_codes_used"] > before["val_codes_used"]  # restarts revived codes


def test_a_signal_stops_between_steps_and_saves(scenes: Path, tmp_path: Path, monkeypatch) -> None:
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)  # not always SIG_DFL: Ray's init installs one
    run = VQVAERun(_cfg(scenes, tmp_path / "r", "train.max_steps=6", "checkpoint.every=100"))
    step = run.train_step

    def step_then_signal() -> dict[str, float]:
        out = step()
        if run.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(run, "train_step", step_then_signal)
    with pytest.raises(KilnError, match=r"stopped at step 2; saved .* --resume"):
        run.run(progress=False)
    assert (tmp_path / "r/checkpoints/latest").read_text().strip() == "step_2"
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_a_time_budget_plans_the_steps_and_a_finished_budget_resumes_to_no_step(
    scenes: Path, tmp_path: Path, capsys
) -> None:
    # Far more than a 1-second budget buys: a step of this tiny model took 2.5 ms on a fast AMD
    # EPYC, so a cap of 400 was reached there before the budget ran out.
    cap = "train.max_steps=100000"
    run = VQVAERun(_cfg(scenes, tmp_path / "b", cap, "train.time_budget=1s", "checkpoint.every=50"))
    final = run.run(progress=False)
    assert 3 <= final["step"] < 100_000  # the budget ended it, not the cap
    assert run.max_steps == final["step"]  # the schedule's length is the plan it ended on
    assert "time budget: " in capsys.readouterr().out
    from kiln import checkpoint_format as fmt

    saved = fmt.read_state(fmt.latest_checkpoint(tmp_path / "b" / "checkpoints"))["scheduler"]
    assert saved["time_budget_s"] == 1.0 and saved["planned_steps"] == final["step"]
    assert saved["train_seconds"] > 0
    again = VQVAERun(_cfg(scenes, tmp_path / "b", cap, "train.time_budget=1s"), resume=True)
    assert again.run(progress=False)["step"] == final["step"]  # the budget's clock went on


def test_a_bad_time_budget_is_one_config_error(scenes: Path, tmp_path: Path) -> None:
    with pytest.raises(KilnError, match=r"train.time_budget = 'soon'"):
        _cfg(scenes, tmp_path / "c", "train.time_budget=soon")
