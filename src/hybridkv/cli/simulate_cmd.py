"""``hybridkv simulate``: drive the cache manager with a workload and summarise."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hybridkv.cli.plan_cmd import add_plan_arguments, build_plan
from hybridkv.manager import CacheManager
from hybridkv.sim.driver import SimResult, Simulator
from hybridkv.sim.workloads import WORKLOAD_NAMES, build_workload


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="run a serving workload through the cache manager",
        description=(
            "Simulate continuous batching over the planned cache: chunked prefill, admission, "
            "preemption by recompute, prefix caching. Prints throughput, concurrency, hit rate, "
            "preemptions, memory utilization per group and manager time per step."
        ),
    )
    add_plan_arguments(parser)
    parser.add_argument(
        "--workload", default="multiturn", metavar="NAME|PATH",
        help=f"{', '.join(WORKLOAD_NAMES)} or a JSONL trace (docs/workloads.md); default multiturn",
    )
    parser.add_argument("--requests", type=int, default=None, metavar="N", help="number of requests")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse cached prefixes (default on)",
    )
    parser.add_argument(
        "--state-checkpoint-interval", type=int, default=None, metavar="TOKENS",
        help="also keep state checkpoints every N tokens (a multiple of 256)",
    )
    parser.add_argument(
        "--min-chunk-tokens", type=int, default=256, metavar="TOKENS",
        help="a running request's prefill chunk that does not fit shrinks to what fits, down to "
             "this many tokens, before a request is preempted (0: never shrink; default 256)",
    )
    parser.add_argument("--plot", metavar="PNG", default=None, help="write a plot of the run")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be positive, got {args.requests}")
    if args.min_chunk_tokens < 0:
        raise ValueError(f"--min-chunk-tokens must be >= 0, got {args.min_chunk_tokens}")
    plan = build_plan(args)
    requests = build_workload(args.workload, num_requests=args.requests, seed=args.seed)
    options: dict[str, Any] = {"enable_prefix_caching": args.prefix_caching}
    if args.state_checkpoint_interval is not None:
        if not args.prefix_caching:
            raise ValueError("--state-checkpoint-interval needs --prefix-caching")
        options["state_checkpoint_interval"] = args.state_checkpoint_interval
    manager = CacheManager.from_plan(plan, page_space=args.page_space, **options)
    sim = Simulator(
        manager, requests,
        max_running=plan.limits.max_running_requests,
        step_token_budget=plan.limits.max_scheduled_tokens,
        min_chunk_tokens=args.min_chunk_tokens,
    )
    quiet = args.json or not sys.stderr.isatty()
    with Progress(
        TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
        TimeElapsedColumn(), console=Console(stderr=True), disable=quiet, transient=True,
    ) as progress:
        task = progress.add_task("sim", total=len(requests))
        result = sim.run(on_step=lambda step, done: progress.update(task, completed=done))
    summary = result.summary()
    summary["workload"] = args.workload
    summary["requests"] = len(requests)
    summary["prefix_caching"] = args.prefix_caching
    summary["kv_memory_bytes"] = plan.budget_bytes
    summary["page_space"] = args.page_space
    if args.plot:
        write_plot(result, args.plot)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary, Console(width=100))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def print_summary(summary: dict, console: Console) -> None:
    table = Table(title=f"simulate: {summary['workload']} ({summary['requests']} requests)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("steps", f"{summary['steps']:,}"),
        ("requests finished", f"{summary['requests_finished']:,}"),
        ("scheduled tokens / step", f"{summary['scheduled_tokens_per_step']:,.1f}"),
        ("max running requests", f"{summary['max_running_reached']:,}"),
        ("mean running requests", f"{summary['mean_running']:,.1f}"),
        ("prefix caching", "on" if summary["prefix_caching"] else "off"),
        ("page space", summary["page_space"]),
        ("token hit rate", f"{summary['token_hit_rate']:.1%}"),
        ("preemptions", f"{summary['preemptions']:,}"),
        ("prefill chunks shrunk to fit", f"{summary['shrunk_chunks']:,}"),
        ("manager µs / step p50", f"{summary['manager_us_per_step_p50']:,.0f}"),
        ("manager µs / step p99", f"{summary['manager_us_per_step_p99']:,.0f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    for gid, u in summary["utilization"].items():
        table.add_row(f"utilization {gid}", f"mean {u['mean']:.1%}  peak {u['peak']:.1%}")
    console.print(table)


def write_plot(result: SimResult, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'hybridkv[plot]'") from None
    steps = np.arange(result.steps)
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for gid in result.group_ids:
        axes[0].plot(steps, 100.0 * result.used_pages[gid] / result.group_total_pages[gid], label=gid)
    axes[0].set_ylabel("bytes in use (% of arena)" if result.shared_arena else "pages in use (% of pool)")
    axes[0].legend(fontsize=7, loc="upper right")
    axes[1].plot(steps, result.running, color="black")
    axes[1].set_ylabel("running requests")
    prompt = np.cumsum(result.prompt_tokens_started)
    hits = np.cumsum(result.hit_tokens)
    rate = np.divide(100.0 * hits, prompt, out=np.zeros(result.steps), where=prompt > 0)
    axes[2].plot(steps, rate, color="tab:green")
    axes[2].set_ylabel("token hit rate (%, cumulative)")
    axes[2].set_xlabel("step")
    fig.suptitle("hybridkv simulate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
