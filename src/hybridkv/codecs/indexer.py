"""DeepSeek-V4 lightning-indexer keys: MXFP4 and FP8 rows (docs/codecs.md).

Both formats use a power-of-two scale per block, ``2^ceil(log2(a / fmax))`` with
``a = max(max|v|, 1e-4)`` (the KV rule's floor, which also fixes the scale of an
all-zero block) and ``fmax`` the format's largest value (6 for e2m1, 448 for
e4m3); the exponent is computed exactly. Pages are structure-of-arrays (all
value parts, then all scale parts) and are not padded: page bytes = R * row_bytes.
Signed zeros keep their sign, as in the KV rows.
"""

from __future__ import annotations

import numpy as np

from hybridkv.codecs._floats import (
    E2M1_MAX,
    E2M1_TO_F32,
    E2M1_TOO_LARGE,
    E4M3,
    E4M3_MAX,
    E4M3_TOO_LARGE,
    F32,
    MXFP4_AMAX_FLOOR,
    UE8M0_BIAS,
    UE8M0_TO_F32,
    block_exponents,
    e4m3_bytes_to_f32,
    e2m1_codes,
    pow2_f32,
    round_to_grid,
    times_ue8m0,
)
from hybridkv.codecs._pool import PagedRowCodec
from hybridkv.models.deepseek_v4 import (
    DEEPSEEK_V4_FP8_INDEXER_BLOCK_SIZE,
    DEEPSEEK_V4_FP8_SCALE_BYTES,
    DEEPSEEK_V4_MXFP4_BLOCK_SIZE,
)

MXFP4_BLOCK = DEEPSEEK_V4_MXFP4_BLOCK_SIZE
FP8_BLOCK = DEEPSEEK_V4_FP8_INDEXER_BLOCK_SIZE

# Two e2m1 values per byte: element 2i in the low nibble, 2i+1 in the high one.
# For each byte, its two float32 values packed into one uint64 (low value first in memory).
_E2M1_PAIR_TO_F32X2 = (
    np.stack(
        [E2M1_TO_F32[np.arange(256) & 0xF], E2M1_TO_F32[np.arange(256) >> 4]], axis=1
    )
    .view(np.uint64)
    .reshape(256)
)


def _check_block_dim(dim: object, block: int, fmt: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise ValueError(f"dim must be an int, got {dim!r}")
    if dim <= 0 or dim % block:
        raise ValueError(f"{fmt} indexer dim must be a positive multiple of {block}, got {dim}")
    return int(dim)


class MXFP4IndexerCodec(PagedRowCodec):
    """MXFP4 indexer keys: ``dim/2`` packed e2m1 bytes + ``dim/32`` UE8M0 scale bytes (68 B for 128).

    Nibble: bit 3 = sign, bits 0-2 = magnitude code for {0, .5, 1, 1.5, 2, 3, 4, 6}.
    Tie rule: round-to-nearest-even on the scaled value ``v / 2^e``, so ties go to
    the neighbour with the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    2.5 -> 2, 3.5 -> 4, 5 -> 4 (the rule of the OCP e2m1 cast; computed here with
    integer/float32 ops, tested equal to ``ml_dtypes.float4_e2m1fn``). ``|v / 2^e| <= 6``
    always, so the clamp to 6 never binds. Values ``>= 3.5 * 2^126`` (~3e38, whose
    form would decode to infinity) are rejected; for accepted input ``e`` lies in
    [-126, 126] and the scale byte ``e + 127`` in [1, 253] (the clamp never binds). The
    amax floor is ``MXFP4_AMAX_FLOOR`` = 6 * 2^-126 (DeepSeek-V4's ``inference/kernel.py``),
    so an all-zero block gets byte 1.
    """

    def __init__(self, dim: int = 128) -> None:
        self.dim = _check_block_dim(dim, MXFP4_BLOCK, "MXFP4")
        self.blocks = self.dim // MXFP4_BLOCK
        self.value_bytes = self.dim // 2
        self.scale_bytes = self.blocks
        self.page_align_bytes = 1

    def __repr__(self) -> str:
        return f"MXFP4IndexerCodec(dim={self.dim})"

    def _rounded(self, x: np.ndarray, first_row: int) -> tuple[np.ndarray, np.ndarray]:
        """Scaled values rounded to the e2m1 grid (float32 ``[m, blocks, 32]``) and exponents."""
        blocks = x.reshape(x.shape[0], self.blocks, MXFP4_BLOCK)
        exps = block_exponents(blocks, E2M1_MAX, E2M1_TOO_LARGE, "x", first_row, MXFP4_AMAX_FLOOR)
        return round_to_grid(blocks * pow2_f32(-exps)[..., None], 1, 0), exps

    def _encode_rows(self, x: np.ndarray, out: np.ndarray, first_row: int) -> None:
        rounded, exps = self._rounded(x, first_row)
        codes = e2m1_codes(rounded).reshape(x.shape[0], self.dim)
        packed = out[:, : self.value_bytes]
        np.left_shift(codes[:, 1::2], 4, out=packed)
        np.bitwise_or(packed, codes[:, 0::2], out=packed)
        out[:, self.value_bytes :] = exps + UE8M0_BIAS

    def _fake_quantize_rows(self, x: np.ndarray, out: np.ndarray, first_row: int) -> None:
        rounded, exps = self._rounded(x, first_row)
        np.multiply(
            rounded,
            UE8M0_TO_F32[exps + UE8M0_BIAS][..., None],
            out=out.reshape(x.shape[0], self.blocks, MXFP4_BLOCK, copy=False),
        )

    def _decode_rows(self, values: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
        """Exact: e2m1 value times ``2^(byte - 127)`` per 32-value block."""
        m = values.shape[0]
        pairs = np.take(_E2M1_PAIR_TO_F32X2, values).view(np.float32)
        times_ue8m0(
            pairs.reshape(m, self.blocks, MXFP4_BLOCK),
            scales,
            out.reshape(m, self.blocks, MXFP4_BLOCK, copy=False),
        )


class FP8IndexerCodec(PagedRowCodec):
    """FP8 indexer keys: ``dim`` e4m3 bytes + one little-endian fp32 scale per 128 values (132 B for 128).

    The scale is ``2^e`` with ``e`` as in the KV rows (block 128, limit 448, RNE cast,
    same rejection of values ``>= 248 * 2^120``); decoding is ``q * scale`` in float32,
    exact for encoder output.
    """

    def __init__(self, dim: int = 128) -> None:
        self.dim = _check_block_dim(dim, FP8_BLOCK, "FP8")
        self.blocks = self.dim // FP8_BLOCK
        self.value_bytes = self.dim
        self.scale_bytes = self.blocks * DEEPSEEK_V4_FP8_SCALE_BYTES
        self.page_align_bytes = 1

    def __repr__(self) -> str:
        return f"FP8IndexerCodec(dim={self.dim})"

    def _scaled(self, x: np.ndarray, first_row: int) -> tuple[np.ndarray, np.ndarray]:
        """Blocks divided by their scale (float32 ``[m, blocks, 128]``) and the scales ``[m, blocks]``."""
        blocks = x.reshape(x.shape[0], self.blocks, FP8_BLOCK)
        exps = block_exponents(blocks, E4M3_MAX, E4M3_TOO_LARGE, "x", first_row)
        return blocks * pow2_f32(-exps)[..., None], pow2_f32(exps)

    def _encode_rows(self, x: np.ndarray, out: np.ndarray, first_row: int) -> None:
        scaled, scales = self._scaled(x, first_row)
        m = x.shape[0]
        out[:, : self.dim].view(E4M3).reshape(m, self.blocks, FP8_BLOCK, copy=False)[...] = scaled
        out[:, self.dim :].view(F32)[...] = scales

    def _fake_quantize_rows(self, x: np.ndarray, out: np.ndarray, first_row: int) -> None:
        scaled, scales = self._scaled(x, first_row)
        np.multiply(
            round_to_grid(scaled, 3, -6),
            scales[..., None],
            out=out.reshape(x.shape[0], self.blocks, FP8_BLOCK, copy=False),
        )

    def _decode_rows(self, values: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
        """``q * scale`` in float32 (exact for encoder output)."""
        m = values.shape[0]
        np.multiply(
            e4m3_bytes_to_f32(values).reshape(m, self.blocks, FP8_BLOCK),
            scales.view(F32)[..., None],
            out=out.reshape(m, self.blocks, FP8_BLOCK, copy=False),
        )
