"""The compiled data plane: one step's per-group, per-request work as plain loops.

Every function here is a numba ``@njit(cache=True)`` kernel over struct-of-arrays
state (``StepState`` in ``hybridkv.runtime.state``); with ``NUMBA_DISABLE_JIT=1``
the same functions run as plain Python. Nothing here allocates Python objects
per request: a step is one call whatever the batch looks like (decode, prefill
chunks, both, requests joining and settling).

Arrays (``G`` groups, ``R`` scheduled rows, ``N`` scheduled tokens):

* ``geometry`` int64 ``[G, 9]``: page tokens ``T``, window tokens ``W`` (0: full
  history), ring column mask (``capacity - 1`` for sliding groups, -1 for full
  history), rows per page, entry stride tokens, the group's first id in the page
  space (ids of group ``g`` are ``offset + local id``), then the log2 of page
  tokens, rows per page and stride (-1 where not a power of two: a division then).
* ``pages`` int32 ``[G, table rows, columns]``: each row's page ids, logical page
  ``L`` at column ``L & mask`` (-1 where no page).
* ``bounds`` int64 ``[2, G, table rows]``: live logical pages ``[base, hi)``.
* ``computed`` int64 ``[table rows]``: tokens computed per row.
* ``ref`` int32 ``[P]``, ``keyed`` bool ``[P]``: per page-space id, its holders and
  whether it carries a content key (an idle keyed page goes to the prefix
  cache's LRU, which Python keeps, not to the free stack).
* ``stack`` int32 ``[P]`` and ``top`` int64 ``[G]``: group ``g``'s free local ids at
  ``stack[offset_g : offset_g + top[g]]``, the next one handed out last (LIFO).

The rules (docs/manager.md): a step writing tokens ``[first, first + n)`` of a
row releases, in a sliding group, the logical pages below
``min(max(first - W + 1, 0) // T, hi)`` and holds pages up to ``ceil((first + n) / T)``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

PAGE_TOKENS, WINDOW_TOKENS, COLUMN_MASK, ROWS_PER_PAGE, STRIDE_TOKENS, ID_OFFSET = range(6)
PAGE_SHIFT, ROWS_SHIFT, STRIDE_SHIFT = range(6, 9)  # log2 of the three sizes, -1 if not a power of two
GEOMETRY_COLUMNS = 9

STEP_DONE = 0
STEP_NEEDS_PAGES = 1  # some group's free stack is short after the releases: evict or lend, then allocate
STEP_NEEDS_ROOM = 2  # the scratch buffers are too small for this step's moves: nothing changed


@njit(cache=True)
def divide(value, divisor, shift):
    """``value // divisor`` for ``value >= 0``, a shift when ``divisor`` is ``1 << shift``."""
    return value >> shift if shift >= 0 else value // divisor


@njit(cache=True)
def plan_bounds(geometry, bounds, computed, rows, counts, after):
    """``after[0, g, r]``, ``after[1, g, r]``: base and hi of ``rows[r]`` in group ``g``
    once the step ran (pure). Returns int64 ``[2, G]``: pages released and pages
    allocated per group."""
    n_groups = geometry.shape[0]
    sums = np.zeros((2, n_groups), dtype=np.int64)
    for g in range(n_groups):
        tokens, shift = geometry[g, PAGE_TOKENS], geometry[g, PAGE_SHIFT]
        window = geometry[g, WINDOW_TOKENS]
        for r in range(rows.size):
            row = rows[r]
            first = computed[row]
            base = bounds[0, g, row]
            hi = bounds[1, g, row]
            new_base = base
            if window > 0:
                floor = divide(max(first - window + 1, 0), tokens, shift)
                new_base = max(base, min(floor, hi))
            new_hi = max(hi, divide(first + counts[r] + tokens - 1, tokens, shift))
            after[0, g, r] = new_base
            after[1, g, r] = new_hi
            sums[0, g] += new_base - base
            sums[1, g] += new_hi - hi
    return sums


@njit(cache=True)
def release_credit(geometry, pages, bounds, ref, rows, after, credit):
    """``credit[g, r]``: pages row ``r`` releases in group ``g`` whose only holder it is
    (they become free or evictable). Pure."""
    for g in range(geometry.shape[0]):
        mask = geometry[g, COLUMN_MASK]
        offset = geometry[g, ID_OFFSET]
        for r in range(rows.size):
            row = rows[r]
            n = 0
            for logical in range(bounds[0, g, row], after[0, g, r]):
                if ref[offset + pages[g, row, logical & mask]] == 1:
                    n += 1
            credit[g, r] = n


@njit(cache=True)
def release(geometry, pages, bounds, ref, keyed, stack, top, rows, after, touched, n_touched, idle_keyed):
    """Drop every row's pages below its new base, in batch order then logical order.
    A page whose last holder left goes on its group's free stack (the first released
    on top) or, if keyed, to ``idle_keyed`` (page-space ids, in release order). Cells
    changed are appended to ``touched`` (flat cell index) from ``n_touched``. Returns
    (cells logged so far, idle keyed pages)."""
    n_keyed = 0
    n_rows = pages.shape[1]
    n_cols = pages.shape[2]
    for g in range(geometry.shape[0]):
        mask = geometry[g, COLUMN_MASK]
        offset = geometry[g, ID_OFFSET]
        start = top[g]  # this step's released pages, pushed in order, reversed below
        for r in range(rows.size):
            row = rows[r]
            for logical in range(bounds[0, g, row], after[0, g, r]):
                col = logical & mask
                page = pages[g, row, col]
                pages[g, row, col] = -1
                touched[n_touched] = (g * n_rows + row) * n_cols + col
                n_touched += 1
                ref[offset + page] -= 1
                if ref[offset + page] == 0:
                    if keyed[offset + page]:
                        idle_keyed[n_keyed] = offset + page
                        n_keyed += 1
                    else:
                        stack[offset + top[g]] = page
                        top[g] += 1
            bounds[0, g, row] = after[0, g, r]
        # The first page released ends on top (reused first).
        lo, hi = offset + start, offset + top[g] - 1
        while lo < hi:
            stack[lo], stack[hi] = stack[hi], stack[lo]
            lo += 1
            hi -= 1
    return n_touched, n_keyed


@njit(cache=True)
def allocate(geometry, pages, bounds, ref, stack, top, rows, after, touched, n_touched):
    """Give every row the pages from its hi to its new hi, popping its group's free
    stack (rows in batch order, pages in logical order); every page held once.
    The caller has checked that each stack holds enough. Returns cells logged."""
    n_rows = pages.shape[1]
    n_cols = pages.shape[2]
    for g in range(geometry.shape[0]):
        mask = geometry[g, COLUMN_MASK]
        offset = geometry[g, ID_OFFSET]
        for r in range(rows.size):
            row = rows[r]
            for logical in range(bounds[1, g, row], after[1, g, r]):
                top[g] -= 1
                page = stack[offset + top[g]]
                ref[offset + page] = 1
                col = logical & mask
                pages[g, row, col] = page
                touched[n_touched] = (g * n_rows + row) * n_cols + col
                n_touched += 1
            bounds[1, g, row] = after[1, g, r]
    return n_touched


@njit(cache=True)
def token_arrays(computed, rows, counts, first_row, positions, request_indices, query_start_loc):
    """Positions, request indices and query start locations of rows ``[first_row, R)``
    (the scheduled ones; rows before them only settle), from their computed tokens
    before the step; then their computed tokens move on."""
    n = 0
    query_start_loc[0] = 0
    for r in range(first_row, rows.size):
        row = rows[r]
        k = r - first_row
        for i in range(counts[r]):
            positions[n] = computed[row] + i
            request_indices[n] = k
            n += 1
        query_start_loc[k + 1] = n
    for r in range(rows.size):
        computed[rows[r]] += counts[r]


@njit(cache=True)
def write_slots(geometry, pages, rows, first_row, positions, request_indices, slots):
    """``slots[g, i]``: ``page * rows_per_page + entry % rows_per_page`` for token ``i``
    (entry ``position // stride``), -1 where the token closes no entry."""
    for g in range(geometry.shape[0]):
        tokens, page_shift = geometry[g, PAGE_TOKENS], geometry[g, PAGE_SHIFT]
        per_page, rows_shift = geometry[g, ROWS_PER_PAGE], geometry[g, ROWS_SHIFT]
        stride, stride_shift = geometry[g, STRIDE_TOKENS], geometry[g, STRIDE_SHIFT]
        mask = geometry[g, COLUMN_MASK]
        for i in range(positions.size):
            pos = positions[i]
            entry = divide(pos + 1, stride, stride_shift)
            if entry * stride != pos + 1:
                slots[g, i] = -1
                continue
            entry -= 1
            row = rows[first_row + request_indices[i]]
            page = pages[g, row, divide(pos, tokens, page_shift) & mask]
            slots[g, i] = np.int64(page) * per_page + entry - divide(entry, per_page, rows_shift) * per_page


@njit(cache=True)
def base_pages(bounds, rows, first_row, out):
    """``out[g, r]``: base logical page of scheduled row ``r`` in group ``g``."""
    for g in range(bounds.shape[1]):
        for r in range(first_row, rows.size):
            out[g, r - first_row] = bounds[0, g, rows[r]]


@njit(cache=True)
def block_tables(geometry, pages, bounds, rows, first_row, width, out):
    """``out[g, r, j]``: page of logical page ``base + j`` of scheduled row ``r``, -1
    past its live pages (``width`` columns)."""
    for g in range(geometry.shape[0]):
        mask = geometry[g, COLUMN_MASK]
        for r in range(first_row, rows.size):
            row = rows[r]
            base = bounds[0, g, row]
            live = bounds[1, g, row] - base
            for j in range(width):
                out[g, r - first_row, j] = pages[g, row, (base + j) & mask] if j < live else -1


@njit(cache=True)
def run_step(geometry, pages, bounds, computed, ref, keyed, stack, top, rows, counts, first_row,
             after, touched, idle_keyed, positions, request_indices, query_start_loc, slots, bases):
    """One step, admitted already: plan, release, allocate, token arrays, write slots,
    base pages. Returns (status, cells touched, idle keyed pages). ``STEP_NEEDS_PAGES``:
    releases ran but some group's stack is short; nothing else changed, and the
    caller makes room (evicts, lends) and calls ``finish_step``. ``STEP_NEEDS_ROOM``:
    ``touched`` (and ``idle_keyed``, as large) must hold the second number of cells;
    nothing changed."""
    sums = plan_bounds(geometry, bounds, computed, rows, counts, after)
    if sums.sum() > touched.size:
        return STEP_NEEDS_ROOM, sums.sum(), 0
    n_touched, n_keyed = release(geometry, pages, bounds, ref, keyed, stack, top, rows, after, touched, 0,
                                 idle_keyed)
    for g in range(geometry.shape[0]):
        if sums[1, g] > top[g]:
            return STEP_NEEDS_PAGES, n_touched, n_keyed
    n_touched = finish_step(geometry, pages, bounds, computed, ref, stack, top, rows, counts, first_row, after,
                            touched, n_touched, positions, request_indices, query_start_loc, slots, bases)
    return STEP_DONE, n_touched, n_keyed


@njit(cache=True)
def finish_step(geometry, pages, bounds, computed, ref, stack, top, rows, counts, first_row, after,
                touched, n_touched, positions, request_indices, query_start_loc, slots, bases):
    """The rest of ``run_step`` once the stacks hold enough: allocate, then the arrays."""
    n_touched = allocate(geometry, pages, bounds, ref, stack, top, rows, after, touched, n_touched)
    token_arrays(computed, rows, counts, first_row, positions, request_indices, query_start_loc)
    write_slots(geometry, pages, rows, first_row, positions, request_indices, slots)
    base_pages(bounds, rows, first_row, bases)
    return n_touched


# --- the pieces the manager's step calls (its pools stay Python objects) -----------------
@njit(cache=True)
def plan_rows(geometry, bounds, rows, first, counts, now, after, need, moves):
    """Stacked ``[2G, R]``: ``now`` and ``after``, base (rows ``[0, G)``) and hi (rows
    ``[G, 2G)``) of every row before and after a step writing ``counts`` tokens from
    ``first``, and ``moves = after - now`` (pages released, pages allocated);
    ``need[g, r]`` pages holding its tokens. Pure. Returns int64 ``[2, G]``: pages
    released and allocated per group."""
    n_groups = geometry.shape[0]
    sums = np.zeros((2, n_groups), dtype=np.int64)
    for g in range(n_groups):
        tokens, shift = geometry[g, PAGE_TOKENS], geometry[g, PAGE_SHIFT]
        window = geometry[g, WINDOW_TOKENS]
        for r in range(rows.size):
            row = rows[r]
            base = bounds[0, g, row]
            hi = bounds[1, g, row]
            new_base = base
            if window > 0:
                new_base = max(base, min(divide(max(first[r] - window + 1, 0), tokens, shift), hi))
            pages = divide(first[r] + counts[r] + tokens - 1, tokens, shift)
            now[g, r] = base
            now[n_groups + g, r] = hi
            after[g, r] = new_base
            after[n_groups + g, r] = max(hi, pages)
            need[g, r] = pages
            moves[g, r] = new_base - base
            moves[n_groups + g, r] = after[n_groups + g, r] - hi
            sums[0, g] += new_base - base
            sums[1, g] += after[n_groups + g, r] - hi
    return sums


@njit(cache=True)
def store_bounds(bounds, rows, after):
    """``bounds[0, g, rows[r]] = after[g, r]`` and ``bounds[1, g, rows[r]] = after[G + g, r]``
    (``after`` stacked as ``plan_rows`` writes it)."""
    n_groups = bounds.shape[1]
    for g in range(n_groups):
        for r in range(rows.size):
            bounds[0, g, rows[r]] = after[g, r]
            bounds[1, g, rows[r]] = after[n_groups + g, r]


@njit(cache=True)
def take_pages(geometry, pages, rows, lo, counts, out, touched):
    """Empty logical pages ``[lo[g, r], lo[g, r] + counts[g, r])`` of every group and row;
    their ids go to ``out`` and their flat cells to ``touched``, group-major then row
    order. Returns how many."""
    n = 0
    n_rows, n_cols = pages.shape[1], pages.shape[2]
    for g in range(geometry.shape[0]):
        mask = geometry[g, COLUMN_MASK]
        for r in range(rows.size):
            row = rows[r]
            for logical in range(lo[g, r], lo[g, r] + counts[g, r]):
                col = logical & mask
                out[n] = pages[g, row, col]
                pages[g, row, col] = -1
                touched[n] = (g * n_rows + row) * n_cols + col
                n += 1
    return n


@njit(cache=True)
def place_pages(geometry, pages, rows, lo, counts, ids, touched):
    """Store ``ids`` (group-major, row-major) at logical pages ``[lo, lo + counts)``;
    their flat cells go to ``touched``."""
    n = 0
    n_rows, n_cols = pages.shape[1], pages.shape[2]
    for g in range(geometry.shape[0]):
        mask = geometry[g, COLUMN_MASK]
        for r in range(rows.size):
            row = rows[r]
            for logical in range(lo[g, r], lo[g, r] + counts[g, r]):
                col = logical & mask
                pages[g, row, col] = ids[n]
                touched[n] = (g * n_rows + row) * n_cols + col
                n += 1


@njit(cache=True)
def transient_ranks(geometry, hi, counts, end, totals, ranks, highest):
    """Per sliding group ``g`` in which some row gets several of the ``totals[g]`` pages
    it allocates: ``highest[g]`` of them are transient (logical page below
    ``max(end - W + 1, 0) // T``, released at the next step), and ``ranks`` (the
    groups' segments of ``totals`` each, in order) puts survivors first, in row then
    logical order, then the transient pages: the id of logical page ``hi[g, r] + k``
    of row ``r`` is ``ids[rank]`` of the group's ids. ``highest[g] = 0`` elsewhere."""
    start = 0
    for g in range(geometry.shape[0]):
        n = totals[g]
        highest[g] = 0
        tokens, shift, window = geometry[g, PAGE_TOKENS], geometry[g, PAGE_SHIFT], geometry[g, WINDOW_TOKENS]
        rows_allocating = 0
        for r in range(end.size):
            if counts[g, r] > 0:
                rows_allocating += 1
        if n == 0 or window <= 0 or n <= rows_allocating:
            start += n
            continue  # history pages all live on; one page per row has no order
        t = 0
        for r in range(end.size):
            keep_from = divide(max(end[r] - window + 1, 0), tokens, shift)
            t += min(max(keep_from - hi[g, r], 0), counts[g, r])
        survivors, transient = 0, 0
        for r in range(end.size):
            keep_from = divide(max(end[r] - window + 1, 0), tokens, shift)
            for k in range(counts[g, r]):
                if hi[g, r] + k < keep_from:
                    ranks[start + survivors + transient] = n - t + transient
                    transient += 1
                else:
                    ranks[start + survivors + transient] = survivors
                    survivors += 1
        highest[g] = t
        start += n


@njit(cache=True)
def merge_free(stack, top, run):
    """Merge the ascending ids ``run`` into the free stack ``stack[:top]`` (descending:
    the lowest id on top), in place; returns the new top. Ids are distinct."""
    i, j, k = top - 1, 0, top + run.size - 1
    while j < run.size:  # fill from the new top down, lowest first; stack ids left are in place
        if i >= 0 and stack[i] < run[j]:
            stack[k] = stack[i]
            i -= 1
        else:
            stack[k] = run[j]
            j += 1
        k -= 1
    return top + run.size


@njit(cache=True)
def take_lowest(stack, top, pending, low):
    """The ``low`` lowest ids of the free stack ``stack[:top]`` (descending, lowest on
    top) and the released ids ``pending`` together, ascending, taken. Only the stack's
    ``low`` lowest can be among them, so just those and ``pending`` are sorted. What is
    left of them goes back on top of the stack when it all lies below the stack's next
    id; otherwise it stays pending. Returns (taken, new top, still pending)."""
    under = max(top - low, 0)
    both = np.empty(top - under + pending.size, dtype=stack.dtype)
    both[: top - under] = stack[under:top]
    both[top - under :] = pending
    both.sort()  # distinct ids: any sort gives the same order
    rest = both[low:]
    if rest.size and under and rest[-1] > stack[under - 1]:
        return both[:low].copy(), under, rest.copy()
    for i in range(rest.size):
        stack[under + i] = rest[rest.size - 1 - i]
    return both[:low].copy(), under + rest.size, rest[:0].copy()


@njit(cache=True)
def batch_arrays(rows, first, counts, after, off, table_rows, scheduled, positions, request_indices,
                 query_start_loc, base_pages, widths):
    """The batch of plan rows ``[off, R)`` (rows before ``off`` only settle): each one's
    table row and scheduled tokens (int32), its tokens' positions from ``first`` and
    request indices, query start locations; ``base_pages[g, r]``, the row's base page
    after the step (``after`` stacked as ``plan_rows`` writes it); ``widths[g]``, the
    widest row's live pages."""
    n_groups = base_pages.shape[0]
    n = 0
    query_start_loc[0] = 0
    for r in range(off, rows.size):
        k = r - off
        table_rows[k] = rows[r]
        scheduled[k] = counts[r]
        for i in range(counts[r]):
            positions[n] = first[r] + i
            request_indices[n] = k
            n += 1
        query_start_loc[k + 1] = n
    for g in range(n_groups):
        widest = 0
        for r in range(off, rows.size):
            base_pages[g, r - off] = after[g, r]
            widest = max(widest, after[n_groups + g, r] - after[g, r])
        widths[g] = widest


@njit(cache=True)
def block_table(geometry, pages, bounds, g, rows, out):
    """``out[r, j]``: group ``g``'s page of logical page ``base + j`` of ``rows[r]``, -1
    past its live pages."""
    mask = geometry[g, COLUMN_MASK]
    for r in range(rows.size):
        row = rows[r]
        base = bounds[0, g, row]
        live = bounds[1, g, row] - base
        for j in range(out.shape[1]):
            out[r, j] = pages[g, row, (base + j) & mask] if j < live else -1


@njit(cache=True)
def drop_holds(ref, keyed, offsets, per_group, pages, freed, keyed_pages, counts):
    """One reference less on each listed page (local ids, group-major, ``per_group[g]``
    of group ``g``, whose ids start at ``offsets[g]`` in ``ref`` and ``keyed``). The pages
    whose last reference went, once each in the order first listed: unkeyed ones to
    ``freed``, keyed ones to ``keyed_pages``; ``counts[0, g]`` and ``counts[1, g]`` how many."""
    start, n_freed, n_keyed = 0, 0, 0
    for g in range(per_group.size):
        end = start + per_group[g]
        offset = offsets[g]
        for i in range(start, end):
            ref[offset + pages[i]] -= 1
        for i in range(start, end):
            page = offset + pages[i]
            if ref[page] == 0:
                ref[page] = -1  # taken once, even where the list repeats it
                if keyed[page]:
                    keyed_pages[n_keyed] = pages[i]
                    n_keyed += 1
                    counts[1, g] += 1
                else:
                    freed[n_freed] = pages[i]
                    n_freed += 1
                    counts[0, g] += 1
        for i in range(start, end):
            if ref[offset + pages[i]] == -1:
                ref[offset + pages[i]] = 0
        start = end
