"""`kiln serve` runs recurrent models: a Mamba-2 and a hybrid, through the official openai client.

The served greedy text equals kiln.model.generate's for the prompt alone, with several requests
in flight at once (continuous batching over per-sequence states), streamed and not.
"""

from __future__ import annotations

import gzip
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from kiln.io import sha256_file
from kiln.model.generate import generate
from kiln.tokenizer.special import EOT
from tests.serve.http.conftest import STORIES, serve_model

TIMEOUT = 60.0
SSM = {"state_size": 8, "head_dim": 16, "n_groups": 2, "chunk_size": 16}
MODELS = {
    "mamba2": {"layer_pattern": "M", "mlp": "none", "pos_emb": "none"},
    "hybrid": {"n_layer": 4, "layer_pattern": "MDMA"},
}
PROMPTS = ["Once upon a time", "The little dog", "She said hello to the", "Tom and Sue went"]


def build_checkpoint(root: Path, overrides: dict) -> Path:
    """A kiln checkpoint of a random recurrent model, its 300-token BPE beside the run."""
    from kiln.model import ModelConfig, Transformer
    from kiln.tokenizer import train_bpe
    from kiln.train.checkpoint import TrainState, save_checkpoint

    with gzip.open(STORIES, "rt", encoding="utf-8") as handle:
        (root / "stories.txt").write_text(handle.read(60_000), encoding="utf-8")
    tok = train_bpe(root / "stories.txt", 300, special_tokens=[EOT], workers=1)
    run = root / "run"
    run.mkdir()
    tok.save(run / "tokenizer.json")
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=tok.n_vocab, block_size=256, ssm=SSM, **overrides)
    model = Transformer(cfg).eval()
    state = TrainState(step=1, tokens=0, cursor={}, config={"model": cfg.to_dict()},
                       dataset={"tokenizer_sha256": sha256_file(run / "tokenizer.json")})  # fmt: skip
    save_checkpoint(run / "checkpoints", model, {}, state, scheduler={}, keep_last=1)
    return run / "checkpoints" / "step_1"


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp(request.param), MODELS[request.param])


def expected_texts(checkpoint: Path, max_tokens: int) -> list[str]:
    """generate's greedy continuation of each prompt alone, decoded up to end-of-text."""
    from kiln.loading import load_model

    loaded = load_model(checkpoint, device="cpu", dtype="fp32")
    tok = loaded.tokenizer
    out = []
    for prompt in PROMPTS:
        ids = generate(loaded.model, [tok.encode(prompt)], max_tokens, temperature=0.0)[0]
        if loaded.eot_id in ids:
            ids = ids[: ids.index(loaded.eot_id)]
        out.append(tok.decode(ids))
    return out


def test_served_greedy_text_equals_generate_with_requests_in_flight(checkpoint: Path) -> None:
    want = expected_texts(checkpoint, 16)
    with serve_model(checkpoint, engine_options={"max_waiting": 64}) as server:
        client = openai.OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=TIMEOUT)

        def complete(prompt: str) -> str:
            got = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                            temperature=0)  # fmt: skip
            return got.choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all in flight together
            texts = list(pool.map(complete, PROMPTS))
        assert texts == want
        chunks = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                           temperature=0, stream=True)  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want[0]
        server.engine.audit()  # blocks and state slots balanced after the traffic
        assert server.engine.states is not None and not server.engine.states.held


def test_kiln_serve_command_serves_a_hybrid(tmp_path: Path) -> None:
    from tests.serve.http.test_server_cli import _start

    ckpt = build_checkpoint(tmp_path, MODELS["hybrid"])
    want = expected_texts(ckpt, 8)[1]
    proc, url = _start(ckpt)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                               timeout=TIMEOUT)  # fmt: skip
        got = client.completions.create(model="step_1", prompt=PROMPTS[1], max_tokens=8,
                                        temperature=0)  # fmt: skip
        assert got.choices[0].text == want
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
