"""GGML's Q4_K and Q6_K weight blocks, written in numpy (the `gguf` package only reads them).

Both cover 256 weights of one row (a super-block) and decode as ``scale * q - offset``:

- Q4_K, 144 bytes: fp16 ``d`` and ``dmin``, 12 bytes holding eight 6-bit scales and eight 6-bit
  mins (one per sub-block of 32), then 128 bytes of 4-bit quants. Weight ``i`` of sub-block ``j``
  decodes as ``d * sc[j] * q[i] - dmin * mn[j]``.
- Q6_K, 210 bytes: 128 bytes of the quants' low 4 bits, 64 bytes of their high 2 bits, sixteen
  int8 scales (one per sub-block of 16), then fp16 ``d``; weight ``i`` decodes as
  ``d * sc[i // 16] * (q[i] - 32)``.

Scales are chosen the way llama.cpp's reference quantizer does it, in kiln's own vectorised form:
each sub-block starts from its min/max fit and tries a small grid of wider and narrower scales,
refitting scale (and offset, for Q4_K) by weighted least squares for each rounding and keeping
the one with the least weighted squared error. The weights favour large values without ignoring
small ones: ``rms + |x|`` per sub-block for Q4_K (llama.cpp's choice), ``rms² + x²`` for Q6_K.
Because the min/max fit is one of the candidates, a sub-block's weighted RMS error before the
6-bit/8-bit scale rounding is at most the min/max fit's: (max - min) / 30 for Q4_K, |amax| / 32
for Q6_K; rounding the sub-block scales to the fp16 super-scale's grid adds at most half a grid
step times the largest quant (and half a step of ``dmin`` for Q4_K's offsets).
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights per super-block, both formats
Q4_K_BYTES = 2 + 2 + 12 + QK_K // 2
Q6_K_BYTES = QK_K // 2 + QK_K // 4 + QK_K // 16 + 2


def _super_blocks(w: np.ndarray) -> tuple[np.ndarray, int]:
    """(rows, cols) as (n_super_blocks, 256) float32, and the row count; refuses a short row."""
    if w.ndim != 2 or w.shape[1] % QK_K:
        raise ValueError(f"K-quants need rows of a multiple of {QK_K} weights, got shape {w.shape}")
    return np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK_K), w.shape[0]


def _fp16_scale_at_least(x: np.ndarray) -> np.ndarray:
    """x rounded to fp16, then up to the next fp16 if rounding went below x.

    A super-scale that never falls below its target keeps every sub-block scale within the
    6-bit (or int8) range, so no sub-block's scale is clipped.
    """
    d = x.astype(np.float16)
    low = d.astype(np.float32) < x
    d[low] = np.nextafter(d[low], np.float16(np.inf))
    return d


def _weighted_fit(
    x: np.ndarray, w: np.ndarray, q: np.ndarray, with_offset: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least-squares (scale, offset) for x ≈ scale * q + offset, and the weighted squared error.

    The offset is held at or below 0 (Q4_K stores it as a non-negative min that is subtracted);
    without an offset the fit is the scale alone.
    """
    sw, sq, sqq = w.sum(-1), (w * q).sum(-1), (w * q * q).sum(-1)
    sx, sqx = (w * x).sum(-1), (w * q * x).sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        lone = np.where(sqq > 0, sqx / sqq, 0.0)
        if with_offset:
            det = sw * sqq - sq * sq
            scale = np.where(det > 0, (sw * sqx - sx * sq) / det, 0.0)
            offset = np.where(det > 0, (sqq * sx - sq * sqx) / det, 0.0)
            positive = offset > 0
            scale, offset = np.where(positive, lone, scale), np.where(positive, 0.0, offset)
        else:
            scale, offset = lone, np.zeros_like(lone)
    err = (w * np.square(scale[..., None] * q + offset[..., None] - x)).sum(-1)
    return scale, offset, err


def _search_q4(xs: np.ndarray, search: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block (scale >= 0, min >= 0) with x ≈ scale * q - min, q in 0..15."""
    lo = np.minimum(xs.min(-1), 0.0)
    hi = xs.max(-1)
    span = hi - lo
    flat = span <= 0
    inv_span = np.where(flat, 0.0, 1.0 / np.where(flat, 1.0, span))
    w = np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True)) + np.abs(xs)
    # The min/max fit: q = round(15 (x - lo) / span), x ≈ lo + span / 15 * q.
    best_scale, best_offset = span / 15, lo.copy()
    q = np.clip(np.rint((xs - lo[..., None]) * (15 * inv_span)[..., None]), 0, 15)
    best = (w * np.square(best_scale[..., None] * q + lo[..., None] - xs)).sum(-1)
    for levels in np.arange(14.0, 16.01, 0.1) if search else ():
        q = np.clip(np.rint((xs - lo[..., None]) * (levels * inv_span)[..., None]), 0, 15)
        scale, offset, err = _weighted_fit(xs, w, q, with_offset=True)
        better = (err < best) & (scale >= 0) & ~flat
        best = np.where(better, err, best)
        best_scale = np.where(better, scale, best_scale)
        best_offset = np.where(better, offset, best_offset)
    return np.maximum(best_scale, 0.0), -best_offset


def quantize_q4_k(w: np.ndarray, search: bool = True) -> np.ndarray:
    """A (rows, cols) float matrix as Q4_K bytes, (rows, cols / 256 * 144) uint8."""
    x, rows = _super_blocks(w)
    xs = x.reshape(-1, 8, 32)  # (N, sub-block, weight)
    scales, mins = _search_q4(xs, search)
    d = _fp16_scale_at_least(scales.max(-1) / 63)
    dmin = _fp16_scale_at_least(mins.max(-1) / 63)
    sc = _grid(scales, d, 0, 63)
    mn = _grid(mins, dmin, 0, 63)
    step = d.astype(np.float32)[:, None] * sc  # (N, 8), exactly what the decoder multiplies
    offset = dmin.astype(np.float32)[:, None] * mn
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((xs + offset[..., None]) / step[..., None])
    q = np.clip(np.where(step[..., None] > 0, q, 0), 0, 15).astype(np.uint8)
    return pack_q4_k(d, dmin, sc.astype(np.uint8), mn.astype(np.uint8), q).reshape(rows, -1)


def _grid(values: np.ndarray, d: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """values / d rounded to integers in [lo, hi] (0 where d is 0), as float32."""
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(d32 > 0, np.rint(values / d32), 0)
    return np.clip(k, lo, hi).astype(np.float32)


def pack_q4_k(
    d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, q: np.ndarray
) -> np.ndarray:
    """Q4_K blocks from fp16 d, dmin (N,), 6-bit sc, mn (N, 8) and 4-bit q (N, 8, 32)."""
    n = d.shape[0]
    out = np.empty((n, Q4_K_BYTES), dtype=np.uint8)
    out[:, 0:2] = d.astype("<f2").reshape(n, 1).view(np.uint8)
    out[:, 2:4] = dmin.astype("<f2").reshape(n, 1).view(np.uint8)
    # Sub-blocks 0-3 keep their 6 bits in bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7
    # put their low 4 bits in bytes 8-11 and their top 2 bits in the spare top bits of 0-7.
    out[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    # Each 32 bytes hold two sub-blocks: the even one in the low nibbles, the odd one high.
    pairs = q.reshape(n, 4, 2, 32)
    out[:, 16:] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    return out


def _search_q6(xs: np.ndarray, search: bool) -> np.ndarray:
    """Per sub-block a signed scale with x ≈ scale * q, q in -32..31."""
    pick = np.argmax(np.abs(xs), axis=-1)[..., None]
    amax = np.take_along_axis(xs, pick, axis=-1)[..., 0]  # signed: it maps to -32
    zero = amax == 0
    inv = np.where(zero, 0.0, -1.0 / np.where(zero, 1.0, amax))
    w = np.mean(xs * xs, axis=-1, keepdims=True) + xs * xs
    best_scale = -amax / 32
    q = np.clip(np.rint(xs * (32 * inv)[..., None]), -32, 31)
    best = (w * np.square(best_scale[..., None] * q - xs)).sum(-1)
    for levels in np.arange(31.1, 32.91, 0.1) if search else ():
        q = np.clip(np.rint(xs * (levels * inv)[..., None]), -32, 31)
        scale, _, err = _weighted_fit(xs, w, q, with_offset=False)
        better = (err < best) & ~zero
        best = np.where(better, err, best)
        best_scale = np.where(better, scale, best_scale)
    return best_scale


def quantize_q6_k(w: np.ndarray, search: bool = True) -> np.ndarray:
    """A (rows, cols) float matrix as Q6_K bytes, (rows, cols / 256 * 210) uint8."""
    x, rows = _super_blocks(w)
    xs = x.reshape(-1, 16, 16)  # (N, sub-block, weight)
    scales = _search_q6(xs, search)
    d = _fp16_scale_at_least(np.abs(scales).max(-1) / 127)
    sc = _grid(scales, d, -127, 127)
    step = d.astype(np.float32)[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(xs / step[..., None])
    q = np.clip(np.where(step[..., None] != 0, q, 0), -32, 31)
    packed = pack_q6_k(d, sc.astype(np.int8), (q + 32).astype(np.uint8).reshape(-1, QK_K))
    return packed.reshape(rows, -1)


def pack_q6_k(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q6_K blocks from fp16 d (N,), int8 sc (N, 16) and 6-bit q (N, 256) stored as q + 32."""
    n = d.shape[0]
    out = np.empty((n, Q6_K_BYTES), dtype=np.uint8)
    # Each half of 128 weights: its low nibbles in 64 bytes (weights b and b + 64 share a
    # byte), its top 2 bits in 32 bytes (weights b, b + 32, b + 64, b + 96 share one).
    low = (q & 0x0F).reshape(n, 2, 2, 64)
    high = (q >> 4).reshape(n, 2, 4, 32)
    out[:, :128] = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    out[:, 128:192] = (
        high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    ).reshape(n, 64)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = d.astype("<f2").reshape(n, 1).view(np.uint8)
    return out
