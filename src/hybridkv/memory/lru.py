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

from hybridkv.runtime.kernels import (ID_OFFSET, LOW_FLOOR, LOW_IDLE_PAGES, LOWEST, LRU_PAGES, PAGE_TOKENS,
                                      RELEASED_PAGES, TOP, add_held, drop_holds, first_out_of_range, free_rows,
                                      note_peaks, place_row, push_free, push_run, take_holds)


@njit(cache=True, inline="always")
def append(prev, nxt, off, page):
    """``page`` (not listed) becomes the tail of the list at ``off``."""
    tail = prev[off]
    nxt[off + tail] = page
    prev[off + page] = tail
    nxt[off + page] = 0
    prev[off] = page


@njit(cache=True, inline="always")
def push_front(prev, nxt, off, page):
    """``page`` (not listed) becomes the head of the list at ``off``: the tail of the same list read backwards."""
    append(nxt, prev, off, page)


@njit(cache=True, inline="always")
def unlink(prev, nxt, off, page):
    """``page`` (listed) leaves the list at ``off``."""
    before, after = prev[off + page], nxt[off + page]
    nxt[off + before] = after
    prev[off + after] = before
    prev[off + page] = -1
    nxt[off + page] = -1


@njit(cache=True)
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
                    push_front(prev, nxt, off, page)
                    low_idle[g] += 1
                    low_floors[g] = min(low_floors[g], page)
                else:
                    append(prev, nxt, off, page)
            lengths[g] += k
            start += k


@njit(cache=True)
def leave(prev, nxt, lengths, offsets, per_group, pages):
    """Listed pages (group after group, ``per_group[g]`` each) leave their group's list."""
    start = 0
    for g in range(per_group.size):
        k, off = per_group[g], offsets[g]
        for i in range(start, start + k):
            unlink(prev, nxt, off, pages[i])
        lengths[g] -= k
        start += k


@njit(cache=True)
def hold_leaving(local, per_group, offsets, limits, ref, keyed, low_priority, low_idle, held, idle_pages, idle_counts,
                 prev, nxt, space_counts):
    """Hold the listed pages (group-major, ``per_group[g]`` each) outside any request: ``kernels.take_holds``,
    ``held`` raised, the idle ones leaving their lists, the pools' peaks following; returns how many had no holder.
    Nothing changed for a page outside ``[1, limits[g])`` (``-1 - i``) or free (``-1 - local.size - i``) or a
    mislisted list (``MISLISTED``)."""
    found = first_out_of_range(local, per_group, limits, 1)
    if found < 0:
        return found
    found = take_holds(ref, keyed, low_priority, low_idle, offsets, per_group, local, idle_pages, idle_counts)
    if found < 0:
        return found - local.size
    add_held(local, per_group, offsets, held, 1)
    if found > 0:
        leave(prev, nxt, space_counts[LRU_PAGES], offsets, idle_counts, idle_pages[:found])
        note_peaks(space_counts, idle_counts, idle_counts[:0])
    return found


@njit(cache=True)
def release_placing(local, per_group, offsets, limits, ref, keyed, held, freed, keyed_pages, counts, stack,
                    space_counts, idle_tick, low_priority, prev, nxt, clock):
    """Drop holds of :func:`hold_leaving` (``kernels.drop_holds``), then what they let go goes where a release puts
    it: unkeyed pages onto their free stacks, keyed ones into their lists (:func:`join`), the release counted; returns
    how many pages lost their last reference. Nothing changed for a page outside ``[0, limits[g])`` (``-1 - i``), one
    released more often than held (``-1 - local.size - i``, ``i`` its listing that passes its holds) or a mislisted
    list (``MISLISTED``)."""
    found = first_out_of_range(local, per_group, limits, 0)
    if found < 0:
        return found
    bad = add_held(local, per_group, offsets, held, -1)
    if bad >= 0:  # undone whole
        add_held(local, per_group, offsets, held, 1)
        return -1 - local.size - bad
    drop_holds(ref, keyed, offsets, per_group, local, freed, keyed_pages, counts)
    found = counts.sum()
    if found > 0:
        push_free(stack, space_counts[TOP], offsets, space_counts[LOWEST], counts[0], freed)
        for g in range(counts.shape[1]):
            space_counts[RELEASED_PAGES, g] += counts[0, g] + counts[1, g]
        join(idle_tick, low_priority, prev, nxt, space_counts[LRU_PAGES], space_counts[LOW_IDLE_PAGES],
             space_counts[LOW_FLOOR], offsets, counts[1], keyed_pages, clock)
    return found


@njit(cache=True)
def leave_to_free(prev, nxt, stack, top, lowest, pages):
    """Listed pages leave one pool's list and go onto its free stack; the new top."""
    for i in range(pages.size):
        unlink(prev, nxt, 0, pages[i])
    return push_run(stack, top, lowest, pages)


@njit(cache=True)
def move(prev, nxt, pages, to_front):
    """Listed ``pages`` (one pool's) move, in order, to the head (``to_front``) or the tail."""
    for i in range(pages.size):
        unlink(prev, nxt, 0, pages[i])
        if to_front:
            push_front(prev, nxt, 0, pages[i])
        else:
            append(prev, nxt, 0, pages[i])


@njit(cache=True, _nrt=False)
def demote_unit(listed, low_priority, prev, nxt, offsets, low_floors, low_idle):
    """``PagePool.demote`` of entries of some groups (``PageSpace.demote``): ``listed`` holds,
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
                push_front(prev, nxt, off, page)
                n_idle += 1
                low_floors[g] = min(low_floors[g], page)
        if n_idle and not was_low:
            low_idle[g] += n_idle
        at = end


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
    ``kernels.take_holds`` of them (idle ones leave their list, peaks follow), then ``kernels.place_row``, each
    page's ring-view cell written over it in ``page_ids``. Returns how many were idle (``-1 - i``, nothing changed,
    when page ``i`` is free; ``-1 - page_ids.size`` when the groups place another number of pages). ``work``
    (int64, three per group and one per page): its scratch; it allocates nothing, counts no reference
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
    offsets, idle = geometry[:, ID_OFFSET], work[3 * n_groups : 3 * n_groups + page_ids.size]
    n_idle = take_holds(ref, keyed, low_priority, per_group[LOW_IDLE_PAGES], offsets, counts, page_ids, idle,
                        idle_counts)
    if n_idle >= 0:
        leave(prev, nxt, per_group[LRU_PAGES], offsets, idle_counts, idle[:n_idle])
        if n_idle:
            note_peaks(per_group, idle_counts, idle_counts[:0])
        place_row(geometry, pages, bounds, row, lo, counts, page_ids, page_ids)  # reads page n, then writes cell n
    return n_idle


@njit(cache=True, _nrt=False)
def free_rows_listed(geometry, pages, bounds, ref, keyed, stack, per_group, idle_tick, low_priority, prev, nxt,
                     clock, rows, cells_out, work):
    """``kernels.free_rows``, then :func:`join` of the keyed pages it left idle. The cells emptied go to ``cells_out``
    (room for every live cell of ``rows``; returns how many), its scratch to ``work`` (int64: 3 per group, then three
    times ``cells_out``'s room), where the keyed pages left idle stay: how many per group from ``work[G]`` (``G``
    groups), the pages (group after group) from ``work[3 * G + 2 * room]``. Allocates nothing, counts no reference
    (``_nrt=False``): a returned array, an allocation or a counted argument would each cost a call from Python cold."""
    n_groups, offsets = geometry.shape[0], geometry[:, ID_OFFSET]
    room, at = cells_out.size, 3 * n_groups
    counts = work[:at].reshape((3, n_groups))
    taken, freed, idle_keyed = work[at : at + room], work[at + room : at + 2 * room], work[at + 2 * room :]
    n = free_rows(geometry, pages, bounds, ref, keyed, stack, per_group, rows, offsets, taken, cells_out, freed,
                  idle_keyed, counts)
    join(idle_tick, low_priority, prev, nxt, per_group[LRU_PAGES], per_group[LOW_IDLE_PAGES], per_group[LOW_FLOOR],
         offsets, counts[1], idle_keyed, clock)
    return n
