"""HF parity for the switch families: GPT-NeoX (parallel blocks, partial RoPE) and Gemma 2
(sandwich norms, GeGLU, soft-capping, sliding/full layers), random tiny configs, both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.errors import KilnError
from kiln.model import ModelConfig, Transformer
from kiln.model.hf import from_hf, load_hf_dir, save_hf_dir, to_hf
from tests.model.helpers import build, randomize

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
VOCAB = 300


def hf_neox(**overrides: object) -> torch.nn.Module:
    """A random GPTNeoXForCausalLM: parallel residual, a quarter of each head rotated."""
    kwargs = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=64, hidden_act="gelu",
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    cfg = transformers.GPTNeoXConfig(**{**kwargs, **overrides})
    return randomize(transformers.GPTNeoXForCausalLM(cfg), std=0.1).eval()


def hf_gemma2(**overrides: object) -> torch.nn.Module:
    """A random Gemma2ForCausalLM: GQA, a sliding layer then a global one, both soft-caps."""
    kwargs = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    cfg = transformers.Gemma2Config(**{**kwargs, **overrides})
    model = randomize(transformers.Gemma2ForCausalLM(cfg), std=0.1)
    with torch.no_grad():  # Gemma's norms scale by 1 + w: move w off 1 so a lost "+1" shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
    return model.eval()


HF_MODELS = {
    "gpt-neox": hf_neox,
    "gpt-neox-sequential-tanh": lambda: hf_neox(use_parallel_residual=False, hidden_act="gelu_new"),
    "gemma2": hf_gemma2,
    "gemma2-untied-no-caps": lambda: hf_gemma2(
        tie_word_embeddings=False,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        sliding_window=64,
        layer_types=["full_attention"] * 2,
    ),
}


def ids(batch: int = 2, length: int = 20) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("make", HF_MODELS.values(), ids=HF_MODELS.keys())
def test_import_gives_equal_logits_and_loss(make) -> None:
    hf = make()
    model = from_hf(hf).eval()
    idx = ids()
    with torch.no_grad():
        ref = hf(idx, labels=idx)
        assert ref.logits.std() > 0.3  # non-trivial logits, so agreement means something
        torch.testing.assert_close(model(idx), ref.logits, rtol=0, atol=ATOL)
        torch.testing.assert_close(model(idx[:, :-1], idx[:, 1:]), ref.loss, rtol=0, atol=ATOL)


def test_imported_switches_are_the_families_equations() -> None:
    neox = from_hf(hf_neox()).cfg
    assert (neox.parallel_block, neox.parallel_norms, neox.rope_dim, neox.mlp) == (
        True, 2, 4, "gelu_exact",
    )  # fmt: skip
    gemma = from_hf(hf_gemma2()).cfg
    assert (gemma.norm_placement, gemma.mlp, gemma.embed_scale) == ("sandwich", "geglu", True)
    assert (gemma.attn_softcap, gemma.logit_softcap, gemma.window_pattern) == (2.0, 5.0, "LG")
    assert gemma.attention_scale == pytest.approx(24**-0.5)


KILN_MODELS = {
    "neox": ModelConfig(
        vocab_size=VOCAB, block_size=64, n_layer=2, n_head=4, n_embd=64, mlp="gelu_exact",
        pos_emb="rope", rotary_fraction=0.5, parallel_block=True, parallel_norms=2,
        tie_embeddings=False,
    ),
    "gemma2": ModelConfig.preset(
        "tiny", vocab_size=VOCAB, block_size=64, mlp="geglu", norm_placement="sandwich",
        embed_scale=True, attn_scale=0.2, attn_softcap=3.0, logit_softcap=6.0, sliding_window=6,
        window_pattern="LG", head_dim=24,
    ),
}  # fmt: skip


@pytest.mark.parametrize("cfg", KILN_MODELS.values(), ids=KILN_MODELS.keys())
def test_export_gives_equal_logits_and_comes_back(cfg: ModelConfig) -> None:
    model = build(cfg)
    hf = to_hf(model)
    assert type(hf).__name__ in ("GPTNeoXForCausalLM", "Gemma2ForCausalLM")
    idx = ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), rtol=0, atol=ATOL)
        back = from_hf(hf)
        assert back.cfg == model.cfg
        torch.testing.assert_close(back(idx), model(idx), rtol=0, atol=ATOL)


@pytest.mark.parametrize("cfg", KILN_MODELS.values(), ids=KILN_MODELS.keys())
def test_saved_directory_loads_in_transformers(tmp_path: Path, cfg: ModelConfig) -> None:
    model = build(cfg)
    save_hf_dir(model, tmp_path, eos_token_id=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    idx = ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), rtol=0, atol=ATOL)
        torch.testing.assert_close(load_hf_dir(tmp_path)(idx), model(idx), rtol=0, atol=ATOL)


def test_switches_without_an_hf_family_are_refused_on_export() -> None:
    for switches, name in (
        ({"norm_placement": "post"}, "norm_placement"),
        ({"parallel_block": True}, "parallel_block"),
        ({"rotary_fraction": 0.5}, "rotary_fraction"),
        ({"mup_base_width": 32}, "mup_base_width"),
    ):
        cfg = ModelConfig.preset("tiny", **switches)
        with pytest.raises(KilnError, match=name):
            to_hf(Transformer(cfg))
    gemma_with_bias = dict(KILN_MODELS["gemma2"].to_dict(), bias=True)
    with pytest.raises(KilnError, match="no HF gemma2 equivalent: bias=True"):
        to_hf(Transformer(ModelConfig.from_dict(gemma_with_bias)))
