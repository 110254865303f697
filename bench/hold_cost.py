"""Cost of one tier offload's pins (``hold_pages`` then ``release_held_pages`` of a plan's pages,
listed group-major as ``TierLink`` lists them), this version against another.

    PYTHONPATH=src:/work/base2 .venv/bin/python bench/hold_cost.py --against hybridkv_base
        [--rounds 9] [--calls 300] [--case idle|held]

V4-Flash, 24,576 KV tokens in per-group pools, prefix caching on: request "a" (4,096 tokens) computed and freed
(its published pages idle in the LRU), request "b" (another 4,096) computed and running. A plan
names, in every group, 4 pages "b" holds and up to 3 idle cached ones (``--case idle``, 3 in
every group that has them: the hold takes them out of the LRU, the release puts them back, as in
``tiers_step``'s write-through runs) or up to 7 pages "b" holds (``--case held``: every page stays
referenced). The two versions' rounds
alternate; each round times ``--calls`` hold + release pairs on the thread's CPU clock. Prints
the median µs a pair of each side, their ratio and the per-round ratios; checks both managers'
invariants after.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import numpy as np


def setup(package: str, case: str):
    """A manager of ``package`` with "a" freed and "b" running, and the plan's pages by group."""
    layout_mod = importlib.import_module(f"{package}.models.layout")
    plan_mod = importlib.import_module(f"{package}.plan")
    manager_mod = importlib.import_module(f"{package}.runtime.manager")
    limits = plan_mod.Limits(max_running_requests=8, max_scheduled_tokens=2048, max_context_tokens=16384,
                             speculative_tokens=1)
    plan = plan_mod.plan_for_tokens(layout_mod.cache_layout("deepseek-v4-flash"), 24576, limits)
    manager = manager_mod.CacheManager.from_plan(plan, page_space="per-group", enable_prefix_caching=True,
                                                 prefix_granularity=256)
    rng = np.random.default_rng(1)
    for rid in ("a", "b"):
        manager.add_request(rid, rng.integers(0, 1000, 4096), max_new_tokens=4)
        while (done := manager.num_computed_tokens(rid)) < 4096:
            manager.schedule([(rid, min(2048, 4096 - done))])
    manager.free("a")
    held_count, idle_count = (4, 3) if case == "idle" else (7, 0)
    pages = {}
    for gid, pool in manager.pools.items():
        held = manager.request_pages("b", gid)[1]
        idle = pool.evictable_page_ids()
        pages[gid] = np.concatenate([held[held > 0][:held_count], idle[:idle_count]]).astype(np.int64)
    return manager, pages


def pair_us(manager, pages, calls: int) -> float:
    """CPU µs of one hold + release of ``pages`` (by group; listed group-major once, untimed), the mean over
    ``calls`` pairs."""
    listed = [pages[spec.group_id] for spec in manager.specs]
    local, per_group = np.concatenate(listed), np.array([p.size for p in listed], dtype=np.int64)
    start = time.thread_time()
    for _ in range(calls):
        manager.hold_pages(local, per_group)
        manager.release_held_pages(local, per_group)
    return (time.thread_time() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="hybridkv_base", help="the other version's package")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--case", choices=("idle", "held"), default="idle")
    args = ap.parse_args()
    sides = {name: setup(name, args.case) for name in ("hybridkv", args.against)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, (manager, pages) in sides.items():
            times[name].append(pair_us(manager, pages, args.calls))
    for manager, _ in sides.values():
        manager.check_invariants()
    mine, other = (statistics.median(times[name]) for name in sides)
    count = sum(p.size for p in sides["hybridkv"][1].values())
    print(f"case {args.case}: {count} pages in {len(sides['hybridkv'][1])} groups a plan; hold + release, CPU µs "
          f"median of {args.rounds}: hybridkv {mine:.1f}, {args.against} {other:.1f}, ratio {mine / other:.3f}")
    print("per-round ratios " + " ".join(f"{a / b:.2f}" for a, b in zip(*times.values())))


if __name__ == "__main__":
    main()
