"""`kiln serve`'s HTTP layer: OpenAI's API over the engine, /health, /metrics and the page at /.

`create_app` wires one loaded engine into a FastAPI app; `run_server` serves it with uvicorn.
Each request is checked in the order a client would want to hear about problems: the key (401),
the body's size (413) and shape (400, naming the field), the model name (404), the prompt (400:
special-token text, too long for the context), then the engine's room (429 with Retry-After).
A client that goes away cancels its request, which frees its KV blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.errors import KilnError
from kiln.serve.chat_template import ChatMessageError, ServerChat
from kiln.serve.limits import ServerLimits, key_matches
from kiln.serve.metrics import ServerMetrics
from kiln.serve.openai_schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    chat_logprob,
    completion_logprobs,
    envelope,
    new_id,
    parse_request,
    sse,
    usage,
)
from kiln.tokenizer.user_text import encode_user_text

# The page may talk to this server only: no CDN, no fonts, no network beyond the API it came from.
PAGE_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'"
)
PROMPT_OPT_IN = "send the prompt as token ids"
# After the grace period requests are cancelled; uvicorn force-closes what is left this much later.
SHUTDOWN_BACKSTOP_S = 5.0


@dataclass(frozen=True)
class ServerOptions:
    """Who the server is and whom it serves: its model name, limits, key and CORS origins."""

    model_name: str
    limits: ServerLimits = field(default_factory=ServerLimits)
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()


@dataclass
class ServerState:
    """What the running app knows: ready to serve, draining for shutdown, requests in flight."""

    ready: bool = False
    draining: bool = False
    inflight: int = 0
    active: set[Generation] = field(default_factory=set)  # requests now generating


def _engine_types() -> tuple[Any, Any]:
    """SamplingParams and EngineFull (imported late: the engine module imports torch)."""
    from kiln.serve.engine import EngineFull
    from kiln.serve.sampling import SamplingParams

    return SamplingParams, EngineFull


# ---- one request's generation -----------------------------------------------------------------


class Generation:
    """The engine handles of one HTTP request (one per prompt), its timing and its accounting."""

    def __init__(self, handles: list[Any], prompt_lens: list[int], n: int, arrived: float) -> None:
        self.handles, self.prompt_lens, self.n, self.arrived = handles, prompt_lens, n, arrived
        self.first: float | None = None
        self.last: float | None = None
        self.counts: dict[int, int] = {}  # choice index -> tokens seen
        self.finished = False  # counted and its slot freed (Service.finish)

    def choice(self, prompt_index: int, sample_index: int) -> int:
        """OpenAI's choice index: prompts in order, each one's n samples in a row."""
        return prompt_index * self.n + sample_index

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, TokenEvent) as the engine produces them, across all prompts."""
        if len(self.handles) == 1:
            async for event in self.handles[0].events():
                yield self._seen(0, event)
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        done = object()

        async def pump(i: int, handle: Any) -> None:
            try:
                async for event in handle.events():
                    await queue.put((i, event))
                await queue.put((i, done))
            except Exception as exc:  # surfaced in the consumer below
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(self.handles)]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is done:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield self._seen(i, item)
        finally:
            for task in tasks:
                task.cancel()

    def _seen(self, prompt_index: int, event: Any) -> tuple[int, Any]:
        now = time.monotonic()
        self.first = self.first if self.first is not None else now
        self.last = now
        k = self.choice(prompt_index, event.index)
        self.counts[k] = self.counts.get(k, 0) + 1
        return k, event

    async def results(self) -> list[Any]:
        """Every finished sample (Completion), in choice order."""
        out = []
        for handle in self.handles:
            done = handle.result(0) if handle.done else await asyncio.to_thread(handle.result, 60)
            out += sorted(done, key=lambda c: c.index)
        return out

    def cancel(self) -> None:
        """Cancel every prompt's request (the engine frees their blocks at its next step)."""
        for handle in self.handles:
            if not handle.done:
                handle.cancel()

    def record(self, metrics: ServerMetrics) -> None:
        """Add this request's tokens (as sent to the client) and latencies to the metrics."""
        generated = sum(self.counts.values())
        ttft = None if self.first is None else self.first - self.arrived
        decode = None if self.first is None or self.last is None else self.last - self.first
        metrics.record(
            sum(self.prompt_lens), generated, ttft, decode, max(self.counts.values(), default=0)
        )


# ---- the service ------------------------------------------------------------------------------


class Service:
    """The API's logic over one engine: checks, prompt building, submission, responses."""

    def __init__(
        self, engine: Any, tokenizer: Any, context_length: int, options: ServerOptions
    ) -> None:
        self.engine, self.tokenizer, self.options = engine, tokenizer, options
        self.limits = options.limits
        self.context_length = context_length
        self.max_prompt = min(
            self.limits.max_prompt_tokens or context_length - 1, context_length - 1
        )
        self.chat = ServerChat.of(tokenizer)
        self.eot_id = getattr(engine, "eot_id", None)
        self.vocab_size = tokenizer.n_vocab if tokenizer is not None else None
        self.metrics = ServerMetrics()
        self.state = ServerState()
        self.created = int(time.time())
        self._pieces: dict[int, tuple[str, bytes]] = {}

    # -- checks --

    def authorize(self, request: Request) -> None:
        """401 unless the request carries the server's key (when it has one)."""
        key = self.options.api_key
        if key is not None and not key_matches(request.headers.get("authorization"), key):
            raise ApiError(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key", kind="authentication_error",
            )  # fmt: skip

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it is over the limit."""
        limit = self.limits.max_body_bytes
        too_big = ApiError(
            413, f"request body over the server's limit of {limit:,} bytes", code="body_too_large"
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(self, name: str) -> None:
        """404 for a model this server does not serve."""
        if name != self.options.model_name:
            raise ApiError(
                404, f"model {name!r} not found; this server serves {self.options.model_name!r}",
                "model", "model_not_found",
            )  # fmt: skip

    def too_busy(self, why: str) -> ApiError:
        """A 429 that says why and when to retry."""
        retry = str(self.limits.retry_after_s)
        return ApiError(
            429, f"server busy ({why}); retry after {retry} s", code="rate_limit_exceeded",
            kind="rate_limit_error", headers={"Retry-After": retry},
        )  # fmt: skip

    # -- prompts --

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """The prompt ids of a completions request: one text, ids, or a batch of either."""
        prompt = req.prompt
        batch = (
            [prompt]
            if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
            else prompt
        )
        if not batch:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        if len(batch) > self.limits.max_prompts:
            raise ApiError(
                400,
                f"prompt: at most {self.limits.max_prompts} prompts per request, got {len(batch)}",
                "prompt",
            )
        single = len(batch) == 1
        return [
            self._prompt_ids(p, "prompt" if single else f"prompt[{i}]") for i, p in enumerate(batch)
        ]

    def _prompt_ids(self, prompt: str | list[int], where: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(
                    400, f"{where}: this model has no tokenizer; send token ids", "prompt"
                )
            try:
                ids = encode_user_text(self.tokenizer, prompt, False, where, PROMPT_OPT_IN)
            except KilnError as exc:
                raise ApiError(400, str(exc), "prompt", "special_token_in_prompt") from None
        else:
            ids = list(prompt)
            bad = next(
                (t for t in ids if t < 0 or (self.vocab_size and t >= self.vocab_size)), None
            )
            if bad is not None:
                raise ApiError(
                    400,
                    f"{where}: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})",
                    "prompt",
                )
        if not ids:  # an empty prompt starts a new document, as after an end of text
            if self.eot_id is None:
                raise ApiError(400, f"{where}: must not be empty", "prompt")
            ids = [self.eot_id]
        return ids

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        """The prompt ids of a chat request, rendered by the model's chat template."""
        if self.chat is None:
            raise ApiError(
                400, f"model {self.options.model_name!r} has no chat template (a base model: its "
                "tokenizer lacks the chat tokens <|system|> <|user|> <|assistant|> <|end|>); use "
                "/v1/completions, or serve a chat-tuned model", "messages", "no_chat_template",
            )  # fmt: skip
        try:
            return self.chat.render([(m.role, m.text()) for m in req.messages])
        except ChatMessageError as exc:
            raise ApiError(400, str(exc), exc.param, "special_token_in_prompt") from None

    # -- sampling --

    def sampling(
        self, req: CompletionRequest | ChatRequest, prompts: list[list[int]], asked: int | None,
        default: int, logprobs: int | None, where: str, stop_ids: tuple[int, ...] = (),
    ) -> Any:  # fmt: skip
        """SamplingParams for the request, after the server's limits and the context check."""
        SamplingParams, _ = _engine_types()
        limits, longest = self.limits, max(len(p) for p in prompts)
        if req.n > limits.max_n:
            raise ApiError(400, f"n: at most {limits.max_n} samples per request, got {req.n}", "n")
        if asked is not None and asked > limits.max_tokens:
            name = (
                "max_completion_tokens"
                if isinstance(req, ChatRequest) and req.max_completion_tokens
                else "max_tokens"
            )
            raise ApiError(
                400, f"{name}: at most {limits.max_tokens:,} on this server, got {asked:,}", name
            )
        room = self.context_length - longest
        if longest > self.max_prompt or room < 1:
            raise self._too_long(longest, asked or 1, where)
        if asked is not None and asked > room:
            raise self._too_long(longest, asked, where)
        max_tokens = asked if asked is not None else min(default, room)
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p,
                repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, stop=req.stop_strings(), seed=req.seed,
                n=req.n, logprobs=logprobs, stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
            )  # fmt: skip
        except KilnError as exc:
            raise ApiError(400, str(exc), _param_of(str(exc))) from None

    def _too_long(self, prompt_len: int, new: int, where: str) -> ApiError:
        limit = min(self.max_prompt, self.context_length - 1)
        return ApiError(
            400, f"this model's maximum context length is {self.context_length} tokens (prompts "
            f"up to {limit}); you asked for {prompt_len + new} ({prompt_len} in the {where}, {new} "
            "to generate): shorten the prompt or lower max_tokens", where, "context_length_exceeded",
        )  # fmt: skip

    async def submit(self, prompts: list[list[int]], params: Any) -> list[Any]:
        """Submit every prompt; on a full queue (429) or a refused one (400) none stays queued."""
        _, EngineFull = _engine_types()
        handles: list[Any] = []
        try:
            for ids in prompts:
                handles.append(await asyncio.to_thread(self.engine.submit, ids, params))
        except EngineFull as exc:
            self._cancel_all(handles)
            raise self.too_busy(f"the engine's waiting queue is full: {exc}") from None
        except KilnError as exc:
            self._cancel_all(handles)
            raise ApiError(400, str(exc), _param_of(str(exc))) from None
        except BaseException:
            self._cancel_all(handles)
            raise
        return handles

    @staticmethod
    def _cancel_all(handles: list[Any]) -> None:
        for handle in handles:
            handle.cancel()

    # -- token text --

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and bytes; a token that is part of a UTF-8 character is named as
        OpenAI names one, `bytes:\\xe2\\x80`, so distinct tokens keep distinct names."""
        found = self._pieces.get(token_id)
        if found is None:
            raw = self.tokenizer.id_to_token(token_id) if self.tokenizer is not None else b""
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            found = self._pieces[token_id] = (text, raw)
        return found

    def completion_entry(self, event: Any) -> tuple[str, float | None, dict[str, float]]:
        """(token, logprob, {alternative: logprob}) for the completions logprobs format."""
        top = {self.piece(t)[0]: lp for t, lp in event.top_logprobs or ()}
        return self.piece(event.token_id)[0], event.logprob, top

    def chat_entry(self, event: Any) -> dict[str, Any]:
        """One logprobs.content entry of a chat choice."""
        text, raw = self.piece(event.token_id)
        top = [(*self.piece(t), lp) for t, lp in event.top_logprobs or ()]
        return chat_logprob(text, raw, event.logprob, top)

    # -- one request's life --

    def reserve(self) -> None:
        """Take an in-flight slot: 503 while shutting down, 429 when every slot is taken."""
        if self.state.draining or not self.state.ready:
            raise ApiError(
                503, "the server is shutting down", kind="server_error", code="unavailable"
            )
        if self.state.inflight >= self.limits.max_concurrent:
            raise self.too_busy(f"{self.limits.max_concurrent} requests already in flight")
        self.state.inflight += 1

    async def start(
        self, prompts: list[list[int]], params: Any, n: int, arrived: float
    ) -> Generation:
        """Reserve a slot and submit the prompts; the returned Generation holds the slot."""
        self.reserve()
        try:
            handles = await self.submit(prompts, params)
        except BaseException:
            self.state.inflight -= 1
            raise
        gen = Generation(handles, [len(p) for p in prompts], n, arrived)
        self.state.active.add(gen)
        return gen

    def finish(self, gen: Generation, outcome: str) -> None:
        """Cancel what is left of `gen`, free its slot and count it (once, whoever calls first)."""
        gen.cancel()
        if gen.finished:
            return
        gen.finished = True
        self.state.inflight -= 1
        self.state.active.discard(gen)
        gen.record(self.metrics)
        self.metrics.count_request(outcome)

    def cancel_all(self) -> None:
        """Cancel every running request (shutdown's grace is over): each ends as "cancelled"."""
        for gen in list(self.state.active):
            gen.cancel()

    async def until_disconnect(self, request: Request) -> None:
        """Return when the client goes away (after its body was read)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return


def _param_of(message: str) -> str | None:
    """The request field an engine error names (the first known field name in its message)."""
    from kiln.serve.openai_schema import ChatRequest, CompletionRequest

    SamplingParams, _ = _engine_types()
    known = (
        {f.name for f in fields(SamplingParams)}
        | set(CompletionRequest.model_fields)
        | set(ChatRequest.model_fields)
    )
    return next((w for w in re.findall(r"[a-z_]+", message) if w in known), None)


# ---- responses --------------------------------------------------------------------------------


def finish_reason(completion: Any) -> str:
    """OpenAI's finish reason; an engine error is an error, not a reason."""
    if completion.finish_reason == "error":
        raise ApiError(500, f"generation failed: {completion.error}", kind="server_error")
    return completion.finish_reason


async def _collect(service: Service, request: Request, gen: Generation) -> list[Any] | None:
    """Run a non-streaming request to its end; None if the client went away (it is cancelled)."""

    async def drain() -> None:
        async for _ in gen.events():
            pass

    work = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(service.until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        service.finish(gen, "disconnected")
        return None
    work.result()
    return await gen.results()


class GenerationStream(StreamingResponse):
    """An SSE response that ends its generation however the response ends (even unstarted)."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            body, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )  # fmt: skip
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _streamed(service: Service, gen: Generation, body: AsyncIterator[bytes]) -> GenerationStream:
    """Stream `body`; a client that leaves mid-way cancels `gen` (its blocks are freed)."""
    return GenerationStream(body, lambda: service.finish(gen, "disconnected"))


async def _answer(service: Service, request: Request, gen: Generation) -> list[Any] | None:
    """The finished samples of a non-streaming request (None: the client left)."""
    outcome = "error"
    try:
        done = await _collect(service, request, gen)
        outcome = "ok" if done is not None else "disconnected"
        return done
    finally:
        service.finish(gen, outcome)


CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the access log does


async def completions(service: Service, request: Request) -> Any:
    """POST /v1/completions."""
    arrived = time.monotonic()
    service.authorize(request)
    req = parse_request(CompletionRequest, await service.read_body(request))
    service.check_model(req.model)
    prompts = service.completion_prompts(req)
    params = service.sampling(req, prompts, req.max_tokens, 16, req.logprobs, "prompt")
    gen = await service.start(prompts, params, req.n, arrived)
    want_lp = req.logprobs is not None
    head = envelope(new_id("cmpl"), "text_completion", service.options.model_name)
    if req.stream:
        return _streamed(service, gen, _stream_completion(service, gen, head, req, want_lp))
    done = await _answer(service, request, gen)
    if done is None:
        return Response(status_code=CLIENT_GONE)
    choices = []
    for k, c in enumerate(done):
        lp = None
        if want_lp:
            lp = completion_logprobs([service.completion_entry(e) for e in c.logprobs or ()])
        choices.append(
            {"index": k, "text": c.text, "logprobs": lp, "finish_reason": finish_reason(c)}
        )
    used = usage(sum(gen.prompt_lens), sum(len(c.token_ids) for c in done))
    return {**head, "choices": choices, "usage": used}


async def _stream_completion(
    service: Service, gen: Generation, head: dict[str, Any], req: CompletionRequest, want_lp: bool
) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}
    offsets: dict[int, int] = {}
    outcome = "error"
    try:
        async for k, event in gen.events():
            if not event.text and not want_lp:
                continue
            lp = None
            if want_lp:
                lp = completion_logprobs([service.completion_entry(event)], offsets.get(k, 0))
                offsets[k] = offsets.get(k, 0) + len(lp["tokens"][0])
            choice = {"index": k, "text": event.text, "logprobs": lp, "finish_reason": None}
            yield sse({**head, "choices": [choice], **extra})
        done = await gen.results()
        for k, c in enumerate(done):
            choice = {"index": k, "text": "", "logprobs": None, "finish_reason": finish_reason(c)}
            yield sse({**head, "choices": [choice], **extra})
        if include_usage:
            used = usage(sum(gen.prompt_lens), sum(len(c.token_ids) for c in done))
            yield sse({**head, "choices": [], "usage": used})
        outcome = "ok"
    except ApiError as exc:  # the headers are sent: the error travels as an event
        yield sse(exc.body())
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "disconnected"
        raise
    finally:
        service.finish(gen, outcome)
    yield sse("[DONE]")


async def chat_completions(service: Service, request: Request) -> Any:
    """POST /v1/chat/completions."""
    arrived = time.monotonic()
    service.authorize(request)
    req = parse_request(ChatRequest, await service.read_body(request))
    service.check_model(req.model)
    prompt = service.chat_prompt(req)
    stop_ids = (service.chat.end_id,) if service.chat is not None else ()
    params = service.sampling(
        req, [prompt], req.new_token_limit(), service.limits.max_tokens, req.top_k_logprobs(),
        "messages", stop_ids,
    )  # fmt: skip
    gen = await service.start([prompt], params, req.n, arrived)
    head = envelope(new_id("chatcmpl"), "chat.completion", service.options.model_name)
    if req.stream:
        head["object"] = "chat.completion.chunk"
        return _streamed(service, gen, _stream_chat(service, gen, head, req))
    done = await _answer(service, request, gen)
    if done is None:
        return Response(status_code=CLIENT_GONE)
    choices = []
    for k, c in enumerate(done):
        lp = None
        if req.logprobs:
            lp = {"content": [service.chat_entry(e) for e in c.logprobs or ()], "refusal": None}
        message = {"role": "assistant", "content": c.text, "refusal": None}
        choices.append(
            {"index": k, "message": message, "logprobs": lp, "finish_reason": finish_reason(c)}
        )
    used = usage(len(prompt), sum(len(c.token_ids) for c in done))
    return {**head, "choices": choices, "usage": used}


async def _stream_chat(
    service: Service, gen: Generation, head: dict[str, Any], req: ChatRequest
) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}

    def chunk(k: int, delta: dict[str, Any], lp: Any = None, reason: str | None = None) -> bytes:
        choice = {"index": k, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return sse({**head, "choices": [choice], **extra})

    outcome = "error"
    try:
        for k in range(req.n):
            yield chunk(k, {"role": "assistant", "content": ""})
        async for k, event in gen.events():
            if not event.text and not req.logprobs:
                continue
            lp = {"content": [service.chat_entry(event)], "refusal": None} if req.logprobs else None
            yield chunk(k, {"content": event.text}, lp)
        done = await gen.results()
        for k, c in enumerate(done):
            yield chunk(k, {}, None, finish_reason(c))
        if include_usage:
            used = usage(gen.prompt_lens[0], sum(len(c.token_ids) for c in done))
            yield sse({**head, "choices": [], "usage": used})
        outcome = "ok"
    except ApiError as exc:
        yield sse(exc.body())
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "disconnected"
        raise
    finally:
        service.finish(gen, outcome)
    yield sse("[DONE]")


# ---- the app ----------------------------------------------------------------------------------


def page_html() -> str:
    """The Storyteller page shipped in the package (kiln/serve/web/index.html)."""
    return resources.files("kiln.serve").joinpath("web/index.html").read_text(encoding="utf-8")


def create_app(engine: Any, tokenizer: Any, context_length: int, options: ServerOptions) -> FastAPI:
    """The FastAPI app serving `engine` (started and stopped with the app's lifespan)."""
    service = Service(engine, tokenizer, context_length, options)
    page = page_html()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(engine.start)
        service.state.ready = True
        try:
            yield
        finally:
            service.state.ready = False
            await asyncio.to_thread(engine.stop, True, 10.0)

    app = FastAPI(
        title="kiln serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.service = service
    if options.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware, allow_origins=list(options.cors_origins), allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )  # fmt: skip

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status >= 400 and exc.status != 401:
            service.metrics.count_request(f"http_{exc.status}")
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        return JSONResponse(error.body(), status_code=exc.status_code)

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

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        service.authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict[str, Any]:
        service.authorize(request)
        service.check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def post_completions(request: Request) -> Any:
        return await completions(service, request)

    @app.post("/v1/chat/completions")
    async def post_chat(request: Request) -> Any:
        return await chat_completions(service, request)

    return app


# ---- serving ----------------------------------------------------------------------------------


class _GracefulServer:
    """uvicorn's Server that drains on SIGTERM/SIGINT and exits normally (status 0) after.

    uvicorn re-raises the signal it caught once it has shut down, which would end the process
    with status 143; a service manager reads a clean stop as 0.
    """

    def __init__(self, config: Any, on_stop: Callable[[], None]) -> None:
        import uvicorn

        class Server(uvicorn.Server):
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
                on_stop()
                super().handle_exit(sig, frame)

        self.server = Server(config)


def make_server(app: FastAPI, host: str, port: int, grace_s: float, log_level: str = "info") -> Any:
    """A uvicorn server for `app` that drains on SIGTERM: running requests get `grace_s` seconds
    to finish, then are cancelled (their streams end with finish_reason "cancelled")."""
    import uvicorn

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", server_header=False,
        timeout_graceful_shutdown=grace_s + SHUTDOWN_BACKSTOP_S,
    )  # fmt: skip
    service: Service = app.state.service

    def on_stop() -> None:
        if not service.state.draining:
            service.state.draining = True
            timer = threading.Timer(grace_s, service.cancel_all)
            timer.daemon = True
            timer.start()

    return _GracefulServer(config, on_stop).server


def run_server(
    app: FastAPI, host: str, port: int, grace_s: float, sock: socket.socket | None = None
) -> None:
    """Serve until SIGTERM/SIGINT, then drain: running requests get `grace_s` seconds to end."""
    server = make_server(app, host, port, grace_s)
    server.run(sockets=[sock] if sock is not None else None)
