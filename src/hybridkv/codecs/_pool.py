"""Structure-of-arrays pages and slot-addressed pools, shared by every row codec.

A row is ``value_bytes`` (token data) followed by ``scale_bytes``. A page of R
rows stores all R value parts first (row r at ``r * value_bytes``), then all R
scale parts (row r at ``R * value_bytes + r * scale_bytes``), then zero padding
up to the page stride (a multiple of ``page_align_bytes``). A pool is a
``uint8[num_pages, page_stride_bytes]`` array; slot ``page * R + row`` names a
row, and slot -1 means "no row" (skipped on write, zeros on read).
"""

from __future__ import annotations

import numpy as np

from hybridkv.codecs._floats import as_float32, as_row_bytes


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class PagedRowCodec:
    """Row encode/decode driver plus page and pool operations for fixed-size rows.

    Subclasses set ``dim``, ``value_bytes``, ``scale_bytes``, ``page_align_bytes``
    and implement the per-chunk kernels ``_encode_rows``, ``_fake_quantize_rows``
    and ``_decode_rows``. Large inputs are processed in chunks of about
    ``CHUNK_VALUES`` values so that the temporaries stay in cache.
    """

    CHUNK_VALUES = 1 << 16
    GATHER_CHUNK_BYTES = 1 << 18

    dim: int
    value_bytes: int
    scale_bytes: int
    page_align_bytes: int = 1

    # --- per-chunk kernels (subclasses) ----------------------------------------------

    def _encode_rows(self, x: np.ndarray, out: np.ndarray, first_row: int) -> None:  # pragma: no cover
        """Encode float32 ``x [m, dim]`` into ``out uint8[m, row_bytes]``.

        ``first_row`` (the chunk's row in the whole input) is for error messages.
        """
        raise NotImplementedError

    def _fake_quantize_rows(self, x: np.ndarray, out: np.ndarray, first_row: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def _decode_rows(self, values: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
        """Decode value parts ``uint8[m, value_bytes]`` and scale parts into ``out float32[m, dim]``."""
        raise NotImplementedError

    # --- the row format -----------------------------------------------------------

    def _chunks(self, n: int):
        step = max(1, self.CHUNK_VALUES // self.dim)
        return ((start, min(start + step, n)) for start in range(0, n, step))

    def encode(self, x: object) -> np.ndarray:
        """float ``[..., dim]`` -> ``uint8[..., row_bytes]``.

        Accepts float16/bfloat16/float32/float64 (float64 is rounded to float32
        first); ``ValueError`` on another dtype, a wrong last dimension, or NaN/inf.
        """
        x32 = as_float32(x, self.dim)
        flat = x32.reshape(-1, self.dim)
        out = np.empty((flat.shape[0], self.row_bytes), dtype=np.uint8)
        for start, stop in self._chunks(flat.shape[0]):
            self._encode_rows(flat[start:stop], out[start:stop], start)
        return out.reshape(*x32.shape[:-1], self.row_bytes)

    def fake_quantize(self, x: object) -> np.ndarray:
        """float ``[..., dim]`` -> float32 ``[..., dim]``, bitwise equal to ``decode(encode(x))``."""
        x32 = as_float32(x, self.dim)
        flat = x32.reshape(-1, self.dim)
        out = np.empty(flat.shape, dtype=np.float32)
        for start, stop in self._chunks(flat.shape[0]):
            self._fake_quantize_rows(flat[start:stop], out[start:stop], start)
        return out.reshape(x32.shape)

    def decode(self, rows: np.ndarray) -> np.ndarray:
        """``uint8[..., row_bytes]`` -> float32 ``[..., dim]``."""
        lead = np.shape(rows)[:-1]
        flat = as_row_bytes(rows, self.row_bytes)
        out = self._decode_parts(flat[:, : self.value_bytes], flat[:, self.value_bytes :])
        return out.reshape(*lead, self.dim)

    def _decode_parts(self, values: np.ndarray, scales: np.ndarray) -> np.ndarray:
        out = np.empty((values.shape[0], self.dim), dtype=np.float32)
        for start, stop in self._chunks(values.shape[0]):
            self._decode_rows(values[start:stop], scales[start:stop], out[start:stop])
        return out

    # --- geometry ---------------------------------------------------------------

    @property
    def row_bytes(self) -> int:
        """Bytes of one encoded row: value part then scale part."""
        return self.value_bytes + self.scale_bytes

    def page_used_bytes(self, rows_per_page: int) -> int:
        """Bytes a page of ``rows_per_page`` rows actually holds (before padding)."""
        return _check_count("rows_per_page", rows_per_page, 1) * self.row_bytes

    def page_stride_bytes(self, rows_per_page: int) -> int:
        """Bytes between consecutive pages: used bytes rounded up to ``page_align_bytes``."""
        used = self.page_used_bytes(rows_per_page)
        return -(-used // self.page_align_bytes) * self.page_align_bytes

    def new_pool(self, num_pages: int, rows_per_page: int) -> np.ndarray:
        """A zero-filled pool ``uint8[num_pages, page_stride_bytes(rows_per_page)]``."""
        num_pages = _check_count("num_pages", num_pages, 0)
        return np.zeros((num_pages, self.page_stride_bytes(rows_per_page)), dtype=np.uint8)

    # --- byte-level scatter / gather -----------------------------------------------

    def write_slot_bytes(
        self, pool: np.ndarray, slots: object, rows: np.ndarray, rows_per_page: int
    ) -> None:
        """Scatter encoded ``rows`` (``uint8[n, row_bytes]``) to ``slots`` (int, ``[n]``).

        Slot -1 is skipped. Raises ``ValueError`` (writing nothing) on a bad pool,
        a slot outside ``[-1, num_pages * rows_per_page)``, a repeated slot, or rows
        of the wrong dtype/shape.
        """
        pool = self._check_pool(pool, rows_per_page, writable=True)
        slot_arr = self._check_slots(slots, pool.shape[0] * rows_per_page, no_repeats=True)
        if not isinstance(rows, np.ndarray) or rows.ndim != 2:
            raise ValueError(f"rows must be a 2-D uint8 array, got {_describe(rows)}")
        rows = as_row_bytes(rows, self.row_bytes)
        if rows.shape[0] != slot_arr.shape[0]:
            raise ValueError(f"got {rows.shape[0]} rows for {slot_arr.shape[0]} slots")
        keep = slot_arr >= 0
        if not keep.all():
            slot_arr, rows = slot_arr[keep], rows[keep]
        self._scatter(pool, slot_arr, rows, rows_per_page)

    def read_slot_bytes(self, pool: np.ndarray, slots: object, rows_per_page: int) -> np.ndarray:
        """Gather the encoded rows at ``slots`` as ``uint8[n, row_bytes]``; slot -1 reads zeros."""
        n, skipped, parts = self._gather_plan(pool, slots, rows_per_page)
        out = np.zeros((n, self.row_bytes), dtype=np.uint8) if parts is None else np.empty(
            (n, self.row_bytes), dtype=np.uint8
        )
        step = max(1, self.GATHER_CHUNK_BYTES // self.row_bytes)
        for start, stop, values, scales in self._gathered(n, skipped, parts, step):
            out[start:stop, : self.value_bytes] = values
            out[start:stop, self.value_bytes :] = scales
        return out

    # --- value-level pool and page API ----------------------------------------------

    def write_slots(self, pool: np.ndarray, slots: object, x: object, rows_per_page: int) -> None:
        """Encode ``x`` (float ``[n, dim]``) and write row i to ``slots[i]`` (-1 skips it).

        Everything is checked before any byte is written: pool dtype/shape against
        ``rows_per_page``, slot range, repeated slots (``ValueError``: the result
        would depend on write order), ``x`` dtype/shape, and NaN/inf in the rows
        that are written (rows with slot -1 are not encoded or checked for values).
        """
        pool = self._check_pool(pool, rows_per_page, writable=True)
        slot_arr = self._check_slots(slots, pool.shape[0] * rows_per_page, no_repeats=True)
        x_arr = np.asarray(x)
        if x_arr.ndim != 2 or x_arr.shape[0] != slot_arr.shape[0]:
            raise ValueError(
                f"x must have shape ({slot_arr.shape[0]}, {self.dim}) to match slots, got {x_arr.shape}"
            )
        keep = slot_arr >= 0
        if not keep.all():
            slot_arr, x_arr = slot_arr[keep], x_arr[keep]
        rows = self.encode(x_arr)  # validates dtype, last dim and values
        self._scatter(pool, slot_arr, rows, rows_per_page)

    def read_slots(self, pool: np.ndarray, slots: object, rows_per_page: int) -> np.ndarray:
        """Decode the rows at ``slots`` as ``float32[n, dim]``; slot -1 reads +0.0 values."""
        n, skipped, parts = self._gather_plan(pool, slots, rows_per_page)
        if parts is None:
            return np.zeros((n, self.dim), dtype=np.float32)
        out = np.empty((n, self.dim), dtype=np.float32)
        step = max(1, self.CHUNK_VALUES // self.dim)
        for start, stop, values, scales in self._gathered(n, skipped, parts, step):
            self._decode_rows(values, scales, out[start:stop])
        return out

    def write_page(
        self, page_buf: np.ndarray, row_offsets: object, x: object, rows_per_page: int
    ) -> None:
        """``write_slots`` on one page buffer (``uint8[page_stride_bytes]``); offsets in [-1, R)."""
        self.write_slots(self._page_as_pool(page_buf, rows_per_page), row_offsets, x, rows_per_page)

    def read_page(self, page_buf: np.ndarray, row_offsets: object, rows_per_page: int) -> np.ndarray:
        """``read_slots`` on one page buffer."""
        return self.read_slots(self._page_as_pool(page_buf, rows_per_page), row_offsets, rows_per_page)

    # --- internals ------------------------------------------------------------------
    # Each part (values, scales) of a row is moved as one numpy void item. When the
    # part's size divides both the page stride and its plane offset, the pool is viewed
    # as a flat array of such items and indexed with one integer per row; otherwise
    # as a [num_pages, R] item array indexed with (page, row).

    def _parts(self, pool: np.ndarray, slots: np.ndarray, rows_per_page: int):
        """``(item_array, index, first_byte_in_row)`` for the value part and the scale part."""
        stride, rows_per_page = pool.shape[1], int(rows_per_page)
        if rows_per_page & (rows_per_page - 1) == 0:
            pages = slots >> (rows_per_page.bit_length() - 1)
        else:
            pages = slots // rows_per_page
        parts = []
        for offset, width, first_byte in (
            (0, self.value_bytes, 0),
            (rows_per_page * self.value_bytes, self.scale_bytes, self.value_bytes),
        ):
            if width == 0:
                continue
            item = np.dtype((np.void, width))
            if stride % width == 0 and offset % width == 0:
                # item index = page * items_per_page + offset / width + row, row = slot - page * R
                items = pool.reshape(-1).view(item)
                index = pages * (stride // width - rows_per_page)
                index += slots
                if offset:
                    index += offset // width
            else:
                plane = pool[:, offset : offset + rows_per_page * width]
                items = plane.reshape(pool.shape[0], rows_per_page, width, copy=False).view(item)[..., 0]
                index = (pages, slots - pages * rows_per_page)
            parts.append((items, index, first_byte))
        return parts

    def _scatter(self, pool: np.ndarray, slots: np.ndarray, rows: np.ndarray, rows_per_page: int) -> None:
        if slots.size == 0:
            return
        for items, index, start in self._parts(pool, slots, rows_per_page):
            width = items.dtype.itemsize
            items[index] = rows[:, start : start + width].view(items.dtype)[:, 0]

    def _gather_plan(self, pool: np.ndarray, slots: object, rows_per_page: int):
        """Checked gather plan: ``(n, skipped mask or None, parts or None if nothing to read)``.

        Rows at slot -1 are read from slot 0 and zeroed afterwards by ``_gathered``.
        """
        pool = self._check_pool(pool, rows_per_page, writable=False)
        slot_arr = self._check_slots(slots, pool.shape[0] * rows_per_page, no_repeats=False)
        skipped = slot_arr < 0
        if not skipped.any():
            return slot_arr.shape[0], None, self._parts(pool, slot_arr, rows_per_page)
        if skipped.all():  # possibly a pool without pages
            return slot_arr.shape[0], skipped, None
        read_from = np.where(skipped, 0, slot_arr)
        return slot_arr.shape[0], skipped, self._parts(pool, read_from, rows_per_page)

    def _gathered(self, n: int, skipped, parts, step: int):
        """Yield ``(start, stop, values uint8[m, value_bytes], scales uint8[m, scale_bytes])``
        in chunks of ``step`` rows (the gathered temporaries stay in cache)."""
        if parts is None:
            return
        for start in range(0, n, step):
            stop = min(start + step, n)
            got = {}
            for items, index, first_byte in parts:
                if isinstance(index, tuple):
                    chunk = items[index[0][start:stop], index[1][start:stop]]
                else:
                    chunk = np.take(items, index[start:stop])
                chunk = chunk.view(np.uint8).reshape(stop - start, items.dtype.itemsize)
                if skipped is not None:
                    chunk[skipped[start:stop]] = 0
                got[first_byte] = chunk
            scales = got.get(self.value_bytes, np.empty((stop - start, 0), dtype=np.uint8))
            yield start, stop, got[0], scales

    def _check_pool(self, pool: object, rows_per_page: int, *, writable: bool) -> np.ndarray:
        stride = self.page_stride_bytes(rows_per_page)
        if not isinstance(pool, np.ndarray) or pool.dtype != np.uint8 or pool.ndim != 2:
            raise ValueError(f"pool must be a 2-D uint8 array, got {_describe(pool)}")
        if pool.shape[1] != stride:
            raise ValueError(
                f"pool pages are {pool.shape[1]} bytes but {rows_per_page} rows per page "
                f"need a {stride}-byte stride (wrong rows_per_page or wrong pool?)"
            )
        if not pool.flags.c_contiguous:
            raise ValueError("pool must be C-contiguous")
        if writable and not pool.flags.writeable:
            raise ValueError("pool is read-only")
        return pool

    def _page_as_pool(self, page_buf: object, rows_per_page: int) -> np.ndarray:
        stride = self.page_stride_bytes(rows_per_page)
        if not isinstance(page_buf, np.ndarray) or page_buf.dtype != np.uint8 or page_buf.ndim != 1:
            raise ValueError(f"page_buf must be a 1-D uint8 array, got {_describe(page_buf)}")
        if page_buf.shape[0] != stride:
            raise ValueError(
                f"page_buf has {page_buf.shape[0]} bytes; {rows_per_page} rows per page need {stride}"
            )
        return page_buf[None, :]

    @staticmethod
    def _check_slots(slots: object, capacity_rows: int, *, no_repeats: bool) -> np.ndarray:
        arr = np.asarray(slots)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"slots must be an integer array, got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"slots must be 1-D, got shape {arr.shape}")
        if arr.size == 0:
            return arr.astype(np.int64)
        low, high = int(arr.min()), int(arr.max())
        if low < -1 or high >= capacity_rows:
            bad = (arr < -1) | (arr >= capacity_rows)
            first = int(np.argmax(bad))
            raise ValueError(
                f"slot {int(arr[first])} at index {first} is out of range "
                f"[-1, {capacity_rows}) for this pool"
            )
        arr = arr.astype(np.int64, copy=False)
        if no_repeats:
            _reject_repeats(arr[arr >= 0] if low < 0 else arr, capacity_rows)
        return arr


def _reject_repeats(slots: np.ndarray, capacity_rows: int) -> None:
    """``ValueError`` naming a slot that occurs twice (slots already in range, no -1)."""
    if slots.size < 2:
        return
    if capacity_rows <= 16 * slots.size:  # a bitmap over the pool is cheaper than a sort
        seen = np.zeros(capacity_rows, dtype=bool)
        seen[slots] = True
        if np.count_nonzero(seen) == slots.size:
            return
    ordered = np.sort(slots)
    repeated = ordered[1:] == ordered[:-1]
    if repeated.any():
        raise ValueError(f"slot {int(ordered[1:][repeated][0])} appears more than once in one write")


def _describe(obj: object) -> str:
    if isinstance(obj, np.ndarray):
        return f"{obj.dtype} array of shape {obj.shape}"
    return type(obj).__name__
