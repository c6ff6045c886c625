"""TrainConfig: TOML round trip, typed --set overrides, and errors that name the key."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kiln.config import ConfigError, to_toml
from kiln.train.config import TrainConfig, load_train_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = {
    "tiny": CONFIGS / "tiny.toml",
    "demo": Path(__file__).resolve().parents[2] / "kiln" / "assets" / "demo.toml",
}
DATA = "data.dataset=some/dir"


@pytest.mark.parametrize("name", ["tiny", "demo"])
def test_shipped_configs_load_and_round_trip(name: str, tmp_path: Path) -> None:
    cfg = load_train_config(SHIPPED[name])
    path = tmp_path / "again.toml"
    path.write_text(cfg.to_toml())
    assert load_train_config(path) == cfg


def test_resolved_config_round_trips_with_every_model_field(tmp_path: Path) -> None:
    cfg = load_train_config(CONFIGS / "tiny.toml", ["optim.fused=false", "train.compile=true"])
    resolved = cfg.resolved(cfg.model_config(vocab_size=300))
    assert "preset" not in resolved.model and resolved.model["n_kv_head"] == 2
    path = tmp_path / "resolved.toml"
    path.write_text(resolved.to_toml())
    again = load_train_config(path)
    assert again.to_dict() == resolved.to_dict()
    assert again.model_config() == resolved.model_config()
    assert tomllib.loads(path.read_text())["model"]["vocab_size"] == 300


def test_set_overrides_are_typed_by_the_field() -> None:
    cfg = load_train_config(
        CONFIGS / "tiny.toml",
        [
            "optim.lr=3e-4",
            "optim.betas=[0.8, 0.99]",
            "optim.name=muon",
            "optim.fused=none",
            "train.max_steps=5",
            "train.compile=true",
            "train.grad_clip=2",  # an integer literal for a float field
            "logging.run_dir=runs/x y",  # strings are taken literally
            "model.n_layer=3",  # typed by ModelConfig
            "model.logit_softcap=30",
            "model.rope_scaling.factor=4",
        ],
    )
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.8, 0.99)
    assert cfg.optim.name == "muon" and cfg.optim.fused is None
    assert cfg.train.max_steps == 5 and cfg.train.compile is True
    assert cfg.train.grad_clip == 2.0 and isinstance(cfg.train.grad_clip, float)
    assert cfg.logging.run_dir == "runs/x y"
    assert cfg.model["n_layer"] == 3 and cfg.model["logit_softcap"] == 30.0
    model = cfg.model_config(vocab_size=300)
    assert model.n_layer == 3 and model.rope_scaling is not None
    assert model.rope_scaling.factor == 4.0


@pytest.mark.parametrize(
    ("assignment", "fragments"),
    [
        ("optim.lrr=1", ["optim.lrr", "optim takes", "lr"]),
        ("optimizer.lr=1", ["optimizer", "the top level takes"]),
        ("train.max_steps=abc", ["train.max_steps", "expected int"]),
        ("train.max_steps=2.5", ["train.max_steps", "expected int"]),
        ("train.compile=yes", ["train.compile", "expected bool"]),
        ("train.dtype=fp16", ["train.dtype", "'bf16' or 'fp32'"]),
        ("optim.betas=[0.9]", ["optim.betas", "a list of 2"]),
        ("model.n_layers=3", ["model.n_layers", "n_layer"]),
        ("model.n_layer=2.5", ["model.n_layer", "expected int"]),
        ("optim.lr", ["KEY=VALUE"]),
        ("optim.lr.x=1", ["optim.lr", "is a value"]),
    ],
)
def test_bad_overrides_name_the_key_and_the_expected_type(
    assignment: str, fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        load_train_config(CONFIGS / "tiny.toml", [assignment])
    for fragment in fragments:
        assert fragment in str(info.value)


def test_file_errors_name_the_file_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[data]\ndataset = "d"\n[optim]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: optim\.lr = 'fast': expected float"):
        load_train_config(path)
    path.write_text('[data]\ndataset = "d"\n[optimizer]\nlr = 1.0\n')
    with pytest.raises(ConfigError, match=r"unknown config key.*optimizer"):
        load_train_config(path)
    path.write_text("[optim]\nlr = 1.0\n")
    with pytest.raises(ConfigError, match=r"missing required config key.*data"):
        load_train_config(path)
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read"):
        load_train_config(tmp_path / "nope.toml")


def test_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"optim\.lr must be > 0"):
        load_train_config(None, [DATA, "optim.lr=-1"])
    with pytest.raises(ConfigError, match=r"data\.dataset"):
        load_train_config(None, ["data.seq_len=8"])
    cfg = load_train_config(None, [DATA, "data.seq_len=4096", "model.preset=tiny"])
    with pytest.raises(ConfigError, match=r"data\.seq_len \(4096\).*block_size \(128\)"):
        cfg.model_config(vocab_size=300)
    cfg = load_train_config(None, [DATA, "data.seq_len=32", "model.preset=tiny", "model.n_head=3"])
    with pytest.raises(ConfigError, match="model: n_embd"):
        cfg.model_config(vocab_size=300)
    cfg = load_train_config(
        None, [DATA, "data.seq_len=32", "model.preset=tiny", "model.vocab_size=100"]
    )
    with pytest.raises(ConfigError, match=r"model\.vocab_size \(100\) is smaller"):
        cfg.model_config(vocab_size=300)


def test_defaults_need_only_the_dataset() -> None:
    cfg = load_train_config(None, [DATA, "model.block_size=256"])
    assert isinstance(cfg, TrainConfig) and cfg.data.dataset == "some/dir"
    assert cfg.model_config(vocab_size=300).vocab_size == 300  # taken from the dataset


def test_toml_writer_handles_floats_strings_and_nesting() -> None:
    data = {"a": 1e-5, "b": 'quote " and é', "c": [1, 2.5], "d": {"e": {"f": True}}, "g": None}
    text = to_toml(data, header="two\nlines")
    assert text.startswith("# two\n# lines\n")
    assert tomllib.loads(text) == {k: v for k, v in data.items() if v is not None}
