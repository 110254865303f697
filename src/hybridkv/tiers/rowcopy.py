"""Compiled row copies between objects' bytes and a codec pool's pages (the load and
offload hot path of ``hybridkv.tiers.rows``).

A pool is ``uint8[pages, stride]`` in the codecs' page layout: the value parts of a
page's ``R`` rows first (row ``r`` at ``r * value_bytes``), then their scale parts
(at ``R * value_bytes + r * scale_bytes``). An object's part is row-major: each row's
value part then its scale part, ``value_bytes + scale_bytes`` bytes a row.

``scatter_rows`` / ``gather_rows`` move the rows of many objects of one part in one
call: object ``j``'s rows start at byte ``starts[j]`` of a flat buffer and go to (come
from) ``slots[k]``, the slots of every object one after the other. Each part of a
row is one ``memcpy``. Both kernels check every slot and every byte range first and
copy nothing when one is out of bounds (they return the index of the first bad
row, or -1 when all rows were copied), so a bad argument cannot write outside the
arrays. ``gather_planes`` gathers every (layer, plane) of a group in one call without
the GIL (an offload worker's one copy per group and plan); ``gather_planes_holding_gil`` keeps
it (an engine's step thread: a short copy that let go of the GIL would wait for the worker to
hand it back). ``gather_views`` gathers objects that are each read through their own page
view (an offload plan's sources), finding and checking the slots and copying every plane in
the same call. With ``NUMBA_DISABLE_JIT=1`` they run as plain Python with numpy slices.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload


def copy_bytes(dst: np.ndarray, dst_at: int, src: np.ndarray, src_at: int, count: int) -> None:
    """``dst[dst_at : dst_at + count] = src[src_at : src_at + count]`` (1-D uint8; compiled: a memcpy)."""
    dst[dst_at : dst_at + count] = src[src_at : src_at + count]


def _memcpy_intrinsic(fixed_count: int | None):
    """An intrinsic ``(dst, dst_at, src, src_at[, count])`` that copies bytes with LLVM's memcpy;
    with ``fixed_count`` the count is a constant, so a small copy compiles to a few moves."""

    def codegen(context, builder, signature, args):
        dst_array = context.make_array(signature.args[0])(context, builder, args[0])
        src_array = context.make_array(signature.args[2])(context, builder, args[2])
        to = builder.gep(dst_array.data, [args[1]])
        at = builder.gep(src_array.data, [args[3]])
        count = args[4] if fixed_count is None else context.get_constant(types.intp, fixed_count)
        cgutils.raw_memcpy(builder, to, at, count, 1)
        return context.get_dummy_value()

    if fixed_count is None:
        def typer(typingctx, dst, dst_at, src, src_at, count):
            return types.void(dst, dst_at, src, src_at, count), codegen
    else:
        def typer(typingctx, dst, dst_at, src, src_at):
            return types.void(dst, dst_at, src, src_at), codegen
    return intrinsic(typer)


_memcpy = _memcpy_intrinsic(None)
_memcpy4, _memcpy8, _memcpy64 = (_memcpy_intrinsic(n) for n in (4, 8, 64))


@overload(copy_bytes)
def _copy_bytes_compiled(dst, dst_at, src, src_at, count):
    def impl(dst, dst_at, src, src_at, count):
        # the small parts of a row (scales, indexer values) as inline moves, not memcpy calls
        if count == 8:
            _memcpy8(dst, dst_at, src, src_at)
        elif count == 4:
            _memcpy4(dst, dst_at, src, src_at)
        elif count == 64:
            _memcpy64(dst, dst_at, src, src_at)
        else:
            _memcpy(dst, dst_at, src, src_at, count)

    return impl


@njit(cache=True)
def _first_bad_row(capacity_slots, flat_bytes, starts, rows, slots, row_bytes):
    """Index of the first row whose slot or buffer range is out of bounds, else -1."""
    k = 0
    for j in range(starts.size):
        if rows[j] < 0 or starts[j] < 0 or starts[j] + rows[j] * row_bytes > flat_bytes:
            return k
        for _ in range(rows[j]):
            if k >= slots.size or slots[k] < 0 or slots[k] >= capacity_slots:
                return k
            k += 1
    return -1 if k == slots.size else k


@njit(cache=True, nogil=True)
def scatter_rows(pool, src, starts, rows, slots, value_bytes, scale_bytes, rows_per_page):
    """Write object ``j``'s ``rows[j]`` rows at ``src[starts[j]:]`` to ``slots``; -1, or the first bad row."""
    row_bytes = value_bytes + scale_bytes
    bad = _first_bad_row(pool.shape[0] * rows_per_page, src.size, starts, rows, slots, row_bytes)
    if bad >= 0 or pool.shape[1] < rows_per_page * row_bytes:
        return max(bad, 0)
    flat = pool.reshape(-1)
    stride, scales_at = pool.shape[1], rows_per_page * value_bytes
    k = 0
    for j in range(starts.size):
        at = starts[j]
        for _ in range(rows[j]):
            page = slots[k] // rows_per_page
            row = slots[k] - page * rows_per_page
            copy_bytes(flat, page * stride + row * value_bytes, src, at, value_bytes)
            if scale_bytes:
                copy_bytes(flat, page * stride + scales_at + row * scale_bytes, src, at + value_bytes, scale_bytes)
            at += row_bytes
            k += 1
    return -1


@njit(cache=True)
def _gather_plane(pool, dst, starts, rows, slots, value_bytes, scale_bytes, rows_per_page):
    row_bytes = value_bytes + scale_bytes
    bad = _first_bad_row(pool.shape[0] * rows_per_page, dst.size, starts, rows, slots, row_bytes)
    if bad >= 0 or pool.shape[1] < rows_per_page * row_bytes:
        return max(bad, 0)
    flat = pool.reshape(-1)
    stride, scales_at = pool.shape[1], rows_per_page * value_bytes
    k = 0
    for j in range(starts.size):
        at = starts[j]
        for _ in range(rows[j]):
            page = slots[k] // rows_per_page
            row = slots[k] - page * rows_per_page
            copy_bytes(dst, at, flat, page * stride + row * value_bytes, value_bytes)
            if scale_bytes:
                copy_bytes(dst, at + value_bytes, flat, page * stride + scales_at + row * scale_bytes, scale_bytes)
            at += row_bytes
            k += 1
    return -1


@njit(cache=True, nogil=True)
def gather_rows(pool, dst, starts, rows, slots, value_bytes, scale_bytes, rows_per_page):
    """Read ``slots`` into object ``j``'s ``rows[j]`` rows at ``dst[starts[j]:]``; -1, or the first bad row."""
    return _gather_plane(pool, dst, starts, rows, slots, value_bytes, scale_bytes, rows_per_page)


@njit(cache=True)
def _gather_each_plane(pools, dst, starts, rows, slots, value_bytes, scale_bytes, rows_per_page):
    for p in range(len(pools)):
        bad = _gather_plane(pools[p], dst, starts[p], rows, slots, value_bytes[p], scale_bytes[p], rows_per_page)
        if bad >= 0:
            return p * slots.size + bad
    return -1


@njit(cache=True, nogil=True)
def gather_planes(pools, dst, starts, rows, slots, value_bytes, scale_bytes, rows_per_page):
    """``gather_rows`` of every plane of a group in one call, without the GIL: plane ``p``
    (``pools[p]``, ``value_bytes[p]``, ``scale_bytes[p]``) goes to ``starts[p, j]`` for object
    ``j``. -1, or ``p * slots.size + row`` for the first bad row (planes before ``p`` copied)."""
    return _gather_each_plane(pools, dst, starts, rows, slots, value_bytes, scale_bytes, rows_per_page)


@njit(cache=True)
def gather_planes_holding_gil(pools, dst, starts, rows, slots, value_bytes, scale_bytes, rows_per_page):
    """``gather_planes`` keeping the GIL: for an engine's step thread, which would otherwise wait
    for the GIL to come back from its offload worker after a short copy."""
    return _gather_each_plane(pools, dst, starts, rows, slots, value_bytes, scale_bytes, rows_per_page)



@njit(cache=True)
def _view_slots(flat_pages, table, rows_per_page, capacity_slots, slots):
    """Pass one of ``gather_views``: every object's slots into ``slots``; -1, ``k`` for row ``k``
    on no held page, or ``-2 - k`` for row ``k`` at or past ``capacity_slots``."""
    k = page_at = 0
    for j in range(table.shape[0]):
        first, count, base, held = table[j, 0], table[j, 1], table[j, 2], table[j, 3]
        for row in range(first, first + count):
            logical = row // rows_per_page - base
            if logical < 0 or logical >= held or flat_pages[page_at + logical] < 0:
                return k
            slot = flat_pages[page_at + logical] * rows_per_page + row % rows_per_page
            if slot >= capacity_slots:
                return -2 - k
            slots[k] = slot
            k += 1
        page_at += held
    return -1


@njit(cache=True)
def _gather_views(pools, dst, flat_pages, table, part_at, value_bytes, scale_bytes, rows_per_page, capacity_slots,
                  payload_starts):
    row_bytes = 0
    for p in range(len(pools)):
        row_bytes += value_bytes[p] + scale_bytes[p]
        if pools[p].shape[1] < rows_per_page * (value_bytes[p] + scale_bytes[p]):
            return -2  # (a pool narrower than its rows)
    at = total_rows = 0
    for j in range(table.shape[0]):
        at += table[j, 4]
        payload_starts[j] = at
        at += table[j, 1] * row_bytes
        total_rows += table[j, 1]
    if at > dst.size:
        return -2
    slots = np.empty(total_rows, dtype=np.int64)
    bad = _view_slots(flat_pages, table, rows_per_page, capacity_slots, slots)
    if bad != -1:
        return bad
    rows, starts = table[:, 1].copy(), np.empty(table.shape[0], dtype=np.int64)
    for p in range(len(pools)):  # each plane as ``gather_rows`` copies one, at its part of every payload
        for j in range(table.shape[0]):
            starts[j] = payload_starts[j] + rows[j] * part_at[p]
        bad = _gather_plane(pools[p], dst, starts, rows, slots, value_bytes[p], scale_bytes[p], rows_per_page)
        if bad >= 0:
            return -2 - bad  # a row outside this plane's pool
    return -1


@njit(cache=True, nogil=True)
def gather_views(pools, dst, flat_pages, table, part_at, value_bytes, scale_bytes, rows_per_page, capacity_slots,
                 payload_starts):
    """Gather many objects of one group, each read through its own page view, in one call
    without the GIL: their slots found and checked first (nothing is copied when one row lies on
    no held page or outside the pools), then every plane's rows copied. Object ``j`` is row
    ``table[j]``: first cache row, rows, base page, held pages (its view: the next ``held`` of
    ``flat_pages``, -1 where none is held), bytes left free before its payload. Its payload is
    written at ``payload_starts[j]`` (set here: after the room, one object after the other),
    plane ``p``'s part at ``+ rows * part_at[p]``, rows as ``gather_rows`` lays them. -1, ``k``
    for the ``k``-th row (over all objects) on no held page, or ``-2 - k`` for one outside the
    pools (``-2``: a buffer or pool too small for them all)."""
    return _gather_views(pools, dst, flat_pages, table, part_at, value_bytes, scale_bytes, rows_per_page,
                         capacity_slots, payload_starts)


@njit(cache=True)
def gather_views_holding_gil(pools, dst, flat_pages, table, part_at, value_bytes, scale_bytes, rows_per_page,
                             capacity_slots, payload_starts):
    """``gather_views`` keeping the GIL (an engine's step thread, as ``gather_planes_holding_gil``)."""
    return _gather_views(pools, dst, flat_pages, table, part_at, value_bytes, scale_bytes, rows_per_page,
                         capacity_slots, payload_starts)
