"""Eval-step samples (samples.jsonl, RNG untouched, exact resume) and TensorBoard / W&B logging."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kiln.errors import KilnError
from kiln.train.trainer import Trainer

from .conftest import MakeConfig

# Dropout draws from the global torch RNG every step: sampling must leave that stream alone.
DROPOUT = ("model.dropout=0.1", "train.max_steps=6", "eval.every=2")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train(cfg: Any, **kwargs: Any) -> Any:
    return Trainer(cfg, cfg.logging.run_dir, **kwargs).run()


def test_samples_leave_the_losses_alone_are_written_at_eval_steps_and_resume_exactly(
    make_config: MakeConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    """Samples off vs on: the same losses; an interrupted run with samples resumes exactly."""
    off = _train(make_config(*DROPOUT, "eval.sample_tokens=0", run="off"))
    assert not (Path(make_config(run="off").logging.run_dir) / "samples.jsonl").exists()

    prompts = 'eval.sample_prompts=["Once upon a time", "The dog"]'
    on_cfg = make_config(*DROPOUT, prompts, "eval.sample_tokens=12", run="on")
    on = _train(on_cfg)
    assert on.losses == off.losses
    samples = _jsonl(Path(on_cfg.logging.run_dir) / "samples.jsonl")
    assert [(s["step"], s["prompt"]) for s in samples] == [
        (step, p) for step in (2, 4, 6) for p in ("Once upon a time", "The dog")
    ]
    assert all(isinstance(s["text"], str) for s in samples)
    assert any(s["text"] for s in samples)
    assert "sample @ step 6: Once upon a time" in capsys.readouterr().out

    def interrupt(trainer: Trainer, step: int, loss: float) -> None:
        if step == 3:
            signal.raise_signal(signal.SIGINT)

    cut_cfg = make_config(*DROPOUT, prompts, "eval.sample_tokens=12", run="cut")
    first = _train(cut_cfg, on_step=interrupt)
    assert first.interrupted and first.step == 3
    second = _train(cut_cfg, resume=True)
    assert first.losses + second.losses == on.losses
    # The same weights at each eval step and a fixed seed: the same samples, none twice.
    assert _jsonl(Path(cut_cfg.logging.run_dir) / "samples.jsonl") == samples


def test_sampling_is_skipped_with_one_warning_without_the_tokenizer(
    make_config: MakeConfig, tiny_dataset: Path, tmp_path: Path
) -> None:
    moved = tmp_path / "shards"
    shutil.copytree(tiny_dataset, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["tokenizer"]["path"] = str(tmp_path / "gone" / "tok.json")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    cfg = make_config(f"data.dataset={moved}", "train.max_steps=2", "eval.every=1")
    with pytest.warns(UserWarning, match="eval samples skipped.*tok.json") as caught:
        result = Trainer(cfg, cfg.logging.run_dir).run()
    assert len([w for w in caught if "eval samples" in str(w.message)]) == 1
    assert result.step == 2 and result.val_loss is not None
    assert not (Path(cfg.logging.run_dir) / "samples.jsonl").exists()


def test_special_token_text_in_sample_prompts_fails_before_the_run_folder_exists(
    tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kiln.cli import main

    from .conftest import CONFIGS

    run_dir = tmp_path / "run"
    argv = ["train", str(CONFIGS / "tiny.toml"), "--no-progress",
            "--set", f"data.dataset={tiny_dataset}", "--set", f"logging.run_dir={run_dir}",
            "--set", 'eval.sample_prompts=["Once upon a time", "The end.<|endoftext|>One"]']  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "kiln: error: eval.sample_prompts[1] 'The end.<|endoftext|>One' contains the special "
        "token '<|endoftext|>' (at character 8); special-token text in user input is refused: "
        "set eval.allow_special = true to encode it as that control token, or remove it\n"
    )
    assert not run_dir.exists()  # nothing was created, nothing to clean up


def test_allow_special_encodes_sample_prompts_with_the_control_token(
    make_config: MakeConfig, tiny_dataset: Path
) -> None:
    cfg = make_config('eval.sample_prompts=["The end.<|endoftext|>One"]', "eval.allow_special=true")
    trainer = Trainer(cfg, cfg.logging.run_dir)
    eot = trainer.data.dataset.manifest.tokenizer.eot_id
    assert trainer.sampler is not None and eot in trainer.sampler.encoded[0]


def test_samples_refuse_a_tokenizer_file_that_is_not_the_manifests(
    make_config: MakeConfig, tiny_dataset: Path, tmp_path: Path
) -> None:
    moved = tmp_path / "shards"
    shutil.copytree(tiny_dataset, moved)
    tok = tmp_path / "tok.json"
    tok.write_text((tiny_dataset.parent / "tok.json").read_text() + "\n")  # same vocab, new bytes
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["tokenizer"]["path"] = str(tok)
    (moved / "manifest.json").write_text(json.dumps(manifest))
    cfg = make_config(f"data.dataset={moved}", run="changed")
    with pytest.raises(KilnError, match=r"tok\.json: sha256 \w+… differs from the tokenizer"):
        Trainer(cfg, cfg.logging.run_dir)
    assert not Path(cfg.logging.run_dir).exists()
    # With samples off the tokenizer is not needed, so the run trains.
    cfg = make_config(f"data.dataset={moved}", "eval.sample_tokens=0", "train.max_steps=1")
    assert Trainer(cfg, cfg.logging.run_dir).run().step == 1


def test_tensorboard_gets_the_scalars(make_config: MakeConfig) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_config("logging.tensorboard=true", "train.max_steps=4", "eval.every=2")
    result = _train(cfg)
    run_dir = Path(cfg.logging.run_dir)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss"} <= tags
    assert "mfu" not in tags  # n/a on a CPU: nothing rather than a made-up number
    losses = [e.value for e in events.Scalars("loss")]
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    assert losses == pytest.approx(result.losses, rel=1e-6)
    assert [e.step for e in events.Scalars("val_loss")] == [2, 4]
    assert "samples/text_summary" in events.Tags()["tensors"]


class _FakeRun:
    def __init__(self, calls: dict[str, Any]) -> None:
        self.calls = calls

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        self.calls["log"].append((step, data))

    def finish(self) -> None:
        self.calls["finished"] += 1


class _FakeTable:
    def __init__(self, columns: list[str]) -> None:
        self.rows: list[tuple[Any, ...]] = []

    def add_data(self, *row: Any) -> None:
        self.rows.append(row)


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A stand-in `wandb` module that records what it is given (nothing goes online)."""
    calls: dict[str, Any] = {"init": [], "log": [], "finished": 0}
    module = types.ModuleType("wandb")

    def init(**kwargs: Any) -> _FakeRun:
        calls["init"].append(kwargs)
        return _FakeRun(calls)

    module.init = init  # type: ignore[attr-defined]
    module.Table = _FakeTable  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_offline_gets_the_metrics_and_the_config(
    make_config: MakeConfig, fake_wandb: dict[str, Any]
) -> None:
    cfg = make_config("logging.wandb=true", "train.max_steps=4", "eval.every=2")
    result = _train(cfg)
    (init,) = fake_wandb["init"]
    assert init["mode"] == "offline" and init["dir"] == str(cfg.logging.run_dir)
    assert init["config"]["logging"]["wandb"] is True
    assert init["config"]["model"]["vocab_size"] == 300  # the resolved config
    scalars = [(step, d) for step, d in fake_wandb["log"] if "loss" in d]
    assert [step for step, _ in scalars] == [1, 2, 3, 4]
    assert [d["loss"] for _, d in scalars] == result.losses
    assert {"lr", "grad_norm", "tokens_per_s"} <= set(scalars[0][1])
    assert [step for step, d in scalars if "val_loss" in d] == [2, 4]
    tables = [d["samples"] for _, d in fake_wandb["log"] if "samples" in d]
    assert len(tables) == 2 and tables[0].rows[0][0] == "Once upon a time"
    assert fake_wandb["finished"] == 1


@pytest.mark.parametrize(
    ("option", "module"), [("logging.tensorboard", "tensorboard"), ("logging.wandb", "wandb")]
)
def test_a_missing_backend_package_is_a_clear_error_at_start(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, option: str, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    cfg = make_config(f"{option}=true")
    with pytest.raises(KilnError, match=rf"{option} = true needs.*pip install {module}"):
        Trainer(cfg, cfg.logging.run_dir)
    assert not (Path(cfg.logging.run_dir) / "checkpoints").exists()
