"""Hooks the crash-injection tests use to kill or pause a process at a named point.

Without their environment variables (KILN_TEST_KILL_AT, KILN_TEST_WAIT_AT) they do nothing.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_kill_point_hits: dict[str, int] = {}


def kill_point(name: str) -> None:
    """SIGKILL this process at its n-th pass here when KILN_TEST_KILL_AT is `name` or `name@n`.

    The crash-injection tests' hook; without that variable it does nothing.
    """
    point, _, nth = os.environ.get("KILN_TEST_KILL_AT", "").partition("@")
    if point != name:
        return
    _kill_point_hits[name] = _kill_point_hits.get(name, 0) + 1
    if _kill_point_hits[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def wait_point(name: str) -> None:
    """Pause here when KILN_TEST_WAIT_AT is `name`: write `<pid>.ready` into $KILN_TEST_WAIT_DIR
    and wait until a file `go` appears there.

    The tests' hook for catching a run at a known moment (without racing it); without that
    variable it does nothing.
    """
    if os.environ.get("KILN_TEST_WAIT_AT") != name:
        return
    folder = Path(os.environ["KILN_TEST_WAIT_DIR"])
    (folder / f"{os.getpid()}.ready").touch()
    while not (folder / "go").exists():
        time.sleep(0.05)
