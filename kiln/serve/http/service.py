"""The API's logic over one engine: who may call (the key), what a request may ask (the
limits), prompts from text, ids or chat messages, SamplingParams from OpenAI's fields,
submission (429 when the engine's queue is full), and the bookkeeping of requests in flight.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field, fields
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from kiln.chat.api_messages import ChatMessageError, ServerChat
from kiln.errors import KilnError
from kiln.serve.http.generation import Generation
from kiln.serve.http.limits import ServerLimits, key_matches
from kiln.serve.http.metrics import ServerMetrics
from kiln.serve.http.openai_schema import ApiError, ChatRequest, CompletionRequest, chat_logprob
from kiln.tokenizer.user_text import check_user_text, encode_user_text

PROMPT_OPT_IN = "send the prompt as token ids"
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the access log does


class ClientGone(ApiError):
    """The client went away before its request was read whole: counted, not logged."""

    def __init__(self) -> None:
        super().__init__(CLIENT_GONE, "the client disconnected while sending its request")


@dataclass(frozen=True)
class ServerOptions:
    """Who the server is and whom it serves: its model names, limits, key and CORS origins."""

    model_name: str
    limits: ServerLimits = field(default_factory=ServerLimits)
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    image_model_name: str | None = None  # the id clients name for the image model, if any


@dataclass
class ServerState:
    """What the running app knows: ready to serve, draining for shutdown, requests in flight."""

    ready: bool = False
    draining: bool = False
    inflight: int = 0
    # Requests now generating: text Generations and image jobs (each has cancel()).
    active: set[Any] = field(default_factory=set)
    drain_task: Any = None  # the shutdown drain (kept referenced so it is not collected)


def _engine_types() -> tuple[Any, Any]:
    """SamplingParams and EngineFull (imported late: the engine module imports torch)."""
    from kiln.serve.engine import EngineFull, SamplingParams

    return SamplingParams, EngineFull


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
        self.metrics.speculative = getattr(engine, "drafter", None) is not None
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
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone() from None
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
        for i, m in enumerate(req.messages):
            # The template does not render names; control-token text there is refused all the
            # same, as in content, so a client never learns that only some fields are checked.
            if m.name is not None:
                self._refuse_special(m.name, f"messages[{i}].name")
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
        stops = req.stop_strings()
        for i, stop in enumerate(stops):
            # A control token ends a sample by its id, never as text: such a stop would not match.
            self._refuse_special(stop, "stop" if isinstance(req.stop, str) else f"stop[{i}]")
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p,
                repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, stop=stops, seed=req.seed,
                n=req.n, logprobs=logprobs, stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
            )  # fmt: skip
        except KilnError as exc:
            raise ApiError(400, str(exc), _param_of(str(exc))) from None

    def _refuse_special(self, text: str, where: str) -> None:
        """400 naming `where` when `text` spells one of the tokenizer's special tokens."""
        if self.tokenizer is None:
            return
        try:
            check_user_text(self.tokenizer, text, where, None)
        except KilnError as exc:
            param = where.split("[")[0] if where.startswith("stop") else where
            raise ApiError(400, str(exc), param, "special_token_in_prompt") from None

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
    from kiln.serve.http.openai_schema import ChatRequest, CompletionRequest

    SamplingParams, _ = _engine_types()
    known = (
        {f.name for f in fields(SamplingParams)}
        | set(CompletionRequest.model_fields)
        | set(ChatRequest.model_fields)
    )
    return next((w for w in re.findall(r"[a-z_]+", message) if w in known), None)
