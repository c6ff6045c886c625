"""LoRA: the base frozen and out of the optimizer, merged == unmerged, and `peft` loading a kiln
adapter onto kiln's HF export computes the same logits (GPT-2 and Llama layouts, offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.errors import KilnError
from kiln.model import ModelConfig, Transformer
from kiln.model.hf import save_hf_dir
from kiln.posttrain.sft.lora import (
    LoRAConfig,
    LoRALinear,
    add_lora,
    merge_lora,
    optimizer_state_bytes,
    save_adapter,
    trainable_parameters,
)
from kiln.train.config import OptimConfig
from kiln.train.optim import build_optimizer

ARCHS = {
    "llama": {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
              "n_kv_head": 2, "tie_embeddings": False},
    "gpt2": {"pos_emb": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True,
             "n_kv_head": 4},
}  # fmt: skip
ALL = ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"]


def _lora_model(arch: str, targets: list[str] = ALL, rank: int = 4) -> Transformer:
    """A tiny model with adapters whose B is random (a fresh B is zero: no change at all)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny", vocab_size=90, block_size=32, **ARCHS[arch]))
    add_lora(model, LoRAConfig(rank=rank, alpha=8.0, targets=targets))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.05)
    return model.eval()


def test_a_fresh_adapter_changes_nothing_and_the_base_is_frozen() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=90, block_size=32)
    plain, model = Transformer(cfg).eval(), Transformer(cfg).eval()
    model.load_state_dict(plain.state_dict())
    names = add_lora(model, LoRAConfig(rank=2, targets=["attn.qkv", "mlp.proj"]))
    assert names == [
        f"blocks.{i}.{t}" for i in range(cfg.n_layer) for t in ("attn.qkv", "mlp.proj")
    ]
    x = torch.randint(0, 90, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # The base keeps its names: the state dict is the base's plus the adapters.
    assert set(plain.state_dict()) < set(model.state_dict())


def test_the_optimizer_holds_the_adapters_only() -> None:
    """Frozen base weights are not in the optimizer: no state, no update, far fewer bytes."""
    model = _lora_model("llama")
    full = Transformer(model.cfg)
    optim_cfg = OptimConfig(lr=1e-2)
    opt = build_optimizer(model, optim_cfg, torch.device("cpu"))
    in_optimizer = {id(p) for g in opt.param_groups for p in g["params"]}
    adapters = {id(p) for n, p in model.named_parameters() if ".lora_" in n}
    assert in_optimizer == adapters
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    x = torch.randint(0, 90, (2, 12))
    model.train()
    model(x, x).backward()
    opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]) and p.grad is None, n
    full_opt = build_optimizer(full, optim_cfg, torch.device("cpu"))
    full(x, x).backward()
    full_opt.step()
    n_lora, n_full = trainable_parameters(model), trainable_parameters(full)
    assert n_lora < n_full / 5
    # AdamW keeps two fp32 moments per trainable value (plus a step count per tensor).
    assert optimizer_state_bytes(opt) == pytest.approx(8 * n_lora, rel=0.01)
    assert optimizer_state_bytes(full_opt) == pytest.approx(8 * n_full, rel=0.01)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_merged_model_equals_the_adapter_model(arch: str) -> None:
    model = _lora_model(arch)
    x = torch.randint(0, 90, (2, 12))
    with torch.no_grad():
        adapted = model(x)
        merged = merge_lora(model)(x)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)
    assert set(model.state_dict()) == set(Transformer(model.cfg).state_dict())


@pytest.mark.parametrize(
    ("arch", "targets"), [("llama", ALL), ("gpt2", ALL), ("llama", ["attn.qkv"])]
)
def test_peft_loads_a_kiln_adapter_onto_the_hf_export(
    tmp_path: Path, arch: str, targets: list[str]
) -> None:
    """transformers + peft (offline) on kiln's export and adapter == the kiln LoRA model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _lora_model(arch, targets)
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=targets)
    base = Transformer(model.cfg)
    base.load_state_dict({k: v for k, v in model.state_dict().items() if ".lora_" not in k})
    save_hf_dir(base, tmp_path / "hf")
    save_adapter(model, cfg, tmp_path / "adapter", base=str(tmp_path / "hf"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["fan_in_fan_out"] == (arch == "gpt2")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    x = torch.randint(0, 90, (2, 12))
    with torch.no_grad():
        ours, theirs, plain = model(x), peft_model(x).logits, base(x)
    assert (ours - plain).abs().max() > 1e-3  # the adapter does something
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_bad_lora_settings_are_one_clear_error() -> None:
    with pytest.raises(KilnError, match=r"lora\.targets: \['attn\.q'\]; choose from"):
        LoRAConfig(rank=2, targets=["attn.q"])
    with pytest.raises(KilnError, match=r"lora\.rank must be >= 0"):
        LoRAConfig(rank=-1)
    with pytest.raises(KilnError, match="nothing to add"):
        add_lora(Transformer(ModelConfig.preset("tiny", vocab_size=90)), LoRAConfig(rank=0))
