"""`kiln prune`: a pruned run folder that loads, exports to HF with the same logits, heals with
`kiln distill`, and refuses calibration data of another tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.cli import main
from kiln.errors import KilnError
from kiln.loading import load_model
from tests.fixtures import require_shared, tiny_story_dataset
from tests.posttrain.test_distill import SHARED, dataset, teacher

HEAL = Path(__file__).resolve().parents[2] / "configs" / "heal.toml"
__all__ = ["dataset", "teacher"]  # the fixtures, shared with the distillation tests


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network for transformers: everything must come from the exported directory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def pruned(teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The teacher (2 blocks, 4 heads in 2 groups, width 64, MLP 192) pruned on every axis."""
    out = tmp_path_factory.mktemp("pruned") / "run"
    argv = ["prune", str(teacher), str(out), "--n-layer", "1", "--n-head", "2",
            "--n-embd", "48", "--d-ff", "96", "--batches", "2", "--seq-len", "32"]  # fmt: skip
    assert main(argv) == 0
    return out


def test_the_pruned_folder_loads_with_the_new_config_and_parameter_count(
    teacher: Path, pruned: Path
) -> None:
    loaded = load_model(pruned, dtype="fp32")
    cfg = loaded.model.cfg
    assert (cfg.n_layer, cfg.n_head, cfg.kv_heads, cfg.n_embd, cfg.ff_size) == (1, 2, 2, 48, 96)
    record = json.loads((pruned / "prune.json").read_text())
    n = sum(p.numel() for p in loaded.model.parameters())
    assert record["params_after"] == n == cfg.num_params()
    assert record["params_before"] == load_model(teacher, dtype="fp32").model.cfg.num_params()
    assert record["calibration_tokens"] == 2 * 8 * 32
    assert loaded.tokenizer is not None and loaded.tokenizer.n_vocab == cfg.vocab_size


def test_the_pruned_model_exports_to_hf_with_the_same_logits(
    pruned: Path, tmp_path: Path, offline: None
) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["export", str(pruned), "--hf", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.num_hidden_layers == 1 and hf.config.hidden_size == 48
    model = load_model(pruned, dtype="fp32").model
    x = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=0, atol=1e-5)


def test_a_pruned_model_heals_by_distillation_from_the_unpruned_one(
    teacher: Path, pruned: Path, dataset: Path, tmp_path: Path
) -> None:
    from kiln.posttrain.distill import build_trainer, load_distill_config

    run = tmp_path / "heal"
    sets = [
        f"distill.teacher={teacher}", f"distill.student={pruned}", f"data.dataset={dataset}",
        "data.seq_len=32", "batch.global_tokens=256", "batch.micro_batch=4",
        "train.time_budget=none", "train.max_steps=3", "train.dtype=fp32", "eval.batches=1",
        "eval.every=3", f"logging.run_dir={run}", "logging.progress=false",
    ]  # fmt: skip
    cfg = load_distill_config(HEAL, sets)
    trainer = build_trainer(cfg, run)
    start = load_model(pruned, dtype="fp32").model.state_dict()
    assert all(torch.equal(t, start[k]) for k, t in trainer.model.state_dict().items())
    result = trainer.run()
    assert result.step == 3 and result.val_loss is not None
    healed = load_model(run, dtype="fp32").model
    assert healed.cfg == load_model(pruned, dtype="fp32").model.cfg
    with pytest.raises(KilnError, match=r"model\.n_embd: the student is distill\.student"):
        build_trainer(load_distill_config(HEAL, [*sets, "model.n_embd=64"]), tmp_path / "x")


def test_calibration_data_of_another_tokenizer_is_refused(
    teacher: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "other").mkdir()
    other = tiny_story_dataset(require_shared(SHARED), tmp_path / "other", 30_000)
    out = tmp_path / "out"
    assert main(["prune", str(teacher), str(out), "--n-layer", "1", "--data", str(other)]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(other) in err and "same tokenizer" in err
    assert not out.exists()
