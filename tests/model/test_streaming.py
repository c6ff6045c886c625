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
