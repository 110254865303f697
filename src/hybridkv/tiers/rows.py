"""Moving rows between a group's page pools and objects, by logical position.

A request's pages in a group are a logical run: logical page ``base_page + i``
is physical page ``pages[i]`` (-1: not held). Cache row ``r`` (tokens
``[r * stride, (r + 1) * stride)``) lives at slot ``page * rows_per_page + r %
rows_per_page`` of page ``pages[r // rows_per_page - base_page]``. Rows are
found this way on both sides of a copy, so two instances with different page
ids (and groups with different page sizes) exchange the same rows.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from hybridkv.spec import CacheGroupSpec
from hybridkv.tiers.keys import ObjectKey
from hybridkv.tiers.objects import ObjectError, RowsObject, part_offsets, parts_row_bytes
from hybridkv.tiers.pools import GroupPools
from hybridkv.tiers.rowcopy import (gather_planes, gather_planes_holding_gil, gather_views, gather_views_holding_gil,
                                   scatter_rows)


class MissingRows(ValueError):
    """A row to read or write lies on a page the request does not hold."""


@dataclass(frozen=True)
class GroupPages:
    """One request's pages in one group, in logical order from ``base_page``."""

    base_page: int
    pages: np.ndarray  # int, -1 where no page is held

    @classmethod
    def of_fields(cls, base_page: int, pages: np.ndarray) -> GroupPages:
        """``GroupPages(base_page, pages)`` without the frozen dataclass's setattr per field (a
        tier link makes one per offload, on the step thread)."""
        out = object.__new__(cls)
        out.__dict__.update(base_page=base_page, pages=pages)
        return out

    def slots(self, spec: CacheGroupSpec, first_row: int, num_rows: int) -> np.ndarray:
        """int64 slots of cache rows ``[first_row, first_row + num_rows)``; ``MissingRows`` if any lacks a page."""
        return self.slots_of_rows(spec, np.arange(first_row, first_row + num_rows, dtype=np.int64))

    def slots_of_rows(self, spec: CacheGroupSpec, rows: np.ndarray) -> np.ndarray:
        """int64 slots of the cache rows ``rows`` (int64, any order); ``MissingRows`` if any lacks a page."""
        logical = rows // spec.rows_per_page - self.base_page
        pages = np.asarray(self.pages, dtype=np.int64)
        inside = (logical >= 0) & (logical < pages.size)
        page = np.where(inside, pages[np.clip(logical, 0, max(pages.size - 1, 0))] if pages.size else -1, -1)
        if rows.size and (page < 0).any():
            bad = int(rows[np.argmax(page < 0)])
            raise MissingRows(f"group {spec.group_id}: cache row {bad} lies on no held page")
        return page * spec.rows_per_page + rows % spec.rows_per_page


def rows_for_tokens(spec: CacheGroupSpec, first_token: int, end_token: int) -> tuple[int, int]:
    """``(first_row, num_rows)``: the cache rows wholly inside tokens ``[first_token, end_token)``."""
    if not 0 <= first_token <= end_token:
        raise ValueError(f"bad token range [{first_token}, {end_token})")
    stride = spec.entry_stride_tokens
    first_row = -(-first_token // stride)
    return first_row, max(0, end_token // stride - first_row)


def gather_object(
    pools: GroupPools, pages: GroupPages, key: ObjectKey, first_token: int, end_token: int
) -> RowsObject:
    """Copy the rows of tokens ``[first_token, end_token)`` out of the pools into an object."""
    if key.group_id != pools.spec.group_id:
        raise ValueError(f"key of group {key.group_id} for pools of {pools.spec.group_id}")
    first_row, num_rows = rows_for_tokens(pools.spec, first_token, end_token)
    slots = pages.slots(pools.spec, first_row, num_rows)
    payload = np.empty(num_rows * sum(p.codec.row_bytes for p in pools.planes), dtype=np.uint8)
    at, rpp = 0, pools.spec.rows_per_page
    for plane in pools.planes:
        size = num_rows * plane.codec.row_bytes
        rows = payload[at : at + size].reshape(num_rows, plane.codec.row_bytes)
        rows[...] = plane.codec.read_slot_bytes(plane.pool, slots, rpp)
        at += size
    return RowsObject(key, first_token, end_token - first_token, first_row, num_rows, pools.parts, payload)


def scatter_object(pools: GroupPools, pages: GroupPages, obj: RowsObject) -> None:
    """Write an object's rows into the pools at the same logical rows; checks everything first."""
    if obj.key.group_id != pools.spec.group_id:
        raise ObjectError(f"object of group {obj.key.group_id} for pools of {pools.spec.group_id}")
    if obj.parts != pools.parts:
        raise ObjectError(f"object parts {obj.parts} differ from the pools' {pools.parts}")
    expected = rows_for_tokens(pools.spec, obj.first_token, obj.first_token + obj.num_tokens)
    if expected != (obj.first_row, obj.num_rows):
        raise ObjectError(f"object rows {(obj.first_row, obj.num_rows)} do not match its tokens ({expected})")
    slots = pages.slots(pools.spec, obj.first_row, obj.num_rows)
    for index, plane in enumerate(pools.planes):
        plane.codec.write_slot_bytes(plane.pool, slots, obj.part_rows(index), pools.spec.rows_per_page)


def scatter_objects(
    pools: dict[str, GroupPools],
    pages: dict[str, GroupPages],
    objects: list[RowsObject],
    *,
    slots: list[np.ndarray] | None = None,
    helper: Executor | None = None,
) -> None:
    """``scatter_object`` for many objects: one compiled copy per (group, layer, plane) and
    source buffer (objects fetched together lie in one buffer), a ``memcpy`` per row part.
    ``helper``: an executor that runs about half the copies (by bytes) while this thread runs
    the rest (the copies write disjoint rows of distinct pools, and release the GIL).

    Every object is checked (group, parts, rows, held pages, slots inside every pool,
    no row written twice) and every pool (shape, writable) before any row is written.
    ``slots``: per object, its rows' slots as ``check_scatter`` of the same pools and page
    views answered them (so objects of one checked set are scattered batch by batch without
    finding their slots again); the objects' groups, parts and row counts are still checked.
    """
    planned = []
    for gid, members in _by_group(range(len(objects)), lambda i: objects[i].key.group_id).items():
        if gid not in pools:
            raise ObjectError(f"object of group {gid}, which these pools do not have")
        group = pools[gid]
        for i in members:
            _check_object_rows(group, objects[i])
            if slots is not None and len(slots[i]) != objects[i].num_rows:
                raise ValueError(f"{len(slots[i])} slots for an object of {objects[i].num_rows} rows")
        if slots is None:
            _check_pools(group, writable=True)
            shapes = [(objects[i].first_row, objects[i].num_rows) for i in members]
            group_slots = _group_slots(group, pages[gid], shapes, unique=True)
        else:
            group_slots = np.concatenate([slots[i] for i in members]) if members else np.zeros(0, np.int64)
        planned.append((group, [objects[i] for i in members], group_slots))
    copies = [copy for group, members, group_slots in planned for copy in _group_copies(group, members, group_slots)]
    _run_copies(copies, helper)


def check_scatter(
    pools: dict[str, GroupPools], pages: dict[str, GroupPages], ranges: list[tuple[ObjectKey, int, int]]
) -> list[np.ndarray]:
    """What ``scatter_objects`` checks before it writes, for objects not fetched yet
    (``(key, first_token, end_token)`` each): their groups and pools, that every row lies on a
    held page inside the pools, and that no two write the same row. Returns each range's
    int64 slots, in order (``scatter_objects(..., slots=)``)."""
    out: list[np.ndarray] = [np.zeros(0, np.int64)] * len(ranges)
    for gid, members in _by_group(range(len(ranges)), lambda i: ranges[i][0].group_id).items():
        if gid not in pools:
            raise ObjectError(f"object of group {gid}, which these pools do not have")
        group = pools[gid]
        _check_pools(group, writable=True)
        shapes = [rows_for_tokens(group.spec, ranges[i][1], ranges[i][2]) for i in members]
        slots = _group_slots(group, pages[gid], shapes, unique=True)
        ends = np.cumsum([n for _, n in shapes]).tolist()
        for i, (_, n), end in zip(members, shapes, ends):
            out[i] = slots[end - n : end]
    return out


def gather_objects(
    pools: dict[str, GroupPools],
    pages: dict[str, GroupPages] | Sequence[GroupPages],
    ranges: list[tuple[ObjectKey, int, int]],
    *,
    room_bytes: list[int] | None = None,
    into: np.ndarray | None = None,
    hold_gil: bool = False,
) -> list[RowsObject]:
    """``gather_object`` for many ``(key, first_token, end_token)``: one compiled copy per group
    (every layer and plane; it lets go of the GIL unless ``hold_gil``: a step thread's short
    copy keeps it, see ``rowcopy``); a group's payloads are views of one new buffer, in order.
    ``pages``: each group's page view, or one view per range (an offload's sources).
    ``room_bytes``: per range, bytes left free right before its payload (where
    ``encode_object(..., in_place=True)`` writes the header). ``into``: a writable 1-D ``uint8``
    buffer to lay every group's payloads in, one group after the other, rather than new ones
    (``ValueError`` when it is too small). New buffers are ``populated_buffer``s (their pages
    faulted in by one call, holding the GIL when ``hold_gil``)."""
    room = [0] * len(ranges) if room_bytes is None else [int(n) for n in room_bytes]
    if len(room) != len(ranges) or min(room, default=0) < 0:
        raise ValueError(f"room_bytes must be {len(ranges)} non-negative ints")
    out: list[RowsObject | None] = [None] * len(ranges)
    used = 0
    per_range = not isinstance(pages, Mapping)
    for gid, members in _by_group(range(len(ranges)), lambda i: ranges[i][0].group_id).items():
        group = pools[gid]
        shapes = [rows_for_tokens(group.spec, ranges[i][1], ranges[i][2]) for i in members]
        row_bytes = parts_row_bytes(group.parts)
        before = [room[i] for i in members]
        buffer, used = _payload_buffer(into, used, sum(before) + sum(n for _, n in shapes) * row_bytes, hold_gil)
        if per_range:
            starts = _gather_views_of(group, [pages[i] for i in members], shapes, before, buffer, hold_gil=hold_gil)
        else:
            starts = _gather_one_view(group, pages[gid], shapes, before, buffer, hold_gil=hold_gil)
        for i, (first, n), start in zip(members, shapes, starts):
            key, first_token, end_token = ranges[i]
            payload = buffer[start : start + n * row_bytes]
            out[i] = RowsObject(key, first_token, end_token - first_token, first, n, group.parts, payload)
    return out


def _gather_one_view(group: GroupPools, view: GroupPages, shapes, before: list[int], buffer: np.ndarray, *,
                     hold_gil: bool) -> list[int]:
    """Gather the rows ``shapes`` of a group through one page view into ``buffer``, each payload
    after its ``before`` bytes; the payloads' starts."""
    plane_pools, value_bytes, scale_bytes, part_at = group.copy_tables
    slots = _group_slots(group, view, shapes, unique=False)
    rows = np.array([n for _, n in shapes], dtype=np.int64)
    ends = np.cumsum(np.array(before, dtype=np.int64) + rows * parts_row_bytes(group.parts))
    starts = ends - rows * parts_row_bytes(group.parts)
    kernel = gather_planes_holding_gil if hold_gil else gather_planes
    bad = kernel(plane_pools, buffer, starts + rows * part_at[:, None], rows, slots, value_bytes, scale_bytes,
                 group.spec.rows_per_page)
    if bad >= 0:  # the checks above make this unreachable
        raise ValueError(f"group {group.spec.group_id}: row {bad} of the gather is out of bounds")
    return starts.tolist()


def _gather_views_of(group: GroupPools, views: Sequence[GroupPages], shapes, before: list[int], buffer: np.ndarray,
                     *, hold_gil: bool) -> list[int]:
    """Gather the rows ``shapes`` (``(first_row, num_rows)`` each), each read through its own page
    view, into ``buffer``, each payload after its ``before`` bytes, in one compiled call
    (``rowcopy.gather_views``: it finds and checks the slots first, and copies nothing when a row
    lies on no held page or outside the pools); the payloads' starts. ``MissingRows`` /
    ``ValueError`` as ``_group_slots``."""
    plane_pools, value_bytes, scale_bytes, part_at = group.copy_tables
    pages = [np.asarray(view.pages, dtype=np.int64) for view in views]
    table = np.array([(first, n, view.base_page, p.size, room)
                      for (first, n), view, p, room in zip(shapes, views, pages, before)], dtype=np.int64)
    starts = np.empty(len(views), dtype=np.int64)
    kernel = gather_views_holding_gil if hold_gil else gather_views
    bad = kernel(plane_pools, buffer, np.concatenate(pages) if pages else np.zeros(0, np.int64),
                 table.reshape(-1, 5), part_at, value_bytes, scale_bytes, group.spec.rows_per_page,
                 group.capacity_slots, starts)
    if bad == -1:
        return starts.tolist()
    k = bad if bad >= 0 else -2 - bad
    ends = np.cumsum(table.reshape(-1, 5)[:, 1])
    j = min(int(np.searchsorted(ends, k, side="right")), len(shapes) - 1)
    row = int(shapes[j][0] + k - (ends[j] - shapes[j][1]))
    if bad >= 0:
        raise MissingRows(f"group {group.spec.group_id}: cache row {row} lies on no held page")
    raise ValueError(f"group {group.spec.group_id}: cache row {row} lies beyond the pools' "
                     f"{group.capacity_slots} rows")


def _payload_buffer(into: np.ndarray | None, used: int, nbytes: int, hold_gil: bool) -> tuple[np.ndarray, int]:
    """``nbytes`` for a group's payloads: new, or the next ``nbytes`` of ``into`` after ``used``."""
    if into is None:
        return populated_buffer(nbytes, hold_gil=hold_gil), used
    if not (isinstance(into, np.ndarray) and into.dtype == np.uint8 and into.ndim == 1
            and into.flags.c_contiguous and into.flags.writeable):
        raise ValueError("into must be a writable, contiguous 1-D uint8 array")
    if used + nbytes > into.size:
        raise ValueError(f"into holds {into.size} bytes; the payloads need {used + nbytes} at least")
    return into[used : used + nbytes], used + nbytes


def _libc_madvise(library: type) -> Callable | None:
    """libc's ``madvise`` through ``library`` (``ctypes.CDLL`` lets go of the GIL for the call,
    ``ctypes.PyDLL`` keeps it), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = library(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _libc_madvise(ctypes.CDLL)
_MADVISE_HOLDING_GIL = _libc_madvise(ctypes.PyDLL)
_MADV_NOHUGEPAGE = 15
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range's pages in, writable, in one call
_POPULATE_MIN_BYTES = 1 << 16  # smaller buffers come from the allocator's heap, mostly faulted in
_HUGE_PAGE_HINT_BYTES = 4 << 20  # numpy asks for transparent huge pages from this size


def populated_buffer(nbytes: int, *, hold_gil: bool = False) -> np.ndarray:
    """A new ``uint8`` array of ``nbytes`` (that owns its memory: ``base`` is None, so a tier
    given views of it finds it whole) whose pages are faulted in by one ``madvise(...,
    MADV_POPULATE_WRITE)`` rather than one fault per 4 KiB page as a gather first writes them
    (about 0.3 against 0.4 ms of CPU a MB), and without the transparent huge pages numpy asks
    for from 4 MiB (``MADV_NOHUGEPAGE``): faulted in one by one, each may wait for the kernel
    to compact memory (8 MiB buffers filled one after another: about 2 ms of CPU a MB, against
    0.33 populated without them). The calls let go of the GIL unless ``hold_gil`` (an engine's step
    thread: see ``rowcopy``). Where they are missing or refused (other systems, Linux before
    5.14) the pages fault in as written."""
    buffer = np.empty(nbytes, dtype=np.uint8)
    madvise = _MADVISE_HOLDING_GIL if hold_gil else _MADVISE
    if madvise is not None and nbytes >= _POPULATE_MIN_BYTES:
        start = -(-buffer.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (buffer.ctypes.data + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:  # (a call refused does nothing)
            if nbytes >= _HUGE_PAGE_HINT_BYTES:
                madvise(start, end - start, _MADV_NOHUGEPAGE)
            madvise(start, end - start, _MADV_POPULATE_WRITE)
    return buffer


def _by_group(items, group_of) -> dict:
    out: dict = {}
    for item in items:
        out.setdefault(group_of(item), []).append(item)
    return out


def _check_object_rows(group: GroupPools, obj: RowsObject) -> None:
    if obj.parts != group.parts:
        raise ObjectError(f"object parts {obj.parts} differ from the pools' {group.parts}")
    expected = rows_for_tokens(group.spec, obj.first_token, obj.first_token + obj.num_tokens)
    if expected != (obj.first_row, obj.num_rows):
        raise ObjectError(f"object rows {(obj.first_row, obj.num_rows)} do not match its tokens ({expected})")


def _check_pools(group: GroupPools, *, writable: bool) -> None:
    """Every pool of the group is a C-contiguous ``uint8[pages, stride]`` (writable to write into)."""
    rows_per_page = group.spec.rows_per_page
    for plane in group.planes:
        pool, stride = plane.pool, plane.codec.page_stride_bytes(rows_per_page)
        where = f"group {group.spec.group_id} layer {plane.layer} plane {plane.plane}"
        if not isinstance(pool, np.ndarray) or pool.dtype != np.uint8 or pool.ndim != 2 or pool.shape[1] != stride:
            raise ValueError(f"{where}: the pool must be a uint8 [pages, {stride}] array")
        if not pool.flags.c_contiguous or (writable and not pool.flags.writeable):
            raise ValueError(f"{where}: the pool must be C-contiguous" + (" and writable" if writable else ""))


def _group_slots(group: GroupPools, pages: GroupPages, shapes, *, unique: bool) -> np.ndarray:
    """Slots of the rows ``shapes`` (``(first_row, num_rows)`` each), one object after the other.
    ``MissingRows`` for a row on no held page; ``ValueError`` for a page outside a pool or, when
    ``unique``, a row asked for twice (two objects writing one row)."""
    counts = [n for _, n in shapes]
    if not sum(counts):
        return np.zeros(0, dtype=np.int64)
    rows = np.concatenate([np.arange(first, first + n, dtype=np.int64) for first, n in shapes])
    slots = pages.slots_of_rows(group.spec, rows)
    if int(slots.max()) >= group.capacity_slots:
        raise ValueError(f"group {group.spec.group_id}: slot {int(slots.max())} lies beyond the pools' "
                         f"{group.capacity_slots} rows")
    if unique and np.unique(slots).size != slots.size:
        raise ValueError(f"group {group.spec.group_id}: two objects write the same cache row")
    return slots


def _group_copies(group: GroupPools, objects: list[RowsObject], slots: np.ndarray) -> list[tuple]:
    """The kernel calls that scatter a group's objects: per source buffer and (layer, plane),
    ``(bytes, plane, buffer, starts, rows, slots, rows_per_page)``."""
    ends, offsets = np.cumsum([obj.num_rows for obj in objects]).tolist(), part_offsets(group.parts)
    copies = []
    for flat, members, payload_at in _sources([obj.payload for obj in objects]):
        rows = np.array([objects[i].num_rows for i in members], dtype=np.int64)
        if len(members) < len(objects):
            slots_here = np.concatenate([slots[ends[i] - objects[i].num_rows : ends[i]] for i in members])
        else:
            slots_here = slots
        total_rows = int(rows.sum())
        for plane, offset in zip(group.planes, offsets):
            starts = payload_at + rows * offset
            copies.append((total_rows * plane.codec.row_bytes, plane, flat, starts, rows, slots_here,
                           group.spec.rows_per_page))
    return copies


def _run_copies(copies: list[tuple], helper: Executor | None) -> None:
    """Run the scatter kernel calls, about half of the bytes on ``helper`` when one is given."""
    if helper is None or len(copies) < 2:
        for _, *args in copies:
            _copy_rows(scatter_rows, *args)
        return
    sizes = np.cumsum([copy[0] for copy in copies])
    cut = max(1, int(np.searchsorted(sizes, sizes[-1] / 2)))
    first = helper.submit(_run_copies, copies[:cut], None)
    _run_copies(copies[cut:], None)
    first.result()


def _copy_rows(kernel, plane, flat: np.ndarray, starts, rows, slots, rows_per_page: int) -> None:
    codec = plane.codec
    bad = kernel(plane.pool, flat, starts, rows, slots, codec.value_bytes, codec.scale_bytes, rows_per_page)
    if bad >= 0:  # the checks above make this unreachable; the kernel copied nothing
        raise ValueError(f"layer {plane.layer} plane {plane.plane}: row {bad} of the copy is out of bounds")


def _sources(payloads: list[np.ndarray]) -> list[tuple[np.ndarray, list[int], np.ndarray]]:
    """Payloads grouped by the flat buffer they are views of (objects fetched in one batch share
    the tier's receive buffer): ``(buffer, payload indices, int64 offsets in the buffer)``."""
    found: dict[int, tuple[np.ndarray, list[int], list[int]]] = {}
    for i, payload in enumerate(payloads):
        owner, flat, offset = _flat_buffer(payload)
        entry = found.setdefault(id(owner), (flat, [], []))
        entry[1].append(i)
        entry[2].append(offset)
    return [(flat, members, np.array(offsets, dtype=np.int64)) for flat, members, offsets in found.values()]


def _flat_buffer(payload: np.ndarray) -> tuple[object, np.ndarray, int]:
    """``(owner, flat uint8 buffer, offset)``: the 1-D buffer a payload is a view of (an ndarray,
    or the bytes behind a memoryview) and where it starts there; else the payload itself."""
    owner = payload.base
    if isinstance(owner, memoryview):
        owner = owner.obj
    if isinstance(owner, (bytes, bytearray)):
        flat = np.frombuffer(owner, dtype=np.uint8)
    elif isinstance(owner, np.ndarray) and owner.dtype == np.uint8 and owner.ndim == 1 and owner.flags.c_contiguous:
        flat = owner
    else:
        flat = None
    if flat is not None and payload.flags.c_contiguous:
        offset = payload.ctypes.data - flat.ctypes.data
        if 0 <= offset and offset + payload.size <= flat.size:
            return owner, flat, offset
    payload = np.ascontiguousarray(payload)
    return payload, payload, 0
