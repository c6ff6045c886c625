"""Q4_K / Q6_K blocks written by kiln.quant.kquants decode, through the gguf package's own reader,
to the values they were meant to hold.

Error bounds (derived in kiln/quant/kquants.py's docstring), per sub-block, importance-weighted
RMS with the quantizer's weights w:
- Q4_K (32 weights, w = rms + |x|): the min/max fit is one of the candidates, so before the 6-bit
  scale rounding the error is at most (max - min') / 30 (min' = min(min, 0), half of one of 15
  steps); rounding the scale to d's grid moves each value by at most 15 · d/2 and the min by
  dmin/2, so the bound is (max - min') / 30 + 7.5 d + dmin / 2.
- Q6_K (16 weights, w = rms² + x²): the min/max fit maps |amax| to 32 steps; a value of the other
  sign may clip from +32 to +31 steps, so at most |amax| / 32 before rounding, plus 32 · d/2.
Weights inside a sub-block's representable range are within half its step (round to nearest).
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln.quant.kquants import pack_q4_k, pack_q6_k, quantize_q4_k, quantize_q6_k

gguf = pytest.importorskip("gguf", reason="the gguf extra is not installed")
Q = gguf.GGMLQuantizationType
F32_SLACK = 1e-6  # float32 arithmetic in the fit and the decode, relative to the values (~1)


def _decode(blocks: np.ndarray, qtype: object, shape: tuple[int, int]) -> np.ndarray:
    return gguf.quants.dequantize(blocks, qtype).reshape(shape)


def _weights(rows: int = 48, cols: int = 512, seed: int = 0) -> np.ndarray:
    """Weights with the spread real matrices have: heavy tails, some rows far larger than others."""
    rng = np.random.default_rng(seed)
    w = rng.standard_t(4, size=(rows, cols)) * np.exp(rng.normal(0, 1, size=(rows, 1)))
    w[0, :32] = 0.0  # a flat sub-block
    w[1, :32] = np.abs(w[1, :32]) + 3.0  # all positive: the min is held at 0
    w[2, 32:64] = -np.abs(w[2, 32:64]) - 1.0  # all negative
    return w.astype(np.float32)


def _weighted_rms(err: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Per sub-block sqrt(sum w e² / sum w); an all-zero sub-block (no weight) by its largest e."""
    total = weight.sum(-1)
    safe = np.where(total > 0, total, 1.0)
    return np.where(total > 0, np.sqrt((weight * err**2).sum(-1) / safe), np.abs(err).max(-1))


def _fields_q4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """d, dmin (N,), and the per-sub-block step d·sc and offset dmin·mn (N, 8), as decoded."""
    b = blocks.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    sc, mn = gguf.quants.Q4_K.get_scale_min(b[:, 4:16].copy())
    return d, dmin, d[:, None] * sc, dmin[:, None] * mn


def test_q4_k_round_trips_within_its_bound_and_the_search_beats_min_max() -> None:
    w = _weights()
    packed = quantize_q4_k(w)
    assert packed.shape == (48, 512 // 256 * 144) and packed.dtype == np.uint8
    got = _decode(packed, Q.Q4_K, w.shape)
    xs, ys = w.reshape(-1, 8, 32), got.reshape(-1, 8, 32)
    d, dmin, step, offset = _fields_q4(packed)
    weight = np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True)) + np.abs(xs)
    wrms = _weighted_rms(ys - xs, weight)
    span = xs.max(-1) - np.minimum(xs.min(-1), 0)
    bound = span / 30 + 7.5 * d[:, None] + dmin[:, None] / 2
    assert (wrms <= bound * (1 + 1e-5) + F32_SLACK).all()
    # Inside [-offset, -offset + 15 step] the value is the nearest grid point.
    inside = (xs >= -offset[..., None]) & (xs <= (15 * step - offset)[..., None])
    assert inside.mean() > 0.9
    err = np.abs(ys - xs)
    assert (err[inside] <= np.broadcast_to(step[..., None] / 2, xs.shape)[inside] + 1e-5).all()
    np.testing.assert_allclose(got[0, :32], 0.0, atol=1e-6)  # a flat zero sub-block stays 0
    # The small search is worth having: a smaller error than the plain min/max fit.
    plain = _decode(quantize_q4_k(w, search=False), Q.Q4_K, w.shape)
    assert np.mean((got - w) ** 2) < 0.95 * np.mean((plain - w) ** 2)


def test_q6_k_round_trips_within_its_bound_and_the_search_beats_min_max() -> None:
    w = _weights(seed=1)
    packed = quantize_q6_k(w)
    assert packed.shape == (48, 512 // 256 * 210)
    got = _decode(packed, Q.Q6_K, w.shape)
    xs, ys = w.reshape(-1, 16, 16), got.reshape(-1, 16, 16)
    b = packed.reshape(-1, 210)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)[:, 0]
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    weight = np.mean(xs * xs, axis=-1, keepdims=True) + xs * xs
    wrms = _weighted_rms(ys - xs, weight)
    bound = np.abs(xs).max(-1) / 32 + 16 * d[:, None]
    assert (wrms <= bound * (1 + 1e-5) + F32_SLACK).all()
    step = np.abs(d[:, None] * sc)
    inside = np.abs(xs) <= 31 * step[..., None]
    err = np.abs(ys - xs)
    assert (err[inside] <= np.broadcast_to(step[..., None] / 2, xs.shape)[inside] + 1e-5).all()
    plain = _decode(quantize_q6_k(w, search=False), Q.Q6_K, w.shape)
    assert np.mean((got - w) ** 2) < 0.95 * np.mean((plain - w) ** 2)


def test_a_hand_made_q4_k_block_has_the_documented_bytes_and_values() -> None:
    # d = 0.5, dmin = 0.25; sub-block j has scale sc[j] and min mn[j]; sub-blocks 4-7 need the
    # 6th bits (values >= 16, >= 32) that live in the top bits of bytes 0-7.
    sc = np.array([[1, 2, 3, 63, 17, 32, 48, 5]], dtype=np.uint8)
    mn = np.array([[0, 4, 8, 1, 33, 16, 2, 63]], dtype=np.uint8)
    q = ((np.arange(8)[:, None] + np.arange(32)) % 16).astype(np.uint8).reshape(1, 8, 32)
    block = pack_q4_k(np.array([0.5], np.float16), np.array([0.25], np.float16), sc, mn, q)
    raw = bytes(block[0])
    assert raw[:4] == bytes([0x00, 0x38, 0x00, 0x34])  # fp16 0.5 and 0.25, little-endian
    # bytes 0-3: sc[0..3] | top 2 bits of sc[4..7] << 6: 17 -> 01, 32 -> 10, 48 -> 11, 5 -> 00.
    assert list(raw[4:8]) == [1 | 1 << 6, 2 | 2 << 6, 3 | 3 << 6, 63]
    assert list(raw[8:12]) == [0 | 2 << 6, 4 | 1 << 6, 8, 1 | 3 << 6]  # mins 33, 16, 2, 63
    assert list(raw[12:16]) == [1 | 1 << 4, 0 | 0 << 4, 0 | 2 << 4, 5 | 15 << 4]
    # qs: byte b of each 32 holds sub-block 2g's weight b (low nibble) and 2g+1's (high).
    assert list(raw[16:18]) == [0 | 1 << 4, 1 | 2 << 4] and raw[48] == 2 | 3 << 4
    got = _decode(block, Q.Q4_K, (1, 256)).reshape(8, 32)
    expected = 0.5 * sc[0, :, None] * q[0].astype(np.float32) - 0.25 * mn[0, :, None]
    np.testing.assert_array_equal(got, expected)
    # Values on that grid quantize back to exactly themselves.
    np.testing.assert_array_equal(quantize_q4_k(expected.reshape(1, 256)), block)


def test_a_hand_made_q6_k_block_has_the_documented_bytes_and_values() -> None:
    sc = np.array([[1, -2, 3, -4, 5, -6, 7, -8, 9, -10, 11, -12, 13, -14, 15, 127]], np.int8)
    q = (np.arange(256) * 7 % 64).astype(np.uint8).reshape(1, 256)  # stored as q + 32
    block = pack_q6_k(np.array([0.125], np.float16), sc, q)
    raw = bytes(block[0])
    # Byte 0: low nibbles of weights 0 and 64; byte 128: top 2 bits of weights 0, 32, 64, 96.
    assert raw[0] == (q[0, 0] & 15) | (q[0, 64] & 15) << 4
    assert raw[128] == sum(int(q[0, k]) >> 4 << 2 * i for i, k in enumerate((0, 32, 64, 96)))
    assert raw[64] == (q[0, 128] & 15) | (q[0, 192] & 15) << 4  # the second half of the block
    assert raw[192:208] == sc.tobytes() and raw[208:] == bytes([0x00, 0x30])  # fp16 0.125
    got = _decode(block, Q.Q6_K, (1, 256))[0]
    expected = 0.125 * np.repeat(sc[0].astype(np.float32), 16) * (q[0].astype(np.float32) - 32)
    np.testing.assert_array_equal(got, expected)


def test_rows_that_are_not_whole_super_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q4_k(np.zeros((4, 288), np.float32))
