"""DeepSeek-V4 main KV rows: FP8-e4m3 nope tiles with UE8M0 scales, bf16 rope (docs/codecs.md).

Row (584 B for head_dim 512, rope 64): ``nope`` e4m3 bytes, then ``rope`` bf16
values (little-endian), then one UE8M0 scale byte per 64 nope values, then one
zero pad byte. Per 64-value tile: ``a = max(max|v|, 1e-4)``,
``e = ceil(log2(a / 448))`` (computed exactly, no float log2),
``q = e4m3(v / 2^e)`` rounded to nearest, ties to even, scale byte ``e + 127``.
Since ``|v / 2^e| <= 448`` the ±448 clamp never binds. Inputs are rejected when
they hold NaN/inf, a nope value ``>= 248 * 2^120`` (~3.3e38: its FP8 form would
decode to infinity) or a rope value that overflows bf16; for every accepted input
``e`` lies in [-22, 120] and the byte in [105, 247] (the [0, 255] clamp never binds).
Decoding is ``q * 2^(byte - 127)``, exact. Signed zeros keep their sign
(``-0.0`` and negatives that round to zero encode as byte 0x80 and decode to -0.0).
"""

from __future__ import annotations

import numpy as np

from hybridkv.codecs._floats import (
    BF16,
    E4M3,
    E4M3_MAX,
    E4M3_TOO_LARGE,
    UE8M0_BIAS,
    UE8M0_TO_F32,
    block_exponents,
    check_bf16_finite,
    e4m3_bytes_to_f32,
    pow2_f32,
    round_to_grid,
    times_ue8m0,
)
from hybridkv.codecs._pool import PagedRowCodec
from hybridkv.models.deepseek_v4 import (
    DEEPSEEK_V4_FP8_QUANT_BLOCK,
    deepseek_v4_swa_scale_dim,
    deepseek_v4_swa_token_stride,
)

TILE = DEEPSEEK_V4_FP8_QUANT_BLOCK  # nope values sharing one scale byte


def _check_dim(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


class KVRowCodec(PagedRowCodec):
    """Encode/decode DeepSeek-V4 KV rows and read/write them in SoA pages.

    ``KVRowCodec(head_dim=512, rope_dim=64)``: ``row_bytes`` 584, token stride
    576, 8 scale bytes; a page of R rows is padded to a multiple of 576 bytes.
    ``head_dim - rope_dim`` must be a positive multiple of 64; ``rope_dim >= 0``.
    """

    def __init__(self, head_dim: int, rope_dim: int) -> None:
        head_dim = _check_dim("head_dim", head_dim)
        rope_dim = _check_dim("rope_dim", rope_dim)
        if rope_dim < 0:
            raise ValueError(f"rope_dim must be >= 0, got {rope_dim}")
        self.head_dim = head_dim
        self.rope_dim = rope_dim
        self.nope_dim = head_dim - rope_dim
        self.scale_bytes = deepseek_v4_swa_scale_dim(head_dim, rope_dim)  # checks nope
        self.value_bytes = deepseek_v4_swa_token_stride(head_dim, rope_dim)
        self.tiles = self.nope_dim // TILE
        self.dim = head_dim
        self.page_align_bytes = self.value_bytes

    @property
    def token_stride_bytes(self) -> int:
        """Token-data bytes per row (nope FP8 + rope bf16); also the page alignment."""
        return self.value_bytes

    def __repr__(self) -> str:
        return f"KVRowCodec(head_dim={self.head_dim}, rope_dim={self.rope_dim})"

    def _scaled_nope(self, x: np.ndarray, first_row: int) -> tuple[np.ndarray, np.ndarray]:
        """Nope tiles divided by their scale (float32 ``[m, tiles, 64]``) and the exponents."""
        check_bf16_finite(x[:, self.nope_dim :], "x (rope part)", first_row)
        tiles = x[:, : self.nope_dim].reshape(x.shape[0], self.tiles, TILE)
        exps = block_exponents(tiles, E4M3_MAX, E4M3_TOO_LARGE, "x (nope part)", first_row)
        return tiles * pow2_f32(-exps)[..., None], exps

    def _encode_rows(self, x: np.ndarray, out: np.ndarray, first_row: int) -> None:
        m, nope = x.shape[0], self.nope_dim
        scaled, exps = self._scaled_nope(x, first_row)
        out[:, :nope].view(E4M3).reshape(m, self.tiles, TILE, copy=False)[...] = scaled  # RNE cast
        out[:, nope : self.value_bytes].view(BF16)[...] = x[:, nope:]
        out[:, self.value_bytes : self.value_bytes + self.tiles] = exps + UE8M0_BIAS
        out[:, -1] = 0

    def _fake_quantize_rows(self, x: np.ndarray, out: np.ndarray, first_row: int) -> None:
        m, nope = x.shape[0], self.nope_dim
        scaled, exps = self._scaled_nope(x, first_row)
        np.multiply(
            round_to_grid(scaled, 3, -6),  # the e4m3 cast's rounding, without bytes
            UE8M0_TO_F32[exps + UE8M0_BIAS][..., None],  # the same factors decode uses
            out=out[:, :nope].reshape(m, self.tiles, TILE, copy=False),
        )
        out[:, nope:] = x[:, nope:].astype(BF16)

    def _decode_rows(self, values: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
        """Exact: ``q * 2^(byte - 127)`` per tile, rope widened from bf16; the pad byte is ignored."""
        m, nope = values.shape[0], self.nope_dim
        q = e4m3_bytes_to_f32(values[:, :nope]).reshape(m, self.tiles, TILE)
        target = out[:, :nope].reshape(m, self.tiles, TILE, copy=False)
        times_ue8m0(q, scales[:, : self.tiles], target)
        out[:, nope:] = values[:, nope:].view(BF16)
