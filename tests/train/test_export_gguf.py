"""`kiln export RUN --gguf OUT.gguf`: the file reads back through the `gguf` package with the
model's tensors, hyper-parameters and tokenizer (llama.cpp itself: tests/serve/test_llamacpp.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.chat import CHAT_TOKENS
from kiln.chat.tokens import with_chat_tokens
from kiln.cli import main
from kiln.errors import KilnError
from kiln.model.config import ModelConfig
from kiln.model.transformer import Transformer
from kiln.tokenizer import Tokenizer
from kiln.tokenizer.byte_unicode import token_string_to_bytes
from kiln.train.config import load_train_config
from kiln.train.export_gguf import describe_gguf, export_gguf, gguf_arch
from kiln.train.gguf_mixture import more_bits, q4_k_m_plan
from kiln.train.trainer import Trainer
from tests.fixtures import EOT

from .conftest import CONFIGS

gguf = pytest.importorskip("gguf", reason="the gguf extra is not installed")


@pytest.fixture(scope="module")
def trained(
    tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Transformer]:
    """A 2-step tiny Llama-style run and its trained model."""
    run = tmp_path_factory.mktemp("gguf") / "run"
    cfg = load_train_config(
        CONFIGS / "tiny.toml",
        [f"data.dataset={tiny_dataset}", f"logging.run_dir={run}", "logging.progress=false",
         "train.max_steps=2", "checkpoint.every=2", "eval.every=2"],
    )  # fmt: skip
    trainer = Trainer(cfg, run)
    trainer.run()
    return run, trainer.model.eval()


def _fields(reader: object) -> dict[str, object]:
    return {name: field.contents() for name, field in reader.fields.items()}  # type: ignore[attr-defined]


def _tensors(reader: object) -> dict[str, np.ndarray]:
    """Each tensor as float32 in PyTorch's (rows, cols) order."""
    out = {}
    for t in reader.tensors:  # type: ignore[attr-defined]
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists ne0 (the row length) first
        out[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    return out


def _halves(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the export's RoPE pairing: pairs (x0, y0, ...) back to kiln's halves."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def test_the_gguf_file_reads_back_with_the_weights_hparams_and_tokenizer(
    trained: tuple[Path, Transformer], tiny_dataset: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    run, model = trained
    cfg, sd = model.cfg, model.state_dict()
    out = tmp_path / "model.gguf"
    assert main(["export", str(run), "--gguf", str(out), "--quant", "f32"]) == 0
    assert "llama, f32" in capsys.readouterr().out
    reader = gguf.GGUFReader(out)
    f = _fields(reader)
    assert f["general.architecture"] == "llama"
    assert (f["llama.block_count"], f["llama.embedding_length"]) == (cfg.n_layer, cfg.n_embd)
    assert (f["llama.attention.head_count"], f["llama.attention.head_count_kv"]) == (
        cfg.n_head, cfg.kv_heads)  # fmt: skip
    assert f["llama.feed_forward_length"] == cfg.ff_size
    assert f["llama.rope.freq_base"] == pytest.approx(cfg.rope_theta)
    assert f["llama.context_length"] == cfg.block_size

    t = _tensors(reader)
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(cfg.n_layer)
        for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                  "ffn_gate", "ffn_up", "ffn_down")
    }  # fmt: skip
    assert set(t) == expected  # tied embeddings: no output.weight, llama.cpp reuses token_embd
    np.testing.assert_array_equal(t["token_embd.weight"], sd["wte.weight"][: cfg.vocab_size])
    q_out, kv_out = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
    q, k, v = sd["blocks.1.attn.qkv.weight"].split([q_out, kv_out, kv_out])
    np.testing.assert_array_equal(_halves(t["blk.1.attn_q.weight"], cfg.n_head), q)
    np.testing.assert_array_equal(_halves(t["blk.1.attn_k.weight"], cfg.kv_heads), k)
    np.testing.assert_array_equal(t["blk.1.attn_v.weight"], v)
    gate, up = sd["blocks.0.mlp.fc.weight"].chunk(2)
    np.testing.assert_array_equal(t["blk.0.ffn_gate.weight"], gate)
    np.testing.assert_array_equal(t["blk.0.ffn_up.weight"], up)

    tok = Tokenizer.load(tiny_dataset.parent / "tok.json")
    tokens = f["tokenizer.ggml.tokens"]
    types = f["tokenizer.ggml.token_type"]
    assert (f["tokenizer.ggml.model"], f["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    assert len(tokens) == cfg.vocab_size
    specials = set(tok.special_tokens.values())
    for i, b in tok.vocab.items():
        if i in specials:
            continue
        assert token_string_to_bytes(tokens[i]) == b and types[i] == 1
    assert tokens[tok.special_tokens[EOT]] == EOT and types[tok.special_tokens[EOT]] == 3
    assert f["tokenizer.ggml.eos_token_id"] == tok.special_tokens[EOT]
    merges = [tuple(map(token_string_to_bytes, m.split(" "))) for m in f["tokenizer.ggml.merges"]]
    assert merges == tok.merges
    assert f["tokenizer.ggml.add_bos_token"] is False
    assert "tokenizer.chat_template" not in f


def test_q8_0_and_q4_0_keep_each_weight_within_its_quantisation_step(
    trained: tuple[Path, Transformer], tmp_path: Path
) -> None:
    _, model = trained
    tok = _tiny_tokenizer(model.cfg.vocab_size)
    w = model.state_dict()["blocks.0.mlp.proj.weight"].numpy()
    # q8_0: step amax/127, rounded to nearest (half a step). q4_0: step amax/8 taken from the
    # signed extreme, so the other sign's extreme is clipped from +8 to +7 steps (a whole step).
    for quant, levels, steps in (("q8_0", 127, 0.5), ("q4_0", 8, 1.0)):
        out = export_gguf(model, tok, EOT, tmp_path / f"{quant}.gguf", quant)
        t = gguf.GGUFReader(out.out).tensors
        stored = {x.name: x for x in t}["blk.0.ffn_down.weight"]
        assert stored.tensor_type.name == quant.upper()
        got = _tensors(gguf.GGUFReader(out.out))["blk.0.ffn_down.weight"]
        blocks = np.abs(w.reshape(-1, 32)).max(axis=1, keepdims=True)
        # Plus the f16 rounding of each block's scale (relative 2^-11, times up to 8 or 127).
        bound = blocks / levels * steps + blocks * 2.0**-10
        err = np.abs(got.reshape(-1, 32) - w.reshape(-1, 32))
        assert (err <= bound + 1e-7).all(), quant
        assert err.max() > 0  # it really is quantised


def test_gpt2_exports_with_learned_positions_and_fused_qkv(tmp_path: Path) -> None:
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=320, block_size=64)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    tok, _ = with_chat_tokens(_tiny_tokenizer(300))
    export_gguf(model, tok, EOT, tmp_path / "g.gguf", "f32")
    reader = gguf.GGUFReader(tmp_path / "g.gguf")
    f, t = _fields(reader), _tensors(reader)
    assert f["general.architecture"] == "gpt2"
    assert f["gpt2.attention.layer_norm_epsilon"] == pytest.approx(cfg.norm_eps)
    sd = model.state_dict()
    np.testing.assert_array_equal(t["position_embd.weight"], sd["wpe.weight"])
    np.testing.assert_array_equal(t["blk.1.attn_qkv.weight"], sd["blocks.1.attn.qkv.weight"])
    np.testing.assert_array_equal(t["blk.1.attn_qkv.bias"], sd["blocks.1.attn.qkv.bias"])
    assert "blk.0.ffn_down.bias" in t and "output_norm.bias" in t
    # The chat tokens are control tokens and the template comes along for llama.cpp's chat.
    assert all(f["tokenizer.ggml.token_type"][tok.special_tokens[c]] == 3 for c in CHAT_TOKENS)
    assert "{%" in f["tokenizer.chat_template"]
    unused = f["tokenizer.ggml.token_type"][tok.n_vocab :]
    assert list(unused) == [5] * (cfg.vocab_size - tok.n_vocab)


def test_bad_requests_are_refused_in_one_line(
    trained: tuple[Path, Transformer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = trained
    out = tmp_path / "m.gguf"
    assert main(["export", str(run), "--gguf", str(out), "--quant", "q4_k_s"]) != 0
    err = capsys.readouterr().err
    assert "--quant 'q4_k_s': expected one of" in err and "q4_k_m" in err and not out.exists()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    # The tiny model's rows (64) hold no K-quant block: every matrix falls back, and says so.
    assert main(["export", str(run), "--gguf", str(out), "--quant", "q4_k_m"]) == 0
    said = capsys.readouterr().out
    assert "llama, q4_k_m" in said and "rows not a multiple of 256 fell back" in said
    assert "blk.*.attn_q.weight (64 columns) Q4_K->Q5_0 x2" in said
    out.unlink()
    assert main(["export", str(run), "--gguf", str(out)]) == 0
    before = out.read_bytes()
    assert main(["export", str(run), "--gguf", str(out)]) != 0
    assert "--force" in capsys.readouterr().err and out.read_bytes() == before
    assert main(["export", str(run), "--gguf", str(out), "--force", "--quant", "q8_0"]) == 0
    assert out.read_bytes() != before
    assert main(["export", str(run), "--hf", str(tmp_path / "hf"), "--quant", "q8_0"]) != 0
    assert "--gguf only" in capsys.readouterr().err
    assert list(tmp_path.glob(".*tmp")) == []
    for preset in ("moe-20m", "mla-20m"):
        with pytest.raises(KilnError, match=r"no llama\.cpp mapping"):
            gguf_arch(ModelConfig.preset(preset))


def test_the_q4_k_m_mixture_follows_llama_cpps_rule() -> None:
    # 8 layers: more_bits picks the first and last eighth (0, 7) and every third between (3, 6).
    assert [i for i in range(8) if more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(32) if more_bits(i, 32)] == [
        0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]  # fmt: skip
    shapes = {"token_embd.weight": (512, 256), "output_norm.weight": (256,)}
    for i in range(8):
        shapes |= {f"blk.{i}.attn_v.weight": (128, 256), f"blk.{i}.attn_q.weight": (256, 256),
                   f"blk.{i}.ffn_down.weight": (256, 768), f"blk.{i}.ffn_up.weight": (768, 256),
                   f"blk.{i}.attn_norm.weight": (256,)}  # fmt: skip
    types, fallbacks = q4_k_m_plan(shapes, 8)
    assert types["token_embd.weight"] == "Q6_K"  # tied: it is also the head
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(8)] == [
        "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]  # fmt: skip
    assert {types[f"blk.{i}.ffn_down.weight"] for i in (0, 3, 6, 7)} == {"Q6_K"}
    assert {types[f"blk.{i}.ffn_down.weight"] for i in (1, 2, 4, 5)} == {"Q4_K"}
    assert {types[f"blk.{i}.{n}.weight"] for i in range(8) for n in ("attn_q", "ffn_up")} == {
        "Q4_K"}  # fmt: skip
    assert types["output_norm.weight"] == "F32" and fallbacks == []
    # Untied: the head is Q6_K, the embedding Q4_K; GPT-2's fused qkv counts as attn_v.
    untied, _ = q4_k_m_plan({"token_embd.weight": (512, 256), "output.weight": (512, 256),
                             "blk.0.attn_qkv.weight": (768, 256),
                             "position_embd.weight": (64, 256)}, 1)  # fmt: skip
    assert untied == {"token_embd.weight": "Q4_K", "output.weight": "Q6_K",
                      "blk.0.attn_qkv.weight": "Q6_K", "position_embd.weight": "F16"}  # fmt: skip
    # Rows that are not whole super-blocks fall back as llama.cpp does.
    odd, fell = q4_k_m_plan({"blk.0.ffn_down.weight": (64, 704), "blk.1.ffn_down.weight": (64, 704),
                             "blk.1.ffn_up.weight": (64, 100)}, 2)  # fmt: skip
    assert odd == {"blk.0.ffn_down.weight": "Q5_0", "blk.1.ffn_down.weight": "Q8_0",
                   "blk.1.ffn_up.weight": "F16"}  # fmt: skip
    assert [(f.name, f.cols, f.wanted) for f in fell] == [
        ("blk.0.ffn_down.weight", 704, "Q4_K"), ("blk.1.ffn_down.weight", 704, "Q6_K"),
        ("blk.1.ffn_up.weight", 100, "Q4_K")]  # fmt: skip


def test_q4_k_m_writes_the_mixture_and_reports_its_fallbacks(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    tok = Tokenizer.load(tiny_dataset.parent / "tok.json")
    # n_embd 256 fills K-quant rows; ffn_down's rows (ff_size 704) do not and fall back.
    cfg = ModelConfig.preset("tiny", vocab_size=tok.n_vocab, n_embd=256, ff_multiple=64)
    assert cfg.ff_size % 256 != 0
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    result = export_gguf(model, tok, EOT, tmp_path / "m.gguf", "q4_k_m")
    reader = gguf.GGUFReader(result.out)
    stored = {t.name: t.tensor_type.name for t in reader.tensors}
    assert stored == result.types
    assert stored["token_embd.weight"] == "Q6_K"  # tied embeddings: the head
    assert [stored[f"blk.{i}.attn_v.weight"] for i in range(2)] == ["Q4_K", "Q6_K"]
    assert [stored[f"blk.{i}.ffn_down.weight"] for i in range(2)] == ["Q5_0", "Q8_0"]
    assert stored["blk.0.attn_q.weight"] == stored["blk.1.ffn_gate.weight"] == "Q4_K"
    assert stored["blk.0.attn_norm.weight"] == "F32"
    assert _fields(reader)["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    # Every weight decodes close to the model's: 4-bit steps are a few percent of the range.
    sd, t = model.state_dict(), _tensors(reader)
    w, got = sd["blocks.0.attn.proj.weight"].numpy(), t["blk.0.attn_output.weight"]
    assert np.sqrt(np.mean((got - w) ** 2)) < 0.1 * np.sqrt(np.mean(w**2))
    line = describe_gguf(result)
    assert "ffn_down.weight (704 columns) Q4_K->Q5_0" in line and "Q6_K->Q8_0" in line
    # Under 0.8 bytes per parameter (f16: 2), tokenizer and norms included.
    assert result.bytes < 0.8 * sum(a.numel() for a in sd.values())


def _tiny_tokenizer(n_vocab: int) -> Tokenizer:
    """Byte tokens plus merges of 'a'-led pairs, and the end-of-text token: n_vocab ids."""
    vocab = {i: bytes([i]) for i in range(256)}
    merges = []
    for i in range(n_vocab - 257):
        a, b = bytes([97 + i // 26]), bytes([97 + i % 26])
        merges.append((a, b))
        vocab[256 + i] = a + b
    return Tokenizer(vocab, merges, {EOT: n_vocab - 1})
