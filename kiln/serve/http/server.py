"""`kiln serve`'s HTTP layer: OpenAI's API over the engine (and an image model, when one is
given: images.py), /health, /metrics and the page at /.

`create_app` wires one loaded engine into a FastAPI app; `run_server` serves it with uvicorn.
Each request is checked in the order a client would want to hear about problems: the key (401),
the body's size (413) and shape (400, naming the field), the model name (404), the prompt (400:
special-token text, too long for the context), then the engine's room (429 with Retry-After).
A client that goes away cancels its request, which frees its KV blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.serve.http.endpoints import chat_completions, completions
from kiln.serve.http.images import ImageService, image_generations
from kiln.serve.http.memory_probe import MemoryProbe, frames_from_env
from kiln.serve.http.openai_schema import ApiError
from kiln.serve.http.service import ClientGone, ServerOptions, Service

__all__ = ["ServerOptions", "create_app", "make_server", "run_server"]

# The page may talk to this server only: no CDN, no fonts, no network beyond the API it came from.
PAGE_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'"
)
# After the grace period requests are cancelled; uvicorn force-closes what is left this much later.
SHUTDOWN_BACKSTOP_S = 5.0


# ---- the app ----------------------------------------------------------------------------------


def page_html() -> str:
    """The Storyteller page shipped in the package (kiln/serve/web/index.html)."""
    return resources.files("kiln.serve").joinpath("web/index.html").read_text(encoding="utf-8")


def create_app(
    engine: Any, tokenizer: Any, context_length: int, options: ServerOptions,
    image_model: Any = None,
) -> FastAPI:  # fmt: skip
    """The FastAPI app serving `engine` (started and stopped with the app's lifespan), and
    `image_model` (a kiln.image.sampler.ImageModel) at /v1/images/generations when given."""
    service = Service(engine, tokenizer, context_length, options)
    page = page_html()
    images = None
    if image_model is not None:
        images = ImageService(image_model, options.image_model_name or "image")
        service.metrics.images = True
        service.metrics.image_queued = lambda: images.queued

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(engine.start)
        service.state.ready = True
        try:
            yield
        finally:
            service.state.ready = False
            await asyncio.to_thread(engine.stop, True, 10.0)
            if images is not None:
                images.close()

    app = FastAPI(
        title="kiln serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.service = service
    app.state.images = images
    if options.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware, allow_origins=list(options.cors_origins), allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )  # fmt: skip

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        count = service.metrics.count_request
        if request.url.path.startswith("/v1/images"):
            count = service.metrics.count_image
        if isinstance(exc, ClientGone):
            count("disconnected")
            return Response(status_code=exc.status)
        if exc.status >= 400 and exc.status != 401:
            count(f"http_{exc.status}")
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        # The traceback goes to the server's log (uvicorn's); the client gets OpenAI's shape.
        service.metrics.count_request("http_500")
        error = ApiError(500, f"internal server error ({type(exc).__name__})", kind="server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page, headers={"Content-Security-Policy": PAGE_POLICY})

    @app.get("/health")
    async def health() -> JSONResponse:
        state = service.state
        status = (
            "ok"
            if state.ready and not state.draining
            else ("stopping" if state.draining else "loading")
        )
        if service.engine.broken is not None:
            status = "broken"  # the engine's loop died: nothing will be answered
        return JSONResponse(
            {"status": status, "model": options.model_name},
            status_code=200 if status == "ok" else 503,
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        service.authorize(request)
        stats = await asyncio.to_thread(engine.stats)
        return PlainTextResponse(
            service.metrics.render(stats), media_type="text/plain; version=0.0.4"
        )

    def model_card() -> dict[str, Any]:
        return {
            "id": options.model_name, "object": "model", "created": service.created, "owned_by": "kiln",
            "max_model_len": context_length,
            "kiln": {"chat": service.chat is not None, "context_length": context_length,
                     "max_tokens": options.limits.max_tokens, "max_n": options.limits.max_n},
        }  # fmt: skip

    def cards() -> list[dict[str, Any]]:
        """The language model first (the page reads it there), then the image model."""
        extra = [images.card(service.created, options.limits.max_n)] if images else []
        return [model_card(), *extra]

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        service.authorize(request)
        return {"object": "list", "data": cards()}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict[str, Any]:
        service.authorize(request)
        if images is not None and name == images.name:
            return images.card(service.created, options.limits.max_n)
        service.check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def post_completions(request: Request) -> Any:
        return await completions(service, request)

    @app.post("/v1/chat/completions")
    async def post_chat(request: Request) -> Any:
        return await chat_completions(service, request)

    @app.post("/v1/images/generations")
    async def post_images(request: Request) -> Any:
        if images is None:
            service.authorize(request)
            raise ApiError(
                404, "this server has no image model; start it with `kiln serve MODEL "
                "--image-model IMAGE_RUN`", "model", "model_not_found",
            )  # fmt: skip
        return await image_generations(service, images, request)

    frames = frames_from_env()
    if frames is not None:  # a leak hunt asked for it (memory_probe.py); absent otherwise
        probe = MemoryProbe(frames)

        @app.get("/debug/memory")
        async def debug_memory(request: Request) -> dict[str, Any]:
            service.authorize(request)
            return await asyncio.to_thread(probe.report)

    return app


# ---- serving ----------------------------------------------------------------------------------


class _GracefulServer:
    """uvicorn's Server that drains on SIGTERM/SIGINT and exits normally (status 0) after.

    The first signal does not close the listener: `on_stop(close)` is called, and the server
    keeps answering (/health 503 "stopping", new work 503) until `close()` hands the exit to
    uvicorn. A second signal stops at once. uvicorn re-raises the signal it caught once it has
    shut down, which would end the process with status 143; a service manager reads a clean
    stop as 0.
    """

    def __init__(self, config: Any, on_stop: Callable[[Callable[[], None]], None]) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            stopping = False

            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                signals = (signal.SIGINT, signal.SIGTERM)
                previous = {s: signal.signal(s, self.handle_exit) for s in signals}
                try:
                    yield
                finally:
                    for s, handler in previous.items():
                        signal.signal(s, handler)

            def handle_exit(self, sig: int, frame: Any) -> None:
                if self.stopping:  # a second signal: no more waiting
                    super().handle_exit(sig, frame)
                    return
                self.stopping = True
                on_stop(functools.partial(super().handle_exit, sig, frame))

        self.server = Server(config)


DRAIN_POLL_S = 0.05  # how often the drain looks whether requests are still running


def make_server(app: FastAPI, host: str, port: int, grace_s: float, log_level: str = "info") -> Any:
    """A uvicorn server for `app` that drains on SIGTERM: it keeps listening (answering /health
    with 503 "stopping" and new work with 503) while running requests get up to `grace_s`
    seconds to finish; then those left are cancelled (their streams end with finish_reason
    "cancelled") and the server closes."""
    import uvicorn

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", server_header=False,
        timeout_graceful_shutdown=SHUTDOWN_BACKSTOP_S,
    )  # fmt: skip
    service: Service = app.state.service

    def on_stop(close: Callable[[], None]) -> None:
        service.state.draining = True
        deadline = time.monotonic() + grace_s

        def drained() -> bool:
            return service.state.inflight == 0 or time.monotonic() >= deadline

        def finish() -> None:
            service.cancel_all()
            close()

        async def drain() -> None:
            while not drained():
                await asyncio.sleep(DRAIN_POLL_S)
            finish()

        def drain_in_thread() -> None:
            while not drained():
                time.sleep(DRAIN_POLL_S)
            finish()

        try:  # the signal arrives on the event loop's thread: drain there
            loop = asyncio.get_running_loop()
            service.state.drain_task = loop.create_task(drain())
        except RuntimeError:  # no loop running here: a thread will do
            threading.Thread(target=drain_in_thread, daemon=True).start()

    return _GracefulServer(config, on_stop).server


def run_server(
    app: FastAPI, host: str, port: int, grace_s: float, sock: socket.socket | None = None
) -> None:
    """Serve until SIGTERM/SIGINT, then drain: running requests get `grace_s` seconds to end."""
    server = make_server(app, host, port, grace_s)
    server.run(sockets=[sock] if sock is not None else None)
