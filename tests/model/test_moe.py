"""Mixture of experts: routing, dispatch, balancing terms and bias, capacity, accounting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.model import ModelConfig, ModelConfigError, Transformer
from kiln.model.config import MoEConfig
from kiln.model.moe import MoE, balance_experts, grouped_matmul, moe_layers
from tests.model.helpers import build, llama_small


def moe_cfg(**moe: object) -> ModelConfig:
    """A tiny Llama whose MLPs are 6 experts of width 16, top-2."""
    return llama_small(moe={"n_experts": 6, "top_k": 2, "d_expert": 16, **moe})


def reference_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, straight from the formulas (no sorting, no grouping)."""
    m = layer.cfg
    out = torch.zeros_like(x)
    for n, token in enumerate(x):
        logits = layer.router.weight @ token  # (E,)
        scores = logits.softmax(-1) if m.score == "softmax" else logits.sigmoid()
        bias = layer.expert_bias if layer.expert_bias is not None else 0.0
        chosen = (scores + bias).topk(m.top_k).indices
        weights = scores[chosen]
        if m.norm_topk:
            weights = weights / weights.sum()
        for e, w in zip(chosen.tolist(), weights * m.routed_scale, strict=True):
            gate, up = (layer.experts.fc.weight[e] @ token).chunk(2)
            out[n] += w * (layer.experts.proj.weight[e] @ (F.silu(gate) * up))
        if layer.shared is not None:
            out[n] += layer.shared(token[None])[0]
    return out


VARIANTS = {
    "softmax-norm": {},
    "softmax-unnormed-top1": {"top_k": 1, "norm_topk": False},
    "sigmoid-shared-bias-scaled": {
        "score": "sigmoid", "n_shared": 2, "expert_bias": True, "routed_scale": 2.5,
    },
}  # fmt: skip


@pytest.mark.parametrize("moe", VARIANTS.values(), ids=VARIANTS.keys())
def test_dispatch_equals_the_per_token_formula(moe: dict) -> None:
    model = build(moe_cfg(**moe))
    layer = moe_layers(model)[0]
    if layer.expert_bias is not None:
        layer.expert_bias.copy_(torch.randn(6) * 0.3)
    x = torch.randn(1, 37, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], reference_moe(layer, x[0]), rtol=1e-5, atol=1e-5)


def test_grouped_matmul_fallback_matches_per_segment_products_and_has_gradients() -> None:
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(3, 5, 8, requires_grad=True)
    counts = torch.tensor([4, 0, 6])
    out = grouped_matmul(x, w, counts)
    torch.testing.assert_close(out, torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T]))
    out.sum().backward()
    assert w.grad is not None and bool(w.grad[1].eq(0).all()) and bool(w.grad[0].ne(0).any())


def test_grouped_mm_path_uses_the_same_segments_and_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    # kiln calls torch._grouped_mm on CUDA (bf16, Hopper+) only; its CPU kernel runs forward
    # in fp32, which checks the offsets and the weight transpose against the fallback here.
    import kiln.model.moe as moe

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    x, w, counts = torch.randn(12, 16), torch.randn(3, 8, 16), torch.tensor([5, 0, 7])
    expected = grouped_matmul(x, w, counts)
    monkeypatch.setattr(moe, "grouped_mm_available", lambda t: True)
    with torch.no_grad():
        torch.testing.assert_close(moe.grouped_matmul(x, w, counts), expected)


def test_capacity_drops_the_later_assignments_of_a_full_expert() -> None:
    dropless = build(moe_cfg())
    capped = build(moe_cfg(capacity_factor=0.25))
    x = torch.randn(1, 48, 64)
    with torch.no_grad():
        a, b = moe_layers(dropless)[0](x), moe_layers(capped)[0](x)
    same = torch.isclose(a, b, atol=1e-6).all(-1)[0]  # (T,): token unaffected by the capacity
    assert same[0] and not same.all()  # the first token always fits; some later ones dropped


def test_balancing_terms_are_added_in_training_only() -> None:
    cfg = moe_cfg(aux_loss=0.01, router_z_loss=0.001)
    model = build(cfg)
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        eval_loss = model(x, x)
        model.train()
        train_loss = model(x, x)
    layers = moe_layers(model)
    aux = sum(float(m.aux_loss) for m in layers)
    assert aux > 0 and float(train_loss) == pytest.approx(float(eval_loss) + aux, rel=1e-6)


def test_balancing_loss_is_one_when_routing_is_uniform() -> None:
    cfg = moe_cfg(aux_loss=1.0)
    model = build(cfg).train()
    layer = moe_layers(model)[0]
    torch.nn.init.zeros_(layer.router.weight)  # equal scores: P_i = 1/E
    layer(torch.randn(1, 60, 64))
    # Equal scores send every token to the same two experts, counts (60, 60, 0, 0, 0, 0), but
    # with P uniform the loss is E/(N·k)·Σ count_i/E = 1 whatever the counts.
    assert float(layer.aux_loss.detach()) == pytest.approx(1.0)


def test_bias_balancing_moves_load_off_the_busiest_expert_and_reports_stats() -> None:
    cfg = moe_cfg(expert_bias=True, bias_update_rate=0.05)
    model = build(cfg).train()
    layer = moe_layers(model)[0]
    x = torch.randn(1, 64, 64)
    first: dict[str, float] = {}
    for _ in range(40):
        with torch.no_grad():
            layer(x)
        stats = balance_experts(model)
        first = first or stats
    assert set(stats) >= {
        "moe.L0.load_min",
        "moe.L0.load_max",
        "moe.L0.load_entropy",
    }
    assert stats["moe.L0.load_max"] < first["moe.L0.load_max"]
    assert stats["moe.L0.load_entropy"] > first["moe.L0.load_entropy"]
    assert layer.load is None  # reset for the next step


def test_dead_experts_are_counted() -> None:
    model = build(moe_cfg()).train()
    for layer in moe_layers(model):
        with torch.no_grad():
            layer.router.weight.zero_()
        layer(torch.randn(1, 8, 64))  # equal scores: always the same two experts
    stats = balance_experts(model)
    assert stats["moe.dead_experts"] == 2 * 4  # 4 of 6 idle in each of 2 layers
    assert stats["moe.L0.load_min"] == 0.0


def test_first_dense_layers_and_active_parameter_count() -> None:
    cfg = moe_cfg(first_dense=1, n_shared=1)
    model = Transformer(cfg)
    assert not isinstance(model.blocks[0].mlp, MoE) and isinstance(model.blocks[1].mlp, MoE)
    expert = 3 * 64 * 16
    assert cfg.num_params() - cfg.num_active_params() == (6 - 2) * expert


@pytest.mark.parametrize(
    "moe, message",
    [
        ({"top_k": 7}, "moe.top_k must be in"),
        ({"score": "relu"}, "moe.score must be"),
        ({"bias_update_rate": 0.1}, "needs moe.expert_bias"),
        ({"capacity_factor": 0.0}, "moe.capacity_factor must be > 0"),
    ],
)
def test_bad_moe_settings_are_clear_errors(moe: dict, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        moe_cfg(**moe)
    with pytest.raises(ModelConfigError, match=message):
        MoEConfig(**{"n_experts": 6, **moe})
