"""Shared float helpers for the codecs: input checks, exact power-of-two scales, lookup tables.

All scales in these formats are powers of two, so every multiply by a scale is
exact in float32 and the only rounding is the one cast to FP8 / FP4 (or bf16).
"""

from __future__ import annotations

import math
import sys

import ml_dtypes
import numpy as np

if sys.byteorder != "little":  # row bytes are little-endian; views below assume a matching host
    raise ImportError("hybridkv.codecs needs a little-endian host")

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype("<f4")

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Floor on a block's max |value| before the exponent is taken (docs/codecs.md; the
# model's clamp); it also fixes the scale of an all-zero block. float32, as the model computes.
AMAX_FLOOR = np.float32(1e-4)
# The MXFP4 (e2m1) indexer keys' floor is 6 * 2^-126 instead, as in DeepSeek-V4's
# inference/kernel.py (the FP4 act-quant clamp) and vLLM's fused MXFP4 indexer kernel:
# an all-zero or near-zero block gets e = -126 (scale byte 1), not -15.
MXFP4_AMAX_FLOOR = np.float32(6.0 * 2.0**-126)
UE8M0_BIAS = 127

# Smallest |v| whose quantized value would round up to 2^128 (infinity in float32):
# at the top exponent (e = 120 for e4m3, 126 for e2m1) the grid near the top is
# 240, 256 (= 2^8) resp. 3, 4 (= 2^2); the midpoints 248 resp. 3.5 round up to even.
E4M3_TOO_LARGE = np.float32(248.0 * 2.0**120)
E2M1_TOO_LARGE = np.float32(3.5 * 2.0**126)

_ACCEPTED_DTYPES = (np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64))
_ABS_MASK = np.uint32(0x7FFFFFFF)
_F32_INF_BITS = 0x7F800000
# The smallest float32 magnitude that rounds to infinity in bfloat16: (2 - 2^-8) * 2^127.
_BF16_OVERFLOW = np.float32((2.0 - 2.0**-8) * 2.0**127)

# float32 value of every e4m3 byte / every e2m1 nibble (exact conversions).
E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
E2M1_TO_F32 = np.arange(16, dtype=np.uint8).view(E2M1).astype(np.float32)
# For each little-endian byte pair, both float32 values packed in one uint64 (first byte first).
_PAIR = np.arange(1 << 16, dtype=np.uint32)
_E4M3_PAIR_TO_F32X2 = (
    np.stack([E4M3_TO_F32[_PAIR & 0xFF], E4M3_TO_F32[_PAIR >> 8]], axis=1).view(np.uint64).reshape(-1)
)
del _PAIR
# e2m1 magnitude code by (float32 exponent, first mantissa bit) of the grid value.
_E2M1_CODE_BY_TOP_BITS = np.zeros(512, dtype=np.uint8)
_E2M1_CODE_BY_TOP_BITS[np.right_shift(E2M1_TO_F32[:8].view(np.uint32), 22)] = np.arange(8)
# 2^(b - 127) for every UE8M0 byte b; b = 255 (2^128) is inf here and handled separately.
with np.errstate(over="ignore"):
    UE8M0_TO_F32 = np.ldexp(np.float32(1.0), np.arange(256, dtype=np.int32) - UE8M0_BIAS).astype(
        np.float32
    )


def as_float32(x: object, dim: int, what: str = "x") -> np.ndarray:
    """``x`` as a C-contiguous float32 array ``[..., dim]``.

    Accepts float16, bfloat16, float32 and float64 (rounded to float32 first);
    anything else (ints, bools, objects) and a wrong last dimension raise ``ValueError``.
    """
    arr = np.asarray(x)
    if arr.dtype not in _ACCEPTED_DTYPES:
        raise ValueError(
            f"{what} must be a float16/bfloat16/float32/float64 array, got dtype {arr.dtype}"
        )
    if arr.ndim == 0 or arr.shape[-1] != dim:
        raise ValueError(f"{what} must have last dimension {dim}, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def as_row_bytes(rows: object, row_bytes: int, what: str = "rows") -> np.ndarray:
    """``rows`` as a C-contiguous uint8 array ``[n, row_bytes]`` (leading dims flattened)."""
    if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8:
        dtype = getattr(rows, "dtype", type(rows).__name__)
        raise ValueError(f"{what} must be a uint8 numpy array, got {dtype}")
    if rows.ndim == 0 or rows.shape[-1] != row_bytes:
        raise ValueError(f"{what} must have last dimension {row_bytes}, got shape {rows.shape}")
    return np.ascontiguousarray(rows).reshape(-1, row_bytes)


def _raise_not_finite(bad: np.ndarray, what: str, first_row: int) -> None:
    row = first_row + int(np.unravel_index(int(np.argmax(bad)), bad.shape)[0])
    raise ValueError(f"{what} contains NaN or infinity (row {row})")


def check_finite(values: np.ndarray, what: str = "x", first_row: int = 0) -> None:
    """Raise ``ValueError`` if a float32 array ``[m, ...]`` holds NaN or infinity."""
    if values.size and not np.isfinite(values).all():
        _raise_not_finite(~np.isfinite(values), what, first_row)


def check_bf16_finite(values: np.ndarray, what: str = "x", first_row: int = 0) -> None:
    """Raise unless every float32 value is finite and stays finite when rounded to bf16."""
    if values.size == 0:
        return
    top = max(float(values.max()), -float(values.min()))
    if not top < float(_BF16_OVERFLOW):  # also catches NaN
        _raise_not_finite(
            ~(np.abs(values) < _BF16_OVERFLOW), f"{what} (rounded to bfloat16)", first_row
        )


def block_exponents(
    blocks: np.ndarray, limit: float, too_large: np.float32, what: str = "x", first_row: int = 0,
    floor: np.float32 = AMAX_FLOOR,
) -> np.ndarray:
    """Exact ``e = ceil(log2(max(amax, floor) / limit))`` per block (int32, ``blocks.shape[:-1]``).

    ``floor`` is float32 1e-4 for the FP8 formats and ``MXFP4_AMAX_FLOOR`` for e2m1.

    ``blocks`` is float32 ``[m, nblocks, block]``. Raises ``ValueError`` on NaN or
    infinity, and on ``|v| >= too_large`` (values whose quantized form would decode
    to infinity; see ``E4M3_TOO_LARGE``). Exact for every float32 amax (no float
    log2): with ``a = m * 2^k`` and ``limit = ml * 2^kl`` (frexp, m and ml in
    [0.5, 1)), ``a / limit`` lies in ``(2^(k-kl-1), 2^(k-kl)]`` when ``m <= ml``
    and in ``(2^(k-kl), 2^(k-kl+1))`` otherwise.
    """
    # |v| as integer bits: integer order equals float order for non-negative floats,
    # and every bit pattern above the largest finite float is inf or NaN.
    amax_bits = np.bitwise_and(blocks.view(np.uint32), _ABS_MASK).max(axis=-1)
    limit_bits = int(np.float32(too_large).view(np.uint32))
    if amax_bits.size and int(amax_bits.max()) >= limit_bits:
        if int(amax_bits.max()) >= _F32_INF_BITS:
            _raise_not_finite(amax_bits >= _F32_INF_BITS, what, first_row)
        row = first_row + int(np.argmax((amax_bits >= limit_bits).any(axis=-1)))
        raise ValueError(
            f"{what} has a value too large for this format (|v| >= {float(too_large):.6g}) in row {row}"
        )
    amax = np.maximum(amax_bits.view(np.float32), np.float32(floor))
    mant, exp = np.frexp(amax)
    limit_mant, limit_exp = math.frexp(limit)
    return (exp - limit_exp + (mant > np.float32(limit_mant))).astype(np.int32)


def round_to_grid(y: np.ndarray, mant_bits: int, min_normal_exp: int) -> np.ndarray:
    """Round float32 ``y`` to the nearest minifloat value (ties to even), as float32.

    The grid has ``mant_bits`` mantissa bits, smallest normal ``2^min_normal_exp`` and
    subnormal step ``2^(min_normal_exp - mant_bits)``: (3, -6) is e4m3, (1, 0) is e2m1.
    No overflow handling: callers guarantee ``|y| <= `` the format's largest value.
    Signs are kept (a negative value that rounds to zero gives -0.0). This is the same
    rounding as the hardware (and ml_dtypes) cast, done with integer and float32 ops.
    """
    bits = y.view(np.uint32)
    drop = 23 - mant_bits
    # |y| >= min normal: round the float32 mantissa to mant_bits, ties to even
    # (add half-minus-one plus the kept LSB, then truncate; a carry bumps the exponent).
    normal = np.right_shift(bits, drop)
    normal &= 1
    normal += (1 << (drop - 1)) - 1
    normal += bits
    normal &= np.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
    # |y| < min normal: adding 2^(min_exp - mant_bits + 23) puts |y| in a binade whose
    # float32 ulp is the subnormal step, so the one float32 rounding is the RNE we want.
    magic = np.float32(2.0 ** (min_normal_exp - mant_bits + 23))
    magnitude = np.abs(y)
    small = magnitude + magic
    small -= magic
    small_bits = small.view(np.uint32)
    small_bits |= bits & np.uint32(0x80000000)
    # Branch-free select: mask is all ones where |y| is below the smallest normal.
    mask = (magnitude < np.float32(2.0**min_normal_exp)).view(np.uint8).astype(np.uint32)
    np.negative(mask, out=mask)
    small_bits &= mask
    np.invert(mask, out=mask)
    normal &= mask
    normal |= small_bits
    return normal.view(np.float32)


def e2m1_codes(rounded: np.ndarray) -> np.ndarray:
    """e2m1 nibbles (bit 3 sign, bits 0-2 magnitude code) of float32 values already on the grid."""
    top = np.right_shift(rounded.view(np.uint32), 22)  # sign, exponent, first mantissa bit
    codes = np.take(_E2M1_CODE_BY_TOP_BITS, top & 0x1FF)
    codes |= (np.right_shift(top, 6) & 8).astype(np.uint8)
    return codes


def e4m3_bytes_to_f32(codes: np.ndarray) -> np.ndarray:
    """float32 values of e4m3 bytes ``uint8[m, k]`` (k even): one table lookup per byte pair."""
    try:
        pairs = codes.view(np.uint16)
    except ValueError:  # odd layout; fall back to one lookup per byte
        return E4M3_TO_F32[codes]
    return np.take(_E4M3_PAIR_TO_F32X2, pairs).view(np.float32)


def pow2_f32(exponents: np.ndarray) -> np.ndarray:
    """``2^e`` as float32 (exact for the exponents these codecs produce)."""
    return np.ldexp(np.float32(1.0), exponents).astype(np.float32, copy=False)


def times_ue8m0(values: np.ndarray, scale_bytes: np.ndarray, out: np.ndarray) -> None:
    """``out = values * 2^(scale_bytes - 127)`` rounded once to float32.

    ``values`` ``[..., blocks, block]`` float32, ``scale_bytes`` ``[..., blocks]`` uint8.
    Exact whenever the product is representable (always, for encoder output).
    """
    if (scale_bytes == 255).any():  # 2^128 is not a float32; ldexp rounds the product correctly
        with np.errstate(over="ignore"):  # garbage bytes may overflow to inf; that is the value
            np.ldexp(values, scale_bytes.astype(np.int32)[..., None] - UE8M0_BIAS, out=out)
        return
    np.multiply(values, UE8M0_TO_F32[scale_bytes][..., None], out=out)
