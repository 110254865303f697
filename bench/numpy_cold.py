"""What a cold CPU cache costs a numpy-vectorized scheduling step.

    .venv/bin/python bench/numpy_cold.py [--steps 240] [--running 256] [--json PATH]

``bench/vs_vllm`` alternates the two managers' decode steps, so each step
starts with the caches the other side's step filled; hybridkv's step comes out
slower that way than when its steps run back to back. This script measures that
penalty apart, on hybridkv alone, under three conditions before each timed call:

* ``warm``: nothing (the previous step ran just before);
* ``python``: ~1 ms of plain Python work (dicts, strings, a sort), standing in
  for another component's scheduling code, as vLLM's per-request calls are;
* ``stream``: a 16 MiB array summed (evicts the private L2 caches).

Timed: (a) six small numpy operations of the kind a decode step starts with
(a take, a compare-and-any, [G, R] max/shift arithmetic), each timed apart, and
(b) a whole decode step (``schedule_uniform``) of ``--running`` chat requests on
the V4-Flash 40 GiB shared arena with prefix caching, with and without write
slots. Medians over ``--steps`` calls per condition, conditions interleaved in
blocks of four. Writes ``bench/out/numpy_cold.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from hybridkv.runtime.manager import CacheManager
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_budget
from hybridkv.sim.workloads import chat_workload

CONDITIONS = ("warm", "python", "stream")
OPS = ("tiny add", "take 256", "add, compare, any", "[6, 256] max", "[6, 256] shift", "[6, 256] min/max")


def _python_work() -> int:
    table = {}
    for i in range(3000):
        table[str(i)] = [i, i * 2, (i, "x")]
    return len(sorted(table.items(), key=lambda kv: kv[1][1]))


_STREAM = np.ones(16 * 2**20 // 8)
BEFORE = {"warm": lambda: None, "python": _python_work, "stream": lambda: float(_STREAM.sum())}


def _op_sequence(arrays) -> list[int]:
    """ns of each of the six operations, in order."""
    known, computed, rows, shift = arrays
    t = [time.perf_counter_ns()]
    np.add(rows[:1], 1)
    t.append(time.perf_counter_ns())
    first = computed.take(rows)
    t.append(time.perf_counter_ns())
    bool((first + 1 > known.take(rows)).any())
    t.append(time.perf_counter_ns())
    keep = np.maximum(first - shift, 0)
    t.append(time.perf_counter_ns())
    keep >>= 2
    t.append(time.perf_counter_ns())
    np.maximum(keep, np.minimum(keep, first))
    t.append(time.perf_counter_ns())
    return np.diff(t).tolist()


def _decode_manager(running: int, decode_tokens: int) -> tuple[CacheManager, tuple[str, ...]]:
    """V4-Flash, 40 GiB shared arena, prefix caching: ``running`` chat requests
    prefilled in 2,048-token chunks and one token into their decode, each allowed
    ``decode_tokens`` more."""
    plan = plan_for_budget(cache_layout("deepseek-v4-flash", indexer="fp8"), 40 * 2**30,
                           Limits(running, 2048, 131072))
    mgr = CacheManager.from_plan(plan, page_space="shared", enable_prefix_caching=True)
    rng = np.random.default_rng(1)
    workload = chat_workload(running, seed=0)
    for item in workload:
        ids = np.asarray(item.prompt_token_ids, dtype=np.int32)
        mgr.add_request(item.request_id, ids, max_new_tokens=decode_tokens + 1)
        while (done := mgr.num_computed_tokens(item.request_id)) < ids.size:
            mgr.schedule([(item.request_id, min(2048, ids.size - done))], block_tables="updates")
        mgr.append_token_ids(item.request_id, [int(rng.integers(0, 100_000))])
    return mgr, tuple(item.request_id for item in workload)


def measure(steps: int, running: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    arrays = (np.arange(1024, dtype=np.int64) + 5, np.arange(1024, dtype=np.int64),
              rng.permutation(1024)[:256], np.arange(6, dtype=np.int64)[:, None])
    ops = {c: [] for c in CONDITIONS}
    blocks = steps // 4
    decode_steps = blocks * len(CONDITIONS) * 2 * 4  # every condition, with and without write slots
    mgr, ids = _decode_manager(running, decode_steps)
    step_us = {(c, ws): [] for c in CONDITIONS for ws in (True, False)}
    tokens = rng.integers(0, 100_000, size=(decode_steps, len(ids)))
    used = 0
    gc.collect()
    gc.disable()
    try:
        for _ in range(blocks):
            for condition in CONDITIONS:
                for _ in range(4):
                    BEFORE[condition]()
                    ops[condition].append(_op_sequence(arrays))
                for write_slots in (True, False):
                    for _ in range(4):
                        BEFORE[condition]()
                        start = time.perf_counter_ns()
                        mgr.schedule_uniform(ids, 1, block_tables="updates", write_slots=write_slots)
                        step_us[condition, write_slots].append((time.perf_counter_ns() - start) / 1e3)
                        mgr.append_token_ids_many(ids, tokens[used][:, None])
                        used += 1
    finally:
        gc.enable()
    out = dict(python=platform.python_version(), numpy=np.__version__, steps=steps, running=running,
               ops_us={c: dict(zip(OPS, (np.median(np.asarray(ops[c]), axis=0) / 1e3).tolist())) for c in CONDITIONS},
               step_us={f"{c}, {'with' if ws else 'without'} write slots": float(np.median(v))
                        for (c, ws), v in step_us.items()})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=240, help="timed calls per condition (multiple of 4)")
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "out" / "numpy_cold.json")
    args = parser.parse_args(argv)
    if args.steps < 4 or args.running < 1:
        parser.error("--steps must be at least 4 and --running at least 1")
    result = measure(args.steps, args.running)
    console = Console()
    table = Table(title="median µs per call, by what ran just before")
    table.add_column("call")
    for condition in CONDITIONS:
        table.add_column(condition, justify="right")
    table.add_column("python / warm", justify="right")
    for op in OPS:
        row = [result["ops_us"][c][op] for c in CONDITIONS]
        table.add_row(op, *(f"{v:.1f}" for v in row), f"{row[1] / row[0]:.1f}x")
    for ws in ("with", "without"):
        row = [result["step_us"][f"{c}, {ws} write slots"] for c in CONDITIONS]
        table.add_row(f"decode step, {args.running} running, {ws} write slots", *(f"{v:,.0f}" for v in row),
                      f"{row[1] / row[0]:.2f}x")
    console.print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    console.print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
