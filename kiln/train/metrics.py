"""Training metrics: throughput, MFU against a per-device peak table, and metrics.jsonl.

MFU = achieved model FLOPs/s ÷ peak FLOPs/s, with model FLOPs per token from the config
(`ModelConfig.flops_per_token`: 6·N_matmul + attention). Peaks are dense bf16 tensor-core
figures from `kiln.hardware`; on a CPU or an unknown accelerator MFU is null ("n/a"), never a
made-up number.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from kiln.fault_points import kill_point
from kiln.io import atomic_write


def peak_flops(device_name: str | None) -> float | None:
    """Peak dense bf16 FLOP/s of a device by its name, or None when it is not in the table."""
    from kiln.hardware import accelerator_for_device

    acc = accelerator_for_device(device_name)
    return acc.peak_flops.get("bf16") if acc is not None else None


def device_peak_flops(device: Any) -> float | None:
    """Peak of a torch device: looked up for CUDA devices, None for the CPU and the unknown."""
    if getattr(device, "type", device) != "cuda":
        return None
    import torch

    return peak_flops(torch.cuda.get_device_name(device))


def mfu(
    tokens_per_s: float, flops_per_token: int, peak_per_device: float | None, n_devices: int = 1
) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None without a known peak."""
    if peak_per_device is None or peak_per_device <= 0 or n_devices < 1:
        return None
    return tokens_per_s * flops_per_token / (peak_per_device * n_devices)


def _finite_or_none(value: Any) -> Any:
    """JSON has no NaN or infinity: write null (and the reason is the stopping message)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """Appends one JSON object per logged step to `metrics.jsonl`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (flushed at once, so a crash loses at most the line being written)."""
        line = json.dumps({k: _finite_or_none(v) for k, v in record.items()})
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step`: a resumed run rewrites them from its checkpoint.

        The file is never rewritten in place: when nothing is to be dropped it is left alone,
        otherwise the kept lines go to a temporary file that replaces it atomically, so a kill
        at any moment leaves either the old history or the truncated one.
        """
        for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            stale.unlink(missing_ok=True)  # the temp file of a truncation that was killed
        if not self.path.is_file():
            return
        text = self.path.read_text(encoding="utf-8")
        numbered = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        kept = []
        for i, (number, line) in enumerate(numbered):
            found = _step_of(line)
            if found is None and i < len(numbered) - 1:  # the last may be torn by a kill: silent
                print(
                    f"warning: {self.path}:{number}: not a record with a numeric 'step' "
                    f"({line[:40]!r}); dropped",
                    file=sys.stderr,
                )
            if found is not None and found <= step:
                kept.append(line)
        if len(kept) == len(numbered) and (not text or text.endswith("\n")):
            return
        with atomic_write(self.path) as handle:
            handle.write("".join(line + "\n" for line in kept))
            handle.flush()
            kill_point("metrics:before-rename")

    def read(self) -> list[dict[str, Any]]:
        """Every record in the file (a line that is not a JSON object, e.g. torn, is skipped)."""
        if not self.path.is_file():
            return []
        records = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


def _step_of(line: str) -> int | None:
    """The step of a record line; None for a line that is not a JSON object with an int step."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None  # a torn last line from a crash
    step = record.get("step", 0) if isinstance(record, dict) else None  # `[]`, `"x"`: None
    if isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step):
        return None
    return int(step)
