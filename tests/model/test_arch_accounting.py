"""Accounting of MoE (total and active), MLA and sinks, checked against the module and torch's
FlopCounterMode, and the KV-cache size per token against the cache the model fills."""

from __future__ import annotations

import pytest
import torch

from kiln.model import ModelConfig, Transformer
from kiln.model.accounting import flop_count
from kiln.model.kv_cache import KVCache
from tests.fixtures import single_torch_thread
from tests.model.test_accounting import measured_breakdown

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)  # as under tests/scaling/

MOE = {"n_experts": 6, "top_k": 2, "d_expert": 24}
VARIANTS = {
    "moe": {"moe": MOE},
    "moe-shared-dense-first-bias": {
        "moe": {**MOE, "n_shared": 1, "first_dense": 1}, "bias": True, "n_layer": 3,
    },
    "moe-gelu": {"moe": MOE, "mlp": "gelu"},
    "mla": {"mla": {"kv_rank": 16, "rope_dim": 8}},
    "mla-qrank-vdim-bias": {
        "mla": {"kv_rank": 16, "q_rank": 24, "rope_dim": 8, "nope_dim": 12, "v_dim": 20},
        "bias": True,
    },
    "mla-moe-sinks": {"mla": {"kv_rank": 16, "rope_dim": 8}, "moe": MOE, "attn_sinks": True},
}  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
def test_breakdown_matches_the_module(variant: str) -> None:
    cfg = ModelConfig.preset("tiny", **VARIANTS[variant])
    model = Transformer(cfg)
    assert cfg.param_breakdown() == measured_breakdown(model)
    if cfg.moe is not None:  # active: the routed experts a token does not use are left out
        n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layer))
        per_expert = sum(p.numel() for p in model.blocks[-1].mlp.experts.parameters()) // 6
        assert cfg.num_params() - cfg.num_active_params() == n_moe * 4 * per_expert


@pytest.mark.parametrize("variant", VARIANTS)
def test_flops_match_torch_flop_counter(variant: str) -> None:
    """Forward matmuls of a real forward (math attention: q·kᵀ and p·v over the full T×T)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = ModelConfig.preset("tiny", **VARIANTS[variant], attention_backend="math")
    model = Transformer(cfg)
    B, T = 2, 32
    x = torch.randint(0, cfg.vocab_size, (B, T))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x, x)
    expected = flop_count(cfg, T)
    assert counter.get_total_flops() == B * T * expected.forward
    assert 3 * expected.forward == cfg.flops_per_token(T)


@pytest.mark.parametrize("variant", ["mla", "mla-qrank-vdim-bias"])
def test_mla_caches_its_latent_and_rope_key_only(variant: str) -> None:
    cfg = ModelConfig.preset("tiny", **VARIANTS[variant])
    cache = KVCache(cfg, 1, 10)
    stored = sum(t.numel() for t in cache.k + cache.v) * 2  # bf16 bytes, 10 tokens
    assert stored == 10 * cfg.kv_cache_bytes_per_token()
    assert cfg.kv_cache_bytes_per_token() == cfg.n_layer * (16 + 8) * 2
    gqa = ModelConfig.preset("tiny")
    assert gqa.kv_cache_bytes_per_token() == gqa.n_layer * 2 * 2 * 16 * 2  # 2 kv heads of 16
