"""Cost of the "prefill-per-byte" checkpoint order (issue 21): per freed request and
per eviction, incremental (``hybridkv.prefix.checkpoints.CheckpointOrder``) against the
full sort at every freed request (``PrefixCache.use_full_sort_ranking``, the
reference and the behaviour before).

Run (about 3 min on a busy 2-core machine)::

    .venv/bin/python bench/ckpt_order_cost.py --json bench/out/ckpt_order_cost.json

Serves one of ``bench/hit_sweep.py``'s workloads (``--workload``; default the
trace: 300 requests over 48 shared document prefixes; the same seed and sizes) on the "hybridkv shared" line with
``checkpoint_policy="prefill-per-byte"`` at each budget, once per order, one
after the other in one process. Times, with ``time.perf_counter`` around the
calls: the ranking after each freed request (``PrefixCache.forget_request``,
less the request's own bookkeeping, which is the same for both) and each state
pool's ``make_room`` that evicted something (an eviction). Prints the median and
95th percentile of each, the cached checkpoints at the frees, and the hit rate
and whether both orders left the same per-group diagnostics (cached pages and
entries, evicted pages by reason, the arena's slabs: they must); writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hit_sweep  # noqa: E402

from hybridkv.prefix.checkpoints import checkpoint_policy  # noqa: E402


def timed(samples: list, fn, counted=lambda: True):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        elapsed = time.perf_counter() - start
        if counted():
            samples.append(elapsed)
        return out
    return wrapper


def serve(requests: list, budget_bytes: int, order: str) -> dict:
    longest = max(r.prompt_tokens + r.output_tokens for r in requests)
    policy = checkpoint_policy("prefill-per-byte", None, None, 256)
    side = hit_sweep.make_side("hybridkv shared", budget_bytes, -(-longest // 4096) * 4096, None, policy)
    prefix = side.manager.prefix
    if order == "full sort":
        prefix.use_full_sort_ranking()
    frees, evictions, cached = [], [], []
    forget = prefix.forget_request

    def forget_timed(req):
        cached.append(len(prefix.values))
        timed(frees, forget)(req)

    prefix.forget_request = forget_timed
    for gid in prefix.state_ids:
        pool = side.manager.pools[gid]
        before = [0]

        def evicted(pool=pool, before=before):
            moved = pool.counters.evicted_pages != before[0]
            before[0] = pool.counters.evicted_pages
            return moved

        room = pool.make_room
        pool.make_room = timed(evictions, lambda *args, room=room, pool=pool, before=before: (
            before.__setitem__(0, pool.counters.evicted_pages), room(*args))[1], evicted)
    start = time.perf_counter()
    hits = hit_sweep.serve_in_order(side, requests)
    seconds = time.perf_counter() - start
    prompt_tokens = sum(r.prompt_tokens for r in requests)

    def stats(xs):
        a = np.asarray(xs) * 1e3
        return dict(n=len(xs), median_ms=float(np.median(a)) if len(a) else None,
                    p95_ms=float(np.percentile(a, 95)) if len(a) else None, total_s=float(a.sum() / 1e3))

    return dict(order=order, budget_bytes=budget_bytes, hit_rate=float(hits.sum() / prompt_tokens),
                per_free=stats(frees), per_eviction=stats(evictions), seconds=seconds,
                cached_checkpoints_at_free=dict(median=float(np.median(cached)), max=int(max(cached))),
                groups=hit_sweep.group_diagnostics(side))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="2GiB,40GiB")
    parser.add_argument("--trace-requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=("trace", "multiturn", "agentic"), default="trace",
                        help="bench/hit_sweep.py's workload of that name, its default sizes")
    parser.add_argument("--json", default="bench/out/ckpt_order_cost.json")
    args = parser.parse_args(argv)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    sizes = argparse.Namespace(workloads=[args.workload], trace=None, trace_requests=args.trace_requests,
                               conversations=120, wave=40, sessions=96, agent_wave=32, seed=args.seed,
                               json=str(Path(args.json).with_name("ckpt_order_cost.json")))
    requests = hit_sweep.build_workloads(sizes)[args.workload]
    print(f"{args.workload}: {len(requests)} requests")
    rows = []
    print("| budget | order | hit rate | cached ckpts (median/max) | per free median / p95 (ms) |"
          " evictions | per eviction median / p95 (ms) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for text in args.budgets.split(","):
        for order in ("full sort", "incremental"):
            r = serve(requests, hit_sweep.parse_bytes(text), order)
            r["budget"] = text
            rows.append(r)
            f, e, c = r["per_free"], r["per_eviction"], r["cached_checkpoints_at_free"]
            ev = "-" if not e["n"] else f"{e['median_ms']:.3f} / {e['p95_ms']:.3f}"
            print(f"| {text} | {order} | {r['hit_rate']:.1%} | {c['median']:.0f} / {c['max']} |"
                  f" {f['median_ms']:.3f} / {f['p95_ms']:.3f} | {e['n']} | {ev} |", flush=True)
        full, fast = rows[-2:]
        same = full["groups"] == fast["groups"] and full["hit_rate"] == fast["hit_rate"]
        fast["same_as_full_sort"] = same
        print(f"| {text} | same hits and per-group diagnostics (cached, evicted by reason, slabs): "
              f"{'yes' if same else 'NO'} | | | | | |", flush=True)
    out = dict(workload=args.workload, load_average=os.getloadavg(), rows=rows)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"load average {os.getloadavg()[0]:.1f}; wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
