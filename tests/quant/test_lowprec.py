"""fp8 / MXFP8 / MXFP4 / NVFP4 weights in a model: logits, bytes, the head, commands, errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.cli import main
from kiln.errors import KilnError
from kiln.model.generate import generate
from kiln.model.hf import save_hf_dir
from kiln.quant.lowprec import LowPrecLinear
from kiln.quant.quantize import model_bytes, quantize_model
from kiln.serve.engine import Engine, EngineConfig, SamplingParams
from tests.fixtures import single_torch_thread
from tests.quant.test_quantize import tiny_model

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)

SETTINGS = [  # (mode, fp8 format, fp8 scaling, logits tolerance)
    ("fp8", "e4m3", "tensor", 0.06), ("fp8", "e4m3", "128x128", 0.06),
    ("fp8", "e5m2", "1x128", 0.12), ("mxfp8", "e4m3", "128x128", 0.06),
    ("nvfp4", "e4m3", "128x128", 0.3), ("mxfp4", "e4m3", "128x128", 0.4),
]  # fmt: skip


def logits_error(model: nn.Module, mode: str, fmt: str, scaling: str) -> float:
    """Relative change of the logits when every linear layer (the head too) takes the format."""
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    m = copy.deepcopy(model)
    with torch.no_grad():
        want = model(x)
        quantize_model(m, mode, include_head=True, fp8_format=fmt, fp8_scaling=scaling)
        return float((m(x) - want).norm() / want.norm())


@pytest.mark.parametrize(("mode", "fmt", "scaling", "tolerance"), SETTINGS)
def test_logits_stay_close_to_fp32(mode: str, fmt: str, scaling: str, tolerance: float) -> None:
    assert logits_error(tiny_model(), mode, fmt, scaling) < tolerance


def test_more_bits_change_the_logits_less() -> None:
    model = tiny_model()
    err = {
        mode: logits_error(model, mode, "e4m3", "1x128")
        for mode in ("fp8", "mxfp8", "nvfp4", "mxfp4")
    }
    assert err["fp8"] * 3 < err["nvfp4"] and err["mxfp8"] * 3 < err["nvfp4"] < err["mxfp4"]


def test_the_layer_computes_x_times_its_dequantized_weight() -> None:
    linear = nn.Linear(64, 40, bias=True)
    layer = LowPrecLinear(linear, "nvfp4")
    x = torch.randn(5, 3, 64)
    want = nn.functional.linear(x, layer.dequantized_weight(), linear.bias)
    assert torch.equal(layer(x), want)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # as a plain Linear under autocast
    assert torch.equal(layer.weight, layer.dequantized_weight())


def test_model_bytes_are_the_formats_bits_per_weight() -> None:
    model = tiny_model(tie_embeddings=False)
    linears = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    fp32 = sum(4 * m.weight.numel() for m in linears)
    n = sum(m.weight.numel() for m in linears)  # in_features 64 and 192: whole blocks
    tiles = sum(-(-m.out_features // 128) * -(-m.in_features // 128) for m in linears)
    before = model_bytes(model)
    expect = {  # codes + scales, byte for byte
        ("fp8", "tensor"): n + 4 * len(linears),
        ("fp8", "1x128"): n + 4 * sum(m.out_features * -(-m.in_features // 128) for m in linears),
        ("fp8", "128x128"): n + 4 * tiles,
        ("mxfp8", ""): n + n // 32,  # one E8M0 byte per 32: 8.25 bits a weight
        ("mxfp4", ""): n // 2 + n // 32,  # 4.25 bits
        ("nvfp4", ""): n // 2 + n // 16 + 4 * len(linears),  # 4.5 bits + one fp32 a tensor
    }
    for (mode, scaling), size in expect.items():
        report = quantize_model(copy.deepcopy(model), mode, fp8_scaling=scaling or "128x128")
        assert report.bytes_after == before - fp32 + size, (mode, scaling)
        assert report.layers == len(linears)
        assert report.paths == {"dequant": len(linears)}


def test_a_tied_head_gets_a_low_precision_copy_and_the_loss_reads_it() -> None:
    model = tiny_model()
    both = copy.deepcopy(model)
    report = quantize_model(both, "mxfp8", include_head=True)
    assert isinstance(both.lm_head, LowPrecLinear) and report.head.startswith("quantized copy")
    assert torch.equal(both.wte.weight, model.wte.weight)
    ids = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        assert float(both(ids, ids)) == pytest.approx(float(model(ids, ids)), rel=0.02)


def test_bad_settings_fail_clearly_and_leave_the_model_untouched() -> None:
    model = tiny_model()
    with pytest.raises(KilnError, match=r"fp8 format must be one of e4m3, e5m2, got 'e4m4'"):
        quantize_model(model, "fp8", fp8_format="e4m4")
    with pytest.raises(KilnError, match=r"fp8 scaling must be one of tensor, 1x128, 128x128"):
        quantize_model(model, "fp8", fp8_scaling="32x32")
    with pytest.raises(KilnError, match=r"kiln has no native nvfp4 kernel"):
        quantize_model(model, "nvfp4", kernel="torch")
    with torch.no_grad():
        model.blocks[1].mlp.fc.weight[0, 0] = float("nan")
    with pytest.raises(
        KilnError, match=r"quantize mxfp4: blocks\.1\.mlp\.fc's weight holds inf or NaN"
    ):
        quantize_model(model, "mxfp4")
    assert not any(isinstance(m, LowPrecLinear) for m in model.modules())  # checked before any
    good = tiny_model()
    quantize_model(good, "fp8")
    with pytest.raises(KilnError, match="already quantized"):
        quantize_model(good, "nvfp4")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model exported as an HF folder (no tokenizer: prompts are token ids)."""
    path = tmp_path_factory.mktemp("hf-tiny-lowprec")
    save_hf_dir(tiny_model(seed=3), path)
    return path


def test_kiln_sample_takes_the_float_formats(
    hf_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sample", str(hf_model), "--prompt-ids", "5,6,7", "--max-tokens", "6"]
    argv += ["--temperature", "0", "--dtype", "fp32", "--stop-id", "-1"]
    assert (
        main([*argv, "--quantize", "fp8", "--quantize-fp8", "e5m2", "--quantize-scaling", "1x128"])
        == 0
    )
    out, err = capsys.readouterr()
    assert "kiln sample: quantize fp8 (e5m2, 1x128 blocks): 8 linear layers (8 by dequantize" in err
    model = tiny_model(seed=3)
    quantize_model(model, "fp8", fp8_format="e5m2", fp8_scaling="1x128")
    assert [int(t) for t in out.split()] == generate(model, [[5, 6, 7]], 6, temperature=0)[0]
    assert main([*argv, "--quantize", "nvfp4", "--quantize-head"]) == 0
    err = capsys.readouterr().err
    assert (
        "quantize nvfp4 (e2m1, 16-element blocks, e4m3 scales + fp32 tensor scale): 9 linear" in err
    )
    assert main([*argv, "--quantize", "mxfp4", "--quantize-fp8", "e4m3"]) == 2
    assert (
        "kiln: error: kiln sample: --quantize-fp8 applies to --quantize fp8 only, got --quantize mxfp4"
        in (capsys.readouterr().err)
    )


@pytest.mark.parametrize("mode", ["fp8", "nvfp4"])
def test_the_engine_serves_a_low_precision_model_as_generate_does(mode: str) -> None:
    model = tiny_model(seed=4, block_size=128)
    quantize_model(model, mode, include_head=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 50))]
    want = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    engine = Engine(model, None, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [c[0].token_ids for c in engine.generate(prompts, params)] == want
