"""GET /debug/memory: what grew in the server's Python heap between two calls (a leak hunt).

Off unless the server starts with KILN_SERVE_TRACEMALLOC=FRAMES in its environment (FRAMES: how
many stack frames each allocation site keeps, 1 to 64); without it the path is a 404 like any
unknown one. With it, tracemalloc traces every allocation from the app's creation on (the
server runs slower, so don't read speed from such a run) and each call answers, as JSON, the
traced total and the process's RSS, the allocation sites that grew most since the previous call
(the first call: since the app was created), the object types whose live count grew most after a
full garbage collection, and the asyncio tasks not yet done. The API key, when the server has
one, is required. bench/serve_load.py --tracemalloc calls it after the warm-up and at the end.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import tracemalloc
from collections import Counter
from typing import Any

from kiln.errors import KilnError

ENV = "KILN_SERVE_TRACEMALLOC"
MAX_FRAMES = 64
TOP = 12  # sites and types listed per call


def frames_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """The frames per site KILN_SERVE_TRACEMALLOC asks for, None when unset or empty."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_FRAMES:
        raise KilnError(f"{ENV}={raw!r}: expected a number of stack frames, 1 to {MAX_FRAMES}")
    return int(raw)


def _snapshot() -> tracemalloc.Snapshot:
    """The traced allocations, less the probe's own (its snapshots and counts would otherwise
    top every report)."""
    mine = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
    return tracemalloc.take_snapshot().filter_traces(mine)


def _type_counts() -> Counter[str]:
    gc.collect()
    # type() rather than isinstance: no __class__ lookups on lazy module proxies.
    return Counter(type(o).__qualname__ for o in gc.get_objects())


class MemoryProbe:
    """tracemalloc from creation on; `report` gives what grew since the previous report."""

    def __init__(self, frames: int) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(frames)
        self._lock = threading.Lock()
        self._snapshot = _snapshot()
        self._types = _type_counts()

    def report(self) -> dict[str, Any]:
        """Traced bytes, RSS, and the sites, types and tasks that grew since the last call."""
        with self._lock:
            snapshot, types = _snapshot(), _type_counts()
            sites = snapshot.compare_to(self._snapshot, "traceback")
            grown = sorted(((n - self._types[t], t) for t, n in types.items()), reverse=True)
            self._snapshot, self._types = snapshot, types
        current, peak = tracemalloc.get_traced_memory()
        return {
            "traced_mib": current / 2**20,
            "peak_traced_mib": peak / 2**20,
            "rss_mib": _rss_mib(),
            "sites": [
                {
                    "size_kib": s.size_diff / 1024,
                    "count": s.count_diff,
                    "traceback": [f"{f.filename}:{f.lineno}" for f in s.traceback],
                }
                for s in sites[:TOP]
                if s.size_diff > 0
            ],
            "types": [{"type": t, "count": d} for d, t in grown[:TOP] if d > 0],
            "tasks": sum(1 for o in gc.get_objects() if type(o) is asyncio.Task and not o.done()),
        }


def _rss_mib() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().memory_info().rss / 2**20
