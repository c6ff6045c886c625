"""Parity with transformers' Mixtral, Qwen3-MoE and DeepSeek-V3 (random tiny configs, offline)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.errors import KilnError
from kiln.model import ModelConfig
from kiln.model.config import MLAConfig, MoEConfig
from kiln.model.hf import from_hf, load_hf_dir, save_hf_dir, to_hf
from tests.model.helpers import build, llama_small, randomize

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
BASE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=300, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=0,
    eos_token_id=0, attn_implementation="eager",
)  # fmt: skip


def hf_mixtral() -> torch.nn.Module:
    """Mixtral: softmax top-2 of 4 experts, renormalised."""
    cfg = transformers.MixtralConfig(
        **BASE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2
    )
    return randomize(transformers.MixtralForCausalLM(cfg), std=0.1).eval()


def hf_qwen3_moe() -> torch.nn.Module:
    """Qwen3-MoE: per-head q/k norms, top-2 of 6 not renormalised, a leading dense layer."""
    cfg = transformers.Qwen3MoeConfig(
        **BASE, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0], head_dim=16,
    )  # fmt: skip
    return randomize(transformers.Qwen3MoeForCausalLM(cfg), std=0.1).eval()


def hf_deepseek(**overrides: object) -> torch.nn.Module:
    """DeepSeek-V3: MLA (query compression, interleaved RoPE), a dense layer, sigmoid MoE."""
    kwargs = {
        **BASE, "num_hidden_layers": 3, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 24,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12,
        "routed_scaling_factor": 2.5, **overrides,
    }  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs))
    randomize(model, std=0.1)
    with torch.no_grad():  # the balancing bias is a buffer: give it values that change routing
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape) * 0.1)
    return model.eval()


HF_MODELS = {
    "mixtral": hf_mixtral,
    "qwen3-moe": hf_qwen3_moe,
    "deepseek-v3-mla-moe": hf_deepseek,
    "deepseek-v3-dense-no-q-rank": lambda: hf_deepseek(
        q_lora_rank=None, first_k_dense_replace=3, rope_interleave=False
    ),
    "deepseek-v3-yarn-mscale": lambda: hf_deepseek(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "original_max_position_embeddings": 16,
        }
    ),
}


def _ids(batch: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(0, 300, (batch, length))


@pytest.mark.parametrize("make", HF_MODELS.values(), ids=HF_MODELS.keys())
def test_import_gives_equal_logits_and_loss(make) -> None:
    hf = make()
    model = from_hf(hf).eval()
    idx = _ids()
    with torch.no_grad():
        ref, out = hf(idx).logits, model(idx)
        loss_ref, loss = hf(idx, labels=idx).loss, model(idx[:, :-1], idx[:, 1:])
    assert ref.std() > 0.5
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=ATOL)


KILN_MODELS = {
    "mixtral": llama_small(moe={"n_experts": 4, "top_k": 2, "d_expert": 32}),
    "qwen3-moe": llama_small(
        qk_norm=True,
        n_layer=3,
        moe={"n_experts": 5, "top_k": 3, "d_expert": 16, "norm_topk": False, "first_dense": 1},
    ),
    "deepseek-v3": llama_small(
        n_layer=3,
        tie_embeddings=False,
        mla={"kv_rank": 16, "q_rank": 24, "rope_dim": 8, "v_dim": 12},
        moe={
            "n_experts": 4,
            "top_k": 2,
            "d_expert": 16,
            "n_shared": 2,
            "score": "sigmoid",
            "routed_scale": 2.0,
            "first_dense": 1,
            "expert_bias": True,
        },
    ),
    "deepseek-v3-dense": llama_small(mla={"kv_rank": 12, "rope_dim": 4}),
}


@pytest.mark.parametrize("cfg", KILN_MODELS.values(), ids=KILN_MODELS.keys())
def test_export_gives_equal_logits_and_imports_back_identically(cfg: ModelConfig) -> None:
    model = build(cfg)
    hf = to_hf(model)
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), rtol=0, atol=ATOL)
    back = from_hf(hf)
    assert back.cfg == model.cfg
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


@pytest.mark.parametrize("name", ["mixtral", "deepseek-v3"])
def test_saved_directory_loads_in_transformers_and_back(tmp_path: Path, name: str) -> None:
    model = build(KILN_MODELS[name])
    save_hf_dir(model, tmp_path, eos_token_id=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), rtol=0, atol=ATOL)
    back = load_hf_dir(tmp_path)
    assert back.cfg == model.cfg
    torch.testing.assert_close(back(idx), model(idx), rtol=0, atol=0)


def test_a_directory_written_by_transformers_loads(tmp_path: Path) -> None:
    hf = hf_deepseek()
    hf.save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path)
    assert model.cfg.mla is not None and model.cfg.moe is not None
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, rtol=0, atol=ATOL)


def test_configs_no_family_expresses_are_refused() -> None:
    sigmoid = MoEConfig(n_experts=4, top_k=2, score="sigmoid")
    with pytest.raises(KilnError, match="DeepSeek-V3"):
        to_hf(build(llama_small(moe=sigmoid)))
    with pytest.raises(KilnError, match="attn_sinks"):
        to_hf(build(llama_small(attn_sinks=True)))
    with pytest.raises(KilnError, match="bias = false"):
        to_hf(build(llama_small(bias=True, mla=MLAConfig(kv_rank=8, rope_dim=4))))
    grouped = hf_deepseek(n_group=2, topk_group=1)
    with pytest.raises(KilnError, match="group-limited routing"):
        from_hf(grouped)


@pytest.mark.parametrize("make", [hf_mixtral, hf_qwen3_moe], ids=["mixtral", "qwen3-moe"])
def test_per_expert_checkpoint_layout_is_read(tmp_path: Path, make) -> None:
    hf = make()
    hf.save_pretrained(tmp_path)  # transformers writes experts.j.* / block_sparse_moe.* keys
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(load_hf_dir(tmp_path)(idx), hf(idx).logits, rtol=0, atol=ATOL)
