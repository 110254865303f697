"""Where a serving step's time goes: ``bench/vs_vllm``'s serving phase, hybridkv side only.

    PYTHONPATH=src:bench .venv/bin/python bench/serving_parts.py [--sizes 32,1024] [--package hybridkv]
        [--against hybridkv_base] [--cold MIB] [--rounds N] [--kv-memory-gib GIB] [--fill-tokens N]

The same workload as ``bench/vs_vllm --phases serving`` (``measure_serving``: 5
rounds of 32 steps, V4-Flash, 40 GiB shared arena, prefix caching and prompt
checkpoints on; each step frees the requests that finished, adds the joiners and
schedules every decode and prefill chunk in one ``schedule``), after an untimed
warm-up run that loads the compiled kernels. A timer (thread CPU time) wraps the
manager's public calls and, inside them, its stages, during the timed steps only;
prints each stage's µs per timed step and its calls per step. Stages nest (indented
under the call or stage they run in; ``_commit_rows`` runs in ``schedule`` and in
``free``). The stage names are the code's, so this script follows it: a renamed
stage is reported missing. ``--package``: a renamed copy of another version
(``hybridkv_base``, as for ``bench/step_profile.py --against``) on ``PYTHONPATH``.

``--against PACKAGE`` (such a copy): both versions' managers in one process, their
steps alternating (``measure_serving`` with two sides), half the timed rounds with
each side listed first (with identical code, the side listed first read 2-15% slower
per stage, though the steps' order rotates: one order alone is not an A/B); each
stage per version and the change (a few % between runs of the same code under load).
``--cold MIB``: before every timed step, ``bench/step_profile.py``'s walk of about
``MIB`` MiB of Python objects (as ``bench/vs_vllm``, where a vLLM step runs between two
of ours); ``--rounds``: timed rounds (5); ``--kv-memory-gib``: the arena's size (40);
``--fill-tokens N``: each segment's cache starts full (``vs_vllm.serving.fill_prefix_cache``: N tokens of
distinct prompts prefilled and freed after the reset, untimed), the state of a server that has run a while,
where every allocation evicts (without it the segments start empty and never evict).
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections import defaultdict

from step_profile import ColdWalk
from vs_vllm import serving as serving_phase
from vs_vllm.sides import GIB, HybridkvSide
from vs_vllm.workload import ServingShape

CLOCK = time.thread_time_ns
# (module under the package, class, method, label); the label's indent is its nesting.
STAGES = (
    ("runtime.manager", "CacheManager", "add_request", "add_request"),
    ("prefix.cache", "PrefixCache", "match_and_borrow", "  match_and_borrow"),
    ("prefix.cache", "PrefixCache", "_match", "    _match"),
    ("runtime.manager", "CacheManager", "free", "free"),
    ("memory.pool", "PageSpace", "free_rows", "  PageSpace.free_rows"),  # before free_row
    ("memory.pool", "PageSpace", "free_row", "  PageSpace.free_row"),
    ("memory.pool", "PageSpace", "keyed_idle", "  PageSpace.keyed_idle (free and schedule)"),
    ("runtime.manager", "CacheManager", "schedule", "schedule"),
    ("runtime.manager", "CacheManager", "_admit", "  _admit"),
    ("runtime.manager", "CacheManager", "_grow_instead_of_evicting", "    _grow_instead_of_evicting"),
    ("runtime.manager", "CacheManager", "_commit_rows", "  _commit_rows (schedule and free)"),
    ("runtime.manager", "CacheManager", "_run", "  _run"),
    ("runtime.manager", "CacheManager", "_after_run", "    _after_run"),
    ("memory.pool", "PagePool", "make_room", "      make_room"),
    ("memory.pool", "PagePool", "_evict_low_below", "        _evict_low_below"),
    ("memory.pool", "PagePool", "_evict_lru", "        _evict_lru"),
    ("runtime.manager", "CacheManager", "_build_batch", "  _build_batch"),
)


class Timers:
    """Thread CPU time per stage, counted only while a timed step runs."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False
        self.steps = 0
        self.originals: list[tuple[type, str, object]] = []
        self.missing: set[str] = set()  # stages this version does not have

    def unwrap(self) -> None:
        for cls, name, inner in reversed(self.originals):
            setattr(cls, name, inner)

    def wrap(self, cls: type, name: str, label: str) -> None:
        inner = getattr(cls, name, None)
        if inner is None:
            self.missing.add(label)
            return
        self.originals.append((cls, name, inner))

        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            start = CLOCK()
            try:
                return inner(*args, **kwargs)
            finally:
                self.ns[label] += CLOCK() - start
                self.calls[label] += 1

        setattr(cls, name, timed)


def measure(size: int, packages: list[str], cold: float = 0.0, rounds: int = 5, kv_memory_gib: float = 40.0,
            fill_tokens: int = 0) -> tuple[dict[str, Timers], dict]:
    """Each package's stage timers and ``measure_serving``'s figures; two packages: half the rounds in each order."""
    timers = {package: Timers() for package in packages}
    for package, t in timers.items():
        for module, cls_name, name, label in STAGES:
            t.wrap(getattr(importlib.import_module(f"{package}.{module}"), cls_name), name, label)
    step, walk = serving_phase.ServingDriver.step, ColdWalk(cold) if cold > 0 else None

    def timed_step(driver, index):
        if walk is not None:
            walk()
        t = timers[driver.side.package]
        t.on, t.steps = True, t.steps + 1
        try:
            return step(driver, index)
        finally:
            t.on = False

    sides = {package: _side(size, package, timers[package], kv_memory_gib) for package in packages}
    options = dict(running=size, step_tokens=8192, chunk_tokens=2048, shape=ServingShape(), seed=0,
                   fill_tokens=fill_tokens)
    # Untimed warm-up: the first call of each compiled kernel loads (or compiles) it, milliseconds
    # that would land in whichever stage first calls it (at 32 running, ~8 ms in one ``free``). A
    # whole round, so that rarer paths (a superseded checkpoint, an eviction) load there too.
    serving_phase.measure_serving(sides, steps=32, rounds=1, **options)
    serving_phase.ServingDriver.step = timed_step
    try:
        out = serving_phase.measure_serving(sides, steps=32, rounds=rounds if len(sides) == 1 else rounds - rounds // 2,
                                            **options)
        if len(sides) > 1:
            serving_phase.measure_serving(dict(reversed(sides.items())), steps=32, rounds=rounds // 2, **options)
    finally:
        serving_phase.ServingDriver.step = step
        for t in timers.values():
            t.unwrap()
    return timers, out


def _side(size: int, package: str, timers: Timers, kv_memory_gib: float = 40.0) -> HybridkvSide:
    """``package``'s side as ``bench/vs_vllm`` builds it, its token appends (the engine's, outside the step) untimed."""
    side = type("Side", (HybridkvSide,), {"package": package, "name": package})(
        kv_memory_bytes=int(kv_memory_gib * GIB), max_model_len=131_072, max_num_batched_tokens=8192, max_num_seqs=size,
        page_space="shared", prompt_checkpoints=True)
    append_many = side.append_many

    def untimed_append(*args):
        was, timers.on = timers.on, False
        try:
            return append_many(*args)
        finally:
            timers.on = was

    side.append_many = untimed_append
    return side


def report(size: int, package: str, timers: dict[str, Timers], figures: dict, against: str | None = None) -> None:
    t, mine = timers[package], figures[package]
    n, total = t.steps, _total(t)
    print(f"{package} at {size} running: {n} timed steps, {total / n / 1e3:.0f} µs a step (thread CPU, the three "
          f"calls); wall mean {mine['us_per_step_mean']:.0f} µs; hit rate {mine['hit_rate']:.3f}"
          + ("" if against is None else f"; {against} {_total(timers[against]) / timers[against].steps / 1e3:.0f} µs"))
    for _, _, _, label in STAGES:
        if label in t.missing:
            print(f"  {label:40s} (missing)")
            continue
        share = 100 * t.ns[label] / total if total else 0.0
        line = f"  {label:40s} {t.ns[label] / n / 1e3:8.0f} µs {share:5.1f}%  {t.calls[label] / n:5.2f} calls a step"
        if against is not None:
            b = timers[against]
            base = b.ns[label] / b.steps / 1e3
            line += f"   {against} {base:6.0f} µs" + (f" ({t.ns[label] / n / 1e3 / base - 1:+.1%})" if base else "")
        print(line)


def _total(t: Timers) -> int:
    return sum(t.ns[label] for label in ("add_request", "free", "schedule"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32,1024")
    ap.add_argument("--package", default="hybridkv")
    ap.add_argument("--against", default=None, help="a renamed copy of another version, run alongside")
    ap.add_argument("--cold", type=float, default=0.0, help="MiB of Python objects walked before every timed step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kv-memory-gib", type=float, default=40.0)
    ap.add_argument("--fill-tokens", type=int, default=0, help="tokens of freed prompts filling the cache first")
    a = ap.parse_args()
    packages = [a.package] + ([a.against] if a.against else [])
    for size in (int(s) for s in a.sizes.split(",")):
        timers, figures = measure(size, packages, a.cold, a.rounds, a.kv_memory_gib, max(0, a.fill_tokens))
        report(size, a.package, timers, figures, a.against)


if __name__ == "__main__":
    main()
