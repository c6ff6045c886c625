"""OpenAI's wire format: request bodies (validated, strict), errors, responses and stream chunks.

Requests are parsed strictly (a string where a number belongs is an error, not a guess) and an
invalid one becomes a 400 whose `param` names the field, as OpenAI's own API answers. Fields
kiln cannot honour (echo, suffix, logit_bias, tools ...) are refused by name rather than
silently ignored; fields that change nothing here (user, service_tier ...) are accepted.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
# OpenAI's bodies nest a handful of levels; a deep one would exhaust the JSON decoder's stack.
MAX_JSON_DEPTH = 64
# pydantic names a union's arm in an error's location ("str", "list[int]", "function-after[…]");
# they are types, not fields.
UNION_ARMS = frozenset({"str", "int", "float", "bool", "none", "bytes", "dict", "list"})
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_JSON_BRACKETS = re.compile(rb"[\[\]{}]")
RequestT = TypeVar("RequestT", bound="_Request")


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with `status` (and optional headers)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, headers or {}

    def body(self) -> dict[str, Any]:
        """{"error": {message, type, param, code}} as OpenAI sends it."""
        return {
            "error": {
                "message": self.message, "type": self.kind, "param": self.param, "code": self.code,
            }
        }  # fmt: skip


# ---- requests ---------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions many OpenAI-compatible servers take (vLLM's names).
    top_k: int | None = Field(None, ge=1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("a stop string must not be empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings as a tuple (none, one or a list in the body)."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def refuse_unsupported(self) -> None:
        """Refuse, by field name, options that would change the answer but that kiln ignores."""
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported by kiln serve", "logit_bias")


class CompletionRequest(_Request):
    """POST /v1/completions: a prompt as text or token ids (or a batch of either)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def refuse_unsupported(self) -> None:
        """Echo, suffix and best_of > n are not offered (see the base class)."""
        super().refuse_unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported by kiln serve", "echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported by kiln serve", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "best_of other than n is not supported by kiln serve", "best_of")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The message's text (the text parts joined, when sent as parts)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Request):
    """POST /v1/chat/completions: messages rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        """Tools, JSON modes and top_logprobs without logprobs are refused by name."""
        super().refuse_unsupported()
        if self.tools:
            raise ApiError(400, "tools are not supported by kiln serve", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ApiError(400, "only response_format type 'text' is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", "top_logprobs")

    def new_token_limit(self) -> int | None:
        """max_completion_tokens, or the older max_tokens (both given: the newer wins)."""
        return self.max_completion_tokens or self.max_tokens

    def top_k_logprobs(self) -> int | None:
        """How many alternatives per token the engine reports (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


def json_depth_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text nests arrays/objects deeper than `limit` (strings don't count)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # too few brackets to nest that deep: the common case costs two counts
    depth = 0
    for match in _JSON_BRACKETS.finditer(_JSON_STRING.sub(b'""', raw)):
        depth += 1 if match.group() in (b"[", b"{") else -1
        if depth > limit:
            return True
    return False


def parse_request(cls: type[RequestT], raw: bytes) -> RequestT:
    """The request body as `cls`; invalid JSON or fields become a 400 naming the field."""
    if json_depth_exceeds(raw):
        raise ApiError(
            400, f"the request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels",
            "body", "body_too_deep",
        )  # fmt: skip
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = field_path(first["loc"])
        raise ApiError(400, f"{param}: {first['msg']}", param) from None
    request.refuse_unsupported()
    return request


def field_path(loc: Sequence[int | str]) -> str:
    """pydantic's error location as a field path: messages[0].content (union arms dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part[:1].islower() and part not in UNION_ARMS and "[" not in part:
            out += f".{part}" if out else part
    return out or "body"


# ---- responses --------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    """A fresh response id: cmpl-…, chatcmpl-…"""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(
    prompt_tokens: int, completion_tokens: int, speculative: tuple[int, int] | None = None
) -> dict[str, Any]:
    """The usage object: prompt, completion and total tokens (+ kiln's speculative extension).

    `speculative` is (draft tokens checked, accepted) over the request's samples, given when the
    engine has a drafter; it appears as usage.speculative (not an OpenAI field).
    """
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if speculative is not None:
        drafted, accepted = speculative
        out["speculative"] = {
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
        }  # fmt: skip
    return out


def envelope(rid: str, kind: str, model: str, created: int | None = None) -> dict[str, Any]:
    """The fields every response and chunk starts with."""
    return {
        "id": rid, "object": kind, "created": created or int(time.time()), "model": model,
        "system_fingerprint": None,
    }  # fmt: skip


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event line pair: `data: …` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def completion_logprobs(entries: list[tuple[str, float | None, dict[str, float] | None]],
                        start_offset: int = 0) -> dict[str, Any]:  # fmt: skip
    """The legacy completions logprobs object from (token, logprob, {alternative: logprob})."""
    offsets, at = [], start_offset
    for token, _, _ in entries:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": [t for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [top for _, _, top in entries],
        "text_offset": offsets,
    }


def chat_logprob(token: str, raw: bytes, logprob: float | None,
                 top: list[tuple[str, bytes, float]]) -> dict[str, Any]:  # fmt: skip
    """One entry of a chat choice's logprobs.content."""
    return {
        "token": token, "logprob": logprob, "bytes": list(raw),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in top],
    }  # fmt: skip
