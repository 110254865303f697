"""What the slow steps of ``bench/vs_vllm``'s decode phase do (hybridkv side only).

    PYTHONPATH=src .venv/bin/python bench/decode_tail.py [--sizes 32,512] [--rounds 5] [--steps 32]
        [--clock wall|cpu] [--json PATH]

The decode phase's workload and driver (``vs_vllm.decode.DecodeDriver``: shared
prefixes, prompts of 512-4,096 tokens, prefix caching on, V4-Flash on the 40 GiB
shared arena), its ``rounds * steps`` steps one after the other with the collector
off, as the phase times them. Each step's time (``--clock cpu``: this thread's CPU
time, steadier on a shared machine) and what it did, read through the public API
around the call: prefix commits (rows whose computed tokens passed a prefix grain
in the previous step: they commit first), spare arena slabs taken, pages evicted.
Prints p50 / p99 and, per kind of step (clean, commits only, slabs taken, pages
evicted), how many and their median and largest time, and the slowest steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_vllm.decode import DecodeDriver  # noqa: E402
from vs_vllm.sides import HybridkvSide  # noqa: E402
from vs_vllm.workload import ServingShape  # noqa: E402

GIB = 2**30


def step_kind(commits: int, slabs: int, evicted: int) -> str:
    """The kind of a step by what it did (slabs first: they stop the compiled step)."""
    if slabs:
        return "slabs taken"
    if evicted:
        return "pages evicted"
    return "commits" if commits else "clean"


def run(running: int, rounds: int, steps: int, clock) -> dict:
    side = HybridkvSide(kv_memory_bytes=40 * GIB, max_model_len=131_072, max_num_batched_tokens=8192,
                        max_num_seqs=running)
    driver = DecodeDriver(side, running=running, total_steps=rounds * steps, chunk_tokens=8192,
                          shape=ServingShape(), seed=0)
    driver.start()
    manager, ids = side.manager, tuple(r.request_id for r in driver.requests)
    grain = manager.prefix.granularity_tokens
    computed = np.asarray([manager.num_computed_tokens(rid) for rid in ids])
    crossed = 0  # rows that passed a grain in the previous step: they commit in this one
    records = []
    gc.collect()
    gc.disable()
    try:
        for k in range(rounds * steps):
            spare = manager.arena.num_spare_slabs
            evicted = sum(s.evicted_pages for s in manager.stats().values())
            side.begin_step()
            start = clock()
            manager.schedule_uniform(ids, 1, block_tables=side.block_tables, write_slots=side.write_slots)
            us = (clock() - start) / 1e3
            side.append_many(driver.handles, driver.tokens[k])
            evicted = sum(s.evicted_pages for s in manager.stats().values()) - evicted
            slabs = spare - manager.arena.num_spare_slabs
            records.append(dict(step=k, us=us, commits=crossed, slabs=slabs, evicted_pages=evicted,
                                kind=step_kind(crossed, slabs, evicted)))
            now = computed + 1
            crossed = int(np.count_nonzero(now // grain > computed // grain))
            computed = now
    finally:
        gc.enable()
    return summarize(running, records)


def summarize(running: int, records: list[dict]) -> dict:
    us = np.asarray([r["us"] for r in records])
    p50, p99 = np.percentile(us, [50, 99])
    kinds = {}
    for kind in ("clean", "commits", "pages evicted", "slabs taken"):
        times = [r["us"] for r in records if r["kind"] == kind]
        if times:
            kinds[kind] = dict(steps=len(times), p50_us=round(float(np.median(times)), 1),
                               max_us=round(max(times), 1))
    slowest = sorted(records, key=lambda r: -r["us"])[:5]
    return dict(running=running, mean_us=round(float(us.mean()), 1), p50_us=round(float(p50), 1),
                p99_us=round(float(p99), 1),
                p99_over_p50=round(float(p99 / p50), 2), kinds=kinds,
                slowest=[{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in slowest])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    clock = time.thread_time_ns if a.clock == "cpu" else time.perf_counter_ns
    out = []
    for size in (int(s) for s in a.sizes.split(",")):
        result = run(size, a.rounds, a.steps, clock)
        out.append(result)
        print(f"{size} running: mean {result['mean_us']} us, p50 {result['p50_us']} us, p99 {result['p99_us']} us "
              f"(p99/p50 {result['p99_over_p50']})")
        for kind, figures in result["kinds"].items():
            print(f"  {kind:14s} {figures['steps']:4d} steps, p50 {figures['p50_us']:8.1f} us, "
                  f"largest {figures['max_us']:8.1f} us")
        for r in result["slowest"]:
            print(f"  slow: step {r['step']:3d} {r['us']:8.1f} us  {r['kind']} (commits {r['commits']}, "
                  f"slabs {r['slabs']}, evicted pages {r['evicted_pages']})")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
