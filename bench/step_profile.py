"""Step cost of ``CacheManager.schedule`` / ``schedule_uniform``, for profiling.

    .venv/bin/python bench/step_profile.py [--sizes 32,128,512,1024] [--steps 300]
        [--phase decode|decode-pairs|serving|prefill|both] [--profile cprofile|none] [--clock wall|cpu] [--json PATH]
        [--against PACKAGE] [--cold MIB]

Manager as ``bench/vs_vllm/sides.py`` builds it: DeepSeek-V4-Flash (FP8 indexer),
40 GiB shared arena, prefix caching on, 8,192 tokens per step, context 131,072,
every step ``block_tables="updates"``. Public API only.

* decode: ``N`` requests (prompts 512-1,536 tokens, prefilled untimed) schedule
  one token each per step (``schedule_uniform``); timed: that call.
* decode-pairs: the decode steps given to ``schedule`` as a list of ``(id, 1)``
  pairs (as a caller that does not use ``schedule_uniform`` writes them), the
  list built untimed (after ``--cold``'s walk); timed: the ``schedule`` call.
* serving: each step the oldest request finishes (``free``), one joins with a
  512-1,536-token prompt (``add_request``), and one ``schedule`` runs the
  ``N - 1`` decoders (1 token) plus the newcomer's whole prompt; timed: the three
  calls. Token appends are untimed in both phases.
* prefill: unique 32,768-token prompts (added and freed untimed), one after the
  other, scheduled in 2,048-token chunks, one chunk a step (as
  ``bench/vs_vllm``'s prefill phase); timed: the chunk's ``schedule``. The size
  only sets the manager's running limit.

Prints p50/p99 per phase and size (and with ``--profile cprofile`` the top of a
cProfile of the timed calls). The figures are wall time on whatever machine runs
it: on a shared one, compare runs made back to back, or use ``--against``: a
copy of another version renamed to another package (``hybridkv`` -> e.g.
``hybridkv_base`` in every import) on ``PYTHONPATH``, whose steps alternate with
this version's on the same workload, the side that runs first swapping every step
(with the order fixed, the same code on both sides read up to 6% apart).

``--cold MIB``: before every timed step, walk about ``MIB`` MiB of Python objects
(small objects with a few attributes, lists and a bytearray, as another component's
scheduling code walks its own requests and blocks; untimed), so each step starts
with the L1/L2 caches evicted, as in ``bench/vs_vllm``, where each hybridkv step
follows a vLLM step. 0 (the default): steps back to back (warm).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import json
import pstats
import time
from functools import partial

import numpy as np

GIB = 2**30
PROMPT_RANGE = (512, 1536)
STEP_TOKENS = 8192
CONTEXT_TOKENS = 131_072
MAX_NEW_TOKENS = 4096
CLOCK = time.perf_counter_ns  # --clock cpu: this thread's CPU time (steadier on a shared machine)


class _Block:
    __slots__ = ("block_id", "ref_cnt", "hash", "prev", "next")

    def __init__(self, block_id: int, prev):
        self.block_id, self.ref_cnt, self.hash, self.prev, self.next = block_id, 0, None, prev, None


class ColdWalk:
    """About ``mib`` MiB of Python objects (linked blocks with a few attributes, as a
    block pool's, plus a bytearray) that ``__call__`` walks, touching every object:
    the CPU's private caches hold none of the manager's data afterwards."""

    def __init__(self, mib: float):
        n = int(mib * 2**20 * 0.75 / 104)  # a slotted object of 5 fields ~ 72 B, its list slot and an int
        blocks, prev = [], None
        for i in range(n):
            prev = _Block(1_000_000 + i, prev)
            blocks.append(prev)
        self.blocks = blocks
        self.bytes = np.ones(int(mib * 2**20 * 0.25) // 8, dtype=np.int64)

    def __call__(self) -> int:
        total = 0
        for block in self.blocks:
            block.ref_cnt += 1
            total += block.block_id
        return total + int(self.bytes.sum())


BEFORE_STEP = None  # --cold: a ColdWalk run before every timed step


def build_manager(running: int, package: str = "hybridkv"):
    """The manager of ``package`` (``hybridkv``, or a renamed copy of another version)."""
    layout = importlib.import_module(f"{package}.models.layout")
    plan_module = importlib.import_module(f"{package}.plan")
    manager = importlib.import_module(f"{package}.manager")
    limits = plan_module.Limits(max(running, 2), STEP_TOKENS, CONTEXT_TOKENS)
    plan = plan_module.plan_for_budget(layout.cache_layout("deepseek-v4-flash", indexer="fp8"), 40 * GIB, limits)
    return manager.CacheManager.from_plan(plan, page_space="shared", enable_prefix_caching=True)


class Workload:
    """``running`` live requests on one manager, with a seeded prompt stream."""

    def __init__(self, running: int, seed: int = 0, package: str = "hybridkv"):
        self.manager = build_manager(running, package)
        self.rng = np.random.default_rng(seed)
        self.live: list[str] = []
        self.prompts: dict[str, int] = {}
        self.next_id = 0
        for _ in range(running):
            self.join()
        self.prefill()

    def prompt(self) -> np.ndarray:
        n = int(self.rng.integers(PROMPT_RANGE[0], PROMPT_RANGE[1] + 1))
        return self.rng.integers(0, 100_000, n, dtype=np.int32)

    def join(self) -> tuple[str, int]:
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = self.prompt()
        hit = self.manager.add_request(rid, prompt, max_new_tokens=MAX_NEW_TOKENS)
        self.prompts[rid] = prompt.size
        self.live.append(rid)
        return rid, hit.hit_tokens

    def prefill(self) -> None:
        m = self.manager
        pending = list(self.live)
        while pending:
            items, budget = [], STEP_TOKENS
            for rid in pending:
                n = min(self.prompt_left(rid), budget)
                if n:
                    items.append((rid, n))
                    budget -= n
                if not budget:
                    break
            m.schedule(items, block_tables="updates")
            self.sample([rid for rid, n in items if not self.prompt_left(rid)])
            pending = [rid for rid in pending if self.prompt_left(rid)]

    def prompt_left(self, rid: str) -> int:
        return self.prompts[rid] - self.manager.num_computed_tokens(rid)

    def sample(self, rids: list[str]) -> None:
        if rids:
            tokens = self.rng.integers(0, 100_000, (len(rids), 1), dtype=np.int32)
            self.manager.append_token_ids_many(tuple(rids), tokens)


def decode_steps(work: Workload, steps: int, profiler=None, pairs: bool = False) -> list[int]:
    """Timed ``schedule_uniform(ids, 1)`` steps; ``pairs`` (``--phase decode-pairs``): ``schedule`` of ``(id, 1)``
    pairs, the list built after the walk, as a caller builds it just before the call."""
    m, ids, out = work.manager, tuple(work.live), []
    call, args = (m.schedule, None) if pairs else (m.schedule_uniform, (ids, 1))
    for _ in range(steps):
        if BEFORE_STEP is not None:
            BEFORE_STEP()
        if pairs:
            args = ([(rid, 1) for rid in ids],)
        if profiler:
            profiler.enable()
        start = CLOCK()
        call(*args, block_tables="updates")
        out.append(CLOCK() - start)
        if profiler:
            profiler.disable()
        work.sample(list(ids))
    return out


def serving_steps(work: Workload, steps: int, profiler=None) -> list[int]:
    m, out = work.manager, []
    for _ in range(steps):
        gone = work.live.pop(0)
        prompt = work.prompt()
        rid = f"r{work.next_id}"
        work.next_id += 1
        if BEFORE_STEP is not None:
            BEFORE_STEP()
        if profiler:
            profiler.enable()
        start = CLOCK()
        m.free(gone)
        hit = m.add_request(rid, prompt, max_new_tokens=MAX_NEW_TOKENS)
        items = [(r, 1) for r in work.live] + [(rid, prompt.size - hit.hit_tokens)]
        m.schedule(items, block_tables="updates")
        out.append(CLOCK() - start)
        if profiler:
            profiler.disable()
        work.live.append(rid)
        work.sample(work.live)
    return out


PREFILL_PROMPT_TOKENS, CHUNK_TOKENS = 32_768, 2048


class PrefillWork:
    """Long unique prompts on one manager, one at a time."""

    def __init__(self, running: int, seed: int = 0, package: str = "hybridkv"):
        self.manager = build_manager(running, package)
        self.rng = np.random.default_rng(seed)
        self.request_id: str | None = None
        self.next_id = 0

    def next_chunk(self) -> str:
        """The request whose next chunk is due (a new one once the last is prefilled)."""
        m = self.manager
        if self.request_id is None or m.num_computed_tokens(self.request_id) >= PREFILL_PROMPT_TOKENS:
            if self.request_id is not None:
                m.free(self.request_id)
            self.request_id = f"p{self.next_id}"
            self.next_id += 1
            prompt = self.rng.integers(0, 100_000, PREFILL_PROMPT_TOKENS, dtype=np.int32)
            m.add_request(self.request_id, prompt, max_new_tokens=1)
        return self.request_id


def prefill_steps(work: PrefillWork, steps: int, profiler=None) -> list[int]:
    m, out = work.manager, []
    for _ in range(steps):
        items = [(work.next_chunk(), CHUNK_TOKENS)]
        if BEFORE_STEP is not None:
            BEFORE_STEP()
        if profiler:
            profiler.enable()
        start = CLOCK()
        m.schedule(items, block_tables="updates")
        out.append(CLOCK() - start)
        if profiler:
            profiler.disable()
    return out


PHASES = {"decode": (Workload, decode_steps), "decode-pairs": (Workload, partial(decode_steps, pairs=True)),
          "serving": (Workload, serving_steps),
          "prefill": (PrefillWork, prefill_steps)}


def summarize(ns: list[int]) -> dict:
    us = np.asarray(ns, dtype=np.float64) / 1e3
    p50, p99 = np.percentile(us, [50, 99])
    return {"mean_us": round(float(us.mean()), 1), "p50_us": round(float(p50), 1), "p99_us": round(float(p99), 1),
            "steps": len(ns)}


def run(sizes, steps, phases, profile, against=None) -> dict:
    """p50/p99 per phase and size; with ``against`` (a package name) the same
    workload on that package's manager too, the two sides' steps alternating (and
    which side goes first, step by step)."""
    results = {}
    profiler = cProfile.Profile() if profile == "cprofile" else None
    sides = ("hybridkv",) if against is None else (against, "hybridkv")
    for n in sizes:
        for phase in phases:
            work_class, fn = PHASES[phase]
            works = {side: work_class(n, package=side) for side in sides}
            times = {side: [] for side in sides}
            for side in sides:
                fn(works[side], 20)  # warm (kernels compiled, caches filled)
            gc.disable()
            try:
                for k in range(steps):
                    for side in sides[::-1] if k % 2 else sides:  # odd steps: this version first
                        times[side] += fn(works[side], 1, profiler if side == "hybridkv" else None)
            finally:
                gc.enable()
            for side in sides:
                key = f"{phase}/{n}" if side == "hybridkv" else f"{side}:{phase}/{n}"
                results[key] = summarize(times[side])
                print(f"{side:14s} {phase:8s} {n:5d}  {results[key]}", flush=True)
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(35)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32,128,512,1024")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--phase", choices=(*PHASES, "both"), default="both", help="both: decode and serving")
    ap.add_argument("--profile", choices=("cprofile", "none"), default="none")
    ap.add_argument("--json", default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--against", default=None,
                    help="package of another version (a renamed copy on PYTHONPATH), steps alternating")
    ap.add_argument("--cold", type=float, default=0.0, help="MiB of Python objects walked before every timed step")
    a = ap.parse_args()
    if a.cold > 0:
        global BEFORE_STEP
        BEFORE_STEP = ColdWalk(a.cold)
    if a.clock == "cpu":
        global CLOCK
        CLOCK = time.thread_time_ns
    phases = ("decode", "serving") if a.phase == "both" else (a.phase,)
    results = run([int(s) for s in a.sizes.split(",")], a.steps, phases, a.profile, a.against)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
