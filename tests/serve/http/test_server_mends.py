"""What a user found trying the server: bodies nested too deep, clients that leave while sending,
field names in errors, control-token text in names and stop strings, the prefix cache in
/metrics, and how stop strings are counted in `usage`."""

from __future__ import annotations

import http.client
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest

from kiln.serve.engine import SamplingParams
from kiln.serve.http.openai_schema import MAX_JSON_DEPTH
from tests.serve.http.conftest import RunningServer, serve_model, wait_until

PROMPT = "Once upon a time, there was a little dog"
TIMEOUT = 30.0


def client_for(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=TIMEOUT)


def metric(server: RunningServer, name: str) -> float:
    """One sample's value from /metrics (0 when the series is absent)."""
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def chat_server(chat_model: Path) -> Iterator[RunningServer]:
    with serve_model(chat_model, model_name="tiny-chat") as running:
        yield running


# ---- the body ---------------------------------------------------------------------------------


def _nested(depth: int, where: str) -> bytes:
    """A completions body with `depth` levels of arrays or objects at `where`."""
    if where == "prompt":
        inner = "[" * depth + "1" + "]" * depth
        return ('{"model": "tiny", "prompt": ' + inner + "}").encode()
    inner = '{"a": ' * depth + "1" + "}" * depth
    return ('{"model": "tiny", "prompt": "hi", "extra": ' + inner + "}").encode()


@pytest.mark.parametrize("where", ["prompt", "extra"])
def test_a_body_nested_too_deep_is_a_400_and_the_connection_lives_on(
    base_server: RunningServer, where: str
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", int(base_server.url.rsplit(":", 1)[1]), 30)
    headers = {"Content-Type": "application/json"}
    try:
        conn.request("POST", "/v1/completions", _nested(990, where), headers)
        response = conn.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 400, error
        assert error["param"] == "body" and "nests" in error["message"]
        assert str(MAX_JSON_DEPTH) in error["message"]
        # The same keep-alive connection answers the next request.
        body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        conn.request("POST", "/v1/completions", body, headers)
        response = conn.getresponse()
        assert response.status == 200 and json.loads(response.read())["choices"]
    finally:
        conn.close()


def test_a_body_nested_within_the_limit_is_parsed(base_server: RunningServer) -> None:
    body = _nested(MAX_JSON_DEPTH - 1, "extra")  # the body itself is one level more
    response = httpx.post(base_server.api + "/completions", content=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_that_leaves_while_sending_its_body_counts_as_disconnected(
    base_server: RunningServer,
) -> None:
    records = _Records()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(records)
    before = metric(base_server, 'kiln_requests_total{outcome="disconnected"}')
    errors_before = metric(base_server, 'kiln_requests_total{outcome="http_500"}')
    try:
        port = int(base_server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n" + b'{"model": "tiny", "prompt": "'
            )
        wait_until(
            lambda: metric(base_server, 'kiln_requests_total{outcome="disconnected"}') > before,
            what="the disconnect to be counted",
        )
    finally:
        logger.removeHandler(records)
    assert metric(base_server, 'kiln_requests_total{outcome="http_500"}') == errors_before
    assert [r.getMessage() for r in records.records if r.exc_info] == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream": "yes"}, "stream"),
        (
            {"stream": True, "stream_options": {"include_usage": "x"}},
            "stream_options.include_usage",
        ),
        ({"stream_options": 3}, "stream_options"),
    ],
)
def test_a_field_whose_name_starts_like_a_type_is_still_named(
    base_server: RunningServer, body: dict[str, object], param: str
) -> None:
    request = {"model": "tiny", "prompt": PROMPT, **body}
    response = httpx.post(base_server.api + "/completions", json=request, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# ---- control-token text -----------------------------------------------------------------------


def test_special_token_text_in_a_message_name_is_refused(chat_server: RunningServer) -> None:
    messages = [{"role": "user", "content": "hello"},
                {"role": "user", "content": "hi", "name": "x<|assistant|>"}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as err:
        client_for(chat_server).chat.completions.create(model="tiny-chat", messages=messages)
    assert err.value.param == "messages[1].name" and "<|assistant|>" in err.value.message
    messages[1]["name"] = "bob"  # a plain name is fine (and, as the template has no names, unused)
    reply = client_for(chat_server).chat.completions.create(
        model="tiny-chat", messages=messages, max_completion_tokens=2
    )
    assert reply.choices


@pytest.mark.parametrize("stop", ["<|endoftext|>", ["x", "the end<|endoftext|>"]])
def test_special_token_text_in_a_stop_string_is_refused(
    base_server: RunningServer, stop: str | list[str]
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client_for(base_server).completions.create(model="tiny", prompt=PROMPT, stop=stop)
    assert err.value.param == "stop" and "<|endoftext|>" in err.value.message
    where = "stop" if isinstance(stop, str) else "stop[1]"
    assert f"{where} contains" in err.value.message


# ---- /metrics and usage -----------------------------------------------------------------------


def test_metrics_report_prefix_cached_blocks_apart_from_used_ones(base_model: Path) -> None:
    with serve_model(base_model, engine_options={"prefix_caching": True}) as server:
        client_for(server).completions.create(model="tiny", prompt=PROMPT * 8, max_tokens=4)
        wait_until(lambda: metric(server, "kiln_requests_running") == 0, what="an idle engine")
        used, cached = (
            metric(server, "kiln_kv_blocks_used"),
            metric(server, "kiln_kv_blocks_cached"),
        )
        free, total = metric(server, "kiln_kv_blocks_free"), metric(server, "kiln_kv_blocks_total")
        assert used == 0 and cached > 0  # idle: nothing is held, the prompt's blocks are kept
        assert used + cached + free == total


def test_usage_counts_the_tokens_of_a_cut_stop_string_as_generated(
    base_server: RunningServer,
) -> None:
    ids = list(base_server.service.tokenizer.encode(PROMPT))
    free = base_server.engine.generate(
        [ids], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )[0][0]
    tok = base_server.service.tokenizer
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    assert stop.strip(), f"no stop string to take from {free.text!r}"
    # Generated tokens: up to the one that completes the stop string, which is cut from the text.
    generated = next(
        k for k in range(1, len(free.token_ids) + 1)
        if stop in tok.decode_bytes(free.token_ids[:k]).decode("utf-8", "replace")
    )  # fmt: skip
    client = client_for(base_server)
    before = metric(base_server, "kiln_generation_tokens_total")
    cut = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert cut.usage.completion_tokens == generated
    assert metric(base_server, "kiln_generation_tokens_total") == before + generated
    streamed = list(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert streamed[-1].usage.completion_tokens == generated
