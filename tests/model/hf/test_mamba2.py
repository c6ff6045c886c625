"""HF parity for Mamba-2: transformers' Mamba2ForCausalLM and kiln's layer_pattern = "M", both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.errors import KilnError
from kiln.model import ModelConfig, Transformer
from kiln.model.generate import generate
from kiln.model.hf import from_hf, load_hf_dir, save_hf_dir, to_hf
from tests.model.helpers import randomize

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
VOCAB = 300


def hf_mamba2(**overrides: object) -> torch.nn.Module:
    """A random Mamba2ForCausalLM: 4 heads in 2 groups, chunks of 8 so prompts span several."""
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
        state_size=8, n_groups=2, expand=2, conv_kernel=4, chunk_size=8, use_bias=False,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    cfg = transformers.Mamba2Config(**{**kwargs, **overrides})
    return randomize(transformers.Mamba2ForCausalLM(cfg), std=0.1).eval()


def ids(T: int = 21, seed: int = 0) -> torch.Tensor:
    """A batch of two random token rows."""
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("overrides", [{}, {"use_bias": True, "tie_word_embeddings": True}])
def test_hf_mamba2_into_kiln_gives_the_same_logits(overrides: dict) -> None:
    hf = hf_mamba2(**overrides)
    model = from_hf(hf).eval()
    assert model.cfg.layer_pattern == "M" and model.cfg.mamba_heads == 4
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=ATOL, rtol=ATOL)


def test_kiln_mamba2_into_hf_gives_the_same_logits_and_greedy_tokens() -> None:
    cfg = ModelConfig.from_dict(dict(
        vocab_size=VOCAB, vocab_multiple=64, n_layer=2, n_head=1, n_embd=32, layer_pattern="M",
        mlp="none", norm="rmsnorm", pos_emb="none", bias=False, tie_embeddings=True,
        ssm={"state_size": 8, "head_dim": 16, "n_groups": 1, "chunk_size": 8},
    ))  # fmt: skip
    torch.manual_seed(0)
    model = randomize(Transformer(cfg), std=0.1).eval()
    with torch.no_grad():  # keep the padded vocabulary rows at zero, as kiln initialises them
        model.wte.weight[VOCAB:].zero_()
    hf = to_hf(model)
    x = ids(19, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=ATOL, rtol=ATOL)
        out = hf.generate(x[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out[0, 19:].tolist() == generate(model, [x[0].tolist()], 6, temperature=0)[0]


def test_mamba2_directory_round_trip(tmp_path: Path) -> None:
    hf = hf_mamba2()
    model = from_hf(hf).eval()
    save_hf_dir(model, tmp_path)
    again = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path).eval()
    back = load_hf_dir(tmp_path).eval()
    x = ids(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, hf(x).logits, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(back(x), model(x), atol=ATOL, rtol=ATOL)
    assert back.cfg == model.cfg


def test_hybrid_export_is_refused_in_one_line() -> None:
    cfg = ModelConfig.preset("tiny", layer_pattern="MA", ssm={"head_dim": 16})
    with pytest.raises(KilnError, match="layer_pattern 'MA'"):
        to_hf(Transformer(cfg))


def test_hf_mamba2_with_a_time_step_limit_is_refused() -> None:
    from kiln.model.hf import config_from_hf

    hf_cfg = hf_mamba2().config.to_dict() | {"time_step_limit": [0.0, 0.5]}
    with pytest.raises(KilnError, match="time_step_limit"):
        config_from_hf(hf_cfg)
