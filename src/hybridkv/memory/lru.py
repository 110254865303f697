"""The pools' LRUs of idle keyed pages: intrusive doubly linked lists in int arrays,
changed by compiled kernels (numba ``@njit(cache=True)``; plain Python with
``NUMBA_DISABLE_JIT=1``), so a release, a borrow or a removal of many pages is one call.

A pool's list lives in ``prev`` and ``nxt`` (int32 by local page id, -1 outside the list):
``nxt[page]`` is the next more recently used page. The null page 0 is the sentinel: ``nxt[0]``
is the head (evicted first), ``prev[0]`` the tail. In a page space every pool's arrays sit end
to end (links stay local ids; kernels add the group's offset). The order is an ``OrderedDict``'s.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hybridkv.runtime.kernels import (BASE, HELD_AT, HELD_PAGES, HI, ID_OFFSET, LOW_FLOOR, LOW_IDLE_PAGES, LOWEST,
                                      LRU_PAGES, PAGE_TOKENS, PUBLISHED, TOP, add_held, first_out_of_range, fit_ring,
                                      note_peaks, place_row, push_run, release_into, take_cells)

# numba's cache of this file's kernels also holds the compiled code of the kernels.py functions imported above, and
# is renewed only when this file changes: after changing one of those in kernels.py, remove __pycache__/lru.*.nb[ic].


@njit(cache=True, inline="always")
def append(prev, nxt, off, page):
    """``page`` (not listed) becomes the tail of the list at ``off``; ``append(nxt, prev, off, page)``: its head (the
    tail of the list read backwards)."""
    tail = prev[off]
    nxt[off + tail] = page
    prev[off + page] = tail
    nxt[off + page] = 0
    prev[off] = page


@njit(cache=True, inline="always")
def unlink(prev, nxt, off, page):
    """``page`` (listed) leaves the list at ``off``."""
    before, after = prev[off + page], nxt[off + page]
    nxt[off + before] = after
    prev[off + after] = before
    prev[off + page] = -1
    nxt[off + page] = -1


@njit(cache=True, _nrt=False)  # it allocates nothing: its 11 arrays come in without a MemInfo each
def join(idle_tick, low_priority, prev, nxt, lengths, low_idle, low_floors, offsets, per_group, pages, clock):
    """Idle keyed ``pages`` (group after group, ``per_group[g]`` each, the last listed first) join their
    group's list with its next tick of the idle clock (``clock[0]``): the tail, a low-priority one the head
    (counted in ``low_idle[g]``, ``low_floors[g]`` lowered to it)."""
    start = 0
    for g in range(per_group.size):
        k, off = per_group[g], offsets[g]
        if k:
            clock[0] += 1
            for i in range(start + k - 1, start - 1, -1):
                page = pages[i]
                idle_tick[off + page] = clock[0]
                if low_priority[off + page]:
                    append(nxt, prev, off, page)  # the head
                    low_idle[g] += 1
                    low_floors[g] = min(low_floors[g], page)
                else:
                    append(prev, nxt, off, page)
            lengths[g] += k
            start += k


@njit(cache=True)
def take_holds(ref, keyed, low_priority, space_counts, prev, nxt, offsets, per_group, pages, idle_counts):
    """One reference more on each listed page (group-major); ``-1 - i`` and nothing changed when page ``i`` is
    free. Else the pages that had no holder leave their group's list (``idle_counts[g]`` each; low-priority ones
    leave its ``LOW_IDLE_PAGES``), the pools' peaks following; returns how many."""
    start = 0
    for g in range(per_group.size):
        offset = offsets[g]
        for i in range(start, start + per_group[g]):
            if ref[offset + pages[i]] == 0 and not keyed[offset + pages[i]]:
                return -1 - i
        start += per_group[g]
    start, n_idle = 0, 0
    for g in range(per_group.size):
        offset = offsets[g]
        idle_counts[g] = 0
        for i in range(start, start + per_group[g]):
            page = offset + pages[i]
            if ref[page] == 0:
                unlink(prev, nxt, offset, pages[i])
                idle_counts[g] += 1
                if low_priority[page]:
                    space_counts[LOW_IDLE_PAGES, g] -= 1
            ref[page] += 1
        space_counts[LRU_PAGES, g] -= idle_counts[g]
        n_idle += idle_counts[g]
        start += per_group[g]
    if n_idle:
        note_peaks(space_counts, idle_counts, idle_counts[:0])
    return n_idle


@njit(cache=True)
def hold_leaving(local, per_group, offsets, limits, ref, keyed, low_priority, held, idle_counts, prev, nxt,
                 space_counts):
    """Hold the listed pages (group-major, ``per_group[g]`` each) outside any request: :func:`take_holds` (the idle
    ones leave their lists, the pools' peaks follow), ``held`` raised; returns how many had no holder. Nothing
    changed for a page outside ``[1, limits[g])`` (``-1 - i``) or free (``-1 - local.size - i``) or a mislisted list
    (``MISLISTED``)."""
    found = first_out_of_range(local, per_group, limits, 1)
    if found < 0:
        return found
    found = take_holds(ref, keyed, low_priority, space_counts, prev, nxt, offsets, per_group, local, idle_counts)
    if found < 0:
        return found - local.size
    add_held(local, per_group, offsets, held, 1)
    return found


@njit(cache=True)
def release_placing(local, per_group, offsets, limits, ref, keyed, held, freed, keyed_pages, counts, stack,
                    space_counts, idle_tick, low_priority, prev, nxt, clock):
    """Drop holds of :func:`hold_leaving`, then what they let go goes where a release puts it
    (``kernels.release_into``): unkeyed pages onto their free stacks, keyed ones into their lists (:func:`join`),
    the release counted; returns how many pages lost their last reference. Nothing changed for a page outside
    ``[0, limits[g])`` (``-1 - i``), one released more often than held (``-1 - local.size - i``, ``i`` its listing
    that passes its holds) or a mislisted list (``MISLISTED``)."""
    found = first_out_of_range(local, per_group, limits, 0)
    if found < 0:
        return found
    bad = add_held(local, per_group, offsets, held, -1)
    if bad >= 0:  # undone whole
        add_held(local, per_group, offsets, held, 1)
        return -1 - local.size - bad
    release_into(ref, keyed, stack, space_counts, offsets, local, per_group, freed, keyed_pages, counts)
    found = counts.sum()
    if found > 0:
        join(idle_tick, low_priority, prev, nxt, space_counts[LRU_PAGES], space_counts[LOW_IDLE_PAGES],
             space_counts[LOW_FLOOR], offsets, counts[1], keyed_pages, clock)
    return found


@njit(cache=True, _nrt=False)
def demote_unit(listed, low_priority, prev, nxt, offsets, low_floors, low_idle):
    """``PagePool.demote`` of entries of some groups (``PageSpace.demote``, the pool's too): ``listed`` holds,
    entry after entry, its group, its page count and its local ids. It allocates nothing, counts no reference."""
    at = 0
    while at < listed.size:
        g, end, n_idle = listed[at], at + 2 + listed[at + 1], 0
        off = offsets[g]
        was_low = end > at + 2 and low_priority[off + listed[at + 2]]  # an entry is low as a whole
        for i in range(at + 2, end):
            page = listed[i]
            low_priority[off + page] = True
            if prev[off + page] >= 0:
                unlink(prev, nxt, off, page)
                append(nxt, prev, off, page)  # the head
                n_idle += 1
                low_floors[g] = min(low_floors[g], page)
        if n_idle and not was_low:
            low_idle[g] += n_idle
        at = end


@njit(cache=True, inline="always")
def low_end(low_priority, prev, nxt, off, known):
    """The last page of the low-priority head of the list at ``off`` (0: none): ``known`` where it still is (listed,
    low priority, before a normal-priority page or the end: the head holds every listed low-priority page), else
    found by a walk from the head."""
    if known == 0:
        head = nxt[off]
        if head == 0 or not low_priority[off + head]:
            return 0
    elif prev[off + known] >= 0 and low_priority[off + known]:
        after = nxt[off + known]
        if after == 0 or not low_priority[off + after]:
            return known
    behind, page = 0, nxt[off]
    while page != 0 and low_priority[off + page]:
        behind, page = page, nxt[off + page]
    return behind


@njit(cache=True)
def first_in_line(listed, idle_tick, low_priority, prev, nxt, offsets, low_ends):
    """``PageSpace.first_in_line``: ``listed`` holds, group after group, its group, its page count and its local ids;
    those listed with normal priority move to just behind their list's low-priority head (the next normal-priority
    pages evicted), the last one listed first, each given the idle tick of the oldest normal-priority page there, so
    ticks still rise along the list. ``low_ends[g]``: where group ``g``'s head ended last time (:func:`low_end`, kept
    up to date). Returns how many moved."""
    at, moved = 0, 0
    while at < listed.size:
        g, end = listed[at], at + 2 + listed[at + 1]
        off = offsets[g]
        behind = low_ends[g] = low_end(low_priority, prev, nxt, off, low_ends[g])
        page = nxt[off + behind]
        tick = idle_tick[off + page] if page != 0 else 0
        for i in range(at + 2, end):
            page = listed[i]
            if prev[off + page] < 0 or low_priority[off + page]:
                continue  # not idle, or low priority already
            unlink(prev, nxt, off, page)
            after = nxt[off + behind]
            nxt[off + behind], prev[off + page], nxt[off + page], prev[off + after] = page, behind, after, page
            idle_tick[off + page] = tick
            moved += 1
        at = end
    return moved


@njit(cache=True)
def order(nxt, out):
    """One pool's listed pages, head first, into ``out``; how many (at most ``out.size``)."""
    n, page = 0, nxt[0]
    while page and n < out.size:
        out[n] = page
        n += 1
        page = nxt[page]
    return n


@njit(cache=True)
def oldest_normal_tick(nxt, low_priority, idle_tick):
    """The least ``idle_tick`` of one pool's listed pages of normal priority, -1 when it lists none."""
    none = np.iinfo(np.int64).max
    oldest, page = none, nxt[0]
    while page:
        if not low_priority[page] and idle_tick[page] < oldest:
            oldest = idle_tick[page]
        page = nxt[page]
    return -1 if oldest == none else oldest


@njit(cache=True)
def normal_tick_at(nxt, low_priority, idle_tick, n):
    """The ``n``-th least ``idle_tick`` (``n >= 1``) of one pool's listed pages of normal priority; past the last
    one, its tick + 1; -1 when it lists none."""
    count, page = 0, nxt[0]
    while page:
        count += not low_priority[page]
        page = nxt[page]
    if count == 0:
        return -1
    ticks, k, page = np.empty(count, dtype=np.int64), 0, nxt[0]
    while page:
        if not low_priority[page]:
            ticks[k] = idle_tick[page]
            k += 1
        page = nxt[page]
    if n > count:
        return ticks.max() + 1
    return np.partition(ticks, n - 1)[n - 1]


@njit(cache=True, _nrt=False)
def drop_units(listed, ref, keyed, low_priority, lru_prev, lru_next, stack, offsets, per_group, idle, told):
    """Entries leaving the groups of a page space (``PageSpace.drop_units``, ``PagePool.evict_entries``): ``listed``
    holds, entry after entry, its group, its page count and its local ids, each group's entries last to first. Every
    page loses its key and low priority; the idle ones (no holder) leave their group's LRU and go onto its free stack
    in listed order, one run a group (``push_run``: as one entry after another would leave it); ``per_group``'s LRU
    lengths, idle low-priority counts and tops follow. ``idle[g]`` gets group ``g``'s idle pages; ``told[e]``, of the
    ``e``-th entry listed, ``2 * idle pages + low`` (low 1 if it was low priority: its first page's flag). ``told``
    (``4 * listed.size`` at least) is its scratch past ``listed.size``: it allocates nothing, counts no reference."""
    size = listed.size
    run, run_group, group_run = told[size:2 * size], told[2 * size:3 * size], told[3 * size:4 * size]
    n, at, e = 0, 0, 0
    idle[:] = 0
    while at < listed.size:
        g, end = listed[at], at + 2 + listed[at + 1]
        offset = offsets[g]
        count, low = 0, 1 if end > at + 2 and low_priority[offset + listed[at + 2]] else 0
        for i in range(at + 2, end):
            page = offset + listed[i]
            keyed[page] = False
            if ref[page] == 0:
                unlink(lru_prev, lru_next, offset, listed[i])
                if low_priority[page]:
                    per_group[LOW_IDLE_PAGES, g] -= 1
                run[n], run_group[n] = listed[i], g
                n += 1
                count += 1
            low_priority[page] = False
        idle[g] += count
        told[e] = 2 * count + low
        e += 1
        at = end
    for g in range(idle.size):
        if idle[g]:
            k = 0
            for i in range(n):
                if run_group[i] == g:
                    group_run[k] = run[i]
                    k += 1
            per_group[LRU_PAGES, g] -= k
            per_group[TOP, g] = push_run(stack[offsets[g]:], per_group[TOP, g], per_group[LOWEST, g] != 0,
                                         group_run[:k])


@njit(cache=True, _nrt=False)
def borrow_row(geometry, pages, bounds, ref, keyed, low_priority, prev, nxt, per_group, row, hit_tokens, windows,
               page_ids, work):
    """A new row's prefix hit at ``hit_tokens`` in one call: group ``g`` places its pages of the last ``windows[g]``
    tokens below the hit (-1: every page from the first), ``page_ids`` listing them group after group;
    :func:`take_holds` of them (idle ones leave their list, peaks follow), then ``kernels.place_row``, each
    page's ring-view cell written over it in ``page_ids``. Returns how many were idle (``-1 - i``, nothing changed,
    when page ``i`` is free; ``-1 - page_ids.size`` when the groups place another number of pages). ``work``
    (int64, three per group at least): its scratch; it allocates nothing, counts no reference
    (``_nrt=False``)."""
    n_groups = geometry.shape[0]
    lo, counts, idle_counts = work[:n_groups], work[n_groups : 2 * n_groups], work[2 * n_groups : 3 * n_groups]
    total = 0
    for g in range(n_groups):
        page_tokens = geometry[g, PAGE_TOKENS]
        lo[g] = 0 if windows[g] < 0 else max(0, hit_tokens - windows[g]) // page_tokens
        counts[g] = hit_tokens // page_tokens - lo[g]
        total += counts[g]
    if total != page_ids.size:
        return -1 - page_ids.size
    n_idle = take_holds(ref, keyed, low_priority, per_group, prev, nxt, geometry[:, ID_OFFSET], counts, page_ids,
                        idle_counts)
    if n_idle >= 0:
        place_row(geometry, pages, bounds, row, lo, counts, page_ids, page_ids)  # reads page n, then writes cell n
    return n_idle


@njit(cache=True, _nrt=False)
def free_row(geometry, pages, bounds, ref, keyed, stack, per_group, idle_tick, low_priority, prev, nxt, clock,
             counters, work, logged, log_at, row, grain):
    """``CacheManager.free`` of table row ``row`` in one call (-1, nothing changed, while its computed tokens complete a
    ``grain`` its published ones do not (``counters[0]``, ``counters[PUBLISHED]``): commit first): its live pages
    (``kernels.take_cells``) and the checkpoint it holds (``HELD_PAGES``), group-major, leave the tables (lanes back,
    base, hi and ``HELD_AT`` 0) as one release (``kernels.release_into``), the keyed ones
    left idle :func:`join` their lists, its counters (``counters[:, row]``) become 0, and the cells emptied are logged
    at ``logged[log_at]`` (-1: not logged). ``work`` (int64: 3 per group, then 4 times the room for a row's every
    cell and held page) holds its scratch: the cells emptied from ``work[3 * G]`` (``G`` groups; returns how many),
    the keyed pages left idle from ``work[3 * G + 3 * room]``, how many per group from ``work[G]``. Allocates nothing,
    counts no reference (``_nrt=False``): a returned array, an allocation or a counted argument would each cost a call
    from Python cold."""
    if grain and counters[PUBLISHED, row] // grain < counters[0, row] // grain:
        return -1
    n_groups, offsets = geometry.shape[0], geometry[:, ID_OFFSET]
    at, n, n_held = 3 * n_groups, 0, 0  # n: cells emptied; taken[n_held + n]: the pages let go
    room, counts = (work.size - at) // 4, work[:at].reshape((3, n_groups))
    cells_out, taken = work[at : at + room], work[at + room : at + 2 * room]
    freed, idle_keyed = work[at + 2 * room : at + 3 * room], work[at + 3 * room :]
    counts[:] = 0
    for g in range(n_groups):
        start = n + n_held
        n = take_cells(geometry, pages, bounds, g, row, bounds[BASE, g, row], taken[n_held:], cells_out, n)  # all of it
        for k in range(HELD_PAGES, bounds.shape[0]):  # the checkpoint it holds (``release_pages``)
            if bounds[k, g, row] > 0:
                taken[n + n_held] = bounds[k, g, row]
                n_held += 1
            bounds[k, g, row] = 0
        counts[2, g] = n + n_held - start
        fit_ring(geometry, pages, bounds, g, row, 0)  # its lane back
        bounds[BASE, g, row], bounds[HI, g, row], bounds[HELD_AT, g, row] = 0, 0, 0
    release_into(ref, keyed, stack, per_group, offsets, taken[: n + n_held], counts[2], freed, idle_keyed, counts)
    join(idle_tick, low_priority, prev, nxt, per_group[LRU_PAGES], per_group[LOW_IDLE_PAGES], per_group[LOW_FLOOR],
         offsets, counts[1], idle_keyed, clock)
    counters[:, row] = 0
    for i in range(n if log_at >= 0 else 0):
        logged[log_at + i] = cells_out[i]
    return n
