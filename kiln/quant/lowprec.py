"""Linear layers whose weights are held in fp8, MXFP8, MXFP4 or NVFP4 (`kiln.quant.formats`).

`LowPrecLinear` stores the codes and scales (fp4 two per byte) and computes
`x @ dequant(W)ᵀ` in the activations' dtype: an exact emulation of the format, so the numbers
are those a device with native support would see for the weights, while the matmul itself runs
in fp32/bf16. No native kernel is used yet (torch's `_scaled_mm` needs a CUDA device with fp8
support), so `kernel="torch"` is refused for these modes rather than silently emulated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.errors import KilnError
from kiln.quant import formats
from kiln.quant.formats import Encoded

LOWPREC_MODES = ("fp8", "mxfp8", "mxfp4", "nvfp4")
DEFAULT_FP8_FORMAT = "e4m3"
DEFAULT_FP8_SCALING = "128x128"


def encode_weight(w: Tensor, mode: str, fp8_format: str, fp8_scaling: str) -> Encoded:
    """w (N, K) in one of the low-precision modes."""
    if mode == "fp8":
        return formats.quantize_fp8(w, fp8_format, fp8_scaling)
    if mode == "mxfp8":
        return formats.quantize_mx(w, "e4m3")
    if mode == "mxfp4":
        return formats.quantize_mx(w, "e2m1")
    if mode == "nvfp4":
        return formats.quantize_nvfp4(w)
    raise KilnError(f"low-precision mode must be one of {', '.join(LOWPREC_MODES)}, got {mode!r}")


def describe_format(mode: str, fp8_format: str, fp8_scaling: str) -> str:
    """A few words for the report line: element format and scaling."""
    if mode == "fp8":
        per = {
            "tensor": "one scale per tensor",
            "1x128": "1x128 blocks",
            "128x128": "128x128 tiles",
        }
        return f"{fp8_format}, {per[fp8_scaling]}"
    if mode in ("mxfp8", "mxfp4"):
        return f"{'e4m3' if mode == 'mxfp8' else 'e2m1'}, 32-element blocks, E8M0 scales"
    return "e2m1, 16-element blocks, e4m3 scales + fp32 tensor scale"


class LowPrecLinear(nn.Module):
    """An `nn.Linear` with fp8 / MX / NVFP4 weights, dequantized for each matmul; fp32 bias."""

    def __init__(
        self,
        linear: nn.Linear,
        mode: str,
        fp8_format: str = DEFAULT_FP8_FORMAT,
        fp8_scaling: str = DEFAULT_FP8_SCALING,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        if not bool(torch.isfinite(w).all()):
            raise KilnError(f"{mode}: the weight holds inf or NaN; the model is broken")
        enc = encode_weight(w, mode, fp8_format, fp8_scaling)
        self.mode, self.fmt, self.scaling = mode, enc.fmt, enc.scaling
        self.kernel, self.kernel_note, self.kernel_disagrees = "dequant", "", False
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.register_buffer("codes", enc.codes)
        self.register_buffer("scales", enc.scales)
        if enc.tensor_scale is not None:
            self.register_buffer("tensor_scale", enc.tensor_scale)

    def extra_repr(self) -> str:
        """Shown by print(model)."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"mode={self.mode} ({describe_format(self.mode, self.fmt, self.scaling)})"
        )

    def encoded(self) -> Encoded:
        """The layer's weight as an `Encoded` (on the buffers' device)."""
        return Encoded(
            self.mode,
            (self.out_features, self.in_features),
            self.codes,
            self.scales,
            self._buffers.get("tensor_scale"),
            self.fmt,
            self.scaling,
        )

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight (N, K) these codes stand for, in `dtype`."""
        return formats.dequantize(self.encoded()).to(dtype)

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (N, K) fp32, for code that reads `.weight` (e.g. the LM loss)."""
        return self.dequantized_weight(torch.float32)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., K) -> (..., N)."""
        dtype = _out_dtype(x)
        y = F.linear(x.to(dtype), self.dequantized_weight(dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def _out_dtype(x: Tensor) -> torch.dtype:
    """The dtype a plain Linear would return for x here (autocast's, when it is on)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype
