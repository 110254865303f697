"""The compiled data plane: one step's per-group, per-request work as plain loops.

Every function here is a numba ``@njit(cache=True)`` kernel (plain Python with ``NUMBA_DISABLE_JIT=1``) over the
manager's struct-of-arrays state: its table store (``TableSet``), page space (``PageSpace``) and per-row token counters
(docs/manager.md, "One step, in four stages"). A step is ``prepare_step`` (pure: the plan admission reads) then
``run_step`` (release, allocate, the batch's arrays); ``step`` runs both in one call when the plan needs nothing from
Python in between (most steps).

Arrays (``G`` groups, ``R`` scheduled rows, ``N`` scheduled tokens):

* ``geometry`` int64 ``[G, 19]``: page tokens ``T``, window tokens ``W`` (0: full history), ring column mask
  (``capacity - 1`` for sliding groups, -1 for full history), rows per page, entry stride tokens, the group's first id
  in the page space (ids of group ``g`` are ``offset + local id``), then the log2 of page tokens and of stride (-1 where
  not a power of two: a division then), then where the group's cells sit in ``pages`` (below), (the one column the
  kernels change) how many of its lanes are free, the most tokens a row writes in a step, then (``HOLD_TOKENS``) the
  trailing tokens of a checkpoint a row holds in this group past its prompt (0: none; ``TableSet.hold_checkpoints``)
  and (``HOLD_GRAIN``, every group's) the grain of those boundaries (0: no row holds any), and (``KEEP_EVERY``) the
  interval of boundaries that are published past the prompt too (0: none; ``held_boundary``).
* ``pages`` int32, flat: every group's table cells (docs/manager.md, "The table store's layout"). Group ``g``'s logical
  page ``L`` of a row is at ``RING_START + row * ROW_STRIDE + (L & RING_MASK) * COLUMN_STRIDE`` (a sliding row's narrow
  ring; full history column-major), or for a *wide* row in its lane ``k`` at
  ``LANE_START + k * (COLUMN_MASK + 1) + (L & COLUMN_MASK)`` (``cell``; ``fit_ring`` moves a row between them). Only
  cells of live pages mean anything.
* ``bounds`` int64 ``[5 + K, G, table rows]``: live logical pages ``[base, hi)``, the row's lane plus one (0: narrow),
  per group the stack of free lanes (``bounds[FREE_LANES, g, :geometry[g, FREE_COUNT]]``, the lowest on top), then
  the boundary of the checkpoint the row holds (``HELD_AT``, 0: none) and its ``K`` page ids (``HELD_PAGES`` on, 0
  past the last), one reference each outside the row's live pages (``release_pages``' holds).
* The *ring view* (``TableSet.ring_view``, the engine's ``BlockTableMirror``): group ``g``, row, column
  ``L & COLUMN_MASK`` at index ``(g * table rows + row) * VIEW_COLUMNS + column``; the cells a kernel touches are logged
  in that form.
* ``counters`` int64 ``[5, table rows]``: computed, committed and known tokens per row, the tokens past which its
  boundaries are held rather than published at its next step (``DEFER_FROM``: its prompt's) and its published tokens
  (``PUBLISHED``: below its committed ones while it holds a checkpoint).
* ``per_group`` int64 ``[PER_GROUP_ROWS, G]``: each group's counts (``TOP`` ... ``SKIP_PACKING``).
* ``ref`` int32 ``[P]``, ``keyed`` bool ``[P]``: per page-space id, its holders and whether it carries a content key (an
  idle keyed page goes to ``hybridkv.memory.lru``'s lists, not to the free stack).
* ``stack`` int32 ``[P]``: group ``g``'s free local ids at ``stack[offset_g : offset_g + top[g]]``, the next one handed
  out last; a ``lowest`` group's sorted, the lowest on top.

The rules (docs/manager.md): a step writing tokens ``[first, first + n)`` of a row releases, in a sliding group, the
logical pages below ``min(max(first - W + 1, 0) // T, hi)`` and holds pages up to ``ceil((first + n) / T)``.
"""

from __future__ import annotations

import ctypes

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic, overload

PAGE_TOKENS, WINDOW_TOKENS, COLUMN_MASK, ROWS_PER_PAGE, STRIDE_TOKENS, ID_OFFSET = range(6)
PAGE_SHIFT, STRIDE_SHIFT = range(6, 8)  # log2 of the page and stride sizes, -1 if not a power of two
RING_START, ROW_STRIDE, RING_MASK, LANE_START, VIEW_COLUMNS, COLUMN_STRIDE = range(8, 14)  # the store's layout
FREE_COUNT = 14  # free lanes of the group (kernels change it)
STEP_TOKENS = 15  # the most tokens a row writes in a step (``max_step_tokens``)
HOLD_TOKENS, HOLD_GRAIN, KEEP_EVERY = 16, 17, 18  # a held checkpoint's tokens in the group; the grain (0: none
# held); the tokens between boundaries a policy publishes past the prompt too (0: none), whose crossings commit
GEOMETRY_COLUMNS = 19
BASE, HI, LANE, FREE_LANES, HELD_AT, HELD_PAGES = range(6)  # planes of ``bounds`` (``HELD_PAGES`` and on: ids)
DEFER_FROM, PUBLISHED = 3, 4  # rows of ``counters`` after computed, committed and known
TOP, LOWEST, LOW_FLOOR, RELEASED_PAGES, ALLOCATED_PAGES, LRU_PAGES, GRANTED_PAGES, PEAK_USED_PAGES = range(8)
LOW_IDLE_PAGES, SKIP_PACKING = range(8, 10)
PER_GROUP_ROWS = 10  # rows of ``per_group`` (``PageSpace.per_group``)
_INT32, _INT64 = np.dtype(np.int32), np.dtype(np.int64)  # ``batch_arrays_for``'s

STEP_DONE = 0
STEP_NEEDS_PAGES = 1  # the releases ran; the caller lends slabs or evicts, then calls finish_step
STEP_PLANNED = 2  # ``step`` planned only: Python admits, commits or grows buffers, then runs
STEP_COVERED = 3  # ``step`` planned only: a free stack is short, but the step's own releases cover it
STEP_COMMITS = 4  # ``step`` planned only: a clean plan whose rows cross a grain, its buffers large enough
STEP_SPARE = 5  # ``step_spare`` planned only: ``admit_spare`` admits a ``STEP_PLANNED`` plan, its buffers large enough
MISLISTED = -(1 << 62)  # ``first_out_of_range``: a group-major page list its counts do not match


@njit(cache=True, inline="always")
def divide(value, divisor, shift):
    """``value // divisor`` for ``value >= 0``, a shift when ``divisor`` is ``1 << shift``."""
    return value >> shift if shift >= 0 else value // divisor


@njit(cache=True, inline="always")
def row_cells(geometry, bounds, g, row):
    """Where ``row``'s cells of group ``g`` lie now: logical page ``L`` at ``start + (L & mask) * step``
    (its lane's, else its narrow ring's); ``(start, mask, step)``, read once for a run of pages."""
    lane = bounds[LANE, g, row]
    if lane:
        mask = geometry[g, COLUMN_MASK]
        return geometry[g, LANE_START] + (lane - 1) * (mask + 1), mask, 1
    return geometry[g, RING_START] + row * geometry[g, ROW_STRIDE], geometry[g, RING_MASK], geometry[g, COLUMN_STRIDE]


@njit(cache=True, inline="always")
def cell(geometry, bounds, g, row, logical):
    """Index in ``pages`` of logical page ``logical`` of ``row`` in group ``g``."""
    start, mask, step = row_cells(geometry, bounds, g, row)
    return start + (logical & mask) * step


@njit(cache=True, inline="always")
def view_cell(geometry, n_rows, g, row, logical):
    """Index of the same cell in the ring view (what the touched-cell log holds)."""
    return (g * n_rows + row) * geometry[g, VIEW_COLUMNS] + (logical & geometry[g, COLUMN_MASK])


@njit(cache=True)
def span_cells(geometry, bounds, g, rows, lo, hi, at, view):
    """``cell`` (to ``at``) and ``view_cell`` (to ``view``) of logical pages ``[lo[r], hi[r])``
    of each ``rows[r]`` in group ``g``, row after row, in logical order; returns how many."""
    n, n_rows = 0, bounds.shape[2]
    for r in range(rows.size):
        for logical in range(lo[r], hi[r]):
            at[n] = cell(geometry, bounds, g, rows[r], logical)
            view[n] = view_cell(geometry, n_rows, g, rows[r], logical)
            n += 1
    return n


@njit(cache=True, inline="always")
def window_held(bounds, g, row, d):
    """Whether ``row`` holds its checkpoint at boundary ``d`` (> 0) in group ``g`` (``HELD_AT``)."""
    return d > 0 and bounds[HELD_AT, g, row] == d


@njit(cache=True, inline="always")
def entry_readable(bounds, g, row, lo, count, held):
    """Whether an entry's pages ``[lo, lo + count)`` of ``row`` in group ``g`` can be read: the checkpoint it holds
    (``held``), or live pages."""
    return held or lo >= bounds[BASE, g, row] and lo + count <= bounds[HI, g, row]


@njit(cache=True, inline="always")
def entry_page(geometry, pages, bounds, g, row, lo, logical, held):
    """Logical page ``logical`` of an entry from ``lo``: of the checkpoint the row holds (``held``), else its
    table's."""
    return bounds[HELD_PAGES + logical - lo, g, row] if held else pages[cell(geometry, bounds, g, row, logical)]


@njit(cache=True)
def commit_pages(geometry, pages, bounds, history, state, row, first_block, end_block, boundaries, out, layout,
                 status, want, ref, keyed, low, limits):
    """Every page a prefix commit of ``row`` publishes, in one pass, into ``out``, one entry
    at a time: per history group ``history[h] = (g, pages per block)`` the pages of each
    block of ``[first_block, end_block)``; then per boundary ``D`` of ``boundaries``, per
    state group ``state[s] = (g, window tokens W)``, the pages of ``[max(D - W, 0), D)``.
    Entry ``e``: ``layout[e]`` = (group, first place in ``out``, pages), ``status[e]`` 1
    when its pages lie in the row's live pages ``[base, hi)`` or are the checkpoint it
    holds there (``HELD_AT``; always for history blocks; else 0, the cells left unread).
    Then, unless ``want`` is empty, the live entries are claimed (``claim_entries``:
    ``status`` 2 where claimed). Returns how many places it filled, or ``-1 - place`` of
    the first wanted page that is not held (nothing claimed then)."""
    n, e = 0, 0
    for h in range(history.shape[0]):
        g, per_block = history[h, 0], history[h, 1]
        for block in range(first_block, end_block):
            layout[e, 0], layout[e, 1], layout[e, 2], status[e] = g, n, per_block, 1
            for logical in range(block * per_block, (block + 1) * per_block):
                out[n] = pages[cell(geometry, bounds, g, row, logical)]
                n += 1
            e += 1
    for i in range(boundaries.size):
        d = boundaries[i]
        for s in range(state.shape[0]):
            g = state[s, 0]
            t = geometry[g, PAGE_TOKENS]
            lo, hi = max(d - state[s, 1], 0) // t, d // t
            held = window_held(bounds, g, row, d)
            good = entry_readable(bounds, g, row, lo, hi - lo, held)
            layout[e, 0], layout[e, 1], layout[e, 2], status[e] = g, n, hi - lo, 1 if good else 0
            for logical in range(lo, hi):
                if good:
                    out[n] = entry_page(geometry, pages, bounds, g, row, lo, logical, held)
                n += 1
            e += 1
    if want.size:
        bad = claim_entries(geometry, layout[:e], out, want, ref, keyed, low, limits, status)
        if bad >= 0:
            return -1 - bad
    return n


@njit(cache=True, _nrt=False)
def commit_unit(geometry, pages, bounds, history, state, unit, out, starts, ref, keyed, low_flags, limits):
    """The pages of one commit, claimed whole or not at all. ``unit``, a tuple of 8 ints: ``low``, row,
    first block, end block, then its boundaries (multiples of the grain): ``count`` speculative ones
    from ``start``, ``step`` apart (``unit[4:7]``), then its latest (``unit[7]``); its pages: per
    history group ``history[h] = (g, pages per block)`` its blocks ``[first, end)``, then per state
    group ``state[s] = (g, window tokens W)`` each boundary's window ``[D - W, D)``. Where every
    window is live (or the checkpoint the row holds there: ``HELD_AT``) and every page a held page of its group
    (``0 < id < limits[g]``, ref count > 0), none keyed, every page is keyed and written into ``out`` (large
    enough) group by group, entry by entry (a window before the latest flagged low where ``low`` is 2), and their
    count returned;
    else nothing changes and -1 is returned. ``starts`` (scratch, groups + 1): where each group's
    pages start in ``out``. It allocates nothing, so it runs without reference counting
    (``_nrt=False``: its 11 arrays come in without a MemInfo each)."""
    row, n_history, n_groups, n, good = unit[1], history.shape[0], history.shape[0] + state.shape[0], 0, True
    for j in range(n_groups):
        starts[j] = n
        for e in range((unit[3] - unit[2] if j < n_history else unit[6] + 1) if good else 0):
            g, lo, count, d = _unit_span(geometry, history, state, unit, j, e)
            offset, held = geometry[g, ID_OFFSET], window_held(bounds, g, row, d)
            good = entry_readable(bounds, g, row, lo, count, held)
            for logical in range(lo, lo + count if good else lo):
                page = entry_page(geometry, pages, bounds, g, row, lo, logical, held)
                good = 0 < page < limits[g] and ref[offset + page] > 0 and not keyed[offset + page]
                if not good:
                    break
                keyed[offset + page] = True
                out[n] = page
                n += 1
            if not good:
                break
    starts[n_groups] = n
    if not good:
        _unkey(geometry, history, state, out, starts, keyed)
        return -1
    _flag_low(geometry, history, state, unit, out, starts, low_flags)
    return n


@njit(cache=True, inline="always")
def _unit_span(geometry, history, state, unit, j, e):
    """Entry ``e`` of group ``j`` in ``unit``: (group, first logical page, pages, boundary): block
    ``first + e`` (boundary 0), or the window of boundary ``e`` (a speculative one, else the latest)."""
    n_history = history.shape[0]
    if j < n_history:
        per_block = history[j, 1]
        return history[j, 0], (unit[2] + e) * per_block, per_block, 0
    g, d = state[j - n_history, 0], unit[4] + e * unit[5] if e < unit[6] else unit[7]
    t = geometry[g, PAGE_TOKENS]
    lo = max(d - state[j - n_history, 1], 0) // t
    return g, lo, d // t - lo, d


@njit(cache=True, inline="always")
def _unkey(geometry, history, state, out, starts, keyed):
    """Unkey the pages of a commit not claimed (``out[starts[j]:starts[j + 1]]``: group ``j``'s)."""
    n_history = history.shape[0]
    for j in range(n_history + state.shape[0]):
        offset = geometry[history[j, 0] if j < n_history else state[j - n_history, 0], ID_OFFSET]
        for i in range(starts[j], starts[j + 1]):
            keyed[offset + out[i]] = False


@njit(cache=True, inline="always")
def _flag_low(geometry, history, state, unit, out, starts, low_flags):
    """Where ``unit``'s ``low`` is 2, flag low the pages of each state group's windows before
    its latest (``out[starts[j]:starts[j + 1]]`` holds group ``j``'s)."""
    n_history = history.shape[0]
    for j in range(n_history, n_history + state.shape[0] if unit[0] == 2 and unit[6] > 0 else n_history):
        g, _, n, _ = _unit_span(geometry, history, state, unit, j, unit[6])
        for i in range(starts[j], starts[j + 1] - n):
            low_flags[geometry[g, ID_OFFSET] + out[i]] = True


@njit(cache=True)
def claim_entries(geometry, layout, pages, want, ref, keyed, low, limits, status):
    """Key the pages of a commit's entries, in order: entry ``e`` is group ``layout[e, 0]``'s
    local ids ``pages[layout[e, 1] : layout[e, 1] + layout[e, 2]]``; ``want[e]`` 0 leaves it,
    1 claims it, 2 claims it low priority, where ``status[e]`` is not 0 (a live entry).
    A claimed entry none of whose pages is keyed yet gets them keyed (and flagged low)
    and ``status[e] = 2``. First every page to claim must be a held page of its group
    (``0 < id < limits[g]``, ref count > 0): else nothing changes and the index in
    ``pages`` of the first that is not is returned; -1 when all are."""
    for e in range(layout.shape[0]):
        if want[e] and status[e]:
            g, start = layout[e, 0], layout[e, 1]
            for i in range(start, start + layout[e, 2]):
                if pages[i] <= 0 or pages[i] >= limits[g] or ref[geometry[g, ID_OFFSET] + pages[i]] <= 0:
                    return i
    for e in range(layout.shape[0]):
        if not (want[e] and status[e]):
            continue
        offset, start, end = geometry[layout[e, 0], ID_OFFSET], layout[e, 1], layout[e, 1] + layout[e, 2]
        free = True
        for i in range(start, end):
            free = free and not keyed[offset + pages[i]]
        if not free:
            continue  # a page carries a key (borrowed)
        for i in range(start, end):
            keyed[offset + pages[i]] = True
            if want[e] == 2:
                low[offset + pages[i]] = True
        status[e] = 2
    return -1


@njit(cache=True, inline="always")
def fit_ring(geometry, pages, bounds, g, row, live_pages):
    """Make ``row`` wide (it takes the top free lane) when ``live_pages`` exceed its narrow ring, narrow
    (the lane goes back) when they fit, moving its live cells across (``move_ring``; the test inline: most
    calls change nothing)."""
    wide = live_pages > geometry[g, RING_MASK] + 1
    if geometry[g, LANE_START] >= 0 and wide != (bounds[LANE, g, row] > 0):
        move_ring(geometry, pages, bounds, g, row, wide)


@njit(cache=True)
def move_ring(geometry, pages, bounds, g, row, wide):
    """``fit_ring``'s move of ``row``'s live cells to a lane (``wide``) or back to its narrow ring."""
    if wide:
        geometry[g, FREE_COUNT] -= 1
        bounds[LANE, g, row] = bounds[FREE_LANES, g, geometry[g, FREE_COUNT]] + 1
    mask, narrow_mask = geometry[g, COLUMN_MASK], geometry[g, RING_MASK]
    lane = geometry[g, LANE_START] + (bounds[LANE, g, row] - 1) * (mask + 1)
    ring, stride = geometry[g, RING_START] + row * geometry[g, ROW_STRIDE], geometry[g, COLUMN_STRIDE]
    for logical in range(bounds[BASE, g, row], bounds[HI, g, row]):
        if wide:
            pages[lane + (logical & mask)] = pages[ring + (logical & narrow_mask) * stride]
        else:
            pages[ring + (logical & narrow_mask) * stride] = pages[lane + (logical & mask)]
    if not wide:
        bounds[FREE_LANES, g, geometry[g, FREE_COUNT]] = bounds[LANE, g, row] - 1
        geometry[g, FREE_COUNT] += 1
        bounds[LANE, g, row] = 0


@njit(cache=True)
def place_row(geometry, pages, bounds, row, lo, counts, page_ids, view):
    """A row's prefix hit: ``page_ids`` (group after group, ``counts[g]`` each) become ``row``'s live pages
    ``[lo[g], lo[g] + counts[g])`` (in its lane if they outgrow its ring); ring-view cells to ``view``."""
    n, n_rows = 0, bounds.shape[2]
    for g in range(lo.size):
        first, k = lo[g], counts[g]
        if k > 0:
            base, hi = bounds[BASE, g, row], bounds[HI, g, row]
            live = max(hi, first + k) - (min(base, first) if hi > base else first)
            fit_ring(geometry, pages, bounds, g, row, live)
            for logical in range(first, first + k):
                pages[cell(geometry, bounds, g, row, logical)] = page_ids[n]
                view[n] = view_cell(geometry, n_rows, g, row, logical)
                n += 1
        bounds[BASE, g, row] = first
        bounds[HI, g, row] = first + k


@njit(cache=True)
def write_slots(geometry, pages, bounds, rows, first, counts, settle, slots):
    """``slots[g, i]``: ``page * rows_per_page + entry % rows_per_page`` for token ``i`` of plan rows
    ``[settle, R)`` (entry ``position // stride``), -1 where the token closes no entry (row by row); a page looked
    up once (the geometry and the row's cells read into locals first: the slot stores may alias them). A decode row
    (one token) takes a branch of its own, without the loops over a row's pages and entries."""
    for g in range(geometry.shape[0]):
        tokens, page_shift = geometry[g, PAGE_TOKENS], geometry[g, PAGE_SHIFT]
        per_page = geometry[g, ROWS_PER_PAGE]
        stride, stride_shift = geometry[g, STRIDE_TOKENS], geometry[g, STRIDE_SHIFT]
        out, at = slots[g], 0  # at: the batch index of the row's first token
        for r in range(settle, rows.size):
            start, end = first[r], first[r] + counts[r]
            if end == start + 1:  # a decode row: one slot, -1 unless its token closes an entry
                slot = -1
                if stride == 1 or divide(end, stride, stride_shift) * stride == end:
                    logical = divide(start, tokens, page_shift)
                    page = np.int64(pages[cell(geometry, bounds, g, rows[r], logical)])
                    slot = (page - logical) * per_page + divide(start, stride, stride_shift)
                out[at] = slot
                at += 1
                continue
            if stride > 1:  # the row's tokens that close no entry stay -1
                out[at : at + counts[r]] = -1
            shift = at - start  # token p's batch index
            pos = divide(start + stride, stride, stride_shift) * stride - 1  # the first entry end
            if pos < end:
                cells_at, mask, step = row_cells(geometry, bounds, g, rows[r])
            while pos < end:
                logical = divide(pos, tokens, page_shift)
                whole = divide(end - pos, tokens, page_shift) if stride == 1 and pos == logical * tokens else 0
                if whole:  # a stride-1 group's whole pages in a loop of their own (4 tokens a page: a constant width)
                    run = out[shift + pos :]
                    if tokens == 4:
                        page_slots(pages, cells_at, mask, step, logical, whole, tokens, per_page, run, 4)
                    else:
                        page_slots(pages, cells_at, mask, step, logical, whole, tokens, per_page, run, tokens)
                    pos += whole * tokens
                    continue
                # The page's rest: every ``stride``-th slot, a view indexed from 0 (no negative index to wrap).
                base = (np.int64(pages[cells_at + (logical & mask) * step]) - logical) * per_page
                run = out[shift + pos : shift + min((logical + 1) * tokens, end) : stride]
                base += divide(pos, stride, stride_shift)
                for i in range(run.size):
                    run[i] = base + i
                pos += run.size * stride
            at += counts[r]


@njit(cache=True, inline="always")
def page_slots(pages, cells_at, mask, step, logical, n_pages, tokens, per_page, out, width):
    """``write_slots``' slots of a stride-1 group's ``n_pages`` whole pages from ``logical`` to ``out``, ``width``
    (``tokens``, a constant where the call can give one) a page."""
    for k in range(n_pages):
        page = logical + k
        base = (np.int64(pages[cells_at + (page & mask) * step]) - page) * per_page + page * tokens
        run = out[k * tokens : k * tokens + width]
        for i in range(width):
            run[i] = base + i


# --- one step: plan (pure), then run (release, allocate, the batch's arrays) -----------------
@njit(cache=True)
def settling_rows(computed, committed, last_rows, rows_in, mark, rows, counts):
    """Rows of ``last_rows`` not in ``rows_in`` with uncommitted tokens, to ``rows`` with zero ``counts``;
    how many, or -1 when ``rows_in`` lists a row twice (``mark``: all-False scratch)."""
    n_in, settle = rows_in.size, 0
    same = last_rows.size == n_in
    for r in range(n_in if same else 0):
        if last_rows[r] != rows_in[r]:
            same = False
            break
    if same:
        return 0
    if not distinct_rows(rows_in, mark, True):
        return -1
    for r in range(last_rows.size):
        row = last_rows[r]
        if not mark[row] and committed[row] < computed[row]:
            rows[settle] = row
            counts[settle] = 0
            settle += 1
    for r in range(n_in):
        mark[rows_in[r]] = False
    return settle


@njit(cache=True, inline="always")
def held_boundary(geometry, counters, row, first, grain_shift):
    """The boundary whose checkpoint a step of ``row`` from ``first`` tokens holds (``release_pages``) instead of
    committing it: the last multiple of the grain at or below ``first``, where the row's committed tokens lie in an
    earlier grain, every boundary crossed lies past the row's ``DEFER_FROM`` tokens and no multiple of
    ``KEEP_EVERY`` was crossed (those commit); else 0. ``grain_shift``: ``log2_exact`` of the grain."""
    grain = geometry[0, HOLD_GRAIN]
    if grain == 0:
        return 0
    committed = counters[1, row]
    q, done = divide(first, grain, grain_shift), divide(committed, grain, grain_shift)
    if done >= q or (done + 1) * grain <= counters[DEFER_FROM, row]:
        return 0
    every = geometry[0, KEEP_EVERY]
    return 0 if every > 0 and q * grain // every > committed // every else q * grain


@njit(cache=True, inline="always")
def note_crossing(geometry, counters, row, first, grain_shift, crossing, n_cross, n_held):
    """A row whose step from ``first`` crosses a grain: held (``held_boundary``: counted) or listed in ``crossing``
    for Python to commit. Returns both counts."""
    if held_boundary(geometry, counters, row, first, grain_shift):
        return n_cross, n_held + 1
    crossing[n_cross] = row
    return n_cross + 1, n_held


@njit(cache=True)
def prepare_step(geometry, bounds, counters, last_rows, rows_in, counts_in, grain, top, mark, rows, counts, first,
                 after, need, sums, crossing, totals, load_tokens):
    """The plan of a step of ``rows_in`` writing ``counts_in`` tokens each (one count for all when it holds
    one); pure but for ``mark``. -1 rows when a row is listed twice, would pass its ``known`` tokens or writes
    a count outside ``[1, geometry[0, STEP_TOKENS]]``.

    ``rows``, ``counts``, ``first``: the rows touched, settling ones first (``settling_rows``), their counts
    and computed tokens; ``after[0|1, g, r]``: base and hi after the step; ``need[g, r]``: pages holding its
    tokens; ``sums[0|1, g]``: pages released and allocated; ``crossing``: rows whose committed tokens lie
    in an earlier ``grain`` than their computed ones; ``totals``: tokens, pages released, most released in
    one group, pages allocated. Returns (rows, settling rows, crossing rows, every free stack covers).
    ``load_tokens`` (empty: a step that computes): a load step's rows hold only their last
    ``load_tokens[g]`` tokens' pages in a sliding group (their base may pass their hi)."""
    each = 0 if counts_in.size == 1 else 1  # ``counts_in[r * each]``: row r's count
    computed, committed, known = counters[0], counters[1], counters[2]
    settle = settling_rows(computed, committed, last_rows, rows_in, mark, rows, counts)
    if settle < 0:
        return -1, 0, 0, False
    n = settle + rows_in.size
    n_cross, n_held, grain_shift = 0, 0, log2_exact(grain)  # a shift per row, not two divisions, for a power of two
    totals[:] = 0
    for r in range(n):  # one pass: the rows' counts, computed tokens, counts and known tokens checked, crossings
        if r >= settle:
            rows[r], counts[r] = rows_in[r - settle], counts_in[(r - settle) * each]
        row = rows[r]
        first[r] = computed[row]
        if r >= settle and not 1 <= counts[r] <= min(known[row] - first[r], geometry[0, STEP_TOKENS]):
            return -1, 0, 0, False
        totals[0] += counts[r]
        if grain > 0 and divide(committed[row], grain, grain_shift) < divide(first[r], grain, grain_shift):
            n_cross, n_held = note_crossing(geometry, counters, row, first[r], grain_shift, crossing, n_cross, n_held)
    clean = True
    for g in range(geometry.shape[0]):  # the group's rows of bounds, after, need as 1-D views: no 3-D indexing a row
        tokens, shift, window = geometry[g, PAGE_TOKENS], geometry[g, PAGE_SHIFT], geometry[g, WINDOW_TOKENS]
        bases, his, new_bases, new_his, held_pages = bounds[BASE, g], bounds[HI, g], after[0, g], after[1, g], need[g]
        loading = window > 0 and load_tokens.size > 0
        released, allocated = 0, 0
        for r in range(n):
            row = rows[r]
            base, hi, end = bases[row], his[row], first[r] + counts[r]
            new_base = base
            if loading and r >= settle:
                new_base = max(base, divide(max(end - load_tokens[g], 0), tokens, shift))
            elif window > 0:
                new_base = max(base, min(divide(max(first[r] - window + 1, 0), tokens, shift), hi))
            held = divide(end + tokens - 1, tokens, shift)
            new_bases[r], new_his[r], held_pages[r] = new_base, max(hi, held), held
            released += min(new_base, hi) - base
            allocated += max(hi, held) - max(hi, new_base)
        sums[0, g], sums[1, g] = released, allocated
        let_go = n_held * (bounds.shape[0] - HELD_PAGES)  # the held pages those rows let go, at most
        totals[1] += released + let_go
        totals[2] = max(totals[2], released + let_go)
        totals[3] += allocated
        clean &= allocated <= top[g]
    return n, settle, n_cross, clean


@njit(cache=True)
def release_pages(geometry, pages, bounds, ref, keyed, stack, per_group, counters, rows, first, after, scratch,
                  idle_keyed, released, touched, n_touched):
    """Every row's pages below its new base leave its table, one reference less each; a page whose last
    reference went goes on its free stack (``push_run``), or if keyed to ``idle_keyed`` (group after
    group, ``drop_released`` of the pages read to ``scratch``). First a row whose step from ``first[r]`` crosses a
    boundary past its ``DEFER_FROM`` tokens (``counters``' committed ones not moved on yet) holds its checkpoint in
    each group that keeps one (``hold_checkpoint``), letting go of the one it held. ``released[0|1, g]``: pages gone
    free and idle keyed. Returns (cells logged, idle keyed pages)."""
    n_rows, top, lowest = bounds.shape[2], per_group[TOP], per_group[LOWEST]
    grain, n_keyed = geometry[0, HOLD_GRAIN], 0
    grain_shift = log2_exact(grain) if grain > 0 else 0
    for g in range(geometry.shape[0]):
        offset, holds = geometry[g, ID_OFFSET], geometry[g, HOLD_TOKENS] > 0
        bases, his, lanes, new_bases = bounds[BASE, g], bounds[HI, g], bounds[LANE, g], after[0, g]  # 1-D views
        n, n_free, keyed_from = 0, 0, n_keyed  # n: pages read
        for r in range(rows.size):
            row, new_base = rows[r], new_bases[r]
            if holds:
                d = held_boundary(geometry, counters, row, first[r], grain_shift)
                if d:
                    n = hold_checkpoint(geometry, pages, bounds, ref, g, row, d, scratch, n)
            if new_base == bases[row] and new_base <= his[row] and not lanes[row]:
                continue  # nothing to release and nothing to change (most rows of a decode step)
            cells_at, mask, step = row_cells(geometry, bounds, g, row)
            view_at, view_mask = view_cell(geometry, n_rows, g, row, 0), geometry[g, COLUMN_MASK]
            for logical in range(bounds[BASE, g, row], min(after[0, g, r], bounds[HI, g, row])):
                at = cells_at + (logical & mask) * step
                page = pages[at]
                pages[at] = -1
                touched[n_touched] = view_at + (logical & view_mask)
                n_touched += 1
                scratch[n] = page
                n += 1
            bounds[BASE, g, row] = after[0, g, r]
            bounds[HI, g, row] = max(bounds[HI, g, row], after[0, g, r])  # a load row's base may pass its hi
            if bounds[LANE, g, row]:
                fit_ring(geometry, pages, bounds, g, row, bounds[HI, g, row] - after[0, g, r])
        if n:
            n_free, n_keyed = drop_released(ref, keyed, offset, scratch[:n], scratch, 0, idle_keyed, n_keyed)
        released[0, g], released[1, g] = n_free, n_keyed - keyed_from
        per_group[RELEASED_PAGES, g] += n_free + n_keyed - keyed_from
        if n_free:
            top[g] = push_run(stack[offset:], top[g], lowest[g] != 0, scratch[:n_free])
    return n_touched, n_keyed


@njit(cache=True)
def hold_checkpoint(geometry, pages, bounds, ref, g, row, d, out, n):
    """``row`` holds its checkpoint at boundary ``d`` in group ``g``: the live pages of its last
    ``geometry[g, HOLD_TOKENS]`` tokens below ``d`` one reference more each, their ids to ``bounds[HELD_PAGES:]``
    (none where the window is not live), ``HELD_AT`` ``d``; the pages it held before go to ``out`` from ``n`` (their
    references for the caller to drop, as a release's). Returns the new ``n``."""
    for k in range(HELD_PAGES, bounds.shape[0]):
        if bounds[k, g, row] > 0:
            out[n] = bounds[k, g, row]
            n += 1
        bounds[k, g, row] = 0
    t, offset = geometry[g, PAGE_TOKENS], geometry[g, ID_OFFSET]
    lo, hi = max(d - geometry[g, HOLD_TOKENS], 0) // t, d // t
    live = lo >= bounds[BASE, g, row] and hi <= bounds[HI, g, row] and hi - lo <= bounds.shape[0] - HELD_PAGES
    for logical in range(lo, hi if live else lo):
        page = pages[cell(geometry, bounds, g, row, logical)]
        ref[offset + page] += 1
        bounds[HELD_PAGES + logical - lo, g, row] = page
    bounds[HELD_AT, g, row] = d if live else 0
    return n


@njit(cache=True, inline="always")
def drop_released(ref, keyed, offset, pages, freed, n_free, idle_keyed, n_keyed):
    """One reference less on each of one group's ``pages`` (local ids; the group's first id ``offset``); those whose
    last reference went, once each: unkeyed to ``freed`` from ``n_free`` (``pages`` may be ``freed``'s own from
    ``n_free`` on: a page is read before its place is written), keyed to ``idle_keyed`` from ``n_keyed``. Pages held
    once (so listed once) go in one pass up to the first held more often; from there every reference is dropped
    before any page is taken (in a loop of their own: the counts' and keys' cache misses overlap; a page listed twice
    goes at its first listing). Returns both counts so far."""
    start = 0
    while start < pages.size and ref[offset + pages[start]] == 1:
        page = pages[start]
        ref[offset + page] = 0
        if keyed[offset + page]:
            idle_keyed[n_keyed] = page
            n_keyed += 1
        else:
            freed[n_free] = page
            n_free += 1
        start += 1
    some_keyed = False
    for i in range(start, pages.size):
        ref[offset + pages[i]] -= 1
        some_keyed |= keyed[offset + pages[i]]
    free_from, keyed_from = n_free, n_keyed
    for i in range(start, pages.size):
        page = pages[i]
        if ref[offset + page] == 0:
            ref[offset + page] = -1  # taken once, even where the list repeats it
            if some_keyed and keyed[offset + page]:
                idle_keyed[n_keyed] = page
                n_keyed += 1
            else:
                freed[n_free] = page
                n_free += 1
    for i in range(free_from, n_free):
        ref[offset + freed[i]] = 0
    for i in range(keyed_from, n_keyed):
        ref[offset + idle_keyed[i]] = 0
    return n_free, n_keyed


@njit(cache=True)
def transient_pages(geometry, bounds, transient, g, rows, first, counts, after, sums):
    """Pages group ``g`` allocates this step that the next step releases again (below the window of their row's new
    end); 0 where ``transient[g]`` is not set, outside sliding groups and when no row gets more than one page (one page
    per row has no order to keep)."""
    tokens, shift, window = geometry[g, PAGE_TOKENS], geometry[g, PAGE_SHIFT], geometry[g, WINDOW_TOKENS]
    if not transient[g] or window <= 0:
        return 0
    rows_allocating, n, his, new_his = 0, 0, bounds[HI, g], after[1, g]
    for r in range(rows.size):  # first the cheap test (a decode step's rows get a page each at most)
        rows_allocating += new_his[r] > his[rows[r]]
    if sums[1, g] <= rows_allocating:
        return 0
    for r in range(rows.size):
        hi = his[rows[r]]
        keep_from = divide(max(first[r] + counts[r] - window + 1, 0), tokens, shift)
        n += min(max(keep_from - hi, 0), new_his[r] - hi)
    return n


@njit(cache=True, _nrt=False)  # allocates nothing: its arrays come in without a MemInfo each (Python calls it too)
def room_groups(geometry, bounds, transient, rows, first, counts, after, sums, stack, per_group, ref, keyed,
                low_priority, packing, out, start, not_joined, idle_keyed):
    """Before ``finish_step``, per group from ``start`` on: whether ``PagePool.make_room`` of its ``sums[1, g]`` pages
    may have something to do (``group_room``); ``out[g]``: then the pages it allocates that the next step releases
    again (``transient_pages``, ``make_room``'s ``highest``), else -1. Returns
    how many to ask; ``out`` None (``run_step``: whether to stop for Python): 1 at the first, written nowhere.
    ``packing``: ``Arena.packing``, its rule asked while the arena is roomy (``SKIP_PACKING``); None: then no group
    packs (the step kernel asks only short free stacks). ``not_joined``: per group, keyed pages gone idle not yet
    in its LRU, ``idle_keyed`` those pages, group after group from ``start`` (None: none)."""
    n_asked, at = 0, 0
    for g in range(start, sums.shape[1]):
        highest = group_room(geometry, bounds, transient, rows, first, counts, after, sums, stack, per_group, ref,
                             keyed, low_priority, packing, g, not_joined, idle_keyed, at)
        if not_joined is not None:
            at += not_joined[g]
        if out is None:
            if highest >= 0:
                return 1
        else:
            out[g] = highest
            n_asked += highest >= 0
    return n_asked


@njit(cache=True, inline="always")
def group_room(geometry, bounds, transient, rows, first, counts, after, sums, stack, per_group, ref, keyed,
               low_priority, packing, g, not_joined, idle_keyed, at):
    """``room_groups``' rule of group ``g``: its transient pages where its free stack is short or (a lowest-first
    group, its arena not roomy or, with ``packing``, its rule telling it to pack: ``must_pack_at``) an
    idle low-priority page lies below the highest id its long-lived pages take (``low_before``: first below the
    highest id of all, before counting them, then without the scan before the rule); else -1 (``make_room`` would
    evict nothing)."""
    count, top, offset = sums[1, g], per_group[TOP, g], geometry[g, ID_OFFSET]
    roomy = per_group[SKIP_PACKING, g] != 0
    if count == 0 or count <= top and (per_group[LOWEST, g] == 0 or roomy and packing is None or not low_before(
            stack, offset, top, count, ref, keyed, low_priority, per_group, g, not_joined, idle_keyed, at, False)):
        return -1
    highest = transient_pages(geometry, bounds, transient, g, rows, first, counts, after, sums)
    long = count - highest
    if count > top:
        return highest
    if long <= 0 or not low_before(stack, offset, top, long, ref, keyed, low_priority, per_group, g, not_joined,
                                   idle_keyed, at, False):
        return -1
    if roomy and packing is not None and not must_pack_at(ref, offset, packing, g, stack[offset + top - long], long,
                                                          per_group, not_joined):
        return -1
    return highest if low_before(stack, offset, top, long, ref, keyed, low_priority, per_group, g, not_joined,
                                 idle_keyed, at, True) else -1


@njit(cache=True)
def low_below(low_priority, keyed, ref, offset, per_group, g, end):
    """Whether group ``g`` (its page ids from ``offset``) has an idle low-priority page below id ``end``
    (``next_low_idle`` from its ``LOW_FLOOR``); its ``LOW_FLOOR`` is raised to the first, or to ``end`` when
    none lies below it (as ``PagePool._evict_low_below`` finding none sets it)."""
    flags = low_priority[offset:]
    page = next_low_idle(flags, keyed[offset:], ref[offset:], flag_words(flags), per_group[LOW_FLOOR, g], end)
    per_group[LOW_FLOOR, g] = page
    return page < end


@njit(cache=True)
def must_pack_at(ref, offset, packing, g, page, pages, per_group, not_joined):
    """The arena's packing rule of group ``g`` once it is roomy (``Arena._packing_rule``) for ``pages`` long-lived
    pages whose highest id is ``page``; ``ref[offset:]``: the group's ref counts. False when the slab of that id's first
    byte holds live pages of the group already, else whether its live pages plus ``pages`` would lie in more than
    ``spread_slabs`` slabs beyond those they fill. ``packing``: owners, the groups' slab page ranges and straddlers,
    and per group its page bytes, the reserved bytes, the slab bytes, the fewest inner pages of a slab
    (``per_slab``) and ``spread_slabs``. First, without the scans, False where its counts rule it out: the live
    pages are at most the group's granted pages less its free and idle ones (``per_group``; ``not_joined``: keyed
    pages gone idle not yet in its LRU, None: none), each slab counted holds one."""
    owner, lo, hi, straddle, sizes = packing
    page_bytes, reserved_bytes, slab_bytes, per_slab, spread_slabs = sizes[g]
    held = per_group[GRANTED_PAGES, g] - per_group[TOP, g] - per_group[LRU_PAGES, g]
    if not_joined is not None:
        held -= not_joined[g]
    if held + 1 <= -(-(held + pages) // per_slab) + spread_slabs:
        return False
    ref, lo, hi, straddle = ref[offset:], lo[g], hi[g], straddle[g]
    slab = (page * page_bytes - reserved_bytes) // slab_bytes
    for page in range(lo[slab], hi[slab]):
        if ref[page] > 0:
            return False
    n, held_pages, held_slabs = owner.size, 0, 0
    for s in range(n):
        if owner[s] != g:
            continue
        here = 0
        for page in range(lo[s], hi[s]):
            if ref[page] > 0:
                here += 1
        if s + 1 < n and owner[s + 1] == g and straddle[s + 1] >= 0 and ref[straddle[s + 1]] > 0:
            here += 1
        held_pages += here
        if here:
            held_slabs += 1
    return held_slabs + 1 > -(-(held_pages + pages) // per_slab) + spread_slabs


@njit(cache=True)
def allocate_pages(geometry, pages, bounds, ref, stack, per_group, transient, rows, first, counts, after, sums,
                   touched, n_touched):
    """Every row gets the pages from its hi to its new hi off its group's free stack (which holds enough),
    each held once; in a ``transient`` group the pages the next step releases again take the highest ids
    (``lowest`` group) or come last, so long-lived pages pack low. Returns cells logged."""
    n_rows, top, lowest = bounds.shape[2], per_group[TOP], per_group[LOWEST]
    for g in range(geometry.shape[0]):
        if sums[1, g] == 0:
            continue
        per_group[ALLOCATED_PAGES, g] += sums[1, g]
        offset = geometry[g, ID_OFFSET]
        tokens, shift, window = geometry[g, PAGE_TOKENS], geometry[g, PAGE_SHIFT], geometry[g, WINDOW_TOKENS]
        n_transient = transient_pages(geometry, bounds, transient, g, rows, first, counts, after, sums)
        # Survivors pop from the top; transient page k sits at ``late - k``.
        late = n_transient - 1 if lowest[g] else top[g] - sums[1, g] + n_transient - 1
        taken, free_top = 0, top[g]  # the top in a local: the stores below may alias ``top``
        his, new_his = bounds[HI, g], after[1, g]  # 1-D views
        for r in range(rows.size):
            row = rows[r]
            if new_his[r] == his[row]:
                continue  # no page to allocate and its hi stays
            keep_from = divide(max(first[r] + counts[r] - window + 1, 0), tokens, shift) if n_transient else 0
            if new_his[r] > his[row]:
                fit_ring(geometry, pages, bounds, g, row, new_his[r] - bounds[BASE, g, row])
            cells_at, mask, step = row_cells(geometry, bounds, g, row)
            view_at, view_mask = view_cell(geometry, n_rows, g, row, 0), geometry[g, COLUMN_MASK]
            for logical in range(his[row], new_his[r]):
                if n_transient > 0 and logical < keep_from:
                    page = stack[offset + late - taken]
                    taken += 1
                else:
                    free_top -= 1
                    page = stack[offset + free_top]
                ref[offset + page] = 1
                pages[cells_at + (logical & mask) * step] = page
                touched[n_touched] = view_at + (logical & view_mask)
                n_touched += 1
            his[row] = new_his[r]
        top[g] = free_top
        if n_transient > 0 and lowest[g]:
            for i in range(top[g] - n_transient):
                stack[offset + i] = stack[offset + n_transient + i]
        top[g] -= n_transient
    return n_touched


def batch_arrays_for(n_groups, n_requests, n_tokens, write_slots):
    """Fresh arrays for what ``run_step`` writes for a batch of ``R`` requests and ``N`` tokens, in its argument
    order: per_request int32 ``[2 + G, R]`` (table rows, scheduled tokens, each group's base pages),
    query_start_loc int32 ``[R + 1]``, request_indices int32 ``[N]``, per_token int64 ``[1 + G, N]`` (positions,
    each group's write slots; ``[1, N]`` without them). Dtypes as instances: numpy converts none (~40 ns each)."""
    return (np.empty((2 + n_groups, n_requests), _INT32), np.empty(n_requests + 1, _INT32),
            np.empty(n_tokens, _INT32), np.empty((1 + n_groups if write_slots else 1, n_tokens), _INT64))


@njit(cache=True, inline="always")
def run_views(plan, n_groups, n):
    """``plan_views`` of the plan of ``n`` rows in ``plan`` as a run reads them: rows, counts, first, after,
    sums, released, widths, release scratch, idle keyed pages."""
    rows, counts, first, after, _, sums, _, _, released, widths, scratch, idle_keyed = plan_views(plan, n_groups)
    return rows[:n], counts[:n], first[:n], after[:, :, :n], sums, released, widths, scratch, idle_keyed


@njit(cache=True, _nrt=False)
def run_step(geometry, pages, bounds, counters, ref, keyed, low_priority, stack, per_group, transient, plan, n,
             settle, hold, touched, n_logged, cells, cell_pages, per_request, query_start_loc, request_indices,
             per_token, idle=None):
    """One admitted step (docs/manager.md, stage 3) of the plan of ``n`` rows (``settle`` settling) that
    ``prepare_step`` wrote to ``plan`` (``plan_views``; its scratch too): commit, release, then ``finish_step``. Returns
    (status, cells logged, idle keyed pages); ``STEP_NEEDS_PAGES`` when it stopped after the releases for Python.
    With ``idle`` (``PageSpace.join_args``) the keyed pages its releases left idle join their LRUs before it returns
    (``join_idle``; none left to Python then)."""
    rows, counts, first, after, sums, released, _, scratch, idle_keyed = run_views(plan, geometry.shape[0], n)
    n_touched, n_keyed = release_pages(geometry, pages, bounds, ref, keyed, stack, per_group, counters, rows, first,
                                       after, scratch, idle_keyed, released, touched, n_logged)
    committed = counters[1]
    for r in range(n):
        committed[rows[r]] = first[r]
    status = STEP_NEEDS_PAGES
    if not (hold or room_groups(geometry, bounds, transient, rows, first, counts, after, sums, stack, per_group, ref,
                                keyed, low_priority, None, None, 0, released[1], idle_keyed)):
        n_touched = finish_step(geometry, pages, bounds, counters, ref, keyed, low_priority, stack, per_group,
                                transient, plan, n, settle, touched, n_touched, cells, cell_pages, per_request,
                                query_start_loc, request_indices, per_token, False)
        status = STEP_DONE
    if idle is not None:
        n_keyed = join_idle(idle, low_priority, per_group, released[1], idle_keyed, n_keyed)
    return status, n_touched, n_keyed


@njit(cache=True, inline="always")
def join_idle(idle, low_priority, per_group, not_joined, idle_keyed, n_keyed):
    """``PageSpace.keyed_idle``'s join of the ``n_keyed`` keyed pages a step's releases left idle (``not_joined[g]``
    of group ``g``) unless ``idle``'s clock is empty (a ranker to tell: Python joins them). Returns those left."""
    idle_tick, prev, nxt, clock, offsets = idle
    if n_keyed == 0 or clock.size == 0:
        return n_keyed
    _lru.join(idle_tick, low_priority, prev, nxt, per_group[LRU_PAGES], per_group[LOW_IDLE_PAGES],
              per_group[LOW_FLOOR], offsets, not_joined, idle_keyed, clock)
    return 0


@njit(cache=True, _nrt=False)
def grant_step(grants, n_grants, scratch, arena, idle, geometry, pages, bounds, counters, ref, keyed, low_priority,
               stack, per_group, transient, plan, n, settle, touched, n_logged, cells, cell_pages, per_request,
               query_start_loc, request_indices, per_token):
    """``run_step`` granting spare slabs alone (``grants``' first ``n_grants`` columns: groups, slabs) after its
    releases, counted off the arena's spare slabs with ``SKIP_PACKING`` following ``Arena.roomy``
    (``Arena._spare_changed``); it stops for Python only when ``room_groups`` asks (as after the idle keyed pages
    joined: its ``not_joined``), its marks left in ``arena``'s last item (the manager's) for ``make_room``, the keyed
    pages its releases left idle joined first (``join_idle``). Status -1 (nothing granted): a slab not spare. A kernel
    of its own: the grant inside ``run_step`` makes ``step``'s compiled loops slower. ``scratch`` (``grant_scratch``):
    int64 room for pages per group and every granted slab's pages: the kernel allocates nothing, so it runs without
    reference counting (``_nrt=False``: its ~30 arrays come in without a MemInfo each, ~8 µs a call).
    ``idle``: ``PageSpace.join_args``."""
    status, n_touched, n_keyed = run_step(
        geometry, pages, bounds, counters, ref, keyed, low_priority, stack, per_group, transient, plan, n, settle,
        True, touched, n_logged, cells, cell_pages, per_request, query_start_loc, request_indices, per_token)
    rows, counts, first, after, sums, released, _, _, idle_keyed = run_views(plan, geometry.shape[0], n)
    owner, lo, hi, straddle, offsets, most_slab_pages, sizes, spare, roomy_slabs, marks = arena
    n_groups = geometry.shape[0]
    gained, granted = scratch[:n_groups], scratch[n_groups:]
    if grant_spare_slabs(owner, grants[0, :n_grants], grants[1, :n_grants], lo, hi, straddle, granted, gained,
                         stack, per_group[TOP], offsets, per_group[LOWEST], per_group[GRANTED_PAGES]) < 0:
        return -1, n_touched, n_keyed
    spare[0] -= n_grants
    per_group[SKIP_PACKING] = 1 if spare[0] >= roomy_slabs else 0  # ``Arena.roomy`` (``Arena._spare_changed``)
    # ``room_groups`` as it answers once the keyed pages gone idle joined their LRUs (they join before it returns).
    if not room_groups(geometry, bounds, transient, rows, first, counts, after, sums, stack, per_group, ref, keyed,
                       low_priority, (owner, lo, hi, straddle, sizes), marks, 0, released[1], idle_keyed):
        n_touched = finish_step(geometry, pages, bounds, counters, ref, keyed, low_priority, stack, per_group,
                                transient, plan, n, settle, touched, n_touched, cells, cell_pages, per_request,
                                query_start_loc, request_indices, per_token, False)
        status = STEP_DONE  # else a group makes room once they joined: ``marks`` says which
    return status, n_touched, join_idle(idle, low_priority, per_group, released[1], idle_keyed, n_keyed)


def grant_scratch(n_grants, arena, n_groups, made=None):
    """``grant_step``'s ``scratch`` for ``n_grants`` slabs: pages per group, then each slab's most pages
    (``arena``: ``grant_step``'s); ``made`` where it is large enough (the kernel reads nothing it did not write)."""
    size = n_groups + n_grants * arena[5]
    return made if made is not None and made.size >= size else np.empty(size, np.int64)


@njit(cache=True, inline="always")
def low_before(stack, offset, top, count, ref, keyed, low_priority, per_group, g, not_joined, idle_keyed, at, scan):
    """Whether an idle low-priority page of group ``g`` (its ids from ``offset``) may lie below the highest of its
    ``count`` lowest free ids: its floor is below it while it has some (with ``scan``: one does, ``low_below``, which
    raises the floor), or one its releases just left idle (``not_joined[g]`` from ``idle_keyed[at]``) is."""
    bound = stack[offset + top - count]
    if per_group[LOW_IDLE_PAGES, g] > 0 and per_group[LOW_FLOOR, g] < bound and (
            not scan or low_below(low_priority, keyed, ref, offset, per_group, g, bound)):
        return True
    if not_joined is not None:
        for page in idle_keyed[at : at + not_joined[g]]:
            if page < bound and low_priority[offset + page]:
                return True
    return False


@njit(cache=True)
def note_peaks(per_group, allocated, not_joined):
    """Each pool's peak of used pages after a step or borrow took ``allocated[g]``: granted less free less idle
    (``not_joined[g]``: keyed pages gone idle that join the LRU next; empty: none)."""
    for g in range(allocated.size):
        if allocated[g]:
            used = per_group[GRANTED_PAGES, g] - per_group[TOP, g] - per_group[LRU_PAGES, g]
            if not_joined.size:
                used -= not_joined[g]
            per_group[PEAK_USED_PAGES, g] = max(per_group[PEAK_USED_PAGES, g], used)


@njit(cache=True, inline="always")
def plan_views(buffer, n_groups):
    """The step's scratch arrays, views of one int64 ``buffer`` whose first three values are their room (rows,
    released pages in one group, idle keyed pages): ``prepare_step``'s outputs in its order, then
    released ``[2, G]``, widths ``[G]`` and ``release_pages``' scratch and idle keyed pages."""
    cap, n_pages, n_keyed = buffer[0], buffer[1], buffer[2]
    plan = buffer[3:]
    grid = 4 * cap + 2 * n_groups * cap
    tail = grid + n_groups * cap
    end = tail + 5 * n_groups + 4
    return (plan[:cap], plan[cap : 2 * cap], plan[2 * cap : 3 * cap],
            plan[4 * cap : grid].reshape((2, n_groups, cap)), plan[grid:tail].reshape((n_groups, cap)),
            plan[tail : tail + 2 * n_groups].reshape((2, n_groups)), plan[3 * cap : 4 * cap],
            plan[tail + 4 * n_groups : tail + 4 * n_groups + 4],
            plan[tail + 2 * n_groups : tail + 4 * n_groups].reshape((2, n_groups)),
            plan[tail + 4 * n_groups + 4 : tail + 5 * n_groups + 4],
            plan[end : end + n_pages], plan[end + n_pages : end + n_pages + n_keyed])


def plan_size(cap, n_groups, n_pages, n_keyed):
    """Size of a ``plan_views`` buffer with that much room."""
    return 3 + (4 + 3 * n_groups) * cap + 5 * n_groups + 4 + n_pages + n_keyed


def entry_point(kernel, args):
    """``kernel``'s compiled code for the types of ``args``, skipping the dispatcher (a few µs a call cold):
    only for calls whose argument types never change (unchecked). ``kernel`` itself without the JIT."""
    typeof = getattr(kernel, "typeof_pyval", None)
    return kernel if typeof is None else kernel.compile(tuple(map(typeof, args)))


# ``step``, ``step_spare``, ``run_step`` and ``finish_step``, the step's kernels Python calls, compile without numba's
# reference counting (its ``_nrt=False``; the kernels they call inherit it unless they set it): their arrays come in
# without a MemInfo made each, and a view costs no atomic count (a clean decode step's kernel in 55-80% of the time).
# Sound as no kernel they reach returns an array; one that allocates sets ``_nrt=True`` (``push_run``).
@njit(cache=True, _nrt=False)
def step(geometry, pages, bounds, counters, ref, keyed, low_priority, stack, per_group, transient, mark, grain,
         plan, last_rows, rows_in, counts_in, touched, n_logged, cells, cell_pages, per_request, query_start_loc,
         request_indices, per_token):
    """``prepare_step`` then, when the plan needs nothing from Python, ``run_step`` (``touched``: the table log,
    ``TableSet.logged``, the cells the step touches after its first ``n_logged``), in one call. Returns (status,
    rows, settling rows, crossing rows, clean, cells logged, idle keyed pages); ``STEP_PLANNED`` (-1 rows: no plan),
    ``STEP_COVERED`` (each group short of free pages has its releases free enough first:
    ``release_credit``'s count) or ``STEP_COMMITS`` (a clean plan whose rows cross a grain, the batch's
    arrays and the scratch large enough for it) when only the plan ran (the logged cells left as they were)."""
    rows, counts, first, after, need, sums, crossing, totals = plan_views(plan, geometry.shape[0])[:8]
    n, settle, n_cross, clean = prepare_step(geometry, bounds, counters, last_rows, rows_in, counts_in, grain,
                                             per_group[TOP], mark, rows, counts, first, after, need, sums, crossing,
                                             totals, counts_in[:0])
    fits = plan_fits(plan, geometry.shape[0], touched.size - n_logged, per_token.shape[1])
    if n < 0 or not clean or n_cross > 0 or not fits:
        covered = n >= 0 and not clean and n_cross == 0
        for g in range(geometry.shape[0] if covered else 0):  # each short group's releases free enough first
            short = sums[1, g] - per_group[TOP, g]
            if short > 0 and release_credit(geometry, pages, bounds, ref, keyed, counters, g, rows[:n], after[0, g],
                                            rows, rows, rows, short)[1] < short:
                covered = False
                break
        if covered:
            return STEP_COVERED, n, settle, n_cross, clean, 0, 0
        return STEP_COMMITS if n >= 0 and clean and fits else STEP_PLANNED, n, settle, n_cross, clean, 0, 0
    status, n_touched, n_keyed = run_step(
        geometry, pages, bounds, counters, ref, keyed, low_priority, stack, per_group, transient, plan, n, settle,
        False, touched, n_logged, cells, cell_pages, per_request, query_start_loc, request_indices, per_token)
    return status, n, settle, n_cross, clean, n_touched, n_keyed


@njit(cache=True, _nrt=False)
def step_spare(geometry, pages, bounds, counters, ref, keyed, low_priority, stack, per_group, transient, mark, grain,
               plan, last_rows, rows_in, counts_in, touched, n_logged, cells, cell_pages, per_request,
               query_start_loc, request_indices, per_token, window_pages, scratch, owner, spare_slabs, slab_pages,
               inner_pages, straddle, taken, grant_groups, grant_slabs):
    """``step`` on an arena, then (pure) ``admit_spare`` of a plan that only ran and is not clean, in one
    call: ``step``'s answer (``STEP_SPARE`` for a ``STEP_PLANNED`` one admitted so whose buffers are large enough)
    and the spare slabs ``admit_spare`` grants (-1: Python decides, or not asked). For batches with more tokens
    than rows (a prefill chunk), whose plans are seldom clean."""
    status, n, settle, n_cross, clean, n_touched, n_keyed = step(
        geometry, pages, bounds, counters, ref, keyed, low_priority, stack, per_group, transient, mark, grain, plan,
        last_rows, rows_in, counts_in, touched, n_logged, cells, cell_pages, per_request, query_start_loc,
        request_indices, per_token)
    n_spare = -1
    if status >= STEP_PLANNED and n >= 0 and not clean:
        n_spare = admit_spare(geometry, pages, bounds, ref, keyed, per_group, counters, grain, window_pages, plan,
                              n, scratch, owner, spare_slabs, slab_pages, inner_pages, straddle, taken,
                              grant_groups, grant_slabs)
        if status == STEP_PLANNED and n_spare >= 0 and plan_fits(plan, geometry.shape[0], touched.size - n_logged,
                                                                 per_token.shape[1]):
            status = STEP_SPARE
    return status, n, settle, n_cross, clean, n_touched, n_keyed, n_spare


@njit(cache=True, inline="always")
def plan_fits(plan, n_groups, cells_room, n_tokens):
    """Whether the batch's arrays (``n_tokens``), the scratch in ``plan`` and the room for touched cells
    (``cells_room``) are large enough for the plan ``prepare_step`` wrote there."""
    totals, _, _, scratch, idle_keyed = plan_views(plan, n_groups)[7:]
    return (totals[0] == n_tokens and totals[2] <= scratch.size and totals[1] <= idle_keyed.size
            and totals[1] + totals[3] <= cells_room)


@njit(cache=True, _nrt=False)
def finish_step(geometry, pages, bounds, counters, ref, keyed, low_priority, stack, per_group, transient, plan, n,
                settle, touched, n_touched, cells, cell_pages, per_request, query_start_loc, request_indices,
                per_token, joined):
    """The rest of ``run_step`` (same arguments; ``keyed``, ``low_priority`` unread) once the stacks hold
    enough: allocate, computed tokens move on, the batch's arrays of plan rows ``[settle, R)`` (``batch_arrays_for``:
    base pages after the step and ``widths[g]``, the widest row's live pages) and write slots; the changed cells read
    into ``cells`` and ``cell_pages`` when they fit; the pools' peaks (``joined``: the keyed pages the
    releases left idle joined their LRUs already, else they join next). Returns the cells changed."""
    rows, counts, first, after, sums, released, widths, _, _ = run_views(plan, geometry.shape[0], n)
    computed, table_rows, scheduled, positions = counters[0], per_request[0], per_request[1], per_token[0]
    n_touched = allocate_pages(geometry, pages, bounds, ref, stack, per_group, transient, rows, first, counts,
                               after, sums, touched, n_touched)
    for r in range(rows.size):
        computed[rows[r]] = first[r] + counts[r]
    n_tokens = 0
    query_start_loc[0] = 0
    for r in range(settle, rows.size):
        k, start, count = r - settle, first[r], counts[r]
        table_rows[k], scheduled[k] = rows[r], count
        if count == 1:  # a decode row
            positions[n_tokens], request_indices[n_tokens] = start, k
        else:  # views indexed from 0 (no negative index to wrap): the loops vectorize
            row_positions = positions[n_tokens : n_tokens + count]
            row_indices = request_indices[n_tokens : n_tokens + count]
            for i in range(count):
                row_positions[i] = start + i
            row_indices[:] = k
        n_tokens += count
        query_start_loc[k + 1] = n_tokens
    for g in range(geometry.shape[0]):
        widest, base_pages, new_bases, new_his = 0, per_request[2 + g], after[0, g], after[1, g]  # 1-D views
        for r in range(settle, rows.size):
            base_pages[r - settle] = new_bases[r]
            widest = max(widest, new_his[r] - new_bases[r])
        widths[g] = widest
    if per_token.shape[0] > 1:
        write_slots(geometry, pages, bounds, rows, first, counts, settle, per_token[1:])
    if n_touched <= cell_pages.size:
        read_cells(geometry, pages, bounds, touched[:n_touched], cells[0], cells[1], cells[2], cell_pages)
    note_peaks(per_group, sums[1], released[1, :0] if joined else released[1])
    return n_touched


@njit(cache=True)
def block_table(geometry, pages, bounds, g, rows, out):
    """``out[r, j]``: group ``g``'s page of logical page ``base + j`` of ``rows[r]``, -1 past its live pages."""
    for r in range(rows.size):
        row = rows[r]
        base = bounds[BASE, g, row]
        live = bounds[HI, g, row] - base
        for j in range(out.shape[1]):
            out[r, j] = pages[cell(geometry, bounds, g, row, base + j)] if j < live else -1


# --- table and page-space helpers outside the step (free, rewind, prefix hits, pools) ------------
@njit(cache=True, inline="always")
def take_cells(geometry, pages, bounds, g, row, keep, taken, cells, n):
    """Row ``row``'s logical pages of group ``g`` from ``keep`` to its hi leave the table (its hi becomes ``keep``
    where it passed it): their ids to ``taken``, their ring-view cells to ``cells``, from ``n``. Returns the new
    ``n``."""
    for logical in range(keep, bounds[HI, g, row]):
        at = cell(geometry, bounds, g, row, logical)
        taken[n] = pages[at]
        pages[at] = -1
        cells[n] = view_cell(geometry, bounds.shape[2], g, row, logical)
        n += 1
    bounds[HI, g, row] = min(keep, bounds[HI, g, row])
    return n


@njit(cache=True)
def rewind_rows(geometry, pages, bounds, counters, known_floor, ref, keyed, stack, per_group, mark, rows, kept):
    """``CacheManager.rewind_many`` in one call (False, nothing changed: a row twice or a count outside [committed,
    computed]): every row's logical pages from ``ceil(kept / T)`` (never below its base nor above its hi) to its hi
    leave its tables (``take_cells``, group after group), one release per group (``release_into``); known tokens
    ``min(known, max(kept, floor))``. Returns (ran, cells emptied, keyed pages left idle, how many per group)."""
    empty = np.zeros(0, dtype=np.int64)
    if not distinct_rows(rows, mark):
        return False, empty, empty, empty
    for r in range(rows.size):
        if not counters[1, rows[r]] <= kept[r] <= counters[0, rows[r]]:
            return False, empty, empty, empty
    n_groups, total, n = geometry.shape[0], 0, 0
    for g in range(n_groups):  # room for every live page of the rows
        for r in range(rows.size):
            total += bounds[HI, g, rows[r]] - bounds[BASE, g, rows[r]]
    work = np.empty((4, total), dtype=np.int64)
    taken, touched, freed, idle_keyed = work[0], work[1], work[2], work[3]
    taken_per_group, counts = np.zeros(n_groups, dtype=np.int64), np.zeros((2, n_groups), dtype=np.int64)
    for g in range(n_groups):
        tokens, shift, start = geometry[g, PAGE_TOKENS], geometry[g, PAGE_SHIFT], n
        for r in range(rows.size):
            keep = max(divide(kept[r] + tokens - 1, tokens, shift), bounds[BASE, g, rows[r]])
            n = take_cells(geometry, pages, bounds, g, rows[r], keep, taken, touched, n)
        taken_per_group[g] = n - start
    release_into(ref, keyed, stack, per_group, geometry[:, ID_OFFSET].copy(), taken[:n], taken_per_group, freed,
                 idle_keyed, counts)
    for r in range(rows.size):
        row = rows[r]
        counters[0, row] = kept[r]
        counters[2, row] = min(counters[2, row], max(kept[r], known_floor[row]))
    return True, touched[:n], idle_keyed[: counts[1].sum()], counts[1].copy()


@njit(cache=True)
def release_into(ref, keyed, stack, per_group, offsets, taken, taken_per_group, freed, idle_keyed, counts):
    """Pages taken out of the tables (group-major, ``taken_per_group[g]`` each) are one release per group
    (``drop_released``, ``push_free``): unkeyed to ``freed``, keyed left idle to ``idle_keyed`` (room for ``taken``),
    ``counts[0|1, g]`` how many (added: zeroed by the caller)."""
    start, n_freed, n_keyed = 0, 0, 0
    for g in range(offsets.size):
        end, freed_from, keyed_from = start + taken_per_group[g], n_freed, n_keyed
        n_freed, n_keyed = drop_released(ref, keyed, offsets[g], taken[start:end], freed, n_freed, idle_keyed,
                                         n_keyed)
        counts[0, g] += n_freed - freed_from
        counts[1, g] += n_keyed - keyed_from
        per_group[RELEASED_PAGES, g] += n_freed - freed_from + n_keyed - keyed_from
        start = end
    push_free(stack, per_group[TOP], offsets, per_group[LOWEST], counts[0], freed)


def _int32_at(address):
    """The int32 pointer at integer ``address`` (``append_token_ids``' token buffers); compiled: ``_pointer``."""
    return ctypes.cast(int(address), ctypes.POINTER(ctypes.c_int32))


@intrinsic
def _pointer(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return types.CPointer(types.int32)(types.int64), codegen


@overload(_int32_at)
def _int32_at_compiled(address):
    return lambda address: _pointer(address)


@njit(cache=True)
def copy_token_ids(ids, out):
    """``out[: ids.size] = ids`` (``CacheManager.add_request``), checking as it copies that no id is
    negative: 0 at the first one (``out`` then partly written), else the address of ``out``'s data."""
    for i in range(ids.size):
        if ids[i] < 0:
            return 0
        out[i] = ids[i]
    return np.int64(out.ctypes.data)


@njit(cache=True)
def append_token_ids(addresses, rows, known, max_total, tokens, mark, grain_tokens, completed_rows):
    """``CacheManager.append_token_ids_many``: ``tokens[i]`` follow the ``known`` ids of row ``rows[i]``'s token
    buffer (its data at ``addresses[row]``, room for ``max_total`` ids: live rows only), all or nothing. Returns
    how many rows completed a block of ``grain_tokens`` (0: none counted), listed in order in ``completed_rows``
    (room for every row); -1, nothing changed, when a row is listed twice, has no buffer (address 0) or would pass
    its ``max_total`` tokens, or an id is negative (``mark``: ``distinct_rows``' scratch)."""
    k = tokens.shape[1]
    if not distinct_rows(rows, mark):
        return -1
    for i in range(rows.size):
        if addresses[rows[i]] == 0 or known[rows[i]] + k > max_total[rows[i]]:
            return -1
        for j in range(k):
            if tokens[i, j] < 0:
                return -1
    completed = 0
    for i in range(rows.size):
        row = rows[i]
        buffer, first = carray(_int32_at(addresses[row]), max_total[row]), known[row]
        for j in range(k):
            buffer[first + j] = tokens[i, j]
        known[row] = first + k
        if grain_tokens and (first + k) // grain_tokens > first // grain_tokens:
            completed_rows[completed] = row
            completed += 1
    return completed


@njit(cache=True)
def merge_free(stack, top, run):
    """Merge the ascending distinct ids ``run`` into the descending free stack ``stack[:top]``; returns the new
    top. A long block of stack ids below the next run id is found by bisection and moved at once."""
    i, j, k = top - 1, 0, top + run.size - 1
    while j < run.size:  # fill from the new top down, lowest first; stack ids left are in place
        if i >= 0 and stack[i] < run[j]:
            if i >= MERGE_BLOCK and stack[i - MERGE_BLOCK] < run[j]:
                lo = first_below(stack, i - MERGE_BLOCK, run[j])
                move_up(stack, lo, i + 1 - lo, k - i)
                k -= i + 1 - lo
                i = lo - 1
            else:
                stack[k] = stack[i]
                i -= 1
                k -= 1
        elif i < 0:  # every stack id lies below the run's rest: it goes in at once, reversed
            below = stack[: k + 1]
            for t in range(k + 1):
                below[t] = run[run.size - 1 - t]
            break
        else:
            stack[k] = run[j]
            j += 1
            k -= 1
    return top + run.size


MERGE_BLOCK = 16  # ``merge_free`` moves stack ids one by one up to this many in a row


@njit(cache=True)
def first_below(stack, at, value):
    """The lowest index ``lo <= at`` with ``stack[lo : at + 1]`` all below ``value``, given
    ``stack[at] < value`` and ``stack`` descending."""
    lo, hi = -1, at  # stack[lo] >= value (or lo = -1), stack[hi] < value
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if stack[mid] < value:
            hi = mid
        else:
            lo = mid
    return hi


@njit(cache=True)
def move_up(stack, lo, n, shift):
    """``stack[lo : lo + n]`` to ``stack[lo + shift : lo + shift + n]`` (``shift > 0``): in
    slices that do not overlap when the shift is long, else one by one from the top."""
    if shift >= 64:
        end = lo + n
        while end > lo:
            start = max(lo, end - shift)
            stack[start + shift : end + shift] = stack[start:end]
            end = start
    else:
        for t in range(n - 1, -1, -1):
            stack[lo + shift + t] = stack[lo + t]


@njit(cache=True, _nrt=True)
def push_run(stack, top, lowest, run):
    """Freed ids ``run`` onto one group's free stack: merged into a ``lowest`` group's sorted stack, else
    pushed with the first listed on top. Returns the new top. Every free stack grows here."""
    if lowest:
        for i in range(1, run.size):
            if run[i] < run[i - 1]:
                return merge_free(stack, top, np.sort(run))
        return merge_free(stack, top, run)  # ascending already (a prefill's pages, mostly): no sort
    n = run.size
    for i in range(n):
        stack[top + i] = run[n - 1 - i]
    return top + n


@njit(cache=True)
def low_idle_ids(low_priority, keyed, ref, start, bound, out):
    """A pool's idle low-priority pages (keyed, low priority, no holder) with ids in ``[start, bound)``, ascending, into
    ``out`` until it is full (what packing evicts first: ``PagePool._evict_low_below``). Returns how many."""
    words, n, page = flag_words(low_priority), 0, start
    while n < out.size:
        page = next_low_idle(low_priority, keyed, ref, words, page, bound)
        if page >= bound:
            break
        out[n] = page
        n += 1
        page += 1
    return n


@njit(cache=True, inline="always")
def flag_words(low_priority):
    """``low_priority``'s whole words of 8 flags (``next_low_idle``'s)."""
    return low_priority[: low_priority.size // 8 * 8].view(np.uint64)


@njit(cache=True, inline="always")
def next_low_idle(low_priority, keyed, ref, words, page, bound):
    """The first idle low-priority page (keyed, low priority, no holder) with an id in ``[page, bound)``, else
    ``bound``. Such pages are sparse: from each multiple of 8 the flags are read 8 a word (``words``:
    ``flag_words``), words of none skipped at once."""
    whole = bound // 8  # words below ``whole`` end at or below ``bound``
    while page < bound:
        if page % 8 == 0:
            w = page // 8
            while w < whole and words[w] == 0:
                w += 1
            if w * 8 > page:
                page = w * 8
                continue
        if low_priority[page] and keyed[page] and ref[page] == 0:
            return page
        page += 1
    return bound


@njit(cache=True)
def push_free(stack, top, offsets, lowest, per_group, freed):
    """``push_run`` of each group's freed local ids (``freed``, group after group, ``per_group[g]`` of them, in
    logical order). A ``lowest`` group's run of at most ``SHORT_RUN`` is sorted in place first (insertion sort):
    ``push_run`` merges it as it is, where it would sort a copy (an allocation and a sort's code, ~3 µs cold)."""
    start = 0
    for g in range(per_group.size):
        run = freed[start : start + per_group[g]]
        if lowest[g] and run.size <= SHORT_RUN:
            for i in range(1, run.size):
                value, j = run[i], i - 1
                while j >= 0 and run[j] > value:
                    run[j + 1] = run[j]
                    j -= 1
                run[j + 1] = value
        if run.size:
            top[g] = push_run(stack[offsets[g]:], top[g], lowest[g] != 0, run)
        start += run.size


SHORT_RUN = 64  # ``push_free`` leaves a longer run to ``push_run``'s sort


@njit(cache=True, inline="always")
def held_span(geometry, counters, g, row, grain_shift):
    """The logical pages of group ``g`` that a step of ``row`` from its computed tokens will hold
    (``release_pages``' ``hold_checkpoint`` of its ``held_boundary``), as ``[lo, hi)``; ``(0, 0)`` where it holds
    none."""
    n = geometry[g, HOLD_TOKENS]
    d = held_boundary(geometry, counters, row, counters[0, row], grain_shift) if n > 0 else 0
    if d == 0:
        return 0, 0
    t = geometry[g, PAGE_TOKENS]
    return max(d - n, 0) // t, d // t


@njit(cache=True)
def release_credit(geometry, pages, bounds, ref, keyed, counters, g, rows, new_base, credit, sole_pages,
                   unkeyed_pages, enough):
    """Group ``g``'s pages below each row's ``new_base`` only that row holds (pure): ``credit[r]`` per row, the
    pages to ``sole_pages``, the unkeyed ones (the releases' free pages) also to ``unkeyed_pages``; not those of
    the checkpoint the row's step will hold (``held_span``), but those of the one it then lets go that nothing else
    holds. Returns (sole, unkeyed). With ``enough`` > 0 it only counts the unkeyed pages, up to ``enough`` (arrays
    unwritten)."""
    offset, listed, grain = geometry[g, ID_OFFSET], enough <= 0, geometry[g, HOLD_GRAIN]
    n_sole, n_unkeyed, n_held, grain_shift = 0, 0, bounds.shape[0] - HELD_PAGES, log2_exact(grain) if grain else 0
    for r in range(rows.size):
        row = rows[r]
        before, (cells_at, mask, step) = n_sole, row_cells(geometry, bounds, g, row)
        held_lo, held_hi = held_span(geometry, counters, g, row, grain_shift)
        lo, n_cells = bounds[BASE, g, row], max(min(new_base[r], bounds[HI, g, row]) - bounds[BASE, g, row], 0)
        for i in range(n_cells + (n_held if held_hi > 0 else 0)):  # its released cells, then the pages let go
            if i < n_cells:
                if held_lo <= lo + i < held_hi:
                    continue  # it stays: the step holds it
                page = pages[cells_at + ((lo + i) & mask) * step]
            else:
                page = bounds[HELD_PAGES + i - n_cells, g, row]
            if page > 0 and ref[offset + page] == 1:
                if listed:
                    sole_pages[n_sole] = page
                n_sole += 1
                if not keyed[offset + page]:
                    if listed:
                        unkeyed_pages[n_unkeyed] = page
                    n_unkeyed += 1
                    if n_unkeyed == enough:
                        return n_sole, n_unkeyed
        if listed:
            credit[r] = n_sole - before
    return n_sole, n_unkeyed


@njit(cache=True)
def short_pages(geometry, pages, bounds, ref, keyed, rows, new_base, first, counters, grain, window_pages, released,
                wanted, clean, free, low, short):
    """Per group, the pages it lacks for ``wanted`` (``short``) after its ``clean`` free pages, the releases'
    free pages (less ``window_pages`` a grain the commits complete) and its ``low`` idle low-priority pages.
    Returns how many groups are short, or -1 when one wants more than its ``free`` pages (pure)."""
    n_short, crossed = 0, -1
    for g in range(wanted.size):
        n, short[g] = wanted[g], 0
        if n <= clean[g]:
            continue
        if n > free[g]:
            return -1
        gap = n - clean[g] - low[g]
        if gap <= 0:
            continue
        freed = 0
        if released[g] > 0:
            if crossed < 0:
                crossed = 0
                for r in range(rows.size if grain > 0 else 0):
                    crossed += max(first[r] // grain - counters[1, rows[r]] // grain, 0)
            extra = crossed * window_pages[g]
            freed = max(release_credit(geometry, pages, bounds, ref, keyed, counters, g, rows, new_base[g], first,
                                       first, first, gap + extra)[1] - extra, 0)
        if gap > freed:
            short[g] = gap - freed
            n_short += 1
    return n_short


@njit(cache=True)
def take_spare_for(short, slab_pages, spare_slabs, owner, inner_pages, straddle, taken, grant_groups, grant_slabs):
    """``Arena.plan`` of ``short`` pages per group from spare slabs alone when they surely cover
    (``take_spare_slabs`` on ``owner``, its ``spare_slabs`` spare, each taken slab spare again before it returns:
    no copy; grants to ``grant_groups``, ``grant_slabs``). Returns their count, or -1 when they might not (pure)."""
    need = 0
    for g in range(short.size):
        if short[g] > 0:
            need += -(-short[g] // slab_pages[g])
    if need > spare_slabs:
        return -1
    n, end = 0, owned_end(owner, spare_slabs)
    packed = end == owner.size - spare_slabs
    for g in range(short.size):
        if short[g] > 0:
            n_taken, _ = take_spare_slabs(owner, g, inner_pages[g], straddle[g], short[g], taken, end, packed)
            for i in range(n_taken):
                grant_groups[n], grant_slabs[n], end = g, taken[i], max(end, taken[i] + 1)
                n += 1
    spare_again(owner, grant_slabs, n)
    return n


@njit(cache=True, inline="always")
def spare_again(owner, slabs, n):
    """The first ``n`` of ``slabs`` spare again under ``owner`` (value by value: no array made)."""
    for i in range(n):
        owner[slabs[i]] = -1


@njit(cache=True, inline="always")
def owned_end(owner, spare_slabs):
    """One past the last slab owned: ``owner`` read only up to the last of its ``owner.size - spare_slabs`` owned
    slabs (DeepSeek-V4's arena has ~2,800 slabs, most spare at the top)."""
    end, left = 0, owner.size - spare_slabs
    for s in range(owner.size):
        if left <= 0:
            break
        if owner[s] >= 0:
            end, left = s + 1, left - 1
    return end


@njit(cache=True, _nrt=False)
def admit_spare(geometry, pages, bounds, ref, keyed, per_group, counters, grain, window_pages, plan, n, scratch,
                owner, spare_slabs, slab_pages, inner_pages, straddle, taken, grant_groups, grant_slabs):
    """``CacheManager._admit`` of the plan in ``plan`` (first ``n`` rows) on an arena when its answer is spare
    slabs alone (pure): slabs for what a group lacks of free and evictable pages, then for what it would
    evict. Returns how many slabs go (to ``grant_groups``, ``grant_slabs``), or -1: Python decides. Slabs are taken
    on ``owner`` itself and spare again before it returns.
    ``scratch`` ``[4, G]``: ``short_pages``' answer, zeros, room for free and clean pages (it allocates nothing)."""
    rows, _, first, after, _, sums = plan_views(plan, geometry.shape[0])[:6]
    rows, first, new_base, wanted = rows[:n], first[:n], after[0, :, :n], sums[1]
    top, n_groups, short, free, clean = per_group[TOP], geometry.shape[0], scratch[0], scratch[2], scratch[3]
    low = scratch[1] if per_group[SKIP_PACKING, 0] != 0 else per_group[LOW_IDLE_PAGES]
    for g in range(n_groups):
        free[g], clean[g] = top[g] + per_group[LRU_PAGES, g], top[g]
    n_short = short_pages(geometry, pages, bounds, ref, keyed, rows, new_base, first, counters, grain,
                          window_pages, sums[0], wanted, top, free, low, short)
    spare, floor, ahead = spare_slabs  # ``owner``'s spare slabs; the fewest left by slabs ahead; ``slabs_ahead``
    if n_short >= 0:
        n_grants = 0 if n_short == 0 else take_spare_for(short, slab_pages, spare, owner, inner_pages, straddle,
                                                         taken, grant_groups, grant_slabs)
        return with_ahead(owner, inner_pages, straddle, taken, grant_groups, grant_slabs, n_grants, ahead,
                          spare - n_grants - floor)
    n_grants, end = 0, owned_end(owner, spare)
    packed = end == owner.size - spare
    for g in range(n_groups):
        deficit = wanted[g] - free[g]
        if deficit > 0:
            n_taken, left = take_spare_slabs(owner, g, inner_pages[g], straddle[g], deficit, taken, end, packed)
            if left > 0:
                spare_again(owner, taken, n_taken)
                spare_again(owner, grant_slabs, n_grants)
                return -1
            for i in range(n_taken):
                grant_groups[n_grants], grant_slabs[n_grants], end = g, taken[i], max(end, taken[i] + 1)
                n_grants += 1
            clean[g] += deficit - left
    if short_pages(geometry, pages, bounds, ref, keyed, rows, new_base, first, counters, grain, window_pages,
                   sums[0], wanted, clean, wanted, low, short) == 0:
        more = 0
    else:
        more = take_spare_for(short, slab_pages, spare - n_grants, owner, inner_pages, straddle, taken,
                              grant_groups[n_grants:], grant_slabs[n_grants:])
    spare_again(owner, grant_slabs, n_grants)
    if more < 0:
        return -1
    return with_ahead(owner, inner_pages, straddle, taken, grant_groups, grant_slabs, n_grants + more, ahead,
                      spare - n_grants - more - floor)


@njit(cache=True, inline="always")
def first_index(values, value):
    """Where ``value`` first appears in ``values`` (``values.size`` if nowhere)."""
    for i in range(values.size):
        if values[i] == value:
            return i
    return values.size


@njit(cache=True)
def with_ahead(owner, inner_pages, straddle, taken, grant_groups, grant_slabs, n_grants, ahead_slabs, room_slabs):
    """The first ``n_grants`` grants and after them up to ``ahead_slabs`` more spare slabs for each group they grant
    to, in the order the groups first appear (``take_spare_slabs`` of one page at a time: the slab it would take
    next), at most ``room_slabs`` in all. On ``owner`` the grants' slabs go to their groups first and every granted
    slab is spare at the end (as ``admit_spare`` found them; ``Arena.ahead`` passes a copy). Returns how many grants
    (``n_grants`` when it is 0 or -1). So a group growing while the arena has spare slabs to spare takes its next
    slabs in the same step, not one step in a few (``Arena.slabs_ahead``; docs/manager.md, stage 1)."""
    if n_grants <= 0 or room_slabs <= 0 or ahead_slabs <= 0:
        return n_grants
    for i in range(n_grants):
        owner[grant_slabs[i]] = grant_groups[i]
    n = n_grants
    for i in range(n_grants):
        g = grant_groups[i]
        if first_index(grant_groups, g) < i:
            continue
        for _ in range(min(ahead_slabs, room_slabs - (n - n_grants))):
            if take_spare_slabs(owner, g, inner_pages[g], straddle[g], 1, taken)[0] == 0:
                break
            grant_groups[n], grant_slabs[n] = g, taken[0]
            n += 1
    spare_again(owner, grant_slabs, n)
    return n


@njit(cache=True)
def take_spare_slabs(owner, group, inner_pages, straddle, short_pages, taken, end=-1, packed=False):
    """Spare slabs (``owner < 0``) for ``group`` until it is not ``short_pages`` short: the lowest next to
    one it owns, else the lowest (``slab_gain`` pages each; ``owner`` updated, slabs to ``taken``).
    Returns (slabs taken, pages still short). One pass: a take makes only its left neighbour newly next to
    the group below it, so the next search starts there; the lowest spare only rises. ``end`` (-1: none
    known): every slab from it on is spare, so the search for the group's slabs stops there; ``packed``: none
    below it is, so each pick is ``end`` itself (the only spare slab that may be next to one the group owns, and
    the lowest), found without a search."""
    n, n_taken, start, lowest = owner.size, 0, 0, 0
    end = n if end < 0 else end
    while short_pages > 0:
        pick = (end if end < n else -1) if packed else next_to(owner, group, start, end)
        if pick < 0:
            while lowest < n and owner[lowest] >= 0:
                lowest += 1
            if lowest == n:
                break
            pick = lowest
        short_pages -= lend_slab(owner, group, inner_pages, straddle, pick, taken, n_taken)
        n_taken, start, end = n_taken + 1, max(pick - 1, 0), max(end, pick + 1)
    return n_taken, short_pages


@njit(cache=True, inline="always")
def next_to(owner, group, start, end):
    """``take_spare_slabs``' pick: the spare slab next to the first of ``group``'s slabs in ``[max(start - 1, 0), end)``
    that has one (its left one, only past ``start``, before its right one), else -1. Found by the spare slabs in order
    (few below ``end``): the first with ``group``'s slab on its left, or past ``start`` on its right, in that range."""
    lo = max(start - 1, 0)
    for s in range(max(lo - 1, 0), min(end + 1, owner.size)):
        if owner[s] < 0 and (lo <= s - 1 < end and owner[s - 1] == group
                             or start < s + 1 < end and owner[s + 1] == group):
            return s
    return -1


@njit(cache=True, inline="always")
def slab_pages(owner, group, lo, hi, straddle, s, pages, n, ascending=False):
    """The page ids ``group`` holds in slab ``s`` under ``owner`` (inner pages, then the straddlers of
    boundaries with neighbours it owns; ``ascending``: the left one first, so that a sorted free stack merges
    them without a sort) to ``pages[n:]``; returns the new ``n``."""
    left, right = held_straddlers(owner, group, straddle, s)
    if ascending and left >= 0:
        pages[n], n, left = left, n + 1, -1
    for page in range(lo[s], hi[s]):
        pages[n] = page
        n += 1
    for page in (left, right):
        if page >= 0:
            pages[n] = page
            n += 1
    return n


@njit(cache=True, inline="always")
def held_straddlers(owner, group, straddle, s):
    """The straddlers ``group`` holds with slab ``s``: of the boundaries with a neighbour it owns (-1: none)."""
    left = straddle[s] if s > 0 and owner[s - 1] == group else -1
    return left, straddle[s + 1] if s < owner.size - 1 and owner[s + 1] == group else -1


@njit(cache=True)
def slab_move_pages(owner, donor, group, lo, hi, straddle, s, pages):
    """Slab ``s`` going from ``donor`` to ``group`` (-1: spare): the pages given up to ``pages[:n_given]``,
    those gained to ``pages[n_given:n]``. Returns ``(n_given, n)``."""
    n_given = 0 if donor < 0 else slab_pages(owner, donor, lo[donor], hi[donor], straddle[donor], s, pages, 0)
    n = n_given if group < 0 else slab_pages(owner, group, lo[group], hi[group], straddle[group], s, pages, n_given)
    return n_given, n


@njit(cache=True)
def grant_spare_slabs(owner, groups, slabs, lo, hi, straddle, pages, counts, stack, top, offsets, lowest, granted):
    """Spare slabs granted (``groups[i]`` takes ``slabs[i]``; ``owner`` updated): group ``g``'s ``counts[g]`` gained
    pages to ``pages`` (group after group), then pushed onto its free stack (``push_free``) and counted in
    ``granted[g]``. Returns the pages in all, or -1 (nothing changed) when a slab is not spare or listed twice."""
    for i in range(slabs.size):  # all checked first: nothing changed unless every slab is granted
        if owner[slabs[i]] >= 0:
            return -1
        for j in range(i):
            if slabs[j] == slabs[i]:
                return -1  # listed twice
    n = 0
    for g in range(lo.shape[0]):
        start = n
        for i in range(groups.size):
            if groups[i] == g:
                n = slab_pages(owner, g, lo[g], hi[g], straddle[g], slabs[i], pages, n, lowest[g] != 0)
                owner[slabs[i]] = g
        counts[g] = n - start
    for g in range(counts.size):
        granted[g] += counts[g]
    push_free(stack, top, offsets, lowest, counts, pages)
    return n


@njit(cache=True)
def revoke_ids(ref, keyed, stack, top, pages):
    """``PagePool.revoke``'s check: when every id in ``pages`` is idle (free, or keyed), those on the stack
    leave it. Returns the new top (-1: some id is not, nothing changed), the distinct ids and the keyed ones."""
    ids = np.sort(pages)
    n = 0
    for i in range(ids.size):  # distinct (``np.unique`` compiled goes through a list)
        if n == 0 or ids[i] != ids[n - 1]:
            ids[n] = ids[i]
            n += 1
    ids, keyed_ids, n_keyed = ids[:n], np.empty(n, dtype=np.int64), 0
    for i in range(n):
        if ref[ids[i]] != 0:
            return -1, ids, ids[:0]
        if keyed[ids[i]]:
            keyed_ids[n_keyed] = ids[i]
            n_keyed += 1
    keyed_ids, on_stack = keyed_ids[:n_keyed], 0
    if n:
        lowest, highest = ids[0], ids[n - 1]
        for i in range(top):
            page = stack[i]
            if lowest <= page <= highest:
                on_stack += ids[np.searchsorted(ids, page)] == page
    if on_stack + n_keyed != n:
        return -1, ids, keyed_ids
    return drop_ids(stack, top, ids), ids, keyed_ids


@njit(cache=True)
def drop_ids(stack, top, ids):
    """Take the ids ``ids`` (ascending, distinct) off the free stack ``stack[:top]``, the
    others keeping their order; returns the new top."""
    if ids.size == 0:
        return top
    lowest, highest, kept = ids[0], ids[ids.size - 1], 0
    for i in range(top):
        page = stack[i]
        if lowest <= page <= highest and ids[np.searchsorted(ids, page)] == page:
            continue
        stack[kept] = page
        kept += 1
    return kept


@njit(cache=True)
def slab_gain(owner, group, inner_pages, straddle, s):
    """The pages ``group`` gains with slab ``s``: its ``inner_pages`` and ``held_straddlers``."""
    left, right = held_straddlers(owner, group, straddle, s)
    return inner_pages[s] + (left >= 0) + (right >= 0)


@njit(cache=True, inline="always")
def lend_slab(owner, group, inner_pages, straddle, s, taken, n_taken):
    """Slab ``s`` goes to ``group`` (``owner`` updated, ``taken[n_taken]`` set); the pages
    the group gains (``slab_gain``)."""
    gain = slab_gain(owner, group, inner_pages, straddle, s)
    owner[s] = group
    taken[n_taken] = s
    return gain


@njit(cache=True)
def released_per_slab(released, slab_geometry, n):
    """Per slab, how many of the ``released`` pages lie inside it, and per boundary whether one straddles it
    (``slab_geometry``: page bytes, reserved bytes, slab bytes)."""
    page_bytes, reserved_bytes, slab_bytes = slab_geometry[0], slab_geometry[1], slab_geometry[2]
    inner, edge = np.zeros(n, dtype=np.int64), np.zeros(n + 1, dtype=np.bool_)
    for i in range(released.size):
        first = (released[i] * page_bytes - reserved_bytes) // slab_bytes
        last = ((released[i] + 1) * page_bytes - 1 - reserved_bytes) // slab_bytes
        if first == last:
            inner[first] += 1
        else:
            edge[last] = True
    return inner, edge


@njit(cache=True, inline="always")
def idle_pages(ref, keyed, low_priority, idle_tick, keyed_mode, before_tick, lo, hi):
    """How many of pages ``lo .. hi-1`` are idle: no request holds one, and it carries no key or one that counts
    (``keyed_mode`` 1: every key, 2: low priority or idle since before ``before_tick``); and how many of those
    are keyed. (The test is written out without branches: they mispredict.)"""
    every, valued, idle, counted = keyed_mode == 1, keyed_mode == 2, 0, 0
    for page in range(lo, hi):
        free, key = ref[page] == 0, keyed[page]
        counts = every | (valued & (low_priority[page] | (idle_tick[page] < before_tick)))
        idle += free & (not key or counts)
        counted += free & key & counts
    return idle, counted


@njit(cache=True, _nrt=False)
def surely_short(owner, deficit, surplus, fewest_inner, most_gain, owned):
    """Whether some group's ``deficit`` pages pass all ``Arena.plan`` could give it with a scan that is not clean
    (pure but for the ``owned`` scratch, per group its slabs): every spare slab and, per donor (no deficit), the
    slabs its ``surplus`` can give up (``take_donor_slabs``: each gives up at least the donor's ``fewest_inner``
    pages), each slab gaining the group at most ``most_gain`` pages (inner pages and two straddlers)."""
    owned[:] = 0
    slabs = 0
    for s in range(owner.size):
        if owner[s] < 0:
            slabs += 1
        else:
            owned[owner[s]] += 1
    for d in range(deficit.size):
        if deficit[d] <= 0 < surplus[d]:
            slabs += owned[d] if fewest_inner[d] == 0 else min(owned[d], surplus[d] // fewest_inner[d])
    for g in range(deficit.size):
        if deficit[g] > slabs * most_gain[g]:
            return True
    return False


@njit(cache=True)
def take_donor_slabs(own, donor, group, lo, hi, donor_straddle, inner_pages, straddle, left_pages, short_pages, taken,
                     inner_idle, edge_idle):
    """``donor``'s slabs for ``group`` until it is not ``short_pages`` short, lowest first: those whose inner and
    given-up straddling pages are idle (``idle_slabs``' ``inner_idle`` and ``edge_idle``) while the pages given up
    leave ``left_pages`` >= 0 (``own``: the plan's owners, updated; slabs to ``taken``). Returns (taken, still short,
    left)."""
    n_taken = 0
    for s in range(own.size):
        if short_pages <= 0:
            break
        if own[s] != donor or not inner_idle[s]:
            continue
        left, right = held_straddlers(own, donor, donor_straddle, s)  # the straddlers given up
        give = hi[s] - lo[s] + (left >= 0) + (right >= 0)
        if give > left_pages or left >= 0 and not edge_idle[s] or right >= 0 and not edge_idle[s + 1]:
            continue
        left_pages -= give
        short_pages -= lend_slab(own, group, inner_pages, straddle, s, taken, n_taken)
        n_taken += 1
    return n_taken, short_pages, left_pages


@njit(cache=True)
def idle_slabs(owner, group, lo, hi, straddle, ref, keyed, low_priority, idle_tick, keyed_mode, before_tick,
               released_pages, slab_geometry, inner_idle, edge_idle):
    """Which of ``group``'s slabs hold only idle pages (``idle_pages``, or released by the step) (pure):
    ``inner_idle[s]`` for inner pages, ``edge_idle[s]`` for the straddler left of ``s``; both start False.
    Returns how many keyed pages count as idle."""
    n, counted = owner.size, 0
    extra, released_edge = released_per_slab(released_pages, slab_geometry, n)
    edge_idle |= released_edge[:n]
    for s in range(n):
        if owner[s] != group:
            continue
        idle, keyed_idle = idle_pages(ref, keyed, low_priority, idle_tick, keyed_mode, before_tick, lo[s], hi[s])
        inner_idle[s], counted, page = idle + extra[s] == hi[s] - lo[s], counted + keyed_idle, straddle[s]
        if s > 0 and owner[s - 1] == group and page >= 0:
            idle, keyed_idle = idle_pages(ref, keyed, low_priority, idle_tick, keyed_mode, before_tick, page, page + 1)
            edge_idle[s] |= idle == 1
            counted += keyed_idle
    return counted


@njit(cache=True)
def read_cells(geometry, pages, bounds, index, group, row, column, page):
    """Group, row, column and page id now (-1: no live page there) of each ring-view
    cell ``index[i]`` (a row's bounds and cells read once for a run of its cells, as a step logs them)."""
    n_rows, n_cols = bounds.shape[2], geometry[0, VIEW_COLUMNS]
    rows_shift, cols_shift = log2_exact(n_rows), log2_exact(n_cols)
    last, g, r, base, hi, mask, cells_at, cells_mask, step = -1, 0, 0, 0, 0, 0, 0, 0, 0
    for i in range(index.size):
        at = index[i]
        q = divide(at, n_cols, cols_shift)
        if q != last:  # another (group, row)
            last, g = q, divide(q, n_rows, rows_shift)
            r = q - g * n_rows
            base, hi, mask = bounds[BASE, g, r], bounds[HI, g, r], geometry[g, COLUMN_MASK]
            cells_at, cells_mask, step = row_cells(geometry, bounds, g, r)
        c = at - q * n_cols
        group[i], row[i], column[i] = g, r, c
        # The one logical page of [base, hi) at column c (a live span never exceeds the ring).
        logical = c if mask < 0 else base + ((c - base) & mask)
        page[i] = pages[cells_at + (logical & cells_mask) * step] if base <= logical < hi else -1


@njit(cache=True)
def log2_exact(value):
    """``log2(value)`` when ``value`` is a power of two, else -1 (``divide``'s shift)."""
    shift = 0
    while (1 << shift) < value:
        shift += 1
    return shift if (1 << shift) == value else -1


@njit(cache=True)
def distinct_rows(rows, mark, keep=False):
    """Whether no row is listed twice (``mark``: scratch, one flag per table row, all False before and after, but
    for the rows' own when ``keep`` and they are distinct: those stay set)."""
    distinct = True
    for r in range(rows.size):
        if mark[rows[r]]:
            distinct = False
            break
        mark[rows[r]] = True
    for r in range(0 if distinct and keep else rows.size):
        mark[rows[r]] = False
    return distinct


@njit(cache=True)
def first_out_of_range(local, per_group, limits, lowest):
    """``-1 - i`` for the first group-major page ``i`` outside ``[lowest, limits[g])`` (0: none); ``MISLISTED``
    unless ``per_group`` holds one non-negative count per group summing to ``local.size``."""
    if per_group.size != limits.size:
        return MISLISTED
    total = 0
    for g in range(per_group.size):
        if per_group[g] < 0 or per_group[g] > local.size - total:  # the sum is never to wrap past int64
            return MISLISTED
        total += per_group[g]
    if total != local.size:
        return MISLISTED
    k = 0
    for g in range(per_group.size):
        for _ in range(per_group[g]):
            if local[k] < lowest or local[k] >= limits[g]:
                return -1 - k
            k += 1
    return 0


@njit(cache=True)
def add_held(local, per_group, offsets, held, delta):
    """``held`` of every listed page raised by ``delta`` per listing; the first listing that takes a count
    below 0 (-1: none)."""
    k, bad = 0, -1
    for g in range(per_group.size):
        for _ in range(per_group[g]):
            held[offsets[g] + local[k]] += delta
            if bad < 0 and held[offsets[g] + local[k]] < 0:
                bad = k
            k += 1
    return bad


# Last: ``grant_step``'s ``lru.join`` (``hybridkv.memory.lru`` imports this module's names first).
from hybridkv.memory import lru as _lru  # noqa: E402
