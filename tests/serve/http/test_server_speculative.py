"""`kiln serve` over a speculative engine: same greedy text, acceptance in usage and /metrics."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import openai

from kiln.loading import load_model
from kiln.serve.engine.drafters import ModelDrafter
from tests.serve.http.conftest import serve_model

PROMPT = "the cat sat. the cat sat. the cat sat. the cat"
TIMEOUT = 30.0


def metric(text: str, name: str) -> float:
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[-1])


def test_usage_and_metrics_report_draft_acceptance(base_model: Path) -> None:
    with serve_model(base_model, engine_options={"batch_invariant": False}) as plain:
        client = openai.OpenAI(base_url=plain.api, api_key="none", max_retries=0, timeout=TIMEOUT)
        want = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                         temperature=0, n=1)  # fmt: skip
        assert "speculative" not in want.usage.model_dump()  # no drafter: no extension field
        assert "speculative" not in httpx.get(plain.url + "/metrics", timeout=TIMEOUT).text
    # The model drafting for itself: every draft is kept.
    drafter = ModelDrafter(load_model(base_model, device="cpu", dtype="fp32").model)
    with serve_model(
        base_model, engine_options={"batch_invariant": False, "drafter": drafter}
    ) as spec:
        client = openai.OpenAI(base_url=spec.api, api_key="none", max_retries=0, timeout=TIMEOUT)
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        used = got.usage.model_dump()["speculative"]
        assert used["draft_tokens"] > 0 and used["accepted_tokens"] == used["draft_tokens"]
        assert used["acceptance_rate"] == 1.0
        chunks = list(client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        ))  # fmt: skip
        assert chunks[-1].usage.model_dump()["speculative"] == used
        text = httpx.get(spec.url + "/metrics", timeout=TIMEOUT).text
        assert metric(text, "kiln_speculative_draft_tokens_total") == 2 * used["draft_tokens"]
        assert metric(text, "kiln_speculative_accepted_tokens_total") == 2 * used["draft_tokens"]
        assert metric(text, "kiln_speculative_acceptance_rate_count") == 2
        assert 'kiln_speculative_acceptance_rate_bucket{le="0.9"} 0' in text  # both at 1.0


def test_kiln_serve_draft_flags(base_model: Path, capsys) -> None:
    from kiln.cli import main
    from tests.serve.http.test_server_cli import _start

    assert main(["serve", str(base_model), "--draft", "ngram", "--draft-k", "0"]) == 2
    assert "--draft-k must be >= 1, got 0" in capsys.readouterr().err
    assert main(["serve", str(base_model), "--draft", "ngram", "--draft-max-batch", "0"]) == 2
    assert "--draft-max-batch must be >= 1, got 0" in capsys.readouterr().err
    proc, url = _start(base_model, "--draft", "ngram", "--draft-k", "3")
    try:
        body = {"model": "model", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        out = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT).json()
        assert out["usage"]["speculative"]["draft_tokens"] > 0
    finally:
        proc.kill()
        proc.wait()
