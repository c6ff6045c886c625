"""ModelConfig: presets, parameter and FLOP accounting, validation, plain-data round trips."""

from __future__ import annotations

import dataclasses
import json
import tomllib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from kiln import config as cfgio
from kiln.config import ConfigError
from kiln.data.tokenize_shards import TokenizeConfig
from kiln.errors import KilnError
from kiln.model import PRESETS, ModelConfig, ModelConfigError, RopeScaling, Transformer
from kiln.scaling.cli import load_model
from tests.model.helpers import gpt2_small, llama_small


def test_gpt2_124m_has_the_released_parameter_count() -> None:
    assert ModelConfig.preset("gpt2-124m").num_params() == 124_439_808
    assert ModelConfig() == ModelConfig.preset("gpt2-124m")


@pytest.mark.parametrize("name", ["gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b"])
def test_gpt2_presets_match_hf_parameter_counts(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig.preset(name)
    hf_cfg = transformers.GPT2Config(
        n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size
    )
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(hf_cfg)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())


def test_llama_1b_preset_has_llama_3_2_1b_shape() -> None:
    assert ModelConfig.preset("llama-1b").num_params() == 1_235_814_400


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_on_meta_without_allocating(name: str) -> None:
    cfg = ModelConfig.preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)  # the constructor checks count == cfg.num_params()
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.is_meta for t in tensors)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


@pytest.mark.parametrize(
    "cfg",
    [
        gpt2_small(),
        gpt2_small(tie_embeddings=False, vocab_multiple=64, d_ff=100),
        llama_small(),
        llama_small(qk_norm=True, bias=True, n_kv_head=1, head_dim=8, tie_embeddings=False),
        gpt2_small(norm="rmsnorm", mlp="swiglu", qk_norm=True, ff_multiple=7),
    ],
    ids=["gpt2", "gpt2-untied-padded", "llama", "llama-variant", "mixed"],
)
def test_num_params_matches_the_module(cfg: ModelConfig) -> None:
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


@pytest.mark.parametrize(
    "cfg",
    [gpt2_small(), llama_small(tie_embeddings=False, vocab_multiple=64)],
    ids=["gpt2", "llama"],
)
def test_flops_per_token_matches_counted_matmul_flops(cfg: ModelConfig) -> None:
    # The math backend makes attention two explicit matmuls the counter can see.
    cfg = dataclasses.replace(cfg, attention_backend="math")
    model = Transformer(cfg)
    B, T = 2, 16
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    with FlopCounterMode(display=False) as counter:
        model(idx).sum().backward()
    assert counter.get_total_flops() == cfg.flops_per_token(T) * B * T


def test_derived_sizes() -> None:
    llama = ModelConfig.preset("llama-100m")
    assert llama.ff_size % llama.ff_multiple == 0
    assert llama.ff_size == 2048  # int(8/3 · 768) = 2048, already a multiple of 256
    padded = gpt2_small(vocab_size=300, vocab_multiple=128)
    assert padded.padded_vocab_size == 384
    assert gpt2_small(n_kv_head=None).kv_heads == 4


def test_window_pattern_cycles_over_layers() -> None:
    cfg = gpt2_small(n_layer=5, sliding_window=8, window_pattern="LLG")
    assert [cfg.layer_window(i) for i in range(5)] == [8, 8, None, 8, 8]
    assert gpt2_small().layer_window(0) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_embd": 65}, "n_embd (65) must be divisible by n_head (4)"),
        ({"n_kv_head": 3}, "n_kv_head (3) must divide n_head (4)"),
        ({"mlp": "tanh"}, "mlp must be one of 'gelu'"),
        ({"norm": "batchnorm"}, "norm must be"),
        ({"pos_emb": "alibi"}, "pos_emb must be"),
        ({"attention_backend": "flash"}, "attention_backend must be"),
        ({"n_layer": 0}, "n_layer must be >= 1"),
        ({"pos_emb": "rope", "head_dim": 7}, "RoPE needs an even rotated width"),
        ({"logit_softcap": 0.0}, "logit_softcap must be > 0"),
        ({"window_pattern": "LX"}, "window_pattern"),
        ({"z_loss": -1.0}, "z_loss must be >= 0"),
        ({"rope_scaling": {"factor": 2.0}}, "rope_scaling must be a RopeScaling or None"),
    ],
)
def test_bad_config_fails_at_construction_with_a_clear_message(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gpt2_small(**overrides)


def test_config_errors_are_kiln_errors_and_value_errors() -> None:
    with pytest.raises(KilnError):
        ModelConfig(n_embd=10, n_head=3)
    with pytest.raises(ValueError):
        ModelConfig(n_embd=10, n_head=3)


def test_unknown_preset_and_unknown_field_are_named() -> None:
    with pytest.raises(ModelConfigError, match=r"unknown model preset 'gpt5'.*gpt2-124m"):
        ModelConfig.preset("gpt5")
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) model\.n_layers; model takes"):
        ModelConfig.from_dict({"n_layers": 3})
    with pytest.raises(ConfigError, match=r"model\.rope_scaling\.beta; model\.rope_scaling takes"):
        ModelConfig.preset("llama-1b", rope_scaling={"factor": 2.0, "beta": 1})
    with pytest.raises(ModelConfigError, match=r"0 < low_freq_factor < high_freq_factor"):
        ModelConfig.preset("llama-1b", rope_scaling={"low_freq_factor": 4.0})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"n_layer": "12"}, r"model\.n_layer = '12': expected int"),
        ({"n_layer": True}, r"model\.n_layer = True: expected int"),
        ({"norm_eps": float("inf")}, r"model\.norm_eps = inf: expected a finite number"),
        ({"logit_softcap": float("nan")}, r"model\.logit_softcap = nan: expected a finite number"),
        ({"rope_scaling": {"factor": "2"}}, r"model\.rope_scaling\.factor = '2': expected float"),
        ({"window_pattern": 3}, r"model\.window_pattern = 3: expected str"),
    ],
)
def test_plain_data_is_type_checked_by_the_shared_config_reader(
    data: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(data)


def test_no_config_dataclass_names_a_command_line_flag() -> None:
    # Library errors name the field; only CLI code speaks in flags.
    for bad in (dict(val_docs=-1), dict(shard_tokens=0), dict(val_docs=1, val_fraction=0.1)):
        with pytest.raises(KilnError) as info:
            TokenizeConfig(tokenizer="t.json", inputs=("a.txt",), out="o", **bad)
        assert "--" not in str(info.value)
    for bad in (dict(n_layer=0), dict(norm="x"), dict(n_embd=10, n_head=3)):
        with pytest.raises(ModelConfigError) as info:
            ModelConfig(**bad)
        assert "--" not in str(info.value)


configs = st.builds(
    lambda n_head, kv_div, hd, mlp, norm, pos, window, softcap, scaling: ModelConfig(
        vocab_size=1000,
        n_layer=2,
        n_head=n_head,
        n_kv_head=n_head // kv_div if n_head % kv_div == 0 else None,
        n_embd=n_head * hd,
        mlp=mlp,
        norm=norm,
        pos_emb=pos,
        sliding_window=window,
        logit_softcap=softcap,
        rope_scaling=scaling,
    ),
    st.integers(1, 8),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([2, 8, 16]),
    st.sampled_from(["gelu", "swiglu"]),
    st.sampled_from(["layernorm", "rmsnorm"]),
    st.sampled_from(["learned", "rope"]),
    st.none() | st.integers(1, 4096),
    st.none() | st.floats(1.0, 100.0),
    st.none() | st.builds(RopeScaling, factor=st.floats(1.0, 64.0)),
)


@settings(max_examples=40, deadline=None)
@given(configs)
def test_toml_and_json_round_trip_through_the_shared_config_reader(cfg: ModelConfig) -> None:
    toml_text = cfgio.to_toml(cfg.to_dict())
    assert ModelConfig.from_dict(tomllib.loads(toml_text)) == cfg
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_scaling_account_reads_a_model_config_file(tmp_path, suffix: str) -> None:
    cfg = ModelConfig.preset("llama-1b")
    path = tmp_path / f"model{suffix}"
    text = cfgio.to_toml(cfg.to_dict()) if suffix == ".toml" else json.dumps(cfg.to_dict())
    path.write_text(text)
    assert load_model(str(path)) == (cfg, None, None)


def test_a_bad_model_config_file_names_the_file_and_the_key(tmp_path) -> None:
    bad = tmp_path / "model.toml"
    bad.write_text("n_layer = [")
    with pytest.raises(KilnError, match=r"model\.toml: not valid TOML"):
        load_model(str(bad))
    bad.write_text("n_layer = 2.5")
    with pytest.raises(ConfigError, match=r"model\.toml: n_layer = 2\.5: expected int"):
        load_model(str(bad))
