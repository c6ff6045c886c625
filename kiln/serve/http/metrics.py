"""The server's /metrics in Prometheus' text format: engine gauges, token counters, latencies.

Gauges come from the engine's own stats at scrape time (requests running and waiting, KV blocks
used and free); counters and the two latency histograms (time to first token, time per output
token after the first) are updated by the server as requests finish.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from typing import Any

PREFIX = "kiln"
# Bucket bounds in seconds: first tokens take prefill plus queueing, later ones one step each.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# An image request's seconds: a few denoising steps on a CPU, or a queue of them.
IMAGE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ACCEPTANCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Histogram:
    """A cumulative histogram with fixed bucket bounds, as Prometheus reads one."""

    def __init__(self, name: str, help_text: str, bounds: Sequence[float]) -> None:
        self.name, self.help_text, self.bounds = name, help_text, tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation in the first bucket whose bound is >= value."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        """Observations so far."""
        return sum(self.counts)

    def lines(self) -> list[str]:
        """The histogram's exposition lines (HELP, TYPE, buckets, sum, count)."""
        out = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        out += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {running}"]
        return out


class ServerMetrics:
    """Counters and histograms the server updates; `render` adds the engine's gauges."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}  # finished requests by outcome ("ok", "error", ...)
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Seconds per generated token after the first, per request.",
            TPOT_BUCKETS,
        )
        self.acceptance = Histogram(
            f"{PREFIX}_speculative_acceptance_rate",
            "Per sample: accepted / checked draft tokens (samples that had drafts checked).",
            ACCEPTANCE_BUCKETS,
        )
        self.speculative = False  # the engine has a drafter: its series are shown
        self.images = False  # an image model is served: its series are shown
        self.image_requests: dict[str, int] = {}  # finished image requests by outcome
        self.images_generated = 0
        self.image_queued: Any = lambda: 0  # the picture queue's length, read at scrape time
        self.image_seconds = Histogram(
            f"{PREFIX}_image_request_seconds",
            "Seconds from an image request's arrival to its end (queue and denoising).",
            IMAGE_BUCKETS,
        )

    def count_request(self, outcome: str) -> None:
        """Count one finished (or refused) request under `outcome`."""
        with self._lock:
            self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def count_image(self, outcome: str, pictures: int = 0, seconds: float | None = None) -> None:
        """Count one finished (or refused) image request: its outcome, pictures and seconds."""
        with self._lock:
            self.image_requests[outcome] = self.image_requests.get(outcome, 0) + 1
            self.images_generated += pictures
            if seconds is not None:
                self.image_seconds.observe(max(seconds, 0.0))

    def record(
        self,
        prompt_tokens: int,
        new_tokens: int,
        ttft: float | None,
        decode_s: float | None,
        longest: int,
    ) -> None:
        """Add one finished request: token counts, time to first token, decode time.

        `longest` is the most tokens one of its samples got: samples decode side by side, so
        the time per output token is the decode time over that sample's tokens after its first.
        """
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += new_tokens
            if ttft is not None:
                self.ttft.observe(max(ttft, 0.0))
            if decode_s is not None and longest > 1:
                self.tpot.observe(max(decode_s, 0.0) / (longest - 1))

    def observe_acceptance(self, drafted: int, accepted: int) -> None:
        """Add one finished sample's draft acceptance (nothing when no draft was checked)."""
        if drafted:
            with self._lock:
                self.acceptance.observe(accepted / drafted)

    def render(self, stats: Any) -> str:
        """The whole exposition text: engine gauges from `stats`, then the server's own series."""
        gauges = [
            ("requests_running", "Requests the engine is generating for.", "running"),
            ("requests_waiting", "Requests queued for the engine.", "waiting"),
            ("kv_blocks_used", "KV-cache blocks held by running sequences.", "blocks_held"),
            ("kv_blocks_cached", "KV-cache blocks the prefix cache keeps that no sequence holds "
             "(reusable: handed out when no block is free).", "blocks_cached"),
            ("kv_blocks_free", "KV-cache blocks holding nothing.", "blocks_free"),
            ("kv_blocks_total", "KV-cache blocks in the pool (used + cached + free).",
             "blocks_total"),
        ]  # fmt: skip
        values = {name: getattr(stats, name, None) for _, _, name in gauges}
        if values["blocks_held"] is None and getattr(stats, "blocks_used", None) is not None:
            # The engine's blocks_used counts the prefix cache's idle blocks as used.
            values["blocks_held"] = stats.blocks_used - (values["blocks_cached"] or 0)
        out: list[str] = []
        for name, help_text, attr in gauges:
            if values[attr] is not None:
                out += _series(f"{PREFIX}_{name}", "gauge", help_text, [("", values[attr])])
        if self.speculative:
            for name, help_text, attr in (
                ("speculative_draft_tokens_total", "Draft tokens the target checked.",
                 "draft_tokens"),
                ("speculative_accepted_tokens_total", "Draft tokens the target accepted.",
                 "accepted_tokens"),
                ("speculative_steps_total", "Engine steps that checked drafts.",
                 "speculative_steps"),
            ):  # fmt: skip
                out += _series(f"{PREFIX}_{name}", "counter", help_text,
                               [("", getattr(stats, attr, 0))])  # fmt: skip
        with self._lock:
            by_outcome = [(f'{{outcome="{k}"}}', v) for k, v in sorted(self.requests.items())]
            out += _series(
                f"{PREFIX}_requests_total", "counter", "HTTP generation requests by outcome.",
                by_outcome or [('{outcome="ok"}', 0)],
            )  # fmt: skip
            out += _series(
                f"{PREFIX}_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                [("", self.prompt_tokens)],
            )  # fmt: skip
            out += _series(
                f"{PREFIX}_generation_tokens_total", "counter",
                "Tokens generated for finished requests.", [("", self.generated_tokens)],
            )  # fmt: skip
            out += self.ttft.lines() + self.tpot.lines()
            if self.speculative:
                out += self.acceptance.lines()
            if self.images:
                out += self._image_lines()
        return "\n".join(out) + "\n"

    def _image_lines(self) -> list[str]:
        """The image endpoint's series (the caller holds the lock)."""
        by_outcome = [(f'{{outcome="{k}"}}', v) for k, v in sorted(self.image_requests.items())]
        out = _series(
            f"{PREFIX}_image_requests_total", "counter", "Image requests by outcome.",
            by_outcome or [('{outcome="ok"}', 0)],
        )  # fmt: skip
        out += _series(f"{PREFIX}_images_generated_total", "counter",
                       "Pictures drawn for finished image requests.",
                       [("", self.images_generated)])  # fmt: skip
        out += _series(f"{PREFIX}_image_requests_queued", "gauge",
                       "Image requests waiting for the picture thread or being drawn.",
                       [("", self.image_queued())])  # fmt: skip
        return out + self.image_seconds.lines()


def _series(name: str, kind: str, help_text: str, values: list[tuple[str, Any]]) -> list[str]:
    """HELP and TYPE lines, then one sample line per (labels, value)."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"] + [
        f"{name}{labels} {value}" for labels, value in values
    ]
