"""The machine and load a bench record was measured under, and the refusal to record on a busy one.

Every script in bench/ that prints or writes a record calls `begin` before it measures: it reads
the load average and the time, and exits with one line when the 1-minute load is above
MAX_START_LOAD (other jobs share the cores, so the numbers would be theirs as much as ours)
unless `--noisy` was given; then the record is kept but marked noisy, with its load. The
`Measurement` it returns stamps every record: `stamp(doc)` for JSON and log entries, `line()`
for the markdown line printed with a table.

    from bench._load import add_noisy_flag, begin
    add_noisy_flag(parser)
    args = parser.parse_args()
    measured = begin("bench/x.py", args.noisy)
    ...
    print(measured.line())
    write_json_atomic(path, measured.stamp(doc))
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_START_LOAD = 1.5
# The CPU features kiln's kernels and torch's CPU paths pick between.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
CPUINFO = Path("/proc/cpuinfo")

Load = tuple[float, float, float]


def add_noisy_flag(parser: argparse.ArgumentParser) -> None:
    """Add --noisy: record even on a busy machine, the record marked noisy with its load."""
    parser.add_argument(
        "--noisy",
        action="store_true",
        help=f"record even when the 1-minute load at start is above {MAX_START_LOAD} "
        "(the record is marked noisy, with the load)",
    )


def cpu_info(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """CPU model, core count and the kernel-relevant flags this CPU has (from /proc/cpuinfo)."""
    model, flags = "", set()
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "cpu_flags": [f for f in KERNEL_FLAGS if f in flags],
    }


def torch_threads() -> int | None:
    """torch's intra-op threads if the script uses torch (it is imported), else None."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclasses.dataclass
class Measurement:
    """When a record was measured, under what load, on which CPU; stamps records with it."""

    script: str
    noisy: bool
    load_start: Load
    started: float
    getloadavg: Callable[[], Load] = os.getloadavg
    clock: Callable[[], float] = time.time
    cpuinfo: Path = CPUINFO
    load_end: Load | None = None
    ended: float | None = None

    def finish(self) -> None:
        """Read the load and time at the end (again on each call: the last record's end)."""
        self.load_end = tuple(self.getloadavg())  # type: ignore[assignment]
        self.ended = self.clock()

    def record(self) -> dict[str, Any]:
        """The measurement as a JSON-able dict (finishes it first)."""
        self.finish()
        assert self.load_end is not None and self.ended is not None
        out: dict[str, Any] = {
            "script": self.script,
            "noisy": self.noisy,
            "started": _utc(self.started),
            "ended": _utc(self.ended),
            "loadavg_start": [round(x, 2) for x in self.load_start],
            "loadavg_end": [round(x, 2) for x in self.load_end],
            **cpu_info(self.cpuinfo),
            "torch_threads": torch_threads(),
        }
        if self.noisy:
            out["noisy_reason"] = (
                f"1-minute load {self.load_start[0]:.2f} at start > {MAX_START_LOAD}, kept by --noisy"
            )
        return out

    def stamp(self, doc: dict[str, Any]) -> dict[str, Any]:
        """`doc` with this measurement under "measured" (and "noisy": true when it is)."""
        rec = self.record()
        return {**doc, **({"noisy": True} if self.noisy else {}), "measured": rec}

    def line(self) -> str:
        """One markdown line for a printed table: when, load at start and end, CPU, threads."""
        rec = self.record()
        flags = ", ".join(rec["cpu_flags"]) or "none of " + "/".join(KERNEL_FLAGS)
        threads = rec["torch_threads"]
        text = (
            f"Measured {rec['started']} to {rec['ended'][11:]} by {self.script}; load average "
            f"{' '.join(f'{x:.2f}' for x in self.load_start)} at start, "
            f"{' '.join(f'{x:.2f}' for x in rec['loadavg_end'])} at end; {rec['cpu']}, "
            f"{rec['cores']} cores ({flags})"
            + (f"; {threads} torch thread{'s' * (threads != 1)}" if threads is not None else "")
            + "."
        )
        if self.noisy:
            return f"**noisy** ({rec['noisy_reason']}): {text}"
        return text


def begin(
    script: str,
    noisy: bool,
    *,
    getloadavg: Callable[[], Load] | None = None,
    clock: Callable[[], float] = time.time,
    cpuinfo: Path = CPUINFO,
) -> Measurement:
    """Start a measurement; exit with one line if the machine is busy and --noisy is not set."""
    getloadavg = getloadavg or os.getloadavg
    load = tuple(getloadavg())
    if load[0] > MAX_START_LOAD and not noisy:
        raise SystemExit(
            f"{script}: not recording: the 1-minute load average is {load[0]:.2f} at start, above "
            f"{MAX_START_LOAD} (other jobs share the CPU); rerun on a quiet machine, or pass "
            "--noisy to keep the record marked noisy"
        )
    # --noisy lets a busy start through; a quiet start stays a quiet record either way.
    busy = noisy and load[0] > MAX_START_LOAD
    return Measurement(script, busy, load, clock(), getloadavg, clock, cpuinfo)  # type: ignore[arg-type]
