"""Parity with Hugging Face transformers (random weights, built offline from a config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.errors import KilnError
from kiln.model import ModelConfig, Transformer
from kiln.model.hf import from_hf, load_hf_dir, save_hf_dir, to_hf
from tests.model.helpers import build, gpt2_small, llama_small, randomize

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ATOL = 1e-5


def hf_gpt2() -> torch.nn.Module:
    """A random GPT2LMHeadModel (small, eager attention so the reference is plain math)."""
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, vocab_size=300, n_positions=64,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    return randomize(transformers.GPT2LMHeadModel(cfg), std=0.1).eval()


def hf_llama(**overrides: object) -> torch.nn.Module:
    """A random LlamaForCausalLM with GQA and a non-default RoPE theta."""
    kwargs = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, rms_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    cfg = transformers.LlamaConfig(**{**kwargs, **overrides})
    return randomize(transformers.LlamaForCausalLM(cfg), std=0.1).eval()


LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}  # fmt: skip

HF_MODELS = {
    "gpt2": hf_gpt2,
    "llama-gqa-theta": hf_llama,
    "llama3-scaling-untied": lambda: hf_llama(
        rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False
    ),
    "llama-mqa-tied": lambda: hf_llama(num_key_value_heads=1, tie_word_embeddings=True),
}


def _ids(batch: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(0, 300, (batch, length))


@pytest.mark.kernels
@pytest.mark.parametrize("make", HF_MODELS.values(), ids=HF_MODELS.keys())
def test_import_from_transformers_gives_equal_logits(make) -> None:
    hf = make()
    model = from_hf(hf).eval()
    idx = _ids()
    with torch.no_grad():
        ref, out = hf(idx).logits, model(idx)
    assert ref.std() > 0.5  # non-trivial logits, so agreement means something
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)


@pytest.mark.kernels
@pytest.mark.parametrize("make", HF_MODELS.values(), ids=HF_MODELS.keys())
def test_loss_matches_transformers_loss(make) -> None:
    hf = make()
    model = from_hf(hf).eval()
    idx = _ids()
    with torch.no_grad():
        ref = hf(idx, labels=idx).loss  # HF shifts the labels itself
        out = model(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)


KILN_MODELS = {
    "gpt2": gpt2_small(),
    "gpt2-untied-padded": gpt2_small(tie_embeddings=False, vocab_multiple=64),
    "llama": llama_small(),
    "llama-scaled-untied": llama_small(
        rope_scaling={"factor": 4.0, "original_max_seq_len": 16}, tie_embeddings=False
    ),
}


@pytest.mark.parametrize("cfg", KILN_MODELS.values(), ids=KILN_MODELS.keys())
def test_export_to_transformers_gives_equal_logits(cfg: ModelConfig) -> None:
    model = build(cfg)
    hf = to_hf(model)
    expected = "GPT2LMHeadModel" if cfg.pos_emb == "learned" else "LlamaForCausalLM"
    assert type(hf).__name__ == expected
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), rtol=0, atol=ATOL)


@pytest.mark.parametrize("cfg", KILN_MODELS.values(), ids=KILN_MODELS.keys())
def test_export_then_import_is_the_identity(cfg: ModelConfig) -> None:
    model = build(cfg)
    hf = to_hf(model)
    back = from_hf(hf)
    # transformers' own forward in between: a mistake undone on the way back (a transpose, a
    # swapped q/k permutation) gives the identity alone, but not these logits.
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), rtol=0, atol=ATOL)
    assert back.cfg == model.cfg
    assert back.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


@pytest.mark.parametrize("cfg", KILN_MODELS.values(), ids=KILN_MODELS.keys())
def test_saved_directory_loads_in_transformers_and_back(tmp_path: Path, cfg: ModelConfig) -> None:
    model = build(cfg)
    save_hf_dir(model, tmp_path, eos_token_id=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), rtol=0, atol=ATOL)
    if cfg.tie_embeddings:
        assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    back = load_hf_dir(tmp_path)
    assert back.cfg == model.cfg
    torch.testing.assert_close(back(idx), model(idx), rtol=0, atol=0)


def test_load_a_directory_written_by_transformers(tmp_path: Path) -> None:
    hf = hf_llama(rope_parameters=LLAMA3_ROPE)
    hf.save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path)
    assert model.cfg.rope_scaling is not None and model.cfg.rope_scaling.factor == 8.0
    assert model.lm_head.weight is model.wte.weight or not model.cfg.tie_embeddings
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, rtol=0, atol=ATOL)


def test_older_llama_config_layout_is_read(tmp_path: Path) -> None:
    hf = hf_llama(rope_parameters=LLAMA3_ROPE)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope  # transformers 4.x wrote it this way
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_hf_dir(tmp_path)
    assert model.cfg.rope_theta == 50000.0 and model.cfg.rope_scaling is not None
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, rtol=0, atol=ATOL)


def test_features_hf_cannot_express_are_refused_on_export() -> None:
    with pytest.raises(KilnError, match="qk_norm"):
        to_hf(Transformer(llama_small(qk_norm=True)))
    with pytest.raises(KilnError, match="neither HF GPT-2"):
        to_hf(Transformer(gpt2_small(norm="rmsnorm")))


def test_unsupported_checkpoints_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(KilnError, match="unsupported HF model_type 'bert'"):
        load_hf_dir(tmp_path)
    with pytest.raises(KilnError, match=r"no config\.json"):
        load_hf_dir(tmp_path / "missing")
    hf_llama().config.save_pretrained(tmp_path)
    with pytest.raises(KilnError, match=r"no model\.safetensors"):
        load_hf_dir(tmp_path)
