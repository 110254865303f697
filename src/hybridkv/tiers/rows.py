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
from hybridkv.tiers.objects import ObjectError, RowsObject
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
