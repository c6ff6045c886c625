"""Speculative steps inside the engine: exact greedy output, the target's law, rolled-back blocks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from kiln.errors import KilnError
from kiln.model.generate import generate
from kiln.serve.engine import Engine, EngineConfig, EngineConfigError, speculative
from kiln.serve.engine.drafters import LookupDrafter, ModelDrafter, truncated
from kiln.serve.engine.sampling import SamplingParams
from kiln.serve.engine.speculative import Warp
from tests.serve.conftest import random_prompts
from tests.serve.engine.test_speculative import (
    chi_square_p_value,
    exact_two_token_distribution,
    model,
)


class FixedDrafter(LookupDrafter):
    """Proposes one token k times for every sequence (always wrong when that token is unused)."""

    name = "fixed"

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, requests: Sequence[tuple[object, list[int], int]]) -> list[list[int]]:
        return [[self.token] * k for _, _, k in requests]


class CheckedEngine(Engine):
    """An engine that checks, after every step, that no sequence holds blocks past its tokens."""

    def step(self) -> int:
        produced = super().step()
        bs = self.pool.block_size
        for seq in self.scheduler.running:
            assert len(seq.blocks) <= -(-len(seq.tokens) // bs), "rejected drafts kept blocks"
            if seq.num_computed >= seq.prompt_len and not self.scheduler.preemptions:
                assert seq.decoding, "kept drafts not committed to the cache"
        self.audit()
        return produced


@pytest.fixture
def make_spec(make_engine):
    """Speculative engines, audited after every step and (as every engine) after the test."""

    def make(model, drafter, **config) -> Engine:
        return make_engine(model, drafter=drafter, engine_cls=CheckedEngine,
                           batch_invariant=False, **config)  # fmt: skip

    return make


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase (so prompt lookup finds matches), mixed lengths."""
    out = []
    for i, phrase in enumerate(random_prompts(n, 3, 7, 300, seed=seed)):
        out.append((phrase * 6)[: 9 + 5 * i])
    return out


def reference(target, prompts, max_tokens):
    return [generate(target, [p], max_tokens, temperature=0.0)[0] for p in prompts]


@pytest.mark.parametrize("drafter_name", ["ngram", "self", "truncated", "wrong"])
def test_greedy_output_equals_plain_decoding_for_many_requests(
    llama, make_spec, drafter_name
) -> None:
    drafters = {
        "ngram": lambda: LookupDrafter(),
        "self": lambda: ModelDrafter(llama),
        "truncated": lambda: ModelDrafter(truncated(llama, 1)),
        "wrong": lambda: FixedDrafter(299),
    }
    drafter = drafters[drafter_name]()
    prompts = repetitive_prompts(5)
    # Blocks of 4: verified segments of k+1 tokens cross block boundaries and get rolled back.
    engine = make_spec(llama, drafter, block_size=4, prefill_chunk=8, speculative_k=3)
    params = SamplingParams(max_tokens=20, temperature=0)
    out = engine.generate(prompts, params)
    assert [c[0].token_ids for c in out] == reference(llama, prompts, 20)
    stats = engine.stats()
    assert stats.speculative_steps > 0 and stats.draft_tokens > 0
    drafted = sum(c[0].drafted for c in out)
    accepted = sum(c[0].accepted for c in out)
    assert (drafted, accepted) == (stats.draft_tokens, stats.accepted_tokens)
    # Steps: each speculative step yields accepted + 1 tokens per sequence, so fewer steps.
    if drafter_name == "self":
        assert accepted == drafted  # the target drafting for itself is always right
        assert stats.steps < 20
    if drafter_name == "wrong":
        assert accepted == 0
    if isinstance(drafter, ModelDrafter):
        assert not drafter.seqs and drafter.pool.used == 0  # every draft block released


def test_the_draft_models_blocks_follow_rollbacks_and_finish_clean(llama, make_spec) -> None:
    drafter = ModelDrafter(truncated(llama, 1))
    prompts = repetitive_prompts(3, seed=1)
    engine = make_spec(llama, drafter, block_size=4, prefill_chunk=8, speculative_k=4)
    handles = [engine.submit(p, SamplingParams(max_tokens=16, temperature=0)) for p in prompts]
    while not all(h.done for h in handles):
        engine.step()
        for seq in engine.scheduler.running:
            st = drafter.seqs.get(seq)
            if st is not None:  # exactly the blocks its cached tokens need
                assert len(st.blocks) == -(-len(st.tokens) // 4)
    assert [h.result()[0].token_ids for h in handles] == reference(llama, prompts, 16)
    assert not drafter.seqs


class RecordingDrafter(ModelDrafter):
    """A ModelDrafter that keeps every context it was asked about and what it proposed."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.calls: list[tuple[list[int], list[int]]] = []

    def propose(self, requests):
        out = super().propose(requests)
        self.calls += [(list(ctx), list(p)) for (_, ctx, _), p in zip(requests, out, strict=True)]
        return out


def test_every_draft_is_the_draft_models_own_greedy_continuation_across_rejections(
    llama, make_spec
) -> None:
    # The target drafting for itself, with a presence penalty the draft does not apply: the
    # target turns away from the draft's argmax now and then, so drafts are rejected and the
    # draft model's cache must roll back to each new context (keys, values and positions).
    drafter = RecordingDrafter(llama)
    prompts = repetitive_prompts(3, seed=5)
    engine = make_spec(llama, drafter, block_size=4, prefill_chunk=8, speculative_k=4)
    params = SamplingParams(max_tokens=24, temperature=0, presence_penalty=1.5)
    engine.generate(prompts, params)
    stats = engine.stats()
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # kept some, rejected some
    assert len(drafter.calls) > 10
    for ctx, proposal in drafter.calls:
        assert proposal == generate(llama, [ctx], len(proposal), temperature=0.0)[0], len(ctx)


def test_stop_tokens_inside_accepted_drafts_end_the_output_there(llama, make_spec) -> None:
    prompt = repetitive_prompts(1, seed=2)[0]
    free = reference(llama, [prompt], 24)[0]
    stop = free[9]
    want = generate(llama, [prompt], 24, temperature=0, stop_tokens=[stop])[0]
    engine = make_spec(llama, ModelDrafter(llama), block_size=4, speculative_k=5)
    params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop,))
    (done,) = engine.generate([prompt], params)[0:1][0]
    assert done.token_ids == want and done.finish_reason == "stop"


def test_penalties_and_logprobs_match_plain_decoding(llama, make_engine, make_spec) -> None:
    prompts = repetitive_prompts(3, seed=3)
    params = SamplingParams(max_tokens=14, temperature=0, repetition_penalty=1.3, logprobs=2)
    plain = make_engine(llama, batch_invariant=False, block_size=4).generate(prompts, params)
    spec = make_spec(llama, ModelDrafter(llama), block_size=4).generate(prompts, params)
    for a, b in zip(plain, spec, strict=True):
        assert a[0].token_ids == b[0].token_ids
        for x, y in zip(a[0].logprobs, b[0].logprobs, strict=True):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert sum(c[0].accepted for c in spec) > 0


def test_speculation_is_off_for_steps_with_a_large_batch(llama, make_spec) -> None:
    prompts = repetitive_prompts(6, seed=4)
    engine = make_spec(llama, ModelDrafter(llama), block_size=8, speculative_max_batch=2,
                       max_num_seqs=8)  # fmt: skip
    handles = [engine.submit(p, SamplingParams(max_tokens=10, temperature=0)) for p in prompts]
    busy_drafts = []
    while not all(h.done for h in handles):
        decoding = sum(s.decoding for s in engine.scheduler.running)
        before = engine.stats().draft_tokens
        engine.step()
        if decoding > 2:
            busy_drafts.append(engine.stats().draft_tokens - before)
    assert busy_drafts and set(busy_drafts) == {0}  # never drafted with more than 2 decoding
    assert [h.result()[0].token_ids for h in handles] == reference(llama, prompts, 10)


def test_bad_combinations_are_refused(llama) -> None:
    with pytest.raises(EngineConfigError, match="batch_invariant and a drafter are exclusive"):
        Engine(llama, None, EngineConfig(), drafter=LookupDrafter())
    other = model(1, vocab_size=64)
    with pytest.raises(KilnError, match=r"vocabulary \(64\) differs from the target's \(300\)"):
        Engine(llama, None, EngineConfig(batch_invariant=False), drafter=ModelDrafter(other))
    with pytest.raises(EngineConfigError, match="speculative_k must be an integer >= 1"):
        EngineConfig(speculative_k=0)
    with pytest.raises(KilnError, match="1 <= layers <= 2"):
        truncated(llama, 3)


def engine_two_token_counts(drafter, target, warp: Warp, n: int, make_spec) -> tuple:
    """First two tokens of n seeded requests through a speculative engine, all in flight."""
    engine = make_spec(target, drafter, block_size=4, max_num_seqs=64, speculative_k=2,
                       speculative_max_batch=64)  # fmt: skip
    prompt = [1, 2, 3, 1, 2]
    params = [SamplingParams(max_tokens=3, temperature=warp.temperature, top_k=warp.top_k,
                             seed=s, ignore_eos=True) for s in range(n)]  # fmt: skip
    out = engine.generate([prompt] * n, params)
    counts: Counter[tuple[int, int]] = Counter(tuple(c[0].token_ids[:2]) for c in out)
    return counts, engine.stats()


@pytest.mark.parametrize(("drafter_name", "min_accepted"), [("model", 0.3), ("ngram", 0.02)])
def test_sampled_output_through_the_engine_has_the_target_distribution(
    drafter_name, min_accepted, make_spec
) -> None:
    target = model(0, vocab_size=6, n_layer=1, std=0.1)
    warp = Warp(temperature=1.0, top_k=5)
    probs = exact_two_token_distribution(target, [1, 2, 3, 1, 2], warp)
    drafter = ModelDrafter(target) if drafter_name == "model" else LookupDrafter()
    n = 800
    counts, stats = engine_two_token_counts(drafter, target, warp, n, make_spec)
    assert min_accepted * stats.draft_tokens < stats.accepted_tokens < stats.draft_tokens
    assert chi_square_p_value(counts, probs, n) > 1e-3


def test_the_engine_chi_square_catches_a_wrong_residual(monkeypatch, make_spec) -> None:
    # After a rejection, drawing from p itself (not the residual) over-weights the drafts.
    monkeypatch.setattr(speculative, "residual_distribution", lambda p, q: p)
    target = model(0, vocab_size=6, n_layer=1, std=0.1)
    warp = Warp(temperature=1.0, top_k=5)
    probs = exact_two_token_distribution(target, [1, 2, 3, 1, 2], warp)
    counts, _ = engine_two_token_counts(ModelDrafter(target), target, warp, 800, make_spec)
    assert chi_square_p_value(counts, probs, 800) < 1e-6


def test_a_seeded_sample_repeats_with_the_same_drafter(llama, make_spec) -> None:
    prompt = repetitive_prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=7)
    runs = [make_spec(llama, LookupDrafter(), block_size=4).generate([prompt], params)[0][0]
            for _ in range(2)]  # fmt: skip
    assert runs[0].token_ids == runs[1].token_ids


def test_prompt_lookup_continues_a_repeating_pattern_past_the_context() -> None:
    lookup = LookupDrafter(max_ngram=2)
    asks = [("a", [1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 3), ("b", [7, 8, 9, 7, 8], 5),
            ("c", [1, 2, 3], 4), ("d", [4, 4, 4], 3)]  # fmt: skip
    assert lookup.propose(asks) == [[5, 6, 1], [9, 7, 8, 9, 7], [], [4, 4, 4]]
