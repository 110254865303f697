"""Token hit rate against KV budget: hybridkv, vLLM 0.33 and the offline bound (issue 21).

Run (hybridkv lines and the bound; about 10 min on a busy 2-core machine)::

    .venv/bin/python bench/hit_sweep.py --plot bench/out/hit_sweep.png

With the vLLM lines too (vLLM 0.33 in /work/venv-vllm)::

    PYTHONPATH=src:bench /work/venv-vllm/bin/python bench/hit_sweep.py --plot bench/out/hit_sweep.png

Workloads (all seeded; the same token ids go to every manager):

* ``multiturn``: ``multiturn_workload(120, 6)`` (720 requests), served in
  waves of 40 conversations (``in_waves``): at most 40 conversations interleave,
  as when about 40 are in flight on a server;
* ``agentic``: ``agentic_workload(96)`` in waves of 32 sessions;
* ``trace``: a JSONL trace (``--trace PATH``; by default one written to
  ``bench/out/hit_sweep_trace.jsonl`` and read back through ``load_jsonl_trace``):
  300 requests over 48 shared document prefixes (2k-16k tokens, Zipf-like
  popularity) with unique questions.

Serving (the concurrency model, the same for every line): one request at a
time in list order, as ``bench/vs_vllm``'s multi-turn phase does: probe the
prefix cache, prefill in 2,048-token steps, feed the answer back in steps of
up to 256 tokens (all but its last token, as decode would; in chunks rather
than token by token to keep the run short), free. The hit of a request is its
first probe. Lines:

* ``hybridkv shared`` / ``hybridkv per-group``: ``CacheManager.from_plan`` on
  ``plan_for_budget`` with ``page_space="shared"`` / ``"per-group"``, prefix
  caching on, default options but the checkpoint policy (``--checkpoint-policy``,
  ``--checkpoint-interval-tokens``; docs/prefix-caching.md), the thrash guard
  (``--no-thrash-guard`` turns it off) and the moved-past demotion
  (``--no-moved-past-demotion``), which the JSON records;
* ``vLLM default`` / ``vLLM retention None``: vLLM 0.33's ``KVCacheManager`` as
  ``bench/vs_vllm``'s ``VllmSide`` builds it, with
  ``prefix_cache_retention_interval`` 0 (vLLM's default) / ``None`` (a
  checkpoint at every boundary);
* ``tokenspeed 0.1.30`` / ``SGLang 0.5.23``: tokenspeed's scheduler sized by
  its own V4 recipe / SGLang's V4 pool, SWA allocator and radix tree sized by
  its own configurator (``bench/peers``; the peers environment, bench/README.md);
* ``offline bound``: ``hybridkv.sim.offline_bound`` (Belady-style, with
  knowledge of the future, under the same one-at-a-time model);
* ``ideal (256 grain)``: ``ideal_hit_tokens(..., grain_tokens=256)``, no budget.

Prints a table, then per hybridkv run and group the value report
(``mgr.prefix.value_report()``: cached and evicted pages, usable / cached
entries, evicted pages by reason; docs/prefix-caching.md) and the arena's slabs;
writes JSON (``--json``, default ``bench/out/hit_sweep.json``) and, with
``--plot PATH``, one panel per workload.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybridkv.prefix.checkpoints import CHECKPOINT_POLICIES, DEFAULT_CHECKPOINT_POLICY, checkpoint_policy  # noqa: E402
from hybridkv.cli.args import flag_names  # noqa: E402
from hybridkv.models.layout import cache_layout  # noqa: E402
from hybridkv.sim.offline_bound import UnitBytes, offline_hit_bound  # noqa: E402
from hybridkv.sim.workloads import (  # noqa: E402
    DEFAULT_VOCAB_SIZE,
    agentic_workload,
    ideal_hit_tokens,
    in_waves,
    load_jsonl_trace,
    multiturn_workload,
)
from peers import PEER_LINES, load_peer_side, peer_lines_skipped  # noqa: E402
from vs_vllm.sides import HybridkvSide, load_vllm_side  # noqa: E402

GIB = 2**30
CHUNK_TOKENS = 2048
ANSWER_CHUNK_TOKENS = 256
MAX_NUM_SEQS = 16  # the plan reserves running state for this many; the sweep runs one at a time
LINES = ("hybridkv shared", "hybridkv per-group", "vLLM default", "vLLM retention None", *PEER_LINES, "offline bound")


def parse_bytes(text: str) -> int:
    text = text.strip()
    for suffix, scale in (("GiB", GIB), ("MiB", 2**20)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


# ----------------------------------------------------------------------------- workloads


def write_trace(path: Path, *, seed: int, requests: int = 300, documents: int = 48) -> None:
    """A prefix-sharing JSONL trace in the documented format (``prefix_id`` form)."""
    rng = np.random.default_rng(seed)
    doc_tokens = np.clip(np.rint(rng.lognormal(np.log(6000), 0.6, documents)), 2048, 16384).astype(int)
    weights = 1.0 / np.arange(1, documents + 1)
    picks = rng.choice(documents, size=requests, p=weights / weights.sum())
    lines = []
    for i, doc in enumerate(picks):
        question = int(np.clip(rng.lognormal(np.log(200), 0.7), 16, 2048))
        answer = int(np.clip(rng.lognormal(np.log(200), 0.6), 16, 1024))
        lines.append(json.dumps({
            "request_id": f"rag-{i:05d}", "arrival": i, "prefix_id": f"doc{doc:03d}",
            "prefix_tokens": int(doc_tokens[doc]), "prompt_tokens": int(doc_tokens[doc]) + question,
            "output_tokens": answer,
        }))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def build_workloads(args: argparse.Namespace) -> dict[str, list]:
    out: dict[str, list] = {}
    if "multiturn" in args.workloads:
        out["multiturn"] = in_waves(multiturn_workload(args.conversations, 6, seed=args.seed), args.wave)
    if "agentic" in args.workloads:
        out["agentic"] = in_waves(agentic_workload(args.sessions, seed=args.seed), args.agent_wave)
    if "trace" in args.workloads:
        path = Path(args.trace) if args.trace else Path(args.json).with_name("hit_sweep_trace.jsonl")
        if not args.trace:
            write_trace(path, seed=args.seed, requests=args.trace_requests)
        out["trace"] = load_jsonl_trace(path, seed=args.seed, vocab_size=DEFAULT_VOCAB_SIZE)
    return out


# ----------------------------------------------------------------------------- serving


def serve_in_order(side: Any, requests: list) -> np.ndarray:
    """Hit tokens per request, one request at a time (module docstring)."""
    hits = np.zeros(len(requests), dtype=np.int64)
    for index, item in enumerate(requests):
        handle = side.new_request(item.request_id, item.prompt_token_ids, max_tokens=item.output_tokens)
        hits[index] = side.probe_hit(handle)
        while (done := side.num_computed_tokens(handle)) < item.prompt_tokens:
            side.begin_step()
            if not side.allocate(handle, min(CHUNK_TOKENS, item.prompt_tokens - done)):
                raise RuntimeError(f"{side.name}: {item.request_id} refused while prefilling")
        answer = [int(t) for t in item.output_token_ids]
        fed = 0  # answer tokens fed back and computed; the last one never is
        while fed < len(answer) - 1:
            step = min(ANSWER_CHUNK_TOKENS, len(answer) - 1 - fed)
            side.append_tokens(handle, answer[fed : fed + step])
            side.begin_step()
            if not side.allocate(handle, step):
                raise RuntimeError(f"{side.name}: {item.request_id} refused while decoding")
            fed += step
        side.free(handle)
    return hits


def make_side(line: str, budget_bytes: int, max_model_len: int, vllm_side: Any, policy: Any = None,
              thrash_guard: bool = True, moved_past: bool = True) -> Any:
    """``policy``: the hybridkv lines' ``hybridkv.prefix.checkpoints.CheckpointPolicy`` (None: the default);
    ``thrash_guard``, ``moved_past``: their prefix cache's thrash guard and moved-past demotion
    (docs/prefix-caching.md, "Eviction by value")."""
    common = dict(kv_memory_bytes=budget_bytes, max_model_len=max_model_len,
                  max_num_batched_tokens=CHUNK_TOKENS, max_num_seqs=MAX_NUM_SEQS)
    if line in PEER_LINES:  # bench/peers: a side with serve(requests)
        return load_peer_side(line)(**common)
    if line.startswith("hybridkv"):
        options = {} if policy is None else dict(checkpoint_policy=policy.name,
                                                 checkpoint_interval_tokens=policy.interval_tokens)
        side = HybridkvSide(page_space="shared" if line.endswith("shared") else "per-group", **common, **options)
        side.manager.prefix.thrash_guard = thrash_guard
        side.manager.prefix.demote_moved_past = moved_past
        return side
    retention = 0 if line == "vLLM default" else None
    return vllm_side(prefix_cache_retention_interval=retention, **common)


def group_diagnostics(side: Any) -> dict[str, dict]:
    """Per group after the run: ``CacheManager.stats()`` counts and the prefix cache's
    value report (usable entries, evicted pages by reason; docs/prefix-caching.md)."""
    manager = side.manager
    value = manager.prefix.value_report() if manager.prefix is not None else {}
    out = {}
    for gid, st in manager.stats().items():
        out[gid] = dict(cached_pages=st.cached_pages, evicted_pages=st.evicted_pages,
                        peak_used_pages=st.peak_used_pages, total_pages=st.total_pages)
        if gid in value:
            v = value[gid]
            out[gid].update(cached_entries=v.cached_entries, usable_entries=v.usable_entries,
                            evicted_by_reason=v.evicted_pages)
    if manager.arena is not None:
        out["arena"] = dict(slabs_owned=manager.arena.slabs_owned(), slab_moves=manager.arena.slab_moves)
    if manager.prefix is not None:  # what the thrash guard and the moved-past demotion did (docs/prefix-caching.md)
        out["prefix"] = dict(thrash_guarded_requests=manager.prefix.thrash_guarded_requests,
                             moved_past_demoted=manager.prefix.moved_past_demoted)
    return out


def run_line(line: str, requests: list, budget_bytes: int, vllm_side: Any, sizes: UnitBytes,
             policy: Any = None, thrash_guard: bool = True, moved_past: bool = True) -> dict:
    prompt_tokens = sum(r.prompt_tokens for r in requests)
    start = time.perf_counter()
    if line == "offline bound":
        bound = offline_hit_bound(requests, sizes, budget_bytes)
        return dict(hit_rate=bound.hit_rate, seconds=time.perf_counter() - start)
    longest = max(r.prompt_tokens + r.output_tokens for r in requests)
    max_model_len = -(-longest // 4096) * 4096
    try:
        side = make_side(line, budget_bytes, max_model_len, vllm_side, policy, thrash_guard, moved_past)
        hits = side.serve(requests) if hasattr(side, "serve") else serve_in_order(side, requests)
    except (RuntimeError, ValueError) as exc:
        return dict(hit_rate=None, error=str(exc)[:300], seconds=time.perf_counter() - start)
    result = dict(hit_rate=float(hits.sum() / prompt_tokens), seconds=time.perf_counter() - start)
    if line.startswith("hybridkv"):
        result["groups"] = group_diagnostics(side)
        result["checkpoint_policy"] = side.manager.prefix.checkpoint_policy
        result["checkpoint_interval_tokens"] = side.manager.prefix.checkpoint_interval_tokens
        result["thrash_guard"] = side.manager.prefix.thrash_guard
        result["demote_moved_past"] = side.manager.prefix.demote_moved_past
    return result


# ----------------------------------------------------------------------------- report


def print_table(results: dict, budgets: list[int], lines: list[str]) -> None:
    for workload, entry in results.items():
        print(f"\n{workload}: {entry['requests']:,} requests, {entry['prompt_tokens']:,} prompt tokens, "
              f"ideal {entry['ideal_hit_rate']:.1%} (256 grain: {entry['grain_256_hit_rate']:.1%})")
        print("| KV budget | " + " | ".join(lines) + " |")
        print("|---:|" + "---:|" * len(lines))
        for budget in budgets:
            row = entry["budgets"][str(budget)]
            bound = row.get("offline bound", {}).get("hit_rate")
            cells = []
            for line in lines:
                rate = row.get(line, {}).get("hit_rate")
                above = bound is not None and rate is not None and rate > bound + 1e-9
                cells.append("-" if rate is None else f"{rate:.1%}" + (" (above the bound!)" if above else ""))
            print(f"| {budget / GIB:g} GiB | " + " | ".join(cells) + " |")
    print_diagnostics(results, budgets)


def print_diagnostics(results: dict, budgets: list[int]) -> None:
    """Per group, after each hybridkv run: pages cached / evicted, usable entries of the
    cached ones, evicted pages by reason (prompt, orphan, gap, lru, unit, slab), slabs owned, requests
    the thrash guard put next in line."""
    for workload, entry in results.items():
        for line in ("hybridkv shared", "hybridkv per-group"):
            for budget in budgets:
                groups = entry["budgets"][str(budget)].get(line, {}).get("groups")
                if not groups:
                    continue
                print(f"# {workload}, {line}, {budget / GIB:g} GiB, per group: cached pages / evicted pages;"
                      " usable / cached entries; evicted by reason")
                for gid, g in groups.items():
                    if gid == "arena":
                        print(f"#   arena: slabs owned {g['slabs_owned']}, slab moves {g['slab_moves']:,}")
                        continue
                    if gid == "prefix":
                        print(f"#   thrash guard: {g['thrash_guarded_requests']:,} requests guarded; moved-past "
                              f"demotion: {g.get('moved_past_demoted', 0):,} checkpoints demoted")
                        continue
                    reasons = ", ".join(f"{k} {n:,}" for k, n in g.get("evicted_by_reason", {}).items() if n)
                    print(f"#   {gid.removeprefix('v4.')}: {g['cached_pages']:,} / {g['evicted_pages']:,}; "
                          f"{g.get('usable_entries', 0):,} / {g.get('cached_entries', 0):,}; {reasons or '-'}")


def write_plot(results: dict, budgets: list[int], lines: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    xs = [b / GIB for b in budgets]
    for ax, (workload, entry) in zip(axes[0], results.items()):
        for line in lines:
            ys = [entry["budgets"][str(b)].get(line, {}).get("hit_rate") for b in budgets]
            if any(y is not None for y in ys):
                ax.plot(xs, [np.nan if y is None else 100 * y for y in ys], marker="o", label=line,
                        linestyle="--" if line == "offline bound" else "-")
        ax.axhline(100 * entry["grain_256_hit_rate"], color="grey", linewidth=0.8, label="ideal (256 grain)")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.set_xlabel("KV budget (GiB)")
        ax.set_ylabel("token hit rate (%)")
        ax.set_title(workload)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def merge(args: argparse.Namespace) -> int:
    results: dict[str, Any] = {}
    unit_bytes: dict = {}
    for path in args.merge:
        data = json.loads(Path(path).read_text())
        unit_bytes = data["unit_bytes"]
        for workload, entry in data["results"].items():
            into = results.setdefault(workload, {**entry, "budgets": {}})
            for budget, row in entry["budgets"].items():
                into["budgets"].setdefault(budget, {}).update(row)
    budgets = sorted({int(b) for entry in results.values() for b in entry["budgets"]})
    lines = [line for line in LINES if any(line in row for e in results.values() for row in e["budgets"].values())]
    Path(args.json).write_text(json.dumps(dict(unit_bytes=unit_bytes, results=results), indent=1))
    print_table(results, budgets, lines)
    if args.plot:
        write_plot(results, budgets, lines, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", default="2GiB,3GiB,6GiB,40GiB")
    parser.add_argument("--workloads", default="multiturn,agentic,trace")
    parser.add_argument("--lines", default=",".join(LINES))
    parser.add_argument("--trace", default=None, help="a JSONL trace (default: write one, see above)")
    parser.add_argument("--trace-requests", type=int, default=300)
    parser.add_argument("--conversations", type=int, default=120)
    parser.add_argument("--wave", type=int, default=40, help="conversations interleaved (multiturn)")
    parser.add_argument("--sessions", type=int, default=96)
    parser.add_argument("--agent-wave", type=int, default=32, help="sessions interleaved (agentic)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-policy", choices=CHECKPOINT_POLICIES, default=DEFAULT_CHECKPOINT_POLICY,
                        help="the hybridkv lines' checkpoint policy (docs/prefix-caching.md; default %(default)s)")
    parser.add_argument("--checkpoint-interval-tokens", type=int, default=None, metavar="TOKENS",
                        help="the \"interval\" policy's k: a speculative checkpoint every k tokens (a multiple of 256)")
    parser.add_argument("--thrash-guard", action=argparse.BooleanOptionalAction, default=True,
                        help="the hybridkv lines' thrash guard (docs/prefix-caching.md; default on)")
    parser.add_argument("--moved-past-demotion", action=argparse.BooleanOptionalAction, default=True,
                        help="the hybridkv lines' moved-past demotion (docs/prefix-caching.md; default on)")
    parser.add_argument("--json", default="bench/out/hit_sweep.json")
    parser.add_argument("--plot", default=None, help="write the plot here (.png, .pdf, .svg)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="run nothing: merge these result files (e.g. one from the vLLM venv, "
                        "one from .venv with matplotlib), print the table, write --json and --plot")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args)
    try:
        policy = checkpoint_policy(args.checkpoint_policy, None, args.checkpoint_interval_tokens, 256)
    except ValueError as exc:
        parser.error(flag_names(str(exc)))
    args.workloads = args.workloads.split(",")
    budgets = [parse_bytes(b) for b in args.budgets.split(",")]
    lines = [line for line in args.lines.split(",") if line]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    vllm_side = load_vllm_side()
    if isinstance(vllm_side, str):
        print(f"# vLLM lines skipped: {vllm_side}", file=sys.stderr)
        lines = [line for line in lines if not line.startswith("vLLM")]
    for line, reason in peer_lines_skipped(lines).items():
        print(f"# {line} skipped: {reason}", file=sys.stderr)
        lines.remove(line)
    sizes = UnitBytes.from_layout(cache_layout("deepseek-v4-flash", indexer="fp8"))
    results: dict[str, Any] = {}
    for workload, requests in build_workloads(args).items():
        prompt_tokens = sum(r.prompt_tokens for r in requests)
        entry = results[workload] = dict(
            requests=len(requests), prompt_tokens=prompt_tokens,
            ideal_hit_rate=float(ideal_hit_tokens(requests).sum() / prompt_tokens),
            grain_256_hit_rate=float(ideal_hit_tokens(requests, grain_tokens=256).sum() / prompt_tokens),
            budgets={},
        )
        for budget in budgets:
            row = entry["budgets"][str(budget)] = {}
            for line in lines:
                row[line] = run_line(line, requests, budget, vllm_side, sizes, policy, args.thrash_guard,
                                     args.moved_past_demotion)
                rate = row[line]["hit_rate"]
                print(f"# {workload} {budget / GIB:g} GiB {line}: "
                      f"{'refused' if rate is None else f'{rate:.1%}'} ({row[line]['seconds']:.0f} s)",
                      file=sys.stderr, flush=True)
            Path(args.json).write_text(json.dumps(dict(unit_bytes=vars(sizes), results=results), indent=1))
    print_table(results, budgets, lines)
    if args.plot:
        write_plot(results, budgets, lines, args.plot)
        print(f"plot written to {args.plot}")
    print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
