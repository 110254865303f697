"""Single-pool page operations for the pool tests, through the path the runtime uses:
a ``PageSpace`` (made for a pool not in one yet), ``PagePool.make_room`` then the free
stack's top (what ``kernels.allocate_pages`` pops), ``kernels.drop_holds`` then
``released`` (a release), ``borrow`` (a prefix hit's holds as ``lru.borrow_row``
takes them: ``kernels.take_holds``, then ``borrowed_idle``) and the key
flags then ``PageSpace.adopt`` (what a commit's ``kernels.claim_entries`` does)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from hybridkv.memory import lru
from hybridkv.memory.pool import NULL_PAGE, PagePool, PageSpace
from hybridkv.runtime import kernels


class PoolExhausted(RuntimeError):
    """An allocation asked for more pages than free plus evictable."""


def space_of(pool: PagePool) -> tuple[PageSpace, int]:
    """The pool's page space (a new one of its own if it has none) and its group there."""
    if pool.space is None:
        PageSpace([pool])
    return pool.space, pool.space.pools.index(pool)


def allocate(pool: PagePool, count: int, *, highest: int = 0) -> np.ndarray:
    """``count`` pages held once, all or nothing, evicting as a step does (``make_room``):
    a lowest-first pool's lowest free ids ascending, except that the last ``highest`` are
    its highest free ids (ascending), as ``kernels.allocate_pages`` places transient pages."""
    count = int(count)
    highest = int(highest) if pool.lowest_first else 0
    if not 0 <= highest <= max(count, 0):
        raise ValueError(f"highest must lie in [0, {count}], got {highest}")
    if count < 0:
        raise ValueError(f"cannot allocate a negative number of pages ({count})")
    if count > pool.num_free_pages:
        raise PoolExhausted(f"group {pool.group_id!r}: need {count} pages, {pool.num_free_pages} free or evictable")
    pool.make_room(count, highest)
    space, g = space_of(pool)
    offset, top, low = int(space.offsets[g]), int(space.tops[g]), count - highest
    stack = space.stack[offset : offset + top]
    out = stack[top - low :][::-1].astype(np.int64)
    if highest:
        out = np.concatenate([out, stack[:highest][::-1].astype(np.int64)])
        stack[: top - low - highest] = stack[highest : top - low].copy()
    space.tops[g] = top - count
    space.ref_counts[offset + out] = 1
    allocated = np.zeros(len(space.pools), dtype=np.int64)
    allocated[g] = count
    space.per_group[kernels.ALLOCATED_PAGES] += allocated  # counted as a step's kernel counts
    kernels.note_peaks(space.per_group, allocated, allocated[:0])  # the pools' peaks, as a step's kernel notes them
    return out


def decref(pool: PagePool, pages: Sequence[int] | np.ndarray) -> None:
    """One reference less on each listed page (logical order, a page may repeat): one
    release, as a step's (``kernels.drop_holds``, ``released``)."""
    space, g = space_of(pool)
    pages = np.asarray(pages, dtype=np.int64)
    per_group = np.zeros(len(space.pools), dtype=np.int64)
    per_group[g] = pages.size
    freed, keyed = np.empty(pages.size, dtype=np.int64), np.empty(pages.size, dtype=np.int64)
    counts = np.zeros((2, len(space.pools)), dtype=np.int64)
    kernels.drop_holds(space.ref_counts, space.cached, space.offsets, per_group, pages, freed, keyed, counts)
    released(space, counts, freed[: counts[0].sum()], keyed[: counts[1].sum()])


def released(space: PageSpace, counts: np.ndarray, freed: np.ndarray, keyed: np.ndarray) -> None:
    """What ``kernels.drop_holds`` let go (``counts``, ``freed``, ``keyed`` as it fills them)
    goes where a step's release puts it (as ``lru.release_placing`` does): unkeyed pages onto their
    pools' free stacks, the release counted, keyed ones into their LRUs by
    ``PageSpace.keyed_idle`` (which tells a pool's ranker)."""
    top, lowest = space.per_group[kernels.TOP], space.per_group[kernels.LOWEST]
    kernels.push_free(space.stack, top, space.offsets, lowest, counts[0], freed)
    space.per_group[kernels.RELEASED_PAGES] += counts[0] + counts[1]
    space.keyed_idle(counts[1], keyed)


def borrowed_idle(space: PageSpace, idle: np.ndarray, n_idle: int) -> None:
    """The first ``n_idle`` of ``idle`` (local ids, ``idle_counts[g]`` of group ``g``, as
    ``kernels.take_holds`` lists them) got a holder: they leave their pools' LRUs and the
    peaks follow (``lru.leave``, ``kernels.note_peaks``), as a prefix hit's leave theirs in ``lru.borrow_row``."""
    if n_idle:
        lru.leave(space.lru_prev, space.lru_next, space.per_group[kernels.LRU_PAGES], space.offsets, space.idle_counts,
                  idle[:n_idle])
        kernels.note_peaks(space.per_group, space.idle_counts, space.idle_counts[:0])


def borrow(space: PageSpace, pages: np.ndarray, per_group: np.ndarray) -> None:
    """One more holder on each of group ``g``'s slice of ``pages`` (local ids, group-major,
    ``per_group[g]`` of them, none twice in a group), the idle ones leaving their LRUs, as a
    prefix hit takes them (``lru.borrow_row``, its placement aside): refused whole
    (ValueError) if a page is free."""
    idle = np.empty(pages.size, dtype=np.int64)
    n_idle = kernels.take_holds(space.ref_counts, space.cached, space.low_priority, space.low_idle, space.offsets,
                                per_group, pages, idle, space.idle_counts)
    if n_idle < 0:
        raise ValueError(f"page {int(pages[-1 - n_idle])} is free, cannot be borrowed")
    borrowed_idle(space, idle, n_idle)


def incref(pool: PagePool, pages: Sequence[int] | np.ndarray) -> None:
    """One more reference on each listed held or cached page (distinct): a prefix hit
    borrowing them (``borrow``)."""
    space, g = space_of(pool)
    pages = np.asarray(pages, dtype=np.int64)
    per_group = np.zeros(len(space.pools), dtype=np.int64)
    per_group[g] = pages.size
    borrow(space, pages, per_group)


def publish(pool: PagePool, key: Hashable, pages: Sequence[int], *, low_priority: bool = False) -> bool:
    """Key held, unkeyed pages under ``key`` (low priority: evicted before every other
    once idle); False, nothing changed, if the key is published already."""
    if pool.lookup(key) is not None:
        return False
    entry = tuple(map(int, pages))
    ids = np.asarray(entry, dtype=np.int64)
    if any(p <= NULL_PAGE or p >= pool.num_pages for p in entry) or not np.all(pool.ref_counts[ids] > 0) or (
            pool.cached[ids].any()):
        raise ValueError(f"group {pool.group_id!r}: a page of {list(entry)} is not a held, unpublished page")
    pool.cached[ids] = True
    if low_priority:
        pool.low_priority[ids] = True
    space_of(pool)[0].adopt([pool], [[key]], [[entry]])
    return True
