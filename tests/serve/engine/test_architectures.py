"""Every architecture kiln.model builds, served by the engine: greedy output equals generate.

MLA from its latent cache (absorbed weights), attention sinks, soft-caps, sliding windows that
free their blocks, and the recurrent layers (Mamba-2, Gated DeltaNet, hybrids) with a state per
sequence; each under batch_invariant True and False, with the KV-block (and state-slot) books
audited after every test by the make_engine fixture.
"""

from __future__ import annotations

import pytest
import torch

from kiln.errors import KilnError
from kiln.model.generate import generate
from kiln.serve.engine import Engine, EngineConfig, EngineConfigError
from kiln.serve.engine.block_pool import (
    FREED,
    decompressed_kv_bytes_per_token,
    kv_bytes_per_token,
)
from kiln.serve.engine.drafters import LookupDrafter
from kiln.serve.engine.sampling import SamplingParams
from kiln.serve.engine.state_pool import state_bytes_per_sequence
from kiln.serve.engine.window_blocks import bound_per_sequence
from tests.model.helpers import build, llama_small
from tests.serve.conftest import random_prompts
from tests.serve.engine.test_engine import alone_and_in_a_crowd, drain

GREEDY = SamplingParams(max_tokens=12, temperature=0)
SSM = {"state_size": 8, "head_dim": 16, "n_groups": 2, "chunk_size": 4}
MLA = {"kv_rank": 16, "rope_dim": 8}

ARCHS = {
    "mla": llama_small(mla=MLA),
    "mla-qrank-sinks-window": llama_small(
        mla={**MLA, "q_rank": 24}, attn_sinks=True, sliding_window=7, window_pattern="LG"
    ),
    "sinks": llama_small(attn_sinks=True),
    "softcaps": llama_small(attn_softcap=5.0, logit_softcap=10.0),
    "sinks-softcap-window": llama_small(attn_sinks=True, attn_softcap=5.0, sliding_window=6),
    "mamba2": llama_small(layer_pattern="M", mlp="none", ssm=SSM),
    "deltanet": llama_small(layer_pattern="D", ssm=SSM),
    "hybrid-MDA": llama_small(n_layer=3, layer_pattern="MDA", ssm=SSM),
    "hybrid-DDDA-window": llama_small(n_layer=4, layer_pattern="DDDA", ssm=SSM, sliding_window=6),
}


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {}


def model_for(name: str, models: dict) -> torch.nn.Module:
    if name not in models:
        models[name] = build(ARCHS[name])
    return models[name]


def reference(model, prompts, max_tokens):
    """kiln.model.generate's greedy tokens for each prompt alone."""
    return [generate(model, [p], max_tokens, temperature=0.0)[0] for p in prompts]


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
@pytest.mark.parametrize("name", ARCHS)
def test_greedy_equals_generate_with_requests_joining(name, invariant, models, make_engine):
    model = model_for(name, models)
    prompts = random_prompts(6, 1, 30, 300, seed=11)
    # Small blocks, chunks and budget: prompts span blocks and chunks and share steps.
    engine = make_engine(model, block_size=4, prefill_chunk=8, max_tokens_per_step=24,
                         batch_invariant=invariant)  # fmt: skip
    handles = [engine.submit(p, GREEDY) for p in prompts[:3]]
    for prompt in prompts[3:]:  # the rest join while the first decode
        engine.step()
        engine.step()
        handles.append(engine.submit(prompt, GREEDY))
    out = drain(engine, handles)
    assert [c[0].token_ids for c in out] == reference(model, prompts, 12)


@pytest.mark.parametrize("name", ["mla-qrank-sinks-window", "sinks", "hybrid-MDA"])
def test_seeded_request_is_bitwise_independent_of_the_batch(name, models, make_engine) -> None:
    """The new paths (latent attention, sinks, per-sequence states) keep batch invariance."""
    alone, crowd = alone_and_in_a_crowd(model_for(name, models), make_engine)
    assert alone[0] == crowd[0]
    assert all(torch.equal(x, y) for x, y in zip(alone[1], crowd[1], strict=True))
    assert alone[2] == crowd[2]


# ------------------------------------------------------------------------------------ MLA
def test_mla_decodes_from_the_latent_without_decompressing_it(models, make_engine) -> None:
    model = model_for("mla", models)
    calls = []
    hooks = [b.attn.wkv_b.register_forward_hook(lambda *a: calls.append(1)) for b in model.blocks]
    try:
        prompts = random_prompts(3, 5, 20, 300, seed=12)
        expected = reference(model, prompts, 12)
        assert calls  # generate's cache decompresses the latent through wkv_b at every step
        calls.clear()
        engine = make_engine(model, block_size=4, prefill_chunk=8)
        assert [c[0].token_ids for c in engine.generate(prompts, GREEDY)] == expected
        assert calls == []  # the engine never expands the cache into per-head keys and values
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_per_token_is_the_pools_real_allocation(dtype) -> None:
    mla, gqa = llama_small(mla=MLA), llama_small()
    for cfg in (mla, gqa):
        model = build(cfg).to(dtype)
        engine = Engine(model, None, EngineConfig(num_blocks=10, block_size=4))
        pool = engine.pool
        stored = pool.k.numel() + (0 if pool.v is None else pool.v.numel())
        slots = (pool.num_blocks + 2) * pool.block_size  # the zero and scratch blocks too
        assert stored * pool.k.element_size() == kv_bytes_per_token(cfg, dtype) * slots
    size = torch.empty(0, dtype=dtype).element_size()
    n_layer = mla.n_layer
    # MLA: the latent (which is also the values) and the RoPE key, once per layer.
    assert kv_bytes_per_token(mla, dtype) == n_layer * (MLA["kv_rank"] + MLA["rope_dim"]) * size
    assert kv_bytes_per_token(gqa, dtype) == n_layer * 2 * gqa.kv_heads * gqa.head_size * size
    per_head = mla.n_head * (mla.qk_head_dim + mla.v_head_dim)
    assert decompressed_kv_bytes_per_token(mla, dtype) == n_layer * per_head * size


# --------------------------------------------------------------------------- sliding window
def test_blocks_out_of_every_window_return_to_the_pool(make_engine) -> None:
    model = build(llama_small(sliding_window=6, window_pattern="L"))
    prompts = random_prompts(3, 14, 20, 300, seed=13)
    params = SamplingParams(max_tokens=40, temperature=0)
    engine = make_engine(model, block_size=4, prefill_chunk=8, prefix_caching=False)
    handles = [engine.submit(p, params) for p in prompts]
    most_held = 0
    freed_seen = False
    while not all(h.done for h in handles):
        engine.step()
        engine.audit()
        for seq in engine.scheduler.running:
            live = [b for b in seq.blocks if b != FREED]
            most_held = max(most_held, len(live))
            freed_seen |= FREED in seq.blocks
        stats = engine.stats()
        assert stats.blocks_used + stats.blocks_free == stats.blocks_total
    # A window of 6 over blocks of 4 spans at most ceil(5 / 4) + 1 = 3 blocks, whatever the
    # length (up to 60 tokens = 15 blocks each).
    assert freed_seen and most_held <= 3
    out = [h.result()[0].token_ids for h in handles]
    assert out == reference(model, prompts, 40)


def test_a_mixed_model_frees_its_windowed_blocks_and_its_global_layers_keep_every_one(
    make_engine,
) -> None:
    model = build(llama_small(sliding_window=6, window_pattern="LG"))
    engine = make_engine(model, block_size=4, prefill_chunk=8, max_tokens_per_step=16,
                         prefix_caching=False)  # fmt: skip
    assert engine.windowed is not None
    local = engine.windowed.pool
    # Its pool is sized to what a window and one step span per sequence, not to the context.
    assert local.num_blocks == 64 * bound_per_sequence(6, 4, 16 + 4 + 1) < engine.pool.num_blocks
    assert set(engine.pool.index) == {1} and set(local.index) == {0}
    prompts = random_prompts(3, 14, 20, 300, seed=14)
    handles = [engine.submit(p, SamplingParams(max_tokens=40, temperature=0)) for p in prompts]
    most_held = 0
    freed_seen = False
    while not all(h.done for h in handles):
        engine.step()
        engine.audit()
        for seq in engine.scheduler.running:
            assert FREED not in seq.blocks and len(seq.local) == len(seq.blocks)
            decoding = seq.decoding and len(seq.tokens) > seq.prompt_len
            if decoding:  # a window of 6 over blocks of 4: ceil(5 / 4) + 1 = 3 blocks
                most_held = max(most_held, sum(b != FREED for b in seq.local))
            freed_seen |= FREED in seq.local
    assert freed_seen and most_held <= 3
    assert [h.result()[0].token_ids for h in handles] == reference(model, prompts, 40)


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_a_mixed_model_shares_prefixes_forks_samples_and_recomputes_when_preempted(
    make_engine, invariant
) -> None:
    model = build(llama_small(sliding_window=6, window_pattern="GL"))
    shared = random_prompts(1, 17, 17, 300, seed=15)[0]
    prompts = [shared + tail for tail in random_prompts(4, 3, 9, 300, seed=16)]
    want = reference(model, prompts, 24)
    # A pool small enough to preempt; prefix caching on; n = 2 forks after the prompt.
    engine = make_engine(model, block_size=4, prefill_chunk=8, max_tokens_per_step=16,
                         num_blocks=24, max_num_seqs=4, batch_invariant=invariant)  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0, n=2)
    first = engine.submit(prompts[0], params)
    drain(engine, [first])
    handles = [engine.submit(p, params) for p in prompts[1:]]
    out = [first.result(), *drain(engine, handles)]
    assert [[c.token_ids for c in r] for r in out] == [[w, w] for w in want]
    assert engine.scheduler.prefix_hits > 0 and engine.scheduler.preemptions > 0


# ------------------------------------------------------------------------ recurrent layers
def test_recurrent_layers_hold_a_constant_state_and_no_kv_blocks(models, make_engine) -> None:
    mamba, hybrid = model_for("mamba2", models), model_for("hybrid-MDA", models)
    engine = make_engine(mamba, block_size=4, max_num_seqs=3)
    assert engine.pool.k.numel() == 0  # no attention layer: no KV memory at all
    per_seq = state_bytes_per_sequence(mamba)
    assert sum(t.numel() * 4 for t in [*engine.states.conv.values(), *engine.states.ssm.values()]
               ) == per_seq * (3 + 1)  # fmt: skip  # the slots and one scratch slot
    engine = make_engine(hybrid, block_size=4)
    assert engine.pool.k.shape[0] == 1  # only the one attention layer of "MDA" keeps K/V
    assert kv_bytes_per_token(hybrid.cfg, torch.float32) * 3 == kv_bytes_per_token(
        llama_small(n_layer=3), torch.float32
    )
    # Longer sequences, the same state: the slots never grow.
    before = {k: v.shape for k, v in engine.states.ssm.items()}
    engine.generate(random_prompts(2, 30, 40, 300), SamplingParams(max_tokens=20, temperature=0))
    assert {k: v.shape for k, v in engine.states.ssm.items()} == before


@pytest.mark.parametrize("name", ["mamba2", "hybrid-MDA"])
def test_recurrent_preemption_recomputes_and_stays_exact(name, models, make_engine) -> None:
    model = model_for(name, models)
    prompts = random_prompts(6, 10, 20, 300, seed=3)
    params = SamplingParams(max_tokens=30, temperature=0)
    # 24 blocks of 4 tokens: six requests of up to 50 tokens cannot all stay resident.
    engine = make_engine(model, block_size=4, num_blocks=24, prefill_chunk=8)
    out = engine.generate(prompts, params)
    assert engine.stats().preemptions > 0
    assert [c[0].token_ids for c in out] == reference(model, prompts, 30)


def test_recurrent_long_prefill_is_chunked_while_others_decode(models, make_engine) -> None:
    model = model_for("hybrid-MDA", models)
    short, long = random_prompts(2, 3, 3, 300, seed=15)[0], random_prompts(1, 50, 50, 300)[0]
    engine = make_engine(model, block_size=4, prefill_chunk=8, max_tokens_per_step=10)
    a = engine.submit(short, GREEDY)
    engine.step()
    b = engine.submit(long, GREEDY)
    steps = 0
    while not b.done:
        engine.step()
        steps += 1
    assert steps > 50 // 8  # the long prompt took several steps, a decoding beside it
    drain(engine, [a])
    assert [a.result()[0].token_ids, b.result()[0].token_ids] == reference(model, [short, long], 12)


def test_recurrent_n_samples_fork_the_prompt_state(models, make_engine) -> None:
    model = model_for("hybrid-MDA", models)
    prompt = random_prompts(1, 10, 10, 300, seed=9)[0]
    engine = make_engine(model, block_size=4, prefill_chunk=8)
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3))
    single = make_engine(model, block_size=4, prefill_chunk=8)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    (alone,) = single.generate([prompt], seeded)[0]
    assert out[0].token_ids == alone.token_ids  # sample 0 is the seeded single
    assert len({tuple(c.token_ids) for c in out}) > 1


def test_speculation_with_recurrent_layers_is_refused_in_one_line(models) -> None:
    with pytest.raises(EngineConfigError, match=r"layer_pattern = 'MDA'.*without a drafter"):
        Engine(model_for("hybrid-MDA", models), None, EngineConfig(batch_invariant=False),
               drafter=LookupDrafter())  # fmt: skip


def test_recurrent_draft_model_is_refused(models) -> None:
    from kiln.serve.engine.drafters import ModelDrafter

    target = model_for("mla", models)
    with pytest.raises(KilnError, match="draft model has recurrent layers"):
        Engine(target, None, EngineConfig(batch_invariant=False),
               drafter=ModelDrafter(model_for("hybrid-MDA", models)))  # fmt: skip


@pytest.mark.parametrize("name", ["mla-qrank-sinks-window", "softcaps"])
def test_speculative_steps_verify_in_the_new_attention_paths(name, models, make_engine) -> None:
    model = model_for(name, models)
    prompts = [p * 3 for p in random_prompts(3, 3, 6, 300, seed=16)]  # repeats: lookup drafts
    engine = make_engine(model, block_size=4, prefill_chunk=8, batch_invariant=False,
                         drafter=LookupDrafter())  # fmt: skip
    out = engine.generate(prompts, GREEDY)
    assert engine.stats().draft_tokens > 0
    assert [c[0].token_ids for c in out] == reference(model, prompts, 12)
