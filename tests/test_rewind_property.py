"""``rewind_many`` (one compiled call for every group and request) against the reference.

Random programs as in ``tests/test_reference_equivalence.py`` (its ``Twin`` and call
helpers), drawn so that rewinds are frequent and reach the edges: back to the
committed tokens (zero for a request whose first step is its only one), below a
prefix grain the step crossed (the commit at the next step then publishes less:
checkpoint supersede), and pages held outside any request (``hold_pages``,
mirrored in the reference as one more reference on each page) or keyed (prefix
caching on: pages a rewind leaves idle join the LRU, whose order later evictions
show). Both page spaces: per-group pools (ids compared exactly) and a shared arena
(ids up to a renaming). Every few calls a refused ``rewind_many`` (forward, below
the committed tokens, unknown or repeated id, non-int count, malformed item, the bad
item anywhere in a batch of good ones) must leave pools, free stacks, tables and
counters exactly as they were.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from hybridkv.runtime.manager import CacheManagerError
from test_reference_equivalence import GIDS, GRAIN, Twin, add, both, draw_items, free, step

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def draw_target(data, r) -> int:
    """A kept count in ``[committed, computed]``: often an edge (the committed tokens, the
    grain below the computed ones), else anywhere."""
    lo, hi = r["committed"], r["c"]
    grain_floor = max(lo, hi // GRAIN * GRAIN)
    return data.draw(st.sampled_from([lo, grain_floor, hi - 1 if hi > lo else hi, data.draw(st.integers(lo, hi))]))


def rewind(twin, data) -> None:
    """Every open request (or a random subset), in a random order, one call; kept counts as
    ints or numpy ints."""
    reqs = twin.ref.reqs
    open_ = [rid for rid, r in reqs.items() if r["c"] > r["committed"] and rid not in twin.loaded]
    if not open_:
        return
    picked = data.draw(st.permutations(open_))[: data.draw(st.integers(1, len(open_)))]
    items = [(rid, draw_target(data, reqs[rid])) for rid in picked]
    if data.draw(st.booleans()) and data.draw(st.booleans()):
        items = [(rid, np.int64(n)) for rid, n in items]
    twin.ref.rewind_many([(rid, int(n)) for rid, n in items])
    twin.mgr.rewind_many(items)


def step_updates(twin, data) -> None:
    """A step in ``"updates"`` mode; then the mirror, which saw only the updates (the cells
    every step and rewind logged), equals the table store cell for cell."""
    items = draw_items(twin, data)
    if not items:
        return
    want, batch = both(lambda: twin.mgr.schedule(items, block_tables="updates"), lambda: twin.ref.schedule(items))
    if want is None:
        return
    twin.loaded.difference_update(rid for rid, _ in items)
    twin.compare_state()
    twin.compare_batch(items, want, batch, "updates", True)
    store = twin.mirror.store
    for g, gid in enumerate(GIDS):
        pages = twin.mgr.tables[gid].pages  # debug view: [table rows, capacity]
        seen = min(store.shape[1], pages.shape[0])
        assert np.array_equal(store[g, :seen, : pages.shape[1]], pages[:seen]), gid
        assert (pages[seen:] == -1).all(), gid


def snapshot(mgr) -> tuple:
    """Everything a refused call must leave as it was, through public and debug views."""
    pools = {g: (mgr.pools[g].free_page_ids().tolist(), mgr.pools[g].evictable_page_ids().tolist(),
                 mgr.pools[g].counters.as_dict()) for g in GIDS}
    stats = {g: s for g, s in mgr.stats().items()}
    tables = {g: mgr.tables[g].pages.tolist() for g in GIDS}
    return pools, stats, tables


def bad_rewind(twin, data) -> None:
    """A batch with one bad item (anywhere among good ones) is refused whole: nothing changes."""
    reqs = twin.ref.reqs
    if not reqs:
        return
    rids = sorted(reqs)
    good = [(rid, reqs[rid]["c"]) for rid in data.draw(st.lists(st.sampled_from(rids), unique=True))]
    rid = data.draw(st.sampled_from(rids))
    r = reqs[rid]
    bad = data.draw(st.sampled_from([
        [(rid, r["c"] + 1)], [(rid, r["committed"] - 1)], [("nobody", 0)], [(rid, float(r["c"]))], [(rid, True)],
        [(rid, str(r["c"]))], [(rid,)], [(rid, r["c"], 0)], [None], [(rid, 2**70)], [(rid, r["c"])] * 2,
    ]))
    items = [(g, n) for g, n in good if g != rid] + bad
    items = data.draw(st.permutations(items))
    before = snapshot(twin.mgr)
    with pytest.raises(CacheManagerError):
        twin.mgr.rewind_many(items)
    assert snapshot(twin.mgr) == before
    for rid, r in reqs.items():
        assert twin.mgr.num_computed_tokens(rid) == r["c"]


def hold(twin, data) -> None:
    """Hold a few of a live request's pages outside it (the reference: one more reference each)."""
    if not twin.ref.reqs:
        return
    rid = data.draw(st.sampled_from(sorted(twin.ref.reqs)))
    r = twin.ref.reqs[rid]
    held = {}
    for g in GIDS:
        ref_pages = r["pages"][g]
        pick = data.draw(st.lists(st.sampled_from(ref_pages), max_size=3)) if ref_pages else []
        if pick:
            held[g] = pick
    if not held:
        return
    twin.mgr.hold_pages(*manager_ids(twin, held))
    for g, pages in held.items():
        for p in pages:
            twin.ref.pools[g].ref[p] += 1
    twin.holds.append(held)


def manager_ids(twin, held: dict) -> tuple[np.ndarray, np.ndarray]:
    """The manager's ids of reference pages (the same ids on per-group pools), group-major as
    ``CacheManager.hold_pages`` takes them."""
    ids, gids = twin.ids, [s.group_id for s in twin.mgr.specs]
    pages = [held.get(g, []) if ids.strict else [ids.fwd[g][p] for p in held.get(g, [])] for g in gids]
    local = np.array([p for group in pages for p in group], dtype=np.int64)
    return local, np.array([len(group) for group in pages], dtype=np.int64)


def release(twin, data) -> None:
    """Drop the oldest holds: a page no request holds any more goes free or, keyed, idle."""
    if not twin.holds:
        return
    held = twin.holds.pop(0)
    twin.mgr.release_held_pages(*manager_ids(twin, held))
    for g, pages in held.items():
        twin.ref.pools[g].release(pages)


def run(data, caching: bool, shared: bool) -> None:
    pages = {g: data.draw(st.integers(6, 12 if caching and g in ("swa", "cst") else 24)) for g in GIDS}
    widths = {"kv": 16, "c4": 8, "swa": 8, "cst": 8}
    prompt_checkpoints = caching and not shared and data.draw(st.booleans())
    twin = Twin(pages, widths, caching, prompt_checkpoints, shared)
    twin.holds = []
    stems = [data.draw(st.lists(st.integers(0, 2), min_size=9, max_size=40)) for _ in range(2)]
    ops = {"step": step, "updates": step_updates, "rewind": rewind, "bad": bad_rewind, "hold": hold,
           "release": release, "free": free}
    for i in range(data.draw(st.integers(4, 40))):
        op = data.draw(st.sampled_from(["add", "step", "updates", "rewind", "rewind", "bad", "hold", "release",
                                        "free"]))
        if op == "add":
            if len(twin.ref.reqs) < 5:
                add(twin, data, stems, f"r{i}")
        else:
            ops[op](twin, data)
        twin.compare_state()
    while twin.holds:
        release(twin, data)
    for rid in sorted(twin.ref.reqs):
        twin.ref.free(rid)
        twin.mgr.free(rid)
    twin.compare_state()


@SETTINGS
@given(st.data(), st.booleans())
def test_rewinds_match_the_reference_on_per_group_pools(data, caching):
    run(data, caching, shared=False)


@SETTINGS
@given(st.data(), st.booleans())
def test_rewinds_match_the_reference_on_a_shared_arena(data, caching):
    run(data, caching, shared=True)
