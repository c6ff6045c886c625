"""llama.cpp (llama-cpp-python) loads `kiln export --gguf` files and computes kiln's model.

Marker `llamacpp`: skipped with the reason when llama-cpp-python (the llamacpp extra) is not
installed; `make test` runs these when it is (docs/export.md).

Tolerances, derived from where llama.cpp's arithmetic differs from kiln's fp32 forward:
- f32 file, f32 KV cache (Llama): only the order of fp32 sums differs. A dot product of n terms
  is off by at most about n·2^-24 of the sum of |terms| (Higham); over the 2·n_layer + 1 matmul
  stages, (2·n_layer + 1)·n·2^-24 relative to the largest logit, n the widest dot product.
- Where ggml rounds to f16, the error is that rounding's, carried through the network, and how
  much a network amplifies it depends on its weights; so the size is measured on kiln itself:
  kiln's forward with the same values rounded to f16 (`_rounded`) against kiln's exact one.
  llama.cpp's error has that size (RMS ratio 0.9-1.2 over the 20 prompts here: the simulation
  leaves out only smaller roundings, such as the softmax weights before P·V), and may be at most
  2x it in RMS and 4x it at the largest single logit (the maximum of thousands of independent
  roundings moves more; measured up to 2.4x), plus the summation bound. ggml rounds:
  every matmul's activations when the weights are f16 (the f16 file), K, V and Q for attention
  (its default f16 KV cache), and GELU's input and output (it reads GELU from an f16 table, also
  in an f32 file: the GPT-2 case).
Greedy tokens at f16 must then be kiln's, except from a step where kiln's top two logits are
closer than twice the largest-logit bound (a tie within the tolerance, after which the runs are not
comparable); at most one of the 20 prompts may end that way, and the test model's logits are
spread wide (weights drawn at std 0.3) to keep such ties rare.
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
U32 = 2.0**-24


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


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def _rounded(
    model: Transformer, ids: list[int], matmuls: bool, attention: bool, gelu: bool
) -> np.ndarray:
    """kiln's logits with the values ggml keeps in f16 rounded to f16 (see the module docstring):
    matmul inputs, the attention projections' output (Q, K, V), GELU's input and output."""
    hooks = []
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if matmuls and isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_pre_hook(lambda m, a: (_f16(a[0]), *a[1:])))
        if (matmuls and leaf == "norm_f") or (attention and leaf == "qkv"):
            hooks.append(mod.register_forward_hook(lambda m, a, out: _f16(out)))
        if gelu and leaf == "fc":
            hooks.append(mod.register_forward_hook(lambda m, a, out: _f16(out)))
        if gelu and leaf == "proj" and name.endswith("mlp.proj"):
            hooks.append(mod.register_forward_pre_hook(lambda m, a: (_f16(a[0]), *a[1:])))
    try:
        return _kiln_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x))))


def _check_within_rounding(ours: np.ndarray, theirs: np.ndarray, rounded: np.ndarray,
                           cfg: ModelConfig, what: str) -> float:  # fmt: skip
    """llama.cpp's logits against kiln's, by the rounding bound; returns the max bound used."""
    slack = _sum_bound(cfg) * float(np.abs(ours).max())
    assert _rms(theirs - ours) <= 2 * _rms(rounded - ours) + slack, what
    bound = 4 * float(np.abs(rounded - ours).max()) + slack
    assert float(np.abs(theirs - ours).max()) <= bound, what
    return bound


def _sum_bound(cfg: ModelConfig) -> float:
    """The fp32 summation-order bound, relative to the largest logit."""
    return (2 * cfg.n_layer + 1) * max(cfg.ff_size, cfg.n_embd) * U32


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


def test_llama_cpp_tokenizes_like_kiln(
    tok: Tokenizer, llama_cfg: ModelConfig, tmp_path: Path
) -> None:
    export_gguf(_model(llama_cfg), tok, EOT, tmp_path / "m.gguf", "f16")
    llm = _llama(tmp_path / "m.gguf", kv_f32=False)
    texts = [*_prompts(tok), 'Tom said: "Let\'s go!"  The end. 123 café ☀\n\nNext']
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
    for text in _prompts(tok)[:5]:
        ids = tok.encode_ordinary(text)
        ours, theirs = _kiln_logits(model, ids), _llama_logits(llm, ids)
        err = np.abs(ours - theirs).max()
        assert err <= _sum_bound(model.cfg) * np.abs(ours).max(), (text, err)


def test_f16_gives_kiln_greedy_tokens_for_20_prompts_and_logits_within_the_bound(
    tok: Tokenizer, llama_cfg: ModelConfig, tmp_path: Path
) -> None:
    model = _model(llama_cfg)
    export_gguf(model, tok, EOT, tmp_path / "m.gguf", "f16")
    reference = _f16_weights(model)
    llm = _llama(tmp_path / "m.gguf", kv_f32=False)
    near_ties: list[str] = []
    for text in _prompts(tok):
        ids = tok.encode_ordinary(text)
        ours = generate(reference, [ids], NEW_TOKENS, temperature=0.0)[0]
        full = ids + ours
        kiln_logits = _kiln_logits(reference, full)
        llama_logits = _llama_logits(llm, full)
        rounded = _rounded(reference, full, matmuls=True, attention=True, gelu=False)
        bound = _check_within_rounding(kiln_logits, llama_logits, rounded, reference.cfg, text)
        llm.reset()
        stream = llm.generate(ids, temp=0.0, reset=True)
        theirs = [t for _, t in zip(range(NEW_TOKENS), stream, strict=False)]
        if theirs == ours:
            continue
        # A different choice is allowed only where kiln's top two logits are closer than
        # llama.cpp may move them apart (twice the bound); after it, the runs are not comparable.
        k = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        top2 = np.sort(kiln_logits[len(ids) - 1 + k])[-2:]
        assert top2[1] - top2[0] <= 2 * bound, (text, k)
        near_ties.append(text)
    assert len(near_ties) <= 1, near_ties


def test_gpt2_exports_load_in_llama_cpp_with_kiln_logits(tok: Tokenizer, tmp_path: Path) -> None:
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=tok.n_vocab, block_size=256)
    model = _model(cfg)
    export_gguf(model, tok, EOT, tmp_path / "g.gguf", "f32")
    llm = _llama(tmp_path / "g.gguf", kv_f32=True)
    for text in _prompts(tok)[:5]:
        ids = tok.encode_ordinary(text)
        ours, theirs = _kiln_logits(model, ids), _llama_logits(llm, ids)
        rounded = _rounded(model, ids, matmuls=False, attention=False, gelu=True)
        _check_within_rounding(ours, theirs, rounded, cfg, text)
