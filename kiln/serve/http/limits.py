"""The server's limits and who may call it: safe defaults, the loopback rule, the key check.

Every limit has a default a laptop survives (a 1 MiB body, 8 samples, 64 requests at once); the
command line raises them. Off loopback the server refuses to start without an API key, and a
key is compared in constant time so its bytes cannot be guessed from response times.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from kiln.config import require
from kiln.errors import KilnError

LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True)
class ServerLimits:
    """What one request (and all of them together) may ask of the server."""

    max_body_bytes: int = 1 << 20  # a request body over this is refused with 413
    max_prompt_tokens: int | None = None  # None: the model's context (less one new token)
    max_tokens: int = 1024  # the most new tokens a request may ask for
    max_n: int = 8  # samples per prompt
    max_prompts: int = 8  # prompts in one /v1/completions batch
    max_concurrent: int = 64  # generation requests in flight; more are refused with 429
    max_waiting: int = 64  # the engine's waiting queue; a full queue answers 429
    retry_after_s: int = 1  # the Retry-After a 429 carries

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tokens", "max_n", "max_prompts", "max_concurrent"):
            _at_least(name, getattr(self, name), 1)
        _at_least("max_waiting", self.max_waiting, 1)
        if self.max_prompt_tokens is not None:
            _at_least("max_prompt_tokens", self.max_prompt_tokens, 1)


def _at_least(name: str, value: int, low: int) -> None:
    """One limit's check; the message names the limit and its command-line flag."""
    flag = "--" + name.replace("_", "-")
    require(value >= low, f"serve limit {name} ({flag}): must be at least {low}, got {value}")


def is_loopback(host: str) -> bool:
    """True when `host` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def check_exposure(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without an API key (one clear line saying how)."""
    if not is_loopback(host) and not api_key:
        raise KilnError(
            f"--host {host}: serving beyond this machine needs an API key; pass --api-key KEY or "
            "set KILN_API_KEY (or bind 127.0.0.1, the default)"
        )


def key_matches(header: str | None, api_key: str) -> bool:
    """True when an Authorization header carries `Bearer <api_key>`, compared in constant time."""
    if not header:
        return False
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode("utf-8"), api_key.encode("utf-8"))
