"""Requests from the caller's side: refused bad input, threads, asyncio, a full queue."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kiln.errors import KilnError
from kiln.serve.engine import EngineConfig, EngineConfigError, EngineFull
from kiln.serve.engine.sampling import SamplingParams, SamplingParamsError
from tests.serve.conftest import random_prompts
from tests.serve.engine.test_engine import reference


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(), "prompt_ids"),
        ([1, 300], SamplingParams(), "prompt_ids[1]"),
        ([1, -1], SamplingParams(), "prompt_ids[1]"),
        ("hello", SamplingParams(), "prompt_ids"),
        ([1] * 96, SamplingParams(max_tokens=1), "prompt_ids"),
        ([1] * 90, SamplingParams(max_tokens=7), "max_tokens"),
        ([1], SamplingParams(stop_token_ids=(300,)), "stop_token_ids"),
        ([1], {"max_tokens": 3}, "SamplingParams"),
    ],
)
def test_bad_requests_are_refused_at_submit(llama, make_engine, prompt, params, field) -> None:
    engine = make_engine(llama)
    with pytest.raises(KilnError, match=field.replace("[", r"\[").replace("]", r"\]")):
        engine.submit(prompt, params)
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=2))[0][0].finish_reason == "length"


def test_a_request_larger_than_the_pool_is_refused(llama, make_engine) -> None:
    engine = make_engine(llama, block_size=4, num_blocks=5)
    with pytest.raises(KilnError, match=r"max_tokens = 20: .* needs 6 KV blocks, the pool has 5"):
        engine.submit([1, 2, 3, 4], SamplingParams(max_tokens=20))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"stop": ("",)}, "stop"),
        ({"n": 0}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs, field) -> None:
    with pytest.raises(SamplingParamsError, match=f"sampling parameter {field} ="):
        SamplingParams(**kwargs)


def test_engine_config_errors_name_the_field() -> None:
    with pytest.raises(EngineConfigError, match=r"engine\.block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(EngineConfigError, match="exclusive"):
        EngineConfig(num_blocks=4, kv_cache_bytes=1 << 20)


def test_a_full_queue_refuses_with_engine_full(llama, make_engine) -> None:
    engine = make_engine(llama, max_waiting=2)
    handles = [engine.submit([1], SamplingParams(max_tokens=2)) for _ in range(2)]
    with pytest.raises(EngineFull, match="max_waiting"):
        engine.submit([1], SamplingParams(max_tokens=2))
    for h in handles:
        h.result()


def test_threads_submit_and_cancel_while_the_loop_runs(llama, make_engine) -> None:
    prompts = random_prompts(8, 2, 20, 300, seed=20)
    expected = reference(llama, prompts, 10)
    engine = make_engine(llama, block_size=4, max_num_seqs=4)
    engine.start()
    got: dict[int, list[int]] = {}
    cancelled: list[str] = []

    def client(i: int) -> None:
        handle = engine.submit(prompts[i], SamplingParams(max_tokens=10, temperature=0))
        got[i] = [event.token_id for event in handle]
        victim = engine.submit(prompts[i], SamplingParams(max_tokens=60))
        victim.cancel()
        cancelled.append(victim.result(timeout=30)[0].finish_reason)
        engine.stats()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    engine.stop()
    assert [got[i] for i in range(8)] == expected
    assert set(cancelled) <= {"cancelled", "length"} and len(cancelled) == 8


def test_async_events_stream_with_and_without_the_loop(llama, make_engine) -> None:
    prompt = [4, 5, 6]
    (expected,) = reference(llama, [prompt], 6)
    engine = make_engine(llama)

    async def collect() -> list[int]:
        handle = engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0))
        return [event.token_id async for event in handle.events()]

    assert asyncio.run(collect()) == expected  # steps driven from the coroutine
    engine.start()
    assert asyncio.run(collect()) == expected  # the background loop steps
    engine.stop()


def test_stop_can_cancel_what_is_running(llama, make_engine) -> None:
    engine = make_engine(llama)
    handle = engine.submit([1, 2], SamplingParams(max_tokens=50))
    engine.step()
    engine.stop(cancel_running=True)
    assert handle.result()[0].finish_reason == "cancelled"
