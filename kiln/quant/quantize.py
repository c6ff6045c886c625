"""Weight-only quantization of a loaded model: int8 per output channel, int4 in groups, and the
low-precision float formats fp8 / MXFP8 / MXFP4 / NVFP4 (`kiln.quant.lowprec`, emulated).

`quantize_model(model, mode, group_size, include_head)` replaces the model's `nn.Linear` layers
in place by `QuantizedLinear`, which holds integer weights and computes `x @ dequant(W)ᵀ`.

- int8: symmetric per output channel, w ≈ q · s with q in [-127, 127] and s = max|w_row| / 127.
- int4: asymmetric per group of `group_size` inputs (32, 64 or 128), w ≈ (c - 8) · s + z with
  c in [0, 15], s = (max - min) / 15 and z = min + 8·s: the layout of torch's int4 kernels.

Two ways to compute: torch's weight-only kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu` or its CUDA twin), whose fast paths take bf16 activations, so the
kernel path casts activations to bf16 and its output back; and a plain fallback that
dequantizes the weight in the activations' dtype and calls `F.linear`. Each layer is probed
against the fallback once at quantization time and falls back when the kernel does not run on
its device; the report says which path every layer took.

The embedding stays fp32 (a row gather costs nothing to keep exact). With a tied head, asking
for the head quantizes a copy of the shared matrix for the head only: compute shrinks, memory
grows by the quantized copy, and the report's byte counts show it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.errors import KilnError
from kiln.quant.formats import FP8_FORMATS, FP8_SCALINGS, pack_nibbles, unpack_nibbles
from kiln.quant.lowprec import (
    DEFAULT_FP8_FORMAT,
    DEFAULT_FP8_SCALING,
    LOWPREC_MODES,
    LowPrecLinear,
    describe_format,
)
from kiln.quant.modes import DEFAULT_GROUP_SIZE, GROUP_SIZES, MODES

KERNELS = ("auto", "torch", "dequant")
KERNEL_DTYPE = torch.bfloat16  # the activations torch's weight-only kernels are vectorised for
INT4_INNER_K_TILES = 2  # torch's int4 packing parameter (2, 4 or 8); 2 allows any K % 32 == 0
PROBE_TOLERANCE = 0.05  # kernel vs fallback, relative to the output's scale (bf16 activations)
# The timed probe: rows of a decode step of a busy engine (32 sequences), best of a few calls.
TIMED_PROBE_ROWS = 32
TIMED_PROBE_REPEATS = 5


class KernelMismatch(RuntimeError):
    """torch's kernel ran but its output differs from the dequantize fallback's."""


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: codes (N, K) int8 and scales (N,) fp32 with w ≈ codes · scale."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return codes, scale


def dequantize_int8(codes: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight (N, K) that int8 codes and per-row scales stand for."""
    return (codes.to(dtype) * scale.to(dtype)[:, None]).to(dtype)


def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Min/max int4 per group: codes (N, K) uint8 in 0..15, scales and zeros (N, K/group_size).

    w ≈ (codes - 8) · scale + zero, group by group along the input dimension.
    """
    N, K = w.shape
    _check_group(K, group_size, "the weight")
    groups = w.detach().float().reshape(N, K // group_size, group_size)  # (N, G, g)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # (N, G)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    zero = lo + 8 * scale
    codes = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).reshape(N, K), scale, zero


def dequantize_int4(
    codes: Tensor, scale: Tensor, zero: Tensor, group_size: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The weight (N, K) that int4 codes (N, K) and per-group scales and zeros stand for."""
    N, K = codes.shape
    groups = codes.reshape(N, K // group_size, group_size).to(torch.float32) - 8  # (N, G, g)
    w = groups * scale[..., None] + zero[..., None]
    return w.reshape(N, K).to(dtype)


class QuantizedLinear(nn.Module):
    """A weight-only quantized `nn.Linear`: int8 or int4 weights, an fp32 bias if any.

    Build it on the device it will run on: the int4 kernel's packed layout is device-specific.
    """

    def __init__(
        self,
        linear: nn.Linear,
        mode: str,
        group_size: int = DEFAULT_GROUP_SIZE,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        _check_mode(mode, group_size, kernel)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.mode, self.group_size = mode, group_size if mode == "int4" else None
        w = linear.weight.detach()
        self.device = w.device
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        if mode == "int8":
            codes, scale = quantize_int8(w)
            self.register_buffer("codes", codes)
            self.register_buffer("scale", scale)
        else:
            _check_group(self.in_features, group_size, "this layer")
            codes, scale, zero = quantize_int4(w, group_size)
            self.register_buffer("codes", pack_nibbles(codes))  # fallback storage (N, K/2)
            self.register_buffer("scale", scale)
            self.register_buffer("zero", zero)
        self.kernel = "dequant"
        self.kernel_note = ""
        # A kernel that ran and disagreed is a wrong result, not a missing platform feature:
        # "auto" still falls back, and the tests fail on it instead of skipping.
        self.kernel_disagrees = False
        if kernel != "dequant":
            self._try_kernel(required=kernel == "torch")

    def extra_repr(self) -> str:
        """Shown by print(model)."""
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"mode={self.mode}{group}, kernel={self.kernel}"
        )

    def forward(self, x: Tensor) -> Tensor:
        """x (..., K) -> (..., N)."""
        if self.kernel == "torch":
            y = self._kernel_matmul(x.reshape(-1, self.in_features))
            y = y.reshape(*x.shape[:-1], self.out_features).to(_out_dtype(x))
        else:
            dtype = _out_dtype(x)
            y = F.linear(x.to(dtype), self.dequantized_weight(dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (N, K) fp32, for code that reads `.weight` (e.g. the LM loss)."""
        return self.dequantized_weight(torch.float32)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight (N, K) these codes stand for, in `dtype`."""
        if self.mode == "int8":
            return dequantize_int8(self.codes, self.scale, dtype)
        if "codes" not in self._buffers:  # int4 on the kernel path keeps only the packed copy
            eye = torch.eye(self.in_features, device=self.device, dtype=KERNEL_DTYPE)
            return self._kernel_matmul(eye).T.to(dtype)  # as the kernel computes it (bf16)
        codes = unpack_nibbles(self.codes)
        return dequantize_int4(codes, self.scale, self.zero, self.group_size or 0, dtype)

    def _kernel_matmul(self, x2: Tensor) -> Tensor:
        """(M, K) -> (M, N) by torch's kernel, activations in bf16."""
        xk = x2.to(KERNEL_DTYPE).contiguous()
        if self.mode == "int8":
            return torch._weight_int8pack_mm(xk, self.codes, self.kernel_scale)
        if self.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                xk, self.kernel_codes, self.group_size, self.kernel_scale
            )
        return torch.ops.aten._weight_int4pack_mm(
            xk, self.kernel_codes, self.group_size, self.kernel_scale
        )

    def _try_kernel(self, required: bool) -> None:
        """Switch to torch's kernel when it runs here and agrees with the fallback."""
        try:
            if self.mode == "int8":
                self.register_buffer("kernel_scale", self.scale.to(KERNEL_DTYPE))
            else:
                self._pack_int4_for_kernel()
            probe = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0))
            probe = probe.to(self.device)
            want = F.linear(probe, self.dequantized_weight())
            got = self._kernel_matmul(probe).float()
            err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
            if not err <= PROBE_TOLERANCE:
                raise KernelMismatch(f"kernel differs from the fallback by {err:.3g} (relative)")
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            for name in ("kernel_scale", "kernel_codes"):
                self._buffers.pop(name, None)
            self.kernel_disagrees = isinstance(exc, KernelMismatch)
            if required:
                fails = "disagrees with the fallback" if self.kernel_disagrees else "does not run"
                raise KilnError(
                    f"quantize kernel 'torch': torch's {self.mode} kernel {fails} on "
                    f"{self.device} ({_first_line(exc)}); use kernel 'auto' or 'dequant'"
                ) from None
            self.kernel_note = _first_line(exc)
            return
        self.kernel = "torch"
        if self.mode == "int4":
            # The kernel holds its own packed copy and bf16 scales; the fallback's would double
            # the bytes (fp32 scales and zeros cost 8 bytes per group).
            for name in ("codes", "scale", "zero"):
                del self._buffers[name]

    def use_fallback(self, note: str) -> None:
        """Compute by dequantize-matmul from now on (int8: its codes and scales are kept)."""
        if self.mode != "int8":
            raise KilnError("only an int8 layer keeps the fallback's weights beside the kernel's")
        self._buffers.pop("kernel_scale", None)
        self.kernel, self.kernel_note = "dequant", note

    def seconds_per_call(self, x: Tensor, kernel: str) -> float:
        """The best of a few timed forwards of `x` on `kernel` ("torch" or "dequant"; or
        "unquantized": a plain matmul with the weight in x's dtype, for reference)."""
        kept, self.kernel = self.kernel, kernel
        plain = self.dequantized_weight(x.dtype) if kernel == "unquantized" else None
        try:
            with torch.no_grad():
                call = (lambda: F.linear(x, plain)) if plain is not None else (lambda: self(x))
                call()  # warm-up: first calls pay for allocation and dispatch
                best = float("inf")
                for _ in range(TIMED_PROBE_REPEATS):
                    start = time.perf_counter()
                    call()
                    best = min(best, time.perf_counter() - start)
        finally:
            self.kernel = kept
        return best

    def _pack_int4_for_kernel(self) -> None:
        """torch's packed int4 weight and its (G, N, 2) scales-and-zeros for this device."""
        codes = unpack_nibbles(self.codes)  # (N, K) 0..15
        if self.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32), INT4_INNER_K_TILES
            )
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack(
                pack_nibbles(codes), INT4_INNER_K_TILES
            )
        scales_zeros = torch.stack((self.scale, self.zero), dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("kernel_codes", packed)
        self.register_buffer("kernel_scale", scales_zeros.to(KERNEL_DTYPE))


@dataclass
class QuantReport:
    """What `quantize_model` did: the settings, the layers and paths, the bytes before and after."""

    mode: str
    group_size: int | None
    include_head: bool
    layers: int = 0
    paths: dict[str, int] = field(default_factory=dict)  # kernel path -> layers
    kernel_notes: list[str] = field(default_factory=list)  # why a layer fell back
    # The timed probe (int8, kernel "auto"): seconds per call of each path (and of an unquantized
    # matmul, for reference), summed over layers.
    probe_s: dict[str, float] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    head: str = "fp32"  # "fp32", "quantized", or "quantized copy (tied embedding kept fp32)"
    fp8_format: str | None = None  # fp8 only
    fp8_scaling: str | None = None  # fp8 only

    def describe(self) -> str:
        """One line for a command's start-up output."""
        group = f" (group {self.group_size})" if self.group_size else " (per output channel)"
        if self.mode in LOWPREC_MODES:
            fmt = describe_format(self.mode, self.fp8_format or "", self.fp8_scaling or "")
            group = f" ({fmt})"
        paths = ", ".join(f"{n} by {_PATH_NAMES[self.mode][p]}" for p, n in self.paths.items())
        note = f"; fallback because: {self.kernel_notes[0]}" if self.kernel_notes else ""
        probe = ""
        if self.probe_s:
            timings = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.probe_s.items())
            probe = f"; timed probe ({TIMED_PROBE_ROWS} rows, all layers): {timings}"
        return (
            f"quantize {self.mode}{group}: {self.layers} linear layers ({paths}); head "
            f"{self.head}; model {_mb(self.bytes_before)} -> {_mb(self.bytes_after)}{probe}{note}"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record (for eval results and benchmarks)."""
        return {
            "mode": self.mode, "group_size": self.group_size, "include_head": self.include_head,
            "layers": self.layers, "paths": dict(self.paths), "head": self.head,
            "probe_s": dict(self.probe_s), "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
            "fp8_format": self.fp8_format, "fp8_scaling": self.fp8_scaling,
        }  # fmt: skip


_PATH_NAMES = {
    "int8": {
        "torch": "torch._weight_int8pack_mm (bf16 activations)",
        "dequant": "dequantize-matmul",
    },
    "int4": {
        "torch": "torch _weight_int4pack_mm (bf16 activations)",
        "dequant": "dequantize-matmul",
    },
    **{m: {"dequant": "dequantize-matmul (emulated format)"} for m in LOWPREC_MODES},
}


def quantize_model(
    model: nn.Module,
    mode: str,
    group_size: int = DEFAULT_GROUP_SIZE,
    include_head: bool = False,
    *,
    kernel: str = "auto",
    probe_dtype: torch.dtype = torch.float32,
    fp8_format: str = DEFAULT_FP8_FORMAT,
    fp8_scaling: str = DEFAULT_FP8_SCALING,
) -> QuantReport:
    """Quantize the model's linear layers in place (the head only if include_head); the report.

    Every layer is checked before any is replaced, so a bad setting leaves the model untouched.
    With int8 and kernel "auto", torch's kernel is kept only where a timed probe (activations
    in `probe_dtype`, the dtype the model will run in) finds it faster than dequantize-matmul:
    on some CPUs the bf16-activation kernel is slower than plain fp32 matmuls.
    fp8_format (e4m3, e5m2) and fp8_scaling (tensor, 1x128, 128x128) apply to mode "fp8".
    """
    _check_mode(mode, group_size, kernel)
    _check_lowprec(mode, kernel, fp8_format, fp8_scaling)
    if any(isinstance(m, (QuantizedLinear, LowPrecLinear)) for m in model.modules()):
        raise KilnError("the model is already quantized")
    head = getattr(model, "lm_head", None)
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and (include_head or m is not head)
    ]
    if mode == "int4":
        for name, m in targets:
            _check_group(m.in_features, group_size, name)
    for name, m in targets:
        if mode in LOWPREC_MODES and not bool(torch.isfinite(m.weight).all()):
            raise KilnError(f"quantize {mode}: {name}'s weight holds inf or NaN")
    report = QuantReport(mode, group_size if mode == "int4" else None, include_head)
    if mode == "fp8":
        report.fp8_format, report.fp8_scaling = fp8_format, fp8_scaling
    report.bytes_before = model_bytes(model)
    tied = head is not None and head.weight is getattr(getattr(model, "wte", None), "weight", None)
    layers = []
    for name, linear in targets:
        layer: QuantizedLinear | LowPrecLinear
        if mode in LOWPREC_MODES:
            layer = LowPrecLinear(linear, mode, fp8_format, fp8_scaling)
        else:
            layer = QuantizedLinear(linear, mode, group_size, kernel)
        _set_submodule(model, name, layer)
        layers.append((name, layer))
    if mode == "int8" and kernel == "auto":
        report.probe_s = _choose_int8_path([layer for _, layer in layers], probe_dtype)
    notes: set[str] = set()
    for name, layer in layers:
        report.layers += 1
        report.paths[layer.kernel] = report.paths.get(layer.kernel, 0) + 1
        if layer.kernel_note and layer.kernel_note not in notes:
            notes.add(layer.kernel_note)
            report.kernel_notes.append(f"{name}: {layer.kernel_note}")
    if include_head and head is not None:
        report.head = "quantized copy (tied embedding kept fp32)" if tied else "quantized"
    report.bytes_after = model_bytes(model)
    return report


def _choose_int8_path(layers: list[QuantizedLinear], dtype: torch.dtype) -> dict[str, float]:
    """Time both int8 paths on every layer whose kernel runs; switch all to the faster one.

    One verdict for the whole model: per-layer choices would follow timing noise on layers of
    the same shape. Returns seconds per call of each path, summed over the timed layers, with
    an unquantized matmul's beside them, so a user sees when int8 costs speed here.
    """
    timed = [layer for layer in layers if layer.kernel == "torch"]
    if not timed:
        return {}
    totals = {"torch": 0.0, "dequant": 0.0, "unquantized": 0.0}
    seed = torch.Generator().manual_seed(0)
    for layer in timed:
        x = torch.randn(TIMED_PROBE_ROWS, layer.in_features, generator=seed)
        x = x.to(device=layer.device, dtype=dtype)
        for path in totals:  # alternated per layer, so load from elsewhere hits both alike
            totals[path] += layer.seconds_per_call(x, path)
    if totals["dequant"] < totals["torch"]:
        note = (
            f"timed probe: dequantize-matmul {totals['dequant'] * 1e3:.2f} ms < torch's kernel "
            f"{totals['torch'] * 1e3:.2f} ms per {TIMED_PROBE_ROWS}-row pass"
        )
        for layer in timed:
            layer.use_fallback(note)
    return totals


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() == 0 or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _check_mode(mode: str, group_size: int, kernel: str) -> None:
    """Clear errors for an unknown mode, group size or kernel."""
    if mode not in MODES:
        raise KilnError(f"quantize mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "int4" and group_size not in GROUP_SIZES:
        raise KilnError(
            f"int4 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}"
        )
    if kernel not in KERNELS:
        raise KilnError(f"quantize kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")


def _check_lowprec(mode: str, kernel: str, fp8_format: str, fp8_scaling: str) -> None:
    """Clear errors for fp8 settings and for a native kernel the float formats lack."""
    if fp8_format not in FP8_FORMATS:
        raise KilnError(f"fp8 format must be one of {', '.join(FP8_FORMATS)}, got {fp8_format!r}")
    if fp8_scaling not in FP8_SCALINGS:
        raise KilnError(
            f"fp8 scaling must be one of {', '.join(FP8_SCALINGS)}, got {fp8_scaling!r}"
        )
    if mode in LOWPREC_MODES and kernel == "torch":
        raise KilnError(
            f"quantize kernel 'torch': kiln has no native {mode} kernel (it emulates the format: "
            "dequantize, then the matmul); use kernel 'auto' or 'dequant'"
        )


def _check_group(in_features: int, group_size: int, where: str) -> None:
    """int4 groups must tile the input dimension exactly."""
    if in_features % group_size:
        fits = [g for g in GROUP_SIZES if in_features % g == 0]
        hint = f"group sizes that divide it: {', '.join(map(str, fits))}" if fits else (
            "no int4 group size divides it; use int8"
        )  # fmt: skip
        raise KilnError(
            f"int4 group size {group_size} does not divide {where}'s in_features "
            f"{in_features} ({hint})"
        )


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted `name`."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _out_dtype(x: Tensor) -> torch.dtype:
    """The dtype a plain Linear would return for x here (autocast's, when it is on)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
