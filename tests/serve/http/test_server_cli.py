"""`kiln serve` as a command: the exposure rule, the key check, and a graceful SIGTERM (a real
subprocess: running requests finish, the process exits 0)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import pytest

from kiln.cli import main
from kiln.serve.http.limits import check_exposure, is_loopback, key_matches
from tests.serve.http.conftest import RunningServer, serve_model

ROOT = Path(__file__).resolve().parents[3]
START_S = 60.0


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.9", "::1", "localhost", "[::1]"])
def test_loopback_hosts_need_no_key(host: str) -> None:
    assert is_loopback(host)
    check_exposure(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.com"])
def test_any_other_host_refuses_to_start_without_a_key(
    host: str, base_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KILN_API_KEY", raising=False)
    assert not is_loopback(host)
    assert main(["serve", str(base_model), "--host", host]) == 2
    err = capsys.readouterr().err
    assert f"--host {host}: serving beyond this machine needs an API key" in err
    assert "KILN_API_KEY" in err and err.count("\n") == 1
    check_exposure(host, "a-key")  # with a key it may


def test_cors_is_off_unless_an_origin_is_given(
    base_model: Path, base_server: RunningServer
) -> None:
    preflight = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST"}
    closed = httpx.options(base_server.api + "/completions", headers=preflight, timeout=10)
    assert "access-control-allow-origin" not in closed.headers
    with serve_model(base_model, cors_origins=("http://page.example",)) as server:
        opened = httpx.options(server.api + "/completions", headers=preflight, timeout=10)
        assert opened.headers["access-control-allow-origin"] == "http://page.example"
        other = {**preflight, "Origin": "http://elsewhere.example"}
        refused = httpx.options(server.api + "/completions", headers=other, timeout=10)
        assert "access-control-allow-origin" not in refused.headers


def test_a_bad_limit_is_one_line_naming_its_flag(
    base_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(base_model), "--max-n", "0"]) == 2
    assert "serve limit max_n (--max-n): must be at least 1, got 0" in capsys.readouterr().err


def test_keys_are_compared_whole_and_only_as_bearer_tokens() -> None:
    assert key_matches("Bearer s3cret", "s3cret") and key_matches("bearer  s3cret ", "s3cret")
    for header in (None, "", "s3cret", "Basic s3cret", "Bearer s3cre", "Bearer s3cret2", "Bearer "):
        assert not key_matches(header, "s3cret"), header


def test_the_server_reads_no_path_a_client_names(base_server: RunningServer) -> None:
    for path in (
        "/../pyproject.toml",
        "/web/index.html",
        "/static/../../etc/passwd",
        "/tokenizer.json",
    ):
        response = httpx.get(base_server.url + path, timeout=10)
        assert response.status_code == 404, path
        assert "error" in response.json()


def _start(
    model: Path, *args: str, seen: list[str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """`kiln serve MODEL --port 0 ARGS` as a subprocess; returns it and its base URL (the
    start-up lines it printed go to `seen`)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("KILN_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "serve", str(model), "--port", "0", "--device", "cpu",
         "--dtype", "fp32", *args],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    deadline = time.monotonic() + START_S
    assert proc.stderr is not None
    for line in proc.stderr:
        if seen is not None:
            seen.append(line)
        found = re.search(r"at (http://127\.0\.0\.1:\d+)/", line)
        if found:
            return proc, found.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    pytest.fail(f"kiln serve did not start: {proc.stderr.read()}")


@pytest.mark.parametrize(("grace", "reason"), [("20", "length"), ("0", "cancelled")])
def test_sigterm_lets_running_streams_finish_within_the_grace_then_cancels_and_exits_0(
    base_model: Path, grace: str, reason: str
) -> None:
    proc, url = _start(base_model, "--grace", grace)
    try:
        body = {"model": "model", "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                "ignore_eos": True}  # fmt: skip
        lines: list[str] = []
        first = threading.Event()

        def read() -> None:
            with (
                httpx.Client(timeout=60) as http,
                http.stream("POST", url + "/v1/completions", json=body) as response,
            ):
                for line in response.iter_lines():
                    lines.append(line)
                    first.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert first.wait(30), "no first chunk"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        reader.join(10)
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert [x for x in lines if x][-1] == "data: [DONE]"
        # Within the grace it runs to its end; after it, it is cancelled, and says so.
        assert events[-1]["choices"][0]["finish_reason"] == reason
        assert "kiln serve: stopped" in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_during_the_grace_health_says_stopping_and_new_work_gets_a_503(base_model: Path) -> None:
    proc, url = _start(base_model, "--grace", "60")
    try:
        # Eight long samples keep the server in its grace period for the checks below.
        body = {"model": "model", "prompt": "Once upon a time", "max_tokens": 480, "n": 8,
                "stream": True, "ignore_eos": True}  # fmt: skip
        lines: list[str] = []
        first = threading.Event()

        def read() -> None:
            with (
                httpx.Client(timeout=120) as http,
                http.stream("POST", url + "/v1/completions", json=body) as response,
            ):
                for line in response.iter_lines():
                    lines.append(line)
                    first.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert first.wait(30), "no first chunk"
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        health = httpx.get(url + "/health", timeout=10)
        while health.json()["status"] != "stopping" and time.monotonic() < deadline:
            time.sleep(0.02)
            health = httpx.get(url + "/health", timeout=10)
        assert (health.status_code, health.json()["status"]) == (503, "stopping")
        refused = httpx.post(url + "/v1/completions", json={"model": "model", "prompt": "hi"},
                             timeout=10)  # fmt: skip
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
        assert proc.wait(timeout=120) == 0  # the running request ends, then the server does
        reader.join(10)
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert reasons == ["length"] * 8
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_on_an_idle_server_exits_0_at_once(base_model: Path) -> None:
    proc, url = _start(base_model)
    try:
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
        models = httpx.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["model"]  # the folder's name
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_quantize_int8_serves_the_quantized_model_and_says_which_kernel_ran(
    base_model: Path,
) -> None:
    seen: list[str] = []
    proc, url = _start(base_model, "--quantize", "int8", seen=seen)
    try:
        report = next(x for x in seen if x.startswith("kiln serve: quantize int8"))
        assert re.search(r"linear layers \(\d+ by (torch\._weight_int8pack_mm|dequantize)", report)
        # Wherever torch's int8 kernel runs at all, a timed probe chose between it and the
        # fallback, and the line gives its timings (else it says why the kernel cannot run).
        assert "timed probe (" in report or "fallback because" in report, report
        body = {"model": "model", "prompt": "Once upon a time", "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
