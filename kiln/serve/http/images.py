"""POST /v1/images/generations: OpenAI's image API over a text-to-image model.

The model is whatever `kiln serve --image-model RUN` loaded (kiln.image.sampler's ImageModel:
`.size`, `.diffusion`, `.tokenizer`, `.caption_ids`, `.sample`), reached by those names only.
Pictures are drawn one request at a time on a thread of their own, so the event loop (and the
text engine behind it) keeps answering while a picture is denoised. A request is checked like
the text endpoints' (key 401, body 413, fields 400 naming `param`, model 404, the caption: control
tokens or too many tokens 400), then takes an in-flight slot (429 when all are taken, 503 while
draining) and a place in the picture queue (429 when `max_waiting` requests already wait).

Answered whole (`data[i].b64_json`, a PNG) or, with `stream: true`, as OpenAI's image stream:
`image_generation.partial_image` events (the picture the current denoising step implies) and one
`image_generation.completed` per picture. kiln's extensions: `seed` (the same seed draws the same
bytes), `steps`, `guidance`, and `scene_from_text` (read the prompt, e.g. a story, for the scene
grammar's words and draw the caption they make; it comes back as `revised_prompt`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from kiln.errors import KilnError
from kiln.image.story_scene import scene_from_text
from kiln.serve.http.endpoints import GenerationStream
from kiln.serve.http.openai_schema import ApiError, parse_request
from kiln.serve.http.service import CLIENT_GONE, Service
from kiln.tokenizer.user_text import check_user_text

MAX_SEED = 2**32 - 1
_SIZE = re.compile(r"(\d+)x(\d+)")


class ImageRequest(BaseModel):
    """POST /v1/images/generations (OpenAI's fields, plus kiln's seed, steps, guidance and
    scene_from_text)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    prompt: str
    model: str | None = None
    n: int = Field(1, ge=1)
    size: str | None = None
    response_format: str | None = None
    stream: bool = False
    partial_images: int | None = Field(None, ge=0)
    output_format: str | None = None
    background: str | None = None
    style: str | None = None
    quality: str | None = None  # accepted: one model, one quality
    user: str | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    steps: int | None = Field(None, ge=1)
    guidance: float | None = Field(None, ge=0.0, le=50.0)
    scene_from_text: bool = False

    def refuse_unsupported(self) -> None:
        """Refuse, by field name, what this server cannot give (links, other formats, styles)."""
        if self.response_format == "url":
            raise ApiError(
                400, "response_format 'url' is not offered: kiln serve keeps no picture files to "
                "link to; ask for 'b64_json' (each picture inline as a base64 PNG)",
                "response_format",
            )  # fmt: skip
        if self.response_format not in (None, "b64_json"):
            raise ApiError(
                400, f"response_format: expected 'b64_json', got {self.response_format!r}",
                "response_format",
            )  # fmt: skip
        if self.output_format not in (None, "png"):
            raise ApiError(400, "output_format: only 'png' is drawn here", "output_format")
        if self.background not in (None, "auto", "opaque"):
            raise ApiError(400, "background: only 'opaque' pictures are drawn here", "background")
        if self.style is not None:
            raise ApiError(400, "style is not supported by kiln serve", "style")


def png_b64(picture: Any) -> str:
    """One picture (3, H, W) in [0, 1] as a base64 PNG."""
    from PIL import Image

    pixels = (picture.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def preview_steps(steps: int, partial: int) -> frozenset[int]:
    """The `partial` step indices (of 0..steps-2) after which a preview goes out, evenly spread."""
    return frozenset(round((j + 1) * steps / (partial + 1)) - 1 for j in range(partial))


class JobCancelled(Exception):
    """A picture job stopped between two denoising steps (client gone or server stopping)."""


@dataclass(eq=False)  # hashed by identity: it sits in the server's set of running requests
class ImageJob:
    """One request's pictures: drawn on the picture thread, cancellable between steps."""

    caption: str
    n: int
    seed: int
    steps: int
    guidance: float | None
    previews: frozenset[int]
    arrived: float
    emit: Callable[[int, list[str]], None] | None = None  # (step, base64 PNGs) per preview
    finished: bool = False
    why: str = "disconnected"  # what cancel() was for
    _stop: threading.Event = field(default_factory=threading.Event)

    def cancel(self, why: str = "cancelled") -> None:
        """Stop at the next step (shutdown calls it with no reason: "cancelled")."""
        self.why = why
        self._stop.set()

    def run(self, model: Any) -> list[str]:
        """Draw the pictures (on the picture thread) and return them as base64 PNGs."""
        if self._stop.is_set():  # the client left while it waited its turn
            raise JobCancelled

        def on_step(step: int, pictures: Any) -> None:
            if self._stop.is_set():
                raise JobCancelled
            if self.emit is not None and step in self.previews:
                self.emit(step, [png_b64(p) for p in pictures])

        pictures = model.sample(
            [self.caption] * self.n, self.seed, self.steps, on_step, guidance=self.guidance
        )
        return [png_b64(p) for p in pictures]


class ImageService:
    """The image model, the one thread that draws with it and the queue before that thread."""

    def __init__(self, model: Any, name: str) -> None:
        self.model, self.name = model, name
        self.size = int(model.size)
        self.sample_steps = int(model.diffusion.sample_steps)
        self.max_steps = int(model.diffusion.timesteps)
        self.max_caption_tokens = int(model.model.config.max_caption_tokens)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-images")
        self.queued = 0  # requests waiting for the thread or being drawn

    def card(self, created: int, max_n: int) -> dict[str, Any]:
        """The image model's /v1/models entry (kiln's fields say what it draws)."""
        return {
            "id": self.name, "object": "model", "created": created, "owned_by": "kiln",
            "kiln": {"image": True, "size": self.size, "sample_steps": self.sample_steps,
                     "max_steps": self.max_steps, "max_caption_tokens": self.max_caption_tokens,
                     "max_n": max_n},
        }  # fmt: skip

    def close(self) -> None:
        """Stop the picture thread (jobs still queued are dropped)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    def check(self, req: ImageRequest, service: Service) -> tuple[str, dict[str, Any] | None]:
        """The caption to draw (and, from a story, what was found) after every field's check."""
        if req.model is not None and req.model != self.name:
            raise ApiError(
                404, f"model {req.model!r} not found; this server draws with {self.name!r}",
                "model", "model_not_found",
            )  # fmt: skip
        if req.n > service.limits.max_n:
            raise ApiError(400, f"n: at most {service.limits.max_n} pictures per request, "
                           f"got {req.n}", "n")  # fmt: skip
        if req.size not in (None, "auto"):
            match = _SIZE.fullmatch(req.size)
            if match is None or {int(match[1]), int(match[2])} != {self.size}:
                raise ApiError(
                    400, f"size: this server's image model draws {self.size}x{self.size} "
                    f"pictures only, got {req.size!r}", "size",
                )  # fmt: skip
        steps = req.steps or self.sample_steps
        if steps > self.max_steps:
            raise ApiError(400, f"steps: at most {self.max_steps}, got {steps}", "steps")
        if req.stream and (req.partial_images or 0) > steps - 1:
            raise ApiError(
                400, f"partial_images: at most {steps - 1} (one per denoising step before the "
                f"last of {steps}), got {req.partial_images}", "partial_images",
            )  # fmt: skip
        if not req.prompt.strip():
            raise ApiError(400, "prompt: must not be empty", "prompt")
        try:
            check_user_text(self.model.tokenizer, req.prompt, "prompt", None)
        except KilnError as exc:
            raise ApiError(400, str(exc), "prompt", "special_token_in_prompt") from None
        found = None
        caption = req.prompt
        if req.scene_from_text:
            scene = scene_from_text(req.prompt)
            caption, found = scene.caption, scene.summary()
        try:
            self.model.caption_ids([caption], "prompt")
        except KilnError as exc:
            raise ApiError(400, str(exc), "prompt", "context_length_exceeded") from None
        return caption, found


def _event(kind: str, data: dict[str, Any]) -> bytes:
    """One server-sent event of OpenAI's image stream."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


async def image_generations(service: Service, images: ImageService, request: Request) -> Any:
    """POST /v1/images/generations."""
    arrived = time.monotonic()
    service.authorize(request)
    req = parse_request(ImageRequest, await service.read_body(request))  # type: ignore[type-var]
    caption, found = images.check(req, service)
    seed = req.seed if req.seed is not None else secrets.randbelow(MAX_SEED)
    steps = req.steps or images.sample_steps
    previews = preview_steps(steps, req.partial_images or 0) if req.stream else frozenset()
    job = ImageJob(caption, req.n, seed, steps, req.guidance, previews, arrived)
    service.reserve()
    if images.queued >= service.limits.max_waiting:
        service.state.inflight -= 1
        raise service.too_busy(f"{images.queued} image requests already wait or draw")
    images.queued += 1
    service.state.active.add(job)  # so a shutdown's cancel_all reaches it
    size = f"{images.size}x{images.size}"
    revised = caption if req.scene_from_text else None
    extra = {"kiln": {"seed": seed, "steps": steps, "model": images.name, "scene": found}}
    if req.stream:
        return _streamed(service, images, job, size, revised, extra)
    pictures = await _drawn(service, images, job, request)
    if pictures is None:
        return Response(status_code=CLIENT_GONE)
    data = [{"b64_json": b64, "revised_prompt": revised} for b64 in pictures]
    return {"created": int(time.time()), "data": data, "size": size, "output_format": "png",
            "background": "opaque", **extra}  # fmt: skip


def _start(images: ImageService, job: ImageJob) -> asyncio.Future[list[str]]:
    """Queue the job on the picture thread; its queue place is freed when the thread is done."""
    loop = asyncio.get_running_loop()
    work = loop.run_in_executor(images.executor, job.run, images.model)

    def release(_: Any) -> None:
        images.queued -= 1

    work.add_done_callback(release)
    return work


def _finish(service: Service, job: ImageJob, outcome: str) -> None:
    """Free the job's in-flight slot and count it (once, whoever calls first)."""
    if job.finished:
        return
    job.finished = True
    service.state.inflight -= 1
    service.state.active.discard(job)
    seconds = time.monotonic() - job.arrived
    service.metrics.count_image(outcome, job.n if outcome == "ok" else 0, seconds)


def _stopped() -> ApiError:
    return ApiError(503, "the server is shutting down: the pictures were not finished",
                    kind="server_error", code="unavailable")  # fmt: skip


async def _drawn(
    service: Service, images: ImageService, job: ImageJob, request: Request
) -> list[str] | None:
    """The request's pictures; None if its client went away (the job stops at its next step)."""
    outcome = "error"
    try:
        work = _start(images, job)
        gone = asyncio.ensure_future(service.until_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            job.cancel("disconnected")
            outcome = "disconnected"
            return None
        try:
            pictures = work.result()
        except JobCancelled:
            outcome = job.why
            raise _stopped() from None
        outcome = "ok"
        return pictures
    finally:
        _finish(service, job, outcome)


def _streamed(
    service: Service, images: ImageService, job: ImageJob, size: str, revised: str | None,
    extra: dict[str, Any],
) -> GenerationStream:  # fmt: skip
    """OpenAI's image stream: partial pictures as the steps come, then each finished one."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, list[str]] | None] = asyncio.Queue()
    job.emit = lambda step, pngs: loop.call_soon_threadsafe(queue.put_nowait, (step, pngs))
    common = {"size": size, "quality": "auto", "background": "opaque", "output_format": "png",
              "revised_prompt": revised, **extra}  # fmt: skip

    # Queued now, not when the body first runs: a response never started still ends its job.
    work = _start(images, job)
    work.add_done_callback(lambda _: queue.put_nowait(None))

    async def body() -> AsyncIterator[bytes]:
        outcome, sent = "error", 0
        try:
            while (item := await queue.get()) is not None:
                step, pngs = item
                for k, b64 in enumerate(pngs):
                    yield _event("image_generation.partial_image", {
                        "b64_json": b64, "created_at": int(time.time()),
                        "partial_image_index": sent, "index": k, "step": step + 1, **common,
                    })  # fmt: skip
                sent += 1
            try:
                pictures = work.result()
            except JobCancelled:
                outcome = job.why
                yield _event("error", _stopped().body())
                return
            for k, b64 in enumerate(pictures):
                yield _event("image_generation.completed", {
                    "b64_json": b64, "created_at": int(time.time()), "index": k,
                    "step": job.steps, **common,
                })  # fmt: skip
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            job.cancel("disconnected")
            outcome = "disconnected"
            raise
        finally:
            _finish(service, job, outcome)

    def closed() -> None:
        job.cancel("disconnected")
        _finish(service, job, "disconnected")

    return GenerationStream(body(), closed)
