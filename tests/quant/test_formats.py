"""fp8 / fp4 / E8M0 codecs and the fp8, MX and NVFP4 block formats: against torch's float8
dtypes and hand-computed values; ties, saturation and NaN; round trips; error bounds."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import KilnError
from kiln.quant import formats as fm
from kiln.quant.formats import E2M1, E4M3, E5M2, Minifloat
from tests.fixtures import single_torch_thread

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)

ALL_CODES = torch.arange(256, dtype=torch.uint8)
TORCH_FP8 = [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN, and the same sign of zero."""
    nan = torch.isnan(a)
    return bool(
        torch.equal(nan, torch.isnan(b))
        and torch.equal(a[~nan], b[~nan])
        and torch.equal(torch.signbit(a[~nan]), torch.signbit(b[~nan]))
    )


def finite_values(fmt: Minifloat) -> torch.Tensor:
    """Every finite value of fmt, sorted (one zero)."""
    v = fm.decode(torch.arange(2**fmt.bits, dtype=torch.uint8), fmt)
    return v[torch.isfinite(v)].unique().sort().values


@pytest.mark.parametrize(("fmt", "dtype"), TORCH_FP8)
def test_decoding_every_fp8_code_matches_torch(fmt: Minifloat, dtype: torch.dtype) -> None:
    assert same(fm.decode(ALL_CODES, fmt), ALL_CODES.view(dtype).float())


@pytest.mark.parametrize(("fmt", "dtype"), TORCH_FP8)
def test_encoding_matches_torchs_cast_including_every_tie(
    fmt: Minifloat, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(50_000, generator=gen) * torch.exp(torch.randn(50_000, generator=gen) * 5)
    values = finite_values(fmt)
    ties = (values[1:] + values[:-1]) / 2  # exactly halfway: round to the even mantissa
    x = torch.cat([spread.clamp(-fmt.max_normal, fmt.max_normal), values, ties, -ties])
    assert torch.equal(fm.encode(x, fmt), x.to(dtype).view(torch.uint8))


def test_e4m3_saturates_like_torch_and_e5m2_overflows_to_inf_like_torch() -> None:
    big = torch.tensor([464.0, 1e6, float("inf"), -1e9, float("-inf")])
    # torch's float8_e4m3fn cast saturates (it has no inf): so does kiln's e4m3
    assert torch.equal(fm.encode(big, E4M3), big.to(torch.float8_e4m3fn).view(torch.uint8))
    assert fm.decode(fm.encode(big, E4M3), E4M3).tolist() == [448, 448, 448, -448, -448]
    # torch's float8_e5m2 cast does not saturate: saturate=False is the same cast
    over = torch.tensor([61440.0, 1e6, float("inf"), -1e9])
    assert torch.equal(
        fm.encode(over, E5M2, saturate=False), over.to(torch.float8_e5m2).view(torch.uint8)
    )
    assert fm.decode(fm.encode(over, E5M2), E5M2).tolist() == [57344, 57344, 57344, -57344]
    with pytest.raises(KilnError, match="e4m3 has no infinity"):
        fm.encode(big, E4M3, saturate=False)


def test_nan_encodes_as_nan_where_the_format_has_one() -> None:
    nan = torch.tensor([float("nan")])
    assert fm.encode(nan, E4M3).item() == 0x7F and torch.isnan(
        fm.decode(fm.encode(nan, E4M3), E4M3)
    )
    assert torch.isnan(fm.decode(fm.encode(nan, E5M2), E5M2)).all()
    with pytest.raises(KilnError, match="e2m1 has no NaN"):
        fm.encode(nan, E2M1)


def test_hand_computed_codes() -> None:
    e4m3 = {1.0: 0x38, 448.0: 0x7E, -(2.0**-9): 0x81, 2.0**-6: 0x08, 0.0: 0x00, -2.0: 0xC0,
            1.0625: 0x38, 1.1875: 0x3A, 2.0**-10: 0x00, 3 * 2.0**-10: 0x02}  # fmt: skip
    e5m2 = {1.0: 0x3C, 57344.0: 0x7B, 2.0**-16: 0x01, -0.75: 0xBA}
    e2m1 = {0.0: 0x0, 0.5: 0x1, 1.0: 0x2, 1.5: 0x3, 2.0: 0x4, 3.0: 0x5, 4.0: 0x6, 6.0: 0x7,
            -3.0: 0xD, 0.25: 0x0, 0.75: 0x2, 2.5: 0x4, 5.0: 0x6, 7.0: 0x7, -100.0: 0xF}  # fmt: skip
    for fmt, table in ((E4M3, e4m3), (E5M2, e5m2), (E2M1, e2m1)):
        x = torch.tensor(list(table))
        assert fm.encode(x, fmt).tolist() == list(table.values()), fmt.name
    assert fm.decode(torch.arange(8, dtype=torch.uint8), E2M1).tolist() == [
        0, 0.5, 1, 1.5, 2, 3, 4, 6
    ]  # fmt: skip


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1])
def test_every_code_round_trips(fmt: Minifloat) -> None:
    codes = torch.arange(2**fmt.bits, dtype=torch.uint8)
    values = fm.decode(codes, fmt)
    keep = ~torch.isnan(values)  # e5m2 has several NaN codes; encode writes one of them
    assert torch.equal(fm.encode(values[keep], fmt, saturate=not fmt.has_inf), codes[keep])


def test_e8m0_scales_match_torch() -> None:
    ref = ALL_CODES.view(torch.float8_e8m0fnu).float()
    assert same(fm.decode_e8m0(ALL_CODES), ref)
    exps = torch.arange(-127, 128)
    assert torch.equal(
        fm.encode_e8m0(exps),
        torch.ldexp(torch.ones(255), exps).to(torch.float8_e8m0fnu).view(torch.uint8),
    )


def test_fp4_packs_two_codes_per_byte() -> None:
    codes = torch.randint(0, 16, (5, 10), dtype=torch.uint8)
    packed = fm.pack_nibbles(codes)
    assert packed.shape == (5, 5) and packed[0, 0] == codes[0, 0] * 16 + codes[0, 1]
    assert torch.equal(fm.unpack_nibbles(packed), codes)


def weight(n: int = 200, k: int = 352, seed: int = 0) -> torch.Tensor:
    """Rows of very different scales and heavy-tailed values (scaling granularity matters)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n)[:, None]
    return w * torch.exp(torch.randn(n, k, generator=gen) * 0.5)


def rounding_bound(ratio: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """Half a step of fmt at each |value| (in scaled units): relative for normals, else absolute."""
    return torch.maximum(
        ratio.abs() * 2.0 ** -(fmt.man_bits + 1),
        torch.tensor(2.0 ** (fmt.min_exp - fmt.man_bits - 1)),
    )


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["tensor", "1x128", "128x128"])
def test_fp8_round_trip_is_within_half_a_step(fmt: str, scaling: str) -> None:
    w = weight()
    enc = fm.quantize_fp8(w, fmt, scaling)
    f = fm.FORMATS[fmt]
    N, K = w.shape
    rows = {"tensor": N, "1x128": 1, "128x128": 128}[scaling]
    cols = K if scaling == "tensor" else 128
    assert enc.codes.shape == (N, K) and enc.codes.dtype == torch.uint8
    assert enc.scales.numel() == -(-N // rows) * -(-K // cols)
    scale = torch.empty_like(w)
    for i in range(0, N, rows):
        for j in range(0, K, cols):
            tile = w[i : i + rows, j : j + cols]
            scale[i : i + rows, j : j + cols] = tile.abs().max() / f.max_normal
    err = (enc.decode() - w).abs()
    assert (err <= rounding_bound(w / scale, f) * scale * (1 + 1e-6)).all()


def row_error(got: torch.Tensor, w: torch.Tensor) -> float:
    """The mean over rows of each row's relative error: small rows count as much as big ones."""
    return float(((got - w).norm(dim=1) / w.norm(dim=1)).mean())


def test_finer_fp8_scaling_is_more_accurate() -> None:
    w = weight()  # rows from 1e-3 to 10: one scale per tensor pushes small rows to subnormals
    err = {s: row_error(fm.quantize_fp8(w, "e4m3", s).decode(), w) for s in fm.FP8_SCALINGS}
    assert err["1x128"] < err["128x128"] < err["tensor"]
    e5m2 = row_error(fm.quantize_fp8(w, "e5m2", "1x128").decode(), w)
    assert err["1x128"] < e5m2  # one more mantissa bit beats range the scale already gives


@pytest.mark.parametrize("elem", ["e4m3", "e2m1"])
def test_mx_scales_are_powers_of_two_and_elements_within_half_a_step(elem: str) -> None:
    w = weight()
    enc = fm.quantize_mx(w, elem)
    f = fm.FORMATS[elem]
    blocks = w.reshape(w.size(0), -1, 32)
    X = fm.decode_e8m0(enc.scales)  # (N, K/32)
    assert enc.scales.shape == blocks.shape[:2]
    ratio = blocks.abs().amax(-1) / X
    # the spec's shared exponent floor(log2 amax) - emax_elem: amax / X in [2^emax, 2^(emax+1))
    assert ((ratio >= 2**f.emax) & (ratio < 2 ** (f.emax + 1))).all()
    r = blocks / X[..., None]
    got = enc.decode().reshape(blocks.shape) / X[..., None]
    inside = r.abs() <= f.max_normal
    assert ((got - r).abs()[inside] <= rounding_bound(r, f)[inside]).all()
    assert torch.equal(got[~inside], torch.sign(r[~inside]) * f.max_normal)  # saturated
    assert enc.codes.shape == ((w.size(0), w.size(1) // 2) if elem == "e2m1" else w.shape)


def test_hand_computed_mx_blocks() -> None:
    w = torch.zeros(2, 32)
    w[0, :3] = torch.tensor([7.0, 1.0, 0.3])  # row 1 stays zero: the smallest scale
    mx4 = fm.quantize_mx(w, "e2m1")
    assert mx4.scales.tolist() == [[127], [0]]  # 7 -> 2^(2 - 2) = 1
    assert mx4.decode()[0, :4].tolist() == [6.0, 1.0, 0.5, 0.0]  # 7 saturates to 6
    assert torch.equal(mx4.decode()[1], torch.zeros(32))
    mx8 = fm.quantize_mx(w, "e4m3")
    assert mx8.scales[0].item() == 127 - 6  # 2^(2 - 8): 7 -> 448, 0.3 -> 19.2 -> 20 (step 2)
    assert mx8.decode()[0, :3].tolist() == [7.0, 1.0, 20 * 2.0**-6]
    w[1, 5] = float("nan")  # a NaN makes its block's scale NaN (the spec's rule)
    assert fm.quantize_mx(w, "e4m3").scales[1].item() == 0xFF
    assert torch.isnan(fm.quantize_mx(w, "e2m1").decode()[1]).all()


def test_hand_computed_nvfp4_block() -> None:
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([6.0, 3.0, -1.0, 0.2])  # block 0: amax 6, the tensor's amax
    w[0, 16] = 0.75  # block 1
    enc = fm.quantize_nvfp4(w)
    t = 6.0 / (448 * 6)
    assert enc.tensor_scale is not None and enc.tensor_scale.item() == pytest.approx(t)
    assert enc.scales[0, 0].item() == 0x7E  # block scale 6/6/t = 448 in e4m3
    # block 1: 0.75/6/t = 56 exactly in e4m3; scale 56·t = 0.125, 0.75 -> 6 exactly
    assert fm.decode(enc.scales, E4M3)[0, 1].item() == 56.0
    got = enc.decode()[0]
    assert got[:4].tolist() == pytest.approx(
        [6.0, 3.0, -1.0, 0.0]
    )  # 0.2 -> 0 (half of 0.5 is 0.25)
    assert got[16].item() == pytest.approx(0.75)
    assert enc.codes.shape == (1, 16)
    with pytest.raises(KilnError, match="NVFP4 needs finite values"):
        fm.quantize_nvfp4(torch.tensor([[float("inf")] * 16]))


def test_nvfp4_round_trip_bound_and_formats_rank_by_error() -> None:
    w = weight()
    enc = fm.quantize_nvfp4(w)
    assert enc.tensor_scale is not None
    s = fm.decode(enc.scales, E4M3) * enc.tensor_scale  # (N, K/16)
    blocks = w.reshape(w.size(0), -1, 16)
    r = torch.where(s[..., None] > 0, blocks / s[..., None], torch.zeros_like(blocks))
    got = enc.decode().reshape(blocks.shape)
    inside = r.abs() <= 6
    err = (got - blocks).abs()
    bound = torch.where(s[..., None] > 0, rounding_bound(r, E2M1) * s[..., None], blocks.abs())
    assert (err[inside] <= bound[inside] * (1 + 1e-6)).all()
    mse = {
        name: row_error(e.decode(), w)
        for name, e in {"fp8": fm.quantize_fp8(w, "e4m3", "1x128"), "mxfp8": fm.quantize_mx(w),
                        "nvfp4": enc, "mxfp4": fm.quantize_mx(w, "e2m1")}.items()
    }  # fmt: skip
    assert mse["fp8"] < mse["nvfp4"] and mse["mxfp8"] < mse["nvfp4"] < mse["mxfp4"]


def test_a_last_partial_block_is_padded_and_cropped() -> None:
    w = weight(n=130, k=200)  # 200 is no multiple of 128, 32 or 16; 130 none of 128
    for enc in (
        fm.quantize_fp8(w, "e4m3", "128x128"),
        fm.quantize_mx(w, "e2m1"),
        fm.quantize_nvfp4(w),
    ):
        got = enc.decode()
        assert got.shape == w.shape
        assert float((got - w).norm() / w.norm()) < 0.2, enc.mode
    assert fm.quantize_fp8(w, "e4m3", "128x128").scales.shape == (2, 2)
    assert fm.quantize_mx(w, "e4m3").scales.shape == (130, 7)


def test_bad_fp8_settings_fail_clearly() -> None:
    with pytest.raises(KilnError, match=r"fp8 format must be one of e4m3, e5m2, got 'e3m4'"):
        fm.quantize_fp8(weight(), "e3m4")
    with pytest.raises(
        KilnError, match=r"fp8 scaling must be one of tensor, 1x128, 128x128, got '64'"
    ):
        fm.quantize_fp8(weight(), "e4m3", "64")


def test_mx_and_nvfp4_agree_with_torchao_where_it_installs() -> None:
    """torchao's reference casts (its prototype mx_formats; not installed in kiln's .venv)."""
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    w = weight(256, 512)
    w[3, :32] = 0  # an all-zero block
    for elem, dtype in (("e4m3", torch.float8_e4m3fn), ("e2m1", torch.float4_e2m1fn_x2)):
        scale, data = to_mx(w, dtype, 32)  # the spec's FLOOR scale, torchao's default
        mine = fm.quantize_mx(w, elem)
        assert torch.equal(scale.view(torch.uint8), mine.scales), elem
        assert torch.equal(to_dtype(data, scale, dtype, 32, torch.float32), mine.decode()), elem
    t = per_tensor_amax_to_scale(w.abs().amax())
    scale, data = nvfp4_quantize(w, 16, t)
    mine = fm.quantize_nvfp4(w)
    assert mine.tensor_scale is not None and torch.equal(mine.tensor_scale, t.reshape(1))
    theirs = (
        f4_unpacked_to_f32(unpack_uint4(data)).reshape(256, -1, 16) * (scale.float() * t)[..., None]
    )
    ours = mine.decode().reshape(256, -1, 16)
    # The one difference: torchao clamps block scales up to e4m3's smallest normal (2^-6);
    # kiln keeps e4m3's subnormal scales, so tiny blocks lose less. Everywhere else: equal.
    differ = scale.view(torch.uint8) != mine.scales
    assert (fm.decode(mine.scales, E4M3)[differ] < 2**-6).all()
    assert (scale.float()[differ] == 2**-6).all()
    assert torch.equal(theirs[~differ], ours[~differ])
    blocks = w.reshape(256, -1, 16)[differ]
    assert (ours[differ] - blocks).pow(2).sum() <= (theirs[differ] - blocks).pow(2).sum()
