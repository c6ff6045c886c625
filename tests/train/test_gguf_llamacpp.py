"""llama.cpp (llama-cpp-python) loads `kiln export --gguf` files and computes kiln's model.

Marker `llamacpp`: skipped with the reason when llama-cpp-python (the llamacpp extra) is not
installed; `make test` runs these when it is (docs/export.md).

Tolerances, derived from where llama.cpp's arithmetic differs from kiln's fp32 forward:
- f32 file, f32 KV cache: only the order of fp32 sums differs. A dot product of n terms is off
  by at most about n·2^-24 of the sum of |terms| (Higham), and an error entering a matmul input
  is carried through the residual stream: over the 2·n_layer + 1 matmul stages, at most
  (2·n_layer + 1)·n·2^-24 relative to the largest logit, n = the widest dot product (d_ff).
- f16 file (llama.cpp's defaults, f16 KV cache): the weights are rounded to f16 in the file, so
  kiln's reference runs those same rounded weights in fp32; what remains is that ggml rounds
  every matmul's activations, and K and V in the cache, to f16: relative 2^-11 per stage, so at
  most (2·n_layer + 1)·2^-11 relative to the largest logit, then twice that for K and V's own
  rounding inside attention. Both bounds are worst-case sums; the measured errors sit far below.
Greedy tokens at f16 must then match exactly wherever kiln's top two logits are further apart
than twice that bound; the test model's logits are spread wide (weights drawn at std 0.3) so
that holds at every step, and the test checks it does rather than assuming it.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.generate import generate
from kiln.model.transformer import Transformer
from kiln.tokenizer import Tokenizer
from kiln.train.export_gguf import export_gguf
from tests.fixtures import EOT, require_shared

from .conftest import SHARED_DATA

pytestmark = pytest.mark.llamacpp
llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')"
)

N_PROMPTS, NEW_TOKENS = 20, 16
U16, U32 = 2.0**-11, 2.0**-24


def _prompts(tok: Tokenizer) -> list[str]:
    """The openings (first sentence or so) of 20 TinyStories validation stories."""
    path = require_shared(SHARED_DATA / "tinystories" / "valid.txt.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        text = f.read(200_000)
    stories = [s.strip() for s in text.split(EOT) if s.strip()]
    return [s[: 20 + 7 * i] for i, s in enumerate(stories[-N_PROMPTS:])]


def _model(cfg: ModelConfig) -> Transformer:
    """Random weights drawn wide (std 0.3) so the logits are far apart; norms stay at 1."""
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model


def _f16_weights(model: Transformer) -> Transformer:
    """The model with every matrix rounded to f16 (what an f16 GGUF holds), computed in fp32."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    return model


def _llama(path: Path, kv_f32: bool) -> object:
    kw = {"type_k": 0, "type_v": 0} if kv_f32 else {}
    return llama_cpp.Llama(str(path), n_ctx=256, n_threads=1, n_threads_batch=1,
                           logits_all=True, verbose=False, **kw)  # fmt: skip


def _llama_logits(llm: object, ids: list[int]) -> np.ndarray:
    llm.reset()  # type: ignore[attr-defined]
    llm.eval(ids)  # type: ignore[attr-defined]
    return np.array(llm.scores[: len(ids)])  # type: ignore[attr-defined]


def _kiln_logits(model: Transformer, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0, :, : model.cfg.vocab_size].numpy()


@pytest.fixture(scope="module")
def tok(tiny_dataset: Path) -> Tokenizer:
    return Tokenizer.load(tiny_dataset.parent / "tok.json")


@pytest.fixture(scope="module")
def llama_cfg(tok: Tokenizer) -> ModelConfig:
    return ModelConfig.preset("tiny", vocab_size=tok.n_vocab, block_size=256)


def test_llama_cpp_tokenizes_like_kiln(tok: Tokenizer, llama_cfg: ModelConfig, tmp_path: Path) -> None:
    export_gguf(_model(llama_cfg), tok, EOT, tmp_path / "m.gguf", "f16")
    llm = _llama(tmp_path / "m.gguf", kv_f32=False)
    texts = [*_prompts(tok), "Tom said: \"Let's go!\"  The end. 123 café ☀\n\nNext"]
    for text in texts:
        ids = tok.encode_ordinary(text)
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids, text
        assert llm.detokenize(ids).decode() == text
    assert llm.token_eos() == tok.special_tokens[EOT]


def test_f32_logits_match_kiln_within_the_summation_order_bound(
    tok: Tokenizer, llama_cfg: ModelConfig, tmp_path: Path
) -> None:
    model = _model(llama_cfg)
    export_gguf(model, tok, EOT, tmp_path / "m.gguf", "f32")
    llm = _llama(tmp_path / "m.gguf", kv_f32=True)
    cfg = model.cfg
    bound_rel = (2 * cfg.n_layer + 1) * max(cfg.ff_size, cfg.n_embd) * U32
    for text in _prompts(tok)[:5]:
        ids = tok.encode_ordinary(text)
        ours, theirs = _kiln_logits(model, ids), _llama_logits(llm, ids)
        err = np.abs(ours - theirs).max()
        assert err <= bound_rel * np.abs(ours).max(), (text, err)


def test_f16_gives_kiln_greedy_tokens_for_20_prompts_and_logits_within_the_bound(
    tok: Tokenizer, llama_cfg: ModelConfig, tmp_path: Path
) -> None:
    model = _model(llama_cfg)
    export_gguf(model, tok, EOT, tmp_path / "m.gguf", "f16")
    reference = _f16_weights(model)
    llm = _llama(tmp_path / "m.gguf", kv_f32=False)
    bound_rel = 2 * (2 * reference.cfg.n_layer + 1) * U16
    for text in _prompts(tok):
        ids = tok.encode_ordinary(text)
        ours = generate(reference, [ids], NEW_TOKENS, temperature=0.0)[0]
        full = ids + ours
        kiln_logits = _kiln_logits(reference, full)
        llama_logits = _llama_logits(llm, full)
        bound = bound_rel * np.abs(kiln_logits).max()
        assert np.abs(kiln_logits - llama_logits).max() <= bound, text
        # The decisions are robust: kiln's top two are further apart than llama.cpp can move them.
        top2 = np.sort(kiln_logits[len(ids) - 1 : -1], axis=1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0] > 2 * bound).all(), text
        llm.reset()
        theirs = [t for _, t in zip(range(NEW_TOKENS), llm.generate(ids, temp=0.0, reset=True))]
        assert theirs == ours, text


def test_gpt2_exports_load_in_llama_cpp_with_kiln_logits(tok: Tokenizer, tmp_path: Path) -> None:
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=tok.n_vocab, block_size=256)
    model = _model(cfg)
    export_gguf(model, tok, EOT, tmp_path / "g.gguf", "f32")
    llm = _llama(tmp_path / "g.gguf", kv_f32=True)
    bound_rel = (2 * cfg.n_layer + 1) * cfg.ff_size * U32
    for text in _prompts(tok)[:5]:
        ids = tok.encode_ordinary(text)
        ours, theirs = _kiln_logits(model, ids), _llama_logits(llm, ids)
        assert np.abs(ours - theirs).max() <= bound_rel * np.abs(ours).max(), text
