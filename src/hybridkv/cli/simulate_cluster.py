"""``hybridkv simulate --instances N --tier host|disk|mooncake``: instances sharing one KV store.

Three runs of the same workload: N instances sharing the store, N instances
without it, and one instance holding everything: the N instances' memory in
one device cache, with a store of its own of the same kind and size. Reported: each run's token hit rate, the
store's share of the hits, and the bytes that went through the store per
token it served, beside a naive layout that stores every group's full pages.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from contextlib import ExitStack
from typing import Any

from hybridkv.units import format_bytes

TIERS = ("host", "disk", "mooncake")


def open_store(kind: str, budget_bytes: int, layout, stack: ExitStack):
    """An ObjectStore over a fresh tier of ``kind``; closed (master stopped, folder removed) by ``stack``."""
    from hybridkv.tiers import DiskTier, HostTier, ObjectStore

    if kind == "host":
        tier = HostTier(budget_bytes)
    elif kind == "disk":
        root = stack.enter_context(tempfile.TemporaryDirectory(prefix="hybridkv-simulate-"))
        tier = DiskTier(root, budget_bytes=budget_bytes)
    else:
        from hybridkv.tiers.mooncake import MooncakeMaster, MooncakeTier, load_store_class

        load_store_class()  # what to install, before a master starts
        master = MooncakeMaster().start()
        stack.callback(master.stop)
        tier = MooncakeTier(master.master_address, master.metadata_url, segment_bytes=budget_bytes,
                            local_buffer_bytes=128 << 20)
        stack.callback(tier.close)
    return ObjectStore(tier, layout)


def _manager_factory(plan, args: argparse.Namespace):
    from hybridkv.runtime.manager import CacheManager

    from hybridkv.cli.simulate_cmd import checkpoint_options

    options: dict[str, Any] = {"enable_prefix_caching": True, **checkpoint_options(args)}

    def make(link):
        return CacheManager.from_plan(plan, page_space=args.page_space, tier_link=link, **options)

    return make


def _simulator_options(plan, args: argparse.Namespace) -> dict:
    return {"max_running": plan.limits.max_running_requests, "step_token_budget": plan.limits.max_scheduled_tokens,
            "min_chunk_tokens": args.min_chunk_tokens}


def _store_counts(store) -> dict:
    """What a run's store counted: objects stored, loaded, missing, corrupt; its tier's errors,
    refused puts and evictions."""
    store_stats, tier_stats = store.stats(), store.tier.stats()
    return {"stored": store_stats.stored, "loaded": store_stats.loaded, "missing": store_stats.missing,
            "corrupt": store_stats.corrupt, "tier_errors": tier_stats.errors,
            "tier_refused": tier_stats.refused, "tier_evicted": tier_stats.evicted}


def _one_instance(args: argparse.Namespace, big, requests) -> dict:
    """One instance of ``big`` (the instances' memory together) with a store of its own; its
    store's counts under ``"store"``."""
    from hybridkv.sim.cluster import run_cluster

    with ExitStack() as stack:
        own = open_store(args.tier, args.tier_memory, big.layout, stack)
        run = run_cluster(_manager_factory(big, args), requests, 1, store=own, write_through=args.write_through,
                          simulator_options=_simulator_options(big, args), wait_steps=args.in_flight_wait).summary()
        return {**run, "store": _store_counts(own)}


def run_cluster_command(args: argparse.Namespace, plan, requests, build_plan) -> dict:
    """The three runs; the summary."""
    from hybridkv.sim.cluster import naive_bytes_per_token, run_cluster
    from hybridkv.sim.workloads import ideal_hit_tokens

    n = args.instances
    runs = {}
    with ExitStack() as stack:
        store = open_store(args.tier, args.tier_memory, plan.layout, stack)
        run = run_cluster(_manager_factory(plan, args), requests, n, store=store, write_through=args.write_through,
                          simulator_options=_simulator_options(plan, args), wait_steps=args.in_flight_wait).summary()
        runs["with_store"] = {**run, "store": _store_counts(store)}
    runs["without_store"] = run_cluster(_manager_factory(plan, args), requests, n,
                                        simulator_options=_simulator_options(plan, args)).summary()
    whole = copy.copy(args)
    whole.kv_memory = args.kv_memory * n
    if n == 1:  # the one instance holding everything is the run with the store
        runs["one_instance"] = runs["with_store"]
    else:
        runs["one_instance"] = _one_instance(args, build_plan(whole), requests)
    shared = runs["with_store"]
    served = shared["tier_hit_tokens"]
    naive = naive_bytes_per_token(plan.layout)
    moved = shared["put_bytes"] + shared["fetched_bytes"]
    one = runs["one_instance"]["token_hit_rate"]
    ideal = ideal_hit_tokens(list(requests), grain_tokens=plan.scheduler_page_tokens)
    return {
        **runs,
        "one_instance_kv_memory_bytes": whole.kv_memory,
        "ideal_hit_rate": float(ideal.sum()) / max(sum(r.prompt_tokens for r in requests), 1),
        "instances": n,
        "tier": args.tier,
        "tier_memory_bytes": args.tier_memory,
        "write_through": args.write_through,
        "in_flight_wait_steps": args.in_flight_wait,
        "hit_rate_vs_one_instance": shared["token_hit_rate"] / one if one else 0.0,
        "bytes_moved_per_tier_hit_token": moved / served if served else 0.0,
        "naive_bytes_moved_per_tier_hit_token": (naive * (shared["offloaded_prefix_tokens"] + served) / served
                                                 if served else 0.0),
        "naive_bytes_per_token": naive,
        "store": shared["store"],
    }


def print_cluster_summary(summary: dict, console) -> None:
    from rich.table import Table

    n, memory = summary["instances"], format_bytes(summary["kv_memory_bytes"])
    where = f"over {n} instances, {summary['model']}, {memory} each" if n > 1 else \
        f"on 1 instance, {summary['model']}, {memory}"
    title = (f"simulate: {summary['workload']} ({summary['requests']:,} requests) {where}; store: "
             f"{summary['tier']} {format_bytes(summary['tier_memory_bytes'])}")
    table = Table(title=title)
    for column in ("run", "token hit rate", "from the store", "preemptions", "steps"):
        table.add_column(column, justify="left" if column == "run" else "right")
    count = f"{summary['instances']} instance" + ("s" if summary["instances"] > 1 else "")
    names = {"with_store": f"{count} sharing the store" if summary["instances"] > 1 else f"{count} with the store",
             "without_store": f"{count}, no store",
             "one_instance": f"1 instance, {format_bytes(summary['one_instance_kv_memory_bytes'])}, own store"}
    if summary["instances"] == 1:
        del names["one_instance"]
    for key, name in names.items():
        run = summary[key]
        share = run.get("tier_hit_tokens", 0) / run["prompt_tokens"] if run["prompt_tokens"] else 0.0
        table.add_row(name, f"{run['token_hit_rate']:.1%}", f"{share:.1%}", f"{run['preemptions']:,}",
                      f"{run['steps']:,}")
    console.print(table)
    shared, own = summary["with_store"], summary["one_instance"]["store"]
    console.print(
        f"hit rate vs one instance: {summary['hit_rate_vs_one_instance']:.1%} "
        f"(unbounded-cache ideal: {summary['ideal_hit_rate']:.1%}); "
        f"loads confirmed {shared['loads']['confirmed']:,}, failed {shared['loads']['failed']:,}, "
        f"denied {shared['loads']['denied']:,}\n"
        f"through the store: put {shared['put_objects']:,} objects ({format_bytes(shared['put_bytes'])}), "
        f"fetched {shared['fetched_objects']:,} ({format_bytes(shared['fetched_bytes'])}); "
        f"refused by the tier {summary['store']['tier_refused']:,}, tier errors {summary['store']['tier_errors']:,} "
        f"(one instance's own store: {own['tier_refused']:,} and {own['tier_errors']:,})\n"
        f"bytes moved per token served by the store: {summary['bytes_moved_per_tier_hit_token']:,.0f} "
        f"(naive full pages: {summary['naive_bytes_moved_per_tier_hit_token']:,.0f})"
    )


def write_cluster_plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rates, moved) = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = ("one_instance", "with_store", "without_store")
    labels = [f"1 instance, {format_bytes(summary['one_instance_kv_memory_bytes'])}\n+ own {summary['tier']}", f"{summary['instances']} instances\nshared {summary['tier']}",
              f"{summary['instances']} instances\nno store"]
    device = [100 * (summary[k]["hit_tokens"] - summary[k]["tier_hit_tokens"]) / max(summary[k]["prompt_tokens"], 1)
              for k in keys]
    store = [100 * summary[k]["tier_hit_tokens"] / max(summary[k]["prompt_tokens"], 1) for k in keys]
    rates.bar(labels, device, color="tab:blue", label="device hit")
    rates.bar(labels, store, bottom=device, color="tab:orange", label="loaded from the store")
    rates.axhline(100 * summary["ideal_hit_rate"], color="black", linestyle=":", linewidth=1,
                  label="unbounded-cache ideal")
    rates.set_ylabel("token hit rate (%)")
    rates.set_ylim(0, 100)
    rates.legend(fontsize=8, loc="upper right", ncol=2)
    values = [summary["bytes_moved_per_tier_hit_token"], summary["naive_bytes_moved_per_tier_hit_token"]]
    moved.bar(["hybridkv objects", "naive full pages"], values, color=["tab:green", "tab:gray"])
    moved.set_yscale("log")
    moved.set_ylim(bottom=max(min(values), 1.0) / 10)
    moved.set_ylabel("bytes through the store per token it served")
    for x, value in enumerate(values):
        moved.text(x, value, f"{value:,.0f}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"hybridkv simulate --instances {summary['instances']} --tier {summary['tier']}: "
                 f"{summary['workload']} ({summary['requests']:,} requests), {summary['model']}, "
                 f"{format_bytes(summary['kv_memory_bytes'])} each", fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def report(summary: dict, args: argparse.Namespace) -> None:
    import json

    from rich.console import Console

    if args.plot:
        write_cluster_plot(summary, args.plot)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_cluster_summary(summary, Console(width=110))
        if args.plot:
            print(f"plot written to {args.plot}")
    sys.stdout.flush()
