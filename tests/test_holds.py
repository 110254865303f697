"""Pages held outside any request (``CacheManager.hold_pages`` / ``release_held_pages``, the pages
listed group-major, as a tier offload's pins take them) against a plain reference on a twin
manager: ``PagePool.incref`` / ``PagePool.decref`` of each group's pages in turn (the pool's own
rules: a page whose last reference goes is free, or, keyed, joins the LRU in listed order) with
the holds counted in a ``Counter``.

Random programs hold pages a live request holds, cached pages no request holds (keyed, idle in
the LRU) and repeated ids, free the request in between (so releases leave pages free or idle),
release more than is held and hold a free page (both refused whole, nothing changes). After every call the two
managers agree on ref counts, holds, the free stacks and the LRU order (``free_page_ids``,
``evictable_page_ids``).
"""

from collections import Counter

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_tokens
from hybridkv.reference.config import ReferenceConfig
from hybridkv.runtime.manager import CacheManager, CacheManagerError
from pool_ops import decref, incref

CONFIG = ReferenceConfig()
LAYOUT = cache_layout(CONFIG.hf_config(), speculative_tokens=3)
LIMITS = Limits(max_running_requests=4, max_scheduled_tokens=512, max_context_tokens=1024, speculative_tokens=3)


def build(page_space: str) -> CacheManager:
    """A request "a" computed and freed (its published pages idle in the LRU) and a request
    "b" sharing its first 512 tokens, computed and still running."""
    plan = plan_for_tokens(LAYOUT, 2048, LIMITS)
    m = CacheManager.from_plan(plan, shuffle_seed=3, enable_prefix_caching=True, prefix_granularity=256,
                               page_space=page_space)
    rng = np.random.default_rng(4)
    shared = rng.integers(0, CONFIG.vocab_size, 512)
    for rid, length in (("a", 700), ("b", 900)):
        tokens = np.concatenate([shared, rng.integers(0, CONFIG.vocab_size, length - 512)])
        m.add_request(rid, tokens, max_new_tokens=4)
        while (done := m.num_computed_tokens(rid)) < length:
            m.schedule([(rid, min(512, length - done))])
        if rid == "a":
            m.free(rid)
    return m


def candidates(m: CacheManager, gid: str) -> list[int]:
    """Pages of group ``gid`` a hold may name: held by "b" (while it runs) and cached idle ones."""
    held = m.request_pages("b", gid)[1].tolist() if m.has_request("b") else []
    return held + m.pools[gid].evictable_page_ids().tolist()


def state(m: CacheManager) -> list:
    return [(p.ref_counts.tolist(), p.free_page_ids().tolist(), p.evictable_page_ids().tolist(),
             p.counters.released_pages) for p in m.pools.values()]


def reference_hold(m: CacheManager, pages_by_group: dict, holds: Counter) -> None:
    for gid, pages in pages_by_group.items():
        incref(m.pools[gid], pages)
        holds.update((gid, p) for p in pages.tolist())


def reference_release(m: CacheManager, pages_by_group: dict, holds: Counter) -> None:
    for gid, pages in pages_by_group.items():
        holds.subtract((gid, p) for p in pages.tolist())
        decref(m.pools[gid], pages)


def group_major(m: CacheManager, pages_by_group: dict) -> tuple[np.ndarray, np.ndarray]:
    """``pages_by_group`` as ``CacheManager.hold_pages`` takes them."""
    gids = [spec.group_id for spec in m.specs]
    none = np.zeros(0, dtype=np.int64)
    local = np.concatenate([np.asarray(pages_by_group.get(g, none), dtype=np.int64) for g in gids])
    return local, np.array([len(pages_by_group.get(g, ())) for g in gids], dtype=np.int64)


def hold(m: CacheManager, pages_by_group: dict) -> None:
    m.hold_pages(*group_major(m, pages_by_group))


def release(m: CacheManager, pages_by_group: dict) -> None:
    m.release_held_pages(*group_major(m, pages_by_group))


PICKS = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10_000)), max_size=12)
OPS = st.lists(st.tuples(st.sampled_from(["hold", "hold", "release", "release", "over", "hold free", "free"]),
                         PICKS),
               min_size=1, max_size=12)


@pytest.mark.parametrize("page_space", ["per-group", "shared"])
@settings(max_examples=30, deadline=None)
# A cached idle page held twice, then both holds released in one call: its last reference goes,
# so it joins the LRU (a fast path once took "every page held more than once" as "held still").
@example(ops=[("free", []), ("hold", [(0, 0), (0, 0)]), ("release", [(0, 0), (0, 0)])])
@given(ops=OPS)
def test_holding_and_releasing_follows_the_pools_rules(page_space, ops):
    m, ref = build(page_space), build(page_space)
    gids = list(m.pools)
    holds: Counter = Counter()
    assert state(m) == state(ref)
    for op, picks in ops:
        if op == "free":
            if m.has_request("b"):
                m.free("b")
                ref.free("b")
        elif op == "hold":
            chosen: dict[str, list[int]] = {}
            for g, k in picks:
                pool = candidates(m, gids[g % len(gids)])
                if pool:
                    chosen.setdefault(gids[g % len(gids)], []).append(pool[k % len(pool)])
            arrays = {gid: np.asarray(p, dtype=np.int64) for gid, p in chosen.items()}
            hold(m, arrays)
            reference_hold(ref, arrays, holds)
        elif op == "hold free":  # a free page among held ones: refused whole
            gid = gids[picks[0][0] % len(gids)] if picks else gids[-1]
            free = m.pools[gid].free_page_ids()
            if not free.size:
                continue
            chosen = {g: candidates(m, g)[:2] for g in gids}
            chosen[gid] = chosen[gid] + [int(free[picks[0][1] % free.size] if picks else free[0])]
            before = state(m)
            with pytest.raises(CacheManagerError, match="is free"):
                hold(m, {g: np.asarray(p, dtype=np.int64) for g, p in chosen.items()})
            assert state(m) == before
        else:
            held = sorted(key for key, n in holds.items() for _ in range(n))
            chosen = {}
            for _, k in picks:
                if held:
                    gid, page = held.pop(k % len(held))
                    chosen.setdefault(gid, []).append(page)
            if op == "over" and chosen:  # one page more often than it is held: refused whole
                gid = next(iter(chosen))
                chosen[gid].extend([chosen[gid][0]] * (holds[(gid, chosen[gid][0])] + 1 - chosen[gid].count(
                    chosen[gid][0])))
                before = state(m)
                with pytest.raises(CacheManagerError, match="did not hold"):
                    release(m, {g: np.asarray(p) for g, p in chosen.items()})
                assert state(m) == before
                continue
            arrays = {gid: np.asarray(p, dtype=np.int64) for gid, p in chosen.items()}
            release(m, arrays)
            reference_release(ref, arrays, holds)
        assert state(m) == state(ref)
        assert [m.held_outside_pages(g) for g in gids] == [
            sum(n for (h, _), n in holds.items() if h == g) for g in gids]
        m.check_invariants()


@pytest.mark.parametrize("page_space", ["shared", "per-group"])
def test_a_page_out_of_range_names_the_first_group_in_the_manager_s_order_that_has_one(page_space):
    m = build(page_space)
    gids = [spec.group_id for spec in m.specs]
    first, last = gids[0], gids[-1]
    before = state(m)
    out_of_range = {last: np.array([1, m.pools[last].num_pages]), first: np.array([1])}
    with pytest.raises(CacheManagerError, match=f"group {last!r}: page ids must lie in \\[1, {m.pools[last].num_pages}\\)"):
        hold(m, out_of_range)
    with pytest.raises(CacheManagerError, match=f"group {first!r}: page ids"):
        hold(m, {last: np.array([m.pools[last].num_pages]), first: np.array([0])})
    with pytest.raises(CacheManagerError, match=f"group {gids[1]!r}: releasing"):
        release(m, {gids[1]: np.array([-1]), last: np.array([m.pools[last].num_pages])})
    assert state(m) == before  # refused whole


@pytest.mark.parametrize("method", ["hold_pages", "release_held_pages"])
def test_a_group_major_list_whose_counts_do_not_match_it_is_refused_whole(method):
    m = build("shared")
    gid = m.specs[0].group_id
    page = candidates(m, gid)[0]
    hold(m, {gid: np.array([page])})  # so that a release of it is valid too
    before, n = state(m), len(m.specs)
    local, counts = group_major(m, {gid: np.array([page])})
    wrapped = np.zeros(n, dtype=np.int64)
    wrapped[:3] = (2**63 - 1, 2**63 - 1, local.size + 2)  # 2**64 + local.size: local.size in int64
    call = getattr(m, method)
    for bad_local, bad_counts in (
        (local, counts + 1),  # more pages counted than listed
        (local, counts[:-1]),  # a count short
        (local, np.where(np.arange(n) == 1, -1, counts + (np.arange(n) == 0))),  # a negative count
        (local.astype(np.int32), counts),
        (local.reshape(1, -1), counts),
        (local.tolist(), counts),
        (local[:0], counts),  # no pages listed, one counted
        (local[:0], np.zeros(n - 1, dtype=np.int64)),  # no pages, a count short
        (local, wrapped),  # counts whose int64 sum wraps round to the length listed
    ):
        with pytest.raises(CacheManagerError, match="must"):
            call(bad_local, bad_counts)
    assert state(m) == before  # nothing held or released
    call(local[:0], np.zeros(n, dtype=np.int64))  # nothing listed: nothing to do
    assert state(m) == before
    call(local, counts)  # the list itself is fine
