"""`kiln eval --bpb FILE --context ...`: bits per byte by context length and by position."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kiln.errors import KilnError
from kiln.eval.context import context_curve, parse_contexts, read_text_prefix, with_context
from kiln.model import ModelConfig
from kiln.tokenizer import Tokenizer

from .conftest import ASSET, random_model, random_tiny
from .test_cli import hf_dir as hf_dir  # the fixture, reused
from .test_cli import run


def brute_force_bpb(model, tok: Tokenizer, ids: list[int], length: int) -> float:
    """Every chunk of `length` tokens scored by a plain forward, bytes summed token by token."""
    nats = nbytes = 0.0
    for start in range(0, len(ids) // length * length, length):
        chunk = torch.tensor([ids[start : start + length]])
        with torch.no_grad():
            logp = model(chunk[:, :-1]).log_softmax(-1)[0]
        nats -= float(logp.gather(1, chunk[0, 1:, None]).sum())
        nbytes += sum(len(tok.decode_bytes([t])) for t in ids[start + 1 : start + length])
    return nats / (math.log(2) * nbytes)


def test_curve_equals_brute_force_and_buckets_add_up(tok: Tokenizer) -> None:
    model = random_tiny()  # block size 128; 256 runs with extended plain RoPE
    curve = context_curve(model, tok, ASSET, [16, 64, 256], n_tokens=1024)
    ids = tok.encode_ordinary(read_text_prefix(ASSET, 8 * 1024))[:1024]  # what the curve reads
    for length in (16, 64):
        assert curve.bpb[length] == pytest.approx(
            brute_force_bpb(model, tok, ids, length), rel=1e-5
        )
    for length, buckets in curve.buckets.items():
        assert [lo for lo, _, _ in buckets][:3] == [1, 2, 4] and buckets[-1][1] == length
    assert set(curve.bpb) == {16, 64, 256} and curve.n_tokens == 1024


def test_extension_keeps_the_weights_and_learned_positions_cannot_extend() -> None:
    model = random_tiny()
    longer = with_context(model, 512, None)
    assert longer.cfg.block_size == 512
    idx = torch.randint(0, 512, (1, 100))
    with torch.no_grad():
        torch.testing.assert_close(longer(idx), model(idx), rtol=0, atol=0)
    gpt = random_model(ModelConfig(vocab_size=400, block_size=64, n_layer=1, n_head=2, n_embd=32))
    with pytest.raises(KilnError, match="learned absolute positions cannot extend"):
        with_context(gpt, 128, None)
    with pytest.raises(KilnError, match="must be >= 2"):
        parse_contexts("1,64")


def test_command_line_writes_the_table_json_and_plot(
    capsys: pytest.CaptureFixture[str],
    hf_dir: Path,
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "r.json", tmp_path / "ctx.png"
    code, stdout, err = run(
        capsys, "eval", str(hf_dir), "--bpb", str(ASSET), "--context", "32,256",
        "--context-tokens", "512", "--rope-scaling", "none,yarn:2", "--plot", str(png),
        "--dtype", "fp32", "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert "context    256" in stdout and "[yarn:2]" in stdout
    doc = json.loads(out.read_text())["context"]
    none, yarn = doc["curves"]
    assert none["rope_scaling"] is None and yarn["rope_scaling"] == "yarn:2"
    assert none["bpb"]["256"] != yarn["bpb"]["256"]  # the scaling changes the model
    assert png.read_bytes()[:4] == b"\x89PNG"
    code, _, err = run(capsys, "eval", str(hf_dir), "--val", "x", "--context", "32")
    assert code != 0 and "--context needs --bpb" in err
