"""Stopping a run cleanly: SIGINT/SIGTERM ask for a stop after the current step, agreed by all ranks.

The loop asks `agreed()` before every step: every rank must stop at the same step, or the
others hang in their next collective. A second SIGINT stops at once (KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch

from kiln.train import distributed
from kiln.train.distributed import DistInfo


class StopRequest:
    """The signal that asked this process to stop (None: none yet)."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def ask(self, signum: int = signal.SIGINT) -> None:
        """Stop after the current step (what SIGINT and SIGTERM do)."""
        self.signal = signum

    def agreed(self, dist: DistInfo, device: torch.device) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it each step)."""
        asked = distributed.any_rank(self.signal is not None, dist, device)
        if asked and self.signal is None:
            self.signal = signal.SIGTERM  # another rank's signal (torchrun forwards TERM)
        return asked

    @contextlib.contextmanager
    def caught(self) -> Iterator[None]:
        """SIGINT/SIGTERM ask for a stop while inside; a second SIGINT stops at once."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be installed from the main thread
            return

        def handler(signum: int, frame: Any) -> None:
            if self.signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.ask(signum)

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
