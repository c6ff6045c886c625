"""RoPE scaling types with Hugging Face's meanings: frequencies and Llama parity, both ways."""

from __future__ import annotations

import pytest
import torch

from kiln.model import ModelConfig, ModelConfigError, RopeScaling
from kiln.model.hf import from_hf, to_hf
from kiln.model.rope import rope_attention_factor, rope_inv_freq
from tests.model.helpers import build, llama_small, randomize

transformers = pytest.importorskip("transformers")

ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
        "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 16.0, "beta_slow": 2.0,
    },
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}  # fmt: skip


def hf_llama(rope: dict, max_positions: int = 64) -> torch.nn.Module:
    """A random tiny LlamaForCausalLM with the given rope parameters (theta 50000)."""
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=max_positions,
        rope_parameters={**rope, "rope_theta": 50000.0}, rms_norm_eps=1e-5, bos_token_id=0,
        eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    return randomize(transformers.LlamaForCausalLM(cfg), std=0.1).eval()


@pytest.mark.parametrize("name", ROPES)
def test_frequencies_and_attention_factor_equal_transformers(name: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_llama(ROPES[name], max_positions=16 if name == "dynamic" else 64)
    kiln_cfg = from_hf(hf).cfg
    assert (
        kiln_cfg.rope_scaling is not None and kiln_cfg.rope_scaling.type == ROPES[name]["rope_type"]
    )
    seq_len = 40 if name == "dynamic" else None  # dynamic: beyond the original 16 positions
    inv_freq, factor = ROPE_INIT_FUNCTIONS[ROPES[name]["rope_type"]](hf.config, None, seq_len)
    torch.testing.assert_close(rope_inv_freq(kiln_cfg, seq_len), inv_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(kiln_cfg) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("name", ROPES)
def test_llama_forward_equals_transformers_both_ways(name: str) -> None:
    hf = hf_llama(ROPES[name], max_positions=16 if name == "dynamic" else 64)
    model = from_hf(hf).eval()
    idx = torch.randint(0, 300, (2, 40))  # past 16 positions: the scaling is in play
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, rtol=0, atol=1e-5)
    fresh = to_hf(model)  # a new HF model: dynamic RoPE keeps no state from the forward above
    back = from_hf(fresh)
    assert back.cfg == model.cfg
    with torch.no_grad():
        torch.testing.assert_close(fresh(idx).logits, model(idx), rtol=0, atol=1e-5)


def test_each_type_changes_the_model_and_dynamic_only_past_the_original_length() -> None:
    plain = build(llama_small())
    idx = torch.randint(0, 300, (1, 40))
    with torch.no_grad():
        ref = plain(idx)
        for rope_type in ("linear", "dynamic", "yarn", "llama3"):
            scaled = build(
                llama_small(
                    rope_scaling={"type": rope_type, "factor": 4.0, "original_max_seq_len": 16}
                )
            )
            out = scaled(idx)
            assert not torch.allclose(out, ref, atol=1e-3), rope_type
            if rope_type == "dynamic":  # within the original length it is plain RoPE
                torch.testing.assert_close(scaled(idx[:, :16]), plain(idx[:, :16]), rtol=0, atol=0)


def test_bad_scaling_settings_are_clear_errors() -> None:
    with pytest.raises(ModelConfigError, match=r"rope_scaling\.type must be one of"):
        RopeScaling(type="ntk")
    with pytest.raises(ModelConfigError, match="beta_fast > beta_slow"):
        RopeScaling(type="yarn", beta_fast=1.0, beta_slow=2.0)
    with pytest.raises(ModelConfigError, match=r"rope_scaling\.factor"):
        ModelConfig.preset("tiny", rope_scaling={"type": "linear", "factor": 0.0})
