"""An engine-side copy of the manager's page tables, kept current from step updates.

A ``BlockTableMirror`` applies every ``block_tables="updates"`` batch's ``table_updates``, in order, to its ``store``
and yields, per group, exactly the block table the full mode would have returned (docs/manager.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridkv.runtime.batch import StepBatch


class BlockTableMirror:
    """Persistent ``[groups, rows, columns]`` copy of a manager's table store."""

    def __init__(self, group_ids: list[str], capacity_pages: list[int], sliding: list[bool]):
        if not len(group_ids) == len(capacity_pages) == len(sliding):
            raise ValueError("group_ids, capacity_pages and sliding must have one entry per group")
        self.group_ids = list(group_ids)
        self._index = {gid: g for g, gid in enumerate(self.group_ids)}
        self.capacity_pages = [int(c) for c in capacity_pages]
        self.sliding = [bool(s) for s in sliding]
        self.store = np.full((len(self.group_ids), 0, max(self.capacity_pages)), -1, dtype=np.int32)
        self.table_rows = np.zeros(0, dtype=np.int64)
        self.base_pages: dict[str, np.ndarray | None] = {}
        self.widths: tuple[int, ...] = ()

    @classmethod
    def for_manager(cls, manager: Any) -> BlockTableMirror:
        tables = [manager.tables[s.group_id] for s in manager.specs]
        return cls([s.group_id for s in manager.specs], [t.capacity_pages for t in tables],
                   [t.sliding for t in tables])

    def apply(self, batch: StepBatch) -> None:
        """Bring the copy up to date with an updates-mode batch and remember its rows."""
        up = batch.table_updates
        if up is None or batch.table_rows is None:
            raise ValueError("apply needs a batch scheduled with block_tables='updates'")
        rows, cells, have = batch.table_rows, up.row, self.store.shape[1]
        need = max(int(rows.max()) + 1 if rows.size else 0, int(cells.max()) + 1 if cells.size else 0)
        if need > have:  # the store grows (at least doubles), keeping its rows
            grown = np.full((self.store.shape[0], max(need, 2 * have), self.store.shape[2]), -1, np.int32)
            grown[:, :have] = self.store
            self.store = grown
        if up.reset:
            self.store.fill(-1)
        self.store[up.group, up.row, up.column] = up.page
        self.table_rows = batch.table_rows.astype(np.int64)
        self.base_pages = {gid: step.base_pages for gid, step in batch.groups.items()}
        self.widths = tuple(up.widths)

    def block_table(self, group_id: str) -> np.ndarray:
        """int32 ``[R, width]`` for the last applied batch, as the full mode builds it."""
        g = self._index.get(group_id) if isinstance(group_id, str) else None
        if g is None or not self.widths:
            raise ValueError(f"unknown group {group_id!r}; groups are {self.group_ids}" if g is None else
                             "block_table needs a batch applied first (apply)")
        width, cap = self.widths[g], self.capacity_pages[g]
        rows, ring = self.table_rows, self.store[g, :, :cap]
        out = np.full((rows.size, width), -1, dtype=np.int32)
        cols = min(width, cap)
        if self.sliding[g]:  # non-live ring cells are -1, so rotating by base needs no mask below the capacity
            base = self.base_pages[group_id].astype(np.int64)
            out[:, :cols] = ring[rows[:, None], (base[:, None] + np.arange(cols, dtype=np.int64)) % cap]
        else:
            out[:, :cols] = ring[rows, :cols]
        return out

    def block_tables(self) -> dict[str, np.ndarray]:
        return {gid: self.block_table(gid) for gid in self.group_ids}
