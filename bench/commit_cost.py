"""Cost of a step's prefix commits (``CacheManager._commit_rows``), this version against another.

    PYTHONPATH=src:/tmp/commit_base .venv/bin/python bench/commit_cost.py --against hybridkv_base
        [--sizes 32,1024] [--steps 200] [--phase decode|serving|prefill|both] [--clock wall|cpu] [--cold MIB]

Same workloads as ``bench/step_profile.py`` (V4-Flash, 40 GiB shared arena, prefix
caching on): decode steps (``N`` requests, one token each) and serving steps (one
request finishes, one joins with a 512-1,536-token prompt), and with ``--phase
prefill`` its 2,048-token prefill chunks of 32,768-token prompts. Each side's
``manager._commit_rows`` (every row of a step that commits, and a ``free``'s) is wrapped
in a timer; the two sides' steps alternate on the same seeded workload, the side that
runs first swapping every step (with the order fixed, the same code on both sides read
up to 17% apart). Prints, per phase
and size, the calls timed, the rows they committed, and their mean and median cost in µs,
and whether both sides emitted the same events
(kind, group, key, parent, tokens, pages; same order). ``--cold MIB``: as
``bench/step_profile.py``'s, the caches evicted before every step (so before its commits). The renamed copy must keep
the hash roots' byte strings (``b"hybridkv-prefix-root\x00"`` in ``prefix/cache.py``):
a blanket ``sed s/hybridkv/hybridkv_base/`` renames them too, every key then differs
and "same events" is False whatever the code does.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import step_profile
from step_profile import PHASES, ColdWalk

CLOCK = time.perf_counter_ns


def timed_commits(work) -> tuple[list[int], list[int]]:
    """Wrap the workload's ``manager._commit_rows``; the lists its durations (ns) and rows go into."""
    manager, out, rows = work.manager, [], []
    inner = manager._commit_rows

    def commit_rows(crossing):
        start = CLOCK()
        inner(crossing)
        out.append(CLOCK() - start)
        rows.append(len(crossing))

    manager._commit_rows = commit_rows
    return out, rows


def measure(n: int, phase: str, steps: int, sides: tuple[str, ...]) -> dict:
    work_class, fn = PHASES[phase]
    works = {side: work_class(n, package=side) for side in sides}
    for work in works.values():
        fn(work, 20)  # warm
        work.manager.prefix.drain_events()
    times = {side: timed_commits(works[side]) for side in sides}
    same_events = True
    gc.disable()
    try:
        for k in range(steps):
            events = []
            for side in sides[::-1] if k % 2 else sides:  # odd steps: this version first
                fn(works[side], 1)
                events.append([(e.kind, e.group_id, e.block_hash, e.parent_hash, e.tokens, e.num_pages)
                               for e in works[side].manager.prefix.drain_events()])
            same_events &= all(e == events[0] for e in events)
    finally:
        gc.enable()
    out = {}
    for side in sides:
        us = np.asarray(times[side][0], dtype=np.float64) / 1e3
        out[side] = {"calls": int(us.size), "rows": int(sum(times[side][1])),
                     "mean_us": round(float(us.mean()), 1) if us.size else 0.0,
                     "median_us": round(float(np.median(us)), 1) if us.size else 0.0}
        print(f"{side:14s} {phase:8s} {n:5d}  {out[side]}", flush=True)
    if len(sides) > 1:
        print(f"{'':14s} {phase:8s} {n:5d}  same events: {same_events}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32,1024")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--phase", choices=("decode", "serving", "prefill", "both"), default="both",
                    help="both: decode and serving")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--against", default=None, help="package of another version (a renamed copy on PYTHONPATH)")
    ap.add_argument("--cold", type=float, default=0.0, help="MiB of Python objects walked before every step")
    a = ap.parse_args()
    if a.cold > 0:
        step_profile.BEFORE_STEP = ColdWalk(a.cold)
    if a.clock == "cpu":
        global CLOCK
        CLOCK = time.thread_time_ns
    sides = ("hybridkv",) if a.against is None else (a.against, "hybridkv")
    for n in (int(s) for s in a.sizes.split(",")):
        for phase in ("decode", "serving") if a.phase == "both" else (a.phase,):
            measure(n, phase, a.steps, sides)


if __name__ == "__main__":
    main()
