"""µP: per-role learning rates and init derived from the width multiplier, SP at the base width,
and the record a checkpoint keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.model import ModelConfig, Transformer
from kiln.train.config import OptimConfig
from kiln.train.mup import apply_mup_init, mup_record
from kiln.train.optim import build_optimizer, split_parameters
from kiln.train.trainer import Trainer

from .conftest import MakeConfig


def cfg_at(width: int, base: int | None = 64, **overrides: object) -> ModelConfig:
    """The tiny preset at this width (4 heads, so head width grows with it), µP from `base`."""
    return ModelConfig.preset(
        "tiny", n_embd=width, n_head=4, n_kv_head=4, mup_base_width=base, **overrides
    )


def lr_by_role(cfg: ModelConfig, name: str) -> dict[str, float]:
    """The peak lr each parameter role ends up with."""
    model = Transformer(cfg)
    optimizer = build_optimizer(model, OptimConfig(name=name, lr=0.01), torch.device("cpu"))
    lr_of = {id(p): g["peak_lr"] for g in optimizer.param_groups for p in g["params"]}
    roles = split_parameters(model)
    return {role: {lr_of[id(p)] for _, p in named}.pop() for role, named in roles.items() if named}


@pytest.mark.parametrize(("name", "hidden"), [("adamw", 0.01 / 4), ("muon", 0.01 / 2)])
def test_hidden_lr_scales_with_width_and_the_rest_does_not(name: str, hidden: float) -> None:
    lrs = lr_by_role(cfg_at(256, tie_embeddings=False, bias=True), name)
    assert lrs == pytest.approx({"hidden": hidden, "head": 0.01, "embedding": 0.01, "vector": 0.01})
    sp = lr_by_role(cfg_at(256, base=None, tie_embeddings=False, bias=True), name)
    assert set(sp.values()) == {0.01}


def test_init_std_of_hidden_matrices_shrinks_as_one_over_root_width() -> None:
    torch.manual_seed(0)
    model = Transformer(cfg_at(1024))
    apply_mup_init(model)
    block = model.blocks[0]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02 / 4, rel=0.02)
    assert model.wte.weight[:512].std().item() == pytest.approx(0.02, rel=0.02)


def test_at_the_base_width_mup_is_standard_parameterisation() -> None:
    sp, mup = cfg_at(64, base=None), cfg_at(64, base=64)
    assert mup.width_mult == 1.0 and mup.attention_scale == pytest.approx(1 / 16**0.5)
    torch.manual_seed(0)
    a = Transformer(sp)
    torch.manual_seed(0)
    b = Transformer(mup)
    apply_mup_init(b)
    idx = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(a(idx), b(idx), rtol=0, atol=0)
    assert lr_by_role(sp, "adamw") == lr_by_role(mup, "adamw")


def test_attention_scale_is_one_over_d_relative_to_the_base() -> None:
    # 4 heads: head width 16 at the base (64), 64 at 4x; 1/√16 there, √16/64 = 1/16 here
    assert cfg_at(256).attention_scale == pytest.approx(1 / 16)
    assert cfg_at(256, base=None).attention_scale is None  # SP: 1/√D


def test_checkpoint_records_the_mup_hyper_parameters(make_config: MakeConfig) -> None:
    cfg = make_config(
        "model.n_embd=128", "model.mup_base_width=64", "optim.lr=0.004", "train.max_steps=2",
        "checkpoint.every=2",
    )  # fmt: skip
    Trainer(cfg, cfg.logging.run_dir).run()
    state_file = Path(cfg.logging.run_dir) / "checkpoints" / "step_2" / "state.json"
    state = json.loads(state_file.read_text())
    assert state["mup"]["width_mult"] == 2.0
    assert state["mup"]["lr"]["hidden"] == pytest.approx(0.002)
    assert state["mup"]["lr"]["embedding"] == pytest.approx(0.004)
    assert state["config"]["model"]["mup_base_width"] == 64
    assert mup_record(cfg_at(64, base=None), "adamw", 0.01) is None
