"""What a caller holds of a request: its handle (stream, cancel, wait), token events, results.

The engine pushes events and completions into the handle from its stepping thread; the caller
reads them from any thread (blocking iteration) or from asyncio (`events()`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.serve.engine import Engine


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one sample, with the text it releases."""

    index: int  # which of the n samples (0..n-1)
    token_id: int
    text: str  # "" while a possible stop string or an incomplete UTF-8 sequence is held back
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None  # best first, when params.logprobs


@dataclass
class Completion:
    """One finished sample."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    logprobs: list[TokenEvent] | None
    error: str | None = None
    drafted: int = 0  # draft tokens the target checked for this sample (speculative engine)
    accepted: int = 0  # of those, kept

    @property
    def acceptance_rate(self) -> float | None:
        """Kept drafts / checked drafts; None when no draft was checked."""
        return self.accepted / self.drafted if self.drafted else None


_ids = itertools.count()


class RequestHandle:
    """A submitted request: iterate its tokens as they come, cancel it, or wait for the result."""

    def __init__(self, engine: Engine, prompt_ids: list[int], n: int) -> None:
        self.request_id = f"req-{next(_ids)}"
        self.prompt_ids = prompt_ids
        self.engine = engine
        self.n = n
        self.done = False
        self.submit_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self._events: deque[TokenEvent] = deque()
        self._completions: dict[int, Completion] = {}
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # ------------------------------------------------------------------------ engine side
    def _push(self, event: TokenEvent) -> None:
        with self._cond:
            if self.first_token_time is None:
                self.first_token_time = time.monotonic()
            self._events.append(event)
        self._notify()

    def _finish(self, completion: Completion) -> None:
        with self._cond:
            self._completions[completion.index] = completion
            if len(self._completions) == self.n:
                self.finish_time = time.monotonic()
                self.done = True
        self._notify()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    # ------------------------------------------------------------------------ caller side
    def _next(self, timeout: float | None) -> TokenEvent | None:
        """The next event, driving the engine when no background loop does; None at the end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if self._events:
                    return self._events.popleft()
                if self.done:
                    return None
                if self.engine.background:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"{self.request_id} did not finish in time")
                    self._cond.wait(0.05 if left is None else min(left, 0.05))
                    continue
            self.engine.step()

    def __iter__(self) -> Iterator[TokenEvent]:
        """Token events of all n samples as they are produced (blocking)."""
        while (event := self._next(None)) is not None:
            yield event

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Token events for asyncio code (steps the engine in a worker thread if nothing does)."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        with self._cond:
            self._waiters.append((loop, wake))
        try:
            while True:
                with self._cond:
                    event = self._events.popleft() if self._events else None
                    finished = self.done and event is None
                    wake.clear()
                if event is not None:
                    yield event
                elif finished:
                    return
                elif self.engine.background:
                    await wake.wait()
                else:
                    await loop.run_in_executor(None, self.engine.step)
        finally:
            with self._cond:
                self._waiters.remove((loop, wake))

    def cancel(self) -> None:
        """Stop generating; the request's KV blocks are freed at the next step at the latest."""
        self.engine._cancel(self)

    def completions(self) -> list[Completion]:
        """The samples finished so far, sample index order (without waiting)."""
        with self._cond:
            return [self._completions[i] for i in sorted(self._completions)]

    def result(self, timeout: float | None = None) -> list[Completion]:
        """The n completions, sample index order, once all are finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"{self.request_id} did not finish in time")
            if self.engine.background:
                with self._cond:
                    self._cond.wait(0.05 if left is None else min(left, 0.05))
            else:
                self.engine.step()
        return [self._completions[i] for i in range(self.n)]
