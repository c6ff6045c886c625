"""Tiny model folders and a real `kiln serve` app on a free loopback port, for the server tests.

Models: the `tiny` preset with random weights and a 300-token BPE trained on a slice of the
packaged TinyStories text; "chat" has the chat control tokens as special tokens, "base" has not.
Servers run uvicorn in a thread over the real Engine, on a socket bound to 127.0.0.1:0.
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import kiln
from kiln.chat.tokens import CHAT_TOKENS
from kiln.tokenizer.special import EOT

STORIES = Path(kiln.__file__).parent / "assets" / "tinystories_valid.txt.gz"
START_TIMEOUT_S = 30.0


def build_model_dir(root: Path, specials: tuple[str, ...], block_size: int = 512) -> Path:
    """An HF model folder: a random `tiny` model and a 300-token BPE with `specials`."""
    import torch

    from kiln.model import ModelConfig, Transformer
    from kiln.model.hf import save_hf_dir
    from kiln.tokenizer import train_bpe

    with gzip.open(STORIES, "rt", encoding="utf-8") as handle:
        text = handle.read(60_000)
    corpus = root / "stories.txt"
    corpus.write_text(text, encoding="utf-8")
    tok = train_bpe(corpus, 300, special_tokens=list(specials), workers=1)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny", vocab_size=tok.n_vocab, block_size=block_size))
    out = root / "model"
    save_hf_dir(model.eval(), out, eos_token_id=tok.special_tokens[EOT])
    tok.save(out / "tokenizer.json")
    return out


@pytest.fixture(scope="session")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base model folder (no chat tokens)."""
    return build_model_dir(tmp_path_factory.mktemp("base"), (EOT,))


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder whose tokenizer has the chat control tokens."""
    return build_model_dir(tmp_path_factory.mktemp("chat"), (EOT, *CHAT_TOKENS))


@dataclass
class RunningServer:
    """A served app: its base URL, the engine behind it and the uvicorn server."""

    url: str
    engine: Any
    server: Any
    service: Any
    images: Any = None  # the app's ImageService, when an image model is served

    @property
    def api(self) -> str:
        """The OpenAI base URL (…/v1)."""
        return self.url + "/v1"


IMAGE_RUN_ENV = "KILN_TEST_IMAGE_RUN"  # a trained DiT run to serve instead (docs screenshots)


def build_image_run(root: Path) -> Path:
    """A `kiln image train-dit` run in seconds: 40 scenes, a 60-step VQ-VAE, a 30-step DiT."""
    import os

    if os.environ.get(IMAGE_RUN_ENV):
        return Path(os.environ[IMAGE_RUN_ENV])
    from kiln.image.dataset import ScenesSpec, build_scenes
    from kiln.train.dit import DiTRun, DiTTrainConfig
    from kiln.train.vqvae import VQVAERun, VQVAETrainConfig

    build_scenes(root / "scenes", ScenesSpec(size=32, train=40, val=8, heldout=8, seed=5))
    vq = VQVAETrainConfig.load(None, [
        f"data.dataset={root / 'scenes'}", f"run_dir={root / 'vq'}", "model.hidden=8",
        "model.res_blocks=0", "model.codebook_size=16", "model.code_dim=4",
        "train.batch_size=8", "train.max_steps=60", "optim.lr=1e-2", "train.eval_images=4",
        "train.restart_every=1", "model.ema=false",
    ])  # fmt: skip
    VQVAERun(vq).run(progress=False)
    dit = DiTTrainConfig.load(None, [
        f"data.dataset={root / 'scenes'}", f"vqvae={root / 'vq'}", f"run_dir={root / 'dit'}",
        "model.width=32", "model.depth=1", "model.heads=2", "model.text_layers=1",
        "train.batch_size=8", "train.max_steps=30", "optim.lr=3e-3", "train.eval_images=4",
        "schedule.warmup_steps=1", "diffusion.sample_steps=4",
    ])  # fmt: skip
    DiTRun(dit).run(progress=False)
    return root / "dit"


@pytest.fixture(scope="session")
def image_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny trained text-to-image run (kiln image train-dit), 32×32, 4 sampling steps."""
    return build_image_run(tmp_path_factory.mktemp("image"))


@contextmanager
def serve_model(
    model_dir: Path, *, engine_options: dict[str, Any] | None = None,
    image_model: Any = None, **options: Any,
) -> Iterator[RunningServer]:  # fmt: skip
    """Serve `model_dir` in this process (a uvicorn thread) until the block ends; with
    `image_model` (a loaded ImageModel) also /v1/images/generations, named "pictures"."""
    from kiln.loading import load_model
    from kiln.serve.engine import Engine, EngineConfig
    from kiln.serve.http.limits import ServerLimits
    from kiln.serve.http.server import ServerOptions, create_app, make_server

    loaded = load_model(model_dir, device="cpu", dtype="fp32")
    engine_options = dict(engine_options or {})
    drafter = engine_options.pop("drafter", None)
    engine = Engine.from_loaded(loaded, EngineConfig(**engine_options), drafter)
    limits = options.pop("limits", ServerLimits())
    if image_model is not None:
        options.setdefault("image_model_name", "pictures")
    opts = ServerOptions(options.pop("model_name", "tiny"), limits, **options)
    app = create_app(engine, loaded.tokenizer, loaded.model.cfg.block_size, opts, image_model)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(app, "127.0.0.1", port, grace_s=2.0, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", engine, server, app.state.service,
                            app.state.images)  # fmt: skip
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


@pytest.fixture(scope="module")
def base_server(base_model: Path) -> Iterator[RunningServer]:
    """The base model served with default limits (shared by a module's tests)."""
    with serve_model(base_model, engine_options={"max_waiting": 64}) as running:
        yield running


def wait_until(check: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `check` until it holds (bounded), failing with `what`."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
