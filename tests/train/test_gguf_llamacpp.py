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
- q4_k_m file: kiln runs the very weights the file holds (decoded by the gguf package), so the
  difference left is llama.cpp's arithmetic: it multiplies K-quant weights with activations
  rounded to 8 bits in blocks of 256 (ggml's Q8_K), simulated the same way (`_q8_k`) and
  held to the same 2x RMS / 4x largest-logit rule, with an f32 KV cache so that is all it rounds.
Greedy tokens at f16 must then be kiln's, except from a step where kiln's top two logits are
closer than twice the largest-logit bound (a tie within the tolerance, after which the runs are not
comparable); at most one of the 20 prompts may end that way, and the test model's logits are
spread wide (weights drawn at std 0.3) to keep such ties rare.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.generate import generate
from kiln.model.transformer import Transformer
from kiln.quant.quantize import quantize_model
from kiln.tokenizer import Tokenizer
from kiln.train.config import load_train_config
from kiln.train.export_gguf import export_gguf
from kiln.train.trainer import Trainer
from tests.fixtures import EOT, require_shared, single_torch_thread

from .conftest import CONFIGS, SHARED_DATA

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


def _q8_k(x: torch.Tensor) -> torch.Tensor:
    """x rounded as ggml's Q8_K rounds a matmul's activations: int8 steps of amax/127 per 256."""
    blocks = x.reshape(-1, 256)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    return (torch.round(blocks / step) * step).reshape(x.shape)


def _file_weights(model: Transformer, path: Path) -> Transformer:
    """`model` with every matrix replaced by the values the GGUF file holds (decoded by gguf)."""
    import gguf

    cfg = model.cfg
    t = {}
    for x in gguf.GGUFReader(path).tensors:
        shape = tuple(int(d) for d in reversed(x.shape))
        t[x.name] = torch.tensor(gguf.quants.dequantize(x.data, x.tensor_type).reshape(shape))

    def halves(w: torch.Tensor, heads: int) -> torch.Tensor:
        rows, cols = w.shape
        return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)

    sd = {"wte.weight": t["token_embd.weight"]}
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        sd[f"blocks.{i}.attn.qkv.weight"] = torch.cat([
            halves(t[b + "attn_q.weight"], cfg.n_head), halves(t[b + "attn_k.weight"],
            cfg.kv_heads), t[b + "attn_v.weight"]])  # fmt: skip
        sd[f"blocks.{i}.attn.proj.weight"] = t[b + "attn_output.weight"]
        sd[f"blocks.{i}.mlp.fc.weight"] = torch.cat(
            [t[b + "ffn_gate.weight"], t[b + "ffn_up.weight"]]
        )
        sd[f"blocks.{i}.mlp.proj.weight"] = t[b + "ffn_down.weight"]
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in sd.items():
            params[name][: len(value)].copy_(value)  # the embedding's padded rows stay
    return model


@pytest.fixture(scope="module")
def trained_256(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    """A tiny Llama-style model 300 steps into training (about a minute on one CPU thread), with
    rows of 256 (n_embd) and 768 (ff_size) so every matrix is a K-quant: a trained model's
    predictions are confident enough for two 4-bit formats to be compared (a random model's
    are not: its argmax moves with any rounding)."""
    run = tmp_path_factory.mktemp("q4k") / "run"
    cfg = load_train_config(
        CONFIGS / "tiny.toml",
        [f"data.dataset={tiny_dataset}", f"logging.run_dir={run}", "logging.progress=false",
         "train.max_steps=300", "checkpoint.every=300", "eval.every=300", "logging.every=300",
         "model.n_embd=256", "model.ff_multiple=256", "model.block_size=256"],
    )  # fmt: skip
    # A module fixture runs before the per-test one-thread fixture: without this, torch's
    # default threads fight the machine's other work (measured 800 s instead of about 60).
    with contextlib.contextmanager(single_torch_thread)():
        trainer = Trainer(cfg, run)
        trainer.run()
    return trainer.model.eval()


def test_q4_k_m_loads_in_llama_cpp_with_the_files_weights_logits_and_greedy_tokens(
    tok: Tokenizer, trained_256: Transformer, tmp_path: Path
) -> None:
    model, cfg = trained_256, trained_256.cfg
    result = export_gguf(model, tok, EOT, tmp_path / "m.gguf", "q4_k_m")
    assert result.fallbacks == [] and {"Q4_K", "Q6_K"} <= set(result.types.values())
    reference = _file_weights(copy.deepcopy(model), result.out)
    simulated = copy.deepcopy(reference)  # and computing as llama.cpp does: Q8_K activations
    for m in simulated.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda m, a: (_q8_k(a[0]), *a[1:]))
    int4 = copy.deepcopy(model)
    quantize_model(int4, "int4", 32, include_head=True)  # groups of 32, the tied head too
    llm = _llama(result.out, kv_f32=True)
    near_ties: list[str] = []
    same_as_int4 = positions = greedy_int4 = 0
    for text in _prompts(tok):
        ids = tok.encode_ordinary(text)
        ours = generate(simulated, [ids], NEW_TOKENS, temperature=0.0)[0]
        full = ids + ours
        kiln_logits, llama_logits = _kiln_logits(reference, full), _llama_logits(llm, full)
        rounded = _kiln_logits(simulated, full)
        bound = _check_within_rounding(kiln_logits, llama_logits, rounded, cfg, text)
        stream = llm.generate(ids, temp=0.0, reset=True)
        theirs = [t for _, t in zip(range(NEW_TOKENS), stream, strict=False)]
        # Against kiln's own int4: the next token at every position of the same text.
        same_as_int4 += int((_kiln_logits(int4, full).argmax(-1) == llama_logits.argmax(-1)).sum())
        positions += len(full)
        greedy_int4 += theirs == generate(int4, [ids], NEW_TOKENS, temperature=0.0)[0]
        if theirs == ours:
            continue
        k = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        top2 = np.sort(rounded[len(ids) - 1 + k])[-2:]
        assert top2[1] - top2[0] <= 2 * bound, (text, k)
        near_ties.append(text)
    assert len(near_ties) <= 1, near_ties
    # Two different 4-bit formats of one model: measured 95% of next tokens and 10/20 whole
    # 16-token continuations equal (fp32 against the file: 98%, 13/20).
    assert same_as_int4 >= 0.9 * positions, (same_as_int4, positions)
    assert greedy_int4 >= N_PROMPTS // 4, greedy_int4
