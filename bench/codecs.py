"""Codec throughput next to a plain-numpy floor measured in the same run.

    .venv/bin/python bench/codecs.py [--rows 100000] [--repeats 7] [--seed 0] [--markdown]

Scatter/gather slots: whole pages in random order with rows in order inside a
page (prefill-like), and separately fully random distinct slots (worst case).
Floors: encode / fake_quantize -> ``x.astype(float8_e4m3fn)`` of the same
``[rows, dim]`` float32 data; decode -> ``q.astype(float32)`` of an e4m3 array of
that shape; scatter / gather -> a plain contiguous copy of the same encoded bytes
into / out of the pool array. write_slots / read_slots (encode + scatter,
gather + decode) are compared with the sum of the two floors. Times are the
median of ``--repeats`` runs; each repeat times the floor right before the codec
and ratio = the median of the per-repeat codec time / floor time (target <= 4).
Writes ``bench/out/codecs.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from rich.console import Console
from rich.table import Table

from hybridkv.codecs import FP8IndexerCodec, KVRowCodec, MXFP4IndexerCodec

ROWS_PER_PAGE = 64
TARGET_RATIO = 4.0


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired_medians(fn, floor_fns, repeats: int) -> tuple[float, float, float]:
    """Median codec time, median floor time and median per-repeat ratio. Each repeat
    times the floor right before the codec, so both see the same machine load."""
    fn()  # warm-up (allocations, lazy imports)
    for floor in floor_fns:
        floor()
    codec_times, floor_times, ratios = [], [], []
    for _ in range(repeats):
        floor_s = sum(seconds(floor) for floor in floor_fns)
        codec_s = seconds(fn)
        codec_times.append(codec_s)
        floor_times.append(floor_s)
        ratios.append(codec_s / floor_s)
    return statistics.median(codec_times), statistics.median(floor_times), statistics.median(ratios)


def bench_codec(name, codec, rows: int, repeats: int, rng) -> list[dict]:
    # Values spread over many binades so scales vary per block.
    x = (rng.standard_normal((rows, codec.dim)) * np.exp2(rng.integers(-12, 12, (rows, 1)))).astype(
        np.float32
    )
    encoded = codec.encode(x)
    q8 = x.astype(ml_dtypes.float8_e4m3fn)
    num_pages = -(-rows // ROWS_PER_PAGE)
    pool = codec.new_pool(num_pages, ROWS_PER_PAGE)
    # Prefill-like: whole pages in random order, rows in order inside a page.
    page_order = rng.permutation(num_pages)[:, None] * ROWS_PER_PAGE
    slots = (page_order + np.arange(ROWS_PER_PAGE)).reshape(-1)[:rows].astype(np.int64)
    # Worst case: every row to a random distinct slot.
    random_slots = rng.permutation(num_pages * ROWS_PER_PAGE)[:rows].astype(np.int64)
    flat_pool = pool.reshape(-1)
    flat_rows = encoded.reshape(-1)
    nbytes = flat_rows.size

    def cast():
        return x.astype(ml_dtypes.float8_e4m3fn)

    def uncast():
        return q8.astype(np.float32)

    def copy_in():
        np.copyto(flat_pool[:nbytes], flat_rows)

    def copy_out():
        return flat_pool[:nbytes].copy()

    # The same random slots with whole rows as single items in a row-major array: the
    # cheapest scatter/gather with the codec's access pattern (no plane split).
    row_item = np.dtype((np.void, codec.row_bytes))
    aos = np.zeros((num_pages * ROWS_PER_PAGE, codec.row_bytes), dtype=np.uint8).view(row_item)[:, 0]
    encoded_items = np.ascontiguousarray(encoded).view(row_item)[:, 0]

    def row_scatter():
        aos[random_slots] = encoded_items

    def row_gather():
        return aos[random_slots]

    r = ROWS_PER_PAGE
    cases = [
        ("encode", lambda: codec.encode(x), [cast], "cast f32->e4m3"),
        ("decode", lambda: codec.decode(encoded), [uncast], "cast e4m3->f32"),
        ("fake_quantize", lambda: codec.fake_quantize(x), [cast], "cast f32->e4m3"),
        (
            "scatter (write_slot_bytes)",
            lambda: codec.write_slot_bytes(pool, slots, encoded, r),
            [copy_in],
            "copy into pool",
        ),
        (
            "gather (read_slot_bytes)",
            lambda: codec.read_slot_bytes(pool, slots, r),
            [copy_out],
            "copy out of pool",
        ),
        (
            "scatter, random slots",
            lambda: codec.write_slot_bytes(pool, random_slots, encoded, r),
            [copy_in],
            "copy into pool",
        ),
        (
            "gather, random slots",
            lambda: codec.read_slot_bytes(pool, random_slots, r),
            [copy_out],
            "copy out of pool",
        ),
        (
            "scatter, random slots",
            lambda: codec.write_slot_bytes(pool, random_slots, encoded, r),
            [row_scatter],
            "row scatter, same slots",
        ),
        (
            "gather, random slots",
            lambda: codec.read_slot_bytes(pool, random_slots, r),
            [row_gather],
            "row gather, same slots",
        ),
        (
            "write_slots (encode+scatter)",
            lambda: codec.write_slots(pool, slots, x, r),
            [cast, copy_in],
            "cast + copy",
        ),
        (
            "read_slots (gather+decode)",
            lambda: codec.read_slots(pool, slots, r),
            [uncast, copy_out],
            "cast + copy",
        ),
    ]
    results = []
    for op, fn, floor_fns, floor_name in cases:
        codec_s, floor_s, ratio = paired_medians(fn, floor_fns, repeats)
        results.append(
            {
                "format": name,
                "op": op,
                "rows": rows,
                "codec_s": codec_s,
                "floor_s": floor_s,
                "floor": floor_name,
                "codec_rows_per_s": rows / codec_s,
                "floor_rows_per_s": rows / floor_s,
                "ratio": ratio,
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "codecs.json")
    parser.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)

    formats = [
        ("KV 512/64", KVRowCodec(head_dim=512, rope_dim=64)),
        ("MXFP4 128", MXFP4IndexerCodec(dim=128)),
        ("FP8 idx 128", FP8IndexerCodec(dim=128)),
    ]
    results = []
    for name, codec in formats:
        results.extend(bench_codec(name, codec, args.rows, args.repeats, rng))

    table = Table(title=f"hybridkv.codecs, {args.rows:,} rows, median of {args.repeats}")
    for col in ("format", "op", "codec rows/s", "floor rows/s", "floor", "ratio"):
        table.add_column(col, justify="left" if col in ("format", "op", "floor") else "right")
    for r in results:
        ratio = f"{r['ratio']:.2f}x"
        if r["ratio"] > TARGET_RATIO:
            ratio = f"[red]{ratio}[/red]"
        table.add_row(
            r["format"],
            r["op"],
            f"{r['codec_rows_per_s'] / 1e6:.2f} M",
            f"{r['floor_rows_per_s'] / 1e6:.2f} M",
            r["floor"],
            ratio,
        )
    Console(width=130).print(table)
    if args.markdown:
        print("| format | op | codec rows/s | floor rows/s | floor | ratio |")
        print("|---|---|---:|---:|---|---:|")
        for r in results:
            print(
                f"| {r['format']} | {r['op']} | {r['codec_rows_per_s'] / 1e6:.2f} M "
                f"| {r['floor_rows_per_s'] / 1e6:.2f} M | {r['floor']} | {r['ratio']:.2f}x |"
            )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "rows": args.rows,
        "repeats": args.repeats,
        "rows_per_page": ROWS_PER_PAGE,
        "numpy": np.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
