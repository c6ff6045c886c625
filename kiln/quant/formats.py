"""Low-precision number formats, emulated exactly in fp32: fp8 (e4m3, e5m2), fp4 (e2m1), E8M0.

Element codecs turn fp32 values into their bit codes (uint8, one code per byte; fp4 two per
byte with `pack_nibbles`) and back. Encoding rounds to nearest, ties to even, with subnormals, as
the hardware casts do; `decode` is a table lookup of all 2^bits codes. The formats (OCP 8-bit
floating point spec, OCP Microscaling spec v1.0):

| format | bias | max normal | min subnormal | inf | NaN |
|---|---|---|---|---|---|
| e4m3 (`float8_e4m3fn`) | 7 | 448 | 2^-9 | none | S.1111.111 |
| e5m2 (`float8_e5m2`) | 15 | 57344 | 2^-16 | S.11111.00 | S.11111.{01,10,11} |
| e2m1 (fp4) | 1 | 6 | 0.5 | none | none |
| E8M0 (scale) | 127 | 2^127 | 2^-127 (no zero, no sign) | none | 0xFF |

Out of range: `saturate=True` clamps to ±max (inf too), the rule of scaled quantization and of
torch's `float8_e4m3fn` cast; `saturate=False` gives inf for e5m2 (torch's `float8_e5m2` cast)
and is refused for formats without inf. NaN encodes as NaN where the format has one.

Block formats built on them (`w` is a weight (N, K); blocks run along K, the input dimension,
and a last partial block is padded with zeros, which change no block maximum):

- fp8 with one fp32 scale per tensor, per 1×128 row block or per 128×128 tile (DeepSeek-V3):
  s = amax / max_normal, codes = fp8(w / s).
- MXFP8 / MXFP4 (OCP MX): 32 elements share an E8M0 scale X = 2^(floor(log2 amax) - emax_elem),
  elements e4m3 / e2m1 of w / X, saturating. The spec's floor puts the block maximum in
  [2^emax, 2^(emax+1)), above max normal when its mantissa is large: those elements clamp
  (e2m1: ratios in [6, 8) become 6), which is the spec's behaviour, not a bug.
- NVFP4: 16 elements share an e4m3 scale, on top of one fp32 scale per tensor
  t = amax / (448·6); block scale b = e4m3(amax_block / 6 / t), elements e2m1(w / (b·t)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from kiln.errors import KilnError
from kiln.quant.modes import FP8_FORMATS, FP8_SCALINGS

FP8_BLOCK = 128
MX_BLOCK = 32
NVFP4_BLOCK = 16


@dataclass(frozen=True)
class Minifloat:
    """A small sign-exponent-mantissa float format and its special values."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max_normal: float
    has_inf: bool
    nan_code: int | None  # the positive NaN code this codec writes; None: no NaN

    @property
    def bits(self) -> int:
        """Bits per code, sign included."""
        return 1 + self.exp_bits + self.man_bits

    @property
    def min_exp(self) -> int:
        """The exponent of the smallest normal number (subnormals share it)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """The exponent of the largest normal number (OCP MX's emax_elem)."""
        return math.floor(math.log2(self.max_normal))


E4M3 = Minifloat("e4m3", 4, 3, 7, 448.0, has_inf=False, nan_code=0x7F)
E5M2 = Minifloat("e5m2", 5, 2, 15, 57344.0, has_inf=True, nan_code=0x7F)
E2M1 = Minifloat("e2m1", 2, 1, 1, 6.0, has_inf=False, nan_code=None)
FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1)}


def round_to_format(x: Tensor, fmt: Minifloat, saturate: bool = True) -> Tensor:
    """x (fp32) rounded to the nearest value of fmt, ties to even; fp32 out."""
    x = x.float()
    mag = x.abs()
    # frexp gives mag = f·2^e with f in [0.5, 1): the binade's exponent is e - 1, exactly.
    _, e = torch.frexp(mag)
    exp = (e - 1).clamp(min=fmt.min_exp)  # subnormals use the smallest normal's step
    step = torch.ldexp(torch.ones_like(mag), exp - fmt.man_bits)
    q = torch.round(mag / step) * step  # torch.round is half-to-even; mag/step is exact
    over = q > fmt.max_normal
    if saturate:
        q = torch.where(over, torch.full_like(q, fmt.max_normal), q)
    elif fmt.has_inf:
        q = torch.where(over, torch.full_like(q, float("inf")), q)
    else:
        raise KilnError(f"{fmt.name} has no infinity: encode it with saturate=True")
    q = torch.where(torch.isnan(x), x, q)
    return torch.copysign(q, x)


def encode(x: Tensor, fmt: Minifloat, saturate: bool = True) -> Tensor:
    """The bit codes (uint8, low fmt.bits bits) of x rounded to fmt."""
    if fmt.nan_code is None and bool(torch.isnan(x).any()):
        raise KilnError(f"{fmt.name} has no NaN: the values to encode must not be NaN")
    q = round_to_format(x, fmt, saturate)
    mag = q.abs()
    sign = torch.signbit(q).to(torch.int32)
    _, e = torch.frexp(mag)
    normal = mag >= 2.0**fmt.min_exp
    biased = torch.where(normal, e - 1 + fmt.bias, torch.zeros_like(e))
    exp = torch.where(normal, e - 1, torch.full_like(e, fmt.min_exp))
    man = torch.ldexp(mag, fmt.man_bits - exp) - normal.to(torch.float32) * 2**fmt.man_bits
    code = (biased << fmt.man_bits) | man.nan_to_num(0, posinf=0, neginf=0).to(torch.int32)
    if fmt.has_inf:  # all-ones exponent, zero mantissa
        code = torch.where(torch.isinf(mag), (2**fmt.exp_bits - 1) << fmt.man_bits, code)
    if fmt.nan_code is not None:
        code = torch.where(torch.isnan(mag), fmt.nan_code, code)
    code = code | (sign << (fmt.bits - 1))
    return code.to(torch.uint8)


def decode(codes: Tensor, fmt: Minifloat) -> Tensor:
    """The fp32 values of fmt's bit codes (uint8)."""
    return _table(fmt.name).to(codes.device)[codes.long()]


@cache
def _table(name: str) -> Tensor:
    """Every code's value, from the bit fields (special codes included)."""
    fmt = FORMATS[name]
    codes = torch.arange(2**fmt.bits)
    sign = torch.where(codes >> (fmt.bits - 1) == 1, -1.0, 1.0)
    biased = (codes >> fmt.man_bits) & (2**fmt.exp_bits - 1)
    man = (codes & (2**fmt.man_bits - 1)).double()
    normal = (1 + man / 2**fmt.man_bits) * torch.pow(2.0, (biased - fmt.bias).double())
    sub = man / 2**fmt.man_bits * 2.0**fmt.min_exp
    values = sign * torch.where(biased == 0, sub, normal)
    top = biased == 2**fmt.exp_bits - 1
    if fmt.name == "e4m3":  # only S.1111.111 is special (NaN); no inf
        values = torch.where(top & (man == 2**fmt.man_bits - 1), float("nan"), values)
    elif fmt.has_inf:  # IEEE-like: the top exponent is inf (mantissa 0) or NaN
        values = torch.where(top & (man == 0), sign * float("inf"), values)
        values = torch.where(top & (man != 0), float("nan"), values)
    return values.float()


def encode_e8m0(exponent: Tensor) -> Tensor:
    """E8M0 codes (uint8) of the scales 2^exponent; exponent an integer tensor in [-127, 127]."""
    return (exponent.to(torch.int32) + 127).clamp(0, 254).to(torch.uint8)


def decode_e8m0(codes: Tensor) -> Tensor:
    """fp32 scales 2^(code - 127); code 0xFF is NaN."""
    c = codes.to(torch.int32)
    x = torch.ldexp(torch.ones(c.shape, device=c.device), c - 127)
    return torch.where(c == 255, float("nan"), x)


def pack_nibbles(codes: Tensor) -> Tensor:
    """Two 4-bit codes per byte: (N, K) uint8 in 0..15 -> (N, K/2) uint8, even index high."""
    return (codes[:, 0::2] << 4) | codes[:, 1::2]


def unpack_nibbles(packed: Tensor) -> Tensor:
    """The inverse of `pack_nibbles`: (N, K/2) uint8 -> (N, K) uint8 codes."""
    return torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(packed.size(0), -1)


def _blocks(w: Tensor, block: int) -> Tensor:
    """w (N, K) as (N, ceil(K/block), block), the last block padded with zeros."""
    N, K = w.shape
    pad = -K % block
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(N, -1, block)


@dataclass
class Encoded:
    """A weight (N, K) in a block format: codes, scales, and what they mean."""

    mode: str  # fp8 | mxfp8 | mxfp4 | nvfp4
    shape: tuple[int, int]
    codes: Tensor  # uint8: fp8 (N, K); MXFP8 (N, Kp); fp4 (N, Kp/2), two per byte (Kp: padded)
    scales: Tensor  # fp32 (fp8) or uint8 codes (E8M0 for MX, e4m3 for NVFP4)
    tensor_scale: Tensor | None = None  # NVFP4's fp32 scale
    fmt: str = "e4m3"
    scaling: str = ""  # fp8: tensor | 1x128 | 128x128

    def decode(self) -> Tensor:
        """The fp32 weight (N, K) these codes stand for."""
        return dequantize(self)


def quantize_fp8(w: Tensor, fmt: str = "e4m3", scaling: str = "tensor") -> Encoded:
    """fp8 codes of w (N, K) with fp32 scales per tensor, per 1×128 block or per 128×128 tile."""
    if fmt not in FP8_FORMATS:
        raise KilnError(f"fp8 format must be one of {', '.join(FP8_FORMATS)}, got {fmt!r}")
    if scaling not in FP8_SCALINGS:
        raise KilnError(f"fp8 scaling must be one of {', '.join(FP8_SCALINGS)}, got {scaling!r}")
    f = FORMATS[fmt]
    w = w.detach().float()
    N, K = w.shape
    tiny = torch.finfo(torch.float32).tiny
    if scaling == "tensor":
        scale = (w.abs().amax() / f.max_normal).clamp(min=tiny).reshape(1, 1)
        return Encoded("fp8", (N, K), encode(w / scale, f), scale.reshape(1), None, fmt, scaling)
    rows = 1 if scaling == "1x128" else FP8_BLOCK
    b = _blocks(w, FP8_BLOCK)  # (N, G, 128)
    Np = -(-N // rows) * rows
    b = torch.nn.functional.pad(b, (0, 0, 0, 0, 0, Np - N)).reshape(Np // rows, rows, -1, FP8_BLOCK)
    scale = (b.abs().amax(dim=(1, 3)) / f.max_normal).clamp(min=tiny)  # (N/rows, G)
    codes = encode(b / scale[:, None, :, None], f).reshape(Np, -1)[:N, :K].clone()  # no padding
    return Encoded("fp8", (N, K), codes, scale, None, fmt, scaling)


def quantize_mx(w: Tensor, fmt: str = "e4m3") -> Encoded:
    """OCP MX codes of w (N, K): 32-element blocks, an E8M0 scale each; e4m3 or e2m1 elements."""
    f = FORMATS[fmt]
    w = w.detach().float()
    b = _blocks(w, MX_BLOCK)  # (N, G, 32)
    amax = b.abs().amax(dim=-1)
    _, e = torch.frexp(amax)
    # floor(log2 amax) - emax_elem; an all-zero block takes the smallest scale
    exp = torch.where(amax > 0, e - 1 - f.emax, torch.full_like(e, -127)).clamp(-127, 127)
    scale_codes = encode_e8m0(exp)
    scale_codes = torch.where(torch.isnan(amax), 255, scale_codes).to(torch.uint8)
    scale = decode_e8m0(scale_codes)[..., None]
    # a block holding NaN has a NaN scale (the spec's rule); its elements no longer matter
    scaled = torch.where(torch.isnan(scale), 0.0, b / scale)
    codes = encode(scaled, f).reshape(w.size(0), -1)
    if f.bits == 4:
        codes = pack_nibbles(codes)
    return Encoded(
        "mxfp4" if f.bits == 4 else "mxfp8", tuple(w.shape), codes, scale_codes, None, fmt
    )


def quantize_nvfp4(w: Tensor) -> Encoded:
    """NVFP4 codes of w (N, K): 16-element e2m1 blocks, an e4m3 scale each, one fp32 scale."""
    w = w.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise KilnError("NVFP4 needs finite values: the tensor holds inf or NaN")
    tiny = torch.finfo(torch.float32).tiny
    t = (w.abs().amax() / (E4M3.max_normal * E2M1.max_normal)).clamp(min=tiny)
    b = _blocks(w, NVFP4_BLOCK)
    block_scale = encode(b.abs().amax(dim=-1) / E2M1.max_normal / t, E4M3)  # (N, G) e4m3
    s = decode(block_scale, E4M3) * t
    scaled = torch.where(s[..., None] > 0, b / s[..., None], torch.zeros_like(b))
    codes = pack_nibbles(encode(scaled, E2M1).reshape(w.size(0), -1))
    return Encoded("nvfp4", tuple(w.shape), codes, block_scale, t.reshape(1), "e2m1")


def dequantize(enc: Encoded) -> Tensor:
    """The fp32 weight (N, K) of an `Encoded`."""
    N, K = enc.shape
    if enc.mode == "fp8":
        values = decode(enc.codes, FORMATS[enc.fmt])  # (N, Kp)
        if enc.scaling == "tensor":
            return values * enc.scales
        rows = 1 if enc.scaling == "1x128" else FP8_BLOCK
        scale = enc.scales.repeat_interleave(rows, dim=0).repeat_interleave(FP8_BLOCK, dim=1)
        return values * scale[:N, :K]
    if enc.mode in ("mxfp4", "nvfp4"):
        values = decode(unpack_nibbles(enc.codes), E2M1)
    else:
        values = decode(enc.codes, FORMATS[enc.fmt])
    if enc.mode == "nvfp4":
        assert enc.tensor_scale is not None
        scale = decode(enc.scales, E4M3) * enc.tensor_scale
        block = NVFP4_BLOCK
    else:
        scale, block = decode_e8m0(enc.scales), MX_BLOCK
    return (values.reshape(N, -1, block) * scale[..., None]).reshape(N, -1)[:, :K]
