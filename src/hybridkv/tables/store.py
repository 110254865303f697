"""Per-request page tables of every cache group, in one store the step kernels own (its layout:
docs/manager.md, "The table store's layout"). The methods here serve what happens outside the
step kernels (prefix hits, publishing, free) and never touch a pool."""

from __future__ import annotations

import numpy as np

from hybridkv.runtime import kernels
from hybridkv.spec import CacheGroupSpec


def cdiv(a, b):
    return -(-a // b)


NARROW_STEP_TOKENS = 1
"""Tokens a row writes in the step its narrow ring is sized for (a decode step; the
ring is a power of two, so it often fits a few more: V4's c4 state rings fit 6)."""


def live_pages_bound(window_tokens: int, page_tokens: int, step_tokens: int) -> int:
    """The most pages a sliding row holds live after a step writing ``step_tokens`` tokens: ``cdiv(W + n + T - 2, T)``.

    Proof: a step writing ``[first, first + n)`` keeps pages from ``floor(max(first - W + 1, 0) / T)`` (the release
    point; the base never lags it, every step releases up to it) to ``ceil((first + n) / T)`` (the hi before the step is
    at most ``ceil(first / T)``). With ``a = first - W + 1 = qT + r``, ``0 <= r < T``, that is
    ``ceil((r + W - 1 + n) / T)`` pages, largest at ``r = T - 1``; below ``first = W - 1`` the base is 0 and the count
    is ``ceil((first + n) / T)``, no more. ``tests/test_tables.py`` checks it against the kernels' plan for every
    ``first``.
    """
    return cdiv(window_tokens + step_tokens + page_tokens - 2, page_tokens)


class GroupTable:
    """Page tables of one group for every request row: a view of its ``TableSet``."""

    def __init__(self, spec: CacheGroupSpec, *, max_context_tokens: int, max_step_tokens: int):
        self.spec = spec
        self.page_tokens = spec.page_tokens
        self.sliding = spec.is_sliding
        self.window_tokens = spec.sliding_window_tokens or 0
        if self.sliding:  # a window plus a step's pages (>= ``live_pages_bound``), rounded up to a power of two
            ring = cdiv(self.window_tokens - 1 + max_step_tokens, self.page_tokens) + 2
            self.capacity_pages = 1 << (int(ring) - 1).bit_length()
            narrow = live_pages_bound(self.window_tokens, self.page_tokens, NARROW_STEP_TOKENS)  # at least 1
            self.ring_pages = min(1 << (int(narrow) - 1).bit_length(), self.capacity_pages)
        else:
            self.capacity_pages = cdiv(max_context_tokens, self.page_tokens)
            self.ring_pages = self.capacity_pages
        self.has_lanes = self.ring_pages < self.capacity_pages
        self.table_set: TableSet | None = None  # the store of every group's tables this one views (it binds it)
        self.group_index = 0  # this group's index in its ``table_set``

    base = property(lambda self: self.table_set.bounds[kernels.BASE, self.group_index])
    hi = property(lambda self: self.table_set.bounds[kernels.HI, self.group_index])

    @property
    def pages(self) -> np.ndarray:
        """Debug view (a copy): this group's part of ``TableSet.ring_view``."""
        return self.table_set.ring_view()[self.group_index, :, : self.capacity_pages]

    def pages_in(self, rows: np.ndarray | int, lo: np.ndarray | int, hi: np.ndarray | int) -> np.ndarray:
        """Held page ids (int64) of logical pages ``[lo_r, hi_r)`` per row (or of one), row-major, in logical order."""
        rows, lo, hi = (np.array(a, dtype=np.int64, ndmin=1) for a in (rows, lo, hi))
        ts = self.table_set
        return ts.pages[_cells(ts.geometry, ts.bounds, self.group_index, rows, lo, hi)].astype(np.int64)


class TableSet:
    """Every group's tables in one store (``pages``, ``bounds``, ``geometry``: ``hybridkv.runtime.kernels``' layout)
    that each ``GroupTable`` views. While ``n_logged`` is a count (not None), every cell a mutation touches is logged
    for ``drain_updates`` (the first drain after ``set_log(True)`` is a resync: docs/manager.md, "Block table
    modes")."""

    def __init__(self, specs: list[CacheGroupSpec] | tuple[CacheGroupSpec, ...], *, max_context_tokens: int,
                 max_step_tokens: int, initial_rows: int = 64, id_offsets: list[int] | None = None):
        self.tables = [GroupTable(s, max_context_tokens=max_context_tokens, max_step_tokens=max_step_tokens)
                       for s in specs]
        self.view_columns = max(t.capacity_pages for t in self.tables)
        self.row_cells = sum(t.capacity_pages for t in self.tables)  # the live cells a row holds at most
        self.geometry = np.zeros((len(self.tables), kernels.GEOMETRY_COLUMNS), dtype=np.int64)
        for g, t in enumerate(self.tables):
            t.table_set, t.group_index = self, g
            mask = t.capacity_pages - 1 if t.sliding else -1
            offset = 0 if id_offsets is None else id_offsets[g]  # the group's first id in the page space
            self.geometry[g, : kernels.RING_START] = (
                t.page_tokens, t.window_tokens, mask, t.spec.rows_per_page, t.spec.entry_stride_tokens, offset,
                kernels.log2_exact(t.page_tokens), kernels.log2_exact(t.spec.entry_stride_tokens))
            self.geometry[g, kernels.RING_MASK] = t.ring_pages - 1 if t.sliding else -1
            self.geometry[g, kernels.VIEW_COLUMNS] = self.view_columns
        self.geometry[:, kernels.STEP_TOKENS] = max_step_tokens  # ``prepare_step`` refuses larger counts
        rows = max(1, int(initial_rows))
        self.max_context_tokens = max_context_tokens
        self.pages, layout = self._new_store(rows)
        self._set_layout(layout)
        self.bounds = np.zeros((kernels.HELD_PAGES, len(self.tables), rows), dtype=np.int64)  # none held yet
        self._add_lanes(0, rows)
        self.n_logged: int | None = None  # cells logged: the first of ``logged`` (a step's touched cells follow them)
        self.logged = np.empty(0, dtype=np.int64)  # ring-view indices, and the step kernels' touched-cell scratch
        self.log_notes = 0  # ``note_cells`` calls the log holds apart (more than 512: merged into one, unique)
        self.resync = False  # the next drain lists every live cell (the log restarted): nothing is logged till then

    rows_capacity = property(lambda self: self.bounds.shape[2])  # table rows now (``ensure_rows`` grows them)

    @property
    def row_held_pages(self) -> int:
        """The pages a row holds outside its live cells at most: a checkpoint in every group (``hold_checkpoints``)."""
        return len(self.tables) * (self.bounds.shape[0] - kernels.HELD_PAGES)

    def hold_checkpoints(self, checkpoint_tokens: dict[int, int], grain_tokens: int, keep_every_tokens: int) -> None:
        """From now on a step's row that crosses a multiple of ``grain_tokens`` past its ``DEFER_FROM`` tokens (and no
        multiple of ``keep_every_tokens``, if not 0) holds its checkpoint there in each group ``g`` of
        ``checkpoint_tokens``: the pages of its last ``checkpoint_tokens[g]`` tokens below the boundary, one reference
        each (``kernels.release_pages``), in place of the one it held. Before any row is taken."""
        assert not self.bounds[kernels.HI].any(), "hold_checkpoints before any row is taken"
        most = max((cdiv(n, self.tables[g].page_tokens) for g, n in checkpoint_tokens.items()), default=0)
        self.bounds = np.concatenate([self.bounds, np.zeros((most, *self.bounds.shape[1:]), np.int64)])
        for g, n in checkpoint_tokens.items():
            self.geometry[g, kernels.HOLD_TOKENS] = n
        self.geometry[:, kernels.HOLD_GRAIN] = grain_tokens if checkpoint_tokens else 0
        self.geometry[:, kernels.KEEP_EVERY] = keep_every_tokens

    def _new_store(self, rows: int) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
        """An empty flat store for ``rows`` rows (rings or column-major tables filled with -1, then the lanes,
        unwritten) and its layout for :meth:`_set_layout` (per group: ring start, row and column strides, lane start);
        changes nothing (a store too large for memory raises ``MemoryError``, saying what sized it)."""
        starts, at = [], 0
        for t in self.tables:
            starts.append(at)
            at += rows * t.ring_pages
        rings, layout = at, []
        for t, start in zip(self.tables, starts):
            layout.append((start, t.ring_pages if t.sliding else 1, 1 if t.sliding else rows, at if t.has_lanes else -1))
            at += rows * t.capacity_pages if t.has_lanes else 0
        try:
            pages = np.empty(at, dtype=np.int32)
        except (MemoryError, ValueError):  # (numpy refuses a size past what it can index with a ValueError)
            raise MemoryError(f"block tables for {rows} request rows need {at * 4:,} bytes ({at // rows:,} cells a row, "
                              f"set by the max context of {self.max_context_tokens:,} tokens): lower "
                              "max_context_tokens") from None
        pages[:rings] = -1
        return pages, layout

    def _set_layout(self, layout: list[tuple[int, int, int, int]]) -> None:
        """Write a store's layout (:meth:`_new_store`'s) into ``geometry``."""
        columns = [kernels.RING_START, kernels.ROW_STRIDE, kernels.COLUMN_STRIDE, kernels.LANE_START]
        for g, starts in enumerate(layout):
            self.geometry[g, columns] = starts

    def _add_lanes(self, have: int, new: int) -> None:
        """Lanes ``[have, new)`` join each lane group's free stack, below the free ones
        (the lowest free lane stays on top)."""
        for g, t in enumerate(self.tables):
            if not t.has_lanes:
                continue
            free = int(self.geometry[g, kernels.FREE_COUNT])
            stack = self.bounds[kernels.FREE_LANES, g]
            stack[new - have: new - have + free] = stack[:free].copy()
            stack[: new - have] = np.arange(new - 1, have - 1, -1)
            self.geometry[g, kernels.FREE_COUNT] = free + new - have

    def lanes(self, g: int) -> np.ndarray:
        """Debug view: each row's lane in group ``g`` (-1: narrow; a wide row's pages sit in its lane)."""
        return self.bounds[kernels.LANE, g] - 1

    def ring_view(self) -> np.ndarray:
        """Debug view: int32 ``[G, rows, view columns]``, group ``g``'s logical page ``L`` of
        a row at column ``L % capacity`` (sliding) or ``L``, -1 outside live pages:
        what a ``BlockTableMirror`` holds once it has applied every update."""
        index = self._live_index()
        view = np.full((len(self.tables), self.rows_capacity, self.view_columns), -1, dtype=np.int32)
        group, row, column = (np.empty(index.size, dtype=np.int64) for _ in range(3))
        page = np.empty(index.size, dtype=np.int32)
        kernels.read_cells(self.geometry, self.pages, self.bounds, index, group, row, column, page)
        view[group, row, column] = page
        return view

    def _live_index(self) -> np.ndarray:
        """Ring-view index of every live cell, group after group, row after row, in logical order."""
        rows, index = np.arange(self.rows_capacity), [np.empty(0, dtype=np.int64)]
        for g in range(len(self.tables)):
            lo, hi = self.bounds[kernels.BASE, g], self.bounds[kernels.HI, g]
            index.append(np.empty(int((hi - lo).sum()), dtype=np.int64))
            kernels.span_cells(self.geometry, self.bounds, g, rows, lo, hi, np.empty_like(index[-1]), index[-1])
        return np.concatenate(index)

    # --- touched-cell log (incremental block tables) ------------------------
    def set_log(self, on: bool) -> None:
        """Log touched cells from now on (the next drain is a resync), or stop (``on`` False: full-mode steps, whose
        mutations then cost nothing extra until logging starts again)."""
        if not on:
            self.n_logged = None
        elif self.n_logged is None:
            self.n_logged, self.log_notes, self.resync = 0, 0, True

    def reserve_log(self, n_cells: int) -> None:
        """Room in ``logged`` for ``n_cells`` more after the logged ones (a step's touched cells go there)."""
        n_logged = self.n_logged or 0
        if n_logged + n_cells > self.logged.size:
            grown = np.empty(2 * (n_logged + n_cells), dtype=np.int64)
            grown[:n_logged] = self.logged[:n_logged]
            self.logged = grown

    def drained(self) -> None:
        """The log is read (its cells and those a step touched after them: ``drain_updates``, or ``finish_step``'s
        cells): empty again, logging on, no resync due."""
        self.n_logged, self.log_notes, self.resync = 0, 0, False

    def note_cells(self, index: np.ndarray) -> None:
        """Log changed cells (ring-view indices) while logging is on and no resync is due."""
        at = self.log_at(index.size)
        if at >= 0:
            self.logged[at : at + index.size] = index
            self.count_logged(index.size)

    def log_at(self, n_cells: int) -> int:
        """Where in ``logged`` the next cells logged go, room for ``n_cells`` reserved there; -1 while logging is off
        or a resync is due (nothing to log). A kernel that writes them there leaves :meth:`count_logged` to its caller."""
        n_logged = self.n_logged
        if n_logged is None or self.resync:
            return -1
        if n_logged + n_cells > self.logged.size:
            self.reserve_log(n_cells)
        return n_logged

    def count_logged(self, n_cells: int) -> None:
        """``n_cells`` more cells logged, written where :meth:`log_at` said (one note; more than 512 notes between
        two drains: the log merged, unique, to keep it bounded)."""
        self.n_logged, self.log_notes = self.n_logged + n_cells, self.log_notes + 1
        if self.log_notes > 512:
            kept = np.unique(self.logged[: self.n_logged])
            self.logged[: kept.size] = kept
            self.n_logged, self.log_notes = kept.size, 1

    def drain_updates(self, n_cells: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                  np.ndarray, bool]:
        """(group, row, column, page id now, reset): the first ``n_cells`` of ``logged`` (a step's: the cells
        logged since the last drain, then those it touched), by default every cell logged; after a (re)start of
        the log, every live cell instead and ``reset`` True. The log is empty after it."""
        reset = self.resync
        index = self._live_index() if reset else self.logged[: (self.n_logged or 0) if n_cells is None else n_cells]
        if self.n_logged is not None:
            self.drained()
        cells = np.empty((3, index.size), dtype=np.int64)
        page = np.empty(index.size, dtype=np.int32)
        group, row, column = cells
        kernels.read_cells(self.geometry, self.pages, self.bounds, index, group, row, column, page)
        return group, row, column, page, reset

    def ensure_rows(self, rows: int) -> None:
        have = self.rows_capacity
        if rows <= have:
            return
        new = max(rows, 2 * have)
        pages, layout = self._new_store(new)  # first: nothing has changed if it raises
        bounds = np.concatenate([self.bounds, np.zeros((*self.bounds.shape[:2], new - have), np.int64)], axis=2)
        old_pages, old_geometry, old_bounds = self.pages, self.geometry.copy(), self.bounds
        self.pages, self.bounds = pages, bounds
        self._set_layout(layout)
        self._add_lanes(have, new)
        for g in range(len(self.tables)):  # every live cell to its place in the new layout
            rows = np.flatnonzero(old_bounds[kernels.HI, g] > old_bounds[kernels.BASE, g])
            lo, hi = old_bounds[kernels.BASE, g, rows], old_bounds[kernels.HI, g, rows]
            self.pages[_cells(self.geometry, self.bounds, g, rows, lo, hi)] = \
                old_pages[_cells(old_geometry, old_bounds, g, rows, lo, hi)]
        if self.n_logged:
            # Logged ring-view indices move with the wider rows dimension (now one note).
            group, cell = np.divmod(self.logged[: self.n_logged], have * self.view_columns)
            self.logged[: self.n_logged], self.log_notes = group * (new * self.view_columns) + cell, 1

    # --- outside the step (free) and the step's block tables ---------------------------
    def block_table(self, g: int, rows: np.ndarray, width: int) -> np.ndarray:
        """int32 ``[R, width]``: group ``g``'s pages from each row's base, -1 padded."""
        out = np.empty((rows.size, width), dtype=np.int32)
        kernels.block_table(self.geometry, self.pages, self.bounds, g, rows, out)
        return out


class CommitPages:
    """The pages prefix commits publish, read (and their entries claimed, where asked) in one compiled call
    (:meth:`read`, :meth:`read_unit`). ``history``: (table, pages per block); ``state``: (table,
    window tokens ``W``: a checkpoint's ``ceil(W / T)`` pages); ``space`` (to claim entries in): the
    ``hybridkv.memory.pool.PageSpace`` of the tables' groups."""

    def __init__(self, history: list[tuple[GroupTable, int]], state: list[tuple[GroupTable, int]], space):
        self._set = (history or state)[0][0].table_set if history or state else None
        self._history = np.asarray([(t.group_index, n) for t, n in history], dtype=np.int64).reshape(-1, 2)
        self._state = np.asarray([(t.group_index, w) for t, w in state], dtype=np.int64).reshape(-1, 2)
        self.block_pages = [n for _, n in history]
        self.checkpoint_pages = [cdiv(w, t.page_tokens) for t, w in state]
        self.boundary_pages = sum(self.checkpoint_pages)  # every state group's pages of one checkpoint
        self._sizes = sum(self.block_pages), self.boundary_pages, len(history), len(state)
        self._layout, self._status = np.empty((16, 3), dtype=np.int64), np.empty(16, dtype=np.int8)
        self._claim_in = (space.ref_counts, space.cached, space.low_priority,
                          np.asarray([p.num_pages for p in space.pools], dtype=np.int64))
        self._no_claims = np.zeros(0, dtype=np.int8)
        self._starts = np.empty(len(history) + len(state) + 1, dtype=np.int64)  # read_unit's scratch
        self._unit_pages = self._sizes[0] + self.boundary_pages  # a block's and its checkpoint's, every group's
        self._out = np.empty(max(64, 2 * self._unit_pages), dtype=np.int64)  # room for a one-block unit's
        if self._set is not None:  # ``read_unit``'s kernel, its compiled code
            ts = self._set
            self._commit_unit = kernels.entry_point(kernels.commit_unit, (
                ts.geometry, ts.pages, ts.bounds, self._history, self._state, (0,) * 8, self._out, self._starts,
                *self._claim_in))

    def read(self, row: int, first_block: int, end_block: int, boundaries: list[int],
             want: list[int] | np.ndarray = ()) -> tuple[list[int], list[int]]:
        """The page ids, entry by entry: history group by group its blocks, then boundary by
        boundary each state group's window (one not live: its place left unread); and per
        entry its status: 1 live, 0 a window not live, 2 claimed: ``want`` (empty: claim
        nothing) names the entries to key, 1 or 2 (low priority), claimed where live and no
        page of theirs carries a key. ValueError, and nothing changes, if a page to claim
        is not held."""
        ts, (per_block, per_boundary, n_history, n_state) = self._set, self._sizes
        if ts is None:
            return [], []  # no group publishes anything
        n_blocks, n_boundaries = end_block - first_block, len(boundaries)
        size = n_blocks * per_block + n_boundaries * per_boundary
        n_entries = n_blocks * n_history + n_boundaries * n_state
        if size > self._out.size or n_entries > self._status.size:
            self._out = np.empty(2 * max(size, self._out.size), dtype=np.int64)
            entries = 2 * max(n_entries, self._status.size)
            self._layout, self._status = np.empty((entries, 3), dtype=np.int64), np.empty(entries, np.int8)
        n = kernels.commit_pages(ts.geometry, ts.pages, ts.bounds, self._history, self._state, row, first_block,
                                 end_block, np.asarray(boundaries, dtype=np.int64), self._out, self._layout,
                                 self._status, np.asarray(want, dtype=np.int8) if len(want) else self._no_claims,
                                 *self._claim_in)
        if n < 0:
            raise ValueError(f"page {int(self._out[-1 - n])} is not a held, unpublished page of its group")
        return self._out[:n].tolist(), self._status[:n_entries].tolist()

    def read_unit(self, unit: tuple[int, ...]) -> list[int] | None:
        """One commit claimed whole or not at all, in one compiled call (``kernels.commit_unit``, whose ``unit``
        this is: 8 ints, ``low``, row, first and end block, the speculative boundaries' start, step and count, the
        latest): its pages, group by group in :meth:`read`'s order, or None where it was not claimed (nothing
        claimed: the caller commits it through :meth:`read`)."""
        ts = self._set
        if ts is None:
            return []  # no group publishes anything
        size = (unit[3] - unit[2]) * self._unit_pages  # at most a checkpoint a block
        if size > self._out.size:
            self._out = np.empty(2 * max(size, self._out.size), dtype=np.int64)
        n = self._commit_unit(ts.geometry, ts.pages, ts.bounds, self._history, self._state, unit, self._out,
                              self._starts, *self._claim_in)
        return self._out[:n].tolist() if n >= 0 else None


def _cells(geometry: np.ndarray, bounds: np.ndarray, g: int, rows: np.ndarray, lo: np.ndarray,
           hi: np.ndarray) -> np.ndarray:
    """Store index of logical pages ``[lo_r, hi_r)`` of each of ``rows`` in group ``g``,
    row-major, in logical order (``kernels.span_cells``)."""
    at = np.empty(int(np.maximum(hi - lo, 0).sum()), dtype=np.int64)
    if at.size:
        kernels.span_cells(geometry, bounds, g, rows, lo, hi, at, np.empty_like(at))
    return at
