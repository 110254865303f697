"""PagePool: null page, all-or-nothing allocation, LIFO reuse, ref counts, cached LRU."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from hybridkv.memory.pool import NULL_PAGE, PagePool, PageSpace
from hybridkv.runtime import kernels
import pool_ops
from pool_ops import PoolExhausted, allocate, borrow, decref, incref, publish, space_of


def _low_floor(space: PageSpace, g: int) -> int | None:
    """Group ``g``'s floor of its idle low-priority page ids while it has some (``kernels.low_before`` reads it)."""
    return int(space.per_group[kernels.LOW_FLOOR, g]) if space.per_group[kernels.LOW_IDLE_PAGES, g] > 0 else None


def _step_asks(space: PageSpace, sums: np.ndarray) -> int:
    """``kernels.room_groups`` as the step kernel asks it (no packing rule, no marks) for the allocations ``sums[1]``
    of plans that count no transient page, every group's ids from ``space.offsets``."""
    geometry = np.zeros((len(space.pools), kernels.GEOMETRY_COLUMNS), dtype=np.int64)
    geometry[:, kernels.ID_OFFSET] = space.offsets
    none = np.zeros(0, dtype=np.int64)
    return kernels.room_groups(geometry, np.zeros((3, len(space.pools), 0), dtype=np.int64),
                               np.zeros(len(space.pools), dtype=np.bool_), none, none, none,
                               np.zeros((2, len(space.pools), 0), dtype=np.int64), sums, space.stack, space.per_group,
                               space.ref_counts, space.cached, space.low_priority, None, None, 0, None, None)


def _tell_at_once(pool, log):
    """An ``evict_many`` for ``pool``: its ``evict_entries`` of a batch, the removals logged at once."""
    def evict_many(keys, cause):
        removals = pool.evict_entries(keys, cause)
        log.extend(removals)
        return sum(idle for _, _, idle in removals)

    return evict_many


def pool_state(pool: PagePool):
    return (
        pool.ref_counts.copy(),
        pool.num_free_pages,
        pool.num_clean_free_pages,
        pool.num_evictable_pages,
        pool.num_cached_pages,
        pool.counters.as_dict(),
        pool.peak_used_pages,
    )


def assert_same_state(before, after):
    assert np.array_equal(before[0], after[0])
    assert before[1:] == after[1:]


@pytest.mark.parametrize("shuffle_seed", [None, 3])
def test_every_page_but_the_null_page_is_handed_out_once(shuffle_seed):
    pool = PagePool("g", 8, shuffle_seed=shuffle_seed)
    assert pool.usable_pages == 7 and pool.num_free_pages == 7
    pages = np.concatenate([allocate(pool, 3), allocate(pool, 4)])
    assert sorted(pages.tolist()) == [1, 2, 3, 4, 5, 6, 7]
    assert NULL_PAGE not in pages.tolist()
    assert pool.ref_counts.tolist() == [0, 1, 1, 1, 1, 1, 1, 1]
    assert pool.num_free_pages == 0 and pool.num_used_pages == 7
    pool.check_invariants()


def test_fresh_pool_hands_out_ascending_ids():
    pool = PagePool("g", 8)
    assert allocate(pool, 3).tolist() == [1, 2, 3]
    assert allocate(pool, 2).tolist() == [4, 5]


def test_allocation_is_all_or_nothing():
    pool = PagePool("g", 8)
    allocate(pool, 5)
    before = pool_state(pool)
    with pytest.raises(PoolExhausted, match="need 3 pages, 2 free"):
        allocate(pool, 3)
    assert_same_state(before, pool_state(pool))  # a refused allocation changes nothing
    assert allocate(pool, 2).tolist() == [6, 7]
    assert pool.counters.allocated_pages == 7
    pool.check_invariants()


def test_allocate_zero_and_negative():
    pool = PagePool("g", 4)
    assert allocate(pool, 0).size == 0
    with pytest.raises(ValueError, match="negative"):
        allocate(pool, -1)
    assert pool.num_free_pages == 3


@pytest.mark.parametrize("num_pages, match", [(0, "at least 2 pages"), (1, "at least 2 pages"),
                                              (True, "must be an integer"), (2.5, "must be an integer"),
                                              (4.0, "must be an integer"), (-4, "at least 2 pages")])
def test_pool_size_is_validated(num_pages, match):
    with pytest.raises(ValueError, match=match):
        PagePool("g", num_pages)


def test_freed_pages_are_reused_first_lifo():
    pool = PagePool("g", 10)
    assert allocate(pool, 3).tolist() == [1, 2, 3]
    decref(pool, np.array([2]))
    assert allocate(pool, 1).tolist() == [2]  # freed page before never-used page 4
    # Freed in logical order [1, 3]: the first listed is on top, so reused first.
    decref(pool, np.array([1, 3]))
    assert allocate(pool, 2).tolist() == [1, 3]
    assert allocate(pool, 1).tolist() == [4]
    decref(pool, np.array([4]))
    decref(pool, np.array([2]))
    assert allocate(pool, 2).tolist() == [2, 4]  # last freed first
    assert pool.counters.released_pages == 5
    pool.check_invariants()


def test_shuffled_pool_is_deterministic_and_non_contiguous():
    a = allocate(PagePool("g", 65, shuffle_seed=7), 64)
    b = allocate(PagePool("g", 65, shuffle_seed=7), 64)
    c = allocate(PagePool("g", 65, shuffle_seed=8), 64)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()
    assert sorted(a.tolist()) == list(range(1, 65))
    assert np.any(np.diff(a) != 1)  # not handed out as a contiguous run


def test_borrow_and_release():
    pool = PagePool("g", 6)
    p, q = allocate(pool, 2).tolist()
    incref(pool, [p])
    assert pool.ref_counts[p] == 2
    decref(pool, np.array([p]))
    assert pool.ref_counts[p] == 1 and pool.num_free_pages == 3
    assert pool.counters.released_pages == 0
    decref(pool, np.array([p, q]))
    assert pool.ref_counts[[p, q]].tolist() == [0, 0]
    assert pool.num_free_pages == 5 and pool.num_used_pages == 0
    assert pool.counters.released_pages == 2
    pool.check_invariants()


def test_borrowing_a_free_page_raises():
    pool = PagePool("g", 4)
    with pytest.raises(ValueError, match="free"):
        incref(pool, [2])
    assert pool.ref_counts.tolist() == [0, 0, 0, 0]
    pool.check_invariants()


def test_peak_used_pages():
    pool = PagePool("g", 10)
    pages = allocate(pool, 6)
    decref(pool, pages[:4])
    allocate(pool, 1)
    assert pool.num_used_pages == 3 and pool.peak_used_pages == 6


def test_publish_lookup_unpublish():
    pool = PagePool("g", 8)
    removed = []
    pool.on_removed = lambda key, cause, idle: removed.append(key)
    a, b, c = allocate(pool, 3).tolist()
    assert publish(pool, "k", [a, b]) is True
    assert pool.lookup("k") == (a, b)
    assert pool.lookup("other") is None
    assert publish(pool, "k", [c]) is False  # key exists: nothing changes
    assert not pool.cached[c]
    with pytest.raises(ValueError, match="not a held, unpublished page"):
        publish(pool, "k2", [a])  # already keyed
    with pytest.raises(ValueError, match="not a held, unpublished page"):
        publish(pool, "k3", [5])  # free page
    with pytest.raises(ValueError, match="not a held, unpublished page"):
        publish(pool, "k4", [NULL_PAGE])
    assert pool.num_cached_pages == 2
    # Released while keyed: evictable, still counted as available.
    decref(pool, np.array([a, b]))
    assert pool.num_evictable_pages == 2 and pool.num_clean_free_pages == 4
    assert pool.num_free_pages == 6 and pool.num_used_pages == 1
    # A hit borrows one of them back.
    incref(pool, [a])
    assert pool.ref_counts[a] == 1 and pool.num_evictable_pages == 1
    pool.check_invariants()
    pool.unpublish("k")
    assert removed == ["k"]
    assert pool.lookup("k") is None and pool.num_cached_pages == 0
    assert pool.ref_counts[a] == 1  # still held, just no longer keyed
    assert pool.num_evictable_pages == 0 and pool.num_clean_free_pages == 5
    assert allocate(pool, 1).tolist() == [b]  # the unheld page went to the free stack top
    pool.check_invariants()


def test_cached_pages_are_evicted_only_when_the_free_stack_is_empty():
    pool = PagePool("g", 6)
    pages = allocate(pool, 2)
    publish(pool, "k", pages.tolist())
    decref(pool, pages)
    assert allocate(pool, 3).tolist() == [3, 4, 5]
    assert pool.lookup("k") is not None and pool.counters.evicted_pages == 0
    assert allocate(pool, 1).tolist() == [pages[0]]  # the whole entry is unpublished
    assert pool.lookup("k") is None
    assert pool.counters.evicted_pages == 2
    assert pool.num_clean_free_pages == 1
    pool.check_invariants()


def test_evictable_lru_evicts_a_chain_tail_before_its_head():
    pool = PagePool("g", 9)
    chain = allocate(pool, 3).tolist()  # blocks 0, 1, 2 of one prefix, one key each
    other = allocate(pool, 2).tolist()
    for i, page in enumerate(chain):
        publish(pool, ("chain", i), [page])
    for i, page in enumerate(other):
        publish(pool, ("other", i), [page])
    decref(pool, np.array(other))  # released earlier: least recently used
    decref(pool, np.array(chain))  # released in logical order
    assert pool.num_evictable_pages == 5
    assert allocate(pool, 3).tolist() == [6, 7, 8]  # clean pages first
    order = [allocate(pool, 1)[0] for _ in range(5)]
    assert order == [other[1], other[0], chain[2], chain[1], chain[0]]
    assert pool.counters.evicted_pages == 5
    pool.check_invariants()


def test_unpublish_every_entry_keeps_held_pages():
    pool = PagePool("g", 6)
    pages = allocate(pool, 2).tolist()
    publish(pool, "a", [pages[0]])
    publish(pool, "b", [pages[1]])
    decref(pool, np.array([pages[0]]))
    for key in pool.entry_keys():  # as PrefixCache.clear does
        pool.unpublish(key)
    assert pool.num_cached_pages == 0 and pool.num_evictable_pages == 0
    assert pool.ref_counts[pages[1]] == 1 and pool.num_clean_free_pages == 4
    pool.check_invariants()


def test_check_invariants_catches_corruption():
    pool = PagePool("g", 6)
    allocate(pool, 2)
    pool.check_invariants()
    pool.ref_counts[5] = 1  # a free page with a reference
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool.ref_counts[5] = 0
    pool.ref_counts[1] = 0  # a held page lost
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_invariants()


def test_refused_borrow_changes_nothing():
    pool = PagePool("g", 6)
    a, b = allocate(pool, 2).tolist()
    publish(pool, "k", [a])
    decref(pool, np.array([a, b]))  # a: evictable, b: free
    before = pool_state(pool)
    with pytest.raises(ValueError, match="free"):
        incref(pool, [a, b])
    assert_same_state(before, pool_state(pool))
    pool.check_invariants()


# --- lowest-first pools (shared arena) --------------------------------------------------
def test_lowest_first_hands_out_the_lowest_free_ids_whatever_the_release_order():
    pool = PagePool("g", 10, lowest_first=True)
    a = allocate(pool, 6)
    assert a.tolist() == [1, 2, 3, 4, 5, 6]
    decref(pool, np.array([5, 2]))
    decref(pool, np.array([6]))
    assert pool.num_free_pages == 6 and pool.num_clean_free_pages == 6  # pending releases count
    # A LIFO pool would hand out 6 first; lowest-first gives 2, 5, 6, then 7.
    assert allocate(pool, 4).tolist() == [2, 5, 6, 7]
    pool.check_invariants()


def test_lowest_first_released_pages_merge_into_the_free_order():
    """Released pages are reused in id order with the free stack's, whenever they were released."""
    pool = PagePool("g", 64, lowest_first=True)
    allocate(pool, 40)  # 1..40 held, 41.. on the stack
    decref(pool, np.array([1, 2, 3]))
    assert allocate(pool, 1).tolist() == [1]
    decref(pool, np.array([30]))
    assert allocate(pool, 1).tolist() == [2]
    assert pool.free_page_ids()[-2:].tolist() == [30, 3]  # top of the stack: the lowest id
    assert allocate(pool, 2).tolist() == [3, 30]
    assert allocate(pool, 2).tolist() == [41, 42]
    pool.check_invariants()


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(0, 2**31)), min_size=1, max_size=60),
       highest=st.integers(0, 3))
def test_lowest_first_matches_a_sorted_set_model(ops, highest):
    """Whatever mix of releases (kept pending) and allocations (small ones sort only
    the pending pages with the stack's lowest), an allocation hands out the lowest
    free ids in ascending order, or, with ``highest``, the highest ones last."""
    pool = PagePool("g", 300, lowest_first=True)
    free, held = set(range(1, 300)), []
    for op, n, seed in ops:
        if op == 2:
            n = min(n, len(free))
            if n == 0:
                continue
            out = allocate(pool, n)
            assert out.tolist() == sorted(free)[:n]
            free.difference_update(out.tolist())
            held.extend(out.tolist())
        elif op == 1:
            n = min(n, len(free))
            if n == 0:
                continue
            h = min(highest, n)
            out = allocate(pool, n, highest=h).tolist()
            ordered = sorted(free)
            assert out == ordered[: n - h] + (ordered[len(ordered) - h :] if h else [])
            free.difference_update(out)
            held.extend(out)
        elif held:
            rng = np.random.default_rng(seed)
            rng.shuffle(held)
            gone, held = held[:n], held[n:]
            decref(pool, np.array(gone))
            free.update(gone)
        assert pool.num_free_pages == len(free)
    pool.check_invariants()
    assert sorted(pool.free_page_ids().tolist()) == sorted(free)


def test_lowest_first_eviction_and_revoke_see_pending_releases():
    pool = PagePool("g", 6, lowest_first=True)
    pages = allocate(pool, 5)
    assert publish(pool, "k", pages[:2])
    decref(pool, pages)  # 1, 2 evictable; 3, 4, 5 pending free
    assert pool.num_free_pages == 5 and pool.num_evictable_pages == 2
    # 5 pages: the 3 free ones are not enough alone, so the cached entry is evicted.
    assert allocate(pool, 5).tolist() == [1, 2, 3, 4, 5]
    assert pool.counters.evicted_pages == 2 and pool.num_cached_pages == 0
    decref(pool, np.array([4, 5]))
    pool.revoke(np.array([4, 5]))  # pending releases can be revoked
    assert pool.usable_pages == 3 and sorted(pool.free_page_ids().tolist()) == []
    pool.check_invariants()
    with pytest.raises(ValueError, match="no request holds"):
        pool.revoke(np.array([4]))  # no longer granted


def test_grant_starts_empty_pools_and_shuffles_grants_when_seeded():
    pool = PagePool("g", 9, granted=False)
    assert pool.usable_pages == 0 and pool.num_free_pages == 0
    with pytest.raises(PoolExhausted):
        allocate(pool, 1)
    pool.grant(np.array([4, 5, 6]))
    assert allocate(pool, 3).tolist() == [4, 5, 6]  # first listed on top
    shuffled = PagePool("g", 9, granted=False, shuffle_seed=3)
    shuffled.grant(np.arange(1, 9))
    out = allocate(shuffled, 8).tolist()
    assert sorted(out) == list(range(1, 9)) and out != list(range(1, 9))
    pool.check_invariants()


@pytest.mark.parametrize("lowest_first", [False, True])
def test_an_eviction_takes_idle_low_priority_entries_beyond_its_need(lowest_first):
    """Evicting for an allocation also frees the idle low-priority entries next in the
    LRU, up to 16 pages beyond the need (so a run of small allocations does not evict
    once each), but never a normal entry the allocation does not need."""
    pool = PagePool("g", 1 + 22 + 4, lowest_first=lowest_first)
    for i in range(11):  # 11 low-priority entries of 2 pages (highest ids: no packing)
        pages = allocate(pool, 2, highest=2)
        assert publish(pool, ("low", i), pages.tolist(), low_priority=True)
        decref(pool, pages)
    normal = allocate(pool, 4, highest=4)
    assert publish(pool, "normal", normal[:2].tolist()) and publish(pool, "normal2", normal[2:].tolist())
    decref(pool, normal)
    assert pool.num_clean_free_pages == 0 and pool.num_low_priority_idle_pages == 22
    # Needs 2 pages; low entries go until 2 + 16 pages are free (both pages released again
    # at the next step: a lowest-first pool does not pack for them, see the arena tests).
    held = allocate(pool, 2, highest=2)
    assert pool.counters.evicted_pages == 18 and pool.num_low_priority_idle_pages == 4
    assert pool.num_clean_free_pages == 16
    assert pool.lookup("normal") is not None and pool.lookup("normal2") is not None
    # 5 pages beyond the clean ones: the last 2 low entries, then one normal entry (the
    # tail of the two, released last, goes first); the extra stops at a normal one.
    more = allocate(pool, 16 + 5)
    assert pool.counters.evicted_pages == 18 + 4 + 2 and pool.num_low_priority_idle_pages == 0
    assert pool.lookup("normal2") is None and pool.lookup("normal") is not None
    decref(pool, np.concatenate([held, more]))
    pool.check_invariants()


def test_lowest_first_reuses_idle_low_priority_pages_in_id_order():
    pool = PagePool("g", 10, lowest_first=True)
    low, normal = allocate(pool, 2), allocate(pool, 2)  # 1, 2 and 3, 4
    assert publish(pool, "low", low, low_priority=True) and publish(pool, "normal", normal)
    decref(pool, low)
    decref(pool, normal)
    # Free ids are 5..9. Ids 1, 2 are idle, low priority and lower, so their entry is
    # evicted and they are reused first; the normal entry (3, 4) stays cached even though
    # its ids are lower than 5: only low-priority pages count as free for the order.
    assert allocate(pool, 3).tolist() == [1, 2, 5]
    assert pool.lookup("low") is None and pool.lookup("normal") == (3, 4)
    assert pool.counters.evicted_pages == 2
    pool.check_invariants()


def _entries(pool):
    return {key: pool.lookup(key) for key in pool.entry_keys()}


@pytest.mark.parametrize("lowest_first", [False, True])
def test_an_allocation_evicting_several_entries_frees_them_as_one_by_one(lowest_first):
    """Worked by hand: entries are evicted in LRU order until enough pages are idle,
    and a LIFO pool's stack ends as if each had been unpublished in turn."""
    pool = PagePool("g", 16, lowest_first=lowest_first)
    removed = []
    pool.on_removed = lambda key, cause, idle: removed.append(key)
    held = allocate(pool, 15)
    for i in range(5):
        publish(pool, ("e", i), held[3 * i : 3 * i + 3].tolist())  # e0 = (1, 2, 3), ...
    decref(pool, held[::-1].copy())  # all idle; listed last = LRU front: e0 first
    # 7 pages: e0, e1, e2 go (9 pages). LIFO: e2's pages on top, then e1's, then e0's.
    expected = [7, 8, 9, 4, 5, 6, 1] if not lowest_first else [1, 2, 3, 4, 5, 6, 7]
    assert allocate(pool, 7).tolist() == expected
    assert removed == [("e", 0), ("e", 1), ("e", 2)]
    assert pool.counters.evicted_pages == 9
    assert allocate(pool, 2).tolist() == ([2, 3] if not lowest_first else [8, 9])
    assert pool.lookup(("e", 3)) == (10, 11, 12) and pool.num_evictable_pages == 6
    pool.check_invariants()


def test_allocate_highest_takes_the_top_free_ids_in_lowest_first_pools():
    pool = PagePool("g", 12, lowest_first=True)  # ids 1..11 free
    assert allocate(pool, 5, highest=3).tolist() == [1, 2, 9, 10, 11]
    assert allocate(pool, 2).tolist() == [3, 4]
    decref(pool, np.array([10, 1]))  # pending releases are merged first
    assert allocate(pool, 3, highest=1).tolist() == [1, 5, 10]
    assert pool.free_page_ids().tolist()[::-1] == [6, 7, 8]
    with pytest.raises(ValueError, match="highest must lie in"):
        allocate(pool, 1, highest=2)
    pool.check_invariants()
    lifo = PagePool("g", 6)  # LIFO pools have no order to choose: highest is ignored
    assert allocate(lifo, 3, highest=2).tolist() == [1, 2, 3]


def _pool_state(pool):
    pool.check_invariants()  # merges pending releases, so both sides compare sorted stacks
    return (pool.ref_counts.tolist(), pool.free_page_ids().tolist(), pool.evictable_page_ids().tolist(),
            pool.num_low_priority_idle_pages, pool.counters.as_dict(),
            pool.peak_used_pages)


def two_page_spaces(data, lowest_first):
    """Drawn pool sizes, and two sides of (pools of those sizes, their PageSpace): one for
    the path under test, one for the pool-by-pool reference."""
    sizes = data.draw(st.lists(st.integers(2, 24), min_size=1, max_size=5), label="sizes")
    sides = []
    for _ in range(2):
        pools = [PagePool(f"g{i}", n, lowest_first=lowest_first) for i, n in enumerate(sizes)]
        sides.append((pools, PageSpace(pools)))
    return sizes, sides


def draw_held_pages(data, i, n):
    """For pool ``i`` of ``n`` pages: how many pages are held, and for each whether it is
    keyed and whether low priority."""
    held = data.draw(st.integers(0, n - 1), label=f"held{i}")
    keyed = data.draw(st.lists(st.booleans(), min_size=held, max_size=held), label=f"keyed{i}")
    low = data.draw(st.lists(st.booleans(), min_size=held, max_size=held), label=f"low{i}")
    return held, keyed, low


@settings(max_examples=60, deadline=None)
@given(data=st.data(), lowest_first=st.booleans(), twice=st.booleans())
def test_one_release_of_every_group_is_a_release_pool_by_pool(data, lowest_first, twice):
    """``released`` (pool_ops: ``kernels.release_into``, then the keyed pages left idle join) of every group's
    pages (some keyed, some low priority, some with a second holder, listed twice with ``twice``) in one call
    leaves each pool as releasing its own pages alone would (what a release of held pages runs)."""

    sizes, sides = two_page_spaces(data, lowest_first)
    any_shared = data.draw(st.booleans(), label="any_shared")  # False: the fused path itself
    script = []
    for i, n in enumerate(sizes):
        held, keyed, low = draw_held_pages(data, i, n)
        shared = data.draw(st.lists(st.booleans(), min_size=held, max_size=held), label=f"shared{i}")
        shared = [x and any_shared for x in shared]
        order = data.draw(st.permutations(range(held)), label=f"order{i}")
        script.append((held, keyed, low, shared, order))
    for pools, _ in sides:
        for pool, (held, keyed, low, shared, _order) in zip(pools, script):
            pages = allocate(pool, held).tolist()
            for j, page in enumerate(pages):
                if keyed[j]:
                    publish(pool, ("k", page), [page], low_priority=low[j])
                if shared[j]:
                    incref(pool, [page])
    (pools_a, space), (pools_b, _) = sides
    released = [np.asarray([p for p in range(1, n) if pools_a[i].ref_counts[p] > 0], dtype=np.int64)[
        list(script[i][4])] for i, n in enumerate(sizes)]
    if twice:  # both holders of a shared page release it in the same call
        released = [np.concatenate([r, r[pools_a[i].ref_counts[r] > 1]]) for i, r in enumerate(released)]
    counts = [r.size for r in released]
    pages = np.concatenate(released)
    pool_ops.released(space, np.array(counts), pages)
    for pool, pages in zip(pools_b, released):
        decref(pool, pages)
    for a, b in zip(pools_a, pools_b):
        assert _pool_state(a) == _pool_state(b)
    floors = [[_low_floor(side_space, g) for g in range(len(sizes))] for _, side_space in sides]
    assert floors[0] == floors[1]  # the packing floors the joining low-priority pages lowered


def _entries_state(pool: PagePool, keys) -> tuple:
    return ({k: pool.lookup(k) for k in keys}, pool.cached.tolist(), pool.low_priority.tolist(),
            pool.num_cached_pages)


def _claim(space: PageSpace, entries: list, want: list[int]) -> tuple[int, list[int]]:
    """``kernels.claim_entries`` over ``entries`` (group, key, pages) of ``space``'s pools."""
    geometry = np.zeros((len(space.pools), kernels.GEOMETRY_COLUMNS), dtype=np.int64)
    geometry[:, kernels.ID_OFFSET] = space.offsets
    layout, at = [], 0
    for g, _, pages in entries:
        layout.append((g, at, len(pages)))
        at += len(pages)
    flat = np.asarray([p for _, _, pages in entries for p in pages], dtype=np.int64)
    status = np.ones(len(entries), dtype=np.int8)  # every entry live
    limits = np.asarray([p.num_pages for p in space.pools], dtype=np.int64)
    bad = kernels.claim_entries(geometry, np.asarray(layout, dtype=np.int64).reshape(-1, 3), flat,
                                np.asarray(want, dtype=np.int8), space.ref_counts, space.cached, space.low_priority,
                                limits, status)
    return int(bad), [int(x == 2) for x in status.tolist()]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.lists(st.integers(1, 11), min_size=2, max_size=2, unique=True),
                          st.integers(0, 2)), max_size=8),
       st.lists(st.integers(0, 5), max_size=3))
def test_claim_then_adopt_is_publish_entry_by_entry(entries, earlier):
    """A commit's publication (``kernels.claim_entries`` over two pools of a page space,
    then ``PageSpace.adopt`` of the claimed entries) against the reference, ``publish``
    entry by entry: an entry whose key is new in its group (the commit's ``want`` is 0
    otherwise) and none of whose pages carries a key is published, low priority when
    wanted so. Same entries, flags and claimed entries; pages may repeat across entries."""
    sides = []
    for _ in range(2):
        pools = [PagePool(f"g{i}", 12) for i in range(2)]
        space = PageSpace(pools)
        for pool in pools:
            allocate(pool, 11)
            for k in earlier:  # entries already there: keys published on pages 10, 11
                publish(pool, k, [10 + k % 2]) if not pool.cached[10 + k % 2] else None
        sides.append((pools, space))
    listed = [(g, 100 + i, pages) for i, (g, pages, _) in enumerate(entries)]  # keys new to both groups
    want = [code for _, _, code in entries]
    (fast, space), (ref, _) = sides
    bad, claimed = _claim(space, listed, want)
    assert bad == -1
    by_group = [([], []) for _ in fast]  # the claimed entries, in one ``PageSpace.adopt`` call
    for i, (g, key, pages) in enumerate(listed):
        if claimed[i]:
            by_group[g][0].append(key), by_group[g][1].append(tuple(pages))
    space.adopt(fast, [keys for keys, _ in by_group], [pages for _, pages in by_group])
    expected = [int(bool(code) and publish(ref[g], key, pages, low_priority=code == 2)
                    if code and not any(ref[g].cached[p] for p in pages) else 0)
                for (g, key, pages), code in zip(listed, want)]
    assert claimed == expected
    keys = list(range(6)) + [key for _, key, _ in listed]
    for a, b in zip(fast, ref):
        assert _entries_state(a, keys) == _entries_state(b, keys)
        a.check_invariants()


def test_claim_refuses_a_page_not_held_and_changes_nothing():
    pools = [PagePool("g", 8), PagePool("h", 8)]
    space = PageSpace(pools)
    a, b = allocate(pools[1], 2).tolist()
    for bad in (7, NULL_PAGE, 8):
        listed = [(1, "k", [b]), (1, "m", [a, bad])]
        assert _claim(space, listed, [1, 2]) == (2, [0, 0])
        assert not space.cached.any() and not space.low_priority.any()
    assert _claim(space, [(1, "k", [b]), (1, "m", [a, 7])], [1, 0])[0] == -1  # unwanted pages are not checked


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_batched_low_priority_evictions_are_the_one_by_one_evictions(data):
    """``evict_many`` set (a state pool of a prefix cache) against evicting each idle
    low-priority entry at once: the same entries leave, in the same order, with the same
    causes and idle counts, and the pools end alike (free order, LRU, counters)."""
    n = data.draw(st.integers(24, 60), label="pages")
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=2, max_size=10), label="entry sizes")
    kinds = st.sampled_from(["low", "normal", "plain"])  # plain: not published, its released pages go free
    plan = [(size, data.draw(kinds, label="kind"), data.draw(st.integers(0, 2), label="held pages"))
            for size in sizes]
    spare = data.draw(st.integers(0, 6), label="normal pages held")
    want = data.draw(st.integers(1, n // 2), label="allocation")
    pools, calls = [], []
    for batch in (False, True):
        pool = PagePool("g", n, lowest_first=True)
        log = []
        pool.on_removed = lambda key, cause, idle, log=log: log.append((key, cause, idle))
        if batch:  # told of a batch's removals at once, in order
            pool.evict_many = _tell_at_once(pool, log)
        for i, (size, kind, held) in enumerate(plan):
            if size > pool.num_clean_free_pages:
                break
            pages = allocate(pool, size)
            if kind != "plain":
                publish(pool, i, pages.tolist(), low_priority=kind == "low")
            decref(pool, pages[held:].copy())  # the first ``held`` pages stay held
        allocate(pool, min(spare, pool.num_clean_free_pages))
        got = allocate(pool, want).tolist() if want <= pool.num_free_pages else None
        pools.append((got, pool.free_page_ids().tolist(), pool.evictable_page_ids().tolist(),
                      sorted(pool.entry_keys()), pool.num_low_priority_idle_pages, pool.counters.evicted_pages))
        calls.append(log)
        pool.check_invariants()
    assert pools[0] == pools[1]
    assert calls[0] == calls[1]


@pytest.mark.parametrize("batch", [False, True])
def test_ids_a_low_priority_eviction_frees_count_as_free_for_the_next(batch):
    """Worked by hand: free ids 9, 10, 12-15, idle low-priority entries at 1 ("a") and 11
    ("b"). Three pages: the third lowest free id is 12, so "a" goes; then 1, 9, 10 are the
    three lowest, 11 is not below them and "b" stays."""
    pool = PagePool("g", 16, lowest_first=True)
    pool.on_removed = lambda key, cause, idle: None  # one entry at a time
    if batch:
        pool.evict_many = _tell_at_once(pool, [])
    a, plain, b = allocate(pool, 1), allocate(pool, 9), allocate(pool, 1)  # 1; 2-10; 11
    publish(pool, "a", a.tolist(), low_priority=True)
    publish(pool, "b", b.tolist(), low_priority=True)
    decref(pool, np.concatenate([a, b, plain[-2:]]))  # 9, 10 go free
    assert allocate(pool, 3).tolist() == [1, 9, 10]
    assert pool.lookup("a") is None and pool.lookup("b") == (11,)
    assert pool.counters.evicted_pages == 1
    pool.check_invariants()


@settings(max_examples=60, deadline=None)
@given(data=st.data(), lowest_first=st.booleans())
def test_a_hits_holds_in_one_call_are_borrowing_pool_by_pool(data, lowest_first):
    """A prefix hit's holds (``borrow``: ``lru.take_holds``, as ``lru.borrow_row`` takes them) of every group's
    pages (held ones, idle keyed ones, some low priority) in one call leave each pool as borrowing its own pages
    alone would; with a free page listed they are refused whole, nothing changed."""

    sizes, sides = two_page_spaces(data, lowest_first)
    script = []
    for i, n in enumerate(sizes):
        held, keyed, low = draw_held_pages(data, i, n)
        idle = data.draw(st.lists(st.booleans(), min_size=held, max_size=held), label=f"idle{i}")
        script.append((held, keyed, low, idle))
    for pools, _ in sides:
        for pool, (held, keyed, low, idle) in zip(pools, script):
            pages = allocate(pool, held).tolist()
            for j, page in enumerate(pages):
                if keyed[j]:
                    publish(pool, ("k", page), [page], low_priority=low[j])
            decref(pool, np.asarray([p for j, p in enumerate(pages) if idle[j]], dtype=np.int64))
    (pools_a, space), (pools_b, _) = sides
    with_free = data.draw(st.booleans(), label="with_free")
    borrowed = []
    for i, pool in enumerate(pools_a):
        usable = [p for p in range(1, sizes[i]) if pool.ref_counts[p] > 0 or pool.cached[p]]
        if with_free:
            usable += pool.free_page_ids().tolist()
        pages = data.draw(st.lists(st.sampled_from(usable), unique=True) if usable else st.just([]), label=f"b{i}")
        borrowed.append(np.asarray(pages, dtype=np.int64))
    counts = np.asarray([b.size for b in borrowed], dtype=np.int64)
    refused = any((pool.ref_counts[b] == 0).any() and not pool.cached[b[pool.ref_counts[b] == 0]].all()
                  for pool, b in zip(pools_a, borrowed))
    before = [_pool_state(a) for a in pools_a]
    if refused:
        with pytest.raises(ValueError, match="is free, cannot be borrowed"):
            borrow(space, np.concatenate(borrowed), counts)
        assert [_pool_state(a) for a in pools_a] == before
        return
    borrow(space, np.concatenate(borrowed), counts)
    for pool, pages in zip(pools_b, borrowed):
        incref(pool, pages)
    for a, b in zip(pools_a, pools_b):
        assert _pool_state(a) == _pool_state(b)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), lowest_first=st.booleans())
def test_page_space_drop_units_is_one_key_after_another(data, lowest_first):
    """``PageSpace.drop_units`` of a unit (pages in several groups), then of a second key
    published in every group, in one call (as an eviction takes units: ``PrefixCache._evict_many``)
    against ``evict_entries([key])`` in each of the pools that publish the key, key after
    key: entries of 0-3 pages, low priority or not, some pages held. It names the groups
    each left, in order; the same free stacks (order included), LRU, idle low-priority
    counts, flags and entries."""
    sizes = data.draw(st.lists(st.integers(9, 24), min_size=1, max_size=4), label="sizes")
    picked = data.draw(st.lists(st.sampled_from(range(len(sizes))), unique=True, min_size=1), label="unit groups")
    script = [data.draw(st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 3), st.integers(0, 4)),
                        label=f"g{i}: pages, low, held, free before") for i in range(len(sizes))]
    sides = []
    for _ in range(2):
        pools = [PagePool(f"g{i}", n, lowest_first=lowest_first) for i, n in enumerate(sizes)]
        space = PageSpace(pools)
        for i, (pool, (size, low, held, free)) in enumerate(zip(pools, script)):
            pages = allocate(pool, size + 1 + free).tolist()
            if i in picked:
                publish(pool, "unit", pages[:size], low_priority=low)
            publish(pool, "other", pages[size : size + 1], low_priority=not low)
            decref(pool, np.asarray(pages[held:size] + pages[size + 1 :], dtype=np.int64))
        sides.append((pools, space))
    (pools_a, space), (pools_b, _) = sides
    assert space.drop_units(space.entry_pops(pools_a), ["unit", "other"])[0] == [[f"g{i}" for i in sorted(picked)],
                                                               [f"g{i}" for i in range(len(sizes))]]
    for i in picked:
        assert pools_b[i].evict_entries(["unit"])[0][0] == "unit"
    for pool in pools_b:
        assert pool.evict_entries(["other"])[0][0] == "other"
    for a, b in zip(pools_a, pools_b):
        a.check_invariants()
        assert (a.free_page_ids().tolist(), a.evictable_page_ids().tolist(), a.num_low_priority_idle_pages,
                a.num_free_pages) == (b.free_page_ids().tolist(), b.evictable_page_ids().tolist(),
                                      b.num_low_priority_idle_pages, b.num_free_pages)
        assert _entries_state(a, ["unit", "other"]) == _entries_state(b, ["unit", "other"])


def _two_scripted_spaces(data, lowest_first: bool, other: bool = False):
    """Pool sizes, keys and two identical page spaces whose pools publish a drawn script of entries (per pool
    and key: published or not, 0-3 pages, low priority or not, how many of them stay held), the rest of their
    pages idle; ``other``: each pool also publishes one idle page under "other" beside an unkeyed idle page."""
    sizes = data.draw(st.lists(st.integers(20, 40), min_size=1, max_size=4), label="sizes")
    keys = [f"k{j}" for j in range(data.draw(st.integers(0, 4), label="keys"))]
    script = [[data.draw(st.tuples(st.booleans(), st.integers(0, 3), st.booleans(), st.integers(0, 3)),
                         label=f"g{i} {key}: published, pages, low, held") for key in keys]
              for i in range(len(sizes))]
    sides = []
    for _ in range(2):
        pools = [PagePool(f"g{i}", n, lowest_first=lowest_first) for i, n in enumerate(sizes)]
        space = PageSpace(pools)
        for pool, entries in zip(pools, script):
            idle = []
            for key, (published, size, low, held) in zip(keys, entries):
                if published:
                    pages = allocate(pool, size).tolist()
                    publish(pool, key, pages, low_priority=low)
                    idle += pages[held:]
            if other:
                extra = allocate(pool, 2).tolist()
                publish(pool, "other", extra[:1])
                idle += extra
            decref(pool, np.asarray(idle, dtype=np.int64))
        sides.append((pools, space))
    return sizes, keys, sides


@settings(max_examples=80, deadline=None)
@given(data=st.data(), lowest_first=st.booleans())
def test_page_space_drop_units_is_evict_entries_pool_by_pool(data, lowest_first):
    """``PageSpace.drop_units`` (one compiled pass over several keys' entries in several
    groups) against ``evict_entries`` of the keys each pool publishes, pool by pool: entries
    of 0-3 pages, low priority or not, some pages held, some keys missing from some groups,
    one entry left published in each group. Per key the groups it left, per pool the idle
    pages freed (as ``evict_entries`` tells them); the same free stacks (order included),
    LRU, idle low-priority counts, flags and entries."""
    _, keys, sides = _two_scripted_spaces(data, lowest_first, other=True)
    (pools_a, space), (pools_b, _) = sides
    cause = data.draw(st.sampled_from(["unpublished", "evicted"]), label="cause")
    left, idle, told = space.drop_units(space.entry_pops(pools_a), keys, cause)
    want_left, want_idle, want_told = [[] for _ in keys], [], None
    for pool in pools_b:
        present = [key for key in keys if pool.lookup(key) is not None]
        removals = pool.evict_entries(present, cause) if present else []
        want_told = removals if want_told is None else want_told  # the first pool's
        want_idle.append(sum(n for _, _, n in removals))
        for key, _, _ in removals:
            want_left[keys.index(key)].append(pool.group_id)
    assert (left, idle, told) == (want_left, want_idle, want_told)
    for a, b in zip(pools_a, pools_b):
        a.check_invariants()
        assert (a.free_page_ids().tolist(), a.evictable_page_ids().tolist(), a.num_low_priority_idle_pages,
                a.num_free_pages) == (b.free_page_ids().tolist(), b.evictable_page_ids().tolist(),
                                      b.num_low_priority_idle_pages, b.num_free_pages)
        assert _entries_state(a, keys + ["other"]) == _entries_state(b, keys + ["other"])


@settings(max_examples=80, deadline=None)
@given(data=st.data(), lowest_first=st.booleans())
def test_page_space_drop_listed_is_one_key_after_another(data, lowest_first):
    """``PageSpace.drop_listed`` of keys popped with ``PageSpace.entry_pops``, each over the
    pools in its own order (as ``PrefixCache._supersede`` pops a superseded unit, its group
    first), the last key listed first (as ``PrefixCache._let_go``), against
    ``evict_entries([key])`` in each pool that publishes it, key after key: entries of 0-3
    pages, low priority or not, some pages held, some keys missing from some groups. The
    same free stacks (order included), LRU, idle low-priority counts, flags and entries."""
    sizes, keys, sides = _two_scripted_spaces(data, lowest_first)
    orders = [data.draw(st.permutations(range(len(sizes))), label=f"{key}: pools") for key in keys]
    (pools_a, space), (pools_b, _) = sides
    listed = []
    for key, order in zip(keys, orders):
        popped = []
        for pop, slot, _ in space.entry_pops([pools_a[i] for i in order]):
            pages = pop(key, None)
            if pages is not None:
                popped += (slot, len(pages), *pages)
        listed[:0] = popped
    space.drop_listed(listed)
    for key in keys:
        for pool in pools_b:
            if pool.lookup(key) is not None:
                pool.evict_entries([key])
    for a, b in zip(pools_a, pools_b):
        a.check_invariants()
        assert (a.free_page_ids().tolist(), a.evictable_page_ids().tolist(), a.num_low_priority_idle_pages,
                a.num_free_pages) == (b.free_page_ids().tolist(), b.evictable_page_ids().tolist(),
                                      b.num_low_priority_idle_pages, b.num_free_pages)
        assert _entries_state(a, keys) == _entries_state(b, keys)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), lowest_first=st.booleans())
def test_page_space_demote_is_demote_pool_by_pool(data, lowest_first):
    """``PageSpace.demote`` (one compiled pass over a unit's entries listed in several groups,
    then a second key's in others) against ``demote(key)`` in each of the pools that publish the
    key, key after key: entries of 0-3 pages, low priority or not, some pages held (so some
    idle pages move to the front of the LRU), among other idle entries. The same LRU order,
    idle low-priority counts, packing floors, flags and entries."""
    sizes = data.draw(st.lists(st.integers(12, 24), min_size=1, max_size=4), label="sizes")
    picked = data.draw(st.lists(st.sampled_from(range(len(sizes))), unique=True, min_size=1), label="unit groups")
    then = data.draw(st.lists(st.sampled_from(range(len(sizes))), unique=True), label="second key's groups")
    script = [data.draw(st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 3), st.booleans()),
                        label=f"g{i}: pages, low, held, other low") for i in range(len(sizes))]
    sides = []
    for _ in range(2):
        pools = [PagePool(f"g{i}", n, lowest_first=lowest_first) for i, n in enumerate(sizes)]
        space = PageSpace(pools)
        for i, (pool, (size, low, held, other_low)) in enumerate(zip(pools, script)):
            pages = allocate(pool, size + 2).tolist()
            if i in picked:
                publish(pool, "unit", pages[:size], low_priority=low)
            publish(pool, "other", pages[size:size + 1], low_priority=other_low)
            publish(pool, "more", pages[size + 1:], low_priority=False)
            decref(pool, np.asarray(pages[size + 1:] + pages[held:size] + pages[size:size + 1], dtype=np.int64))
        sides.append((pools, space))
    (pools_a, space_a), (pools_b, space_b) = sides
    listed = []  # each entry: its pool's index in the space, its page count, its pages
    for i, key in [(i, "unit") for i in sorted(picked)] + [(i, "more") for i in then]:
        pages = pools_a[i].lookup(key)
        listed += (i, len(pages), *pages)
    space_a.demote(listed)
    for i in sorted(picked):
        pools_b[i].demote("unit")
    for i in then:
        pools_b[i].demote("more")
    for g, (a, b) in enumerate(zip(pools_a, pools_b)):
        a.check_invariants()
        assert (a.evictable_page_ids().tolist(), a.num_low_priority_idle_pages) == (
            b.evictable_page_ids().tolist(), b.num_low_priority_idle_pages)
        assert _low_floor(space_a, g) == _low_floor(space_b, g)
        assert _entries_state(a, ["unit", "other", "more"]) == _entries_state(b, ["unit", "other", "more"])


@pytest.mark.parametrize("batch", [False, True])
def test_revoke_takes_the_entries_on_its_pages_in_page_order(batch):
    """Entries "c" (pages 5, 6; 6 held), "a" (2, 7) and "b" (3) idle, 4 free: revoking 2-5
    evicts a (its page 7 goes free), b and c in the order of their lowest revoked page, told one
    by one or (``evict_many``) in one batch; pages 6 (held), 7 and 9 stay granted."""
    pool = PagePool("g", 10, lowest_first=True)
    told = []
    pool.on_removed = lambda key, cause, idle: told.append((key, cause, idle))
    if batch:
        pool.evict_many = _tell_at_once(pool, told)
    pages = allocate(pool, 8).tolist()  # 1 .. 8
    assert pages == list(range(1, 9))
    publish(pool, "a", [2, 7])
    publish(pool, "b", [3])
    publish(pool, "c", [5, 6])
    decref(pool, np.array([2, 3, 4, 5, 7]))
    pool.revoke(np.array([2, 3, 4, 5]))
    assert told == [("a", "revoked", 2), ("b", "revoked", 1), ("c", "revoked", 1)]
    assert pool.entry_keys() == [] and sorted(pool.free_page_ids().tolist()) == [7, 9]
    assert pool.usable_pages == 5 and pool.counters.evicted_pages == 4
    pool.check_invariants()


def _revoke_pool(lowest: bool, plan: list, held: set) -> tuple[PagePool, dict]:
    """A 30-id pool granted ids 1-24 whose first 20 were allocated: entry ``i`` publishes
    the next ``plan[i][0]`` of them (idle unless ``plan[i][1]``), the rest go free but
    ``held``. Returns the pool and each entry's pages."""
    pool = PagePool("g", 30, lowest_first=lowest, granted=False)
    pool.grant(np.arange(1, 25))
    every, at, entries = allocate(pool, 20).tolist(), 0, {}
    for i, (size, keep) in enumerate(plan):
        entries[i] = every[at : at + size]
        publish(pool, i, entries[i])
        if not keep:
            decref(pool, np.asarray(entries[i]))
        at += size
    decref(pool, np.asarray([p for p in every[at:] if p not in held], dtype=np.int64))
    return pool, entries


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_revoke_is_unpublishing_the_entries_then_taking_the_ids_off_the_free_stack(data):
    """``revoke`` (checked, and its free ids taken off, in compiled passes) against a
    reference of public calls: refused, changing nothing, when a listed id is held or
    not granted; else each entry on a listed idle id unpublished (in the order of its
    lowest listed id), then the listed ids gone from the free stack, whose other ids
    keep their order (LIFO or lowest-first pool; ids listed in any order, some twice)."""
    lowest = data.draw(st.booleans(), label="lowest first")
    plan = data.draw(st.lists(st.tuples(st.integers(1, 3), st.booleans()), max_size=5), label="entries: pages, held")
    held = data.draw(st.sets(st.integers(1, 20)), label="ids past the entries still held")
    listed = data.draw(st.lists(st.integers(1, 29), max_size=12), label="ids revoked")
    pool, entries = _revoke_pool(lowest, plan, held)
    free, idle = pool.free_page_ids().tolist(), set(pool.evictable_page_ids().tolist())
    before = (pool_state(pool), free, pool.evictable_page_ids().tolist(), pool.entry_keys())
    if not all(p in idle or p in free for p in listed):
        with pytest.raises(ValueError, match="no request holds"):
            pool.revoke(np.asarray(listed, dtype=np.int64))
        assert_same_state(before[0], pool_state(pool))
        assert before[1:] == (pool.free_page_ids().tolist(), pool.evictable_page_ids().tolist(), pool.entry_keys())
        return
    told = []
    pool.on_removed = lambda key, cause, idle_pages: told.append((key, cause))
    pool.revoke(np.asarray(listed, dtype=np.int64))
    pool.check_invariants()
    reference, _ = _revoke_pool(lowest, plan, held)
    owner = {p: key for key, pages in entries.items() for p in pages}
    keys = list(dict.fromkeys(owner[p] for p in sorted(set(listed)) if p in idle))
    for key in keys:
        reference.unpublish(key, "revoked")
    stack = [p for p in reference.free_page_ids().tolist() if p not in set(listed)]
    assert told == [(key, "revoked") for key in keys]
    assert (pool.free_page_ids().tolist(), pool.entry_keys(), pool.usable_pages) == (
        stack, reference.entry_keys(), reference.usable_pages - len(set(listed)))


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_evict_entries_leaves_the_pool_as_unpublishing_each_in_turn(data):
    """``evict_entries`` (one compiled pass over every entry's pages) against ``unpublish``
    of each entry in the same order (cause ``"evicted"``), in a LIFO or lowest-first
    pool, entries of 0-3 pages, some low priority, some pages held: the same (key, cause,
    idle pages) per entry, free stack (order included), LRU, idle low-priority count,
    and the evicted pages counted."""
    lowest = data.draw(st.booleans(), label="lowest first")
    plan = data.draw(st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 3)), min_size=1,
                              max_size=8), label="entries: pages, low, held")
    order = data.draw(st.permutations(range(len(plan))), label="eviction order")
    ends = []
    for batch in (True, False):
        pool = PagePool("g", 40, lowest_first=lowest)
        told = []
        pool.on_removed = lambda key, cause, idle, told=told: told.append((key, cause, idle))
        every, at = allocate(pool, sum(size for size, _, _ in plan)).tolist(), 0  # one call: nothing packs
        for i, (size, low, held) in enumerate(plan):
            pages, at = every[at : at + size], at + size
            publish(pool, i, pages, low_priority=low)
            decref(pool, np.asarray(pages[held:]))  # the first ``held`` pages stay held
        if batch:
            told.extend(pool.evict_entries(list(order)))
        else:
            pool.counters.evicted_pages += sum(pool.unpublish(i, "evicted") for i in order)
        ends.append((told, pool.free_page_ids().tolist(), pool.evictable_page_ids().tolist(),
                     pool.num_low_priority_idle_pages, pool.counters.evicted_pages, pool.entry_keys()))
        pool.check_invariants()
    assert ends[0] == ends[1]


def test_the_step_asks_no_packing_of_a_pool_not_lowest_first_nor_while_skip_packing_is_set():
    """``kernels.room_groups`` as the step kernel asks it (no packing rule): an allocation below an idle low-priority
    page stops the step in a lowest-first pool, but neither in one that does not hand out its lowest ids first nor,
    in any pool, while its ``PageSpace.skip_packing`` is set (its arena is roomy); a short free stack always does."""
    pools = [PagePool(f"g{i}", 8, lowest_first=i < 2) for i in range(3)]
    space = PageSpace(pools)
    for pool in pools:
        held = allocate(pool, 4)  # a lowest-first pool's ids 1 .. 4
        publish(pool, "low", held[2:3], low_priority=True)
        decref(pool, held[[0, 2]])  # its lowest free ids 1, 5; id 3 idle, low priority

    def asks(count):
        return [_step_asks(space, np.array([[0, 0, 0], [count if i == g else 0 for i in range(3)]])) for g in range(3)]

    assert asks(1) == [0, 0, 0] and asks(2) == [1, 1, 0]
    space.skip_packing[:] = 1
    assert asks(2) == [0, 0, 0] and asks(5) == [1, 1, 1]  # a short free stack still stops the step
    space.skip_packing[:] = 0
    assert asks(2) == [1, 1, 0]


def _reference_pack(pool, count):
    """Packing as first written: while fewer than ``count`` idle pages were freed, the
    lowest idle low-priority page (keyed, low priority, no holder) goes with its whole
    entry, one entry at a time (each removal told before the next is chosen), if it lies
    below the ``count``-th lowest free id (the stack as it is then)."""
    freed = 0
    while freed < count:
        free = sorted(pool.free_page_ids().tolist())
        bound = free[count - 1] if len(free) >= count else pool.num_pages
        idle_low = np.flatnonzero(pool.low_priority & pool.cached & (pool.ref_counts == 0))
        if not idle_low.size or idle_low[0] >= bound:
            return
        key = next(k for k in pool.entry_keys() if int(idle_low[0]) in pool.lookup(k))
        freed += pool.unpublish(key, "evicted")


@settings(max_examples=150, deadline=None)
@given(data=st.data(), batch=st.booleans(), ask=st.booleans())
def test_packing_evicts_the_entries_the_one_by_one_reference_evicts(data, batch, ask):
    """Packing (``make_room``: idle low-priority entries below the ids an allocation takes
    evicted, lowest id first) against ``_reference_pack``, a few times in a row with
    entries demoted and allocations made between: the same entries leave in the same
    order and the free order ends alike (an allocation takes its top). Entries are 1-3
    pages, some partly held, some demoted or promoted once idle; without ``batch`` each
    removal may demote another entry of the pool (a history pool's cascade), with it
    told of all removals at once; with ``ask``, a ``must_pack`` that always answers True
    (as none)."""
    n = data.draw(st.integers(12, 48), label="pages")
    plan = data.draw(st.lists(st.tuples(st.integers(1, 3), st.sampled_from(["low", "normal", "plain"]),
                                        st.integers(0, 2), st.sampled_from(["", "demote", "promote"])),
                              min_size=1, max_size=14), label="entries")
    cascade = data.draw(st.lists(st.integers(0, 13), max_size=8), label="demoted on removal")
    rounds = data.draw(st.lists(st.tuples(st.integers(1, n // 2), st.integers(0, 13)), min_size=1, max_size=3),
                       label="allocations, then an entry demoted")
    sides = []
    for reference in (False, True):
        pool = PagePool("g", n, lowest_first=True)
        log, todo = [], list(cascade)

        def removed(key, cause, idle, pool=pool, log=log, todo=todo):
            log.append((key, cause, idle))
            while todo and not batch:
                other = todo.pop(0)
                if pool.lookup(other) is not None:
                    pool.demote(other)
                    break

        pool.on_removed = removed
        pool.must_pack = (lambda page, pages: True) if ask else None
        if batch:
            pool.evict_many = _tell_at_once(pool, log)
        for i, (size, kind, held, later) in enumerate(plan):
            if size > pool.num_clean_free_pages:
                break
            pages = allocate(pool, size)
            if kind != "plain":
                publish(pool, i, pages.tolist(), low_priority=kind == "low")
            decref(pool, pages[held:].copy())
            if kind != "plain" and later:
                getattr(pool, later)(i)
        states = []
        for want, demoted in rounds:
            if not reference:
                pool.make_room(want)  # packing, then the LRU if the free stack is still short
            else:
                _reference_pack(pool, want)
            if pool.num_clean_free_pages < want:
                break  # the LRU's part: not what this test checks
            pool.check_invariants()
            states.append((list(log), pool.free_page_ids().tolist(), pool.evictable_page_ids().tolist(),
                           sorted(pool.entry_keys(), key=str), pool.num_low_priority_idle_pages))
            allocate(pool, want)
            if pool.lookup(demoted) is not None:
                pool.demote(demoted)
        sides.append(states)
    assert sides[0][: len(sides[1])] == sides[1]


def test_a_packing_that_tells_each_removal_chooses_again_after_each():
    """Worked by hand: idle entries at 1 (low priority), 2 (normal) and 3 (low), free 4-15;
    telling of 1's removal demotes 2. Three pages: 1, then 2 (now the lowest idle
    low-priority id), then 3 go, in that order (a batch chosen first would take 1 and 3
    and leave 2)."""
    pool = PagePool("g", 16, lowest_first=True)
    pages = allocate(pool, 3)  # 1-3
    for page in (1, 2, 3):
        publish(pool, page, [page], low_priority=page != 2)
    decref(pool, pages)
    log = []

    def removed(key, cause, idle):
        log.append(key)
        if key == 1:
            pool.demote(2)

    pool.on_removed = removed
    pool.make_room(3)
    assert log == [1, 2, 3]
    pool.check_invariants()


def test_a_packing_in_a_large_pool_clears_its_reserve_of_ids_ahead():
    """Worked by hand, a pool of 8,192 pages (reserve: 64 ids): held pages 1-300 but for
    free 10-19, idle low-priority entries at 2, 50, 100, 150, 250, 400 and one of 60-61
    whose page 61 is held. Five pages: packing clears the 5 + 64 lowest of the free ids
    and the ids it frees (2, 10-19, 50, 60, 100, 150, 250 and 301-353), evicting every
    entry below 353 but none above (400) and not the held page 61; the next 60 pages find
    their ids clear: nothing more is evicted. A pool of 5,999 granted pages reserves 1/128
    of them, 46 ids (5 + 46: 301-335 cleared, the same entries go). A pool of fewer than
    4,096 pages packs exactly: page 2's entry alone."""
    for n_pages, reserve in ((8193, 64), (6000, 46), (4095, 0)):
        pool = PagePool("g", n_pages, lowest_first=True)
        assert pool.pack_ahead_pages == reserve
        pages = allocate(pool, 300)  # 1-300
        for page in (2, 50, 100, 150, 250):
            publish(pool, page, [page], low_priority=True)
        publish(pool, 60, [60, 61], low_priority=True)
        high = allocate(pool, 100)  # 301-400
        publish(pool, 400, [400], low_priority=True)
        decref(pool, np.array([2, 50, 60, 100, 150, 250, *range(10, 20)]))
        decref(pool, high)  # 301-399 free, 400 idle
        assert allocate(pool, 5).tolist() == [2, 10, 11, 12, 13]
        gone = [key for key in (2, 50, 60, 100, 150, 250, 400) if pool.lookup(key) is None]
        assert gone == ([2, 50, 60, 100, 150, 250] if reserve else [2])
        assert pool.ref_counts[61] == 1 and 61 not in pool.free_page_ids().tolist()
        evicted = pool.counters.evicted_pages
        allocate(pool, 60)
        assert pool.counters.evicted_pages == evicted or not reserve
        pool.check_invariants()
    del pages


def _pack(pool, want: int, reference: bool) -> None:
    """``make_room(want)``, or the packing reference's, on ``pool``."""
    if reference:
        _reference_pack_ahead(pool, want)
    else:
        pool.make_room(want)


def _reference_pack_ahead(pool, count):
    """Packing with a reserve, from its documentation: when the free stack is short,
    ``_reference_pack`` of ``count``; else, when an idle low-priority page lies below the
    ``count``-th lowest free id (packing is needed), ``_reference_pack`` of ``count``
    plus ``pack_ahead_pages``, at most every free id."""
    free = sorted(pool.free_page_ids().tolist())
    if len(free) < count:
        _reference_pack(pool, count)
        return
    idle_low = np.flatnonzero(pool.low_priority & pool.cached & (pool.ref_counts == 0))
    if idle_low.size and idle_low[0] < free[count - 1]:
        _reference_pack(pool, min(count + pool.pack_ahead_pages, len(free)))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_packing_with_a_reserve_evicts_what_the_reference_evicts_for_the_wider_allocation(data):
    """In a pool of 4,096 pages or more, packing (``make_room``) against
    ``_reference_pack_ahead``: the same entries leave, the free order and the LRU end
    alike, and free + held + cached pages stay consistent (``check_invariants``), over
    random entries (1-3 pages, some partly held, some demoted) and allocations."""
    n = data.draw(st.sampled_from([4097, 6000, 8193]), label="pages")
    plan = data.draw(st.lists(st.tuples(st.integers(1, 3), st.sampled_from(["low", "normal", "plain"]),
                                        st.integers(0, 2), st.booleans(), st.integers(1, 40)),
                              min_size=1, max_size=40), label="entries")
    rounds = data.draw(st.lists(st.integers(1, 120), min_size=1, max_size=4), label="allocations")
    sides = []
    for reference in (False, True):
        pool = PagePool("g", n, lowest_first=True)
        log = []
        # packing's batch; the reference's ``unpublish`` tells ``on_removed``
        pool.evict_many = _tell_at_once(pool, log)
        pool.on_removed = lambda *removal, log=log: log.append(removal)
        made = [(allocate(pool, gap), allocate(pool, size)) for size, _, _, _, gap in plan]  # before any release
        for i, ((gap_pages, pages), (_, kind, held, demote, _)) in enumerate(zip(made, plan)):
            if kind != "plain":
                publish(pool, i, pages.tolist(), low_priority=kind == "low")
            decref(pool, pages[held:].copy())
            decref(pool, gap_pages[::2].copy())  # free ids among the entries
            if kind == "normal" and demote:
                pool.demote(i)
        states = []
        for want in rounds:
            _pack(pool, want, reference)
            if pool.num_clean_free_pages < want:
                break  # the LRU's part: not what this test checks
            pool.check_invariants()
            states.append((list(log), pool.free_page_ids().tolist(), pool.evictable_page_ids().tolist(),
                           sorted(pool.entry_keys(), key=str)))
            allocate(pool, want)
        sides.append(states)
    assert sides[0][: len(sides[1])] == sides[1]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_packing_past_one_scan_of_ids_evicts_what_the_reference_evicts(data):
    """Packing that needs more than one scan of the flags (64 ids a scan): a pool of 8,193
    pages (a reserve of 64 ids) with 70-200 idle low-priority entries of 1-2 pages (some
    partly held) among free ids, low ids first, then allocations of 1-150 pages, against
    ``_reference_pack_ahead``: the same entries leave in the same order, the free order and
    the LRU end alike."""
    n_entries = data.draw(st.integers(70, 200), label="low entries")
    sizes = data.draw(st.lists(st.integers(1, 2), min_size=n_entries, max_size=n_entries), label="sizes")
    held = data.draw(st.lists(st.booleans(), min_size=n_entries, max_size=n_entries), label="partly held")
    gaps = data.draw(st.lists(st.integers(0, 3), min_size=n_entries, max_size=n_entries), label="free gaps")
    rounds = data.draw(st.lists(st.integers(1, 150), min_size=1, max_size=3), label="allocations")
    sides = []
    for reference in (False, True):
        pool = PagePool("g", 8193, lowest_first=True)
        log = []
        pool.evict_many = _tell_at_once(pool, log)
        pool.on_removed = lambda *removal, log=log: log.append(removal)
        made = [(allocate(pool, gap), allocate(pool, size)) for size, gap in zip(sizes, gaps)]
        allocate(pool, 500)  # held ids above them
        for i, ((gap_pages, pages), keep) in enumerate(zip(made, held)):
            publish(pool, i, pages.tolist(), low_priority=True)
            decref(pool, pages[1:].copy() if keep and pages.size > 1 else pages.copy())
            decref(pool, gap_pages.copy())
        states = []
        for want in rounds:
            _pack(pool, want, reference)
            pool.check_invariants()
            states.append((list(log), pool.free_page_ids().tolist(), sorted(pool.entry_keys())))
            allocate(pool, want)
        sides.append(states)
    assert sides[0] == sides[1]


def test_packing_finds_idle_low_priority_pages_a_previous_packing_passed():
    """Worked by hand: idle low-priority entries "a" (page 1) and "c" (page 10), free
    ids 5, 6, 11-15. One page: "a" goes (below 5); "c" lies above the free ids then,
    but three pages later go past it (5, 6, then 10), so that packing evicts "c"."""
    pool = PagePool("g", 16, lowest_first=True)
    a, plain, c = allocate(pool, 1), allocate(pool, 8), allocate(pool, 1)  # 1; 2-9; 10
    publish(pool, "a", a.tolist(), low_priority=True)
    publish(pool, "c", c.tolist(), low_priority=True)
    decref(pool, np.concatenate([a, c, plain[3:5]]))  # 5, 6 go free
    assert allocate(pool, 1).tolist() == [1]
    assert pool.lookup("a") is None and pool.lookup("c") == (10,)
    assert allocate(pool, 3).tolist() == [5, 6, 10]
    assert pool.lookup("c") is None
    pool.check_invariants()


def test_packing_asks_must_pack_only_when_an_idle_low_priority_page_may_lie_below():
    """Worked by hand: ``must_pack`` (here always True, recording its questions) is not
    asked while the only idle low-priority page (10) lies above the ids an allocation
    takes (free 2-9); once one lies below them (page 1, free from 2), it is asked about
    the highest id taken and its entry goes."""
    pool = PagePool("g", 16, lowest_first=True)
    asked = []
    pool.must_pack = lambda page, pages: asked.append((page, pages)) or True
    low, plain, high = allocate(pool, 1), allocate(pool, 8), allocate(pool, 1)  # 1; 2-9; 10
    publish(pool, "low", low.tolist(), low_priority=True)
    publish(pool, "high", high.tolist(), low_priority=True)
    decref(pool, np.concatenate([high, plain]))  # 2-10 idle, "high" among them
    pool.make_room(3)
    assert asked == [] and pool.lookup("high") == (10,)
    decref(pool, low)
    pool.make_room(3)
    assert asked == [(4, 3)] and pool.lookup("low") is None and pool.lookup("high") == (10,)
    assert allocate(pool, 3).tolist() == [1, 2, 3]
    pool.check_invariants()


def test_packing_one_by_one_sees_entries_a_removal_demoted():
    """Worked by hand: a pool told of each removal at once (a history pool) whose
    removal of "x" (low priority, page 3) demotes "y" (idle, page 1). Two pages, free
    ids from 4: "x" goes, then "y", now low priority and below the second free id."""
    pool = PagePool("g", 12, lowest_first=True)
    pages = allocate(pool, 3)  # 1, 2, 3
    publish(pool, "y", [1])
    publish(pool, "x", [3], low_priority=True)
    removed = []

    def on_removed(key, cause, idle):
        removed.append((key, cause))
        if key == "x":
            pool.demote("y")

    pool.on_removed = on_removed
    decref(pool, np.array([pages[0], pages[2]]))
    assert allocate(pool, 2).tolist() == [1, 3]
    assert removed == [("x", "evicted_low"), ("y", "evicted_low")]
    pool.check_invariants()


class LruReference:
    """The LRU as an ``OrderedDict`` of pages (least recently used first), changed as the
    pool documents: released pages join at the tail (the last released first), low-priority
    ones at the head instead; borrowed or unpublished pages leave; ``touch`` and
    ``promote`` move an entry's idle pages to the tail, ``demote`` to the head."""

    def __init__(self):
        from collections import OrderedDict

        self.order, self.low = OrderedDict(), {}

    def joined(self, pages, low):
        for page in reversed(pages):
            self.order[page] = None
            if low:
                self.order.move_to_end(page, last=False)

    def left(self, pages):
        for page in pages:
            self.order.pop(page, None)

    def moved(self, pages, to_front):
        for page in pages:
            if page in self.order:
                self.order.move_to_end(page, last=not to_front)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), lowest_first=st.booleans())
def test_the_lru_keeps_an_ordered_dicts_order_through_every_change(data, lowest_first):
    """Random publishes, releases, borrows, touches, promotions, demotions and removals
    (one entry or several at once; entries of 1-7 pages) against an ``OrderedDict`` reference: the pool's LRU
    order (``evictable_page_ids``) and its length match after each."""
    pool, ref = PagePool("g", 24, lowest_first=lowest_first), LruReference()
    entries, held = {}, {}  # key -> pages; key -> whether its pages are held (once)
    for step in range(data.draw(st.integers(1, 40), label="steps")):
        ops = ["publish"] if pool.num_clean_free_pages >= 7 else []
        ops += ["release", "borrow", "touch", "promote", "demote", "unpublish", "drop"] if entries else []
        op = data.draw(st.sampled_from(ops or ["publish_none"]), label=f"op{step}")
        key = data.draw(st.sampled_from(sorted(entries)), label=f"key{step}") if entries else None
        if op == "publish":
            pages = allocate(pool, data.draw(st.integers(1, 7), label=f"n{step}")).tolist()
            for k in [k for k in entries if pool.lookup(k) is None]:  # packed away (lowest first)
                ref.left(entries.pop(k))
                del held[k]
            low = data.draw(st.booleans(), label=f"low{step}")
            assert publish(pool, step, pages, low_priority=low)
            entries[step], held[step], ref.low[step] = pages, True, low
        elif op == "release" and held[key]:
            decref(pool, np.array(entries[key]))
            ref.joined(entries[key], ref.low[key])
            held[key] = False
        elif op == "borrow" and not held[key]:
            incref(pool, entries[key])
            ref.left(entries[key])
            held[key] = True
        elif op in ("touch", "promote", "demote"):
            getattr(pool, op)(key)
            if op == "demote" or ref.low[key] != (op == "touch"):
                ref.moved(entries[key], op == "demote")
                ref.low[key] = op == "demote"
        elif op in ("unpublish", "drop"):
            keys = [key] if op == "unpublish" else sorted(entries)[: data.draw(st.integers(1, 3), label=f"k{step}")]
            pool.unpublish(keys[0]) if op == "unpublish" else pool.evict_entries(keys)
            for k in keys:
                if held.pop(k):
                    decref(pool, np.array(entries[k]))  # unkeyed now: straight to the free stack
                ref.left(entries.pop(k))
        pool.check_invariants()
        assert pool.evictable_page_ids().tolist() == list(ref.order)
        assert pool.num_evictable_pages == len(ref.order)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_room_groups_leaves_out_only_pools_whose_make_room_evicts_nothing(data):
    """``kernels.room_groups`` (the step asks ``make_room`` only of the groups it names):
    for a lowest-first pool with random held, free and idle entries of either priority,
    a group it leaves out (-1) is one whose ``make_room`` of the allocation changes
    nothing: no entry evicted, the free stack as it was; one it names whose free stack covers
    the allocation has an idle low-priority page below the ids the allocation takes."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    pool = PagePool("g", 48, lowest_first=True)
    held = allocate(pool, data.draw(st.integers(1, 40)))
    for k, page in enumerate(held[: data.draw(st.integers(0, held.size))].tolist()):
        publish(pool, ("e", k), [page], low_priority=bool(rng.integers(2)))
    decref(pool, rng.permutation(held)[: data.draw(st.integers(0, held.size))])
    count = data.draw(st.integers(0, pool.num_free_pages))
    space, g = space_of(pool)
    sums = np.zeros((2, 1), dtype=np.int64)
    sums[1, 0] = count
    out, none, geometry = np.empty(1, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros((1, 8), dtype=np.int64)
    geometry[0, kernels.ID_OFFSET] = space.offsets[g]
    asked = kernels.room_groups(geometry, np.zeros((3, 1, 0), dtype=np.int64), np.zeros(1, dtype=np.bool_), none,
                                none, none, np.zeros((2, 1, 0), dtype=np.int64), sums, space.stack, space.per_group,
                                space.ref_counts, space.cached, space.low_priority, None, out, 0, None, None)
    assert asked == int(out[0] >= 0) and (out[0] in (-1, 0))
    free = pool.free_page_ids().copy()  # the lowest on top: the allocation's highest id is free[-count]
    if out[0] < 0:
        before, evicted = pool.free_page_ids().tolist(), pool.counters.evicted_pages
        pool.make_room(count, 0)
        assert pool.free_page_ids().tolist() == before and pool.counters.evicted_pages == evicted
    elif count <= free.size:  # named though its free stack covers the allocation: a page to pack lies below
        assert (pool.low_priority & pool.cached & (pool.ref_counts == 0))[: free[-count]].any()


def test_room_groups_leaves_out_a_pool_whose_idle_low_priority_pages_lie_above_the_ids_taken():
    """A pool whose lowest idle low-priority page was borrowed again (its floor, a lower bound
    of their ids, stays below) and whose one left lies above the ids an allocation takes:
    ``kernels.room_groups`` scans from the floor and leaves it out (``make_room`` would evict
    nothing), then names it once a low-priority page below those ids goes idle."""
    pool = PagePool("g", 20, lowest_first=True)
    held = allocate(pool, 10)  # 1 .. 10
    decref(pool, held[1:5])  # 2 .. 5 free
    assert publish(pool, "a", [1], low_priority=True) and publish(pool, "c", [10], low_priority=True)
    decref(pool, [1, 10])
    incref(pool, [1])  # idle low priority: 10 alone; the allocation of 2 takes ids 2, 3
    space, _ = space_of(pool)
    sums, out, none = np.zeros((2, 1), dtype=np.int64), np.empty(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    sums[1, 0] = 2
    geometry = np.zeros((1, 8), dtype=np.int64)
    geometry[0, kernels.ID_OFFSET] = space.offsets[0]

    def asked():
        return kernels.room_groups(geometry, np.zeros((3, 1, 0), dtype=np.int64), np.zeros(1, dtype=np.bool_), none,
                                   none, none, np.zeros((2, 1, 0), dtype=np.int64), sums, space.stack, space.per_group,
                                   space.ref_counts, space.cached, space.low_priority, None, out, 0, None, None)

    assert asked() == 0 and out[0] == -1
    decref(pool, [1])  # 1 idle again, below the ids taken
    assert asked() == 1 and out[0] == 0
    assert allocate(pool, 2).tolist() == [1, 2] and pool.lookup("a") is None and pool.lookup("c") == (10,)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_room_groups_asks_before_the_keyed_pages_gone_idle_join_as_after(data):
    """``kernels.room_groups`` of a lowest-first pool with random held, free and idle entries of either priority,
    some borrowed again (the floor left stale), some pages just released (``kernels.release_into``: the keyed ones
    idle, not yet in the LRU: ``not_joined``), and one row allocating a few pages, in a sliding group
    (``window_tokens`` > 0, a token a page: the pages the next step releases again take the highest ids) or not: as
    the step kernel asks it (no marks) it says so exactly when the free stack is short or an idle low-priority page
    lies below the highest id the long-lived pages take; with marks it names the group then, with its transient
    pages, and as it does once those pages joined their LRU (``PageSpace.keyed_idle``), the floor then a lower bound
    of the idle low-priority ids."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    pool = PagePool("g", 48, lowest_first=True)
    held = allocate(pool, data.draw(st.integers(1, 46)))
    for k, page in enumerate(rng.permutation(held)[: data.draw(st.integers(0, held.size))].tolist()):
        publish(pool, ("e", k), [page], low_priority=bool(rng.integers(2)))
    order = rng.permutation(held)
    dropped = data.draw(st.integers(0, held.size))
    decref(pool, order[:dropped])
    idle = (pool.cached & (pool.ref_counts == 0)).nonzero()[0]
    incref(pool, idle[: data.draw(st.integers(0, idle.size))])  # the lowest: the floor stays below the rest
    now = order[dropped : dropped + data.draw(st.integers(0, held.size - dropped))].astype(np.int64)
    space, g = space_of(pool)
    freed, idle_keyed, released = np.empty(now.size, np.int64), np.empty(now.size, np.int64), np.zeros((2, 1), np.int64)
    kernels.release_into(space.ref_counts, space.cached, space.stack, space.per_group, space.offsets, now,
                         np.array([now.size]), freed, idle_keyed, released)
    not_joined, idle_keyed = released[1], idle_keyed[: released[1, 0]]
    count, window_tokens = data.draw(st.integers(1, 4)), data.draw(st.integers(0, 3))
    geometry, plan = np.zeros((1, 8), dtype=np.int64), np.zeros(kernels.plan_size(1, 1, 0, 0), dtype=np.int64)
    geometry[0, [kernels.PAGE_TOKENS, kernels.WINDOW_TOKENS, kernels.ID_OFFSET]] = 1, window_tokens, space.offsets[g]
    plan[0] = 1  # room for a row: row 0 gets ``count`` tokens from 0, a page each
    rows, counts, first, after, _, sums = kernels.plan_views(plan, 1)[:6]
    rows[0], counts[0], first[0], after[1, 0, 0], sums[1, 0] = 0, count, 0, count, count
    bounds, transient, out = np.zeros((3, 1, 1), dtype=np.int64), np.array([window_tokens > 0]), np.empty(1, np.int64)
    args = (geometry, bounds, transient, rows[:1], first[:1], counts[:1], after[:, :, :1], sums, space.stack,
            space.per_group, space.ref_counts, space.cached, space.low_priority, None)
    asked = kernels.room_groups(*args, None, 0, not_joined, idle_keyed)
    free, low_idle = pool.free_page_ids(), pool.low_priority & pool.cached & (pool.ref_counts == 0)
    highest = kernels.transient_pages(geometry, bounds, transient, 0, rows[:1], first[:1], counts[:1],
                                      after[:, :, :1], sums)
    long = count - highest
    assert asked == (count > free.size or (long > 0 and bool(low_idle[: free[-long]].any())))
    assert kernels.room_groups(*args, out, 0, not_joined, idle_keyed) == asked and out[0] == (highest if asked else -1)
    space.keyed_idle(not_joined, idle_keyed)
    pool.check_invariants()
    out[0] = -7
    assert kernels.room_groups(*args, out, 0, None, None) == asked and out[0] == (highest if asked else -1)
    assert not low_idle[: space.per_group[kernels.LOW_FLOOR, g]].any()


def test_peak_used_pages_can_be_reset_and_rises_again():
    """``peak_used_pages`` stays a settable attribute (it reads and writes the pool's slot
    of its page space's counts): set back, the next allocation raises it again."""
    pool = PagePool("g", 10)
    allocate(pool, 6)
    pool.peak_used_pages = 0
    assert pool.peak_used_pages == 0
    allocate(pool, 1)
    assert pool.peak_used_pages == 7


def test_page_space_drop_units_counts_each_call_alone():
    """``PageSpace.drop_units`` reuses its per-group scratch: a second call's idle pages per
    pool are that call's only (as ``evict_entries`` tells them), not added to the first's."""
    pools = [PagePool(f"g{i}", 16, lowest_first=True) for i in range(3)]
    space = PageSpace(pools)
    for pool in pools:
        pages = allocate(pool, 4).tolist()
        publish(pool, "a", pages[:2])
        publish(pool, "b", pages[2:])
        decref(pool, np.asarray(pages[1:], dtype=np.int64))  # a's first page stays held
    assert space.drop_units(space.entry_pops(pools[:2]), ["a"]) == ([["g0", "g1"]], [1, 1], [("a", "unpublished", 1)])
    assert space.drop_units(space.entry_pops(pools[1:]), ["b"]) == ([["g1", "g2"]], [2, 2], [("b", "unpublished", 2)])
    assert space.drop_units(space.entry_pops(pools), ["a"]) == ([["g2"]], [0, 0, 1], [])
    for pool in pools:
        pool.check_invariants()


@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_first_in_line_matches_a_list_model(data):
    """``PageSpace.first_in_line`` (the thrash guard's move), three times: pages of idle entries, some low priority,
    some held, released in a random order; between calls an entry may be unpublished (the low-priority head's last
    page, which the space remembers, among them) or another page released. The listed idle normal-priority pages end
    just behind the low-priority head, the last listed first, with the oldest normal-priority tick; the rest keep
    their order and ticks (a list model)."""
    pool = PagePool("g", 16)
    pages = allocate(pool, 15).tolist()
    low = data.draw(st.lists(st.booleans(), min_size=15, max_size=15))
    for i, page in enumerate(pages):
        publish(pool, ("entry", i), [page], low_priority=low[i])
    held = data.draw(st.permutations(pages))
    cut = data.draw(st.integers(0, 15))
    for page in held[:cut]:  # one release each: a tick each
        decref(pool, [page])
    held = held[cut:]
    space, g = space_of(pool)
    for _ in range(3):
        change = data.draw(st.sampled_from(["none", "unpublish", "unpublish the head's last", "release"]))
        idle = pool.evictable_page_ids().tolist()
        last_low = [p for p in idle if pool.low_priority[p]][-1:]
        if change == "unpublish" and idle:
            pool.unpublish(("entry", pages.index(data.draw(st.sampled_from(idle)))))
        elif change == "unpublish the head's last" and last_low:
            pool.unpublish(("entry", pages.index(last_low[0])))
        elif change == "release" and held:
            decref(pool, [held.pop()])
        order_before = pool.evictable_page_ids().tolist()
        ticks_before = {p: int(pool.idle_tick[p]) for p in order_before}
        listed = data.draw(st.lists(st.sampled_from(pages), unique=True, max_size=15))
        moved = space.first_in_line([g, len(listed), *listed])

        head = [p for p in order_before if pool.low_priority[p]]
        normal = [p for p in order_before if not pool.low_priority[p]]
        movers = [p for p in listed if p in normal]
        expected = head + movers[::-1] + [p for p in normal if p not in movers]
        assert moved == len(movers)
        assert pool.evictable_page_ids().tolist() == expected
        oldest = ticks_before[normal[0]] if normal else None
        assert {p: int(pool.idle_tick[p]) for p in expected} == {
            p: oldest if p in movers else ticks_before[p] for p in expected}
        pool.check_invariants()
