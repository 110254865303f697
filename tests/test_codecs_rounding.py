"""The codecs' float kernels against independent references: minifloat rounding and exponents."""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.codecs._floats import block_exponents, e2m1_codes, round_to_grid

FORMATS = {
    # name: (ml_dtypes type, mantissa bits, smallest normal exponent, largest value)
    "e4m3": (ml_dtypes.float8_e4m3fn, 3, -6, 448.0),
    "e2m1": (ml_dtypes.float4_e2m1fn, 1, 0, 6.0),
}


def grid_and_neighbours(dtype, max_value):
    """Every grid value and midpoint, each with its float32 neighbours, both signs."""
    count = 16 if dtype is ml_dtypes.float4_e2m1fn else 256
    grid = np.arange(count, dtype=np.uint8).view(dtype).astype(np.float32)
    grid = np.unique(np.abs(grid[np.isfinite(grid)]))
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
    points = np.concatenate([grid, mids])
    points = np.concatenate(
        [points, np.nextafter(points, np.float32(np.inf)), np.nextafter(points, np.float32(0))]
    )
    points = points[points <= max_value]
    return np.concatenate([points, -points])


@pytest.mark.parametrize("name", FORMATS)
def test_round_to_grid_matches_the_cast_at_every_tie_and_neighbour(name):
    dtype, mant_bits, min_exp, max_value = FORMATS[name]
    y = grid_and_neighbours(dtype, max_value)
    want = y.astype(dtype).astype(np.float32)
    got = round_to_grid(y, mant_bits, min_exp)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # signed zeros too


@pytest.mark.parametrize("name", FORMATS)
def test_round_to_grid_matches_the_cast_on_random_bit_patterns(name):
    dtype, mant_bits, min_exp, max_value = FORMATS[name]
    rng = np.random.default_rng(11)
    y = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    y = y[np.isfinite(y) & (np.abs(y) <= max_value)]  # mostly tiny and subnormal magnitudes
    y = np.concatenate([y, rng.uniform(-max_value, max_value, 100_000).astype(np.float32)])
    want = y.astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(round_to_grid(y, mant_bits, min_exp).view(np.uint32), want.view(np.uint32))


def test_e2m1_codes_match_the_cast_bytes():
    y = grid_and_neighbours(ml_dtypes.float4_e2m1fn, 6.0)
    rounded = round_to_grid(y, 1, 0)
    np.testing.assert_array_equal(e2m1_codes(rounded), y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))


def reference_exponent(amax, limit):
    """Smallest integer e with max(amax, 1e-4) <= limit * 2^e, by exact float64 comparisons."""
    a = max(float(amax), float(np.float32(1e-4)))
    e = math.ceil(math.log2(a / limit))
    while a > limit * 2.0**e:
        e += 1
    while a <= limit * 2.0 ** (e - 1):
        e -= 1
    return e


amaxes = st.one_of(
    st.floats(0, 1.5 * 2.0**127, width=32),
    st.integers(-140, 119).map(lambda k: float(np.float32(448.0 * 2.0**k))),
    st.integers(-140, 125).map(lambda k: float(np.float32(6.0 * 2.0**k))),
    st.integers(-126, 127).map(lambda k: 2.0**k),
)


@pytest.mark.parametrize("limit", [448.0, 6.0])
@given(amax=amaxes, nudge=st.sampled_from([-1, 0, 1]))
def test_block_exponent_is_exact(limit, amax, nudge):
    value = np.float32(amax)
    if nudge:
        value = np.nextafter(value, np.float32(nudge * np.inf))
    if not np.isfinite(value) or value >= np.float32(3.2e38):
        return
    blocks = np.zeros((1, 1, 4), np.float32)
    blocks[0, 0, 2] = -value
    got = int(block_exponents(blocks, limit, np.float32(3.3e38))[0, 0])
    assert got == reference_exponent(value, limit)


def test_block_exponent_examples_from_the_issue():
    blocks = np.float32([[[448.0, 0]], [[1e-4, 0]], [[0, 0]], [[449.0, 0]], [[3.0, -6.0]]])
    got = block_exponents(blocks, 448.0, np.float32(3.3e38))[:, 0]
    np.testing.assert_array_equal(got, [0, -22, -22, 1, -6])


@pytest.mark.parametrize("limit", [448.0, 6.0])
def test_block_exponent_equals_the_float32_kernel_formula(limit):
    """Kernels compute ceil(log2(amax * (1/fmax))) in float32 from the product's bits. The exact
    rule gives the same e: checked on every float32 within 4096 ulps of fmax * 2^k and on a
    sample of two whole binades (the outcome is the same at every k: float32 rounding is
    scale-invariant while the product stays normal, as it does for amax >= 1e-4)."""
    inv = np.float32(1) / np.float32(limit)
    boundary = np.float32(limit * 4).view(np.uint32).astype(np.int64)
    near = np.arange(boundary - 4096, boundary + 4096)
    start = np.float32(limit).view(np.uint32).astype(np.int64)
    sample = np.arange(start - 2**23, start + 2**23, 13)
    amax = np.concatenate([near, sample]).astype(np.uint32).view(np.float32)
    product_bits = (amax * inv).view(np.uint32)
    kernel = ((product_bits >> 23) & 0xFF).astype(np.int64) - 127 + ((product_bits & 0x7FFFFF) != 0)
    got = block_exponents(amax.reshape(-1, 1, 1), limit, np.float32(3.3e38))[:, 0]
    np.testing.assert_array_equal(got, kernel)
