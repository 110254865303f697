"""Compressor state rows: plain little-endian float32 ``[C | Z]`` rows in the same pool API.

A state pool is ``uint8[num_pages, R * width * 4]`` like every other codec's pool
(row r of a page at byte ``r * width * 4``, no scale part, no padding), so the
reference layer addresses every group the same way; ``float_view`` reinterprets
it as ``float32[num_pages, R, width]`` without copying.
"""

from __future__ import annotations

import numpy as np

from hybridkv.codecs._floats import F32, as_float32, check_finite
from hybridkv.codecs._pool import PagedRowCodec


class StateRowCodec(PagedRowCodec):
    """fp32 rows of ``width`` floats (``row_bytes = 4 * width``); encode/decode are fp32 copies."""

    def __init__(self, width: int) -> None:
        if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width <= 0:
            raise ValueError(f"width must be a positive int, got {width!r}")
        self.width = int(width)
        self.dim = self.width
        self.value_bytes = 4 * self.width
        self.scale_bytes = 0
        self.page_align_bytes = 1

    def __repr__(self) -> str:
        return f"StateRowCodec(width={self.width})"

    def encode(self, x: object) -> np.ndarray:
        """float ``[..., width]`` -> ``uint8[..., 4 * width]`` (float64 is rounded to float32 first)."""
        x32 = self.fake_quantize(x)
        return x32.view(np.uint8).reshape(*x32.shape[:-1], self.row_bytes)

    def _decode_rows(self, values: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
        out[...] = values.view(F32)

    def fake_quantize(self, x: object) -> np.ndarray:
        """``x`` as a new float32 array; ``ValueError`` on NaN/inf."""
        x32 = as_float32(x, self.width)
        check_finite(x32)
        return x32.copy() if np.may_share_memory(x32, x) else x32

    def float_view(self, pool: np.ndarray, rows_per_page: int) -> np.ndarray:
        """The pool as ``float32[num_pages, rows_per_page, width]`` (a view; writes go through)."""
        pool = self._check_pool(pool, rows_per_page, writable=False)
        return pool.view(F32).reshape(pool.shape[0], rows_per_page, self.width, copy=False)
