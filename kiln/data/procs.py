"""Worker processes that never outlive their parent, and SIGTERM as a clean interrupt.

A process pool's workers are the parent's children only by convention: SIGKILL the parent and
they are re-parented to init and keep running (each holding its memory); SIGTERM it and they are
not even told. Every pool in `kiln data` starts its workers with `worker_init`, which has the
kernel kill a worker when its parent dies (Linux; a watchdog thread elsewhere), and stops its
pools with `stop_pool` when interrupted, instead of waiting for the running tasks.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from types import FrameType

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def worker_init(parent_pid: int) -> None:
    """Initializer of a pool worker: die with the parent; leave Ctrl-C and SIGTERM to it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the pool on Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler, inherited by fork
    if not _set_parent_death_signal():
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)


def _set_parent_death_signal() -> bool:
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and kill the workers now (shutdown alone waits for them)."""
    # The executor has no public handle on its processes (before Python 3.14's terminate_workers).
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        with contextlib.suppress(OSError, ValueError):
            process.kill()
    for process in processes:
        with contextlib.suppress(OSError, ValueError, AssertionError):
            process.join(timeout=10)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt, so cleanup runs as for Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM wait: they take effect (as usual) when it ends.

    For a few renames that must not be cut in two. The handlers are swapped rather than the
    signals masked, because a mask is per thread and any other thread (a progress bar's monitor)
    would still take the signal and have the main thread act on it mid-block.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if handler is not None:  # None: set outside Python, which could not be restored
            previous[signum] = signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)
