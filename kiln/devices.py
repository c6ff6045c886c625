"""Where a model runs and at what precision: `--device auto` and `dtype = "auto"` for every command.

On CPUs without native bf16 matrix support (no AVX512_BF16, no AMX) PyTorch emulates bf16
matmuls, roughly 30x slower than fp32, so "auto" only picks bf16 where the CPU flags say it is
native *and* a tiny timed probe confirms that a bf16 matmul is not slower than an fp32 one.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.errors import KilnError

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# bf16 must run at least this fast relative to fp32 in the probe (above 1: noise allowance).
PROBE_MAX_RATIO = 1.1


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """cpu, cuda[:N] or auto (this rank's GPU when there is one, else the CPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):  # kiln runs on nothing else
        raise KilnError(f"device must be cpu, cuda, cuda:N or auto, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise KilnError(f"device {name!r}: no CUDA device is available")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise KilnError(
                f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


@dataclass(frozen=True)
class Precision:
    """The precision chosen for a model's matmuls, and why."""

    name: str  # "fp32" or "bf16"
    requested: str  # what the user asked for: "auto", "fp32" or "bf16"
    reason: str  # one line, e.g. "this CPU has no native bf16 (no avx512_bf16/amx_bf16 flag)"
    bf16_slowdown: float | None = None  # probe: bf16 matmul time / fp32 time, when measured

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of `name`."""
        return DTYPES[self.name]

    @property
    def warning(self) -> str | None:
        """A line to print once when bf16 runs emulated on this CPU (asked for, or kept), else None."""
        slowdown = self.bf16_slowdown if self.name == "bf16" else None
        if slowdown is None or slowdown <= PROBE_MAX_RATIO:
            return None
        return (
            f"dtype bf16 on a CPU without native bf16: the probe measured bf16 matmuls "
            f"{slowdown:.1f}x slower than fp32; dtype auto would pick fp32"
        )

    def describe(self) -> str:
        """The line printed once at start-up, e.g. "dtype auto → fp32: this CPU has no ..."."""
        if self.requested == self.name:
            return f"dtype {self.name}: {self.reason}"
        return f"dtype {self.requested} → {self.name}: {self.reason}"

    def lines(self, command: str) -> list[str]:
        """What a command prints once at start-up: the choice, and the warning if there is one."""
        lines = [f"{command}: {self.describe()}"]
        if self.warning is not None:
            lines.append(f"{command}: warning: {self.warning}")
        return lines

    def to_dict(self) -> dict[str, object]:
        """The record kept in a run's config and metrics."""
        return {
            "dtype": self.name,
            "requested": self.requested,
            "reason": self.reason,
            "bf16_slowdown": self.bf16_slowdown,
        }


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where /proc/cpuinfo is unreadable)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.lru_cache(maxsize=1)
def bf16_probe_ratio(size: int = 256, repeats: int = 7) -> float:
    """Best-of-`repeats` time of a (size x size) bf16 matmul over an fp32 one, on this CPU.

    One thread, and the two dtypes interleaved: on a shared machine a multi-threaded matmul this
    small waits on the scheduler (ratios of 0.3 and 50 in turn were seen), and interleaving puts
    both dtypes under the same load. The ratio of the kernels is what the rule needs.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pairs = {
            dtype: (torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype))
            for dtype in (torch.float32, torch.bfloat16)
        }
        for a, b in pairs.values():
            torch.mm(a, b)  # warm-up: first-call dispatch and allocation are not the matmul
        best = dict.fromkeys(pairs, math.inf)
        for _ in range(repeats):
            for dtype, (a, b) in pairs.items():
                start = time.perf_counter()
                torch.mm(a, b)
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def choose_precision(
    requested: str, device: torch.device, flags: frozenset[str] | None = None
) -> Precision:
    """Resolve "auto", "fp32" or "bf16" for `device` (see the module docstring for the rule)."""
    if requested not in ("auto", *DTYPES):
        raise KilnError(f"dtype must be auto, fp32 or bf16, got {requested!r}")
    if device.type == "cuda":
        return _cuda_precision(requested, device)
    if device.type != "cpu":
        raise KilnError(f"no precision rule for {device.type} devices (kiln runs on cpu or cuda)")
    if requested == "fp32":
        return Precision("fp32", requested, "asked for")
    flags = cpu_flags() if flags is None else flags
    native = sorted(f for f in NATIVE_BF16_FLAGS if f in flags)
    if requested == "bf16":
        ratio = None if native else bf16_probe_ratio()
        return Precision("bf16", requested, "asked for", ratio)
    if not native:
        return Precision(
            "fp32", requested, "this CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag)"
        )
    ratio = bf16_probe_ratio()
    if ratio > PROBE_MAX_RATIO:
        return Precision(
            "fp32",
            requested,
            f"the CPU reports {'/'.join(native)} but the probe measured bf16 matmuls "
            f"{ratio:.1f}x slower than fp32",
            ratio,
        )
    return Precision(
        "bf16",
        requested,
        f"this CPU has native bf16 ({'/'.join(native)}); probe bf16/fp32 time {ratio:.2f}",
        ratio,
    )


def _cuda_precision(requested: str, device: torch.device) -> Precision:
    """The rule on a GPU: bf16 where its tensor cores have it (compute capability 8.0 and up).

    Not `torch.cuda.is_bf16_supported()`, which also says yes for GPUs that only emulate bf16.
    """
    major, minor = torch.cuda.get_device_capability(device)
    where = f"{torch.cuda.get_device_name(device)}, sm_{major}{minor}"
    native = (major, minor) >= (8, 0)
    if requested == "fp32":
        return Precision("fp32", requested, "asked for")
    if requested == "bf16":
        return Precision(
            "bf16", requested, "asked for" if native else f"asked for; {where} emulates bf16"
        )
    if native:
        return Precision("bf16", requested, f"this GPU has native bf16 ({where})")
    return Precision("fp32", requested, f"this GPU has no native bf16 ({where}; needs sm_80+)")
