"""A server's memory does not grow with the number of requests it has answered (issue #32's leak
hunt): after a burst of requests of every kind (streamed, whole, n > 1, refused, left mid-stream)
no per-request object outlives its request, and every book the server keeps is back to idle; and
the server's /debug/memory, which finds what grew when something does."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import pytest

from kiln.errors import KilnError
from kiln.serve.engine.engine import _Request, _Sample
from kiln.serve.engine.requests import RequestHandle
from kiln.serve.engine.scheduler import Sequence
from kiln.serve.http.generation import Generation
from kiln.serve.http.memory_probe import ENV, frames_from_env
from tests.serve.http.conftest import RunningServer, serve_model, wait_until

PROMPTS = ["Once upon a time, there was a little dog", "Lily and Tom went to the park."]
TIMEOUT = 30.0
PER_REQUEST = (RequestHandle, _Request, _Sample, Sequence, Generation)


@pytest.fixture(scope="module")
def server(base_model: Path) -> Iterator[RunningServer]:
    with serve_model(base_model, engine_options={"max_waiting": 64}) as running:
        yield running


def burst(server: RunningServer, rounds: int) -> None:
    """`rounds` times: a streamed, a whole, an n = 2, a refused and an abandoned request."""
    url = server.api + "/completions"
    with httpx.Client(timeout=TIMEOUT) as http:
        for i in range(rounds):
            body = {"model": "tiny", "prompt": PROMPTS[i % 2], "max_tokens": 6, "seed": i}
            assert http.post(url, json=body).status_code == 200
            assert http.post(url, json={**body, "n": 2, "temperature": 1.0}).status_code == 200
            assert http.post(url, json={**body, "max_tokens": -1}).status_code == 400
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", url, json=stream) as response:
                assert "data: [DONE]" in list(response.iter_lines())
            long = {**stream, "max_tokens": 200, "ignore_eos": True}
            with http.stream("POST", url, json=long) as response:  # leaves after one chunk
                next(response.iter_lines())
    engine = server.engine
    wait_until(lambda: engine.stats().running == 0 and engine.stats().waiting == 0,
               what="an idle engine")  # fmt: skip
    wait_until(lambda: server.service.state.inflight == 0, what="every request finished")


def books(server: RunningServer) -> dict[str, int]:
    """The size of everything the server keeps between requests, and live per-request objects."""
    gc.collect()
    engine, service = server.engine, server.service
    # type() rather than isinstance: no __class__ lookups on lazy module objects.
    kinds = set(PER_REQUEST)
    alive = Counter(type(o).__name__ for o in gc.get_objects() if type(o) in kinds)
    tasks = sum(1 for o in gc.get_objects() if type(o) is asyncio.Task and not o.done())
    pool = engine.pool
    return {
        **{f"alive {cls.__name__}": alive[cls.__name__] for cls in PER_REQUEST},
        "pending asyncio tasks": tasks,
        "engine requests": len(engine._requests), "engine cancels": len(engine._cancels),
        "engine inbox": len(engine._inbox),
        "scheduler queues": len(engine.scheduler.running) + len(engine.scheduler.waiting),
        "blocks held": sum(1 for r in pool.refs if r),
        "prefix cache keys": max(0, len(pool.by_key) - pool.num_blocks),  # beyond the pool
        "server active": len(service.state.active), "server inflight": service.state.inflight,
        "outcome labels": len(service.metrics.requests),
        "token pieces": max(0, len(service._pieces) - service.vocab_size),  # beyond the vocab
    }  # fmt: skip


def test_nothing_the_server_keeps_grows_with_the_requests_it_answered(
    server: RunningServer,
) -> None:
    burst(server, 2)
    after_few = books(server)
    burst(server, 10)
    after_many = books(server)
    grown = {k: (after_few[k], v) for k, v in after_many.items() if v > after_few[k]}
    assert not grown, f"grew with the requests answered (after 10, after 60): {grown}"
    # Idle books are empty, not merely not growing: a leak of one object per request shows here
    # (uvicorn's own tasks and the outcome labels are there from the first requests on).
    constant = {"pending asyncio tasks", "outcome labels"}
    assert {k: v for k, v in after_many.items() if k not in constant and v} == {}
    # Outcome labels are a fixed set (a status code at most), never a per-request value.
    assert set(server.service.metrics.requests) == {"ok", "disconnected", "http_400"}


# ---- /debug/memory (KILN_SERVE_TRACEMALLOC) ------------------------------------------------------


class Planted:
    """Objects a test keeps alive between two reports, as a leak would."""


def test_debug_memory_is_absent_unless_asked_for(server: RunningServer) -> None:
    assert httpx.get(server.url + "/debug/memory", timeout=TIMEOUT).status_code == 404


def test_debug_memory_names_the_type_and_site_that_grew_between_two_calls(
    base_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "4")
    kept: list[Planted] = []
    try:
        with serve_model(base_model) as running:
            first = httpx.get(running.url + "/debug/memory", timeout=TIMEOUT).json()
            kept += [Planted() for _ in range(5000)]
            second = httpx.get(running.url + "/debug/memory", timeout=TIMEOUT).json()
    finally:
        tracemalloc.stop()
    assert first["traced_mib"] > 0 and second["rss_mib"] > 0
    grown = {t["type"]: t["count"] for t in second["types"]}
    assert grown.get("Planted", 0) >= 5000
    assert any(__file__ + ":" in "".join(s["traceback"]) for s in second["sites"])


@pytest.mark.parametrize("value", ["0", "x", "65"])
def test_a_bad_tracemalloc_setting_names_the_variable(value: str) -> None:
    with pytest.raises(KilnError, match=f"{ENV}='{value}': expected a number of stack frames"):
        frames_from_env({ENV: value})
    assert frames_from_env({}) is None and frames_from_env({ENV: "8"}) == 8
