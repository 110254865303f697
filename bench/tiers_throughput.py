"""KV tiers: load and offload throughput through the Mooncake tier against raw Mooncake reads and
writes of the same bytes, and stored bytes per cached token against the groups' byte-ideal and a
naive full-page layout.

    .venv/bin/python bench/tiers_throughput.py                 # V4-Flash, a 16k-token prefix, 7 rounds
    .venv/bin/python bench/tiers_throughput.py --tokens 4096 --repeats 3 --batch 8 --json PATH

The objects are one handoff's (history blocks of the two compressed groups, the checkpoint of the
sliding groups at the end). Every path moves the same objects in the same batches (``--batch``):

* raw ``get_batch`` (the client's ``get``, a new ``bytes`` per value) and raw ``batch_get_into``
  a registered buffer (the fastest read the client has; 16 objects a batch is on its plateau);
* tier fetch: ``ObjectStore.fetch`` (``batch_get_into`` + checksum, header and key checks);
* tier load: ``stream_load`` into pools (fetch + verify + scatter), batch after batch and with
  the next batch in flight; handoff load: ``HandoffPlan.load`` (one fetch of everything, then
  the scatter of what the boundary uses: all or nothing);
* raw ``put_batch`` / ``batch_put_from`` against tier offload (``OffloadPlan.run``: gather with room
  for each header, header written in place, ``put``).

The paths take turns within each round (drift hits them alike); medians of the rounds.
Needs the [mooncake] extra and its libraries (scripts/install-test-deps.sh); it starts its own
master on loopback. One process is both writer and reader (the objects live in this client's
segment), so a transfer is a memory copy by Mooncake's transfer threads, not a network. Writes a
table and JSON (default bench/out/tiers_throughput.json) with every round's seconds.
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
from hybridkv.tiers import ObjectStore, encode_object, new_group_pools, stream_load
from hybridkv.tiers.mooncake import MooncakeMaster, MooncakeTier
from hybridkv.tiers.rows import GroupPages
from hybridkv.transfer import OffloadPlan, checkpoint_tokens, export_objects, plan_handoff


def build_source(layout, tokens: int, seed: int, objects=None):
    """Pools holding random bytes on shuffled pages for one request of ``tokens`` tokens: per group,
    the logical pages that ``objects`` (planned objects; default all of the prefix) touch, and two
    more pages that no view holds."""
    rng = np.random.default_rng(seed)
    spans = {g.group_id: (0, tokens) for g in layout.groups}
    if objects is not None:
        spans = {g.group_id: (tokens, 0) for g in layout.groups}
        for o in objects:
            lo, hi = spans[o.key.group_id]
            spans[o.key.group_id] = (min(lo, o.first_token), max(hi, o.end_token))
    first, need = {}, {}
    for g in layout.groups:
        lo, hi = spans[g.group_id]
        first[g.group_id] = lo // g.spec.page_tokens if hi > lo else 0
        need[g.group_id] = max(0, math.ceil(hi / g.spec.page_tokens) - first[g.group_id]) + 2
    pools = new_group_pools(layout, need)
    pages = {}
    for gid, group in pools.items():
        for plane in group.planes:
            plane.pool[...] = np.frombuffer(rng.bytes(plane.pool.size), dtype=np.uint8).reshape(plane.pool.shape)
        pages[gid] = GroupPages(first[gid], rng.permutation(np.arange(1, need[gid]))[: need[gid] - 2])
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


def rounds_of(paths, repeats: int, after=None) -> dict:
    """Seconds of each path per round, wall and CPU (``process_time``: every thread of this process,
    Mooncake's transfer threads included); the paths take turns within a round, so drift (other
    jobs on the machine) hits every path alike. ``after`` (untimed) runs after each path."""
    rounds = {name: ([], []) for name, _ in paths}
    for _ in range(repeats):
        for name, fn in paths:
            start, cpu = time.perf_counter(), time.process_time()
            fn()
            rounds[name][0].append(time.perf_counter() - start)
            rounds[name][1].append(time.process_time() - cpu)
            if after is not None:
                after()
    return rounds


def summarize(rounds: dict, total_bytes: int, floors: tuple[str, ...], paths: tuple[str, ...]) -> dict:
    """Median seconds (wall and CPU) and MB/s per path; each tier path's share of each raw floor
    (medians of the wall times)."""
    out = {}
    for name, (times, cpu_times) in rounds.items():
        median = statistics.median(times)
        out[name] = {"median_s": median, "mb_per_s": total_bytes / median / 1e6,
                     "cpu_median_s": statistics.median(cpu_times),
                     "rounds_s": [round(t, 6) for t in times], "rounds_cpu_s": [round(t, 6) for t in cpu_times]}
    best = min(floors, key=lambda f: out[f]["median_s"])
    for name in paths:
        for floor in floors:
            out[name][f"of_{floor}"] = out[floor]["median_s"] / out[name]["median_s"]
        out[name]["of_best_raw"] = out[best]["median_s"] / out[name]["median_s"]
    return out


LOAD_FLOORS = ("raw_get_batch", "raw_get_into")
LOAD_PATHS = ("tier_fetch", "tier_load_serial", "tier_load", "handoff_load")


def measure_load(tier, store, plan, objects, layout, args) -> dict:
    """Raw Mooncake reads of the stored objects against the tier's fetch and loads into pools."""
    names = [store.name(o.key) for o in plan.objects]
    sizes = [len(encode_object(o, store.namespace)) for o in objects]
    ranges = [(o.key, o.first_token, o.end_token) for o in plan.objects]
    rows = [o.num_rows for o in objects]
    batches = [list(range(i, min(i + args.batch, len(names)))) for i in range(0, len(names), args.batch)]
    dst_pools, dst_pages = build_source(layout, args.tokens, args.seed + 1, plan.objects)

    def raw_get_batch():
        for b in batches:
            tier.raw_get([names[i] for i in b])

    def raw_get_into():
        for b in batches:
            codes = tier.raw_get_into([names[i] for i in b], [sizes[i] for i in b])
            assert list(codes) == [sizes[i] for i in b], f"batch_get_into answered {list(codes)}"

    def tier_fetch():
        for b in batches:
            store.fetch([plan.objects[i].key for i in b], [rows[i] for i in b])

    def tier_load_serial():
        assert all(stream_load(store, ranges, dst_pools, dst_pages, batch_objects=args.batch, overlap=False))

    def tier_load():
        assert all(stream_load(store, ranges, dst_pools, dst_pages, batch_objects=args.batch, overlap=True))

    def handoff_load():
        assert plan.load(store, dst_pools, dst_pages).boundary_tokens == args.tokens

    for load in (tier_load_serial, tier_load, handoff_load):
        clear(dst_pools)
        load()
        for i, o in enumerate(plan.objects):  # each load moved the right bytes
            assert np.array_equal(export_objects([o], dst_pools, dst_pages)[0].payload, objects[i].payload)
    paths = (("raw_get_batch", raw_get_batch), ("raw_get_into", raw_get_into), ("tier_fetch", tier_fetch),
             ("tier_load_serial", tier_load_serial), ("tier_load", tier_load), ("handoff_load", handoff_load))
    return summarize(rounds_of(paths, args.repeats), sum(sizes), LOAD_FLOORS, LOAD_PATHS)


def clear(pools) -> None:
    for group in pools.values():
        for plane in group.planes:
            plane.pool[...] = 0


OFFLOAD_FLOORS = ("raw_put_batch", "raw_put_from")
OFFLOAD_PATHS = ("tier_offload",)


def measure_offload(tier, layout, plan, pools, pages, args) -> dict:
    """Raw Mooncake puts of the encoded objects against gather + encode + put through the tier
    (under another namespace, so the loaded objects stay); everything put is removed between rounds."""
    store = ObjectStore(tier, layout, model_id=f"{args.model}@offload-bench")
    objects = export_objects(plan.objects, pools, pages)
    encoded = [encode_object(o, store.namespace) for o in objects]
    sizes = [len(b) for b in encoded]
    staged = tier.receive_buffer(1)[: sum(sizes)]
    staged[...] = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    batches = [list(range(i, min(i + args.batch, len(plan.objects)))) for i in range(0, len(plan.objects), args.batch)]
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
    raw_names = [f"raw-put/{i}" for i in range(len(encoded))]
    pattern = f"^(raw-put/|hkv1/{store.namespace.hex}/)"

    def raw_put_batch():
        for b in batches:
            assert tier.raw_put([raw_names[i] for i in b], [encoded[i] for i in b]) == 0

    def raw_put_from():
        for b in batches:
            codes = tier.raw_put_from([raw_names[i] for i in b], [starts[i] for i in b], [sizes[i] for i in b], 1)
            assert list(codes) == [0] * len(b)

    def tier_offload():
        for b in batches:
            planned = tuple(plan.objects[i] for i in b)
            assert all(OffloadPlan(planned, tuple(pages[o.key.group_id] for o in planned)).run(store, pools))

    paths = (("raw_put_batch", raw_put_batch), ("raw_put_from", raw_put_from), ("tier_offload", tier_offload))
    rounds = rounds_of(paths, args.repeats, after=lambda: tier.raw_remove_matching(pattern))
    return summarize(rounds, sum(sizes), OFFLOAD_FLOORS, OFFLOAD_PATHS)


def run(args) -> dict:
    layout = cache_layout(args.model)
    # a read lease of 5 s (the tests' 50 ms can expire inside a batch get on a loaded machine)
    with tempfile.TemporaryDirectory() as tmp, MooncakeMaster(log_path=os.path.join(tmp, "master.log"),
                                                              lease_ms=5000) as master:
        tier = MooncakeTier(master.master_address, master.metadata_url, segment_bytes=args.segment_mib << 20,
                            local_buffer_bytes=args.buffer_mib << 20, receive_bytes=args.receive_mib << 20)
        try:
            store = ObjectStore(tier, layout)
            plan = plan_handoff(store, np.arange(args.tokens) % 50000, args.tokens)
            pools, pages = build_source(layout, args.tokens, args.seed, plan.objects)
            objects = export_objects(plan.objects, pools, pages)
            assert all(store.put(objects)), "the store refused objects: raise --segment-mib"
            load = measure_load(tier, store, plan, objects, layout, args)
            offload = measure_offload(tier, layout, plan, pools, pages, args)
        finally:
            tier.close()
    encoded = [encode_object(o, store.namespace) for o in objects]
    return {
        "model": args.model,
        "tokens": args.tokens,
        "objects": len(objects),
        "bytes": sum(len(b) for b in encoded),
        "batch_objects": args.batch,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "load": load,
        "offload": offload,
        "bytes_per_token": bytes_per_token(layout, objects, encoded, args.tokens),
    }


LABELS = {
    "raw_get_batch": "raw Mooncake get_batch (bytes per value)",
    "raw_get_into": "raw Mooncake batch_get_into (registered)",
    "tier_fetch": "tier fetch (get_into + verify)",
    "tier_load_serial": "tier load, batch after batch",
    "tier_load": "tier load, next batch in flight",
    "handoff_load": "handoff load (one fetch, 2 threads after)",
    "raw_put_batch": "raw Mooncake put_batch",
    "raw_put_from": "raw Mooncake batch_put_from (registered)",
    "tier_offload": "tier offload (OffloadPlan.run)",
}


def print_table(rows: dict, floors: tuple[str, str]) -> None:
    short = [f.replace("raw_", "of ") for f in floors]
    print(f"{'path':<44}{'MB/s':>8}{short[0]:>18}{short[1]:>17}{'CPU ms':>9}")
    for name, row in rows.items():
        shares = [f"{row[f'of_{f}']:.0%}" if f"of_{f}" in row else "" for f in floors]
        cpu_ms = row["cpu_median_s"] * 1e3
        print(f"{LABELS[name]:<44}{row['mb_per_s']:>8.0f}{shares[0]:>18}{shares[1]:>17}{cpu_ms:>9.1f}")


def print_report(report: dict) -> None:
    print(f"{report['model']}: {report['tokens']} tokens, {report['objects']} objects, "
          f"{report['bytes'] / 2**20:.1f} MiB, batches of {report['batch_objects']} objects, "
          f"median of {report['repeats']} rounds, {report['cpus']} CPUs, load average {report['load_average_1m']:.2f}")
    print_table(report["load"], LOAD_FLOORS)
    print()
    print_table(report["offload"], OFFLOAD_FLOORS)
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
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16, help="objects per get_batch call")
    parser.add_argument("--segment-mib", type=int, default=256)
    parser.add_argument("--buffer-mib", type=int, default=64)
    parser.add_argument("--receive-mib", type=int, default=64, help="each of the tier's two receive buffers")
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
