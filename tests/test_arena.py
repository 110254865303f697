"""Shared arena: geometry worked by hand, slab lending and reclaim, the manager in
``page_space="shared"`` mode, and that live pages of different groups never share
a byte (checked from page ids and page sizes alone, not through the arena)."""

import dataclasses
import os
import subprocess
import sys

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import event, given, settings

from hybridkv.memory.arena import (AHEAD_MIN_SLABS, SLABS_AHEAD, SPREAD_SLABS, Arena, IdleScan, anchor_group_for,
                                   arena_geometry, shared_arena_for)
from hybridkv.runtime.manager import CacheManager, CacheManagerError
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_budget
from hybridkv.memory.pool import PagePool, PageSpace
from hybridkv.spec import CacheGroupSpec
from hybridkv.runtime import kernels
from pool_ops import allocate, decref, publish

def slab_of(geometry, group_id, pages):
    """Slab index of the first byte of each (non-null) page id of a group (a reference
    worked from the arena's geometry)."""
    return (np.asarray(pages, dtype=np.int64) * geometry.page_bytes[group_id] - geometry.reserved_bytes) // (
        geometry.slab_bytes)


SWA = CacheGroupSpec("swa", "sliding_window", 4, 1, sliding_window_tokens=8, family="state")
KV = CacheGroupSpec("kv", "full_history", rows_per_page=16, entry_stride_tokens=1)
# swa pages 40 B, kv pages 30 B (anchor). Head: ceil(40/30) = 2 kv pages = 60 B; slab
# 8 kv pages = 240 B; 4 slabs -> 1,020 B.
SMALL_BYTES = {"swa": 40, "kv": 30}


def small_geometry(slabs=4):
    return arena_geometry(SMALL_BYTES, 60 + 240 * slabs + 17, anchor_group="kv", slab_anchor_pages=8)


def packing_arena(slabs=12):
    """A ``small_geometry`` arena with one lowest-first pool per group, no slab granted:
    (geometry, pools by group, arena)."""
    geometry = small_geometry(slabs)
    pools = {gid: PagePool(gid, geometry.view_pages(gid), granted=False, lowest_first=True) for gid in SMALL_BYTES}
    PageSpace(list(pools.values()))  # an arena's pools lie in one page space, in its group order
    return geometry, pools, Arena(geometry, pools)


def grant_and_allocate(data, pools, arena):
    """A drawn group is granted slabs for up to 30 pages (partly, as they fit) and
    allocates some of its free pages: (group, its pool)."""
    gid = data.draw(st.sampled_from(sorted(SMALL_BYTES)))
    pool = pools[gid]
    arena.apply(arena.plan({gid: data.draw(st.integers(0, 30))}, {}, partial=True))
    if pool.num_free_pages:
        allocate(pool, data.draw(st.integers(1, pool.num_free_pages)))
    return gid, pool


def grant_publish_release(data, rng, pools, arena, steps, random_priority):
    """``steps`` times: grant and allocate (``grant_and_allocate``), publish some of the
    pool's new pages as entries (of random priority when ``random_priority``), release some
    held pages."""
    for step in range(steps):
        gid, pool = grant_and_allocate(data, pools, arena)
        held = np.flatnonzero((pool.ref_counts > 0) & ~pool.cached)
        for k, page in enumerate(rng.permutation(held)[: data.draw(st.integers(0, held.size))].tolist()):
            low = bool(rng.integers(2)) if random_priority else False
            publish(pool, (step, gid, k), [page], low_priority=low)
        held = np.flatnonzero(pool.ref_counts > 0)
        decref(pool, rng.permutation(held)[: data.draw(st.integers(0, held.size))])


def small_manager(slabs=4, slabs_ahead=0, **kw):
    """A manager on a small arena; its worked examples take slabs one step at a time (``slabs_ahead`` 0) unless a
    test says otherwise."""
    m = CacheManager([SWA, KV], None, max_context_tokens=256, max_step_tokens=64, arena=small_geometry(slabs), **kw)
    m.arena.slabs_ahead = slabs_ahead
    return m


def live_byte_ranges_disjoint(m):
    """Independent check: every held or cached page of every group, as a byte range,
    lies after the null head, inside the arena, and overlaps no other."""
    geometry = m.arena.geometry
    spans = []
    for gid, pool in m.pools.items():
        size = geometry.page_bytes[gid]
        live = np.flatnonzero((pool.ref_counts > 0) | pool.cached)
        assert np.all(live * size >= geometry.reserved_bytes), f"{gid}: a page in the null head"
        spans += [(int(p) * size, (int(p) + 1) * size, gid) for p in live]
    spans.sort()
    for (a0, a1, ga), (b0, b1, gb) in zip(spans, spans[1:]):
        assert a1 <= b0, f"{ga} [{a0}, {a1}) overlaps {gb} [{b0}, {b1})"
    assert (spans[-1][1] if spans else 0) <= geometry.total_bytes
    return spans


# --- geometry ----------------------------------------------------------------------
def test_geometry_worked_by_hand():
    g = small_geometry()
    assert (g.reserved_bytes, g.slab_bytes, g.num_slabs, g.total_bytes) == (60, 240, 4, 1020)
    assert (g.view_pages("swa"), g.view_pages("kv")) == (25, 34)
    lo, hi = g.slab_page_ranges("swa")
    # slab k = [60 + 240k, 300 + 240k): 40-byte pages wholly inside; page 7 = [280, 320) straddles.
    assert lo.tolist() == [2, 8, 14, 20] and hi.tolist() == [7, 13, 19, 25]
    lo, hi = g.slab_page_ranges("kv")
    assert lo.tolist() == [2, 10, 18, 26] and hi.tolist() == [10, 18, 26, 34]
    assert slab_of(g, "swa", [2, 6, 8, 24]).tolist() == [0, 0, 1, 3]
    # Boundaries at 300, 540, 780 cut swa pages 7, 13, 19; kv pages tile the slabs.
    assert g.boundary_pages("swa").tolist() == [-1, 7, 13, 19]
    assert g.boundary_pages("kv").tolist() == [-1, -1, -1, -1]


@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=4), anchor_pages=st.integers(1, 20),
       slabs=st.integers(1, 300))
def test_fewest_slab_pages_is_the_least_of_the_slab_page_ranges(sizes, anchor_pages, slabs):
    """The plain-int count the planner uses (no numpy) is the least ``hi - lo`` over every slab."""
    page_bytes = {f"g{i}": size for i, size in enumerate(sizes)}
    probe = arena_geometry(page_bytes, 2**40, anchor_group="g0", slab_anchor_pages=anchor_pages)
    g = arena_geometry(page_bytes, probe.reserved_bytes + slabs * probe.slab_bytes, anchor_group="g0",
                       slab_anchor_pages=anchor_pages)
    assert g.num_slabs == slabs
    for gid in page_bytes:
        lo, hi = g.slab_page_ranges(gid)
        event(f"{'whole' if g.fewest_slab_pages(gid) == g.slab_bytes // page_bytes[gid] else 'one fewer'}")
        assert g.fewest_slab_pages(gid) == int((hi - lo).min())


def test_slab_holds_at_least_two_of_the_largest_pages():
    g = arena_geometry({"big": 1000, "small": 10}, 10_000, anchor_group="small", slab_anchor_pages=3)
    # head: 1000 B (100 small pages); slab raised from 30 B to ceil(2000/10) * 10 = 2000 B
    assert (g.reserved_bytes, g.slab_bytes, g.num_slabs) == (1000, 2000, 4)


def test_geometry_errors():
    with pytest.raises(ValueError, match="holds no slab.*needs 300 B"):
        arena_geometry(SMALL_BYTES, 299, anchor_group="kv", slab_anchor_pages=8)
    with pytest.raises(ValueError, match="anchor group 'x'"):
        arena_geometry(SMALL_BYTES, 10_000, anchor_group="x")
    with pytest.raises(ValueError, match="slab_anchor_pages"):
        arena_geometry(SMALL_BYTES, 10_000, anchor_group="kv", slab_anchor_pages=0)


def test_anchor_is_the_history_group_with_most_bytes_per_token():
    layout = cache_layout("deepseek-v4-flash", indexer="fp8")
    page_bytes = {g.group_id: g.page_bytes for g in layout.groups}
    assert anchor_group_for(layout.specs, page_bytes) == "v4.c4a.compressed_kv"


def test_v4_flash_40gib_arena():
    """Slab = 16 c4 pages of 963,648 B; head = 2 c4 pages (covers the 1,609,920 B window page)."""
    layout = cache_layout("deepseek-v4-flash", indexer="fp8")
    plan = plan_for_budget(layout, 40 << 30, Limits(256, 2048, 131072))
    g = shared_arena_for(plan)
    assert g.slab_bytes == 16 * 963_648 and g.reserved_bytes == 2 * 963_648
    assert g.num_slabs == (40 * 2**30 - 2 * 963_648) // (16 * 963_648) == 2785
    lo, hi = g.slab_page_ranges("v4.c4a.compressed_kv")
    assert set((hi - lo).tolist()) == {16}  # the anchor loses nothing at slab edges


# --- arena on bare pools -------------------------------------------------------------
def bare_arena():
    g = small_geometry()
    pools = {gid: PagePool(gid, g.view_pages(gid), granted=False, lowest_first=True) for gid in SMALL_BYTES}
    PageSpace(list(pools.values()))
    return Arena(g, pools), pools


def test_spare_slabs_go_out_lowest_first_and_pools_start_empty():
    arena, pools = bare_arena()
    assert all(p.usable_pages == 0 and p.num_free_pages == 0 for p in pools.values())
    grants = arena.plan({"swa": 6, "kv": 3}, {})
    assert grants == [("swa", 0, None), ("swa", 1, None), ("kv", 2, None)]
    arena.apply(grants)
    # swa owns slabs 0 and 1, so page 7 straddling their boundary is its too: 5 + 5 + 1.
    assert pools["swa"].usable_pages == 11 and pools["kv"].usable_pages == 8
    assert allocate(pools["swa"], 3).tolist() == [2, 3, 4]
    assert allocate(pools["kv"], 2).tolist() == [18, 19]
    assert arena.num_spare_slabs == 1
    arena.check_invariants()


def test_a_spare_grant_listing_a_slab_twice_changes_nothing():
    """``kernels.grant_spare_slabs`` checks every slab before it grants any: a slab listed twice (for two groups)
    leaves the owners, free stacks and counts as they were; the same grants without the repeat go through."""
    g = small_geometry()
    pools = {gid: PagePool(gid, g.view_pages(gid), granted=False, lowest_first=True) for gid in SMALL_BYTES}
    space = PageSpace(list(pools.values()))
    arena = Arena(g, pools)
    owner, lo, hi, straddle, offsets = arena.grant_args[:5]

    def grant(groups, slabs):
        counts, pages = np.zeros(len(SMALL_BYTES), np.int64), np.empty(64, np.int64)
        return kernels.grant_spare_slabs(owner, np.array(groups, np.int64), np.array(slabs, np.int64), lo, hi,
                                         straddle, pages, counts, space.stack, space.per_group[kernels.TOP], offsets,
                                         space.per_group[kernels.LOWEST], space.per_group[kernels.GRANTED_PAGES])

    before = owner.copy(), space.per_group.copy(), space.stack.copy()
    assert grant([0, 1], [1, 1]) == -1
    assert (owner == before[0]).all() and (space.per_group == before[1]).all() and (space.stack == before[2]).all()
    assert grant([0, 1], [1, 2]) > 0
    assert owner[1:3].tolist() == [0, 1]


def test_reclaim_takes_only_wholly_idle_slabs_and_respects_the_donors_surplus():
    arena, pools = bare_arena()
    arena.apply(arena.plan({"swa": 20}, {}))  # every slab to swa: 4 x 5 inner + 3 straddlers
    assert pools["swa"].usable_pages == 23
    held = allocate(pools["swa"], 6)  # lowest first: 2..6 in slab 0 and straddler 7 (slabs 0/1)
    assert held.tolist() == [2, 3, 4, 5, 6, 7]
    # Slab 1 is pinned by page 7. Slab 2 gives its 5 inner pages and both straddlers (13, 19).
    assert arena.plan({"kv": 1}, {"swa": 100}) == [("kv", 2, "swa")]
    # Slab 2 costs swa 7 pages and slab 3 costs 6: more than 5 it can spare.
    assert arena.plan({"kv": 9}, {"swa": 5}) is None
    # With 13 to spare: slab 2 (7), then slab 3 alone (5, its straddler went with slab 2).
    grants = arena.plan({"kv": 9}, {"swa": 13})
    assert grants == [("kv", 2, "swa"), ("kv", 3, "swa")]
    arena.apply(grants)
    assert pools["swa"].usable_pages == 11 and pools["kv"].usable_pages == 16
    assert sorted(pools["swa"].free_page_ids().tolist()) == [8, 9, 10, 11, 12]
    arena.check_invariants()
    decref(pools["swa"], held)
    # Page 7 freed: slab 1 is idle too, so both of swa's slabs can go.
    assert arena.plan({"kv": 100}, {"swa": 11}, partial=True) == [("kv", 0, "swa"), ("kv", 1, "swa")]
    arena.check_invariants()


def test_a_spare_slab_next_to_the_groups_own_is_preferred():
    arena, pools = bare_arena()
    arena.apply([("kv", 0, None), ("swa", 2, None)])
    # swa is short again: slab 1 and slab 3 both touch slab 2; the lower is taken, and
    # it brings the straddling page 13 (slabs 1/2) with it.
    grants = arena.plan({"swa": 1}, {})
    assert grants == [("swa", 1, None)]
    arena.apply(grants)
    assert sorted(pools["swa"].free_page_ids().tolist()) == [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    arena.check_invariants()


def test_revoke_refuses_held_pages_and_changes_nothing():
    arena, pools = bare_arena()
    arena.apply(arena.plan({"swa": 1}, {}))
    page = allocate(pools["swa"], 1)
    with pytest.raises(ValueError, match="no request holds"):
        pools["swa"].revoke(np.arange(2, 7))
    assert pools["swa"].usable_pages == 5 and pools["swa"].num_free_pages == 4
    decref(pools["swa"], page)
    arena.check_invariants()


# --- the manager on an arena ------------------------------------------------------------
def test_manager_borrows_slabs_on_demand_worked_example():
    m = small_manager()
    assert m.stats()["kv"].total_pages == 0 and m.stats()["kv"].utilization == 0.0
    m.add_request("a", prompt_tokens=8, max_new_tokens=4)
    batch = m.schedule([("a", 8)])
    # swa (first in spec order) takes slab 0 (ids 2..6), kv slab 1 (ids 10..17); lowest ids first.
    assert batch.groups["swa"].block_table.tolist() == [[2, 3]]
    assert batch.groups["kv"].block_table.tolist() == [[10]]
    assert batch.groups["kv"].write_slots.tolist() == list(range(160, 168))
    assert m.arena.owner.tolist() == [0, 1, -1, -1]
    assert m.stats()["kv"].total_pages == 8 and m.stats()["swa"].total_pages == 5
    live_byte_ranges_disjoint(m)
    m.check_invariants()


def test_a_group_given_a_slab_takes_more_ahead_while_the_arena_stays_roomy():
    """The worked example above with ``slabs_ahead``: swa and kv each take the slab they need (0 and 1), then, in the
    order they were given slabs, up to that many more spare slabs each, the one next to their own first, else the
    lowest, while the spare slabs left stay at least the roomy count (ceil(10% of the slabs)), counting the spare
    slabs the step itself takes; the same whether the step admits itself or reuses ``check_admission``'s verdict."""
    m = small_manager(slabs=10, slabs_ahead=2)  # roomy: 1 spare slab; 10 - 2 - 1 = 7 to take ahead
    m.add_request("a", prompt_tokens=8, max_new_tokens=4)
    m.schedule([("a", 8)])
    # swa: slab 2 (the lowest: 1 is kv's), then 3 (next to 2); kv: slab 4 (none spare next to 1), then 5.
    assert m.arena.owner.tolist() == [0, 1, 0, 0, 1, 1, -1, -1, -1, -1]
    m.check_invariants()
    for admitted_first in (False, True):  # the step's own admission, or check_admission's (Python) verdict reused
        m = small_manager(slabs=4, slabs_ahead=4)  # 4 - 2 - 1 = 1 to take ahead: swa's first only
        m.add_request("a", prompt_tokens=8, max_new_tokens=4)
        if admitted_first:
            assert m.check_admission([("a", 8)])[0].ok
        m.schedule([("a", 8)])
        assert m.arena.owner.tolist() == [0, 1, 0, -1] and m.arena.num_spare_slabs == 1
        m.check_invariants()


def test_slabs_ahead_takes_a_count():
    m = small_manager()
    assert m.arena.slabs_ahead == 0
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="slabs_ahead"):
            m.arena.slabs_ahead = bad
    m.arena.slabs_ahead = np.int64(3)
    assert m.arena.slabs_ahead == 3
    # The default: SLABS_AHEAD on an arena of AHEAD_MIN_SLABS slabs or more, none on a smaller one.
    for slabs, ahead in ((AHEAD_MIN_SLABS - 1, 0), (AHEAD_MIN_SLABS, SLABS_AHEAD)):
        built = CacheManager([SWA, KV], None, max_context_tokens=256, max_step_tokens=64, arena=small_geometry(slabs))
        assert built.arena.geometry.num_slabs == slabs and built.arena.slabs_ahead == ahead
    assert (SLABS_AHEAD, AHEAD_MIN_SLABS) == (4, 512)


def test_history_grows_into_memory_the_window_group_gave_back():
    """A window-heavy burst takes 3 of 4 slabs for swa; once it is freed, one long
    request's history borrows an idle swa slab (per-group pools would be fixed)."""
    m = small_manager()
    for i in range(3):
        m.add_request(f"s{i}", prompt_tokens=20)
    m.schedule([(f"s{i}", 20) for i in range(3)])  # swa 3 x 5 pages = slabs 0-2, kv 3 x 2 = slab 3
    assert m.arena.owner.tolist() == [0, 0, 0, 1]
    live_byte_ranges_disjoint(m)
    for i in range(3):
        m.free(f"s{i}")
    m.add_request("long", prompt_tokens=200)
    for _ in range(25):
        assert m.check_admission([("long", 8)])[0].ok
        m.schedule([("long", 8)])
        live_byte_ranges_disjoint(m)
    m.check_invariants()
    # kv needed a 9th page at token 128: swa's slab 0 holds the window (lowest ids),
    # slab 1 was wholly idle and moved.
    assert m.arena.owner.tolist() == [0, 1, 0, 1] and m.arena.slab_moves == 1
    assert m.request_pages("long", "kv")[1].size == 13


def test_refusal_names_the_arena_and_changes_nothing():
    m = small_manager(slabs=2)
    m.add_request("a", prompt_tokens=200)
    m.schedule([("a", 8)])
    before = ({g: (p.ref_counts.tolist(), p.usable_pages) for g, p in m.pools.items()}, m.arena.owner.tolist())
    [adm] = m.check_admission([("a", 64)])
    assert not adm.ok and "no slab of the shared arena can be lent" in adm.reason
    with pytest.raises(CacheManagerError, match="not admissible"):
        m.schedule([("a", 64)])
    after = ({g: (p.ref_counts.tolist(), p.usable_pages) for g, p in m.pools.items()}, m.arena.owner.tolist())
    assert after == before
    m.check_invariants()


def test_reclaim_evicts_cached_pages_of_the_donor_slab():
    arena, pools = bare_arena()
    removed = []
    pools["kv"].on_removed = lambda key, cause, idle: removed.append((key, cause, idle))
    arena.apply(arena.plan({"kv": 32}, {}))  # all 4 slabs to kv
    pages = allocate(pools["kv"], 3)  # 2, 3, 4 in slab 0
    assert publish(pools["kv"], "block", pages)
    decref(pools["kv"], pages)
    assert pools["kv"].num_evictable_pages == 3
    grants = arena.plan({"swa": 1}, {"kv": 8})
    assert grants == [("swa", 0, "kv")]  # slab 0: 3 evictable + 5 free pages
    arena.apply(grants)
    assert removed == [("block", "revoked", 3)] and pools["kv"].counters.evicted_pages == 3
    assert pools["kv"].num_cached_pages == 0 and pools["kv"].usable_pages == 24
    arena.check_invariants()


def test_from_plan_builds_the_plans_page_space_unless_told_otherwise():
    """``plan_for_budget`` plans a shared arena by default and ``from_plan`` builds the
    plan's own page space; an explicit ``page_space`` wins (a per-group plan's budget also
    makes an arena; a shared plan's per-group figures make pools when they fit it)."""
    layout = cache_layout("deepseek-v4-flash", indexer="fp8")
    shared = plan_for_budget(layout, 2 << 30, Limits(8, 2048, 32768))
    per_group = plan_for_budget(layout, 2 << 30, Limits(8, 2048, 32768), page_space="per-group")
    assert (shared.page_space, per_group.page_space) == ("shared", "per-group")
    for m in (CacheManager.from_plan(shared), CacheManager.from_plan(per_group, page_space="shared")):
        assert m.arena is not None and m.arena.geometry == shared_arena_for(shared)
        assert m.arena.geometry.total_bytes <= 2 << 30
    for m in (CacheManager.from_plan(per_group), CacheManager.from_plan(shared, page_space="per-group")):
        assert m.arena is None and {g: p.num_pages for g, p in m.pools.items()} == per_group.group_pages
    assert CacheManager.from_plan(shared, slab_anchor_pages=4).arena.geometry.slab_bytes == 4 * 963_648


def test_from_plan_page_space_errors():
    layout = cache_layout("deepseek-v4-flash", indexer="fp8")
    limits = Limits(8, 2048, 32768)
    plan = plan_for_budget(layout, 2 << 30, limits)
    with pytest.raises(ValueError, match="page_space must be"):
        CacheManager.from_plan(plan, page_space="global")
    for not_a_name in (np.array(["shared"]), ["shared"], b"shared"):  # an array was taken as "shared" (truthy ==)
        with pytest.raises(ValueError, match="page_space must be 'shared' or 'per-group'"):
            CacheManager.from_plan(plan, page_space=not_a_name)
        with pytest.raises(ValueError, match="page_space must be 'shared' or 'per-group'"):
            plan_for_budget(layout, 2 << 30, limits, page_space=not_a_name)
    with pytest.raises(ValueError, match="only to page_space='shared'"):
        CacheManager.from_plan(plan, page_space="per-group", slab_anchor_pages=4)
    with pytest.raises(ValueError, match="only to page_space='shared'"):  # the plan's own page space
        CacheManager.from_plan(plan_for_budget(layout, 2 << 30, limits, page_space="per-group"), slab_anchor_pages=4)
    # 128 running need 2.40 GiB of per-group pools: a shared plan of 2 GiB builds an arena only.
    small = plan_for_budget(layout, 2 << 30, Limits(128, 8192, 32768))
    assert not small.fits_per_group and CacheManager.from_plan(small).arena is not None
    with pytest.raises(ValueError, match=f"per-group pools of this plan need {small.total_bytes:,} B, beyond its "
                                         f"{2 << 30:,} B budget: use page_space='shared'"):
        CacheManager.from_plan(small, page_space="per-group")


def test_low_priority_pages_are_packed_under_long_lived_pages_once_the_arena_is_not_roomy():
    """A long-lived allocation takes the lowest ids, evicting idle low-priority entries
    below them, once less than a tenth of the slabs is spare (so live pages pack low and
    the slabs above hold only idle pages an arena can lend). While the arena is roomy it
    takes the lowest free id in a slab that already holds live pages. Pages released again
    at the next step take the highest free ids and evict nothing."""
    arena, pools = bare_arena()
    kv = pools["kv"]
    arena.apply(arena.plan({"kv": 8}, {}))  # slab 0; three slabs spare
    low = allocate(kv, 2)
    assert low.tolist() == [2, 3] and publish(kv, "low", low, low_priority=True)
    decref(kv, low)
    assert allocate(kv, 1, highest=1).tolist() == [9]  # transient: the highest id, entry kept
    assert arena.roomy() and allocate(kv, 1).tolist() == [4]  # slab 0 holds a live page: kept
    assert kv.lookup("low") == (2, 3) and kv.space.skip_packing.all()  # what the step kernel reads
    arena.apply(arena.plan({"swa": 15}, {}))  # the other three slabs: nothing spare
    assert not arena.roomy() and not kv.space.skip_packing.any()
    assert allocate(kv, 1).tolist() == [2]  # ids 2, 3 are reused in order
    assert kv.lookup("low") is None and kv.counters.evicted_pages == 2
    arena.check_invariants()


@pytest.mark.parametrize("live_slabs", [2, 3])
def test_while_roomy_live_pages_spread_over_at_most_two_slabs_more_than_they_fill(live_slabs):
    """kv owns slabs 0-5 (8 pages each, ids 2-49) of 12: roomy. One live page in each of
    the first ``live_slabs`` slabs, every other page of slabs 0-4 an idle low-priority
    entry, slab 5 free. One more live page fills one slab: in slab 5 it would spread the
    live pages over 3 slabs (allowed: 1 + 2) or 4 (not: the lowest entry, id 3, is evicted
    and its id taken)."""
    _, pools, arena = packing_arena()
    kv = pools["kv"]
    arena.apply(arena.plan({"kv": 48}, {}))
    pages = allocate(kv, 40)
    assert pages.tolist() == list(range(2, 42)) and arena.roomy()
    live = [2 + 8 * k for k in range(live_slabs)]
    for page in pages.tolist():
        if page not in live:
            assert publish(kv, ("e", page), [page], low_priority=True)
    decref(kv, np.asarray([p for p in pages.tolist() if p not in live]))
    got = allocate(kv, 1).tolist()
    assert got == ([42] if live_slabs == 2 else [3])
    assert kv.counters.evicted_pages == (0 if live_slabs == 2 else 1)
    arena.check_invariants()


def test_a_group_grows_into_a_spare_slab_instead_of_evicting_cached_pages():
    # Worked out with only each request's own checkpoints (no low-priority prompt ones).
    m = small_manager(slabs=5, enable_prefix_caching=True, prefix_granularity=16, prompt_checkpoints=False)
    a_ids = np.arange(40, dtype=np.int32)
    m.add_request("a", a_ids, max_new_tokens=1)
    m.schedule([("a", 32)])
    m.schedule([("a", 8)])  # commits [0, 32): two kv blocks published
    m.free("a")
    kv = m.pools["kv"]
    cached = kv.num_cached_pages
    assert cached == 2 and kv.num_clean_free_pages == 6 and m.arena.num_spare_slabs == 2
    # b needs 8 kv pages: 6 clean + 2 evictable would do, but a spare slab is taken instead
    # (swa, short of clean pages too, takes the other one rather than evict a's checkpoint:
    # its step's releases are not counted as room, since b's 16-token grain boundaries may
    # publish them as checkpoints first).
    m.add_request("b", 1000 + np.arange(120, dtype=np.int32), max_new_tokens=1)
    for _ in range(8):
        m.schedule([("b", 15)])
    assert kv.counters.evicted_pages == 0 and kv.num_cached_pages > cached  # b published too
    assert m.arena.slabs_owned() == {"swa": 3, "kv": 2} and m.arena.num_spare_slabs == 0
    assert m.stats()["swa"].evicted_pages == 0
    assert m.add_request("c", np.concatenate([a_ids[:33], [7]]).astype(np.int32)).hit_tokens == 32
    live_byte_ranges_disjoint(m)
    m.check_invariants()


def test_partial_plan_gives_what_there_is_in_group_order():
    arena, _ = bare_arena()
    assert arena.plan({"swa": 100, "kv": 3}, {}) is None
    # swa cannot be covered even by all four slabs (23 pages), but takes them all (it then
    # evicts less); kv, after it, is left short.
    assert arena.plan({"swa": 100, "kv": 3}, {}, partial=True) == [("swa", k, None) for k in range(4)]
    assert arena.plan({"swa": 5, "kv": 3}, {}, partial=True) == [("swa", 0, None), ("kv", 1, None)]


def test_surely_short_bounds_the_spare_slabs_and_the_donors_surplus_worked_by_hand():
    """Four spare slabs gain swa at most 5 inner pages and 2 straddlers each (28); once swa owns them all,
    kv's deficit is bounded by the slabs swa's surplus can give up, 5 inner pages each at least."""
    arena, _ = bare_arena()
    ids = np.zeros(2, dtype=np.int64)
    assert not arena.surely_short(np.array([28, -1]), ids) and arena.surely_short(np.array([29, -1]), ids)
    arena.apply(arena.plan({"swa": 20}, {}))
    assert not arena.surely_short(np.array([-1, 2 * 10]), np.array([10, 0]))  # two slabs, 8 + 2 pages of kv each
    assert arena.surely_short(np.array([-1, 2 * 10 + 1]), np.array([10, 0]))
    assert arena.surely_short(np.array([-1, 1]), np.array([4, 0]))  # less than a slab's inner pages to spare


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_surely_short_only_where_the_plan_finds_nothing(data):
    """Where ``Arena.surely_short`` says a deficit cannot be covered, ``Arena.plan`` with a scan that is not clean
    answers None: random grants, allocations, entries and releases, any surpluses, and deficits around the most a
    partial plan gets the group (which a plan covers, so the bound must let it through)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    _, pools, arena = packing_arena()
    grant_publish_release(data, rng, pools, arena, data.draw(st.integers(0, 8)), random_priority=True)
    ids, g = arena.group_ids, data.draw(st.integers(0, len(SMALL_BYTES) - 1))
    surplus = np.array([data.draw(st.integers(-5, 80)) for _ in ids], dtype=np.int64)
    deficit = np.array([data.draw(st.integers(-40, 0)) for _ in ids], dtype=np.int64)
    deficit[g] = 10**6
    most = arena.replay(arena.plan(dict(zip(ids, deficit.tolist())), dict(zip(ids, surplus.tolist())), IdleScan(),
                                   partial=True))[1].get(ids[g], 0)
    deficit[g] = max(most + data.draw(st.integers(-3, 3)), 1)
    short = arena.surely_short(deficit, surplus)
    plan = arena.plan(dict(zip(ids, deficit.tolist())), dict(zip(ids, surplus.tolist())), IdleScan())
    event(f"surely short: {short}, plan: {plan is not None}")
    assert not (short and plan is not None)


def test_pages_that_outlive_a_chunk_get_its_lowest_ids():
    """A 20-token chunk on the 8-token window keeps only logical pages 3 and 4 after the
    step; they get the lowest fresh ids, so the released ones leave slab 0's top free."""
    m = small_manager()
    m.add_request("a", prompt_tokens=40)
    batch = m.schedule([("a", 20)])
    # fresh swa ids 2..6 ascending; survivors (pages 3, 4) take 2, 3; pages 0-2 take 4-6
    assert batch.groups["swa"].block_table.tolist() == [[4, 5, 6, 2, 3]]
    assert batch.groups["swa"].write_slots[[0, 12, 16, 19]].tolist() == [16, 8, 12, 15]
    batch = m.schedule([("a", 1)])  # releases pages 0-2; position 20 takes the lowest free id
    assert batch.groups["swa"].block_table.tolist() == [[2, 3, 4]]
    assert batch.groups["swa"].base_pages.tolist() == [3]
    m.check_invariants()


# kv pages of 2 tokens, so a short step needs several kv pages while the window group
# releases a chunk's pages in the same step.
KV2 = CacheGroupSpec("kv", "full_history", rows_per_page=2, entry_stride_tokens=1)


def test_a_slab_idle_only_after_the_steps_own_release_can_be_lent():
    m = CacheManager([SWA, KV2], None, max_context_tokens=256, max_step_tokens=64, arena=small_geometry(5))
    m.add_request("a", prompt_tokens=60)
    m.schedule([("a", 40)])
    # swa: 10 of the 11 pages of slabs 0-1 (ids 2..12, straddler 7 included): the 2
    # survivors take the lowest free ids (2, 3), the 8 transient pages the highest
    # (5..12); kv: 20 of the 24 pages of slabs 2-4.
    assert m.arena.owner.tolist() == [0, 0, 1, 1, 1]
    assert sorted(m.request_pages("a", "swa")[1].tolist()) == [2, 3] + list(range(5, 13))
    # 12 more tokens: swa releases pages 0-7 (ids 5..12) and needs 3; kv needs 6 and has
    # 4 free. Slab 1 (ids 8..12, straddler 7) is idle only once the release has run.
    assert m.check_admission([("a", 12)])[0].ok
    m.schedule([("a", 12)])
    assert m.arena.owner.tolist() == [0, 1, 1, 1, 1] and m.arena.slab_moves == 1
    assert sorted(m.request_pages("a", "swa")[1].tolist()) == [2, 3, 4, 5, 6]
    assert m.request_pages("a", "kv")[1].size == 26
    live_byte_ranges_disjoint(m)
    m.check_invariants()


def test_a_step_that_must_borrow_still_grows_rather_than_evicts():
    """The grow-before-evict rule also holds on the path where a group must take
    slabs: the spare slabs go to the window group; the history group, with no spare
    slab left, evicts two blocks (prompt checkpoints off: the cached pages are worked
    out from own checkpoints only), and with them the checkpoint they were below."""
    m = small_manager(slabs=5, enable_prefix_caching=True, prompt_checkpoints=False)
    m.add_request("a", np.arange(100, dtype=np.int32), max_new_tokens=1)
    for _ in range(25):
        m.schedule([("a", 4)])
    m.free("a")
    # swa: slabs 0 and 2, 8 clean pages + the checkpoint at 96 (2 pages, cached);
    # kv: slab 1, 2 clean pages + 6 cached blocks.
    assert m.arena.owner.tolist() == [0, 1, 0, -1, -1]
    assert (m.pools["swa"].num_clean_free_pages, m.pools["swa"].num_evictable_pages) == (8, 2)
    assert (m.pools["kv"].num_clean_free_pages, m.pools["kv"].num_evictable_pages) == (2, 6)
    m.add_request("b", 1000 + np.arange(60, dtype=np.int32), max_new_tokens=1)
    # swa needs 15 pages: slab 3 (5 + the straddler with slab 2) is a must; with it swa
    # would still evict its checkpoint for the 15th page, so it takes slab 4 too. kv needs
    # 4 with 2 clean and no slab left: it evicts two blocks, the tail of a's chain first
    # (96's block, then the one below, an orphan by then), so the checkpoint at 96, which
    # needs every block below 96, goes too ("unit").
    m.schedule([("b", 60)])
    assert m.arena.owner.tolist() == [0, 1, 0, 0, 0]
    report = m.prefix.value_report()
    assert m.stats()["kv"].evicted_pages == 2 and report["kv"].evicted_pages["lru"] == 1
    assert report["kv"].evicted_pages["orphan"] == 1
    assert m.stats()["swa"].evicted_pages == 2 and report["swa"].evicted_pages["unit"] == 2
    assert m.stats()["swa"].cached_pages == 0 and report["kv"].usable_entries == 0
    live_byte_ranges_disjoint(m)
    m.check_invariants()


def test_a_group_borrows_another_groups_clean_slab_rather_than_evict_cached_pages():
    """No spare slab left: the history group, out of clean pages, would evict cached
    blocks; the window group has a slab whose pages are all free (once the step's own
    releases have run) and does not need it, so that slab is lent instead. A cached
    page goes only when no memory is idle anywhere."""
    m = CacheManager([SWA, KV], None, max_context_tokens=256, max_step_tokens=64, arena=small_geometry(4),
                     enable_prefix_caching=True, prefix_granularity=16, prompt_checkpoints=False)
    m.add_request("s", np.arange(60, dtype=np.int32), max_new_tokens=2)
    m.schedule([("s", 60)])
    m.append_token_ids("s", [5])
    m.schedule([("s", 1)])
    m.free("s")
    # swa: slabs 0-2, 15 clean pages and the checkpoint at 48 (2 pages); kv: slab 3,
    # 5 clean pages and 3 cached blocks. No spare slab.
    assert m.arena.owner.tolist() == [0, 0, 0, 1] and m.arena.num_spare_slabs == 0
    assert (m.pools["swa"].num_clean_free_pages, m.pools["swa"].num_evictable_pages) == (15, 2)
    assert (m.pools["kv"].num_clean_free_pages, m.pools["kv"].num_evictable_pages) == (5, 3)
    m.add_request("k", 1000 + np.arange(200, dtype=np.int32), max_new_tokens=1)
    for step in range(12):  # one kv page a step; kv runs out of clean pages at step 5
        m.schedule([("k", 16)])
        if step == 4:
            assert m.pools["kv"].num_clean_free_pages == 0 and m.arena.slab_moves == 0
    assert m.arena.owner.tolist() == [0, 1, 0, 1] and m.arena.slab_moves == 1
    assert m.stats()["kv"].evicted_pages == 0 and m.stats()["swa"].evicted_pages == 0
    assert m.pools["kv"].num_evictable_pages == 3  # s's blocks are still cached
    live_byte_ranges_disjoint(m)
    m.check_invariants()


def test_a_donor_of_planned_grants_is_not_asked_for_its_lent_pages_again():
    """A step that borrows slabs (planned first) and then grows instead of evicting
    (planned after) counts what the first grants took from each donor. Counting a
    donor's lent pages as still its clean pages, the second plan lends them twice and
    the step's allocation fails (it ran out of pages in this run without the donor losses
    of ``Arena.replay``)."""
    from hybridkv.sim.driver import Simulator
    from hybridkv.sim.workloads import multiturn_workload

    plan = plan_for_budget(cache_layout("deepseek-v4-flash"), int(2.5 * 2**30), Limits(64, 8192, 2**20))
    m = CacheManager.from_plan(plan, page_space="shared", enable_prefix_caching=True)
    result = Simulator(m, multiturn_workload(24, 4), max_running=64, step_token_budget=8192).run()
    assert result.summary()["requests_finished"] == 96 and m.arena.slab_moves > 0
    m.check_invariants()


def test_only_what_low_priority_pages_cannot_cover_is_evicted_from_valuable_entries():
    """A group short of clean pages in a roomy arena (one slab of five spare) takes the
    spare slab first, then evicts its idle low-priority pages (prompt checkpoints) for the
    rest of its need rather than a request's terminal checkpoint; the next turn still hits."""
    m = CacheManager([SWA, KV], None, max_context_tokens=256, max_step_tokens=64, arena=small_geometry(5),
                     enable_prefix_caching=True, prefix_granularity=16)
    a_ids = np.arange(64, dtype=np.int32)
    m.add_request("a", a_ids, max_new_tokens=2)
    m.schedule([("a", 64)])
    m.append_token_ids("a", [3])
    m.schedule([("a", 1)])
    m.free("a")
    swa = m.pools["swa"]
    # swa: 9 clean pages; 8 cached: the prompt checkpoints at 16, 32, 48 (6 pages, low
    # priority) and a's terminal at 64 (2 pages). One spare slab.
    assert (swa.num_clean_free_pages, swa.num_evictable_pages, swa.num_low_priority_idle_pages) == (9, 8, 6)
    assert m.arena.owner.tolist() == [0, 0, 0, 1, -1]
    m.add_request("b", 1000 + np.arange(100, dtype=np.int32), max_new_tokens=1)
    m.schedule([("b", 64)])  # swa needs 16 pages: 9 clean, the spare slab's, then low-priority ones
    assert m.arena.owner.tolist() == [0, 0, 0, 1, 0]
    assert m.stats()["swa"].evicted_pages == 6 and swa.num_evictable_pages == 2
    assert m.add_request("c", np.concatenate([a_ids, [3, 9]]).astype(np.int32)).hit_tokens == 64
    live_byte_ranges_disjoint(m)
    m.check_invariants()


def whole_pool_must_pack(arena, gid, page, pages):
    """The packing rule worked from every page id of the pool (``slab_of``
    of each held page), the reference for ``PagePool.must_pack``, which counts only the
    group's own slabs."""
    if not arena.roomy():
        return True
    geometry, pool = arena.geometry, arena.pools[gid]
    lo, hi = geometry.slab_page_ranges(gid)
    slab = int(slab_of(geometry, gid, [page])[0])
    if (pool.ref_counts[lo[slab] : hi[slab]] > 0).any():
        return False
    held = np.flatnonzero(pool.ref_counts > 0)
    spread = np.unique(slab_of(geometry, gid, held)).size + 1
    per_slab = max(int((hi - lo).min()), 1)
    return spread > -(-(held.size + pages) // per_slab) + SPREAD_SLABS


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_must_pack_counting_the_groups_slabs_answers_as_the_whole_pool_scan(data):
    """Random slab grants, allocations (straddling pages included) and releases in two
    groups of a 12-slab arena, roomy or not: for every free id and allocation size the
    pool's rule answers as the whole-pool reference."""
    geometry, pools, arena = packing_arena()
    for _ in range(data.draw(st.integers(1, 12))):
        gid = data.draw(st.sampled_from(sorted(SMALL_BYTES)))
        pool = pools[gid]
        arena.apply(arena.plan({gid: data.draw(st.integers(0, 30))}, {}, partial=True))
        free = pool.num_free_pages
        if free:
            allocate(pool, data.draw(st.sampled_from([free, max(free // 2, 1), 1])))
        held = np.flatnonzero(pool.ref_counts > 0)
        keep = data.draw(st.integers(0, min(held.size, 8)))  # a few live pages left, anywhere in its slabs
        order = np.random.default_rng(data.draw(st.integers(0, 2**16))).permutation(held)
        if data.draw(st.booleans()):  # keep pages straddling two slabs first
            order = order[np.argsort(~np.isin(order, geometry.boundary_pages(gid)), kind="stable")]
        decref(pool, order[keep:])
    arena.check_invariants()
    for gid, pool in pools.items():
        g, per_group = arena.group_ids.index(gid), pool.space.per_group
        for page in pool.free_page_ids().tolist():
            for pages in (1, 3, 9):
                must = whole_pool_must_pack(arena, gid, page, pages)
                assert pool.must_pack(page, pages) == must
                # The rule's test before its scans (the pool's counts alone, none of its keyed idle pages left out
                # of its LRU) never rules out a pack.
                assert not arena.roomy() or must == kernels.must_pack_at(pool.ref_counts, 0, arena.packing, g, page,
                                                                         pages, per_group, np.zeros(2, np.int64))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_room_groups_on_an_arena_leaves_out_only_groups_whose_make_room_evicts_nothing(data):
    """``kernels.room_groups`` with the arena's packing rule (``Arena.packing``, ``must_pack_at``): after
    random grants, entries of either priority and releases in a 12-slab arena (roomy or not), a group
    it leaves out for an allocation of ``count`` pages is one whose ``make_room`` changes nothing (no
    entry evicted, the free stack as it was), and one it names whose free stack covers the allocation
    is one the packing rule (``must_pack``) tells to pack, with an idle low-priority page below the ids
    the allocation takes (``kernels.low_below``); where the rule lets the pages spread, it leaves out a
    group that has such pages."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    geometry, pools, arena = packing_arena()
    grant_publish_release(data, rng, pools, arena, data.draw(st.integers(1, 8)), True)
    space, (g, gid) = arena.pools["kv"].space, data.draw(st.sampled_from(list(enumerate(arena.group_ids))))
    pool = pools[gid]
    count = data.draw(st.integers(1, max(pool.num_free_pages, 1)))
    sums, out = np.zeros((2, 2), dtype=np.int64), np.empty(2, dtype=np.int64)
    sums[1, g] = count
    none, ids = np.zeros(0, dtype=np.int64), np.zeros((2, 8), dtype=np.int64)
    ids[:, kernels.ID_OFFSET] = space.offsets  # the rule reads the roomy arena in ``PageSpace.skip_packing``
    kernels.room_groups(ids, np.zeros((3, 2, 0), dtype=np.int64), np.zeros(2, dtype=np.bool_), none, none, none,
                        np.zeros((2, 2, 0), dtype=np.int64), sums, space.stack, space.per_group, space.ref_counts,
                        space.cached, space.low_priority, arena.packing, out, 0, None, None)
    free = pool.free_page_ids()  # the lowest on top: the allocation's highest id is free[-count]
    low_below = count <= free.size and (pool.low_priority & pool.cached & (pool.ref_counts == 0))[: free[-count]].any()
    event("left out with low-priority pages below" if out[g] < 0 and low_below else "other")
    if out[g] < 0:
        before, evicted = pool.free_page_ids().tolist(), pool.counters.evicted_pages
        pool.make_room(count, 0)
        assert pool.free_page_ids().tolist() == before and pool.counters.evicted_pages == evicted
    elif count <= free.size:  # named, its free stack covering the allocation: the rule packs (``make_room``'s packs)
        assert pool.must_pack(int(free[-count]), count) and low_below


def test_live_pages_straddling_two_slabs_count_for_the_slab_of_their_first_byte():
    """swa owns slabs 0-5 of 12 (roomy) and holds only the five pages straddling their
    boundaries (ids 7, 13, 19, 25, 31: first bytes in slabs 0-4). Live pages then lie in
    5 slabs though they fill one: any long-lived page in a slab without live inner pages
    must reuse lower ids first (5 + 1 > ceil(6 / 5) + 2)."""
    geometry, pools, arena = packing_arena()
    swa = pools["swa"]
    arena.apply(arena.plan({"swa": 30}, {}))
    straddling = [7, 13, 19, 25, 31]
    assert geometry.boundary_pages("swa")[1:6].tolist() == straddling
    pages = allocate(swa, swa.num_free_pages)
    decref(swa, np.asarray([p for p in pages.tolist() if p not in straddling]))
    assert arena.roomy() and np.flatnonzero(swa.ref_counts > 0).tolist() == straddling
    for page in swa.free_page_ids().tolist():
        assert swa.must_pack(page, 1) and whole_pool_must_pack(arena, "swa", page, 1)
    assert swa.must_pack(2, 10) and not swa.must_pack(2, 11)  # 6 > ceil(15 / 5) + 2, not ceil(16 / 5) + 2


def whole_pool_idle_slabs(arena, gid, keyed_mode, before_tick, released):
    """The reference of ``kernels.idle_slabs``: every idle page id of the pool listed
    (free stack, idle keyed pages that count, the released ones), then counted per slab."""
    geometry, pool = arena.geometry, arena.pools[gid]
    keyed = pool.evictable_page_ids()
    if keyed_mode == 0:
        keyed = keyed[:0]
    elif keyed_mode == 2:
        keyed = keyed[pool.low_priority[keyed] | (pool.idle_tick[keyed] < before_tick)]
    idle = np.concatenate([pool.free_page_ids().astype(np.int64), keyed, released])
    first = slab_of(geometry, gid, idle)
    last = ((idle + 1) * geometry.page_bytes[gid] - 1 - geometry.reserved_bytes) // geometry.slab_bytes
    lo, hi = geometry.slab_page_ranges(gid)
    inner_idle = np.bincount(first[first == last], minlength=geometry.num_slabs) == hi - lo
    edge_idle = np.zeros(geometry.num_slabs, dtype=bool)
    edge_idle[last[first != last]] = True
    return inner_idle, edge_idle, keyed.size


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_idle_slabs_and_the_oldest_idle_tick_answer_as_the_whole_pool_scan(data):
    """Random slab grants, allocations, published entries (low priority or not) and
    releases in two groups of a 12-slab arena: for each way of counting idle keyed
    pages and some pages released by the step, ``kernels.idle_slabs`` over the slabs a
    group owns finds the same idle slabs, idle straddlers and keyed pages counted as a
    scan of every idle page of the pool; ``PagePool.oldest_idle_tick`` (a walk of the pool's
    LRU) the same oldest normal-priority idle page as the pool's flags, and
    ``PagePool.normal_tick_at(n)`` the ``n``-th least tick among those pages (past the
    last: its tick + 1)."""
    from hybridkv.runtime import kernels

    geometry, pools, arena = packing_arena()
    for step in range(data.draw(st.integers(1, 12))):
        gid, pool = grant_and_allocate(data, pools, arena)
        held = np.flatnonzero((pool.ref_counts > 0) & ~pool.cached)
        rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
        for k, page in enumerate(rng.permutation(held)[: data.draw(st.integers(0, held.size))].tolist()):
            publish(pool, (step, gid, k), [page], low_priority=bool(rng.integers(2)))
        held = np.flatnonzero(pool.ref_counts > 0)
        decref(pool, rng.permutation(held)[: data.draw(st.integers(0, held.size))])
    arena.check_invariants()
    for gid, pool in pools.items():
        lo, hi = geometry.slab_page_ranges(gid)
        straddle, gi = geometry.boundary_pages(gid), arena.group_ids.index(gid)
        held = np.flatnonzero(pool.ref_counts == 1)
        released = np.sort(held[: data.draw(st.integers(0, held.size))]).astype(np.int64)
        first = slab_of(geometry, gid, released)
        last = ((released + 1) * geometry.page_bytes[gid] - 1 - geometry.reserved_bytes) // geometry.slab_bytes
        slab_geometry = np.asarray([geometry.page_bytes[gid], geometry.reserved_bytes, geometry.slab_bytes])
        ticks = pool.idle_tick[pool.evictable_page_ids()]
        for keyed_mode, before_tick in [(0, 0), (1, 0)] + [(2, int(t)) for t in np.unique(ticks)[:3]] + [(2, 2**40)]:
            inner_idle = np.zeros(geometry.num_slabs, dtype=bool)
            edge_idle = np.zeros(geometry.num_slabs, dtype=bool)
            counted = kernels.idle_slabs(arena.owner, gi, lo, hi, straddle, pool.ref_counts, pool.cached,
                                         pool.low_priority, pool.idle_tick, keyed_mode, before_tick, released,
                                         slab_geometry, inner_idle, edge_idle)
            want_inner, want_edge, want_counted = whole_pool_idle_slabs(arena, gid, keyed_mode, before_tick, released)
            assert inner_idle.tolist() == want_inner.tolist()
            assert counted == want_counted
            owned = np.flatnonzero((arena.owner[1:] == gi) & (arena.owner[:-1] == gi) & (straddle[1:] >= 0)) + 1
            released_edges = last[first != last]
            assert np.flatnonzero(edge_idle).tolist() == np.flatnonzero(want_edge).tolist()
            assert set(np.flatnonzero(edge_idle).tolist()) <= set(owned.tolist()) | set(released_edges.tolist())
        normal = np.flatnonzero(pool.cached & (pool.ref_counts == 0) & ~pool.low_priority)  # from the flags
        assert pool.oldest_idle_tick() == (int(pool.idle_tick[normal].min()) if normal.size else None)
        ticks = np.sort(pool.idle_tick[normal])
        for n in range(1, normal.size + 2):
            assert pool.normal_tick_at(n) == (None if not normal.size else int(ticks[n - 1]) if n <= normal.size
                                              else int(ticks[-1]) + 1)


def reference_donor_slabs(arena, own, gid, donor, short, left, inner_idle, edge_idle):
    """``donor``'s slabs for ``gid``, lowest first, one at a time, with every count worked out from the geometry:
    a slab goes when its inner pages and the straddlers the donor gives up with it are idle (``inner_idle``,
    ``edge_idle``) and the donor keeps ``left`` >= 0 (``own`` updated). Returns (slabs, still short, left)."""
    geometry, di, gi, slabs = arena.geometry, arena.group_ids.index(donor), arena.group_ids.index(gid), []

    def edges(group, slab):
        index, st = arena.group_ids.index(group), geometry.boundary_pages(group)
        return [b for b, near in ((slab, slab - 1), (slab + 1, slab + 1))
                if 0 <= near < geometry.num_slabs and own[near] == index and st[b] >= 0]

    def count(group, slab):
        lo, hi = geometry.slab_page_ranges(group)
        return int(hi[slab] - lo[slab]) + len(edges(group, slab))

    for slab in range(geometry.num_slabs):
        if short <= 0:
            break
        if own[slab] != di or not inner_idle[slab]:
            continue
        give = count(donor, slab)
        if give > left or not all(edge_idle[b] for b in edges(donor, slab)):
            continue
        left -= give
        own[slab] = -1
        short -= count(gid, slab)
        own[slab] = gi
        slabs.append(slab)
    return slabs, short, left


def slab_by_slab_pages(geometry, owner, index, grants):
    """Reference for granting spare slabs: each grant's pages from the geometry alone,
    one slab at a time (inner pages, then the straddler of each boundary with a slab
    the group owns by then): the sorted ids each group gains."""
    own, gained = owner.copy(), {gid: [] for gid in index}
    for gid, slab, _ in grants:
        lo, hi = geometry.slab_page_ranges(gid)
        st = geometry.boundary_pages(gid)
        gained[gid] += range(int(lo[slab]), int(hi[slab]))
        for boundary, near in ((slab, slab - 1), (slab + 1, slab + 1)):
            if 0 <= near < geometry.num_slabs and own[near] == index[gid] and st[boundary] >= 0:
                gained[gid].append(int(st[boundary]))
        own[slab] = index[gid]
    return {gid: sorted(pages) for gid, pages in gained.items()}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_spare_plan_is_the_plan_whenever_spare_slabs_surely_cover_and_grants_as_slab_by_slab(data):
    """``plan_spare`` (one compiled pass) answers ``plan``'s grants when spare slabs alone
    surely cover every short group (a slab holds at least ``slab_bytes // page_bytes - 1``
    pages of it), else None; applying spare grants (one run per pool) gives each pool
    the pages the slab-by-slab reference lists, on top of what it had."""
    geometry, pools, arena = packing_arena(data.draw(st.integers(2, 12)))
    for _ in range(data.draw(st.integers(0, 4))):
        grant_and_allocate(data, pools, arena)
    ids = arena.group_ids
    short = np.asarray([data.draw(st.integers(-3, 40)) for _ in ids], dtype=np.int64)
    owner = arena.owner.copy()
    per_slab = {gid: geometry.slab_bytes // geometry.page_bytes[gid] - 1 for gid in ids}
    need = sum(-(-int(n) // per_slab[gid]) for gid, n in zip(ids, short.tolist()) if n > 0)
    got = arena.plan_spare(short)
    assert np.array_equal(arena.owner, owner)  # pure
    if need > arena.num_spare_slabs:
        assert got is None
        return
    assert got == arena.plan({gid: int(n) for gid, n in zip(ids, short.tolist())}, {}, partial=True)
    before = {gid: sorted(pool.free_page_ids().tolist()) for gid, pool in pools.items()}
    want = slab_by_slab_pages(geometry, owner, {gid: i for i, gid in enumerate(ids)}, got)
    arena.apply(got)
    for gid, pool in pools.items():
        assert sorted(pool.free_page_ids().tolist()) == sorted(before[gid] + want[gid])
    assert arena.num_spare_slabs == int(np.count_nonzero(owner < 0)) - len(got)
    arena.check_invariants()


def test_granting_a_slab_that_is_not_spare_is_refused_and_changes_nothing():
    arena, pools = bare_arena()
    arena.apply([("swa", 1, None)])
    owner, usable = arena.owner.copy(), pools["kv"].usable_pages
    with pytest.raises(AssertionError, match="not spare"):
        arena.apply([("kv", 2, None), ("kv", 1, None)])
    assert np.array_equal(arena.owner, owner) and pools["kv"].usable_pages == usable


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_take_donor_slabs_lends_as_the_one_at_a_time_reference(data):
    """``kernels.take_donor_slabs`` given ``idle_slabs``' answers over the slabs the donor
    owns takes the slabs, and leaves the counts, of the one-at-a-time reference given the
    whole-pool scan's answers: random grants, allocations, entries (low priority or not),
    releases, pages the step frees, every way of counting keyed pages, and plan owners that
    already moved some slabs."""
    from hybridkv.runtime import kernels

    geometry, pools, arena = packing_arena()
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    grant_publish_release(data, rng, pools, arena, data.draw(st.integers(1, 10)), random_priority=True)
    donor = data.draw(st.sampled_from(sorted(SMALL_BYTES)))
    group = next(g for g in SMALL_BYTES if g != donor)
    pool, di, gi = pools[donor], arena.group_ids.index(donor), arena.group_ids.index(group)
    lo, hi = geometry.slab_page_ranges(donor)
    straddle = geometry.boundary_pages(donor)
    held = np.flatnonzero(pool.ref_counts == 1)
    released = np.sort(rng.permutation(held)[: data.draw(st.integers(0, held.size))]).astype(np.int64)
    slab_geometry = np.asarray([geometry.page_bytes[donor], geometry.reserved_bytes, geometry.slab_bytes])
    own = arena.owner.copy()
    for slab in np.flatnonzero(own == di).tolist():  # a plan may have moved some already
        if rng.integers(4) == 0:
            own[slab] = gi
    g_lo, g_hi = geometry.slab_page_ranges(group)
    g_straddle = geometry.boundary_pages(group)
    left, short = data.draw(st.integers(-2, 60)), data.draw(st.integers(1, 60))
    ticks = np.unique(pool.idle_tick[pool.evictable_page_ids()])
    for keyed_mode, before_tick in [(0, 0), (1, 0), (2, 0), (2, int(ticks[len(ticks) // 2]) if ticks.size else 5)]:
        inner_idle = np.zeros(geometry.num_slabs, dtype=bool)
        edge_idle = np.zeros(geometry.num_slabs, dtype=bool)
        kernels.idle_slabs(arena.owner, di, lo, hi, straddle, pool.ref_counts, pool.cached, pool.low_priority,
                           pool.idle_tick, keyed_mode, before_tick, released, slab_geometry, inner_idle, edge_idle)
        got_own, got_taken = own.copy(), np.empty(geometry.num_slabs, dtype=np.int64)
        got = kernels.take_donor_slabs(got_own, di, gi, lo, hi, straddle, g_hi - g_lo, g_straddle, left, short,
                                       got_taken, inner_idle, edge_idle)
        want_own = own.copy()
        want_inner, want_edge, _ = whole_pool_idle_slabs(arena, donor, keyed_mode, before_tick, released)
        slabs, want_short, want_left = reference_donor_slabs(arena, want_own, group, donor, short, left,
                                                             want_inner, want_edge)
        assert got == (len(slabs), want_short, want_left)
        assert got_taken[: got[0]].tolist() == slabs
        assert np.array_equal(got_own, want_own)


def test_a_clean_scan_counts_a_state_donors_entries_up_to_where_the_short_groups_would_evict(monkeypatch):
    """Every clean scan a step plans with (60 six-turn conversations served in turn on a 2 GiB shared arena): a
    history donor's keyed pages count idle since before the oldest normal-priority idle tick of the wanting groups,
    a state donor's since before the latest tick a wanting group's own evictions would reach (its low-priority idle
    pages first, then ``n`` normal ones: the ``n``-th least tick, past the last one its tick + 1), worked from each
    pool's flags at that moment."""
    from bench_support import load_bench_script
    from hybridkv.sim.workloads import in_waves, multiturn_workload

    sweep = load_bench_script("hit_sweep.py", "hit_sweep_for_ticks")
    real_plan, checked = Arena.plan, []

    def reference(pools, wanting):
        oldest, reached = [], []
        for gid, short in wanting.items():
            pool = pools[gid]
            idle = pool.cached & (pool.ref_counts == 0)
            ticks = np.sort(pool.idle_tick[idle & ~pool.low_priority])
            if not ticks.size:
                continue
            n = short - int(np.count_nonzero(idle & pool.low_priority))
            oldest.append(int(ticks[0]))
            reached.append(int(ticks[0]) if n <= 1 else int(ticks[n - 1]) if n <= ticks.size else int(ticks[-1]) + 1)
        return (min(oldest), max(reached + oldest)) if oldest else (None, None)

    def plan(arena, deficit, surplus, scan=None, **kw):
        if scan is not None and scan.clean:
            before, state_tick = reference(arena.pools, {g: n for g, n in deficit.items() if n > 0})
            assert scan.before_tick == before
            assert scan.group_ticks == (None if before is None else dict.fromkeys(state_ids, state_tick))
            checked.append(before is not None)
        return real_plan(arena, deficit, surplus, scan, **kw)

    side = sweep.make_side("hybridkv shared", 2 * 2**30, 131_072, None)
    state_ids = side.manager.prefix.state_ids  # the state groups that store checkpoints
    monkeypatch.setattr(Arena, "plan", plan)
    sweep.serve_in_order(side, in_waves(multiturn_workload(60, 6, seed=0), 60)[:240])
    assert sum(checked) > 20


def test_a_step_asks_make_room_of_the_same_groups_as_asking_every_allocating_group(vs, monkeypatch):
    """``kernels.room_groups`` leaves out groups whose ``make_room`` would evict nothing, and
    once one group evicted (telling of a removal can drop or demote entries of later
    groups) it names the later groups again (from ``start``), and a group named with its
    free stack covering the allocation packs without asking ``must_pack`` (``packs``): 120
    six-turn conversations served one request at a time on a 2 GiB shared arena
    (bench/hit_sweep.py's multiturn line) give the same hits and the same per-group counts
    (evictions by reason, cached pages, slabs) as with a reference that names every
    allocating group, each ``make_room`` applying its whole rule."""
    from bench_support import load_bench_script

    sweep = load_bench_script("hit_sweep.py", "hit_sweep_for_room")
    from hybridkv.runtime import kernels
    from hybridkv.sim.workloads import in_waves, multiturn_workload

    real = kernels.room_groups

    def every_allocating_group(geometry, bounds, transient, rows, first, counts, after, sums, *rest):
        real(geometry, bounds, transient, rows, first, counts, after, sums, *rest)
        out, start = rest[6], rest[7]  # after the stack ... low priority and packing
        for g in range(start, out.size):
            if out[g] < 0 and sums[1, g] > 0:
                out[g] = kernels.transient_pages(geometry, bounds, transient, g, rows, first, counts, after, sums)
        return int(np.count_nonzero(out[start:] >= 0))

    from hybridkv.memory.pool import PagePool

    real_make_room = PagePool.make_room

    def make_room_asking(pool, count, highest=0, packs=False):  # the reference's: its own rule in whole
        real_make_room(pool, count, highest)

    runs = []
    for room_groups, make_room in ((real, real_make_room), (every_allocating_group, make_room_asking)):
        monkeypatch.setattr(kernels, "room_groups", room_groups)
        monkeypatch.setattr(PagePool, "make_room", make_room)
        side = sweep.make_side("hybridkv shared", 2 * 2**30, 131_072, None)
        hits = sweep.serve_in_order(side, in_waves(multiturn_workload(120, 6, seed=0), 40))
        runs.append((hits.tolist(), sweep.group_diagnostics(side)))
    assert runs[0] == runs[1]


_LOADS_AFTER_A_DONOR_MOVE = """
from hybridkv.runtime import kernels
from hybridkv.runtime.manager import CacheManager
from hybridkv.spec import CacheGroupSpec
from hybridkv.memory.arena import arena_geometry

def loaded():
    return {name: len(f.signatures) for name, f in vars(kernels).items() if hasattr(f, "signatures")}

specs = [CacheGroupSpec("swa", "sliding_window", 4, 1, sliding_window_tokens=8, family="state"),
         CacheGroupSpec("kv", "full_history", rows_per_page=16, entry_stride_tokens=1)]
m = CacheManager(specs, None, max_context_tokens=256, max_step_tokens=64,
                 arena=arena_geometry({"swa": 40, "kv": 30}, 60 + 240 * 4 + 17, anchor_group="kv", slab_anchor_pages=8))
for i in range(3):
    m.add_request(f"s{i}", prompt_tokens=20)
m.schedule([(f"s{i}", 20) for i in range(3)])
for i in range(3):
    m.free(f"s{i}")
m.add_request("long", prompt_tokens=200)
m.schedule([("long", 8)])
before = loaded()
for _ in range(24):
    m.schedule([("long", 8)])
assert m.arena.slab_moves == 1, m.arena.slab_moves
print(sorted(name for name, n in loaded().items() if n != before[name]))
"""


def test_a_donor_slab_move_loads_no_kernel_the_arena_did_not_load_when_built():
    """A step that lends a donor's slab (``test_history_grows_into_memory_the_window_group_gave_back``)
    runs kernels loaded already (``Arena._load_kernels``; those of ``_admit`` and ``_run``'s
    Python path, which earlier steps admitted in compiled calls skip: ``CacheManager._load_kernels``),
    with the types it calls them with:
    in a fresh process, none gets a new compiled signature then."""
    if os.environ.get("NUMBA_DISABLE_JIT") == "1":
        pytest.skip("kernels run as plain Python")
    done = subprocess.run([sys.executable, "-c", _LOADS_AFTER_A_DONOR_MOVE], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"



def test_a_geometry_the_arena_cannot_lend_is_refused():
    """A hand-built geometry: ints only, a slab or more, the null pages in the head, a whole page of every group
    in every slab (``small_geometry``: head 60 B, slabs 240 B, pages 40 B "swa" and 30 B "kv")."""
    g = small_geometry()
    swap = lambda **kw: dataclasses.replace(g, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="num_slabs must be positive, got 0"):
        swap(num_slabs=0)
    with pytest.raises(ValueError, match="slab_bytes must be an integer"):
        swap(slab_bytes=240.0)
    with pytest.raises(ValueError, match=r"page_bytes\['kv'\] must be positive"):
        swap(page_bytes={"swa": 40, "kv": 0})
    with pytest.raises(ValueError, match="at least one group"):
        swap(page_bytes={})
    with pytest.raises(ValueError, match="39 B head cannot hold the null page of group 'swa'"):
        swap(reserved_bytes=39)
    # 50 B slabs: slab 0 is [60, 110), which holds no 40 B page (they start at 40, 80, 120).
    with pytest.raises(ValueError, match="slab of 50 B after a 60 B head holds no whole 40 B page of group 'swa'"):
        swap(slab_bytes=50)
    # 60 B slabs: [60, 120) holds [80, 120), [120, 180) holds [120, 160), and so on; 30 B pages tile them.
    assert swap(slab_bytes=60).fewest_slab_pages("swa") == 1
    assert type(swap(reserved_bytes=np.int64(40)).reserved_bytes) is int
