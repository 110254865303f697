"""KVRowCodec: bytes worked out by hand, exactness properties, and input errors."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hybridkv.codecs import KVRowCodec

TINY = KVRowCodec(head_dim=128, rope_dim=64)  # 64 nope (1 tile) + 64 rope: 194-byte rows
REAL = KVRowCodec(head_dim=512, rope_dim=64)  # 448 nope (7 tiles) + 64 rope: 584-byte rows


def tiny_row(nope=(), rope=()):
    """A float32 [1, 128] input: the given leading nope and rope values, zeros elsewhere."""
    x = np.zeros((1, 128), np.float32)
    x[0, : len(nope)] = nope
    x[0, 64 : 64 + len(rope)] = rope
    return x


def expected_tiny(nope_bytes=(), rope_bytes=(), scale_byte=105):
    """194 bytes: 64 FP8 bytes, 128 bf16 bytes, 1 scale byte, 1 zero pad byte."""
    row = np.zeros(194, np.uint8)
    row[: len(nope_bytes)] = nope_bytes
    row[64 : 64 + len(rope_bytes)] = rope_bytes
    row[192] = scale_byte
    return row


# --- geometry -------------------------------------------------------------------


def test_geometry_real_and_tiny():
    assert (REAL.row_bytes, REAL.token_stride_bytes, REAL.scale_bytes) == (584, 576, 8)
    assert (TINY.row_bytes, TINY.token_stride_bytes, TINY.scale_bytes) == (194, 192, 2)
    assert (REAL.page_used_bytes(64), REAL.page_stride_bytes(64)) == (37_376, 37_440)
    assert (REAL.page_used_bytes(2), REAL.page_stride_bytes(2)) == (1_168, 1_728)
    # 64 * 194 = 12,416 -> 65 * 192; 2 * 194 = 388 -> 3 * 192
    assert TINY.page_stride_bytes(64) == 12_480
    assert TINY.page_stride_bytes(2) == 576
    assert REAL.page_stride_bytes(1) == 1_152


@pytest.mark.parametrize(
    "head_dim, rope_dim",
    [(512, 100), (64, 64), (32, 64), (512, -64), (512.0, 64), (True, 0), (512, None)],
)
def test_bad_geometry_raises(head_dim, rope_dim):
    with pytest.raises(ValueError):
        KVRowCodec(head_dim=head_dim, rope_dim=rope_dim)


def test_rope_free_geometry():
    codec = KVRowCodec(head_dim=64, rope_dim=0)
    assert (codec.row_bytes, codec.page_stride_bytes(3)) == (66, 256)  # 198 -> 4 * 64


# --- bytes worked out by hand (tiny geometry: one tile) ----------------------------


def test_zero_tile_uses_the_amax_floor():
    # a = 1e-4 -> e = ceil(log2(1e-4 / 448)) = ceil(-22.09) = -22 -> byte 105
    np.testing.assert_array_equal(TINY.encode(tiny_row())[0], expected_tiny(scale_byte=105))
    assert not TINY.decode(TINY.encode(tiny_row())).any()


def test_tile_at_the_448_edge():
    # amax 448 -> e = 0 -> byte 127; e4m3: 448 = 0_1111_110, 1 = 0_0111_000, 0.5 = 0_0110_000
    x = tiny_row(nope=[448.0, -448.0, 1.0, -0.5, -0.0])
    want = expected_tiny(nope_bytes=[0x7E, 0xFE, 0x38, 0xB0, 0x80], scale_byte=127)
    np.testing.assert_array_equal(TINY.encode(x)[0], want)
    back = TINY.decode(TINY.encode(x))
    np.testing.assert_array_equal(back, x)
    assert np.signbit(back[0, 4])  # -0.0 keeps its sign


def test_tiny_amax_scale_and_rounding():
    # amax 1e-4 -> e = -22 (byte 105); 1e-4 * 2^22 = 419.43 -> 416 = 0_1111_101 (step 32);
    # -3e-6 * 2^22 = -12.58 -> -13 = 1_1010_101 (step 1)
    x = tiny_row(nope=[1e-4, -3e-6])
    want = expected_tiny(nope_bytes=[0x7D, 0xD5], scale_byte=105)
    np.testing.assert_array_equal(TINY.encode(x)[0], want)
    back = TINY.decode(TINY.encode(x))
    assert back[0, 0] == np.float32(416.0 / 2**22)
    assert back[0, 1] == np.float32(-13.0 / 2**22)


def test_scale_exponent_at_power_of_two_boundaries():
    # 449 -> e = ceil(log2(449/448)) = 1 (byte 128); 449 / 2 = 224.5 -> 224 = 0_1110_110
    np.testing.assert_array_equal(
        TINY.encode(tiny_row(nope=[449.0]))[0], expected_tiny([0x76], scale_byte=128)
    )
    # 3584 = 448 * 2^3 exactly -> e = 3 (byte 130), q = 448
    np.testing.assert_array_equal(
        TINY.encode(tiny_row(nope=[3584.0]))[0], expected_tiny([0x7E], scale_byte=130)
    )
    # one ulp above -> e = 4 (byte 131), q = 224.00002 -> 224
    above = np.nextafter(np.float32(3584.0), np.float32(np.inf))
    np.testing.assert_array_equal(
        TINY.encode(tiny_row(nope=[above]))[0], expected_tiny([0x76], scale_byte=131)
    )
    # largest scale: 448 * 2^119 -> byte 246; one ulp above -> byte 247
    top = np.float32(448.0 * 2.0**119)
    np.testing.assert_array_equal(TINY.encode(tiny_row(nope=[top]))[0], expected_tiny([0x7E], scale_byte=246))
    next_up = np.nextafter(top, np.float32(np.inf))
    np.testing.assert_array_equal(
        TINY.encode(tiny_row(nope=[next_up]))[0], expected_tiny([0x76], scale_byte=247)
    )


def test_e4m3_ties_round_to_even_including_subnormals():
    # with amax 448 (e = 0): 17 -> 16 (0x58), 19 -> 20 (0x5A); subnormal step 2^-9:
    # 2^-9 -> 0x01, 1.5*2^-9 -> 2*2^-9 (0x02), 2.5*2^-9 -> 0x02, 2^-10 -> +0, -2^-10 -> -0,
    # 7.5*2^-9 -> 8*2^-9 = 2^-6, the smallest normal (0x08)
    s = 2.0**-9
    x = tiny_row(nope=[448.0, 17.0, 19.0, s, 1.5 * s, 2.5 * s, 0.5 * s, -0.5 * s, 7.5 * s])
    want = expected_tiny([0x7E, 0x58, 0x5A, 0x01, 0x02, 0x02, 0x00, 0x80, 0x08], scale_byte=127)
    np.testing.assert_array_equal(TINY.encode(x)[0], want)


def test_rope_is_little_endian_bf16_rounded_to_even():
    # 1.0 = 0x3F80; -2.0 = 0xC000; 1 + 2^-8 ties to 1.0; 1 + 3*2^-8 ties to 1 + 2^-6 (0x3F82)
    x = tiny_row(rope=[1.0, -2.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, -0.0])
    want = expected_tiny(
        rope_bytes=[0x80, 0x3F, 0x00, 0xC0, 0x80, 0x3F, 0x82, 0x3F, 0x00, 0x80], scale_byte=105
    )
    np.testing.assert_array_equal(TINY.encode(x)[0], want)
    back = TINY.decode(TINY.encode(x))[0, 64:69]
    np.testing.assert_array_equal(back, np.float32([1.0, -2.0, 1.0, 1 + 2.0**-6, -0.0]))
    assert np.signbit(back[4])


def test_real_geometry_scale_bytes_follow_the_tiles():
    # tile t holds 2^t everywhere: e = ceil(t - log2 448) = t - 8 -> byte 119 + t; q = 256 (0x78)
    x = np.zeros((1, 512), np.float32)
    for t in range(7):
        x[0, 64 * t : 64 * (t + 1)] = 2.0**t
    x[0, 448] = 1.0  # first rope value
    row = REAL.encode(x)[0]
    assert row.shape == (584,)
    np.testing.assert_array_equal(row[:448], np.full(448, 0x78, np.uint8))
    np.testing.assert_array_equal(row[448:450], [0x80, 0x3F])
    assert not row[450:576].any()
    np.testing.assert_array_equal(row[576:583], np.arange(119, 126))
    assert row[583] == 0
    np.testing.assert_array_equal(REAL.decode(row[None]), x)


def test_decode_is_exact_for_hand_made_bytes():
    rows = np.zeros((4, 194), np.uint8)
    rows[0, 0], rows[0, 192] = 0x7E, 130  # 448 * 2^3
    rows[1, 0], rows[1, 192] = 0x01, 0  # 2^-9 * 2^-127 = 2^-136 (a float32 subnormal)
    rows[2, 0], rows[2, 192] = 0x30, 255  # 0.5 * 2^128 = 2^127
    rows[3, 0], rows[3, 192] = 0x38, 255  # 1.0 * 2^128 overflows float32
    rows[:, 193] = 0xAB  # the pad byte is ignored
    out = TINY.decode(rows)
    assert out[0, 0] == 3584.0
    assert out[1, 0] == np.float32(2.0**-136)
    assert out[2, 0] == np.float32(2.0**127)
    assert out[3, 0] == np.inf


def test_bytes_are_not_a_fixed_point_when_the_rounded_max_is_224():
    # amax 230 -> e = 0, q = 224; decoded amax 224 = 448 * 2^-1 -> re-encoded with e = -1:
    # scale byte 126 and q = 448 (0x7E); the values are the same.
    first = TINY.encode(tiny_row(nope=[230.0, 3.0]))
    np.testing.assert_array_equal(first[0], expected_tiny([0x76, 0x44], scale_byte=127))
    second = TINY.encode(TINY.decode(first))
    np.testing.assert_array_equal(second[0], expected_tiny([0x7E, 0x4C], scale_byte=126))
    np.testing.assert_array_equal(TINY.decode(second), TINY.decode(first))


def test_leading_dimensions_and_bfloat16_input():
    x = np.linspace(-3, 3, 2 * 3 * 128, dtype=np.float32).reshape(2, 3, 128)
    rows = TINY.encode(x)
    assert rows.shape == (2, 3, 194) and rows.dtype == np.uint8
    assert TINY.decode(rows).shape == (2, 3, 128)
    xb = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(TINY.encode(xb), TINY.encode(xb.astype(np.float32)))
    assert TINY.encode(np.zeros((0, 128), np.float32)).shape == (0, 194)


def test_many_rows_cross_chunk_boundaries():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((700, 512)) * 10.0 ** rng.integers(-6, 6, (700, 1))).astype(np.float32)
    rows = REAL.encode(x)
    for i in (0, 127, 128, 129, 699):  # chunks are 128 rows for 512-d rows
        np.testing.assert_array_equal(rows[i], REAL.encode(x[i : i + 1])[0])
    np.testing.assert_array_equal(REAL.decode(rows).view(np.uint32), REAL.fake_quantize(x).view(np.uint32))


# --- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 127), np.float32),  # wrong last dimension
        np.zeros((2, 128), np.int32),
        np.zeros((2, 128), bool),
        np.zeros((2, 128), object),
        [[1] * 128],  # Python ints -> int64
        np.float32(1.0),  # 0-d
    ],
)
def test_encode_rejects_bad_arrays(bad):
    for fn in (TINY.encode, TINY.fake_quantize):
        with pytest.raises(ValueError):
            fn(bad)


@pytest.mark.parametrize(
    "column, value, message",
    [
        (3, np.nan, "row 1"),
        (3, np.inf, "NaN or infinity"),
        (70, -np.inf, "rope"),
        (70, np.nan, "rope"),
        (70, 3.4e38, "rope"),  # finite float32, infinite in bf16
        (3, 3.3e38, "too large"),  # its FP8 form would decode to infinity
    ],
)
def test_encode_rejects_non_finite_values(column, value, message):
    x = np.ones((3, 128), np.float32)
    x[1, column] = value
    for fn in (TINY.encode, TINY.fake_quantize):
        with pytest.raises(ValueError, match=message):
            fn(x)


def test_largest_accepted_nope_value_decodes_finite():
    below = np.nextafter(np.float32(248.0 * 2.0**120), np.float32(0))
    out = TINY.decode(TINY.encode(tiny_row(nope=[below])))
    assert out[0, 0] == np.float32(240.0 * 2.0**120)


@pytest.mark.parametrize(
    "bad", [np.zeros((2, 194), np.int8), np.zeros((2, 193), np.uint8), [[0] * 194], np.zeros(5)]
)
def test_decode_rejects_bad_rows(bad):
    with pytest.raises(ValueError):
        TINY.decode(bad)


# --- properties ----------------------------------------------------------------------

_E4M3_ALL = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
E4M3_GRID = np.unique(_E4M3_ALL[np.isfinite(_E4M3_ALL)])
E4M3_MIDPOINTS = ((E4M3_GRID[1:].astype(np.float64) + E4M3_GRID[:-1]) / 2).astype(np.float32)
specials = st.one_of(
    st.floats(-(2.0**100), 2.0**100, width=32),  # includes -0.0, subnormals, huge values
    st.sampled_from([0.0, -0.0, 1e-4, -1e-4, 448.0, 224.0, 230.0, 1e-30]),
)


@st.composite
def inputs(draw, codec):
    """float32 [n, head_dim]: each 64-value block drawn at its own scale and in one of
    several shapes (noise, e4m3 grid values, grid midpoints = ties, zeros), plus a few
    hand-picked special values at drawn positions. Dense data comes from a drawn seed."""
    n = draw(st.integers(1, 3))
    dim = codec.head_dim
    blocks = -(-dim // 64)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = np.empty((n, blocks * 64), np.float32)
    for b in range(blocks):
        for r in range(n):
            kind = draw(st.sampled_from(["noise", "grid", "ties", "zeros"]))
            scale = np.float32(2.0 ** draw(st.integers(-40, 90)))
            if kind == "noise":
                block = rng.standard_normal(64)
            elif kind == "grid":
                block = rng.choice(E4M3_GRID, 64)
            elif kind == "ties":
                block = rng.choice(E4M3_MIDPOINTS, 64)
            else:
                block = np.zeros(64)
            x[r, 64 * b : 64 * (b + 1)] = block.astype(np.float32) * scale
    x = x[:, :dim].copy()
    for _ in range(draw(st.integers(0, 6))):
        x[draw(st.integers(0, n - 1)), draw(st.integers(0, dim - 1))] = draw(specials)
    return x


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("codec", [TINY, REAL], ids=["128/64", "512/64"])
@given(data=st.data())
def test_decode_encode_equals_fake_quantize_bitwise(codec, data):
    x = data.draw(inputs(codec))
    np.testing.assert_array_equal(bits(codec.decode(codec.encode(x))), bits(codec.fake_quantize(x)))


@pytest.mark.parametrize("codec", [TINY, REAL], ids=["128/64", "512/64"])
@given(data=st.data())
def test_reencoding_is_idempotent(codec, data):
    """Values are a fixed point at once; bytes too, except tiles whose largest |q| is 224.

    Such a tile (only possible above the amax floor, byte > 105) re-encodes one exponent
    lower with every q doubled; after that one step the bytes are a fixed point.
    """
    x = data.draw(inputs(codec))
    first = codec.encode(x)
    values = codec.decode(first)
    second = codec.encode(values)
    np.testing.assert_array_equal(bits(codec.decode(second)), bits(values))
    np.testing.assert_array_equal(codec.encode(codec.decode(second)), second)

    nope, stride, tiles = codec.nope_dim, codec.token_stride_bytes, codec.nope_dim // 64
    np.testing.assert_array_equal(second[:, nope:stride], first[:, nope:stride])  # rope
    assert not second[:, -1].any()  # pad
    for r in range(first.shape[0]):
        for t in range(tiles):
            q1, q2 = (rows[r, 64 * t : 64 * (t + 1)] for rows in (first, second))
            s1, s2 = first[r, stride + t], second[r, stride + t]
            if (q1 & 0x7F).max() == 0x76 and s1 > 105:
                assert s2 == s1 - 1
                f1, f2 = (q.view(ml_dtypes.float8_e4m3fn).astype(np.float32) for q in (q1, q2))
                np.testing.assert_array_equal(f2, 2 * f1)
            else:
                assert s2 == s1
                np.testing.assert_array_equal(q2, q1)


@given(x=hnp.arrays(np.float32, (2, 128), elements=st.floats(-1e4, 1e4, width=32)))
def test_fake_quantize_error_is_within_half_a_step(x):
    """|fq(v) - v| <= half an e4m3 step at the tile's scale (<= 2^e * 16 for |q| <= 448)."""
    out = TINY.fake_quantize(x)
    amax = max(float(np.abs(x[:, :64]).max()), 1e-4)
    # e4m3 relative step is 2^-3, absolute step near the top is 32 * 2^e
    e = int(np.ceil(np.log2(amax / 448.0))) + 1  # generous by one binade
    assert np.all(np.abs(out[:, :64] - x[:, :64]) <= 16 * 2.0**e)
    np.testing.assert_array_equal(out[:, 64:], x[:, 64:].astype(ml_dtypes.bfloat16).astype(np.float32))
