"""A MoE run logs per-layer expert load, moves its balancing biases, and plots the load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.model.moe import moe_layers
from kiln.train.report import plot_run
from kiln.train.trainer import Trainer

from .conftest import MakeConfig


def test_moe_run_logs_expert_load_and_updates_the_bias(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    cfg = make_config(
        "train.max_steps=3", "logging.every=1", "model.moe.n_experts=4", "model.moe.top_k=2",
        "model.moe.d_expert=32", "model.moe.expert_bias=true", "model.moe.bias_update_rate=0.01",
        "model.moe.aux_loss=0.01",
    )  # fmt: skip
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    n_layer = trainer.model_cfg.n_layer
    for record in records:
        for i in range(n_layer):
            assert 0 <= record[f"moe.L{i}.load_min"] <= 1 <= record[f"moe.L{i}.load_max"] <= 4
            assert 0 < record[f"moe.L{i}.load_entropy"] <= 1
        assert "moe.dead_experts" in record
    biases = [layer.expert_bias for layer in moe_layers(trainer.model)]
    assert all(b is not None and bool(b.abs().sum() > 0) for b in biases)  # moved off zero
    for b in biases:  # ±rate per step: a multiple of 0.01 no larger than 3 steps' worth
        assert float(b.abs().max()) <= 0.03 + 1e-6
    report = plot_run(tmp_path / "run")
    assert any(p.name == "expert_load.png" for p in report.pngs)
    assert torch.equal(
        trainer.model.state_dict()["blocks.0.mlp.expert_bias"], biases[0]
    )  # the bias is checkpointed state
