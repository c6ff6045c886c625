"""The engine: exact greedy output, batch-independent numbers, preemption, prefix sharing."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kiln.errors import KilnError
from kiln.model.generate import generate
from kiln.serve.engine import Engine
from kiln.serve.engine.sampling import SamplingParams
from tests.fixtures import thread_counts
from tests.serve.conftest import random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def reference(model, prompts, max_tokens):
    """kiln.model.generate's greedy tokens for each prompt alone."""
    return [generate(model, [p], max_tokens, temperature=0.0)[0] for p in prompts]


def drain(engine: Engine, handles) -> list:
    while not all(h.done for h in handles):
        engine.step()
    return [h.result() for h in handles]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_equals_generate_alone_for_mixed_lengths(arch, request, make_engine) -> None:
    model = request.getfixturevalue(arch)
    prompts = random_prompts(7, 1, 40, 300)
    # Small blocks, chunks and budget: prompts span blocks, chunks and several steps.
    engine = make_engine(model, block_size=4, prefill_chunk=8, max_tokens_per_step=24)
    out = engine.generate(prompts, GREEDY)
    assert [c[0].token_ids for c in out] == reference(model, prompts, 12)
    assert all(c[0].finish_reason == "length" for c in out)


def test_requests_joining_mid_way_decode_exactly(llama, make_engine) -> None:
    prompts = random_prompts(6, 2, 30, 300, seed=1)
    engine = make_engine(llama, block_size=8, prefill_chunk=16, max_tokens_per_step=32)
    handles = [engine.submit(prompts[0], GREEDY)]
    for prompt in prompts[1:]:
        for _ in range(3):
            engine.step()
        handles.append(engine.submit(prompt, GREEDY))
    out = drain(engine, handles)
    assert [c[0].token_ids for c in out] == reference(llama, prompts, 12)


def test_sliding_window_model_decodes_exactly(make_engine) -> None:
    from tests.model.helpers import build, llama_small

    model = build(llama_small(block_size=64, sliding_window=6, window_pattern="LG"))
    prompts = random_prompts(4, 3, 20, 300, seed=2)
    engine = make_engine(model, block_size=4, prefill_chunk=8)
    out = engine.generate(prompts, GREEDY)
    assert [c[0].token_ids for c in out] == reference(model, prompts, 12)


@pytest.mark.parametrize("window", [None, 24])
def test_batch_1_fast_path_attends_a_view_of_its_blocks_and_decodes_exactly(
    window, make_engine, monkeypatch
) -> None:
    from kiln.serve.engine import engine as engine_module
    from tests.model.helpers import build, llama_small

    # With a window, the early steps see every key (the view); later ones (more keys than the
    # window, then blocks freed behind it) fall back to the masked gather: all decode exactly.
    model = build(llama_small(block_size=64, sliding_window=window))
    built = []
    original = engine_module.PagedStep

    def spy(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(engine_module, "PagedStep", spy)
    engine = make_engine(model, block_size=4, prefill_chunk=8, batch_invariant=False)
    prompts = random_prompts(3, 10, 20, 300, seed=7)
    out = [engine.generate([p], GREEDY)[0][0].token_ids for p in prompts]  # one at a time
    assert out == reference(model, prompts, 12)
    assert sum(step.single is not None for step in built) >= 10  # the view path ran


def test_preemption_recomputes_and_stays_exact(llama, make_engine) -> None:
    prompts = random_prompts(6, 10, 20, 300, seed=3)
    params = SamplingParams(max_tokens=30, temperature=0)
    # 24 blocks of 4 tokens: six requests of up to 50 tokens cannot all stay resident.
    engine = make_engine(llama, block_size=4, num_blocks=24, prefill_chunk=8, prefix_caching=False)
    out = engine.generate(prompts, params)
    assert engine.stats().preemptions > 0
    assert [c[0].token_ids for c in out] == reference(llama, prompts, 30)


def test_a_shared_prefix_is_prefilled_once(llama, make_engine) -> None:
    system = random_prompts(1, 16, 16, 300, seed=4)[0]  # four whole blocks of 4
    prompts = [system + tail for tail in random_prompts(4, 1, 6, 300, seed=5)]
    engine = make_engine(llama, block_size=4, prefill_chunk=8)
    first = engine.generate(prompts[:1], GREEDY)
    rest = engine.generate(prompts[1:], GREEDY)
    assert engine.stats().prefix_hits == 3 * 16
    got = [c[0].token_ids for c in first + rest]
    assert got == reference(llama, prompts, 12)


def test_concurrent_requests_hold_shared_prefix_blocks_together(llama, make_engine) -> None:
    system = random_prompts(1, 8, 8, 300, seed=6)[0]
    prompts = [[*system, 7], [*system, 9, 10]]
    engine = make_engine(llama, block_size=4, prefill_chunk=8)
    a = engine.submit(prompts[0], GREEDY)
    engine.step()  # a's prompt is computed and its two full blocks registered
    b = engine.submit(prompts[1], GREEDY)
    engine.step()  # b is admitted on a's blocks
    shared = a.engine._requests[a].samples[0].seq.blocks[:2]
    assert engine._requests[b].samples[0].seq.blocks[:2] == shared
    assert [engine.pool.refs[x] for x in shared] == [2, 2]
    out = drain(engine, [a, b])
    assert [c[0].token_ids for c in out] == reference(llama, prompts, 12)


def alone_and_in_a_crowd(model, make_engine, **config) -> tuple[tuple, tuple]:
    """A seeded request's (tokens, logits rows, logprobs) alone and amid others joining."""
    prompt = random_prompts(1, 21, 21, 300, seed=7)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=123, logprobs=3)

    def run(crowd: bool) -> tuple[list[int], list[torch.Tensor], list[float]]:
        rows: list[torch.Tensor] = []
        spy = SamplingParams(**{**params.__dict__, "logits_processors": (record(rows),)})
        engine = make_engine(model, block_size=4, prefill_chunk=8, max_tokens_per_step=20,
                             prefix_caching=False, **config)  # fmt: skip
        others = random_prompts(9, 1, 35, 300, seed=8)
        handles = []
        if crowd:  # others first, so ours joins a busy batch and shares its steps with prefills
            handles += [engine.submit(p, SamplingParams(max_tokens=20, seed=i))
                        for i, p in enumerate(others[:4])]  # fmt: skip
            engine.step()
        ours = engine.submit(prompt, spy)
        for p in others[4:] if crowd else []:
            engine.step()
            handles.append(engine.submit(p, SamplingParams(max_tokens=9, temperature=0)))
        (done,) = drain(engine, [ours, *handles])[0]
        return done.token_ids, rows, [e.logprob for e in done.logprobs]

    return run(False), run(True)


@pytest.mark.parametrize("rows", [16, 1], ids=["tile16", "tile1"])
@pytest.mark.parametrize("threads", thread_counts())
def test_seeded_request_is_bitwise_independent_of_the_batch(
    llama, make_engine, threads, rows
) -> None:
    """fp32 on CPU: the same logits rows and tokens alone and amid others joining at any step
    (with the default 16-row tiles, and with 1-row tiles, the batch-1 latency setting)."""
    torch.set_num_threads(threads)
    alone, crowd = alone_and_in_a_crowd(llama, make_engine, invariant_rows=rows)
    assert alone[0] == crowd[0]
    assert len(alone[1]) == len(crowd[1]) == 16
    assert all(torch.equal(x, y) for x, y in zip(alone[1], crowd[1], strict=True))
    assert alone[2] == crowd[2]


def test_without_the_tiles_the_logits_move_with_the_batch(llama, make_engine, monkeypatch) -> None:
    """The check above can fail: with the tiling mode off and no row padding, it does."""
    import kiln.serve.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "TiledMatmuls", lambda rows: contextlib.nullcontext())
    monkeypatch.setattr(engine_module, "pad_rows", lambda n, rows: max(n, 1))
    alone, crowd = alone_and_in_a_crowd(llama, make_engine)
    assert not all(torch.equal(x, y) for x, y in zip(alone[1], crowd[1], strict=False))


def record(rows: list[torch.Tensor]):
    """A logits processor that keeps a copy of every row it sees."""

    def processor(ids, logits):
        rows.append(logits.clone())
        return logits

    return processor


def test_n_samples_share_the_prompt_and_sample_zero_is_the_seeded_single(
    llama, make_engine
) -> None:
    prompt = random_prompts(1, 10, 10, 300, seed=9)[0]  # two full blocks of 4 and a partial one
    engine = make_engine(llama, block_size=4, prefill_chunk=16, prefix_caching=False)
    handle = engine.submit(prompt, SamplingParams(max_tokens=8, n=3, seed=5))
    engine.step()  # the prompt: sample 0 prefills, the others fork from its blocks
    seqs = [s.seq for s in engine._requests[handle].samples]
    assert seqs[0].blocks[:2] == seqs[1].blocks[:2] == seqs[2].blocks[:2]
    assert len({s.blocks[2] for s in seqs}) == 3  # the partial block is copied per sample
    assert [engine.pool.refs[b] for b in seqs[0].blocks[:2]] == [3, 3]
    many = handle.result()
    (single,) = engine.generate([prompt], SamplingParams(max_tokens=8, seed=5))[0:1][0]
    assert many[0].token_ids == single.token_ids
    assert len({tuple(c.token_ids) for c in many}) > 1  # the samples draw their own streams
    again = engine.generate([prompt], SamplingParams(max_tokens=8, n=3, seed=5))[0]
    assert [c.token_ids for c in again] == [c.token_ids for c in many]


def test_n_samples_without_room_wait_and_match_the_forked_ones(llama, make_engine) -> None:
    prompt = random_prompts(1, 10, 10, 300, seed=12)[0]
    params = SamplingParams(max_tokens=6, n=3, seed=9)
    roomy = make_engine(llama, block_size=4, prefix_caching=False)
    tight = make_engine(llama, block_size=4, prefix_caching=False, max_num_seqs=1)
    forked = roomy.generate([prompt], params)[0]
    waited = tight.generate([prompt], params)[0]
    assert [c.token_ids for c in waited] == [c.token_ids for c in forked]


def test_long_prefill_is_chunked_while_others_decode(llama, make_engine) -> None:
    engine = make_engine(llama, block_size=4, prefill_chunk=8, max_tokens_per_step=10)
    short = engine.submit([1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
    engine.step()
    long = engine.submit(random_prompts(1, 60, 60, 300, seed=10)[0], GREEDY)
    tokens_of_short = []
    for _ in range(7):  # 60 prompt tokens in chunks of 8: at least 7 steps of prefill
        engine.step()
        tokens_of_short.append(len(list(short._events)))
    assert long.first_token_time is None
    assert tokens_of_short == list(range(2, 9))  # one decode token every step meanwhile
    drain(engine, [short, long])


def test_cancel_frees_blocks_at_the_next_step(llama, make_engine) -> None:
    engine = make_engine(llama, block_size=4, prefix_caching=False)
    handle = engine.submit(random_prompts(1, 20, 20, 300)[0], SamplingParams(max_tokens=40))
    for _ in range(3):
        engine.step()
    assert engine.stats().blocks_used > 0
    handle.cancel()
    engine.step()
    assert engine.stats().blocks_used == 0
    (c,) = handle.result()
    assert c.finish_reason == "cancelled" and len(c.token_ids) == 3


def test_stop_token_ends_the_sample_and_is_not_returned(llama, make_engine) -> None:
    prompt = [5, 6, 7]
    (ref,) = reference(llama, [prompt], 12)
    k = next(i for i in range(2, 12) if ref[i] not in ref[:i])  # the first time a token appears
    engine = make_engine(llama, eot_id=ref[k])
    (c,) = engine.generate([prompt], GREEDY)[0]
    assert c.token_ids == ref[:k] and c.finish_reason == "stop"
    (c,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                    ignore_eos=True))[0]  # fmt: skip
    assert c.token_ids == ref
    (c,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                    stop_token_ids=(ref[0],)))[0]  # fmt: skip
    assert c.token_ids == [] and c.finish_reason == "stop"


def forced(text: bytes):
    """A logits processor that makes the model spell `text`, then end-of-text."""

    def processor(ids, logits):
        want = text[len(ids)] if len(ids) < len(text) else 256
        out = torch.full_like(logits, float("-inf"))
        out[want] = 0.0
        return out

    return processor


def test_stop_string_across_tokens_is_never_sent(byte_tokenizer, make_engine) -> None:
    from tests.model.helpers import build, llama_small

    model = build(llama_small(vocab_size=257, block_size=64))
    engine = make_engine(model, byte_tokenizer, eot_id=256)
    params = SamplingParams(max_tokens=30, temperature=0, stop=("lo w", "zzz"),
                            logits_processors=(forced(b"hello world"),))  # fmt: skip
    handle = engine.submit([104], params)
    texts = [e.text for e in handle]
    (c,) = handle.result()
    assert c.text == "".join(texts) == "hel"
    assert c.finish_reason == "stop"
    assert bytes(c.token_ids) == b"hello w"  # the tokens up to the one completing the stop
    plain = SamplingParams(
        max_tokens=30, temperature=0, logits_processors=(forced("é ok".encode()),)
    )
    handle = engine.submit([104], plain)
    texts = [e.text for e in handle]
    assert texts[:2] == ["", "é"]  # a split UTF-8 character is released whole
    assert handle.result()[0].text == "é ok"


def test_logprobs_are_the_models_and_top_n_best_first(llama, make_engine) -> None:
    prompt = [3, 1, 4, 1, 5]
    engine = make_engine(llama)
    (c,) = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logp = llama(ids)[0].log_softmax(-1)  # (T, V)
    for i, event in enumerate(c.logprobs):
        row = logp[len(prompt) - 1 + i]
        assert event.logprob == pytest.approx(float(row[event.token_id]), abs=1e-4)
        assert [t for t, _ in event.top_logprobs] == row.topk(3).indices.tolist()
        assert event.top_logprobs[0][0] == event.token_id  # greedy: the best one


def test_a_failing_request_fails_alone(llama, make_engine) -> None:
    prompts = random_prompts(4, 3, 12, 300, seed=11)

    def explode(ids, logits):
        if len(ids) == 3:
            raise RuntimeError("injected failure")
        return logits

    engine = make_engine(llama, block_size=4)
    bad = SamplingParams(max_tokens=12, temperature=0, logits_processors=(explode,))
    params = [GREEDY, bad, GREEDY, GREEDY]
    out = engine.generate(prompts, params)
    assert out[1][0].finish_reason == "error"
    assert "injected failure" in out[1][0].error
    assert len(out[1][0].token_ids) == 3
    ok = [out[i][0].token_ids for i in (0, 2, 3)]
    assert ok == reference(llama, [prompts[i] for i in (0, 2, 3)], 12)
    # and the engine keeps serving
    assert engine.generate(prompts[:1], GREEDY)[0][0].token_ids == ok[0]


def test_memory_bound_by_bytes_and_gqa_stores_kv_heads(llama, make_engine) -> None:
    from kiln.serve.engine.block_pool import block_bytes

    per_block = block_bytes(llama.cfg, 16, torch.float32)
    engine = make_engine(llama, kv_cache_bytes=12 * per_block + 1)
    assert engine.pool.num_blocks == 10  # and a zero and a scratch block for padding
    assert engine.pool.k.numel() * 4 * 2 <= 12 * per_block + 1
    assert engine.pool.k.shape == (llama.cfg.n_layer, 2, 12, 16, llama.cfg.head_size)


def test_a_failed_forward_fails_its_step_and_the_engine_goes_on(
    llama, make_engine, monkeypatch
) -> None:
    engine = make_engine(llama, block_size=4)
    first = engine.submit([1, 2, 3], GREEDY)
    real = engine._forward
    calls = iter([RuntimeError("device lost"), None])

    def flaky(work):
        exc = next(calls, None)
        if exc is not None:
            raise exc
        return real(work)

    monkeypatch.setattr(engine, "_forward", flaky)
    engine.step()
    (c,) = first.result()
    assert c.finish_reason == "error" and "device lost" in c.error
    assert engine.stats().blocks_used == 0
    (ok,) = engine.generate([[1, 2, 3]], GREEDY)[0]
    assert ok.token_ids == reference(llama, [[1, 2, 3]], 12)[0]


def test_text_held_for_a_stop_string_is_kept_when_end_of_text_ends_the_sample(
    byte_tokenizer, make_engine
) -> None:
    from tests.model.helpers import build, llama_small

    model = build(llama_small(vocab_size=257, block_size=64))
    engine = make_engine(model, byte_tokenizer, eot_id=256)
    # "ab" then end-of-text: "b" could start the stop string "bc", so it is held back...
    params = SamplingParams(max_tokens=10, temperature=0, stop=("bc",),
                            logits_processors=(forced(b"ab"),))  # fmt: skip
    handle = engine.submit([104], params)
    streamed = "".join(e.text for e in handle)
    (c,) = handle.result()
    assert streamed == "a" and c.finish_reason == "stop"
    assert c.text == "ab"  # ...and is the sample's own text once end-of-text ends it
    # An unfinished UTF-8 character at the end becomes U+FFFD, not nothing.
    handle = engine.submit([104], SamplingParams(max_tokens=10, temperature=0,
                                                 logits_processors=(forced(b"\xc3"),)))  # fmt: skip
    list(handle)
    assert handle.result()[0].text == "\ufffd"


def test_a_dying_loop_fails_every_request_and_refuses_new_ones(llama, make_engine) -> None:
    engine = make_engine(llama)
    handle = engine.submit([1, 2, 3], SamplingParams(max_tokens=50, temperature=0))

    def broken_schedule(*args: object, **kwargs: object) -> None:
        raise RuntimeError("scheduler bug")

    engine.scheduler.schedule = broken_schedule  # type: ignore[method-assign]
    engine.start()
    (c,) = handle.result(timeout=30)
    assert c.finish_reason == "error" and "scheduler bug" in (c.error or "")
    assert engine.broken is not None
    with pytest.raises(KilnError, match="loop has stopped"):
        engine.submit([1, 2], SamplingParams(max_tokens=2))
    del engine.scheduler.schedule  # the real one again, for the block audit
