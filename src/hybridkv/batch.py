"""What the manager hands out: the arrays of a step, admission answers, pool stats.

Plain data; every array is numpy and can be copied to a device as is.
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

    block_table: np.ndarray  # int32 [R, width], -1 padded
    base_pages: np.ndarray | None  # int32 [R] logical page of column 0 (sliding groups)
    write_slots: np.ndarray  # int64 [N], -1 where a token writes no row


@dataclass(frozen=True)
class StepBatch:
    request_ids: tuple[str, ...]
    num_scheduled_tokens: np.ndarray  # int32 [R]
    query_start_loc: np.ndarray  # int32 [R+1]
    positions: np.ndarray  # int64 [N]
    request_indices: np.ndarray  # int32 [N]
    groups: dict[str, GroupStep]


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
    failed_allocations: int
    evicted_pages: int
