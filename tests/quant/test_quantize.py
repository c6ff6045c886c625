"""Weight-only int8/int4 quantization: round trips, kernel vs fallback, model logits, bytes, errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.cli import main
from kiln.errors import KilnError
from kiln.model import ModelConfig, Transformer
from kiln.model.generate import generate
from kiln.model.hf import save_hf_dir
from kiln.quant.quantize import (
    QuantizedLinear,
    dequantize_int4,
    dequantize_int8,
    model_bytes,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    quantize_model,
    unpack_nibbles,
)
from kiln.serve.engine import Engine, EngineConfig, SamplingParams
from tests.fixtures import single_torch_thread

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)


def tiny_model(seed: int = 0, **overrides: object) -> Transformer:
    """The `tiny` preset (Llama-style, tied head, in_features 64 and 192) with its init weights."""
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("tiny", **{"vocab_size": 512, "block_size": 64, **overrides})
    return Transformer(cfg).eval()


def weight(n: int = 48, k: int = 128, seed: int = 0) -> torch.Tensor:
    """A weight with rows of very different scales (per-channel scaling has to matter)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]


def test_int8_round_trip_is_within_half_a_step_per_channel() -> None:
    w = weight()
    codes, scale = quantize_int8(w)
    assert codes.dtype == torch.int8 and scale.shape == (48,)
    assert int(codes.abs().max()) == 127  # each row's largest weight uses the full range
    err = (dequantize_int8(codes, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5)).all())
    # Relative to each row's scale, the error is the same for small and large rows.
    assert float((err.amax(dim=1) / w.abs().amax(dim=1)).max()) <= 0.5 / 127 + 1e-6


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_is_within_half_a_step_per_group(group_size: int) -> None:
    w = weight()
    codes, scale, zero = quantize_int4(w, group_size)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scale.shape == zero.shape == (48, 128 // group_size)
    err = (dequantize_int4(codes, scale, zero, group_size) - w).abs()
    step = scale.repeat_interleave(group_size, dim=1)  # (N, K): each weight's group step
    assert bool((err <= step / 2 * (1 + 1e-4) + 1e-7).all())
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    assert pack_nibbles(codes).shape == (48, 64)  # two codes per byte


def test_smaller_groups_quantize_more_accurately() -> None:
    w = weight()
    errs = [
        float((dequantize_int4(*quantize_int4(w, g), g) - w).pow(2).mean()) for g in (32, 64, 128)
    ]
    assert errs[0] < errs[1] < errs[2]
    codes, scale = quantize_int8(w)
    assert float((dequantize_int8(codes, scale) - w).pow(2).mean()) < errs[0] / 10


@pytest.mark.parametrize(("mode", "group_size"), [("int8", 64), ("int4", 32), ("int4", 128)])
def test_kernel_layer_equals_the_dequantize_fallback(mode: str, group_size: int) -> None:
    linear = nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        linear.weight.copy_(weight(96, 256, seed=1))
    fallback = QuantizedLinear(linear, mode, group_size, kernel="dequant")
    auto = QuantizedLinear(linear, mode, group_size, kernel="auto")
    x = torch.randn(2, 5, 256)
    with torch.no_grad():
        want = nn.functional.linear(x, fallback.dequantized_weight(), linear.bias)
        torch.testing.assert_close(fallback(x), want)
    assert fallback.kernel == "dequant"  # the fallback is exactly dequantize + matmul
    assert not auto.kernel_disagrees, auto.kernel_note  # a wrong kernel fails, never skips
    if auto.kernel != "torch":
        pytest.skip(f"torch's {mode} kernel does not run here: {auto.kernel_note}")
    with torch.no_grad():
        got = auto(x)
    assert got.dtype == torch.float32 and got.shape == (2, 5, 96)
    # The kernel path takes bf16 activations: agreement to bf16's precision of the output scale.
    assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())
    w_err = (auto.weight - fallback.weight).abs().amax(dim=1)  # the kernel's weight, read back
    assert bool((w_err <= 1e-2 * fallback.weight.abs().amax(dim=1)).all())  # bf16 scales


def test_a_kernel_that_disagrees_is_told_apart_from_one_that_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe's verdict the tests above rely on: a wrong kernel is flagged, never a skip."""
    linear = nn.Linear(256, 96, bias=False)
    real = QuantizedLinear._kernel_matmul
    monkeypatch.setattr(QuantizedLinear, "_kernel_matmul", lambda self, x: 2 * real(self, x))
    auto = QuantizedLinear(linear, "int8", kernel="auto")
    assert (auto.kernel, auto.kernel_disagrees) == ("dequant", True)
    assert "differs from the fallback" in auto.kernel_note
    with pytest.raises(KilnError, match="int8 kernel disagrees with the fallback"):
        QuantizedLinear(linear, "int8", kernel="torch")

    def cannot_run(self: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("no kernel for this device")

    monkeypatch.setattr(QuantizedLinear, "_kernel_matmul", cannot_run)
    missing = QuantizedLinear(linear, "int8", kernel="auto")
    assert (missing.kernel, missing.kernel_disagrees) == ("dequant", False)
    with pytest.raises(KilnError, match="int8 kernel does not run"):
        QuantizedLinear(linear, "int8", kernel="torch")


@pytest.mark.parametrize("mode", ["int8", "int4"])
@torch.no_grad()
def test_a_kernel_row_does_not_depend_on_the_rest_of_the_batch(mode: str) -> None:
    """The serving engine relies on it: a request's logits never change with batch composition.

    (The fallback's F.linear is an ordinary fp32 GEMM, made batch-invariant by the engine.)
    """
    layer = QuantizedLinear(nn.Linear(256, 512, bias=False), mode, 64)
    assert not layer.kernel_disagrees, layer.kernel_note
    if layer.kernel != "torch":
        pytest.skip(f"torch's {mode} kernel does not run here: {layer.kernel_note}")
    x = torch.randn(40, 256)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    for rows in (2, 7, 16, 40):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize(
    ("mode", "group_size", "kernel", "tolerance"),
    [("int8", 64, "dequant", 0.02), ("int8", 64, "auto", 0.03), ("int4", 32, "dequant", 0.15),
     ("int4", 64, "auto", 0.2)],
)  # fmt: skip
def test_quantized_model_logits_stay_close_to_fp32(
    mode: str, group_size: int, kernel: str, tolerance: float
) -> None:
    model = tiny_model()
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(x)
        quantize_model(model, mode, group_size, include_head=True, kernel=kernel)
        got = model(x)
    rel = float((got - want).norm() / want.norm())
    assert rel < tolerance
    # Most greedy choices survive quantization.
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) > 0.8


@pytest.mark.parametrize("faster", ["torch", "dequant"])
def test_int8_auto_runs_the_path_its_timed_probe_found_faster(
    monkeypatch: pytest.MonkeyPatch, faster: str
) -> None:
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    fallback = tiny_model()
    quantize_model(fallback, "int8", include_head=True, kernel="dequant")
    slower = {"torch": "dequant", "dequant": "torch"}[faster]
    seconds = {faster: 1e-3, slower: 2e-3, "unquantized": 5e-4}
    monkeypatch.setattr(QuantizedLinear, "seconds_per_call", lambda self, x, path: seconds[path])
    model = tiny_model()
    report = quantize_model(model, "int8", include_head=True)
    if not report.probe_s:
        pytest.skip(f"torch's int8 kernel does not run here: {report.kernel_notes}")
    assert report.paths == {faster: report.layers}
    assert report.probe_s == {p: s * report.layers for p, s in seconds.items()}
    assert ("timed probe" in report.describe()) and report.to_dict()["probe_s"] == report.probe_s
    with torch.no_grad():
        same = torch.equal(model(x), fallback(x))
    assert same == (faster == "dequant")  # the fallback path is exactly dequantize + matmul


def test_the_timed_probe_measures_both_int8_paths_on_this_machine() -> None:
    model = tiny_model()
    report = quantize_model(model, "int8")
    if not report.probe_s:
        pytest.skip(f"torch's int8 kernel does not run here: {report.kernel_notes}")
    assert set(report.probe_s) == {"torch", "dequant", "unquantized"}
    assert min(report.probe_s.values()) > 0
    paths = {p: report.probe_s[p] for p in ("torch", "dequant")}
    assert report.paths == {min(paths, key=paths.__getitem__): report.layers}


def test_int8_error_is_smaller_than_int4_error() -> None:
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    model = tiny_model()
    with torch.no_grad():
        want = model(x)
        errs = {}
        for mode in ("int8", "int4"):
            m = copy.deepcopy(model)
            quantize_model(m, mode, 64, include_head=True, kernel="dequant")
            errs[mode] = float((m(x) - want).norm())
    assert errs["int8"] * 4 < errs["int4"]


@pytest.mark.parametrize("group_size", [32, 64])
def test_model_bytes_shrink_as_the_formats_say(group_size: int) -> None:
    model = tiny_model(tie_embeddings=False)
    linears = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    fp32 = sum(4 * m.weight.numel() for m in linears)
    weights = sum(m.weight.numel() for m in linears)
    rows = sum(m.out_features for m in linears)
    before = model_bytes(model)
    int8 = quantize_model(copy.deepcopy(model), "int8", kernel="dequant")
    assert int8.bytes_before == before
    assert int8.bytes_after == before - fp32 + weights + 4 * rows  # codes + one fp32 scale a row
    int4 = quantize_model(copy.deepcopy(model), "int4", group_size, kernel="dequant")
    groups = weights // group_size
    assert int4.bytes_after == before - fp32 + weights // 2 + 8 * groups  # nibbles + scale, zero
    auto = quantize_model(copy.deepcopy(model), "int4", group_size)
    assert auto.bytes_after <= int4.bytes_after  # the kernel's copy replaces the fallback's
    assert (
        int4.layers == int8.layers == len(linears) == 4 * model.cfg.n_layer
    )  # qkv, proj, fc, proj


def test_a_tied_head_is_quantized_as_a_copy_only_when_asked() -> None:
    model = tiny_model()
    embedding = model.wte.weight.detach().clone()
    report = quantize_model(copy.deepcopy(model), "int8")
    assert report.head == "fp32"
    kept = copy.deepcopy(model)
    quantize_model(kept, "int8", include_head=False)
    assert kept.lm_head.weight is kept.wte.weight  # still tied, still fp32
    both = copy.deepcopy(model)
    report = quantize_model(both, "int8", include_head=True, kernel="dequant")
    assert isinstance(both.lm_head, QuantizedLinear) and report.head.startswith("quantized copy")
    assert torch.equal(both.wte.weight, embedding)  # the embedding lookup stays exact
    # The copy costs bytes: the fp32 embedding stays and the head's int8 codes are added.
    assert report.bytes_after > model_bytes(kept)
    ids = torch.randint(0, 512, (1, 16))
    with torch.no_grad():  # the LM loss reads the head's (dequantized) weight
        loss = both(ids, ids)
        assert float(loss) == pytest.approx(float(model(ids, ids)), rel=0.02)


def test_bad_settings_fail_clearly_and_leave_the_model_untouched() -> None:
    model = tiny_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        KilnError,
        match=r"quantize mode must be one of int8, int4, fp8, mxfp8, mxfp4, nvfp4, got 'int3'",
    ):
        quantize_model(model, "int3")
    with pytest.raises(KilnError, match=r"int4 group size must be one of 32, 64, 128, got 48"):
        quantize_model(model, "int4", 48)
    with pytest.raises(KilnError, match=r"kernel must be one of auto, torch, dequant"):
        quantize_model(model, "int8", kernel="fast")
    odd = tiny_model(n_embd=96, n_head=2, n_kv_head=1)  # in_features 96: 32 divides, 64 does not
    with pytest.raises(
        KilnError, match=r"int4 group size 64 does not divide blocks\.0\.attn\.qkv's in_features "
        r"96 \(group sizes that divide it: 32\)"
    ):  # fmt: skip
        quantize_model(odd, "int4", 64)
    assert not any(isinstance(m, QuantizedLinear) for m in odd.modules())  # checked before any
    quantize_model(odd, "int4", 32)  # the suggested group size works
    assert {k: torch.equal(v, state[k]) for k, v in model.state_dict().items()} == dict.fromkeys(
        state, True
    )
    quantize_model(model, "int8")
    with pytest.raises(KilnError, match="already quantized"):
        quantize_model(model, "int4")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model exported as an HF folder (no tokenizer: prompts are token ids)."""
    path = tmp_path_factory.mktemp("hf-tiny")
    save_hf_dir(tiny_model(seed=3), path)
    return path


def test_kiln_sample_quantize_option(hf_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sample", str(hf_model), "--prompt-ids", "5,6,7", "--max-tokens", "6"]
    argv += ["--temperature", "0", "--dtype", "fp32", "--stop-id", "-1"]
    assert main([*argv, "--quantize", "int8"]) == 0
    out, err = capsys.readouterr()
    assert "kiln sample: quantize int8 (per output channel): 8 linear layers" in err
    model = tiny_model(seed=3)
    quantize_model(model, "int8")
    assert [int(t) for t in out.split()] == generate(model, [[5, 6, 7]], 6, temperature=0)[0]
    assert main([*argv, "--quantize", "int4", "--quantize-group", "32", "--quantize-head"]) == 0
    err = capsys.readouterr().err
    assert "quantize int4 (group 32): 9 linear layers" in err and "head quantized copy" in err
    with pytest.raises(SystemExit):
        main([*argv, "--quantize", "int4", "--quantize-group", "48"])
    assert "--quantize-group: invalid choice: 48" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_engine_serves_a_quantized_model_as_generate_does(mode: str) -> None:
    """The server's path: greedy output on the engine equals `generate` on the same quantized model."""
    model = tiny_model(seed=4, block_size=128)
    quantize_model(model, mode, 32, include_head=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 50))]
    want = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    engine = Engine(model, None, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [c[0].token_ids for c in engine.generate(prompts, params)] == want
