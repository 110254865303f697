"""Single-pool page operations for the pool tests, through the path the runtime uses:
the pool's ``PageSpace``, ``PagePool.make_room`` then the free
stack's top (what ``kernels.allocate_pages`` pops), ``released`` (a release:
``kernels.release_into``), ``borrow`` (a prefix hit's holds as ``lru.borrow_row``
takes them: ``lru.take_holds``) and the key
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
    """The pool's page space (its own unless a larger one holds it) and its group there."""
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
    release, as a step's (``released``)."""
    space, g = space_of(pool)
    pages = np.asarray(pages, dtype=np.int64)
    per_group = np.zeros(len(space.pools), dtype=np.int64)
    per_group[g] = pages.size
    released(space, per_group, pages)


def released(space: PageSpace, per_group: np.ndarray, pages: np.ndarray) -> None:
    """One release of ``pages`` (local ids, group-major, ``per_group[g]`` each) as a step's
    (``kernels.release_into``: unkeyed pages onto their pools' free stacks, the release counted),
    the keyed ones it left idle then into their LRUs by ``PageSpace.keyed_idle`` (which tells a
    pool's ranker), as ``lru.release_placing`` does."""
    freed, keyed = np.empty(pages.size, dtype=np.int64), np.empty(pages.size, dtype=np.int64)
    counts = np.zeros((2, len(space.pools)), dtype=np.int64)
    kernels.release_into(space.ref_counts, space.cached, space.stack, space.per_group, space.offsets, pages,
                         per_group, freed, keyed, counts)
    space.keyed_idle(counts[1], keyed[: counts[1].sum()])


def borrow(space: PageSpace, pages: np.ndarray, per_group: np.ndarray) -> None:
    """One more holder on each of group ``g``'s slice of ``pages`` (local ids, group-major,
    ``per_group[g]`` of them, none twice in a group), the idle ones leaving their LRUs, as a
    prefix hit takes them (``lru.borrow_row``, its placement aside): refused whole
    (ValueError) if a page is free."""
    n_idle = lru.take_holds(space.ref_counts, space.cached, space.low_priority, space.per_group, space.lru_prev,
                            space.lru_next, space.offsets, per_group, pages, space.idle_counts)
    if n_idle < 0:
        raise ValueError(f"page {int(pages[-1 - n_idle])} is free, cannot be borrowed")


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
