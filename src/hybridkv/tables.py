"""Per-request page tables of every cache group, in one store the step kernels own.

Each request owns a row of the store. Full-history groups store logical page
``L`` (tokens ``[L*T, (L+1)*T)``) at column ``L``. Sliding groups keep only the
live pages ``[base, hi)`` in a power-of-two ring (logical page ``L`` at column
``L % cap``) and hand kernels a table whose column ``j`` is logical page
``base + j``. The step's table work runs in ``hybridkv.runtime.kernels``; the
methods here serve what happens outside a step (prefix hits, publishing,
rewind, free) and never touch a pool: the manager takes the ids they return.
"""

from __future__ import annotations

import numpy as np

from hybridkv.runtime import kernels
from hybridkv.spec import CacheGroupSpec


def cdiv(a, b):
    return -(-a // b)


def segment_arange(counts: np.ndarray) -> np.ndarray:
    """``concat(arange(c) for c in counts)`` without a Python loop."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


class GroupTable:
    """Page tables of one group for every request row."""

    # Bound by ``TableSet``: where this group's cells sit in the stacked array, and
    # the log of touched cells (None: not logging) that feeds incremental updates.
    _log = None  # callable taking flat indices, or None
    _log_offset = 0
    _log_stride = 0

    def __init__(
        self,
        spec: CacheGroupSpec,
        *,
        max_context_tokens: int,
        max_step_tokens: int,
        initial_rows: int = 1,
    ):
        self.spec = spec
        self.page_tokens = spec.page_tokens
        self.rows_per_page = spec.rows_per_page
        self.stride_tokens = spec.entry_stride_tokens
        self.sliding = spec.is_sliding
        self.window_tokens = spec.sliding_window_tokens or 0
        if self.sliding:
            # A window plus a step's pages, as a power of two: the ring column is a mask.
            ring = cdiv(self.window_tokens - 1 + max_step_tokens, self.page_tokens) + 2
            self.capacity_pages = 1 << (ring - 1).bit_length()
        else:
            self.capacity_pages = cdiv(max_context_tokens, self.page_tokens)
        rows = max(1, int(initial_rows))
        self.pages = np.full((rows, self.capacity_pages), -1, dtype=np.int32)
        self.base = np.zeros(rows, dtype=np.int64)
        self.hi = np.zeros(rows, dtype=np.int64)

    def _cols(self, logical: np.ndarray) -> np.ndarray:
        return logical % self.capacity_pages if self.sliding else logical

    def pages_in(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Held page ids of logical pages ``[lo_r, hi_r)`` per row, row-major, in logical order."""
        counts = np.maximum(hi - lo, 0)
        if not counts.any():
            return np.zeros(0, dtype=np.int64)
        rep = np.repeat(rows, counts)
        logical = np.repeat(lo, counts) + segment_arange(counts)
        return self.pages[rep, self._cols(logical)].astype(np.int64)

    def row_pages(self, row: int, lo: int, hi: int) -> list[int]:
        """Held page ids of one row's logical pages ``[lo, hi)`` (slices, no fancy indexing)."""
        if hi <= lo:
            return []
        line = self.pages[row]
        if not self.sliding:
            return line[lo:hi].tolist()
        c0, c1 = lo % self.capacity_pages, hi % self.capacity_pages
        if c0 < c1:
            return line[c0:c1].tolist()
        return line[c0:].tolist() + line[:c1].tolist()

    # --- mutation -----------------------------------------------------------
    def take(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``pages_in`` then ``drop`` in one pass: the removed page ids in logical order."""
        counts = np.maximum(hi - lo, 0)
        if not counts.any():
            return np.zeros(0, dtype=np.int64)
        rep = np.repeat(rows, counts)
        cols = self._cols(np.repeat(lo, counts) + segment_arange(counts))
        pages = self.pages[rep, cols].astype(np.int64)
        self.pages[rep, cols] = -1
        self._note(rep, cols)
        return pages

    def place(self, rows: np.ndarray, lo: np.ndarray, counts: np.ndarray, page_ids: np.ndarray) -> None:
        """Store ``page_ids`` at logical pages ``[lo_r, lo_r + counts_r)``, row-major."""
        if page_ids.size:
            rep = np.repeat(rows, counts)
            cols = self._cols(np.repeat(lo, counts) + segment_arange(counts))
            self.pages[rep, cols] = page_ids
            self._note(rep, cols)

    def _note(self, rows: np.ndarray, cols: np.ndarray) -> None:
        if self._log is not None:
            self._log((self._log_offset + rows * self._log_stride + cols).ravel())


class TableSet:
    """The tables of every group of a manager in one store; the step's table work runs
    in the compiled kernels of ``hybridkv.runtime.kernels``.

    ``pages[g]``, ``base[g]`` and ``hi[g]`` are group ``g``'s arrays; each
    ``GroupTable`` in ``tables`` is bound to views of them, so per-group code
    (prefix publishing, rewind, free) and whole-step code see the same state.

    While ``log`` is a list, every cell any mutation touches is logged (as a flat
    index into ``pages``); ``drain_updates`` hands out those cells with their
    current page ids, which is all a mirror of ``pages`` needs. ``stop_log``
    turns logging off; the next drain after a start is a resync: every live
    cell, and a flag telling the mirror to clear first.
    """

    def __init__(
        self,
        specs: list[CacheGroupSpec] | tuple[CacheGroupSpec, ...],
        *,
        max_context_tokens: int,
        max_step_tokens: int,
        initial_rows: int = 64,
        id_offsets: list[int] | None = None,
    ):
        self.tables = [
            GroupTable(s, max_context_tokens=max_context_tokens, max_step_tokens=max_step_tokens)
            for s in specs
        ]
        self.geometry = np.zeros((len(self.tables), kernels.GEOMETRY_COLUMNS), dtype=np.int64)
        for g, t in enumerate(self.tables):
            # A ring column is ``logical & (capacity - 1)`` (rings are powers of two); full
            # history keeps every bit.
            mask = t.capacity_pages - 1 if t.sliding else -1
            offset = 0 if id_offsets is None else id_offsets[g]  # the group's first id in the page space
            self.geometry[g] = (t.page_tokens, t.window_tokens, mask, t.rows_per_page, t.stride_tokens, offset,
                                _log2(t.page_tokens), _log2(t.rows_per_page), _log2(t.stride_tokens))
        cap_max = max(t.capacity_pages for t in self.tables)
        self.pages = np.full((len(self.tables), max(1, int(initial_rows)), cap_max), -1, np.int32)
        # base and hi of every group and row in one array: a step gathers and stores both at once.
        self.bounds = np.zeros((2, *self.pages.shape[:2]), dtype=np.int64)
        self.log: list[np.ndarray] | None = None
        self._resync = False
        self._bind()

    def _bind(self) -> None:
        _, rows_cap, cap_max = self.pages.shape
        self.base, self.hi = self.bounds[0], self.bounds[1]
        for g, table in enumerate(self.tables):
            table.pages = self.pages[g, :, : table.capacity_pages]
            table.base = self.base[g]
            table.hi = self.hi[g]
            table._log = None if self.log is None else self.note_cells
            table._log_offset = g * rows_cap * cap_max
            table._log_stride = cap_max

    # --- touched-cell log (incremental block tables) ------------------------
    def start_log(self) -> None:
        """Log touched cells from now on (the next drain is a resync)."""
        if self.log is None:
            self.log = []
            self._resync = True
            self._bind()

    def stop_log(self) -> None:
        """Stop logging (full-mode steps): mutations cost nothing extra until the next start."""
        if self.log is not None:
            self.log = None
            self._bind()

    def note_cells(self, index: np.ndarray) -> None:
        """Log changed cells (flat indices into ``pages``) while logging is on."""
        log = self.log
        if log is not None:
            log.append(index)
            if len(log) > 512:  # many mutations between two drains: keep it bounded
                log[:] = [np.unique(np.concatenate(log))]

    def drain_updates(self, touched: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                         np.ndarray, bool]:
        """(group, row, column, page id, reset): every cell touched since the last drain,
        and the cells ``touched`` (flat indices a step just changed, read here and not
        kept), with the page id it holds now (-1: empty; a cell may appear twice); after
        a (re)start of the log, every live cell instead and ``reset`` True."""
        log = self.log
        reset = self._resync
        if reset:
            # Every cell outside [base, hi) is -1: the live ranges are the whole store.
            rows = np.arange(self.pages.shape[1], dtype=np.int64)
            counts = self.hi - self.base
            index = np.empty(int(counts.sum()), dtype=np.int64)
            kernels.take_pages(self.geometry, self.pages.copy(), rows, self.base, counts, index.copy(), index)
            self._resync = False
        elif log:
            index = np.concatenate(log if touched is None else [*log, touched])
        elif touched is not None:
            index = touched
        else:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty, np.zeros(0, dtype=np.int32), False
        log.clear()
        cells = np.empty((3, index.size), dtype=np.int64)
        page = np.empty(index.size, dtype=np.int32)
        kernels.read_cells(self.pages, index, cells, page)
        return cells[0], cells[1], cells[2], page, reset

    def ensure_rows(self, rows: int) -> None:
        have = self.pages.shape[1]
        if rows <= have:
            return
        new = max(rows, 2 * have)
        pages = np.full((self.pages.shape[0], new, self.pages.shape[2]), -1, dtype=np.int32)
        pages[:, :have] = self.pages
        if self.log:
            # Logged flat indices move with the wider rows dimension.
            group, cell = np.divmod(np.concatenate(self.log), have * self.pages.shape[2])
            self.log[:] = [group * (new * self.pages.shape[2]) + cell]
        self.pages = pages
        self.bounds = np.concatenate([self.bounds, np.zeros((2, pages.shape[0], new - have), dtype=np.int64)], axis=2)
        self._bind()

    # --- outside the step (free, rewind) and the step's block tables -------------------
    def take_flat(self, rows: np.ndarray, lo: np.ndarray, *, counts: np.ndarray, total: int) -> np.ndarray:
        """Forget logical pages ``[lo, lo + counts)`` (``[G, R]`` each, ``total`` pages in
        all) of every group: their ids, group-major then row-major."""
        out = np.empty(total, dtype=np.int64)
        touched = np.empty(total, dtype=np.int64)
        kernels.take_pages(self.geometry, self.pages, rows, lo, counts, out, touched)
        self.note_cells(touched)
        return out

    def clear_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Empty ``rows`` in every group (bounds back to 0): their held page ids,
        group-major, row-major, in logical order, and how many per group."""
        lo = self.bounds[0][:, rows]
        counts = self.bounds[1][:, rows] - lo
        per_group = counts.sum(axis=1)
        pages = self.take_flat(rows, lo, counts=counts, total=int(per_group.sum()))
        self.bounds[:, :, rows] = 0
        return pages, per_group

    def block_table(self, g: int, rows: np.ndarray, width: int) -> np.ndarray:
        """int32 ``[R, width]``: group ``g``'s pages from each row's base, -1 padded."""
        out = np.empty((rows.size, width), dtype=np.int32)
        kernels.block_table(self.geometry, self.pages, self.bounds, g, rows, out)
        return out


def _log2(n: int) -> int:
    """log2 of a power of two, -1 otherwise."""
    return n.bit_length() - 1 if n & (n - 1) == 0 else -1
