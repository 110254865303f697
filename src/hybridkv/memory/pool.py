"""Physical pages of one cache group: free ids, ref counts, cached-page LRU.

A granted page id is free (on the free stack), held (ref count >= 1) or cached and evictable (ref count
0, keyed, in the LRU); page 0 is the null page. Free order is deterministic: LIFO, or lowest id first
(``lowest_first``, an arena's pools); cached pages are reclaimed only once the free stack is empty,
least recently used first. With ``granted=False`` a pool starts empty (an arena grants it ids).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable, Hashable, Sequence
from operator import attrgetter

import numpy as np

from hybridkv._checks import as_int
from hybridkv.memory import lru
from hybridkv.runtime import kernels

NULL_PAGE = 0
_LOW_EVICT_PAGES = 16  # idle low-priority pages an eviction frees beyond the allocation's need
# Packing ahead (``PagePool.pack_ahead_pages``): free ids beyond an allocation's a packing clears of idle
# low-priority entries at once, so live pages pack lower (filling 1,024 requests leaves 447 slabs spare, not 178)
# and the next allocations find their ids clear; none in a smaller pool (small budgets' hit rates move with any change).
PACK_AHEAD_PAGES = 64
PACK_AHEAD_MIN_POOL_PAGES = 4096
_SCAN_PAGES = 64  # idle low-priority ids one scan of the flags lists for packing
# One clock for every pool (when a keyed page last went idle); an array so that ``lru.join`` draws ticks.
_IDLE_CLOCK = np.zeros(1, dtype=np.int64)
_NO_PAGES = np.empty(0, dtype=np.int64)
_ANY_PAGES = np.zeros(4, dtype=np.int64)[::2]  # a read-only strided view: its type covers every int64 1-D layout
_ANY_PAGES.flags.writeable = False


def _stirs_any(key: Hashable) -> bool:
    """``PagePool.stirs`` by default: telling of any removal may change the pool."""
    return True


def idle_clock_tick() -> int:
    """A tick of the pools' shared idle clock later than every ``idle_tick`` so far."""
    _IDLE_CLOCK[0] += 1
    return int(_IDLE_CLOCK[0])


# Why an entry left a pool (the second argument of ``on_removed``).
UNPUBLISHED, EVICTED, EVICTED_LOW, REVOKED = "unpublished", "evicted", "evicted_low", "revoked"


class PoolCounters:
    """A pool's event counts. Pages released and allocated live in ``tallies`` (int64), a
    view of ``PageSpace.per_group`` once a page space holds the pool: the step kernels add to it."""

    __slots__ = ("tallies", "evicted_pages")

    def __init__(self) -> None:
        self.tallies, self.evicted_pages = np.zeros(2, dtype=np.int64), 0

    released_pages = property(lambda self: int(self.tallies[0]))
    allocated_pages = property(lambda self: int(self.tallies[1]))

    def as_dict(self) -> dict[str, int]:
        """The three counts by name (a snapshot)."""
        return {name: getattr(self, name) for name in ("allocated_pages", "released_pages", "evicted_pages")}


def _count(row: int, doc: str | None = None) -> property:
    """A ``PagePool`` count: row ``row`` of its ``per_group``, in its column (``_slot``)."""

    def get(pool: PagePool) -> int:
        return int(pool._per_group[row, pool._slot])

    def put(pool: PagePool, value: int) -> None:
        pool._per_group[row, pool._slot] = value

    return property(get, put, doc=doc)


class PagePool:
    """Pages ``1 .. num_pages-1`` of one group (``num_pages`` counts the null page)."""

    def __init__(self, group_id: str, num_pages: int, *, shuffle_seed: int | None = None, granted: bool = True,
                 lowest_first: bool = False):
        num_pages = as_int(f"group {group_id!r}: num_pages", num_pages)
        if num_pages < 2:
            raise ValueError(f"group {group_id!r}: a pool needs at least 2 pages (null page + 1), got {num_pages!r}")
        self.group_id = group_id
        self.num_pages = num_pages
        self.ref_counts = np.zeros(self.num_pages, dtype=np.int32)
        self._rng = None if shuffle_seed is None else np.random.default_rng(shuffle_seed)
        self.lowest_first = bool(lowest_first) and self._rng is None
        self.counters = PoolCounters()
        # The free stack is ``_stack[:_top]``; the counts are a ``per_group`` column (a page space's, once in one).
        self._stack = np.empty(self.num_pages, dtype=np.int32)
        self._bind(np.zeros((kernels.PER_GROUP_ROWS, 1), dtype=np.int64), 0)
        self._per_group[kernels.LOWEST] = self.lowest_first
        self._low_floor = self.num_pages  # none yet
        # The LRU of idle keyed pages: a linked list in two arrays (``hybridkv.memory.lru``).
        self._lru_prev = np.full(self.num_pages, -1, dtype=np.int32)
        self._lru_next = np.full(self.num_pages, -1, dtype=np.int32)
        self._lru_prev[NULL_PAGE] = self._lru_next[NULL_PAGE] = NULL_PAGE
        self.idle_tick = np.zeros(self.num_pages, dtype=np.int64)
        self._low_ids = kernels.low_idle_ids  # by its compiled code once :meth:`load_kernels` ran
        self.cached = np.zeros(self.num_pages, dtype=bool)
        self.low_priority = np.zeros(self.num_pages, dtype=bool)  # evicted before all others once idle
        # Per keyed page, its entry's key (stale for unkeyed pages); a list: an entry's pages share cache lines.
        self._page_key: list[Hashable | None] = [None] * self.num_pages
        self._entries: dict[Hashable, tuple[int, ...]] = {}
        self.lookup: Callable[[Hashable], tuple[int, ...] | None] = self._entries.get  # pages by key, or None
        # Told (key, cause, idle pages freed) after an entry is removed.
        self.on_removed: Callable[[Hashable, str, int], None] | None = None
        # A "prefill-per-byte" prefix cache's ``CheckpointOrder``: names normal-priority victims.
        self._ranker = None
        # Evicts a batch (keys, cause) itself, telling everyone, in place of :meth:`evict_entries` and
        # ``on_removed``, on a pool whose removals never change it (docs/prefix-caching.md, "Evicting in
        # batches"); returns the idle pages freed here.
        self.evict_many: Callable[[Sequence[Hashable], str], int] | None = None
        # Where telling of removals may change the pool (``on_removed`` set, no ``evict_many``): whether telling of the
        # removal of ``key``'s entry may (any, unless a prefix cache knows better), and what evicts packing's batches
        # (keys, cause; the removals of all but the last change nothing here), telling everyone, returning the idle
        # pages freed here (``_evict_low_below``; None: :meth:`_unpublish_many`).
        self.stirs: Callable[[Hashable], bool] = _stirs_any
        self.evict_batch: Callable[[Sequence[Hashable], str], int] | None = None
        # Set by an arena: must an allocation of ``n`` pages up to id ``page`` pack first (None: always).
        self.must_pack: Callable[[int, int], bool] | None = None
        self.space = PageSpace([self])  # the page space whose arrays this pool views (a manager's, once in one)
        if granted:
            self.grant(np.arange(1, self.num_pages, dtype=np.int32))

    def _set_ranker(self, ranker) -> None:
        self._ranker = ranker
        self.space.ranked = [g for g, pool in enumerate(self.space.pools) if pool.ranker is not None]

    ranker = property(attrgetter("_ranker"), _set_ranker)

    # --- counts ---------------------------------------------------------
    def _bind(self, per_group: np.ndarray, slot: int) -> None:
        """The pool's counts become views of ``per_group``'s rows (its column ``slot``)."""
        self._per_group, self._slot = per_group, slot
        self._tops, self._lows = per_group[kernels.TOP], per_group[kernels.LOW_IDLE_PAGES]
        self._lru_lengths = per_group[kernels.LRU_PAGES]
        self.counters.tallies = per_group[kernels.RELEASED_PAGES : kernels.LRU_PAGES, slot]

    _top = num_clean_free_pages = _count(kernels.TOP, "Ids on the free stack.")
    _low_floor = _count(kernels.LOW_FLOOR, "A lower bound of the idle low-priority pages' ids (``num_pages``: none).")
    peak_used_pages = _count(kernels.PEAK_USED_PAGES, """The most pages held at once, as a page space's steps and
        borrows saw it (``kernels.note_peaks``).""")
    usable_pages = _count(kernels.GRANTED_PAGES, "Pages granted to this pool (all but the null page unless an arena "
                          "manages it).")
    # Pages an allocation can get now: free plus cached-evictable.
    num_free_pages = property(lambda self: int(self._tops[self._slot] + self._lru_lengths[self._slot]))
    num_evictable_pages = property(lambda self: int(self._lru_lengths[self._slot]))
    num_used_pages = property(lambda self: self.usable_pages - self.num_free_pages)  # held by a request or more
    num_low_priority_idle_pages = _count(kernels.LOW_IDLE_PAGES, """Idle keyed pages of low-priority entries
        (evicted before any other): an exact count.""")
    num_cached_pages = property(lambda self: int(np.count_nonzero(self.cached)))

    def make_room(self, count: int, highest: int = 0, packs: bool = False) -> None:
        """Evict cached entries so that the free stack's top ``count`` ids are the ones an allocation of ``count``
        pages takes: in a lowest-first pool, idle low-priority entries holding ids below the ``count - highest``
        lowest free ones (packing: long-lived pages stay low, so the slabs above them hold only idle pages an arena
        can lend; the ``highest`` pages, released again at the next step, take the highest free ids), then least
        recently used entries while the stack is short. The one place allocation evicts. A packing that finds an idle
        low-priority id below those it takes, with free ids to spare, clears ``pack_ahead_pages`` more (below the
        ``count - highest + pack_ahead_pages`` lowest free ids, or all if fewer), so the next steps need not pack.
        Packing is skipped without asking ``must_pack`` when no idle low-priority id can lie below those lowest free
        ones (``_low_floor``, a lower bound of them, is not below the highest): it would find nothing to evict.
        ``packs``: the caller knows that packing is due (``kernels.room_groups`` asked with the free stack covering
        the allocation): ``must_pack`` is not asked again."""
        long, top = count - highest, int(self._tops[self._slot])
        if long > 0 and self.lowest_first and self._lows[self._slot]:
            short = top < long
            last = 0 if short else int(self._stack[top - long])  # the highest id the long-lived take
            if packs or short or (self._low_floor < last and (self.must_pack is None or self.must_pack(last, long))):
                self._evict_low_below(long, 0 if short else self.pack_ahead_pages)
                top = int(self._tops[self._slot])
        if top < count:
            self._evict_lru(count - top)

    @property
    def pack_ahead_pages(self) -> int:
        """Packing's reserve (``PACK_AHEAD_PAGES``): at most 1/128 of the granted pages, none in a small pool."""
        granted = self.usable_pages
        return 0 if granted < PACK_AHEAD_MIN_POOL_PAGES else min(PACK_AHEAD_PAGES, granted >> 7)

    def _evict_low_below(self, count: int, ahead: int = 0) -> None:
        """:meth:`make_room`'s packing: evict the idle low-priority entries holding ids below the ``count`` lowest free
        ones (those freed count as free), lowest id first; with ``ahead``, below the ``count + ahead`` lowest (or all)
        when one lies below the ``count`` lowest, else none. One batch (:meth:`_low_victims`) where telling of a removal
        cannot change this pool (``evict_many`` set, or no one to tell), else batches (``evict_batch``) each ending with
        the first entry whose removal may (``stirs``: ``on_removed`` may demote entries here), the flags scanned again
        after it."""
        top, freed = self._top, 0
        stirs = self.stirs if self.on_removed is not None and self.evict_many is None else None
        end = int(self._stack[top - count]) if top >= count else self.num_pages  # scanned below it
        candidates = self._low_idle_ids(end, _SCAN_PAGES)
        if ahead and candidates:  # one lies below the ids taken: clear more
            count = min(count + ahead, top)
        while candidates:
            keys = self._low_victims(count, top, candidates,
                                     candidates[0] + 1 if len(candidates) == _SCAN_PAGES else end, freed, stirs)
            if stirs is None:
                self._unpublish_many(keys)
                return
            scan = stirs(keys[-1])
            freed += (self.evict_batch or self._unpublish_many)(keys, EVICTED)
            if not scan or freed >= count:
                return
            top = self._top  # the scan stops at the ``count``-th lowest free id (``num_pages`` while fewer are free)
            end = int(self._stack[top - count]) if top >= count else self.num_pages
            candidates = self._low_idle_ids(end, _SCAN_PAGES)
        self._low_floor = max(self._low_floor, end)  # none below it

    def _low_victims(self, count: int, top: int, candidates: list[int], end: int, freed: int = 0,
                     stirs: Callable[[Hashable], bool] | None = None) -> list[Hashable]:
        """:meth:`_evict_low_below`'s batch: the keys of the idle low-priority entries below the ``count`` lowest free
        ids (those the entries before free count as free), lowest id first, from ``candidates`` (the first scan's) and
        scans of ``_SCAN_PAGES`` ids that each go on where the last stopped (the next from ``end``);
        ``_low_floor`` set to where they stopped. The bound, the ``count``-th lowest of the free ids and those freed,
        is kept as pages are freed in a sorted list of the ``count`` lowest (``stack[:top]`` has the lowest on top).
        ``freed``: idle pages freed before (it stops at ``count``); ``stirs``: the batch ends with the first key it
        is true of (``_low_floor`` its page)."""
        ref, page_key, entries = self._ref_view, self._page_key, self._entries
        lowest = self._stack[top - min(count, top) : top][::-1].tolist()  # ascending; fewer while fewer are free
        keys, gone, bound = [], set(), lowest[-1] if len(lowest) == count else self.num_pages
        while True:
            if not candidates:  # the next scan goes on where the last stopped
                candidates = self._low_idle_ids(bound, _SCAN_PAGES, end)
                if not candidates:
                    break
                end = candidates[0] + 1 if len(candidates) == _SCAN_PAGES else bound
            page = candidates.pop()
            if page in gone:
                continue
            if page >= bound or freed >= count:
                self._low_floor = page  # the lowest idle low-priority id left
                return keys
            keys.append(page_key[page])
            if stirs is not None and stirs(keys[-1]):  # its removal may change the flags: a scan again after it
                self._low_floor = page
                return keys
            pages = entries[keys[-1]]
            gone.update(pages)
            for p in pages:
                if ref[p]:
                    continue
                freed += 1
                if p < bound:  # it joins the ``count`` lowest; past ``count``, the highest (the bound) leaves
                    insort(lowest, p)
                    del lowest[count:]
                    if len(lowest) == count:
                        bound = lowest[-1]
        # None left below the bound the scans stopped at (it only fell meanwhile).
        self._low_floor = max(self._low_floor, bound)
        return keys

    def _low_idle_ids(self, bound: int, most: int, start: int = -1) -> list[int]:
        """The first ``most`` idle low-priority page ids from ``start`` (default ``_low_floor``) up to ``bound``
        (excluded), the lowest last (popped first): one scan of the flags (``kernels.low_idle_ids``)."""
        start = self._low_floor if start < 0 else start
        if start >= bound:
            return []
        out = np.empty(most, dtype=np.int64)
        n = self._low_ids(self.low_priority, self.cached, self.ref_counts, start, bound, out)
        return out[:n][::-1].tolist()

    # --- grants (shared arena) ---------------------------------------------
    def grant(self, pages: np.ndarray) -> None:
        """Make never-granted (or revoked) page ids usable: they go on the free stack,
        the first listed on top (shuffled first with a shuffle seed)."""
        pages = np.asarray(pages, dtype=np.int64)
        if self._rng is not None:
            pages = pages.copy()
            self._rng.shuffle(pages)
        self._top = int(kernels.push_run(self._stack, self._top, self.lowest_first, pages))
        self.usable_pages += int(pages.size)

    def free_page_ids(self) -> np.ndarray:
        """Ids on the free stack (a view; do not keep across calls)."""
        return self._stack[: self._top]

    def evictable_page_ids(self) -> np.ndarray:
        """Cached pages no request holds, least recently used first (the LRU's order)."""
        out = np.empty(self.num_evictable_pages, dtype=np.int64)
        return out[: lru.order(self._lru_next, out)]

    def oldest_idle_tick(self) -> int | None:
        """The idle tick of the least recently idle keyed page of normal priority (None: none)."""
        tick = lru.oldest_normal_tick(self._lru_next, self.low_priority, self.idle_tick)
        return None if tick < 0 else int(tick)

    def normal_tick_at(self, n: int) -> int | None:
        """The idle tick of the ``n``-th least recently idle keyed page of normal priority (``n >= 1``; past the last
        one, its tick + 1; None: none), in plain ints (``lru.normal_tick_at``)."""
        tick = lru.normal_tick_at(self._lru_next, self.low_priority, self.idle_tick, n)
        return None if tick < 0 else int(tick)

    def revoke(self, pages: np.ndarray) -> None:
        """Take back page ids that are all free or cached-evictable (their entries unpublished); all or nothing."""
        top, pages, evictable = kernels.revoke_ids(self.ref_counts, self.cached, self._stack, self._top,
                                                   np.asarray(pages, dtype=np.int64))
        if top < 0:
            raise ValueError(f"group {self.group_id!r}: only granted pages no request holds can be revoked")
        self._top = int(top)
        if evictable.size:
            # One batch (telling of one removal takes no other entry here); their pages then leave the stack.
            self._unpublish_many(list(dict.fromkeys(map(self._page_key.__getitem__, evictable.tolist()))), REVOKED)
            self._top = int(kernels.drop_ids(self._stack, self._top, evictable))
        self.usable_pages -= int(pages.size)

    def load_kernels(self) -> None:
        """Load (or compile) now, changing nothing, the kernels of revokes, grants and evictions."""
        self.revoke(_NO_PAGES)
        kernels.drop_ids(self._stack, self._top, _NO_PAGES)
        kernels.push_run(self._stack, self._top, self.lowest_first, _NO_PAGES)
        self._low_ids = kernels.entry_point(kernels.low_idle_ids, (  # ``_low_idle_ids``' kernel, its compiled code
            self.low_priority, self.cached, self.ref_counts, 0, 0, _NO_PAGES))

    # --- content-keyed entries -------------------------------------------
    def demote(self, key: Hashable) -> None:
        """Make an entry low priority: its idle pages move to the front of the LRU, the last listed first
        (``PageSpace.demote``)."""
        pages = self._entries[key]
        self.space.demote([self._slot, len(pages), *pages])

    def _move_idle(self, pages: tuple[int, ...]) -> list[int]:
        """Those of ``pages`` in the LRU move, in order, to its tail (entries are a few pages: item stores beat a
        kernel call); returns them."""
        prev, nxt = self._lru_views
        idle = []
        for page in pages:  # lru.unlink, then lru.append
            before = prev[page]
            if before < 0:
                continue
            idle.append(page)
            after = nxt[page]
            nxt[before], prev[after] = after, before
            tail = prev[NULL_PAGE]
            nxt[tail], prev[page], nxt[page], prev[NULL_PAGE] = page, tail, NULL_PAGE, page
        return idle

    def unpublish(self, key: Hashable, cause: str = UNPUBLISHED) -> int:
        """Drop an entry; its pages that no request holds go back to the free stack (their count is returned)."""
        removal = self.space.drop_units([self._drop_args], [key], cause)[2][0]
        if self.on_removed is not None:
            self.on_removed(*removal)
        return removal[2]

    def promote(self, key: Hashable) -> None:
        """Undo :meth:`demote`: the entry's idle pages become the most recently used."""
        pages = self._entries[key]
        low = self.low_priority
        if not pages or not low[pages[0]]:
            return
        for page in pages:
            low[page] = False
        self._lows[self._slot] -= len(self._move_idle(pages))  # ``num_low_priority_idle_pages``

    def touch(self, key: Hashable) -> None:
        """Move a normal-priority entry's idle pages to the back of the LRU (the most
        recently used); a low-priority entry stays where it is."""
        pages = self._entries[key]
        if pages and not self.low_priority[pages[0]]:
            self._move_idle(pages)

    def entry_keys(self) -> list[Hashable]:
        return list(self._entries)

    def _evict_lru(self, pages_needed: int) -> None:
        """Evict least recently used entries until ``pages_needed`` idle pages are freed (the same entries, in the same
        order, as evicting one at a time); idle low-priority entries at the head of the LRU go ``_LOW_EVICT_PAGES``
        pages beyond that in the same pass, so a run of small allocations does not evict once each."""
        keys, freed = {}, 0  # the victims' keys in order (a dict: an ordered set)
        page_key, low, entries, nxt, ranker, ref = (self._page_key, self.low_priority, self._entries,
                                                    self._lru_views[1], self.ranker, self.ref_counts)
        page = nxt[NULL_PAGE]  # the head
        while page != NULL_PAGE:
            key = page_key[page]
            if key not in keys:
                if freed >= pages_needed and (freed >= pages_needed + _LOW_EVICT_PAGES or not low[page]):
                    break
                if ranker is not None and not low[page]:  # past the idle low-priority entries: the ranker's victims
                    while freed < pages_needed:
                        key = ranker.victim(self, keys)
                        if key is None:
                            raise AssertionError(f"group {self.group_id!r}: the checkpoint order lost idle pages")
                        keys[key] = None
                        freed += sum(1 for p in entries[key] if ref[p] == 0)
                    break
                keys[key] = None
                pages = entries[key]  # its idle pages are the ones in the LRU
                freed += 1 if len(pages) == 1 else sum(1 for p in pages if nxt[p] >= 0)
            page = nxt[page]
        self._unpublish_many(list(keys))

    def _unpublish_many(self, keys: Sequence[Hashable], cause: str = EVICTED) -> int:
        """``evict_many`` where set, else :meth:`evict_entries`, then each removal told to
        ``on_removed``; the idle pages freed."""
        if self.evict_many is not None:
            return self.evict_many(keys, cause)
        removals = self.evict_entries(keys, cause)
        if self.on_removed is not None:
            for removal in removals:
                self.on_removed(*removal)
        return sum(idle for _, _, idle in removals)

    def evict_entries(self, keys: Sequence[Hashable], cause: str = EVICTED) -> list[tuple[Hashable, str, int]]:
        """Unpublish the published entries ``keys`` as evictions (their idle pages counted as evicted) in one compiled
        pass over their pages (``PageSpace.drop_units``),
        telling no one: the free stack ends as after one :meth:`unpublish` each, in order (the last entry's pages on
        top). Per entry, in order, what :meth:`unpublish` would tell ``on_removed``: (key, cause: ``EVICTED_LOW`` for a
        low-priority entry evicted, idle pages freed)."""
        removals = self.space.drop_units([self._drop_args], keys, cause)[2]
        self.counters.evicted_pages += sum(idle for _, _, idle in removals)
        return removals

    # --- checks -----------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if free/held/evictable states overlap or pages leak, or the LRU's links are not a list
        from the head of the ``num_evictable_pages`` idle keyed pages, each linked back to the one before, every other
        page unlinked."""
        free = self._stack[: self._top]
        assert np.unique(free).size == free.size, "page on the free stack twice"
        assert not np.any(free == NULL_PAGE), "null page on the free stack"
        assert np.all(self.ref_counts[free] == 0), "free page with references"
        assert not np.any(self.cached[free]), "free page still keyed"
        listed = np.empty(self.num_pages, dtype=np.int64)
        listed = listed[: lru.order(self._lru_next, listed)]
        assert listed.size == self.num_evictable_pages, "LRU length"
        ring = np.concatenate([[NULL_PAGE], listed, [NULL_PAGE]])
        assert np.array_equal(self._lru_prev[ring[1:]], ring[:-1]), "LRU back links"
        unlisted = np.ones(self.num_pages, dtype=bool)
        unlisted[ring] = False
        assert np.all(self._lru_next[unlisted] == -1) and np.all(self._lru_prev[unlisted] == -1), "unlisted page linked"
        # Every idle keyed page, and only they, in the LRU: what the arena's idle scans (kernels.idle_slabs) rely on.
        idle_keyed = np.flatnonzero(self.cached & (self.ref_counts == 0))
        assert np.array_equal(idle_keyed, np.sort(listed)), "idle cached page outside the LRU"
        low_idle = int(np.count_nonzero(self.low_priority[listed]))
        assert self.num_low_priority_idle_pages == low_idle, "idle low-priority count"
        assert self.num_cached_pages == sum(map(len, self._entries.values())), "keyed pages outside the entries"
        assert self.ref_counts[NULL_PAGE] == 0
        assert np.all(self.ref_counts >= 0)
        held = int(np.count_nonzero(self.ref_counts > 0))
        assert held + self.num_free_pages == self.usable_pages, "page leaked"


class PageSpace:
    """Every pool's pages in arrays the step kernels own (per page: ref counts, key flags, idle ticks,
    free stacks at ``offsets[g]``, LRU links; per group: ``per_group``, ``kernels.TOP`` ... ``SKIP_PACKING``).
    Each pool is rebound to views of them, so pool methods and kernels see the same state."""

    def __init__(self, pools: Sequence[PagePool]):
        self.pools = list(pools)
        sizes = [p.num_pages for p in self.pools]
        if sum(sizes) >= 2**31:
            raise ValueError("a page space holds fewer than 2**31 pages")
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        for name in ("ref_counts", "cached", "low_priority", "_stack", "idle_tick", "_lru_prev", "_lru_next"):
            whole = np.concatenate([getattr(p, name) for p in self.pools])  # the pools' arrays, end to end
            setattr(self, name.lstrip("_"), whole)
            for pool, start, n in zip(self.pools, self.offsets.tolist(), sizes):  # every pool views its slice
                setattr(pool, name, whole[start : start + n])
        self.per_group = np.stack([p._per_group[:, p._slot] for p in self.pools], axis=1)  # the pools' counts
        self.tops, self.idle_low_floors = self.per_group[kernels.TOP], self.per_group[kernels.LOW_FLOOR]
        self.lru_lengths, self.low_idle = self.per_group[kernels.LRU_PAGES], self.per_group[kernels.LOW_IDLE_PAGES]
        self.skip_packing = self.per_group[kernels.SKIP_PACKING]
        self.ranked: list[int] = []  # the groups whose pool has a ranker (``PagePool.ranker`` keeps it)
        self.idle_counts = np.zeros(len(self.pools), dtype=np.int64)  # scratch of hold_outside and drop_units
        self._demote_arrays = (self.low_priority, self.lru_prev, self.lru_next, self.offsets, self.idle_low_floors,
                               self.low_idle)  # ``lru.demote_unit``'s arguments after ``listed``, and its compiled code
        self._demote_unit = kernels.entry_point(lru.demote_unit, (_NO_PAGES, *self._demote_arrays))
        self._join = kernels.entry_point(lru.join, (  # ``keyed_idle``'s kernel, for any int64 counts and pages
            self.idle_tick, self.low_priority, self.lru_prev, self.lru_next, self.lru_lengths, self.low_idle,
            self.idle_low_floors, self.offsets, _ANY_PAGES, _ANY_PAGES, _IDLE_CLOCK))
        # ``lru.drop_units``' arguments from ``ref`` to ``idle`` (its space's arrays), and its compiled code.
        self._drop_arrays = (self.ref_counts, self.cached, self.low_priority, self.lru_prev, self.lru_next, self.stack,
                             self.offsets, self.per_group, self.idle_counts)
        self._drop_units = kernels.entry_point(lru.drop_units, (_NO_PAGES, *self._drop_arrays, _NO_PAGES))
        self._told = np.empty(64, dtype=np.int64)  # drop_listed's ``told`` (scratch)
        self._low_ends = np.zeros(len(self.pools), dtype=np.int64)  # per LRU, its low-priority head's last page
        self._free_work = _NO_PAGES  # free_row's cells emptied, then its kernel's scratch (sized at the first call)
        self._free_row_entry = None  # free_row's compiled code (``kernels.entry_point``), at its first call
        self._free_args = (None,) * 14  # its arguments (``_free_call``)
        for g, pool in enumerate(self.pools):  # its counts become views of ``per_group``; what ``entry_pops`` reads
            pool._bind(self.per_group, g)
            pool._drop_args = (pool._entries.pop, g, pool.group_id)
            pool._lru_views = (memoryview(pool._lru_prev), memoryview(pool._lru_next))  # item access faster than
            pool._ref_view = memoryview(pool.ref_counts)  # the arrays'
            pool.space = self
            pool.ranker = pool.ranker  # into ``ranked``

    def load_kernels(self, tables, counters: np.ndarray) -> None:
        """Load (or compile) now, changing nothing, the kernels of this space's and each pool's methods."""
        self.keyed_idle(np.zeros(len(self.pools), dtype=np.int64), _NO_PAGES)
        self._free_call(tables, counters)
        self.drop_units([], [])  # ``lru.drop_units``, :meth:`drop_units`' kernel too
        self.first_in_line([])  # ``lru.first_in_line`` (the thrash guard's, first called late in a run)
        for pool in self.pools:
            pool.load_kernels()

    def hold_outside(self, local: np.ndarray, per_group: np.ndarray, limits: np.ndarray, held: np.ndarray) -> int:
        """Hold ``local`` (group-major) outside any request, idle pages leaving their LRUs (``lru.hold_leaving``)."""
        return lru.hold_leaving(local, per_group, self.offsets, limits, self.ref_counts, self.cached,
                                self.low_priority, held, self.idle_counts, self.lru_prev, self.lru_next, self.per_group)

    def release_outside(self, local: np.ndarray, per_group: np.ndarray, limits: np.ndarray, held: np.ndarray) -> int:
        """Drop holds of :meth:`hold_outside`, pages left without a holder freed or joining their LRU
        (``lru.release_placing``); then the rankers are told."""
        scratch = np.empty((2, local.size), dtype=np.int64)  # freed, keyed
        counts = np.zeros((2, self.offsets.size), dtype=np.int64)
        found = lru.release_placing(local, per_group, self.offsets, limits, self.ref_counts, self.cached, held,
                                    scratch[0], scratch[1], counts, self.stack, self.per_group, self.idle_tick,
                                    self.low_priority, self.lru_prev, self.lru_next, _IDLE_CLOCK)
        if found > 0 and self.ranked:
            self._tell_rankers(counts[1], scratch[1])
        return found

    def adopt(self, pools: Sequence[PagePool], keys: Sequence[Sequence[Hashable]],
              entries: Sequence[Sequence[tuple[int, ...]]]) -> None:
        """Record the entries ``entries[i][j]`` (held pages, none published) under ``keys[i][j]`` in ``pools[i]`` (this
        space's), whose pages are flagged keyed already, and low priority where they are (by a commit's compiled claim,
        ``kernels.claim_entries``): a commit's entries of every group in one call."""
        for pool, group_keys, group_entries in zip(pools, keys, entries):
            published, page_key = pool._entries, pool._page_key
            for key, entry in zip(group_keys, group_entries):
                published[key] = entry
                for page in entry:
                    page_key[page] = key

    def entry_maps(self, pools: Sequence[PagePool]) -> list[tuple[dict, list]]:
        """Per pool of ``pools`` (this space's), its entries by key and its pages' keys: what :meth:`adopt` writes
        (a commit that records its entries itself, as :meth:`adopt` does)."""
        return [(pool._entries, pool._page_key) for pool in pools]

    def demote(self, listed: list[int]) -> None:
        """Make each entry ``listed`` (its pool's index in this space, its page count, its pages) low priority in turn,
        in one compiled call (``lru.demote_unit``: ``PagePool.demote``, superseded checkpoints' units kept low; every
        page flagged low, the idle ones moved to the front of their LRU, the last listed first, entry after entry)."""
        self._demote_unit(np.array(listed, dtype=np.int64), *self._demote_arrays)

    def first_in_line(self, listed: list[int]) -> int:
        """Put pages next in line for eviction (``lru.first_in_line``; ``listed``: per group its index in this space,
        its page count, its pages): the idle normal-priority ones move to just behind their LRU's low-priority head, the
        last listed first, with its oldest normal-priority idle tick. Returns how many moved."""
        return int(lru.first_in_line(np.array(listed, dtype=np.int64), self.idle_tick, self.low_priority,
                                     self.lru_prev, self.lru_next, self.offsets, self._low_ends))

    def drop_units(self, pops: list[tuple[Callable, int, str]], keys: Sequence[Hashable],
                   cause: str = UNPUBLISHED) -> tuple[list[list[str]], list[int], list[tuple[Hashable, str, int]]]:
        """``pool.evict_entries(…, cause)`` of the ``keys`` each of the pools ``pops`` names (:meth:`entry_pops`')
        publishes, counting no eviction, all in one compiled pass (:meth:`drop_listed`: each pool's free stack ends as
        after its own ``evict_entries``). Returns per key, in order, the group ids of the pools it left (in ``pops``
        order); per pool its idle pages freed; and what the first pool's ``evict_entries`` returns of the keys it
        published. The entries are popped pool by pool, the last key first."""
        listed, left = [], []
        for key in reversed(keys):
            gone = []
            for pop, slot, gid in pops:
                pages = pop(key, None)
                if pages is not None:
                    listed += (slot, len(pages), *pages)
                    gone.append(gid)
            left.append(gone)
        told = self.drop_listed(listed)[:len(listed) // 2].tolist()  # per entry (2 numbers at least): 2 * idle + low
        low_cause, first, at, removals = EVICTED_LOW if cause == EVICTED else cause, pops and pops[0][2], 0, []
        for key, gone in zip(reversed(keys), left):  # the first pool's entry comes first in ``gone``
            if gone and gone[0] == first:
                removals.append((key, low_cause if told[at] & 1 else cause, told[at] >> 1))
            at += len(gone)
        left.reverse()
        removals.reverse()
        idle = self.idle_counts.tolist()
        return left, [idle[slot] for _, slot, _ in pops], removals

    def entry_pops(self, pools: Sequence[PagePool]) -> list[tuple[Callable, int, str]]:
        """Per pool of ``pools`` (this space's), what pops an entry from it (its entries' ``pop``), its index here and
        its group id: an entry popped with it is listed ((index, page count, pages), :meth:`drop_listed`'s)."""
        return [pool._drop_args for pool in pools]

    def drop_listed(self, listed: list[int]) -> np.ndarray:
        """What :meth:`drop_units` does to the pages of entries popped already (``listed``: each its pool's index,
        page count and pages, each pool's last entry first), in one compiled pass (``lru.drop_units``); per pool its
        idle pages freed in ``idle_counts``. Returns its scratch, per entry listed ``2 * idle pages + low``."""
        if 4 * len(listed) > self._told.size:  # ``lru.drop_units``' scratch
            self._told = np.empty(8 * len(listed), dtype=np.int64)
        self._drop_units(np.array(listed, dtype=np.int64), *self._drop_arrays, self._told)
        return self._told

    @property
    def join_args(self) -> tuple:
        """``kernels.run_step``'s and ``grant_step``'s arguments of ``keyed_idle``'s join (``kernels.join_idle``): an
        empty clock where a ranker is to be told (``keyed_idle`` joins then)."""
        return self.idle_tick, self.lru_prev, self.lru_next, _IDLE_CLOCK[:0] if self.ranked else _IDLE_CLOCK, \
            self.offsets

    def keyed_idle(self, per_group: np.ndarray, keyed: np.ndarray) -> None:
        """Keyed pages a release left idle (group after group, ``per_group[g]`` each; both int64) join their LRUs
        (``lru.join``); then the rankers are told."""
        self._join(self.idle_tick, self.low_priority, self.lru_prev, self.lru_next, self.lru_lengths, self.low_idle,
                   self.idle_low_floors, self.offsets, per_group, keyed, _IDLE_CLOCK)
        if self.ranked:
            self._tell_rankers(per_group, keyed)

    def free_row(self, tables, counters: np.ndarray, row: int, grain: int) -> bool:
        """``CacheManager.free``'s release of table row ``row`` in one call (``lru.free_row``; False, nothing changed,
        while ``counters`` show a ``grain`` to commit first), the cells emptied logged by the kernel where
        ``tables.log_at`` says (counted by ``tables.count_logged``). The rankers read the keyed pages left idle where
        the kernel lists them."""
        args = self._free_args  # kept while its arrays are the ones to pass (grown tables or counters: new ones)
        if args[1] is not tables.pages or args[2] is not tables.bounds or args[12] is not counters:
            args = self._free_args = self._free_call(tables, counters)
        log_at = tables.log_at(tables.row_cells)
        n = self._free_row_entry(*args, tables.logged, log_at, row, grain)
        if n < 0:
            return False
        if log_at >= 0:
            tables.count_logged(n)
        if self.ranked:
            g, work = len(self.pools), args[13]
            self._tell_rankers(work[g : 2 * g], work[3 * g + 3 * (tables.row_cells + tables.row_held_pages) :])
        return True

    def _free_call(self, tables, counters: np.ndarray) -> tuple:
        """:meth:`free_row`'s kernel arguments but the row and grain, the scratch sized for the tables' rows (3 per
        group, 4 per cell and held page of a row); the kernel's compiled code (``kernels.entry_point``) loaded at the
        first call."""
        size = 3 * len(self.pools) + 4 * (tables.row_cells + tables.row_held_pages)
        if self._free_work.size != size:
            self._free_work = np.empty(size, dtype=np.int64)
        args = (tables.geometry, tables.pages, tables.bounds, self.ref_counts, self.cached, self.stack, self.per_group,
                self.idle_tick, self.low_priority, self.lru_prev, self.lru_next, _IDLE_CLOCK, counters, self._free_work)
        if self._free_row_entry is None:  # the types every call passes: no type dispatch a call
            self._free_row_entry = kernels.entry_point(lru.free_row, (*args, tables.logged, 0, 0, 0))
        return args

    def _tell_rankers(self, per_group: np.ndarray, keyed: np.ndarray) -> None:
        """Each pool with a ranker whose pages just joined their LRU (logical order) tells it of the normal-priority
        ones and their tick (``lru.join`` drew one per group with pages, the last just now; plain loops)."""
        counts, starts, ticks, start = per_group.tolist(), [], [], 0
        tick = int(_IDLE_CLOCK[0]) - sum(1 for k in counts if k)
        for k in counts:  # where each pool's pages start, and the tick they got (each pool with some, the next)
            tick += 1 if k else 0
            starts.append(start)
            ticks.append(tick)
            start += k
        for g in self.ranked:
            if counts[g]:
                pool, pages = self.pools[g], keyed[starts[g] : starts[g] + counts[g]][::-1].tolist()
                low, page_key = pool.low_priority, pool._page_key
                pool.ranker.went_idle(pool.group_id, [(p, page_key[p]) for p in pages if not low[p]], ticks[g])
