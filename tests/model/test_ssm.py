"""Mamba-2 and Gated DeltaNet: the chunked and recurrent forms agree, hybrids, cached decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.model import ModelConfig, Transformer
from kiln.model.config import ModelConfigError
from kiln.model.generate import generate
from kiln.model.kv_cache import KVCache
from kiln.model.ssm import (
    GatedDeltaNet,
    Mamba2Mixer,
    delta_rule_chunked,
    delta_rule_recurrent,
    ssd_chunked,
    ssd_recurrent,
)

TOL = dict(atol=1e-5, rtol=1e-5)


def ssd_inputs(seed: int, T: int = 37, B: int = 2, H: int = 4, P: int = 8, G: int = 2, N: int = 6):
    """Random SSD inputs with decays strong enough that a wrong chunk boundary shows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, P, generator=gen)
    dt = F.softplus(torch.randn(B, T, H, generator=gen))
    A = -torch.rand(H, generator=gen) * 2 - 0.1
    Bm, Cm = torch.randn(B, T, G, N, generator=gen), torch.randn(B, T, G, N, generator=gen)
    h0 = torch.randn(B, H, P, N, generator=gen)
    return x, dt, A, Bm, Cm, h0


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 64])
def test_ssd_chunked_equals_recurrent_at_any_chunk_size(chunk: int) -> None:
    x, dt, A, Bm, Cm, h0 = ssd_inputs(0)
    y_ref, h_ref = ssd_recurrent(x, dt, A, Bm, Cm, h0)
    y, h = ssd_chunked(x, dt, A, Bm, Cm, chunk, h0)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(h, h_ref, **TOL)


def test_ssd_recurrent_is_the_scan_it_claims() -> None:
    """One head by hand: h = exp(Δa)·h + Δ·x⊗B, y = h·C, with B, C of the head's group."""
    x, dt, A, Bm, Cm, _ = ssd_inputs(1, T=5, B=1, H=2, G=1)
    y, _ = ssd_recurrent(x, dt, A, Bm, Cm)
    head = 1
    h = torch.zeros(x.shape[-1], Bm.shape[-1])
    for t in range(5):
        h = torch.exp(dt[0, t, head] * A[head]) * h
        h = h + dt[0, t, head] * torch.outer(x[0, t, head], Bm[0, t, 0])
        torch.testing.assert_close(y[0, t, head], h @ Cm[0, t, 0], **TOL)


def delta_inputs(seed: int, T: int = 29, B: int = 2, H: int = 3, Dk: int = 8, Dv: int = 6):
    """Random gated-delta inputs: L2-normalised keys (as the layer makes them), g ≤ 0."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, Dk, generator=gen) * Dk**-0.5
    k = F.normalize(torch.randn(B, T, H, Dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    g = -torch.rand(B, T, H, generator=gen)
    S0 = torch.randn(B, H, Dk, Dv, generator=gen)
    return q, k, v, beta, g, S0


def delta_rule_loop(q, k, v, beta, g, S0):
    """The reference, written out per row and head: S ← exp(g)·(I − β·k·kᵀ)·S + β·k·vᵀ; o = Sᵀq."""
    B, T, H, Dk = k.shape
    o = torch.zeros(B, T, H, v.shape[-1])
    S_out = torch.zeros_like(S0)
    for b in range(B):
        for h in range(H):
            S = S0[b, h].clone()
            for t in range(T):
                kt = k[b, t, h][:, None]  # (Dk, 1)
                S = torch.exp(g[b, t, h]) * (torch.eye(Dk) - beta[b, t, h] * kt @ kt.T) @ S
                S = S + beta[b, t, h] * kt @ v[b, t, h][None]
                o[b, t, h] = S.T @ q[b, t, h]
            S_out[b, h] = S
    return o, S_out


def test_delta_rule_recurrent_equals_the_plain_loop() -> None:
    q, k, v, beta, g, S0 = delta_inputs(0, T=9)
    o, S = delta_rule_recurrent(q, k, v, beta, g, S0)
    o_ref, S_ref = delta_rule_loop(q, k, v, beta, g, S0)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(S, S_ref, **TOL)


@pytest.mark.parametrize("chunk", [1, 4, 8, 29, 64])
def test_delta_rule_chunked_equals_recurrent_at_any_chunk_size(chunk: int) -> None:
    q, k, v, beta, g, S0 = delta_inputs(1)
    o_ref, S_ref = delta_rule_recurrent(q, k, v, beta, g, S0)
    o, S = delta_rule_chunked(q, k, v, beta, g, chunk, S0)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(S, S_ref, **TOL)


def test_delta_rule_matches_qwen3_next_reference_recurrences() -> None:
    """transformers' Qwen3-Next torch recurrences (flash-linear-attention's reference API)."""
    qwen = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, beta, g, S0 = delta_inputs(2, T=20)
    raw_q = q * q.shape[-1] ** 0.5  # theirs scales q by 1/√Dk itself
    o, S = delta_rule_chunked(q, k, v, beta, g, 8, S0)
    for fn, extra in ((qwen.torch_recurrent_gated_delta_rule, {}),
                      (qwen.torch_chunk_gated_delta_rule, {"chunk_size": 8})):  # fmt: skip
        o_ref, S_ref = fn(raw_q, k, v, g, beta, initial_state=S0, output_final_state=True, **extra)
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(S, S_ref, **TOL)


def hybrid(pattern: str = "MDA", **overrides: object) -> ModelConfig:
    """A small model with every mixer kind, chunks short enough that prompts span several."""
    ssm = {"state_size": 8, "head_dim": 16, "n_groups": 2, "chunk_size": 4}
    base = dict(vocab_size=97, block_size=64, n_layer=3, layer_pattern=pattern, ssm=ssm)
    return ModelConfig.preset("tiny", **{**base, **overrides})


def build(cfg: ModelConfig) -> Transformer:
    """A float64-free, eval-mode model with non-trivial recurrent parameters."""
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def test_layer_pattern_places_mixers_cyclically() -> None:
    model = Transformer(hybrid("DDDA", n_layer=8))
    kinds = [type(b.attn).__name__ for b in model.blocks]
    assert kinds == ["GatedDeltaNet"] * 3 + ["CausalSelfAttention"] + ["GatedDeltaNet"] * 3 + [
        "CausalSelfAttention"
    ]
    mamba_only = Transformer(hybrid("M", mlp="none", n_layer=2))
    assert all(isinstance(b.attn, Mamba2Mixer) and b.mlp is None for b in mamba_only.blocks)
    assert isinstance(Transformer(hybrid("D", n_layer=1)).blocks[0].attn, GatedDeltaNet)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"layer_pattern": "AX"}, "layer_pattern"),
        ({"layer_pattern": ""}, "layer_pattern"),
        ({"ssm": {"head_dim": 48}}, "ssm.head_dim"),
        ({"ssm": {"chunk_size": 0}}, "ssm.chunk_size"),
        ({"parallel_block": True}, "parallel_block"),
        ({"mlp": "none", "norm_placement": "post"}, "mlp = 'none'"),
    ],
)
def test_bad_ssm_configs_are_refused_naming_the_field(overrides: dict, needle: str) -> None:
    with pytest.raises(ModelConfigError, match=needle):
        hybrid(**overrides)


@pytest.mark.parametrize("pattern", ["M", "D", "MDA"])
def test_cached_prefill_and_decode_equal_the_full_forward(pattern: str) -> None:
    model = build(hybrid(pattern))
    idx = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(idx)  # (B, T, V)
        cache = KVCache(model.cfg, 2, 19)
        steps = [model(idx[:, :7], cache=cache)]  # a prefill over two chunks and a bit
        steps += [model(idx[:, t : t + 1], cache=cache) for t in range(7, 19)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def test_generate_with_ragged_prompts_equals_each_prompt_alone() -> None:
    model = build(hybrid("MDA"))
    prompts = [[5, 9, 2, 44, 7, 8, 1], [3, 3], [60, 2, 9, 1]]
    together = generate(model, prompts, 6, temperature=0)
    alone = [generate(model, [p], 6, temperature=0)[0] for p in prompts]
    assert together == alone
    with torch.no_grad():  # and greedy decoding is argmax of repeated full forwards
        seq = list(prompts[0])
        for _ in range(6):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert together[0] == seq[len(prompts[0]) :]


def test_recurrent_layers_refuse_packed_segments() -> None:
    model = build(hybrid("MA", n_layer=2))
    idx = torch.randint(0, 97, (1, 8))
    with pytest.raises(KilnError, match="layer_pattern"):
        model(idx, idx, segments=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]))


def test_a_hybrid_trains() -> None:
    """A few optimizer steps on one batch lower its loss: gradients reach every mixer."""
    model = Transformer(hybrid("MDA")).train()
    idx = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    grads = {
        n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0
    }
    assert {"blocks.0.attn.A_log", "blocks.1.attn.A_log", "blocks.0.attn.conv.weight"} <= grads
    assert losses[-1] < losses[0] - 0.5


def test_engine_speculation_and_mesh_refuse_recurrent_layers_in_one_line() -> None:
    from kiln.serve.engine import check_servable
    from kiln.train.parallelize import _check_mesh_supports

    cfg = hybrid("MDA")
    check_servable(cfg)  # the engine serves it (tests/serve/engine/test_architectures.py)...
    with pytest.raises(KilnError, match="layer_pattern = 'MDA'"):
        check_servable(cfg, speculative=True)  # ...but not speculatively
    for shape in ({"tp": 2, "pp": 1}, {"tp": 1, "pp": 2}):
        with pytest.raises(KilnError, match="layer_pattern = 'MDA'"):
            _check_mesh_supports(cfg, shape)
    _check_mesh_supports(cfg, {"tp": 1, "pp": 1})  # ddp / fsdp take it
