"""Attention sinks (learned per-head logits) and StreamingLLM-style streaming with a sink cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.errors import KilnError
from kiln.model.attention import attention_weights, math_attention
from kiln.model.streaming import SinkCache, stream_generate, streaming_nll
from tests.model.helpers import build, gpt2_small, llama_small

STREAMING = {
    "llama": llama_small(),
    "llama-sinks-yarn": llama_small(
        attn_sinks=True, rope_scaling={"type": "yarn", "factor": 2.0, "original_max_seq_len": 32}
    ),
    "mla": llama_small(mla={"kv_rank": 16, "rope_dim": 8}),
}


def test_sink_logits_take_mass_from_the_keys_and_minus_infinity_is_plain_softmax() -> None:
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    sinks = torch.tensor([0.0, 1.0, 2.0, -1.0])
    w = attention_weights(q, k, None, sinks=sinks)
    plain = attention_weights(q, k, None)
    assert bool((w.sum(-1) < 1).all())
    # softmax over [scores, s] = plain softmax · Z / (Z + e^s), row by row
    scores = (q @ k.repeat_interleave(2, 1).transpose(-2, -1)) / 8**0.5
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    z = scores.exp().sum(-1, keepdim=True)
    torch.testing.assert_close(w, plain * z / (z + sinks.exp()[None, :, None, None]))
    none = math_attention(q, k, v, None, sinks=torch.full((4,), -1e9))
    torch.testing.assert_close(none, math_attention(q, k, v, None))


@pytest.mark.parametrize("cfg", STREAMING.values(), ids=STREAMING.keys())
def test_streaming_before_any_eviction_equals_the_full_forward(cfg) -> None:
    model = build(cfg)
    ids = torch.randint(0, 300, (30,)).tolist()
    with torch.no_grad():
        full = torch.nn.functional.cross_entropy(
            model(torch.tensor([ids[:-1]]))[0], torch.tensor(ids[1:]), reduction="none"
        )
    torch.testing.assert_close(
        streaming_nll(model, ids, n_sink=4, window=40), full, rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("cfg", STREAMING.values(), ids=STREAMING.keys())
def test_after_eviction_the_cache_is_the_sinks_and_window_recomputed_at_cache_positions(
    cfg,
) -> None:
    # One layer: its keys and values depend on the token and its position only, so the
    # re-rotated cache must give what a fresh forward over [sinks + last window] gives. (Deeper
    # layers' cached states also saw the evicted tokens: StreamingLLM does not recompute them.)
    cfg = dataclasses.replace(cfg, n_layer=1)
    model = build(cfg)
    ids = torch.randint(0, 300, (50,)).tolist()
    n_sink, window = 3, 9
    cache = SinkCache(cfg, 1, n_sink, window)
    with torch.no_grad():
        for t, token in enumerate(ids):
            cache.make_room(1)
            logits = model.logits(model.hidden(torch.tensor([[token]]), cache))[0, -1]
            if t >= n_sink + window:
                kept = ids[:n_sink] + ids[t - window + 1 : t + 1]
                fresh = model(torch.tensor([kept]))[0, -1]
                torch.testing.assert_close(logits, fresh, rtol=0, atol=1e-4)
    assert cache.length == n_sink + window and cache.evicted == len(ids) - n_sink - window


def test_generation_runs_past_block_size_with_a_bounded_cache() -> None:
    model = build(llama_small(block_size=32))
    out = list(stream_generate(model, [1, 2, 3], 100, n_sink=4, window=20))
    assert len(out) == 100  # 103 tokens through a model of block_size 32


def test_learned_positions_stream_too_and_bad_windows_are_clear_errors() -> None:
    model = build(gpt2_small())
    assert streaming_nll(model, list(range(100)), n_sink=2, window=30).shape == (99,)
    with pytest.raises(KilnError, match="n_sink \\+ window <= block_size"):
        SinkCache(model.cfg, 1, 10, 60)


def test_sink_attention_equals_transformers_gpt_oss_attention() -> None:
    # The module, not the whole model: gpt-oss's MoE (clamped SwiGLU with a +1 on up, biased
    # experts) is not kiln's, so only its attention with sinks is compared.
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss

    from kiln.model.layers import CausalSelfAttention
    from kiln.model.rope import rope_tables

    hf_cfg = transformers.GptOssConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=1, layer_types=["full_attention"], attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    hf = gpt_oss.GptOssAttention(hf_cfg, 0).eval()
    torch.nn.init.normal_(hf.sinks, std=1.0)
    cfg = llama_small(attn_sinks=True, bias=True)
    ours = CausalSelfAttention(cfg, 0).eval()
    with torch.no_grad():
        for name in ("weight", "bias"):
            parts = [getattr(hf, f"{p}_proj").__getattr__(name) for p in "qkv"]
            getattr(ours.qkv, name).copy_(torch.cat(parts))
            getattr(ours.proj, name).copy_(getattr(hf.o_proj, name))
        ours.sinks.copy_(hf.sinks)
        x = torch.randn(2, 20, 64)
        cos, sin = gpt_oss.GptOssRotaryEmbedding(hf_cfg)(x, torch.arange(20)[None].expand(2, -1))
        causal = torch.full((20, 20), float("-inf")).triu(1)[None, None]
        expected, _ = hf(x, (cos, sin), causal)
        rope = tuple(t[:20] for t in rope_tables(cfg))
        torch.testing.assert_close(ours(x, rope, None), expected, rtol=0, atol=1e-5)
        ours.sinks.fill_(-1e9)  # no sinks: clearly different, so the sinks are what matched
        assert not torch.allclose(ours(x, rope, None), expected, atol=1e-3)


def sink_model() -> torch.nn.Module:
    """A constructed 1-layer model that parks its attention on token 0, as trained LMs do on
    their first tokens: every query carries a large constant in its slowest RoPE pair (barely
    rotating over 128 positions), only token 0's key matches it, and token 0's value is zero."""
    cfg = llama_small(n_layer=1, bias=True, rope_theta=1e9, block_size=128)
    model = build(cfg)
    H, Hkv, D = cfg.n_head, cfg.kv_heads, cfg.head_size
    with torch.no_grad():
        model.wte.weight[:, 0] = 0.0
        model.wte.weight[0] = 0.0
        model.wte.weight[0, 0] = 1.0  # token 0: all its (normalised) mass in feature 0
        model.blocks[0].norm1.weight[0] = 1.0
        qkv = model.blocks[0].attn.qkv
        qkv.weight[:, 0] = 0.0  # feature 0 feeds nothing but the sink key below
        for h in range(H):
            qkv.weight[h * D + 7], qkv.bias[h * D + 7] = 0.0, 10.0
        for g in range(Hkv):
            row = H * D + g * D + 7
            qkv.weight[row], qkv.bias[row] = 0.0, 0.0
            qkv.weight[row, 0] = 1.0
        qkv.bias[H * D + Hkv * D :] = 0.0  # values: token 0's is zero
    return model.eval()


def test_with_sinks_perplexity_stays_where_window_eviction_degrades() -> None:
    # A constructed case (not a trained model): text sampled from the model itself, so the
    # full-attention NLL is the reference; past the window, evicting token 0 shifts every
    # softmax, keeping it as a sink reproduces full attention.
    from kiln.model.attention_maps import attention_maps
    from kiln.model.generate import generate

    model = sink_model()
    text = [0] + generate(model, [[0]], 119, temperature=1.0, seed=0)[0]
    (weights,) = attention_maps(model, torch.tensor([text]))
    assert float(weights[0, :, 8:, 0].min()) > 0.9  # every head parks on token 0
    with torch.no_grad():
        logits = model(torch.tensor([text[:-1]]))[0]
    full = torch.nn.functional.cross_entropy(logits, torch.tensor(text[1:]), reduction="none")
    sinks = streaming_nll(model, text, n_sink=1, window=31)
    window = streaming_nll(model, text, n_sink=0, window=32)
    late = slice(40, None)  # well past the 32-token cache
    assert float(sinks[late].mean()) == pytest.approx(float(full[late].mean()), abs=0.02)
    assert float(window[late].mean()) > float(full[late].mean()) + 0.5
