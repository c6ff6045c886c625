"""The loop: accumulation check, exact resume, refusals, non-finite steps, checkpoint files."""

from __future__ import annotations

import json
import math
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
from kiln.errors import KilnError
from kiln.train import checkpoint as ckpt
from kiln.train.trainer import NonFiniteError, Trainer, accumulation_steps

from .conftest import MakeConfig


def _records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors"))


def test_accumulation_steps_divides_exactly_or_says_what_would() -> None:
    assert accumulation_steps(256, 1, 4, 32) == 2
    assert accumulation_steps(512, 2, 4, 32) == 2
    with pytest.raises(KilnError) as info:
        accumulation_steps(300, 2, 4, 32)
    message = str(info.value)
    assert "batch.global_tokens (300)" in message and "2 × 4 × 32 = 256" in message
    assert "256 or 512" in message


def test_trainer_refuses_a_global_batch_that_does_not_split(make_config: MakeConfig) -> None:
    with pytest.raises(KilnError, match=r"global_tokens \(200\) must be a multiple"):
        Trainer(make_config("batch.global_tokens=200"), make_config().logging.run_dir)


@pytest.mark.parametrize(
    ("options", "signum"),
    [
        (["train.dtype=fp32", "optim.name=adamw", "model.dropout=0.1"], signal.SIGINT),
        (
            ["train.dtype=bf16", "optim.name=muon", "schedule.name=wsd", "model.dropout=0.1"],
            signal.SIGTERM,
        ),
    ],
)
@pytest.mark.kernels
def test_resume_equals_an_uninterrupted_run_bit_for_bit(
    make_config: MakeConfig, options: list[str], signum: int
) -> None:
    """3 steps, a signal (checkpoint, exit), resume for 5 more == one 8-step run, exactly.

    Every variant trains with dropout and samples at its eval steps, so the RNG states must be
    restored (and the sampler must leave them alone) for the runs to match.
    """
    straight = make_config(*options, run="straight")
    Trainer(straight, straight.logging.run_dir).run()

    def interrupt(trainer: Trainer, step: int, loss: float) -> None:
        if step == 3:
            signal.raise_signal(signum)  # the real handler path: finish the step, save, return

    cut = make_config(*options, run="cut")
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs in the background
    first = Trainer(cut, cut.logging.run_dir, on_step=interrupt).run()
    assert first.interrupted and first.step == 3
    assert first.checkpoint == Path(cut.logging.run_dir) / "checkpoints" / "step_3"
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    resumed = Trainer(cut, cut.logging.run_dir, resume=True)
    assert resumed.step == 3 and resumed.tokens == 3 * 256
    second = resumed.run()
    assert second.step == 8 and not second.interrupted
    assert first.losses + second.losses == _losses(straight.logging.run_dir)

    a, b = _records(Path(straight.logging.run_dir)), _records(Path(cut.logging.run_dir))
    for key in ("step", "tokens", "loss", "lr", "grad_norm", "val_loss"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    wa, wb = _weights(Path(straight.logging.run_dir), 8), _weights(Path(cut.logging.run_dir), 8)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa = json.loads((Path(straight.logging.run_dir) / "checkpoints/step_8/state.json").read_text())
    sb = json.loads((Path(cut.logging.run_dir) / "checkpoints/step_8/state.json").read_text())
    assert sa["cursor"] == sb["cursor"] and sa["rng"] == sb["rng"]
    samples = [(Path(run.logging.run_dir) / "samples.jsonl").read_text() for run in (straight, cut)]
    assert samples[0] and samples[0] == samples[1]  # sampled at steps 4 and 8, alike


def _losses(run_dir: str) -> list[float]:
    return [r["loss"] for r in _records(Path(run_dir))]


def test_checkpoint_contents(make_config: MakeConfig) -> None:
    cfg = make_config()
    Trainer(cfg, cfg.logging.run_dir).run()
    run = Path(cfg.logging.run_dir)
    path = ckpt.latest_checkpoint(run / "checkpoints")
    assert path == run / "checkpoints" / "step_8"
    assert sorted(p.name for p in path.iterdir()) == [
        "model.safetensors", "optimizer.pt", "state.json"
    ]  # fmt: skip
    weights = load_file(str(path / "model.safetensors"))
    assert "wte.weight" in weights and "lm_head.weight" not in weights  # tied: stored once
    state = json.loads((path / "state.json").read_text())
    assert state["step"] == 8 and state["tokens"] == 8 * 256
    assert state["cursor"] == {"epoch": 0, "position": 8 * 8}
    assert set(state["rng"]["0"]) >= {"python", "numpy", "torch"}
    assert state["config"]["optim"]["lr"] == 3e-3 and state["config"]["model"]["n_layer"] == 2
    assert state["scheduler"]["name"] == "warmup_cosine" and state["scheduler"]["max_steps"] == 8
    assert state["kiln_version"] and "git_commit" in state
    config_toml = (run / "config.toml").read_text()
    assert "[model]" in config_toml and "vocab_size = 300" in config_toml
    records = _records(run)
    assert [r["step"] for r in records] == list(range(1, 9))
    first = records[0]
    assert set(first) >= {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"}
    assert first["mfu"] is None  # CPU: no peak to compare with
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8]
    assert records[-1]["loss"] < records[0]["loss"]


def test_resume_refuses_a_changed_model_or_data_config(
    make_config: MakeConfig, tiny_dataset: Path
) -> None:
    cfg = make_config("train.max_steps=2", "eval.batches=0")
    Trainer(cfg, cfg.logging.run_dir).run()
    run_dir = cfg.logging.run_dir
    with pytest.raises(KilnError, match=r"model\.n_layer: 2 -> 3"):
        Trainer(make_config("model.n_layer=3", "train.max_steps=4"), run_dir, resume=True)
    with pytest.raises(KilnError, match=r"data\.seq_len: 32 -> 16.*another logging\.run_dir"):
        Trainer(make_config("data.seq_len=16", "train.max_steps=4"), run_dir, resume=True)
    other = tiny_dataset.parent / "other_shards"
    tokenize_to_shards(
        TokenizeConfig(
            tokenizer=str(tiny_dataset.parent / "tok.json"), inputs=(str(tiny_dataset.parent / "stories.txt"),),
            out=str(other), val_docs=5, workers=1, progress=False, force=True,
        )
    )  # fmt: skip
    with pytest.raises(KilnError, match=r"dataset\.train_tokens: \d+ -> \d+"):
        Trainer(make_config(f"data.dataset={other}", "train.max_steps=4"), run_dir, resume=True)
    moved = tiny_dataset.parent / "moved_shards"
    shutil.copytree(tiny_dataset, moved, dirs_exist_ok=True)
    same = Trainer(make_config(f"data.dataset={moved}", "train.max_steps=2"), run_dir, resume=True)
    assert any(note.startswith("data.dataset:") for note in same.notes)
    # Hyper-parameters may change (a longer run, another lr); the change is reported.
    more = Trainer(make_config("train.max_steps=4", "optim.lr=1e-3"), run_dir, resume=True)
    assert "optim.lr: 0.003 -> 0.001" in more.notes and "train.max_steps: 2 -> 4" in more.notes


def test_fresh_run_refuses_a_used_run_dir_and_resume_needs_a_checkpoint(
    make_config: MakeConfig,
) -> None:
    cfg = make_config("train.max_steps=1", "eval.batches=0")
    with pytest.raises(KilnError, match="nothing to resume"):
        Trainer(cfg, cfg.logging.run_dir, resume=True)
    Trainer(cfg, cfg.logging.run_dir).run()
    with pytest.raises(KilnError, match="already holds checkpoints; pass --resume"):
        Trainer(cfg, cfg.logging.run_dir)


class _NanAt(nn.Module):
    """The model, except that forward call number `at` (0-based) returns a NaN loss."""

    def __init__(self, model: nn.Module, at: int) -> None:
        super().__init__()
        self.model, self.at, self.calls = model, at, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.model(x, y)
        self.calls += 1
        return loss * float("nan") if self.calls - 1 == self.at else loss


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(make_config: MakeConfig) -> None:
    cfg = make_config("checkpoint.every=2", "eval.batches=0")
    trainer = Trainer(cfg, cfg.logging.run_dir)
    trainer.train_model = _NanAt(trainer.model, at=2 * 3)  # step 4's first micro-step
    with pytest.raises(NonFiniteError) as info:
        trainer.run()
    checkpoints = Path(cfg.logging.run_dir) / "checkpoints"
    message = str(info.value)
    assert "step 4: non-finite loss nan" in message
    assert f"last good checkpoint is {checkpoints / 'step_2'}" in message
    assert "train.skip_nonfinite" in message
    assert ckpt.latest_checkpoint(checkpoints) == checkpoints / "step_2"
    assert [s for s, _ in ckpt.list_checkpoints(checkpoints)] == [2]
    weights = _weights(Path(cfg.logging.run_dir), 2)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert max(r["step"] for r in _records(Path(cfg.logging.run_dir))) == 3


def test_nonfinite_step_can_be_skipped_and_counted(make_config: MakeConfig) -> None:
    cfg = make_config("train.skip_nonfinite=true", "eval.batches=0")
    trainer = Trainer(cfg, cfg.logging.run_dir)
    trainer.train_model = _NanAt(trainer.model, at=2 * 3 + 1)  # step 4's second micro-step
    before: dict[str, torch.Tensor] = {}

    def snapshot(t: Trainer, step: int, loss: float) -> None:
        if step == 3:
            before.update({k: v.clone() for k, v in t.model.state_dict().items()})
        if step == 4:  # the skipped step left the weights alone
            assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())

    trainer.on_step = snapshot
    result = trainer.run()
    assert result.step == 8 and math.isnan(result.losses[3])
    records = _records(Path(cfg.logging.run_dir))
    assert records[3]["loss"] is None and records[3]["skipped_steps"] == 1
    assert records[-1]["skipped_steps"] == 1 and math.isfinite(records[-1]["loss"])


def test_keep_last_k_checkpoints(make_config: MakeConfig) -> None:
    cfg = make_config("checkpoint.every=1", "checkpoint.keep_last=3", "eval.batches=0")
    Trainer(cfg, cfg.logging.run_dir).run()
    checkpoints = Path(cfg.logging.run_dir) / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(checkpoints)] == [6, 7, 8]
    assert (checkpoints / "latest").read_text().strip() == "step_8"
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".tmp")]


def test_a_checkpoint_directory_appears_only_complete(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config("checkpoint.every=2", "eval.batches=0")
    checkpoints = Path(cfg.logging.run_dir) / "checkpoints"
    seen: list[list[str]] = []
    real_save = torch.save

    def failing_save(obj: Any, path: Any) -> None:
        # While a checkpoint is being written, no step_N for it exists yet.
        seen.append(sorted(p.name for p in checkpoints.iterdir()))
        if Path(path).parent.name.startswith(".tmp-step_4"):
            raise OSError("disk full")
        real_save(obj, path)

    monkeypatch.setattr(ckpt.torch, "save", failing_save)
    trainer = Trainer(cfg, cfg.logging.run_dir)
    with pytest.raises(OSError, match="disk full"):
        trainer.run()
    assert seen[0] == [".tmp-step_2-" + str(__import__("os").getpid())]
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["latest", "step_2"]  # no step_4, no temporary left behind
    assert ckpt.latest_checkpoint(checkpoints) == checkpoints / "step_2"
    for _, path in ckpt.list_checkpoints(checkpoints):
        assert {p.name for p in path.iterdir()} == {
            "model.safetensors", "optimizer.pt", "state.json"
        }  # fmt: skip
