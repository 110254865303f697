"""MXFP4IndexerCodec and FP8IndexerCodec: hand-worked bytes, tie rule, properties, errors."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.codecs import FP8IndexerCodec, MXFP4IndexerCodec

MX32 = MXFP4IndexerCodec(dim=32)  # one block: 16 value bytes + 1 scale byte
MX128 = MXFP4IndexerCodec(dim=128)
FP8 = FP8IndexerCodec(dim=128)


def block(*values, dim=32):
    x = np.zeros((1, dim), np.float32)
    x[0, : len(values)] = values
    return x


def mx_row(value_bytes, scale_bytes, dim=32):
    row = np.zeros(dim // 2 + dim // 32, np.uint8)
    row[: len(value_bytes)] = value_bytes
    row[dim // 2 :] = scale_bytes
    return row


# --- geometry -------------------------------------------------------------------------


def test_geometry():
    assert (MX128.row_bytes, MX128.value_bytes, MX128.scale_bytes) == (68, 64, 4)
    assert (FP8.row_bytes, FP8.value_bytes, FP8.scale_bytes) == (132, 128, 4)
    assert MX32.row_bytes == 17
    # indexer pages are not padded
    assert MX128.page_stride_bytes(64) == 64 * 68
    assert FP8.page_stride_bytes(3) == 3 * 132
    assert FP8IndexerCodec(dim=256).row_bytes == 264


@pytest.mark.parametrize("dim", [0, -32, 16, 48, 127.0, True])
def test_bad_mxfp4_dim(dim):
    with pytest.raises(ValueError):
        MXFP4IndexerCodec(dim=dim)


@pytest.mark.parametrize("dim", [0, 64, 200, "128"])
def test_bad_fp8_dim(dim):
    with pytest.raises(ValueError):
        FP8IndexerCodec(dim=dim)


# --- MXFP4 bytes by hand -----------------------------------------------------------------


def test_mxfp4_nibble_order_and_codes():
    # amax 6 -> e = 0 (byte 127); codes 0.5:1 1:2 1.5:3 2:4 3:5 4:6 6:7;
    # element 2i in the low nibble, 2i+1 in the high nibble
    x = block(0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0)
    np.testing.assert_array_equal(MX32.encode(x)[0], mx_row([0x21, 0x43, 0x65, 0x07], 127))
    np.testing.assert_array_equal(MX32.decode(MX32.encode(x)), x)


def test_mxfp4_ties_round_to_nearest_even():
    # with 6 present (e = 0): 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4;
    # sign is nibble bit 3: -0.75 -> 0xA, -5 -> 0xE, -0.0 and -1e-30 -> 0x8 (signed zero)
    x = block(6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0, -0.0, -1e-30)
    want = mx_row([0x07, 0x22, 0x44, 0x66, 0xEA, 0x88], 127)
    np.testing.assert_array_equal(MX32.encode(x)[0], want)
    back = MX32.decode(MX32.encode(x))[0, :12]
    np.testing.assert_array_equal(back, [6, 0, 1, 1, 2, 2, 4, 4, -1, -4, 0, 0])
    assert np.signbit(back[10]) and np.signbit(back[11])


def test_mxfp4_values_next_to_ties_round_to_nearest():
    # 0.74 -> 0.5 (code 1), 0.76 -> 1.0 (code 2), 3.49 -> 3 (code 5), 3.51 -> 4 (code 6)
    x = block(6.0, 0.74, 0.76, 3.49, 3.51, 0.0)
    np.testing.assert_array_equal(MX32.encode(x)[0], mx_row([0x17, 0x52, 0x06], 127))


def test_mxfp4_scale_bytes():
    # all-zero block: a = 6 * 2^-126 (the kernels' floor) -> e = -126 -> byte 1
    np.testing.assert_array_equal(MX32.encode(block())[0], mx_row([], 1))
    # 1e-5 is far above that floor: e = ceil(log2(1e-5 / 6)) = ceil(-19.19) = -19 (byte 108),
    # 1e-5 * 2^19 = 5.24 -> 6 (code 7)
    np.testing.assert_array_equal(MX32.encode(block(1e-5))[0], mx_row([0x07], 108))
    # under the floor: 2^-128 (subnormal) * 2^126 = 0.25 ties to 0 (code 0); 3 * 2^-128 -> 0.75 -> 1.0
    np.testing.assert_array_equal(MX32.encode(block(2.0**-128))[0], mx_row([0x00], 1))
    np.testing.assert_array_equal(MX32.encode(block(3 * 2.0**-128))[0], mx_row([0x02], 1))
    # exactly the floor: 6 * 2^-126 -> e = -126, 6 (code 7); one ulp above -> e = -125
    np.testing.assert_array_equal(MX32.encode(block(6 * 2.0**-126))[0], mx_row([0x07], 1))
    np.testing.assert_array_equal(
        MX32.encode(block(np.nextafter(np.float32(6 * 2.0**-126), np.float32(1))))[0], mx_row([0x05], 2)
    )
    # 12 -> e = 1 (byte 128), 12/2 = 6 (code 7); 7 -> e = 1, 7/2 = 3.5 ties to 4 (code 6)
    np.testing.assert_array_equal(MX32.encode(block(12.0))[0], mx_row([0x07], 128))
    np.testing.assert_array_equal(MX32.encode(block(7.0))[0], mx_row([0x06], 128))
    # 3 -> e = -1 (byte 126), 3/0.5 = 6; 6 * 2^-10 exactly -> e = -10 (byte 117)
    np.testing.assert_array_equal(MX32.encode(block(3.0))[0], mx_row([0x07], 126))
    np.testing.assert_array_equal(MX32.encode(block(6 * 2.0**-10))[0], mx_row([0x07], 117))
    # one ulp above 6 -> e = 1: 3.0000002 -> 3 (code 5)
    np.testing.assert_array_equal(
        MX32.encode(block(np.nextafter(np.float32(6), np.float32(7))))[0], mx_row([0x05], 128)
    )


def test_mxfp4_four_scale_bytes_in_block_order():
    x = np.zeros((1, 128), np.float32)
    for b in range(4):
        x[0, 32 * b : 32 * (b + 1)] = 6.0 * 2.0**b
    row = MX128.encode(x)[0]
    np.testing.assert_array_equal(row[:64], np.full(64, 0x77))
    np.testing.assert_array_equal(row[64:], [127, 128, 129, 130])
    np.testing.assert_array_equal(MX128.decode(row[None]), x)


def test_mxfp4_decode_hand_bytes():
    rows = np.zeros((3, 17), np.uint8)
    rows[0, 0], rows[0, 16] = 0xF7, 127  # [6, -6]
    rows[1, 0], rows[1, 16] = 0x91, 130  # [0.5 * 8, -0.5 * 8]
    rows[2, 0], rows[2, 16] = 0x71, 255  # [0.5 * 2^128 = 2^127, 6 * 2^128 = inf]
    out = MX32.decode(rows)
    np.testing.assert_array_equal(out[:, :2], [[6, -6], [4, -4], [2.0**127, np.inf]])
    assert not out[:, 2:].any()


def test_mxfp4_rounding_matches_the_ml_dtypes_cast():
    """Cross-check against an independent RNE implementation (the OCP e2m1 cast)."""
    rng = np.random.default_rng(3)
    scaled = rng.uniform(-6, 6, (200, 32)).astype(np.float32)
    scaled[:, 0] = 6.0  # pins e = 0, so the codec rounds exactly these values
    grid = np.float32([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6])
    scaled[:15, 1:16] = grid
    scaled[15:30, 1:16] = -grid
    want = scaled.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(MX32.fake_quantize(scaled).view(np.uint32), want.view(np.uint32))


# --- FP8 indexer bytes by hand --------------------------------------------------------------


def fp8_row(value_bytes, scale_le_bytes, dim=128):
    row = np.zeros(dim + 4 * (dim // 128), np.uint8)
    row[: len(value_bytes)] = value_bytes
    row[dim:] = scale_le_bytes
    return row


def test_fp8_indexer_bytes():
    # amax 448 -> scale 1.0 = 0x3F800000 -> little-endian 00 00 80 3F
    x = block(448.0, -1.0, 0.5, -0.0, dim=128)
    want = fp8_row([0x7E, 0xB8, 0x30, 0x80], [0x00, 0x00, 0x80, 0x3F])
    np.testing.assert_array_equal(FP8.encode(x)[0], want)
    np.testing.assert_array_equal(FP8.decode(FP8.encode(x)), x)
    # all zero: scale 2^-22 -> exponent field 105 -> 0x34800000
    np.testing.assert_array_equal(FP8.encode(block(dim=128))[0], fp8_row([], [0, 0, 0x80, 0x34]))
    # 449 -> scale 2 = 0x40000000, 449 / 2 = 224.5 -> 224 (0x76)
    np.testing.assert_array_equal(
        FP8.encode(block(449.0, dim=128))[0], fp8_row([0x76], [0, 0, 0, 0x40])
    )


def test_fp8_indexer_two_blocks_two_scales():
    codec = FP8IndexerCodec(dim=256)
    x = np.zeros((1, 256), np.float32)
    x[0, 0], x[0, 128] = 448.0, 896.0
    row = codec.encode(x)[0]
    assert row[0] == 0x7E and row[128] == 0x7E
    np.testing.assert_array_equal(row[256:], [0, 0, 0x80, 0x3F, 0, 0, 0, 0x40])


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("codec", [MX128, FP8], ids=["mxfp4", "fp8"])
@pytest.mark.parametrize(
    "bad",
    [np.zeros((1, 64), np.float32), np.zeros((1, 128), np.int64), np.zeros((1, 128), object), "x"],
)
def test_encode_rejects_bad_arrays(codec, bad):
    for fn in (codec.encode, codec.fake_quantize):
        with pytest.raises(ValueError):
            fn(bad)


@pytest.mark.parametrize("codec", [MX128, FP8], ids=["mxfp4", "fp8"])
@pytest.mark.parametrize(
    "value, message", [(np.nan, "row 2"), (-np.inf, "NaN or infinity"), (3.35e38, "too large")]
)
def test_encode_rejects_non_finite_and_too_large(codec, value, message):
    x = np.ones((4, 128), np.float32)
    x[2, 100] = value
    for fn in (codec.encode, codec.fake_quantize):
        with pytest.raises(ValueError, match=message):
            fn(x)


def test_mxfp4_largest_accepted_value_decodes_finite():
    below = np.nextafter(np.float32(3.5 * 2.0**126), np.float32(0))
    assert MX32.decode(MX32.encode(block(below)))[0, 0] == np.float32(3 * 2.0**126)
    with pytest.raises(ValueError, match="too large"):
        MX32.encode(block(3.5 * 2.0**126))


@pytest.mark.parametrize("codec", [MX128, FP8], ids=["mxfp4", "fp8"])
def test_decode_rejects_bad_rows(codec):
    for bad in (np.zeros((1, codec.row_bytes), np.float32), np.zeros((1, codec.row_bytes + 1), np.uint8)):
        with pytest.raises(ValueError):
            codec.decode(bad)


# --- properties ------------------------------------------------------------------------------

E2M1_GRID = np.float32([0, 0.5, 1, 1.5, 2, 3, 4, 6])
E2M1_TIES = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5])
_E4M3_ALL = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
E4M3_GRID = np.unique(_E4M3_ALL[np.isfinite(_E4M3_ALL)])
E4M3_TIES = ((E4M3_GRID[1:].astype(np.float64) + E4M3_GRID[:-1]) / 2).astype(np.float32)
FORMATS = {
    "mxfp4": (MX128, 32, E2M1_GRID, E2M1_TIES),
    "fp8": (FP8, 128, E4M3_GRID, E4M3_TIES),
}
specials = st.one_of(
    st.floats(-(2.0**100), 2.0**100, width=32),
    st.sampled_from([0.0, -0.0, 1e-4, -1e-4, 6.0, 3.0, 3.2, 448.0, 224.0, 1e-30]),
)


@st.composite
def inputs(draw, fmt):
    """float32 [n, 128]: per block a drawn scale and shape (noise, grid values, ties, zeros),
    signs at random, plus a few special values; dense data from a drawn seed."""
    codec, block_len, grid, ties = FORMATS[fmt]
    n = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = np.empty((n, codec.dim), np.float32)
    for r in range(n):
        for b in range(codec.dim // block_len):
            kind = draw(st.sampled_from(["noise", "grid", "ties", "zeros"]))
            scale = np.float32(2.0 ** draw(st.integers(-40, 90)))
            source = {"grid": grid, "ties": ties}.get(kind)
            if kind == "noise":
                values = rng.standard_normal(block_len)
            elif kind == "zeros":
                values = np.zeros(block_len)
            else:
                values = rng.choice(source, block_len) * rng.choice([-1.0, 1.0], block_len)
            x[r, block_len * b : block_len * (b + 1)] = values.astype(np.float32) * scale
    for _ in range(draw(st.integers(0, 6))):
        x[draw(st.integers(0, n - 1)), draw(st.integers(0, codec.dim - 1))] = draw(specials)
    return x


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("fmt", FORMATS)
@given(data=st.data())
def test_decode_encode_equals_fake_quantize_bitwise(fmt, data):
    codec = FORMATS[fmt][0]
    x = data.draw(inputs(fmt))
    np.testing.assert_array_equal(bits(codec.decode(codec.encode(x))), bits(codec.fake_quantize(x)))


def mx_block_parts(rows, r, b):
    codes = np.empty(32, np.uint8)
    codes[0::2] = rows[r, 16 * b : 16 * (b + 1)] & 0xF
    codes[1::2] = rows[r, 16 * b : 16 * (b + 1)] >> 4
    return codes, rows[r, 64 + b]


def fp8_block_parts(rows, r, b):
    return rows[r, :128], rows[r, 128:132].view(np.float32)[0]


@pytest.mark.parametrize("fmt", FORMATS)
@given(data=st.data())
def test_reencoding_is_idempotent(fmt, data):
    """Values are a fixed point at once. Bytes too, except blocks whose largest |q| is half
    the format maximum (e2m1 3 = code 5, e4m3 224 = 0x76) and whose scale is above the floor
    (MXFP4 byte 1, FP8 2^-22): those re-encode one exponent lower with q doubled."""
    codec = FORMATS[fmt][0]
    x = data.draw(inputs(fmt))
    first = codec.encode(x)
    values = codec.decode(first)
    second = codec.encode(values)
    np.testing.assert_array_equal(bits(codec.decode(second)), bits(values))
    np.testing.assert_array_equal(codec.encode(codec.decode(second)), second)
    for r in range(first.shape[0]):
        if fmt == "mxfp4":
            for b in range(4):
                (c1, s1), (c2, s2) = mx_block_parts(first, r, b), mx_block_parts(second, r, b)
                if (c1 & 7).max() == 5 and s1 > 1:
                    assert s2 == s1 - 1
                    v1 = c1.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
                    v2 = c2.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
                    np.testing.assert_array_equal(v2, 2 * v1)
                else:
                    assert s2 == s1
                    np.testing.assert_array_equal(c2, c1)
        else:
            (q1, s1), (q2, s2) = fp8_block_parts(first, r, 0), fp8_block_parts(second, r, 0)
            if (q1 & 0x7F).max() == 0x76 and s1 > 2.0**-22:
                assert s2 == s1 / 2
                f1, f2 = (q.view(ml_dtypes.float8_e4m3fn).astype(np.float32) for q in (q1, q2))
                np.testing.assert_array_equal(f2, 2 * f1)
            else:
                assert s2 == s1
                np.testing.assert_array_equal(q2, q1)


@given(data=st.data())
def test_mxfp4_encoding_matches_an_independent_reference(data):
    """Bytes equal a straightforward reference: exponent from float64 log2 (safe away from
    exact powers of two, which the hand tests cover), ml_dtypes e2m1 cast, nibble packing."""
    x = data.draw(inputs("mxfp4"))
    blocks = x.reshape(-1, 4, 32).astype(np.float64)
    amax = np.maximum(np.abs(blocks).max(-1), 6.0 * 2.0**-126)
    ratio = np.log2(amax / 6.0)
    exact_power = ratio == np.round(ratio)
    e = np.where(exact_power, np.round(ratio), np.ceil(ratio)).astype(int)
    codes = (
        (blocks / 2.0 ** e[..., None]).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    ).reshape(-1, 128)
    want = np.concatenate([codes[:, 0::2] | (codes[:, 1::2] << 4), (e + 127).astype(np.uint8)], axis=1)
    np.testing.assert_array_equal(MX128.encode(x), want)
