"""CPU cost of the cache manager per engine step (all six DeepSeek-V4-Flash groups).

    .venv/bin/python bench/manager_step.py [--prefix-caching] [--requests 32,64,...,1024]
        [--decode-steps 200] [--verify-steps 100] [--seed 0] [--block-tables full|updates]
        [--profile N | --breakdown N]

Plan: V4-Flash, 80 GiB, Limits(max_running 1024, 8,192 tokens per step, context
2**20, speculative 4) from ``hybridkv.plan.plan_for_budget``, built as per-group pools
(``page_space="per-group"``, as the figures docs/benchmarks.md records were). For each running
count N, N requests with prompts log-uniform in [2,048, 32,768] tokens (the first
N of one fixed-seed draw of 1,024) go through three timed phases:

* prefill: a scheduler fills each step's 8,192-token budget with prompt chunks in
  arrival order; a request whose prompt completed waits for the decode phase
  (it settles, releasing its last chunk's slid-out pages, at the next schedule).
* decode: every running request schedules 1 token per step.
* verify: every running request schedules 4 tokens, then all rewind to 2 accepted
  in one ``rewind_many`` call.

Only manager calls are timed (``perf_counter_ns``, cyclic GC off in timed loops): ``schedule`` per step
(``check_admission`` is timed separately for prefill steps only), the
``rewind_many`` call of a verify step, and with ``--prefix-caching`` the
``append_token_ids_many`` call of a step. ``--prefix-caching`` runs every
count twice, caching off and on (requests then carry token ids), and reports
on/off per running request per decode step, also with the off and on managers'
decode steps alternating (the steadier ratio on a noisy machine). ``--block-tables`` is the mode of
every ``schedule`` call: ``full`` builds each group's ``[R, width]`` table,
``updates`` hands out only the changed table cells (docs/manager.md). Writes
bench/out/manager_step.json.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from hybridkv.runtime.manager import CacheManager
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_budget

GIB = 2**30
BUDGET_BYTES = 80 * GIB
LIMITS = Limits(
    max_running_requests=1024, max_scheduled_tokens=8192, max_context_tokens=2**20, speculative_tokens=4
)
PROMPT_RANGE = (2048, 32768)
VERIFY_TOKENS, ACCEPTED_TOKENS = 4, 2
TARGET_US_PER_REQUEST = 2.0
TARGET_PREFIX_RATIO = 1.5
OUT = Path(__file__).parent / "out" / "manager_step.json"


def make_plan():
    layout = cache_layout("deepseek-v4-flash", speculative_tokens=LIMITS.speculative_tokens)
    return plan_for_budget(layout, BUDGET_BYTES, LIMITS)


def prompt_lengths(seed: int, count: int = 1024) -> np.ndarray:
    lo, hi = np.log(PROMPT_RANGE[0]), np.log(PROMPT_RANGE[1])
    return np.exp(np.random.default_rng(seed).uniform(lo, hi, count)).astype(np.int64)


def summarize(ns: list[int], per: int = 1) -> dict:
    us = np.asarray(ns, dtype=np.float64) / 1e3
    p50, p99 = np.percentile(us, [50, 99])
    return {
        "steps": len(ns),
        "p50_us": float(p50),
        "p99_us": float(p99),
        "mean_us": float(us.mean()),
        "p50_us_per_request": float(p50 / per),
        "p99_us_per_request": float(p99 / per),
    }


class Run:
    """One manager with N running requests, driven through the three phases."""

    def __init__(self, plan, prompts: np.ndarray, *, prefix_caching: bool, seed: int, max_new: int,
                 block_tables: str = "full"):
        self.m = CacheManager.from_plan(plan, page_space="per-group", enable_prefix_caching=prefix_caching)
        self.block_tables = block_tables
        self.caching = prefix_caching
        self.rng = np.random.default_rng(seed + 1)
        self.rids = [f"req{i}" for i in range(prompts.size)]
        self.prompt = dict(zip(self.rids, prompts.tolist()))
        for rid in self.rids:
            if prefix_caching:
                ids = self.rng.integers(0, 2**17, self.prompt[rid])
                self.m.add_request(rid, ids, max_new_tokens=max_new)
            else:
                self.m.add_request(rid, prompt_tokens=self.prompt[rid], max_new_tokens=max_new)

    def append(self, rids: list[str], per_request: int) -> int:
        """Append fresh token ids (caching on only); returns ns spent in the manager."""
        if not self.caching or not rids:
            return 0
        ids = self.rng.integers(0, 2**17, (len(rids), per_request))
        t0 = time.perf_counter_ns()
        self.m.append_token_ids_many(rids, ids)
        return time.perf_counter_ns() - t0

    def prefill(self, step_tokens: int) -> dict:
        m, queue = self.m, list(self.rids)
        sched_ns, admit_ns, reqs_per_step = [], [], []
        while queue:
            items, budget = [], step_tokens
            while queue and budget > 0:
                rid = queue[0]
                done = m.num_computed_tokens(rid)
                n = min(budget, self.prompt[rid] - done)
                items.append((rid, n))
                budget -= n
                if done + n == self.prompt[rid]:
                    queue.pop(0)
            t0 = time.perf_counter_ns()
            answers = m.check_admission(items)
            t1 = time.perf_counter_ns()
            m.schedule(items, block_tables=self.block_tables)
            t2 = time.perf_counter_ns()
            assert all(a.ok for a in answers)
            admit_ns.append(t1 - t0)
            sched_ns.append(t2 - t1)
            reqs_per_step.append(len(items))
        out = summarize(sched_ns)
        out["requests_per_step_mean"] = float(np.mean(reqs_per_step))
        out["p50_us_per_request"] = float(np.percentile(np.asarray(sched_ns) / 1e3 / reqs_per_step, 50))
        out["p99_us_per_request"] = float(np.percentile(np.asarray(sched_ns) / 1e3 / reqs_per_step, 99))
        out["check_admission_p50_us"] = float(np.percentile(admit_ns, 50) / 1e3)
        out["tokens"] = int(sum(self.prompt.values()))
        return out

    def decode(self, steps: int) -> dict:
        m, n = self.m, len(self.rids)
        ids = tuple(self.rids)
        sched_ns, append_ns = [], []
        for _ in range(steps):
            append_ns.append(self.append(self.rids, 1))
            t0 = time.perf_counter_ns()
            m.schedule_uniform(ids, 1, block_tables=self.block_tables)
            sched_ns.append(time.perf_counter_ns() - t0)
        out = summarize(sched_ns, n)
        if self.caching:
            out["append"] = summarize(append_ns, n)
            out["with_append"] = summarize([a + b for a, b in zip(sched_ns, append_ns)], n)
        return out

    def verify(self, steps: int) -> tuple[dict, dict]:
        m, n = self.m, len(self.rids)
        ids = tuple(self.rids)
        sched_ns, rewind_ns, append_ns = [], [], []
        for _ in range(steps):
            append_ns.append(self.append(self.rids, VERIFY_TOKENS))
            keep = [(rid, m.num_computed_tokens(rid) + ACCEPTED_TOKENS) for rid in self.rids]
            t0 = time.perf_counter_ns()
            m.schedule_uniform(ids, VERIFY_TOKENS, block_tables=self.block_tables)
            t1 = time.perf_counter_ns()
            m.rewind_many(keep)
            t2 = time.perf_counter_ns()
            sched_ns.append(t1 - t0)
            rewind_ns.append(t2 - t1)
        out = summarize(sched_ns, n)
        if self.caching:
            out["append"] = summarize(append_ns, n)
        return out, summarize(rewind_ns, n)

    def check_and_free(self) -> None:
        self.m.check_invariants()
        for rid in self.rids:
            self.m.free(rid)
        self.m.clear_prefix_cache()
        for s in self.m.stats().values():
            assert s.free_pages == s.total_pages, s


def run_count(plan, prompts, args, caching: bool) -> dict:
    max_new = 2 + args.decode_steps + ACCEPTED_TOKENS * args.verify_steps + VERIFY_TOKENS
    run = Run(plan, prompts, prefix_caching=caching, seed=args.seed, max_new=max_new, block_tables=args.block_tables)
    gc.collect()
    gc.disable()  # timed loops run without the cyclic collector (engines gc.freeze())
    try:
        prefill = run.prefill(LIMITS.max_scheduled_tokens)
        gc.collect()
        decode = run.decode(args.decode_steps)
        gc.collect()
        verify, rewind = run.verify(args.verify_steps)
    finally:
        gc.enable()
    used = {gid: s.used_pages for gid, s in run.m.stats().items()}
    run.check_and_free()
    return {
        "requests": int(prompts.size),
        "prefix_caching": caching,
        "block_tables": args.block_tables,
        "prompt_tokens": int(prompts.sum()),
        "prefill": prefill,
        "decode_1": decode,
        "verify_4": verify,
        "rewind_to_2": rewind,
        "used_pages_at_end": used,
    }


def paired_decode(plan, prompts, args) -> dict:
    """Caching off and on, decode steps alternating (the order rotating each step):
    the on/off ratio over the same stretch of time, so the machine's slow minutes
    hit both managers alike. ``schedule`` time only; appends are not timed."""
    max_new = 2 + args.decode_steps
    runs = [Run(plan, prompts, prefix_caching=caching, seed=args.seed, max_new=max_new,
                block_tables=args.block_tables) for caching in (False, True)]
    for run in runs:
        run.prefill(LIMITS.max_scheduled_tokens)
    ns = np.zeros((2, args.decode_steps), dtype=np.int64)
    ids = [tuple(run.rids) for run in runs]
    gc.collect()
    gc.disable()
    try:
        for step in range(args.decode_steps):
            for k in ((0, 1) if step % 2 == 0 else (1, 0)):
                runs[k].append(runs[k].rids, 1)
                t0 = time.perf_counter_ns()
                runs[k].m.schedule_uniform(ids[k], 1, block_tables=args.block_tables)
                ns[k, step] = time.perf_counter_ns() - t0
    finally:
        gc.enable()
    for run in runs:
        run.check_and_free()
    return {
        "requests": int(prompts.size),
        "off_p50_us_per_request": float(np.median(ns[0]) / 1e3 / prompts.size),
        "on_p50_us_per_request": float(np.median(ns[1]) / 1e3 / prompts.size),
        "on_over_off_median_step_ratio": float(np.median(ns[1] / ns[0])),
        "on_over_off_ratio_of_totals": float(ns[1].sum() / ns[0].sum()),
    }


def profile_decode(plan, prompts, args, caching: bool) -> str:
    run = Run(plan, prompts, prefix_caching=caching, seed=args.seed, max_new=4 + 2 * args.decode_steps,
              block_tables=args.block_tables)
    run.prefill(LIMITS.max_scheduled_tokens)
    ids = tuple(run.rids)
    prof = cProfile.Profile()
    for _ in range(args.decode_steps):
        run.append(run.rids, 1)
        prof.enable()
        run.m.schedule_uniform(ids, 1, block_tables=args.block_tables)
        prof.disable()
    stream = __import__("io").StringIO()
    pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(20)
    return stream.getvalue()


BREAKDOWN_METHODS = {
    "CacheManager": ["schedule", "schedule_uniform", "_admit", "_fast_rows", "_step", "_after_run", "_plan",
                     "_run", "_build_batch", "rewind_many"],
    "TableSet": ["block_table", "drain_updates"],
    "PagePool": ["make_room", "adopt", "unpublish"],
    "PrefixCache": ["commit"],
}


def breakdown(plan, prompts, args, caching: bool) -> dict[str, dict[str, float]]:
    """Inclusive wall µs per step of the manager's methods (wrapped with timers here)."""
    from hybridkv.memory.pool import PagePool
    from hybridkv.prefix.cache import PrefixCache
    from hybridkv.tables.store import TableSet

    classes = {
        "CacheManager": CacheManager,
        "TableSet": TableSet,
        "PagePool": PagePool,
        "PrefixCache": PrefixCache,
    }
    spent: dict[str, int] = {}
    originals = []

    def timed(label, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                spent[label] = spent.get(label, 0) + time.perf_counter_ns() - t0

        return wrapper

    for cls_name, names in BREAKDOWN_METHODS.items():
        cls = classes[cls_name]
        for name in names:
            originals.append((cls, name, getattr(cls, name)))
            setattr(cls, name, timed(f"{cls_name}.{name}", getattr(cls, name)))
    try:
        run = Run(plan, prompts, prefix_caching=caching, seed=args.seed,
                  max_new=4 + args.decode_steps + ACCEPTED_TOKENS * args.verify_steps + VERIFY_TOKENS,
                  block_tables=args.block_tables)
        run.prefill(LIMITS.max_scheduled_tokens)
        out = {}
        gc.collect()
        gc.disable()
        spent.clear()
        run.decode(args.decode_steps)
        out["decode_1"] = {k: v / args.decode_steps / 1e3 for k, v in spent.items()}
        spent.clear()
        run.verify(args.verify_steps)
        out["verify_4_and_rewind"] = {k: v / args.verify_steps / 1e3 for k, v in spent.items()}
    finally:
        gc.enable()
        for cls, name, fn in originals:
            setattr(cls, name, fn)
    return out


def print_tables(console: Console, runs: list[dict]) -> None:
    table = Table(title="Manager µs per step, V4-Flash, all 6 groups: p50 / p99 (per running request: p50), "
                  f"block_tables={runs[0].get('block_tables', 'full') if runs else 'full'}")
    for col in (
        "running",
        "caching",
        "decode-1 step",
        "µs/req",
        "vs 32",
        "verify-4 step",
        "µs/req",
        "rewind µs/req",
        "prefill step",
        "reqs/step",
        "admission",
    ):
        table.add_column(col, justify="right")
    base = {}
    for r in runs:
        d, v, w, p = r["decode_1"], r["verify_4"], r["rewind_to_2"], r["prefill"]
        key = r["prefix_caching"]
        base.setdefault(key, d["p50_us_per_request"])
        table.add_row(
            f"{r['requests']:,}",
            "on" if key else "off",
            f"{d['p50_us']:,.0f} / {d['p99_us']:,.0f}",
            f"{d['p50_us_per_request']:.2f}",
            f"{d['p50_us_per_request'] / base[key]:.2f}x",
            f"{v['p50_us']:,.0f} / {v['p99_us']:,.0f}",
            f"{v['p50_us_per_request']:.2f}",
            f"{w['p50_us_per_request']:.2f}",
            f"{p['p50_us']:,.0f} / {p['p99_us']:,.0f}",
            f"{p['requests_per_step_mean']:.1f}",
            f"{p['check_admission_p50_us']:,.0f}",
        )
    console.print(table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default="32,64,128,256,512,1024", help="running counts, comma-separated")
    ap.add_argument("--decode-steps", type=int, default=200)
    ap.add_argument("--verify-steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-caching", action="store_true", help="also run with caching on; report on/off")
    ap.add_argument("--block-tables", choices=("full", "updates"), default="full",
                    help="schedule mode: full [R, width] tables, or only the changed cells")
    ap.add_argument("--profile", type=int, metavar="N", help="cProfile the decode steps at N running, then exit")
    ap.add_argument("--breakdown", type=int, metavar="N", help="µs per step per manager method at N running, then exit")
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args(argv)
    console = Console(width=150)
    plan = make_plan()
    all_prompts = prompt_lengths(args.seed)
    counts = [int(x) for x in args.requests.split(",")]
    if max(counts) > all_prompts.size:
        ap.error(f"at most {all_prompts.size} running requests")

    if args.profile:
        for caching in [False] + ([True] if args.prefix_caching else []):
            console.print(f"[bold]decode profile, {args.profile} running, caching {'on' if caching else 'off'}")
            console.print(profile_decode(plan, all_prompts[: args.profile], args, caching), markup=False)
        return 0

    if args.breakdown:
        for caching in [False] + ([True] if args.prefix_caching else []):
            result = breakdown(plan, all_prompts[: args.breakdown], args, caching)
            for phase, spent in result.items():
                t = Table(title=f"{phase}, {args.breakdown} running, caching {'on' if caching else 'off'}: "
                          "inclusive µs per step")
                t.add_column("method")
                t.add_column("µs/step", justify="right")
                t.add_column("µs/req", justify="right")
                for name, us in sorted(spent.items(), key=lambda kv: -kv[1]):
                    t.add_row(name, f"{us:,.1f}", f"{us / args.breakdown:.3f}")
                console.print(t)
        return 0

    runs = []
    for n in counts:
        for caching in [False] + ([True] if args.prefix_caching else []):
            t0 = time.perf_counter()
            runs.append(run_count(plan, all_prompts[:n], args, caching))
            console.print(f"  {n:>5} running, caching {'on ' if caching else 'off'}: {time.perf_counter() - t0:.1f} s")
    print_tables(console, runs)

    ratios = []
    if args.prefix_caching:
        off = {r["requests"]: r for r in runs if not r["prefix_caching"]}
        for r in runs:
            if r["prefix_caching"]:
                o = off[r["requests"]]["decode_1"]["p50_us_per_request"]
                paired = paired_decode(plan, all_prompts[: r["requests"]], args)
                ratios.append(
                    {
                        "requests": r["requests"],
                        "schedule_on_over_off": r["decode_1"]["p50_us_per_request"] / o,
                        "schedule_plus_append_on_over_off": r["decode_1"]["with_append"]["p50_us_per_request"] / o,
                        "paired": paired,
                    }
                )
        t = Table(title=f"Prefix caching on / off, µs per running request per decode step (target <= {TARGET_PREFIX_RATIO}x)")
        for col in ("running", "schedule", "schedule + append_token_ids", "schedule, steps alternating (median)"):
            t.add_column(col, justify="right")
        for x in ratios:
            t.add_row(
                f"{x['requests']:,}",
                f"{x['schedule_on_over_off']:.2f}x",
                f"{x['schedule_plus_append_on_over_off']:.2f}x",
                f"{x['paired']['on_over_off_median_step_ratio']:.2f}x",
            )
        console.print(t)

    report = {
        "benchmark": "manager_step",
        "command": "bench/manager_step.py " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "plan": {
            "model": "deepseek-v4-flash",
            "budget_bytes": BUDGET_BYTES,
            "limits": vars(LIMITS),
            "total_tokens": plan.total_tokens,
            "group_pages": plan.group_pages,
        },
        "prompts": {"distribution": "log-uniform", "range_tokens": PROMPT_RANGE, "seed": args.seed},
        "decode_steps": args.decode_steps,
        "verify_steps": args.verify_steps,
        "block_tables": args.block_tables,
        "targets": {"us_per_running_request_per_decode_step": TARGET_US_PER_REQUEST,
                    "prefix_caching_ratio": TARGET_PREFIX_RATIO},
        "runs": runs,
        "prefix_caching_ratios": ratios,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
