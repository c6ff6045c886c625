"""What the [parallel] mesh does not split yet is refused in one line, before any process work."""

from __future__ import annotations

import pytest

from kiln.errors import KilnError
from kiln.model import ModelConfig
from kiln.train.parallelize import _check_mesh_supports

SHAPE = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1}


@pytest.mark.parametrize(
    ("overrides", "shape", "message"),
    [({"mla": {"kv_rank": 16, "rope_dim": 8}}, {}, "does not split MLA"),
     ({"moe": {"n_experts": 4, "top_k": 2}}, {"tp": 2}, "does not split MoE"),
     ({"moe": {"n_experts": 4, "top_k": 2}}, {"pp": 2}, "model.moe")],
)  # fmt: skip
def test_unsupported_models_are_named(overrides: dict, shape: dict, message: str) -> None:
    cfg = ModelConfig.preset("tiny", **overrides)
    with pytest.raises(KilnError, match=message):
        _check_mesh_supports(cfg, {**SHAPE, **shape})


@pytest.mark.parametrize(
    "overrides",
    [{}, {"embed_scale": True}, {"mup_base_width": 32}, {"attn_sinks": True},
     {"pos_emb": "sinusoidal"}],
)  # fmt: skip
def test_models_the_pipeline_stage_runs_pass(overrides: dict) -> None:
    # the stage runs the model's own embed / blocks / head (their results: test_mesh.py)
    _check_mesh_supports(ModelConfig.preset("tiny", **overrides), {**SHAPE, "tp": 2, "pp": 2})
