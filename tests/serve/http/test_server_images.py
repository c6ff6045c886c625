"""`kiln serve --image-model`: POST /v1/images/generations as the official `openai` client
calls it (`images.generate`, whole and streamed), against a real server and a tiny trained
text-to-image run: seeded pictures that are the model's own, every refusal naming its field,
the key and the queue's 429, text served while a picture is drawn, cancellation, /metrics.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
import torch

from kiln.cli import main
from kiln.image.sampler import load_image_model
from kiln.image.story_scene import scene_from_text
from kiln.serve.http.limits import ServerLimits
from tests.serve.http.conftest import RunningServer, serve_model, wait_until

CAPTION = "a red ball under a green tree"
TIMEOUT = 60.0


class GatedModel:
    """The image model, but each denoising step after the first `free_steps` waits for `gate` (so
    a test can hold a picture mid-way) and counts itself in `steps_run`."""

    def __init__(self, model: Any) -> None:
        self.inner, self.gate, self.steps_run, self.free_steps = model, threading.Event(), 0, 0
        self.gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def sample(self, prompts: list[str], seed: int, steps: Any = None, on_step: Any = None,
               guidance: Any = None) -> torch.Tensor:  # fmt: skip
        def step(i: int, pictures: torch.Tensor) -> None:
            if self.steps_run >= self.free_steps:
                assert self.gate.wait(TIMEOUT)
            self.steps_run += 1
            if on_step is not None:
                on_step(i, pictures)

        return self.inner.sample(prompts, seed, steps, step, guidance)


@pytest.fixture(scope="module")
def model(image_run: Path) -> GatedModel:
    return GatedModel(load_image_model(image_run))


@pytest.fixture(scope="module")
def server(base_model: Path, model: GatedModel) -> Iterator[RunningServer]:
    with serve_model(base_model, image_model=model) as running:
        yield running


def client_for(server: RunningServer, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key=key, max_retries=0, timeout=TIMEOUT)


def pixels(b64: str) -> torch.Tensor:
    """A base64 PNG as (3, H, W) uint8."""
    import numpy as np
    from PIL import Image

    picture = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert picture.format == "PNG" and picture.mode == "RGB"
    return torch.from_numpy(np.array(picture)).permute(2, 0, 1)


def draw(client: openai.OpenAI, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": "pictures", "prompt": CAPTION, "size": "32x32",
                            "response_format": "b64_json", **kw}  # fmt: skip
    return client.images.generate(**args)


def test_the_openai_client_draws_seeded_pictures_that_are_the_models_own(
    server: RunningServer, model: GatedModel
) -> None:
    client = client_for(server)
    first = draw(client, n=2, extra_body={"seed": 7})
    assert len(first.data) == 2 and first.size == "32x32"
    again = draw(client, n=2, extra_body={"seed": 7})
    assert [d.b64_json for d in again.data] == [d.b64_json for d in first.data]  # same bytes
    other = draw(client, n=2, extra_body={"seed": 8})
    assert other.data[0].b64_json != first.data[0].b64_json
    # What the server sent is what the model draws for that caption and seed, to the byte.
    direct = model.inner.sample([CAPTION] * 2, 7)
    for k, d in enumerate(first.data):
        expected = (direct[k].clamp(0, 1) * 255).round().to(torch.uint8)
        assert torch.equal(pixels(d.b64_json), expected)
    assert first.model_extra["kiln"]["seed"] == 7
    assert first.data[0].revised_prompt is None
    unseeded = draw(client)
    assert isinstance(unseeded.model_extra["kiln"]["seed"], int)  # reported, to draw it again


def test_a_story_becomes_a_scene_caption_returned_as_the_revised_prompt(
    server: RunningServer,
) -> None:
    story = "Once upon a time, a little dog found a big red ball under a tree. The sun was warm."
    done = draw(client_for(server), prompt=story, extra_body={"seed": 1, "scene_from_text": True})
    scene = scene_from_text(story)
    assert done.data[0].revised_prompt == scene.caption == "a big red ball under a green tree"
    assert done.model_extra["kiln"]["scene"] == {"kinds": ["dog", "ball", "tree", "sun"],
                                                 "colours": ["red"]}  # fmt: skip
    caption = draw(client_for(server), prompt=scene.caption, extra_body={"seed": 1})
    assert caption.data[0].b64_json == done.data[0].b64_json


def test_the_stream_sends_each_steps_picture_then_the_finished_one(server: RunningServer) -> None:
    client = client_for(server)
    events = list(draw(client, stream=True, partial_images=3, extra_body={"seed": 5}))
    kinds = [e.type for e in events]
    assert kinds == ["image_generation.partial_image"] * 3 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:3]] == [0, 1, 2]
    assert [e.model_extra["step"] for e in events] == [1, 2, 3, 4]  # 4 steps: one preview each
    whole = draw(client, extra_body={"seed": 5})
    assert events[-1].b64_json == whole.data[0].b64_json
    assert len({e.b64_json for e in events}) == 4  # every step's picture differs
    [only] = list(draw(client, stream=True, extra_body={"seed": 5}))  # partial_images 0
    assert only.type == "image_generation.completed"


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"size": "64x64"}, "size", None),
        ({"size": "1024x1024"}, "size", None),
        ({"size": "big"}, "size", None),
        ({"response_format": "url"}, "response_format", None),
        ({"prompt": "a red ball <|endoftext|>"}, "prompt", "special_token_in_prompt"),
        ({"prompt": "a red ball " * 40}, "prompt", "context_length_exceeded"),
        ({"prompt": "   "}, "prompt", None),
        ({"n": 9}, "n", None),
        ({"n": "2"}, "n", None),
        ({"seed": -1}, "seed", None),
        ({"steps": 5000}, "steps", None),
        ({"stream": True, "partial_images": 4}, "partial_images", None),
        ({"output_format": "jpeg"}, "output_format", None),
        ({"style": "vivid"}, "style", None),
        ({}, "prompt", None),  # no prompt at all
    ],
)
def test_a_bad_request_is_a_400_naming_the_field(
    server: RunningServer, body: dict[str, Any], param: str, code: str | None
) -> None:
    sent = {"model": "pictures", "prompt": CAPTION, **body} if body else {"model": "pictures"}
    r = httpx.post(server.api + "/images/generations", json=sent, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    if code is not None:
        assert error["code"] == code
    if param == "response_format":
        assert "b64_json" in error["message"] and "no picture files" in error["message"]
    if param == "size":
        assert "32x32" in error["message"]


def test_the_openai_client_sees_the_refusals_too(server: RunningServer) -> None:
    client = client_for(server)
    with pytest.raises(openai.BadRequestError) as err:
        draw(client, size="64x64")
    assert err.value.body["param"] == "size"
    with pytest.raises(openai.NotFoundError) as err:
        draw(client, model="tiny")  # the language model cannot draw
    assert err.value.body["param"] == "model"


def test_models_lists_the_image_model_after_the_language_model(server: RunningServer) -> None:
    data = client_for(server).models.list().data
    assert [m.id for m in data] == ["tiny", "pictures"]
    card = data[1].model_extra["kiln"]
    assert card["image"] is True and card["size"] == 32 and card["sample_steps"] == 4
    assert client_for(server).models.retrieve("pictures").id == "pictures"


def test_without_an_image_model_the_endpoint_is_a_404(base_server: RunningServer) -> None:
    r = httpx.post(base_server.api + "/images/generations", json={"prompt": CAPTION})
    assert r.status_code == 404 and "--image-model" in r.json()["error"]["message"]


def test_the_key_is_required_and_a_full_queue_is_a_429_while_text_is_still_served(
    base_model: Path, model: GatedModel
) -> None:
    limits = ServerLimits(max_waiting=1)
    with serve_model(base_model, image_model=model, api_key="k3y", limits=limits) as server:
        with pytest.raises(openai.AuthenticationError):
            draw(client_for(server, "wrong"))
        client = client_for(server, "k3y")
        model.gate.clear()  # the first picture stops at its first step
        held: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: held.update(done=draw(client)))
        thread.start()
        try:
            wait_until(lambda: server.service.state.inflight == 1, 30, "the held picture")
            with pytest.raises(openai.RateLimitError) as err:
                draw(client)
            assert err.value.response.headers["Retry-After"] == "1"
            # The picture thread is busy; the event loop and the text engine are not.
            text = client.completions.create(model="tiny", prompt="Once", max_tokens=4)
            assert text.choices[0].finish_reason in ("length", "stop")
            assert thread.is_alive()
        finally:
            model.gate.set()
            thread.join(TIMEOUT)
        assert len(held["done"].data) == 1
        metrics = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer k3y"}).text
        assert 'kiln_image_requests_total{outcome="http_429"} 1' in metrics
        assert 'kiln_image_requests_total{outcome="ok"} 1' in metrics


def test_a_client_that_leaves_mid_stream_stops_the_drawing(
    base_model: Path, model: GatedModel
) -> None:
    # Only the first step runs before the client leaves: opening the gate and closing it again
    # would race the picture thread, which on a fast host drew all four steps in between.
    model.steps_run, model.free_steps = 0, 1
    model.gate.clear()
    try:
        with serve_model(base_model, image_model=model) as server:
            body = {"model": "pictures", "prompt": CAPTION, "stream": True, "partial_images": 3,
                    "steps": 4}  # fmt: skip
            with httpx.stream("POST", server.api + "/images/generations", json=body,
                              timeout=TIMEOUT) as r:  # fmt: skip
                assert next(r.iter_lines()) == "event: image_generation.partial_image"
                assert model.steps_run == 1  # the second step is held while the client goes away
            images = server.images
            wait_until(lambda: server.service.state.inflight == 0, 30, "the request to end")
            model.gate.set()
            wait_until(lambda: images.queued == 0, 30, "the picture thread to stop")
            assert model.steps_run < 4  # it stopped early: the last steps were never drawn
            metrics = httpx.get(server.url + "/metrics").text
            assert 'kiln_image_requests_total{outcome="disconnected"} 1' in metrics
    finally:
        model.free_steps = 0
        model.gate.set()


def test_metrics_count_image_requests_pictures_and_refusals(server: RunningServer) -> None:
    client = client_for(server)
    before = _scrape(server)
    draw(client, n=3, extra_body={"seed": 2})
    with pytest.raises(openai.BadRequestError):
        draw(client, size="8x8")
    after = _scrape(server)
    assert after["kiln_images_generated_total"] - before.get("kiln_images_generated_total", 0) == 3
    ok = 'kiln_image_requests_total{outcome="ok"}'
    bad = 'kiln_image_requests_total{outcome="http_400"}'
    assert after[ok] - before.get(ok, 0) == 1 and after[bad] - before.get(bad, 0) == 1
    assert after["kiln_image_request_seconds_count"] > before.get(
        "kiln_image_request_seconds_count", 0
    )
    assert after["kiln_image_requests_queued"] == 0
    # The text series do not count pictures.
    assert before.get('kiln_requests_total{outcome="ok"}', 0) == after.get(
        'kiln_requests_total{outcome="ok"}', 0
    )


def _scrape(server: RunningServer) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_kiln_serve_names_a_bad_image_model_flag(tmp_path: Path, capsys) -> None:
    code = main(["serve", str(tmp_path), "--image-model", str(tmp_path / "none"), "--port", "0"])
    assert code == 2
    assert "--image-model" in capsys.readouterr().err
