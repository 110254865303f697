"""KV tiers: load throughput through the Mooncake tier vs raw Mooncake ``get`` of the same
bytes, and stored bytes per cached token vs the groups' byte-ideal and a naive full-page layout.

    .venv/bin/python bench/tiers_throughput.py                 # V4-Flash, 16k-token prefix, 5 repeats
    .venv/bin/python bench/tiers_throughput.py --tokens 4096 --repeats 3 --json PATH

Needs the [mooncake] extra and its libraries (scripts/install-test-deps.sh); it
starts its own master on loopback. One process is both writer and reader (the
objects live in this client's segment), so the figures are loopback memory
copies through the transfer engine, not a network. Writes a table and JSON
(default bench/out/tiers_throughput.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time

import numpy as np

from hybridkv.models.layout import cache_layout
from hybridkv.tiers import ObjectStore, encode_object, new_group_pools
from hybridkv.tiers.mooncake import MooncakeMaster, MooncakeTier
from hybridkv.tiers.rows import GroupPages, scatter_objects
from hybridkv.transfer import checkpoint_tokens, export_objects, plan_handoff


def build_source(layout, tokens: int, seed: int):
    """Pools holding random bytes on shuffled pages for one request of ``tokens`` tokens."""
    rng = np.random.default_rng(seed)
    need = {g.group_id: math.ceil(tokens / g.spec.page_tokens) + 2 for g in layout.groups}
    pools = new_group_pools(layout, need)
    pages = {}
    for gid, group in pools.items():
        for plane in group.planes:
            plane.pool[...] = rng.integers(0, 256, plane.pool.shape, dtype=np.uint8)
        pages[gid] = GroupPages(0, rng.permutation(np.arange(1, need[gid]))[: need[gid] - 2])
    return pools, pages


def bytes_per_token(layout, objects, encoded, tokens: int) -> dict:
    stored = sum(len(b) for b in encoded)
    payload = sum(o.payload.size for o in objects)
    ideal_history = sum(g.ideal_bytes_per_token for g in layout.groups) * tokens
    ideal_checkpoint = sum(
        len(g.layers) * g.row_bytes * checkpoint_tokens(layout, g.group_id, tokens)
        for g in layout.groups if g.spec.is_sliding
    )
    naive = sum(math.ceil(tokens / g.spec.page_tokens) * g.page_bytes for g in layout.groups)
    ideal = ideal_history + ideal_checkpoint
    return {
        "tokens": tokens,
        "stored_bytes_per_token": stored / tokens,
        "payload_bytes_per_token": payload / tokens,
        "ideal_bytes_per_token": ideal / tokens,
        "naive_full_page_bytes_per_token": naive / tokens,
        "stored_over_ideal": stored / ideal,
        "naive_over_ideal": naive / ideal,
    }


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def measure(tier, store, plan, objects, layout, args) -> dict:
    """Median seconds and MB/s of raw get, tier get and tier load of the plan's objects."""
    names = [store.name(o.key) for o in plan.objects]
    total_bytes = sum(len(encode_object(o, store.namespace)) for o in objects)
    batches = [list(range(i, min(i + args.batch, len(names)))) for i in range(0, len(names), args.batch)]
    dst_pools, dst_pages = build_source(layout, args.tokens, args.seed + 1)

    sizes = [len(encode_object(o, store.namespace)) for o in objects]
    rows = [o.num_rows for o in objects]

    def raw():
        for b in batches:
            tier.raw_get([names[i] for i in b])

    def raw_into():
        for b in batches:
            codes = tier.raw_get_into([names[i] for i in b], [sizes[i] for i in b])
            assert list(codes) == [sizes[i] for i in b]

    def tier_get():
        for b in batches:
            store.get([plan.objects[i].key for i in b])

    def tier_fetch():
        for b in batches:
            store.fetch([plan.objects[i].key for i in b], [rows[i] for i in b])

    def tier_load():
        for b in batches:
            scatter_objects(dst_pools, dst_pages, store.fetch([plan.objects[i].key for i in b], [rows[i] for i in b]))

    tier_load()
    for i, o in enumerate(plan.objects):  # the load moved the right bytes
        assert np.array_equal(export_objects([o], dst_pools, dst_pages)[0].payload, objects[i].payload)
    paths = (("raw_get", raw), ("raw_get_into", raw_into), ("tier_get", tier_get), ("tier_fetch", tier_fetch),
             ("tier_load", tier_load))
    rounds = {name: [] for name, _ in paths}
    for _ in range(args.repeats):  # interleaved, so drift hits every path alike
        for name, fn in paths:
            rounds[name] += timed(fn, 1)
    results = {}
    for name, times in rounds.items():
        median = statistics.median(times)
        results[name] = {"median_s": median, "mb_per_s": total_bytes / median / 1e6}
    for name in ("tier_get", "tier_fetch", "tier_load"):
        results[name]["of_raw"] = results["raw_get"]["median_s"] / results[name]["median_s"]
        results[name]["of_raw_into"] = results["raw_get_into"]["median_s"] / results[name]["median_s"]
    return results


def run(args) -> dict:
    layout = cache_layout(args.model)
    pools, pages = build_source(layout, args.tokens, args.seed)
    with tempfile.TemporaryDirectory() as tmp, MooncakeMaster(log_path=os.path.join(tmp, "master.log")) as master:
        tier = MooncakeTier(master.master_address, master.metadata_url, segment_bytes=args.segment_mib << 20,
                            local_buffer_bytes=args.buffer_mib << 20)
        try:
            store = ObjectStore(tier, layout)
            plan = plan_handoff(store, np.arange(args.tokens) % 50000, args.tokens)
            objects = export_objects(plan.objects, pools, pages)
            assert all(store.put(objects)), "the store refused objects: raise --segment-mib"
            results = measure(tier, store, plan, objects, layout, args)
        finally:
            tier.close()
    encoded = [encode_object(o, store.namespace) for o in objects]
    return {
        "model": args.model,
        "objects": len(objects),
        "bytes": sum(len(b) for b in encoded),
        "batch_objects": args.batch,
        "repeats": args.repeats,
        "throughput": results,
        "bytes_per_token": bytes_per_token(layout, objects, encoded, args.tokens),
    }


def print_report(report: dict) -> None:
    print(f"{report['model']}: {report['objects']} objects, {report['bytes'] / 2**20:.1f} MiB, "
          f"batches of {report['batch_objects']}, median of {report['repeats']}")
    print(f"{'path':<44}{'MB/s':>8}{'of get_batch':>14}{'of get_into':>13}")
    labels = {"raw_get": "raw Mooncake get_batch", "raw_get_into": "raw Mooncake batch_get_into (registered)",
              "tier_get": "tier get (get_batch + verify)", "tier_fetch": "tier fetch (get_into + verify)",
              "tier_load": "tier load (fetch + verify + scatter)"}
    for name, row in report["throughput"].items():
        share = f"{row['of_raw']:.0%}" if "of_raw" in row else ""
        share_into = f"{row['of_raw_into']:.0%}" if "of_raw_into" in row else ""
        print(f"{labels[name]:<44}{row['mb_per_s']:>8.0f}{share:>14}{share_into:>13}")
    b = report["bytes_per_token"]
    print(f"\nbytes per cached token ({b['tokens']} tokens, history + checkpoint at the end):")
    print(f"  stored objects   {b['stored_bytes_per_token']:>10.1f}  ({b['stored_over_ideal']:.4f}x ideal)")
    print(f"  payload only     {b['payload_bytes_per_token']:>10.1f}")
    print(f"  byte-ideal       {b['ideal_bytes_per_token']:>10.1f}")
    print(f"  naive full pages {b['naive_full_page_bytes_per_token']:>10.1f}  ({b['naive_over_ideal']:.2f}x ideal)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="deepseek-v4-flash")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="objects per get_batch call")
    parser.add_argument("--segment-mib", type=int, default=256)
    parser.add_argument("--buffer-mib", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench/out/tiers_throughput.json")
    args = parser.parse_args()
    report = run(args)
    print_report(report)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
