"""One HTTP request's generation: its engine handles (one per prompt), events merged across
them in OpenAI's choice order, its timing for the metrics, and its cancellation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from kiln.serve.http.metrics import ServerMetrics


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
        for handle in self.handles:
            for completion in handle.completions():
                metrics.observe_acceptance(completion.drafted, completion.accepted)
