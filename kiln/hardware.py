"""Accelerator peak throughput and memory by precision: the one table for MFU and for plans.

Figures are dense (no 2:4 sparsity) tensor-core peaks from the vendors' data sheets; "fp32" is
plain (non-tensor-core) FP32, "tf32" the tensor-core TF32 rate. A precision a part does not
support is absent, and asking for it is an error rather than a silent fallback.

Sources (dense figures are half of the "with sparsity" figures the sheets headline):
- H100 SXM5 / PCIe / NVL: NVIDIA H100 Tensor Core GPU data sheet (2023).
- H200 SXM: NVIDIA H200 data sheet (2024): H100 SXM's compute, 141 GB HBM3e.
- B200: NVIDIA HGX B200 / DGX B200 data sheets (2024), per GPU.
- A100 SXM 80 GB: NVIDIA A100 data sheet (2021).
- L40S: NVIDIA L40S data sheet (2023).
- V100 SXM2: NVIDIA V100 data sheet (2020); no bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import KilnError

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Accelerator:
    """One accelerator: its dense peak FLOP/s per precision and its memory."""

    name: str
    peak_flops: dict[str, float]  # precision -> dense FLOP/s
    memory_bytes: float
    aliases: tuple[str, ...] = ()

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s at `precision`; an error naming what the part supports otherwise."""
        if precision not in self.peak_flops:
            raise KilnError(
                f"{self.name} has no {precision} peak in kiln's table; "
                f"known: {', '.join(self.peak_flops)}"
            )
        return self.peak_flops[precision]


def _tf(**rates: float) -> dict[str, float]:
    """Precision -> FLOP/s from figures given in TFLOP/s."""
    return {k: v * 1e12 for k, v in rates.items()}


GB = 1e9
ACCELERATORS: tuple[Accelerator, ...] = (
    Accelerator("h100", _tf(fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9), 80 * GB,
                ("h100-sxm", "h100 sxm")),
    Accelerator("h100-pcie", _tf(fp32=51, tf32=378, bf16=756, fp16=756, fp8=1513), 80 * GB),
    Accelerator("h100-nvl", _tf(fp32=60, tf32=417.5, bf16=835, fp16=835, fp8=1670), 94 * GB),
    Accelerator("h200", _tf(fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9), 141 * GB,
                ("h200-sxm", "gh200")),
    Accelerator("b200", _tf(fp32=75, tf32=1100, bf16=2250, fp16=2250, fp8=4500), 180 * GB),
    Accelerator("a100", _tf(fp32=19.5, tf32=156, bf16=312, fp16=312), 80 * GB,
                ("a100-sxm", "a100-80gb")),
    Accelerator("l40s", _tf(fp32=91.6, tf32=183, bf16=362.05, fp16=362.05, fp8=733), 48 * GB),
    Accelerator("v100", _tf(fp32=15.7, fp16=125), 32 * GB, ("v100-sxm2",)),
)  # fmt: skip


def accelerator(name: str) -> Accelerator:
    """Look up an accelerator by name or alias (case-insensitive)."""
    key = name.strip().lower()
    for acc in ACCELERATORS:
        if key == acc.name or key in acc.aliases:
            return acc
    known = ", ".join(a.name for a in ACCELERATORS)
    raise KilnError(f"unknown GPU {name!r}; known: {known}")


# CUDA device names (torch.cuda.get_device_name) to table entries: the first key that is a
# substring of the name wins, so more specific names come first.
_DEVICE_NAME_KEYS: tuple[tuple[str, str], ...] = (
    ("h100 pcie", "h100-pcie"),
    ("h100 nvl", "h100-nvl"),
    ("gh200", "h200"),
    ("h200", "h200"),
    ("h100", "h100"),
    ("b200", "b200"),
    ("a100", "a100"),
    ("l40s", "l40s"),
    ("v100", "v100"),
)


def accelerator_for_device(device_name: str | None) -> Accelerator | None:
    """The table entry for a device name such as "NVIDIA H100 80GB HBM3", or None if unknown."""
    if not device_name:
        return None
    lowered = device_name.lower()
    for key, name in _DEVICE_NAME_KEYS:
        if key in lowered:
            return accelerator(name)
    return None
