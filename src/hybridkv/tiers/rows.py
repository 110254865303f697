"""Moving rows between a group's page pools and objects, by logical position.

A request's pages in a group are a logical run: logical page ``base_page + i``
is physical page ``pages[i]`` (-1: not held). Cache row ``r`` (tokens
``[r * stride, (r + 1) * stride)``) lives at slot ``page * rows_per_page + r %
rows_per_page`` of page ``pages[r // rows_per_page - base_page]``. Rows are
found this way on both sides of a copy, so two instances with different page
ids (and groups with different page sizes) exchange the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridkv.spec import CacheGroupSpec
from hybridkv.tiers.keys import ObjectKey
from hybridkv.tiers.objects import ObjectError, RowsObject, part_offsets
from hybridkv.tiers.pools import GroupPools


class MissingRows(ValueError):
    """A row to read or write lies on a page the request does not hold."""


@dataclass(frozen=True)
class GroupPages:
    """One request's pages in one group, in logical order from ``base_page``."""

    base_page: int
    pages: np.ndarray  # int, -1 where no page is held

    def slots(self, spec: CacheGroupSpec, first_row: int, num_rows: int) -> np.ndarray:
        """int64 slots of cache rows ``[first_row, first_row + num_rows)``; ``MissingRows`` if any lacks a page."""
        rows = np.arange(first_row, first_row + num_rows, dtype=np.int64)
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


def scatter_objects(pools: dict[str, GroupPools], pages: dict[str, GroupPages], objects: list[RowsObject]) -> None:
    """``scatter_object`` for many objects, one codec call per (group, layer, plane).

    Every object is checked (group, parts, rows, held pages) before any row is
    written; rows of different objects must not overlap.
    """
    by_group: dict[str, list[RowsObject]] = {}
    for obj in objects:
        by_group.setdefault(obj.key.group_id, []).append(obj)
    planned = []
    for gid, group_objects in by_group.items():
        if gid not in pools:
            raise ObjectError(f"object of group {gid}, which these pools do not have")
        group = pools[gid]
        slots = []
        for obj in group_objects:
            if obj.parts != group.parts:
                raise ObjectError(f"object parts {obj.parts} differ from the pools' {group.parts}")
            expected = rows_for_tokens(group.spec, obj.first_token, obj.first_token + obj.num_tokens)
            if expected != (obj.first_row, obj.num_rows):
                raise ObjectError(f"object rows {(obj.first_row, obj.num_rows)} do not match its tokens ({expected})")
            slots.append(pages[gid].slots(group.spec, obj.first_row, obj.num_rows))
        planned.append((group, group_objects, np.concatenate(slots) if slots else np.zeros(0, np.int64)))
    for group, group_objects, slots in planned:
        rpp = group.spec.rows_per_page
        for index, plane in enumerate(group.planes):
            rows = [obj.part_rows(index) for obj in group_objects]
            plane.codec.write_slot_bytes(plane.pool, slots, np.concatenate(rows) if len(rows) > 1 else rows[0], rpp)


def gather_objects(
    pools: dict[str, GroupPools], pages: dict[str, GroupPages], ranges: list[tuple[ObjectKey, int, int]]
) -> list[RowsObject]:
    """``gather_object`` for many ``(key, first_token, end_token)``, one codec call per (group, layer, plane)."""
    by_group: dict[str, list[int]] = {}
    for i, (key, _, _) in enumerate(ranges):
        by_group.setdefault(key.group_id, []).append(i)
    out: list[RowsObject | None] = [None] * len(ranges)
    for gid, members in by_group.items():
        group = pools[gid]
        shapes = [rows_for_tokens(group.spec, ranges[i][1], ranges[i][2]) for i in members]
        slots = np.concatenate([pages[gid].slots(group.spec, first, n) for first, n in shapes])
        offsets, row_bytes = part_offsets(group.parts), sum(p.codec.row_bytes for p in group.planes)
        payloads = [np.empty(n * row_bytes, dtype=np.uint8) for _, n in shapes]
        for index, plane in enumerate(group.planes):
            rows = plane.codec.read_slot_bytes(plane.pool, slots, group.spec.rows_per_page)
            size, at = plane.codec.row_bytes, 0
            for payload, (_, n) in zip(payloads, shapes):
                start = n * offsets[index]
                payload[start : start + n * size] = rows[at : at + n].reshape(-1)
                at += n
        for i, payload, (first, n) in zip(members, payloads, shapes):
            key, first_token, end_token = ranges[i]
            out[i] = RowsObject(key, first_token, end_token - first_token, first, n, group.parts, payload)
    return out
