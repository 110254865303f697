"""bench/hold_cost.py's plans: the pages it names are what its docstring says, and a timed pair
leaves the same pages held and idle (every hold released; the idle ones rejoin the LRU at its tail)."""

import pytest

from bench_support import load_bench_script


@pytest.fixture(scope="module")
def hold_cost():
    return load_bench_script("hold_cost.py", "hold_cost_under_test")


@pytest.mark.parametrize("case", ["idle", "held"])
def test_a_plan_names_held_and_idle_pages_and_a_pair_changes_nothing(hold_cost, case):
    manager, pages = hold_cost.setup("hybridkv", case)
    idle_listed = []
    for gid, listed in pages.items():
        idle = set(manager.pools[gid].evictable_page_ids().tolist())
        idle_listed.append(sum(p in idle for p in listed.tolist()))
    assert all(n in (0, 3) for n in idle_listed)
    assert (sum(idle_listed) > 0) == (case == "idle")
    before = {gid: (pool.ref_counts.tolist(), sorted(pool.evictable_page_ids().tolist())) for gid, pool in manager.pools.items()}
    assert hold_cost.pair_us(manager, pages, 2) > 0
    assert {gid: (pool.ref_counts.tolist(), sorted(pool.evictable_page_ids().tolist()))
            for gid, pool in manager.pools.items()} == before
    assert all(manager.held_outside_pages(gid) == 0 for gid in pages)
    manager.check_invariants()
