"""`train.fp8`: the switch converts the run's linear layers, picks a backend, logs it, and trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.config import ConfigError
from kiln.quant import fp8_train
from kiln.quant.formats import E4M3
from kiln.quant.fp8_train import Fp8TrainLinear, qdq
from kiln.train.trainer import Trainer

from .conftest import MakeConfig


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head]


@pytest.mark.parametrize("mode", ["tensor", "block"])
def test_an_fp8_run_trains_and_says_which_path(make_config: MakeConfig, mode: str) -> None:
    cfg = make_config(f"train.fp8={mode}", "train.max_steps=12", "eval.every=0")
    trainer = Trainer(cfg, cfg.logging.run_dir)
    layers = _linears(trainer.model)
    assert layers and all(isinstance(m, Fp8TrainLinear) for m in layers)
    assert trainer.model.lm_head.__class__ is nn.Linear  # the head stays in full precision
    result = trainer.run()
    assert sum(result.losses[-3:]) / 3 < result.losses[0] - 0.5  # it learned
    first = json.loads((Path(cfg.logging.run_dir) / "metrics.jsonl").read_text().splitlines()[0])
    assert first["fp8"]["mode"] == mode and first["fp8"]["backend"] == "emulated"
    # the trained layer's matmul is quantize → dequantize → matmul, exactly
    layer = layers[0]
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    scaling = "1x128" if mode == "block" else "tensor"
    wscale = "128x128" if mode == "block" else "tensor"
    want = qdq(x, E4M3, scaling) @ qdq(layer.weight.detach(), E4M3, wscale).T
    if layer.bias is not None:
        want = want + layer.bias
    with torch.no_grad():
        assert torch.equal(layer(x), want)
        assert not torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


def test_fp8_off_leaves_plain_linear_layers(make_config: MakeConfig) -> None:
    cfg = make_config("train.max_steps=1")
    trainer = Trainer(cfg, cfg.logging.run_dir)
    assert not any(isinstance(m, Fp8TrainLinear) for m in trainer.model.modules())
    assert trainer.fp8 == {"mode": "off"}


def test_the_log_names_the_backend(make_config: MakeConfig, capsys: pytest.CaptureFixture) -> None:
    cfg = make_config("train.fp8=tensor_delayed", "train.max_steps=1")
    Trainer(cfg, cfg.logging.run_dir)
    out = capsys.readouterr().out
    assert "fp8 tensor_delayed (delayed)" in out and "emulated: cpu has no fp8 tensor cores" in out


def test_a_bad_fp8_mode_names_the_field(make_config: MakeConfig) -> None:
    with pytest.raises(ConfigError, match=r"train\.fp8 = 'e4m3': expected 'off' or 'tensor'"):
        make_config("train.fp8=e4m3")


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    return torch.device("cuda", 0)


def test_scaled_mm_is_chosen_only_with_fp8_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fp8_train.select_backend("tensor", torch.device("cpu"))[0] == "emulated"
    hopper = _fake_cuda(monkeypatch, (9, 0))
    assert fp8_train.select_backend("tensor", hopper) == (
        "scaled_mm",
        "torch._scaled_mm on Fake GPU",
    )
    assert fp8_train.select_backend("delayed", hopper)[0] == "scaled_mm"
    assert fp8_train.select_backend("blockwise", hopper)[0] == "emulated"  # no block GEMM in torch
    ampere = _fake_cuda(monkeypatch, (8, 0))
    assert fp8_train.select_backend("tensor", ampere)[0] == "emulated"
    ada = _fake_cuda(monkeypatch, (8, 9))
    assert fp8_train.select_backend("tensor", ada)[0] == "scaled_mm"
    monkeypatch.delattr(torch, "_scaled_mm")
    assert fp8_train.select_backend("tensor", ada)[0] == "emulated"


def test_the_scaled_mm_layer_refuses_block_scaling() -> None:
    with pytest.raises(Exception, match="does not run recipe 'blockwise'"):
        Fp8TrainLinear(nn.Linear(16, 16), "blockwise", "scaled_mm")


@pytest.mark.skipif(
    not (torch.cuda.is_available() and fp8_train.fp8_tensor_cores(torch.device("cuda"))),
    reason="needs a CUDA device with fp8 tensor cores",
)
def test_scaled_mm_matches_the_emulation_on_a_device() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 128, bias=False).cuda()
    emu, real = Fp8TrainLinear(linear, "tensor"), Fp8TrainLinear(linear, "tensor", "scaled_mm")
    x = torch.randn(64, 256, device="cuda")
    assert torch.allclose(real(x), emu(x), rtol=1e-2, atol=1e-2)
