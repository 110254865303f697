"""What the manager hands out: the arrays of a step, admission answers, pool stats.

Plain data; every array is numpy, fresh for each step. The manager stores the step's frozen
dataclasses' fields directly (``CacheManager._build_batch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Admission:
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class GroupStep:
    """What the kernels of one group need for a step."""

    block_table: np.ndarray | None  # int32 [R, width], -1 padded; None with block_tables="updates"
    base_pages: np.ndarray | None  # int32 [R] logical page of column 0 (sliding groups)
    write_slots: np.ndarray | None  # int64 [N], -1 where a token writes no row; None with write_slots=False


@dataclass(frozen=True)
class TableUpdates:
    """How the manager's table store changed since the previous ``block_tables="updates"`` step.

    The store is ``[groups, table rows, columns]`` int32 (see ``hybridkv.tables.mirror``): a request keeps its table row
    for its whole life; full-history groups hold logical page ``L`` at column ``L``, sliding groups at column
    ``L % capacity`` (a ring), and every cell outside a request's live pages is -1. Setting
    ``store[group, row, column] = page`` for every listed cell (any order; a cell listed twice carries the same id),
    after clearing the store to -1 when ``reset`` is set, brings a copy up to date.
    """

    group: np.ndarray  # int64 [k] group index (manager's group order)
    row: np.ndarray  # int64 [k] table row
    column: np.ndarray  # int64 [k] store column
    page: np.ndarray  # int32 [k] page id now in that cell (-1: empty)
    widths: tuple[int, ...]  # per group, the width the full-mode block table has this step
    reset: bool = False  # a resync: the first updates step, or the first after full-mode steps


@dataclass(frozen=True)
class StepBatch:
    request_ids: tuple[str, ...]
    num_scheduled_tokens: np.ndarray  # int32 [R]
    query_start_loc: np.ndarray  # int32 [R+1]
    positions: np.ndarray  # int64 [N]
    request_indices: np.ndarray  # int32 [N]
    groups: dict[str, GroupStep]
    table_rows: np.ndarray | None = None  # int32 [R] each request's row in the table store
    table_updates: TableUpdates | None = None  # with block_tables="updates"


@dataclass(frozen=True)
class GroupStats:
    group_id: str
    total_pages: int
    free_pages: int
    used_pages: int
    peak_used_pages: int
    utilization: float
    cached_pages: int
    evictable_pages: int
    allocated_pages: int
    released_pages: int
    evicted_pages: int
