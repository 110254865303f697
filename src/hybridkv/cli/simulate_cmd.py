"""``hybridkv simulate``: drive the cache manager with a workload and summarise.

Every flag is checked before the run starts (the plot path's folder, name,
extension and the plotting extra included), so a run never fails at its end.
Heavy modules are imported inside :func:`run`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

from hybridkv.prefix.checkpoints import CHECKPOINT_POLICIES, checkpoint_policy
from hybridkv.cli import args as a
from hybridkv.cli.plan_cmd import add_plan_arguments, build_plan

WORKLOAD_NAMES = ("chat", "multiturn", "longctx", "agentic")  # = hybridkv.sim.workloads.WORKLOAD_NAMES
PLOT_FORMATS = (".png", ".pdf", ".svg")
TIERS = ("host", "disk", "mooncake")  # = hybridkv.cli.simulate_cluster.TIERS
MAX_INSTANCES = 64
DEFAULT_TIER_MEMORY = 4 << 30
DEFAULT_IN_FLIGHT_WAIT = 8  # steps
MAX_IN_FLIGHT_WAIT = 10_000


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
    add_plan_arguments(parser, context_len=False)
    _add_workload_arguments(parser)
    _add_cluster_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(run=run)


def _add_workload_arguments(parser: Any) -> None:
    """The workload, its prefix caching and checkpoints, chunking and the plot."""
    parser.add_argument(
        "--workload", type=a.nonempty("--workload"), default="multiturn", metavar="NAME|PATH",
        help=f"{', '.join(WORKLOAD_NAMES)} or a JSONL trace (docs/workloads.md; - or /dev/stdin "
        "reads standard input); default multiturn",
    )
    parser.add_argument(
        "--requests", type=a.number("--requests", maximum=a.MAX_WORKLOAD_REQUESTS), default=None,
        metavar="N", help="number of requests (1k = 1000; default: chat 256, multiturn 128, longctx 8, "
        "agentic the requests of 64 sessions, a trace all it holds)",
    )
    parser.add_argument(
        "--seed", type=a.number("--seed", minimum=0, maximum=a.MAX_SEED), default=0,
        help="workload seed (default 0)",
    )
    parser.add_argument(
        "--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse cached prefixes (default on)",
    )
    parser.add_argument(
        "--state-checkpoint-interval",
        type=a.number("--state-checkpoint-interval", "tokens", maximum=a.MAX_CONTEXT_TOKENS),
        default=None, metavar="TOKENS", help="also keep state checkpoints every N tokens (a multiple of 256)",
    )
    parser.add_argument(
        "--checkpoint-policy", choices=CHECKPOINT_POLICIES, default=None,
        help="which boundaries keep a state checkpoint (docs/prefix-caching.md; default prompt-boundaries)",
    )
    parser.add_argument(
        "--checkpoint-interval-tokens",
        type=a.number("--checkpoint-interval-tokens", "tokens", maximum=a.MAX_CONTEXT_TOKENS),
        default=None, metavar="TOKENS",
        help="the interval policy's k: a speculative checkpoint every k tokens (a multiple of 256)",
    )
    parser.add_argument(
        "--thrash-guard", action=argparse.BooleanOptionalAction, default=None,
        help="a request that an eviction cost part of its hit has what it publishes evicted next "
        "(docs/prefix-caching.md, \"Eviction by value\"; default on)",
    )
    parser.add_argument(
        "--moved-past-demotion", action=argparse.BooleanOptionalAction, default=None,
        help="a checkpoint a conversation moved past goes low priority once it moves on again "
        "(docs/prefix-caching.md, \"Eviction by value\"; default on)",
    )
    parser.add_argument(
        "--min-chunk-tokens",
        type=a.number("--min-chunk-tokens", "tokens", minimum=0, maximum=a.MAX_CHUNK_TOKENS),
        default=256, metavar="TOKENS",
        help="a running request's prefill chunk that does not fit shrinks to what fits, down to "
        "this many tokens, before a request is preempted (0: never shrink; default 256)",
    )
    parser.add_argument(
        "--plot", type=a.nonempty("--plot"), metavar="PATH", default=None,
        help="write a plot of the run (.png, .pdf or .svg; no extension: .png)",
    )


def _add_cluster_arguments(parser: Any) -> None:
    """Several instances sharing a KV tier (``hybridkv.cli.simulate_cluster``)."""
    parser.add_argument(
        "--instances", type=a.number("--instances", maximum=MAX_INSTANCES), default=1, metavar="N",
        help="spread the workload round-robin over N instances (each its own manager and --kv-memory) "
        "sharing the --tier store; needs --tier (default 1)",
    )
    parser.add_argument(
        "--tier", choices=TIERS, default=None,
        help="a KV store the instances offload to and load from: compares N instances with it, without it, "
        "and one instance with all their memory (Mooncake: a master on loopback is started and stopped)",
    )
    parser.add_argument(
        "--tier-memory", type=a.number("--tier-memory", "bytes", maximum=a.MAX_KV_MEMORY_BYTES), default=None,
        metavar="SIZE", help="the store's capacity (host budget, disk budget, Mooncake segment; default 4GiB)",
    )
    parser.add_argument(
        "--write-through", action=argparse.BooleanOptionalAction, default=None,
        help="offload entries when published, not only when evicted (default on with --tier)",
    )
    parser.add_argument(
        "--in-flight-wait", type=a.number("--in-flight-wait", minimum=0, maximum=MAX_IN_FLIGHT_WAIT),
        default=None, metavar="STEPS",
        help="with --tier: a request whose next prefix block another request is computing (a marker in "
        "the store) waits up to this many steps, then loads it or computes it (0: never wait; default "
        f"{DEFAULT_IN_FLIGHT_WAIT})",
    )


def plot_path(text: str) -> str:
    """The file ``--plot`` writes: ``.png`` added when there is no extension; the
    folder must exist and be writable, the name short enough, the extension known."""
    root, extension = os.path.splitext(text)
    if not extension:
        text += ".png"
    elif extension.lower() not in PLOT_FORMATS:
        raise ValueError(f"--plot: unknown extension {extension!r} (use {', '.join(PLOT_FORMATS)})")
    a.check_path_name("--plot", text)
    folder = os.path.dirname(text) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"--plot: no such folder {folder!r}")
    if os.path.isdir(text):
        raise ValueError(f"--plot: {text!r} is a folder")
    if not os.access(folder, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise ValueError(f"--plot: cannot write to {text!r} (permission denied)")
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "--plot needs matplotlib: pip install 'hybridkv[plot]' (in a source checkout: "
            "pip install -e '.[plot]')"
        )
    return text


def workload_source(text: str) -> str:
    """``-`` reads standard input; a long name is refused before the file system sees it."""
    if text == "-":
        return "/dev/stdin"
    if text not in WORKLOAD_NAMES:
        a.check_path_name("--workload", text)
    return text


def check_arguments(args: argparse.Namespace) -> None:
    """Everything that can be checked before planning and the run."""
    switches = ("thrash_guard", "moved_past_demotion")  # on / off flags
    for flag in ("state_checkpoint_interval", "checkpoint_policy", "checkpoint_interval_tokens", *switches):
        if getattr(args, flag) is not None and not args.prefix_caching:
            name = f"--{flag.replace('_', '-')}"
            raise ValueError(f"{name} / --no-{name[2:]} needs --prefix-caching" if flag in switches else
                             f"{name} needs --prefix-caching")
    try:  # the grain's multiple is checked when the manager is built (before the run)
        checkpoint_policy(args.checkpoint_policy, None, args.checkpoint_interval_tokens, 1)
    except ValueError as exc:
        raise ValueError(a.flag_names(str(exc))) from None
    check_tier_arguments(args)
    args.workload = workload_source(args.workload)
    if args.plot is not None:
        args.plot = plot_path(args.plot)


def check_tier_arguments(args: argparse.Namespace) -> None:
    """``--instances``, ``--tier-memory``, ``--write-through`` and ``--in-flight-wait`` need ``--tier``; a tier
    needs prefix caching."""
    if args.tier is None:
        for flag, given in (("--instances", args.instances != 1), ("--tier-memory", args.tier_memory is not None),
                            ("--write-through", args.write_through is not None),
                            ("--in-flight-wait", args.in_flight_wait is not None)):
            if given:
                raise ValueError(f"{flag} needs --tier (the store the instances share)")
        return
    if not args.prefix_caching:
        raise ValueError("--tier needs --prefix-caching (objects are keyed by cached prefixes)")
    if args.tier_memory is None:
        args.tier_memory = DEFAULT_TIER_MEMORY
    if args.in_flight_wait is None:
        args.in_flight_wait = DEFAULT_IN_FLIGHT_WAIT
    if args.tier == "mooncake" and args.tier_memory < 16 << 20:
        raise ValueError("--tier-memory: a Mooncake segment needs at least 16MiB")
    if args.write_through is None:
        args.write_through = True


MAX_SIMULATED_POOL_PAGES = 2**24


def check_pool_sizes(plan, page_space: str) -> None:
    """The simulator holds every page of every pool in memory: refuse budgets whose
    pools would not fit this machine before any is allocated."""
    if page_space == "shared":
        from hybridkv.memory.geometry import shared_arena_for

        geometry = shared_arena_for(plan)
        pages = {gid: geometry.view_pages(gid) for gid in geometry.page_bytes}
    else:
        pages = plan.group_pages
    gid, count = max(pages.items(), key=lambda item: item[1])
    if count > MAX_SIMULATED_POOL_PAGES:
        raise ValueError(
            f"--kv-memory: {count:,} pages of {gid} are more than the {MAX_SIMULATED_POOL_PAGES:,} "
            "a simulated pool holds; plan budgets this large with `hybridkv plan`"
        )


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    from rich.console import Console

    from hybridkv.cli.simulate_render import print_summary, progress_bar, write_plot
    from hybridkv.runtime.manager import CacheManager
    from hybridkv.sim.driver import Simulator
    from hybridkv.sim.workloads import build_workload

    plan = build_plan(args)
    check_pool_sizes(plan, args.page_space)
    requests = build_workload(
        args.workload, num_requests=args.requests, seed=args.seed,
        max_request_tokens=plan.limits.max_context_tokens,
    )
    if args.tier is not None:
        return _run_with_tier(args, plan, requests)
    options = {"enable_prefix_caching": args.prefix_caching, **checkpoint_options(args)}
    try:
        manager = CacheManager.from_plan(plan, page_space=args.page_space, **options)
    except ValueError as exc:
        raise ValueError(a.flag_names(str(exc))) from None
    if args.thrash_guard is not None:
        manager.prefix.thrash_guard = args.thrash_guard
    if args.moved_past_demotion is not None:
        manager.prefix.demote_moved_past = args.moved_past_demotion
    sim = Simulator(
        manager, requests,
        max_running=plan.limits.max_running_requests,
        step_token_budget=plan.limits.max_scheduled_tokens,
        min_chunk_tokens=args.min_chunk_tokens,
    )
    with progress_bar(len(requests), quiet=args.json or not sys.stderr.isatty()) as advance:
        result = sim.run(on_step=lambda step, done: advance(done))
    summary = result.summary()
    summary.update(
        workload=args.workload, requests=len(requests), prefix_caching=args.prefix_caching,
        kv_memory_bytes=plan.budget_bytes, page_space=args.page_space, model=plan.layout.name,
        thrash_guarded_requests=manager.prefix.thrash_guarded_requests if manager.prefix is not None else 0,
        moved_past_demoted=manager.prefix.moved_past_demoted if manager.prefix is not None else 0,
    )
    if args.plot:
        write_plot(result, args.plot, summary)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary, Console(width=100))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def checkpoint_options(args: argparse.Namespace) -> dict[str, Any]:
    """The manager's checkpoint options the flags set (none when left out)."""
    names = ("state_checkpoint_interval", "checkpoint_policy", "checkpoint_interval_tokens")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _run_with_tier(args: argparse.Namespace, plan, requests) -> int:
    from hybridkv.cli.simulate_cluster import report, run_cluster_command

    summary = run_cluster_command(args, plan, requests, build_plan)
    summary.update(
        workload=args.workload, requests=len(requests), kv_memory_bytes=plan.budget_bytes,
        page_space=args.page_space, model=plan.layout.name,
    )
    report(summary, args)
    return 0
