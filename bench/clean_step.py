"""A clean decode step's fixed and per-request cost, warm and cold, against another version.

    PYTHONPATH=src:/work/base .venv/bin/python bench/clean_step.py --against hybridkv_base
        [--sizes 8,32,64,128] [--steps 200] [--cold 6]

``bench/step_profile.py``'s decode workload (V4-Flash, 40 GiB shared arena, prefix
caching on, "updates" block tables) on this version and on ``--against`` (a renamed
copy of another version on ``PYTHONPATH``), their steps alternating, the side that goes
first swapping every round (with the order fixed, the same code on both sides read up
to 13% apart). Only *clean*
steps count: those in which no row commits to the prefix cache (no row's computed
tokens passed a 256-token grain in its previous step), so the figures are the step's
own cost, not the commits'. Each size runs ``--steps`` rounds of two conditions:

* ``warm``: an untimed step of the same manager just before the timed one;
* ``cold``: ``--cold`` MiB of Python objects walked just before (``step_profile.ColdWalk``:
  the L1/L2 caches hold none of the manager's data, as in ``bench/vs_vllm``, where
  each hybridkv step follows a vLLM step).

Prints the median thread CPU time per side, size and condition, their ratio, and a
least-squares fit over the sizes: fixed cost plus cost per request.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_profile as sp  # noqa: E402

CLOCK = time.thread_time_ns


def crossed(work: sp.Workload, grain: int) -> int:
    """Rows whose previous step passed a prefix grain: they commit in the next one."""
    computed = np.array([work.manager.num_computed_tokens(rid) for rid in work.live])
    return int(np.count_nonzero(computed // grain > (computed - 1) // grain))


def timed_step(work: sp.Workload) -> int:
    ids = tuple(work.live)
    start = CLOCK()
    work.manager.schedule_uniform(ids, 1, block_tables="updates")
    took = CLOCK() - start
    work.sample(list(ids))
    return took


def run(size: int, steps: int, sides: tuple[str, ...], walk: sp.ColdWalk) -> dict:
    """Median ns of clean steps per (side, condition)."""
    works = {side: sp.Workload(size, package=side) for side in sides}
    for work in works.values():
        sp.decode_steps(work, 20)
    grain = works[sides[-1]].manager.prefix.granularity_tokens
    times = {(side, cond): [] for side in sides for cond in ("warm", "cold")}
    gc.disable()
    try:
        for k in range(steps):
            for cond in ("warm", "cold"):
                for side in sides[::-1] if k % 2 else sides:  # odd rounds: this version first
                    work = works[side]
                    if cond == "cold":
                        clean = not crossed(work, grain)  # before the walk: it reads the manager
                        walk()
                    else:
                        timed_step(work)  # untimed here: warms the manager
                        clean = not crossed(work, grain)
                    took = timed_step(work)
                    if clean:
                        times[side, cond].append(took)
    finally:
        gc.enable()
    return {key: float(np.median(v)) for key, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,32,64,128")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cold", type=float, default=6.0, help="MiB of Python objects walked before a cold step")
    ap.add_argument("--against", default=None, help="package of another version (a renamed copy on PYTHONPATH)")
    a = ap.parse_args()
    sides = ("hybridkv",) if a.against is None else (a.against, "hybridkv")
    walk = sp.ColdWalk(a.cold)
    sizes = [int(s) for s in a.sizes.split(",")]
    points = {}
    for size in sizes:
        medians = run(size, a.steps, sides, walk)
        for cond in ("warm", "cold"):
            line = "  ".join(f"{side} {medians[side, cond] / 1e3:7.1f} us" for side in sides)
            ratio = f"  ratio {medians['hybridkv', cond] / medians[sides[0], cond]:.3f}" if a.against else ""
            print(f"{size:5d} {cond}: {line}{ratio}", flush=True)
            for side in sides:
                points.setdefault((side, cond), []).append((size, medians[side, cond] / 1e3))
    if len(sizes) > 1:
        for (side, cond), pts in points.items():
            per_request, fixed = np.polyfit(*np.array(pts).T, 1)
            print(f"fit {side} {cond}: fixed {fixed:6.1f} us + {per_request:.3f} us per request")


if __name__ == "__main__":
    main()
