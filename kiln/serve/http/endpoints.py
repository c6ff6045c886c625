"""The two generation endpoints, /v1/completions and /v1/chat/completions: a checked request
becomes a Generation, answered whole or streamed as server-sent events ending with [DONE]; a
client that goes away (a closed stream, a timed-out request) cancels it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kiln.serve.http.generation import Generation
from kiln.serve.http.openai_schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    RequestT,
    completion_logprobs,
    envelope,
    new_id,
    parse_request,
    sse,
    usage,
)
from kiln.serve.http.service import CLIENT_GONE, Service


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


def _streamed(service: Service, gen: Generation, chunks: AsyncIterator[bytes]) -> GenerationStream:
    """Stream `chunks`, then [DONE]; a client that leaves mid-way cancels `gen` (its blocks are
    freed); an error after the headers are sent travels as an error event."""

    async def body() -> AsyncIterator[bytes]:
        outcome = "error"
        try:
            async for chunk in chunks:
                yield chunk
            outcome = "ok"
        except ApiError as exc:
            yield sse(exc.body())
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "disconnected"
            raise
        finally:
            service.finish(gen, outcome)
        yield sse("[DONE]")

    return GenerationStream(body(), lambda: service.finish(gen, "disconnected"))


async def _answer(service: Service, request: Request, gen: Generation) -> list[Any] | None:
    """The finished samples of a non-streaming request (None: the client left)."""
    outcome = "error"
    try:
        done = await _collect(service, request, gen)
        outcome = "ok" if done is not None else "disconnected"
        return done
    finally:
        service.finish(gen, outcome)


async def _parse(service: Service, request: Request, cls: type[RequestT]) -> tuple[RequestT, float]:
    """The checked request body (key, size, fields, model) and when it arrived."""
    arrived = time.monotonic()
    service.authorize(request)
    req = parse_request(cls, await service.read_body(request))
    service.check_model(req.model)
    return req, arrived


async def _respond(
    service: Service, request: Request, gen: Generation, head: dict[str, Any], stream: bool,
    chunks: Callable[[], AsyncIterator[bytes]], choice: Callable[[int, Any], dict[str, Any]],
) -> Any:  # fmt: skip
    """Stream `chunks()`, or answer whole with `choice(k, completion)` per finished sample."""
    if stream:
        return _streamed(service, gen, chunks())
    done = await _answer(service, request, gen)
    if done is None:
        return Response(status_code=CLIENT_GONE)
    used = _usage(service, gen, done)
    return {**head, "choices": [choice(k, c) for k, c in enumerate(done)], "usage": used}


async def completions(service: Service, request: Request) -> Any:
    """POST /v1/completions."""
    req, arrived = await _parse(service, request, CompletionRequest)
    prompts = service.completion_prompts(req)
    params = service.sampling(req, prompts, req.max_tokens, 16, req.logprobs, "prompt")
    gen = await service.start(prompts, params, req.n, arrived)
    want_lp = req.logprobs is not None
    head = envelope(new_id("cmpl"), "text_completion", service.options.model_name)

    def choice(k: int, c: Any) -> dict[str, Any]:
        lp = None
        if want_lp:
            lp = completion_logprobs([service.completion_entry(e) for e in c.logprobs or ()])
        return {"index": k, "text": c.text, "logprobs": lp, "finish_reason": finish_reason(c)}

    chunks = partial(_stream_completion, service, gen, head, req, want_lp)
    return await _respond(service, request, gen, head, req.stream, chunks, choice)


def _wants_usage(req: CompletionRequest | ChatRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _usage(service: Service, gen: Generation, done: list[Any]) -> dict[str, Any]:
    """The request's usage; with a drafter, its draft tokens checked and accepted too."""
    spec = None
    if getattr(service.engine, "drafter", None) is not None:
        spec = (sum(c.drafted for c in done), sum(c.accepted for c in done))
    return usage(sum(gen.prompt_lens), sum(len(c.token_ids) for c in done), spec)


def _usage_chunk(service: Service, head: dict[str, Any], gen: Generation, done: list[Any]) -> bytes:
    """The last chunk under stream_options.include_usage: no choices, the usage."""
    return sse({**head, "choices": [], "usage": _usage(service, gen, done)})


def held_tail(text: str, sent: str) -> str:
    """The end of a finished sample's text that no token event carried (held back for a stop
    string or an unfinished character when a stop token ended the sample)."""
    return text[len(sent) :] if text.startswith(sent) else ""


async def _stream_completion(
    service: Service, gen: Generation, head: dict[str, Any], req: CompletionRequest, want_lp: bool
) -> AsyncIterator[bytes]:
    extra = {"usage": None} if _wants_usage(req) else {}
    offsets: dict[int, int] = {}
    sent: dict[int, str] = {}
    async for k, event in gen.events():
        sent[k] = sent.get(k, "") + event.text
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
        tail = held_tail(c.text, sent.get(k, ""))
        choice = {"index": k, "text": tail, "logprobs": None, "finish_reason": finish_reason(c)}
        yield sse({**head, "choices": [choice], **extra})
    if _wants_usage(req):
        yield _usage_chunk(service, head, gen, done)


async def chat_completions(service: Service, request: Request) -> Any:
    """POST /v1/chat/completions."""
    req, arrived = await _parse(service, request, ChatRequest)
    prompt = service.chat_prompt(req)
    stop_ids = (service.chat.end_id,) if service.chat is not None else ()
    params = service.sampling(
        req, [prompt], req.new_token_limit(), service.limits.max_tokens, req.top_k_logprobs(),
        "messages", stop_ids,
    )  # fmt: skip
    gen = await service.start([prompt], params, req.n, arrived)
    kind = "chat.completion.chunk" if req.stream else "chat.completion"
    head = envelope(new_id("chatcmpl"), kind, service.options.model_name)

    def choice(k: int, c: Any) -> dict[str, Any]:
        lp = None
        if req.logprobs:
            lp = {"content": [service.chat_entry(e) for e in c.logprobs or ()], "refusal": None}
        message = {"role": "assistant", "content": c.text, "refusal": None}
        return {"index": k, "message": message, "logprobs": lp, "finish_reason": finish_reason(c)}

    chunks = partial(_stream_chat, service, gen, head, req)
    return await _respond(service, request, gen, head, req.stream, chunks, choice)


async def _stream_chat(
    service: Service, gen: Generation, head: dict[str, Any], req: ChatRequest
) -> AsyncIterator[bytes]:
    extra = {"usage": None} if _wants_usage(req) else {}

    def chunk(k: int, delta: dict[str, Any], lp: Any = None, reason: str | None = None) -> bytes:
        choice = {"index": k, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return sse({**head, "choices": [choice], **extra})

    for k in range(req.n):
        yield chunk(k, {"role": "assistant", "content": ""})
    sent: dict[int, str] = {}
    async for k, event in gen.events():
        sent[k] = sent.get(k, "") + event.text
        if not event.text and not req.logprobs:
            continue
        lp = {"content": [service.chat_entry(event)], "refusal": None} if req.logprobs else None
        yield chunk(k, {"content": event.text}, lp)
    done = await gen.results()
    for k, c in enumerate(done):
        tail = held_tail(c.text, sent.get(k, ""))
        yield chunk(k, {"content": tail} if tail else {}, None, finish_reason(c))
    if _wants_usage(req):
        yield _usage_chunk(service, head, gen, done)
