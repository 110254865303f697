"""Side by side: vLLM's KV-cache manager and hybridkv's, same layout, budget and workloads.

Run with the vLLM environment (bench/README.md):

    .venv-vllm/bin/python bench/vs_vllm.py            # full run, ~3-4 min on 2 cores
    .venv-vllm/bin/python bench/vs_vllm.py --quick    # smaller, for a smoke test

Both managers plan DeepSeek-V4-Flash (FP8 indexer, as vLLM uses) in the same
byte budget and are fed the same requests, phase by phase, alternating sides
within one process. Measured:

* decode: manager time per running request per decode step (``--decode-requests``
  running requests, chat-workload prompts, ``--decode-steps`` steps), with the
  two sides' steps alternating ("decode"), with each side's steps in a row
  ("decode_unpaired"), and alternating with a batch that changes every step
  ("decode_churn"); see ``measure_decode``;
* prefill: manager time per ``--chunk``-token prefill chunk;
* multiturn: token hit rate on conversations sharing a system prompt, requests
  served one after another (the order ``ideal_hit_tokens`` assumes);
* capacity: requests of ``--context`` tokens that fit, computed from the layout
  and measured by prefilling requests until the pool refuses (chunks after the
  first shrink to fit down to ``--capacity-min-chunk`` tokens; the
  ``capacity_fixed_chunk`` phase keeps every chunk at ``--chunk``).

It prints a table of ratios and writes JSON (``--json``, default
bench/out/vs_vllm.json). The hybridkv side is :class:`HybridkvSide`
(``--state-checkpoint-interval 256`` keeps a state checkpoint at every block).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from hybridkv.sim.workloads import (
    DEFAULT_VOCAB_SIZE,
    chat_workload,
    ideal_hit_tokens,
    multiturn_workload,
)

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_JSON = BENCH_DIR / "out" / "vs_vllm.json"
GIB = 2**30


class CacheSide(Protocol):
    """What both adapters offer (see bench/vllm_side.py for the semantics)."""

    name: str

    def describe(self) -> dict[str, Any]: ...
    def computed_capacity(self, context_tokens: int) -> float: ...
    def new_request(self, request_id: str, token_ids: Sequence[int], max_tokens: int = 1) -> Any: ...
    def probe_hit(self, request: Any) -> int: ...
    def allocate(self, request: Any, num_new_tokens: int) -> bool: ...
    def append_tokens(self, request: Any, token_ids: Sequence[int]) -> None: ...
    def free(self, request: Any) -> None: ...
    def begin_step(self) -> None: ...
    def num_computed_tokens(self, request: Any) -> int: ...
    def pages_per_group(self, request: Any) -> list[int]: ...
    def num_free_blocks(self) -> int: ...
    def num_total_blocks(self) -> int: ...
    def reset_prefix_cache(self) -> bool: ...
    def take_timings(self) -> dict[str, int]: ...
    def decode_step(self, requests: Sequence[Any]) -> bool: ...


class _Handle:
    __slots__ = ("request_id", "token_ids", "max_tokens", "added", "scheduled")

    def __init__(self, request_id: str, token_ids: np.ndarray, max_tokens: int):
        self.request_id = request_id
        self.token_ids = token_ids
        self.max_tokens = max_tokens
        self.added = False
        self.scheduled = False


class HybridkvSide:
    """hybridkv's ``CacheManager`` behind the same adapter API as ``vllm_side.VllmSide``.

    Same model (DeepSeek-V4-Flash, FP8 indexer), budget, context limit, chunk
    and running limits. ``probe_hit`` adds the request (matching and borrowing
    its cached prefix); a refused first ``allocate`` frees it again, so nothing
    changed. ``decode_step`` schedules every running request in one call (the
    manager is built for whole-batch steps); each call's time accumulates per
    method and ``take_timings`` returns and resets it.
    """

    name = "hybridkv"
    package = "hybridkv"  # the package the manager comes from (decode_ab.py sets an older copy)

    def __init__(
        self,
        *,
        kv_memory_bytes: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_prefix_caching: bool = True,
        state_checkpoint_interval: int | None = None,
        page_space: str = "shared",
        prompt_checkpoints: bool = True,
    ) -> None:
        manager = importlib.import_module(f"{self.package}.manager")
        layout = importlib.import_module(f"{self.package}.models.layout")
        plan = importlib.import_module(f"{self.package}.plan")

        self.layout = layout.cache_layout("deepseek-v4-flash", indexer="fp8")
        limits = plan.Limits(max_num_seqs, max_num_batched_tokens, max_model_len)
        self.plan = plan.plan_for_budget(self.layout, kv_memory_bytes, limits)
        self.page_space = page_space
        self.manager = manager.CacheManager.from_plan(
            self.plan,
            page_space=page_space,
            enable_prefix_caching=enable_prefix_caching,
            state_checkpoint_interval=state_checkpoint_interval if enable_prefix_caching else None,
            prompt_checkpoints=prompt_checkpoints,
        )
        self.manager_ns: dict[str, int] = {}

    def _timed(self, name: str, start: int) -> None:
        self.manager_ns[name] = self.manager_ns.get(name, 0) + time.perf_counter_ns() - start

    def describe(self) -> dict[str, Any]:
        groups = [
            dict(
                group=g.group_id,
                spec_class=g.spec.retention,
                layers=len(g.layers),
                block_tokens=g.spec.page_tokens,
                window_tokens=g.spec.sliding_window_tokens,
                page_bytes=g.page_bytes,
            )
            for g in self.layout.groups
        ]
        pages = self.plan.group_pages
        arena = self.manager.arena
        return dict(
            layout="per-group pools" if arena is None else
            f"one arena, {arena.geometry.num_slabs:,} slabs of {arena.geometry.slab_bytes:,} B",
            page_space=self.page_space,
            specs=[],
            groups=groups,
            group_pages=pages if arena is None else None,
            num_blocks=sum(pages.values()) if arena is None else arena.geometry.num_slabs,
            block_stride_bytes=0 if arena is None else arena.geometry.slab_bytes,
            pool_bytes=self.plan.total_bytes if arena is None else arena.geometry.total_bytes,
            scheduler_block_tokens=self.plan.scheduler_page_tokens,
            hash_block_tokens=self.manager.prefix.granularity_tokens if self.manager.prefix else None,
            block_tables=self.block_tables,
            write_slots=self.write_slots,
        )

    def computed_capacity(self, context_tokens: int) -> float:
        if self.manager.arena is not None:
            from hybridkv.arena import shared_concurrency

            return float(shared_concurrency(self.plan, context_tokens, self.manager.arena.geometry))
        return float(self.plan.max_concurrent_requests(context_tokens))

    def new_request(self, request_id: str, token_ids: Sequence[int], max_tokens: int = 1) -> Any:
        return _Handle(request_id, np.asarray(token_ids, dtype=np.int32), int(max_tokens))

    def probe_hit(self, request: Any) -> int:
        start = time.perf_counter_ns()
        # vLLM lets max_tokens run past max_model_len; ours refuses that, so clip.
        room = self.manager.max_context_tokens - request.token_ids.size
        hit = self.manager.add_request(
            request.request_id, request.token_ids, max_new_tokens=max(0, min(request.max_tokens, room))
        )
        self._timed("probe_hit", start)
        request.added = True
        return hit.hit_tokens

    def allocate(self, request: Any, num_new_tokens: int) -> bool:
        if not request.added:
            self.probe_hit(request)
        items = [(request.request_id, int(num_new_tokens))]
        start = time.perf_counter_ns()
        ok = self.manager.check_admission(items)[0].ok
        if ok:
            self.manager.schedule(items, block_tables=self.block_tables, write_slots=self.write_slots)
        elif not request.scheduled:
            self.manager.free(request.request_id)  # undo the probe's borrow
            request.added = False
        self._timed("allocate", start)
        request.scheduled = request.scheduled or ok
        return ok

    # "updates" (every step, prefill and decode, as an engine keeping a BlockTableMirror
    # runs it): the step hands out the changed table cells (vLLM's manager likewise
    # returns new block ids and builds no tables); "full": [R, width] tables per group.
    block_tables = "updates"
    # True: every step also computes each group's write slots (the manager's default);
    # False: the engine derives them from its mirrored tables, as vLLM's model runner
    # derives its slot mapping outside the cache manager.
    write_slots = True

    def decode_step(self, requests: Sequence[Any]) -> bool:
        """One token for every request, in one scheduling call (``schedule_uniform``:
        the ids as a tuple, one count for all)."""
        ids = tuple(r.request_id for r in requests)
        start = time.perf_counter_ns()
        try:
            self.manager.schedule_uniform(ids, 1, block_tables=self.block_tables, write_slots=self.write_slots)
        except ValueError:
            return False
        finally:
            self._timed("allocate", start)
        return True

    def append_tokens(self, request: Any, token_ids: Sequence[int]) -> None:
        self.manager.append_token_ids(request.request_id, np.asarray(token_ids, dtype=np.int32))

    def free(self, request: Any) -> None:
        start = time.perf_counter_ns()
        self.manager.free(request.request_id)
        self._timed("free", start)
        request.added = request.scheduled = False

    def begin_step(self) -> None:
        pass  # nothing per step outside schedule()

    def num_computed_tokens(self, request: Any) -> int:
        return self.manager.num_computed_tokens(request.request_id) if request.added else 0

    def pages_per_group(self, request: Any) -> list[int]:
        return [
            int(self.manager.request_pages(request.request_id, s.group_id)[1].size) for s in self.manager.specs
        ]

    def num_free_blocks(self) -> int:
        return sum(st.free_pages for st in self.manager.stats().values())

    def num_total_blocks(self) -> int:
        return sum(st.total_pages for st in self.manager.stats().values())

    def reset_prefix_cache(self) -> bool:
        self.manager.clear_prefix_cache()
        return True

    def take_timings(self) -> dict[str, int]:
        timings, self.manager_ns = self.manager_ns, {}
        return timings


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Collect first, then keep the collector out of the timed region."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def prefill(
    side: CacheSide, request: Any, prompt_tokens: int, chunk_tokens: int, min_chunk_tokens: int | None = None
) -> bool:
    """Schedule the rest of the prompt in chunks, one step each; False if the pool refuses a chunk.

    With ``min_chunk_tokens``, a refused chunk is retried at half the size down to
    that many tokens (a scheduler that fills the last free memory with a shorter
    chunk rather than give up), the next chunk starting at full size again.
    """
    floor = chunk_tokens if min_chunk_tokens is None else min(min_chunk_tokens, chunk_tokens)
    while (done := side.num_computed_tokens(request)) < prompt_tokens:
        side.begin_step()
        tokens = min(chunk_tokens, prompt_tokens - done)
        while not side.allocate(request, tokens):
            if tokens <= floor:
                return False
            tokens = max(tokens // 2, floor)
    return True


def _manager_ns(timings: dict[str, int], *names: str) -> int:
    return sum(timings.get(name, 0) for name in names)


def _unique_prompts(rng: np.random.Generator, count: int, tokens: int) -> list[np.ndarray]:
    return [rng.integers(0, DEFAULT_VOCAB_SIZE, size=tokens, dtype=np.int32) for _ in range(count)]


# --------------------------------------------------------------------------- measurements


def _decode_setup(side: CacheSide, workload: list, *, steps: int, chunk_tokens: int, seed: int) -> list:
    """Prefill every request, then one decode step each, so each holds its steady-state
    pages (window pages of the last chunk released) before the timed steps."""
    rng = np.random.default_rng(seed + 1)
    running = []
    for item in workload:
        request = side.new_request(item.request_id, item.prompt_token_ids, max_tokens=steps + 2)
        side.probe_hit(request)
        fits = prefill(side, request, item.prompt_tokens, chunk_tokens)
        if fits:
            side.append_tokens(request, [int(item.output_token_ids[0])])
            side.begin_step()
            fits = side.allocate(request, 1)
        if not fits:
            raise RuntimeError(f"{side.name}: decode setup does not fit ({item.request_id})")
        side.append_tokens(request, [int(rng.integers(0, DEFAULT_VOCAB_SIZE))])
        running.append(request)
    side.take_timings()
    return running


def measure_decode(sides: dict[str, CacheSide], *, num_requests: int, steps: int, chunk_tokens: int,
                   seed: int, paired: bool = True, churn: bool = False) -> dict[str, Any]:
    """Manager time per running request per decode step, every side in one run.

    Each side gets the same requests. ``paired``: the timed steps alternate between
    the sides (step k of every side, in an order that rotates each step), so both
    are measured over the same stretch of time and slow drifts of the machine hit
    both; each side's step then also starts with caches the other side's step
    filled, as in an engine whose scheduler runs between other work. Otherwise each
    side runs all its steps in turn (its own code stays warm from step to step).
    ``churn``: at step k request k (mod the count) sits the step out, so no two
    consecutive batches are the same, as in serving, where requests finish and
    join every few steps; figures are then per request of the step's batch.
    Per side: the usual figures. ``paired``, with two sides: the ratio of the first
    side's total step time to the second's, and the median of the per-step ratios.
    """
    workload = chat_workload(num_requests, seed=seed)
    names = list(sides)
    running = {name: _decode_setup(side, workload, steps=steps, chunk_tokens=chunk_tokens, seed=seed)
               for name, side in sides.items()}
    step_ns = {name: np.zeros(steps, dtype=np.int64) for name in names}
    hash_ns = dict.fromkeys(names, 0)  # vLLM's block hashing of appended tokens, outside its step
    outputs = np.random.default_rng(seed + 2).integers(0, DEFAULT_VOCAB_SIZE, size=(steps, num_requests))
    if paired:
        order = [names[(step + i) % len(names)] for step in range(steps) for i in range(len(names))]
    else:
        order = [name for name in names for _ in range(steps)]
    with quiet_gc():
        for index, name in enumerate(order):
            step = index // len(names) if paired else index % steps
            side = sides[name]
            batch = running[name]
            if churn:
                out_index = step % num_requests
                batch = batch[:out_index] + batch[out_index + 1 :]
            side.begin_step()
            if not side.decode_step(batch):
                raise RuntimeError(f"{name}: decode step {step} refused a slot")
            timings = side.take_timings()  # with the hashing of the previous step's tokens
            step_ns[name][step] = _manager_ns(timings, "begin_step", "allocate")
            hash_ns[name] += timings.get("hash", 0)
            for request, token in zip(batch, outputs[step]):
                side.append_tokens(request, [int(token)])
    out: dict[str, Any] = {}
    for name, side in sides.items():
        hash_ns[name] += side.take_timings().get("hash", 0)
        for request in running[name]:
            side.free(request)
        batch_requests = num_requests - 1 if churn else num_requests
        per_request_us = step_ns[name] / batch_requests / 1e3
        out[name] = dict(
            running_requests=num_requests,
            batch_requests=batch_requests,
            churn=churn,
            steps=steps,
            prompt_tokens_total=int(sum(r.prompt_tokens for r in workload)),
            us_per_request_step_mean=float(per_request_us.mean()),
            us_per_request_step_p50=float(np.median(per_request_us)),
            us_per_request_step_p90=float(np.percentile(per_request_us, 90)),
            ms_per_step_mean=float(step_ns[name].mean() / 1e6),
            hash_us_per_request_step=float(hash_ns[name] / steps / batch_requests / 1e3),
        )
    if len(names) == 2:
        a, b = (step_ns[n].astype(np.float64) for n in names)
        out["ratio"] = dict(
            sides=names,
            paired=paired,
            ratio_of_totals=float(a.sum() / b.sum()),
            median_step_ratio=float(np.median(a / b)),
        )
    return out


def measure_prefill(side: CacheSide, *, num_requests: int, prompt_tokens: int, chunk_tokens: int, seed: int) -> dict[str, Any]:
    """Manager time per prefill chunk of ``chunk_tokens`` (unique prompts, no hits)."""
    rng = np.random.default_rng(seed + 2)
    chunk_ns: list[int] = []
    requests = []
    for index, prompt in enumerate(_unique_prompts(rng, num_requests, prompt_tokens)):
        request = side.new_request(f"prefill-{index}", prompt)
        side.probe_hit(request)
        side.take_timings()
        with quiet_gc():
            while (done := side.num_computed_tokens(request)) < prompt_tokens:
                side.begin_step()
                if not side.allocate(request, min(chunk_tokens, prompt_tokens - done)):
                    raise RuntimeError(f"{side.name}: prefill chunk refused")
                chunk_ns.append(_manager_ns(side.take_timings(), "begin_step", "allocate"))
        requests.append(request)
    for request in requests:
        side.free(request)
    chunk_ms = np.asarray(chunk_ns) / 1e6
    return dict(
        chunk_tokens=chunk_tokens,
        chunks=len(chunk_ns),
        prompt_tokens=prompt_tokens,
        ms_per_chunk_mean=float(chunk_ms.mean()),
        ms_per_chunk_p50=float(np.median(chunk_ms)),
        ms_per_chunk_min=float(chunk_ms.min()),
        ms_per_chunk_max=float(chunk_ms.max()),
    )


def measure_multiturn(side: CacheSide, workload: list, *, chunk_tokens: int) -> dict[str, Any]:
    """Token hit rate with requests served one after another in workload order."""
    hits = np.zeros(len(workload), dtype=np.int64)
    side.take_timings()
    for index, item in enumerate(workload):
        request = side.new_request(item.request_id, item.prompt_token_ids, max_tokens=item.output_tokens)
        hits[index] = side.probe_hit(request)
        if not prefill(side, request, item.prompt_tokens, chunk_tokens):
            raise RuntimeError(f"{side.name}: multiturn request {item.request_id} refused")
        side.append_tokens(request, [int(item.output_token_ids[0])])
        for token in item.output_token_ids[1:]:
            side.begin_step()
            if not side.allocate(request, 1):
                raise RuntimeError(f"{side.name}: multiturn decode refused")
            side.append_tokens(request, [int(token)])
        side.free(request)
    timings = side.take_timings()
    prompt_tokens = int(sum(r.prompt_tokens for r in workload))
    return dict(
        requests=len(workload),
        prompt_tokens=prompt_tokens,
        hit_tokens=int(hits.sum()),
        hit_rate=float(hits.sum() / prompt_tokens),
        manager_ms_total=float(_manager_ns(timings, "probe_hit", "allocate", "free") / 1e6),
    )


def measure_capacity(
    side: CacheSide, *, context_tokens: int, chunk_tokens: int, seed: int, limit: int,
    min_chunk_tokens: int | None = None,
) -> dict[str, Any]:
    """Admit unique requests of ``context_tokens`` one by one until the pool refuses one.

    A request is a ``context_tokens - 1`` token prompt, prefilled in chunks,
    then one decode step (its first output token gets its slot), so each holds
    its steady-state pages when the next one is admitted. With
    ``min_chunk_tokens``, chunks after the first shrink to fit (see ``prefill``).
    """
    rng = np.random.default_rng(seed + 3)
    prompt_tokens = context_tokens - 1
    admitted = []
    refused_at = "none (limit reached)"
    for index in range(limit):
        prompt = rng.integers(0, DEFAULT_VOCAB_SIZE, size=prompt_tokens, dtype=np.int32)
        request = side.new_request(f"cap-{index}", prompt, max_tokens=2)
        side.probe_hit(request)
        if not side.allocate(request, min(chunk_tokens, prompt_tokens)):
            refused_at = "admission"
            break
        if prefill(side, request, prompt_tokens, chunk_tokens, min_chunk_tokens):
            side.append_tokens(request, [int(rng.integers(0, DEFAULT_VOCAB_SIZE))])
            side.begin_step()
            if side.allocate(request, 1):
                admitted.append(request)
                continue
            refused_at = "first decode step"
        else:
            refused_at = f"prefill chunk at token {side.num_computed_tokens(request)}"
        side.free(request)
        break
    used_blocks = side.num_total_blocks() - side.num_free_blocks()
    first_request_pages = side.pages_per_group(admitted[0]) if admitted else []
    for request in admitted:
        side.free(request)
    side.take_timings()
    return dict(
        context_tokens=context_tokens,
        chunk_tokens=chunk_tokens,
        min_chunk_tokens=min_chunk_tokens or chunk_tokens,
        measured_requests=len(admitted),
        refused_at=refused_at,
        blocks_used_when_refused=int(used_blocks),
        blocks_per_request=float(used_blocks / max(len(admitted), 1)),
        first_request_pages_per_group=first_request_pages,
        computed_requests=float(side.computed_capacity(context_tokens)),
    )


# --------------------------------------------------------------------------- driver


@dataclass(frozen=True)
class BenchConfig:
    kv_memory_bytes: int
    max_model_len: int
    chunk_tokens: int
    max_num_seqs: int
    decode_requests: int
    decode_steps: int
    prefill_requests: int
    prefill_tokens: int
    conversations: int
    turns: int
    system_prompt_tokens: int
    context_tokens: int
    capacity_limit: int
    seed: int
    skip_capacity: bool
    rounds: int
    state_checkpoint_interval: int | None = None
    capacity_max_running: int | None = None
    page_space: str = "shared"
    prompt_checkpoints: bool = True
    capacity_min_chunk_tokens: int = 256


def _make_sides(config: BenchConfig, vllm_factory: Callable[..., Any] | None) -> dict[str, Any]:
    """Each side, or the reason it is unavailable."""
    kwargs = dict(
        kv_memory_bytes=config.kv_memory_bytes,
        max_model_len=config.max_model_len,
        max_num_batched_tokens=config.chunk_tokens,
        max_num_seqs=config.max_num_seqs,
    )
    sides: dict[str, Any] = {}
    ours = functools.partial(
        HybridkvSide, state_checkpoint_interval=config.state_checkpoint_interval, page_space=config.page_space,
        prompt_checkpoints=config.prompt_checkpoints,
    )
    for name, factory in (("vLLM", vllm_factory), ("hybridkv", ours)):
        if factory is None:
            sides[name] = "vLLM is not installed (see bench/README.md)"
            continue
        try:
            sides[name] = factory(**kwargs)
        except NotImplementedError as exc:
            sides[name] = f"not implemented: {exc}"
    return sides


def byte_ideal_capacity(config: BenchConfig) -> dict[str, Any]:
    """Requests of ``context_tokens`` that fit if every byte held live cache (no padding)."""
    from hybridkv.models.layout import cache_layout

    layout = cache_layout("deepseek-v4-flash", indexer="fp8")
    request_bytes = config.context_tokens * layout.ideal_bytes_per_token + layout.ideal_bytes_per_request
    return dict(
        ideal_bytes_per_token=layout.ideal_bytes_per_token,
        fixed_bytes_per_request=layout.ideal_bytes_per_request,
        requests=config.kv_memory_bytes / request_bytes,
    )


def layout_capacity_bound(config: BenchConfig, held_pages: Sequence[int], chunk_tokens: int) -> dict[str, Any]:
    """The most requests any manager fits with hybridkv's kernel page sizes if no byte
    were lost: each request holds what the first one held after its first decode step,
    and the last one's final prefill chunk (``chunk_tokens``) also needs its sliding
    groups' chunk pages: ``N = floor((budget - chunk_bytes) / request_bytes)``."""
    from hybridkv.models.layout import cache_layout

    layout = cache_layout("deepseek-v4-flash", indexer="fp8")
    request_bytes = sum(pages * g.page_bytes for pages, g in zip(held_pages, layout.groups))
    chunk_bytes = 0
    for pages, g in zip(held_pages, layout.groups):
        spec = g.spec
        if spec.is_sliding:
            span = -(-(spec.sliding_window_tokens - 1 + chunk_tokens) // spec.page_tokens) + 1
            chunk_bytes += max(span - pages, 0) * g.page_bytes
    return dict(
        chunk_tokens=chunk_tokens,
        request_bytes=request_bytes,
        last_chunk_extra_bytes=chunk_bytes,
        requests=(config.kv_memory_bytes - chunk_bytes) // request_bytes,
    )


TIMED_PHASES = {"prefill": "ms_per_chunk_mean"}


def _decode_rounds(config: BenchConfig, live: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """The decode phases: ``config.rounds`` runs of every live side with paired steps
    ("decode"), as many with each side's steps in a row ("decode_unpaired") and as
    many with paired steps whose batch changes every step ("decode_churn"), see
    ``measure_decode``. Of each, the round with the median vLLM/hybridkv ratio of
    totals is reported (one side: its median per-request mean); every round's
    figures are kept."""
    out: dict[str, Any] = {name: {} for name in live}
    if not live:
        return out
    for phase, paired, churn in (("decode", True, False), ("decode_unpaired", False, False),
                                 ("decode_churn", True, True)):
        outcomes = []
        for _ in range(config.rounds):
            for side in live.values():
                if not side.reset_prefix_cache():
                    raise RuntimeError(f"prefix cache could not be reset before {phase}")
            started = time.perf_counter()
            outcomes.append(measure_decode(
                live, num_requests=config.decode_requests, steps=config.decode_steps,
                chunk_tokens=config.chunk_tokens, seed=config.seed, paired=paired, churn=churn))
            log(f"{phase} ({', '.join(live)}) done in {time.perf_counter() - started:.1f} s")
        if all("ratio" in o for o in outcomes):
            key = lambda o: o["ratio"]["ratio_of_totals"]  # noqa: E731
        else:
            first = next(iter(live))
            key = lambda o: o[first]["us_per_request_step_mean"]  # noqa: E731
        chosen = sorted(outcomes, key=key)[len(outcomes) // 2]
        for name in live:
            result = out[name][phase] = dict(chosen[name], rounds_us_per_request_step_mean=[
                o[name]["us_per_request_step_mean"] for o in outcomes])
            if "ratio" in chosen:
                result["ratio"] = dict(chosen["ratio"], rounds_ratio_of_totals=[
                    o["ratio"]["ratio_of_totals"] for o in outcomes], rounds_median_step_ratio=[
                    o["ratio"]["median_step_ratio"] for o in outcomes])
    return out


def run(config: BenchConfig, vllm_factory: Callable[..., Any] | None, log: Callable[[str], None]) -> dict[str, Any]:
    sides = _make_sides(config, vllm_factory)
    live = {name: side for name, side in sides.items() if not isinstance(side, str)}
    results: dict[str, dict[str, Any]] = {name: {} for name in sides}
    for name, side in sides.items():
        if isinstance(side, str):
            results[name]["unavailable"] = side
            log(f"{name}: {side}")
        else:
            results[name]["layout"] = side.describe()

    multiturn = multiturn_workload(
        config.conversations, config.turns, seed=config.seed, system_prompt_tokens=config.system_prompt_tokens
    )
    prompt_total = sum(r.prompt_tokens for r in multiturn)
    bounds = dict(
        ideal_hit_rate=float(ideal_hit_tokens(multiturn).sum() / prompt_total),
        grain_256_hit_rate=float(ideal_hit_tokens(multiturn, grain_tokens=256).sum() / prompt_total),
        prompt_tokens=int(prompt_total),
    )

    for name, decode in _decode_rounds(config, live, log).items():
        results[name].update(decode)
    phases: list[tuple[str, Callable[[Any], dict[str, Any]]]] = [
        ("prefill", lambda s: measure_prefill(
            s, num_requests=config.prefill_requests, prompt_tokens=config.prefill_tokens,
            chunk_tokens=config.chunk_tokens, seed=config.seed)),
        ("multiturn", lambda s: measure_multiturn(s, multiturn, chunk_tokens=config.chunk_tokens)),
    ]
    if not config.skip_capacity:
        # "capacity": chunks shrink to fit (down to capacity_min_chunk_tokens);
        # "capacity_fixed_chunk": every chunk is chunk_tokens. Same procedure on both sides.
        for phase, floor in (("capacity", config.capacity_min_chunk_tokens),
                             ("capacity_fixed_chunk", config.chunk_tokens)):
            phases.append((phase, functools.partial(
                measure_capacity, context_tokens=config.context_tokens, chunk_tokens=config.chunk_tokens,
                seed=config.seed, limit=config.capacity_limit, min_chunk_tokens=floor)))
    for phase, measure in phases:
        primary = TIMED_PHASES.get(phase)
        rounds = config.rounds if primary else 1
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in live}
        for _ in range(rounds):  # interleaved: each round runs the phase on every side in turn
            for name, side in live.items():
                if not side.reset_prefix_cache():
                    raise RuntimeError(f"{name}: prefix cache could not be reset before {phase}")
                started = time.perf_counter()
                runs[name].append(measure(side))
                log(f"{name}: {phase} done in {time.perf_counter() - started:.1f} s")
        for name, outcomes in runs.items():
            if primary:  # report the round with the median primary figure
                outcomes = sorted(outcomes, key=lambda outcome: outcome[primary])
                chosen = dict(outcomes[len(outcomes) // 2])
                chosen[f"rounds_{primary}"] = [outcome[primary] for outcome in outcomes]
                results[name][phase] = chosen
            else:
                results[name][phase] = outcomes[0]
    if not config.skip_capacity and "hybridkv" in live:
        # The capacity phase again with per-group pools: sized for the configured running
        # requests, and for `capacity_max_running` (window and state pages are reserved
        # per running request in that mode; see docs/benchmarks.md).
        extra = [("capacity_per_group", config.max_num_seqs)]
        if config.capacity_max_running:
            extra.append(("capacity_sized", config.capacity_max_running))
        for key, running in extra:
            side = HybridkvSide(
                kv_memory_bytes=config.kv_memory_bytes, max_model_len=config.max_model_len,
                max_num_batched_tokens=config.chunk_tokens, max_num_seqs=running, page_space="per-group",
            )
            outcome = measure_capacity(
                side, context_tokens=config.context_tokens, chunk_tokens=config.chunk_tokens,
                seed=config.seed, limit=config.capacity_limit, min_chunk_tokens=config.capacity_min_chunk_tokens,
            )
            outcome["max_running"] = running
            results["hybridkv"][key] = outcome
            log(f"hybridkv: capacity with per-group pools for {running} running: {outcome['measured_requests']}")
        held = results["hybridkv"].get("capacity", {}).get("first_request_pages_per_group")
        if held:
            results["hybridkv"]["capacity_bound"] = layout_capacity_bound(
                config, held, config.capacity_min_chunk_tokens)
            results["hybridkv"]["capacity_bound_fixed_chunk"] = layout_capacity_bound(
                config, held, config.chunk_tokens)
    return dict(
        config=config.__dict__,
        multiturn_bounds=bounds,
        byte_ideal_capacity=byte_ideal_capacity(config),
        results=results,
        environment=dict(
            python=platform.python_version(),
            machine=platform.machine(),
            cpus=os.cpu_count(),
            vllm=getattr(sides.get("vLLM"), "describe", lambda: {})().get("vllm_version"),
        ),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def _get(results: dict[str, Any], side: str, phase: str, key: str) -> float | None:
    value = results["results"].get(side, {}).get(phase, {}).get(key)
    return None if value is None else float(value)


def ratio_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each metric with both values, the ratio in the "ours is better when > 1" sense, the target."""
    bounds = report["multiturn_bounds"]
    ideal = report["byte_ideal_capacity"]["requests"]
    rows = []

    def add(metric: str, phase: str, key: str, unit: str, lower_is_better: bool, target: str) -> None:
        theirs, ours = _get(report, "vLLM", phase, key), _get(report, "hybridkv", phase, key)
        ratio = None
        if theirs is not None and ours is not None and ours > 0 and theirs > 0:
            ratio = theirs / ours if lower_is_better else ours / theirs
        rows.append(dict(metric=metric, unit=unit, vllm=theirs, hybridkv=ours, ratio=ratio, target=target))

    add("manager time per running request per decode step (steps of both sides alternate)", "decode",
        "us_per_request_step_mean", "µs", True, ">= 20x")
    paired = report["results"].get("hybridkv", {}).get("decode", {}).get("ratio")
    if paired:
        rows.append(dict(metric="same, p50 step; ratio: median of the per-step ratios", unit="µs",
                         vllm=_get(report, "vLLM", "decode", "us_per_request_step_p50"),
                         hybridkv=_get(report, "hybridkv", "decode", "us_per_request_step_p50"),
                         ratio=paired["median_step_ratio"], target="-"))
    add("manager time per running request per decode step (each side's steps in a row)", "decode_unpaired",
        "us_per_request_step_mean", "µs", True, "-")
    add("same, steps alternate, the batch changes every step (one request sits out, rotating)", "decode_churn",
        "us_per_request_step_mean", "µs", True, "-")
    add("manager time per prefill chunk", "prefill", "ms_per_chunk_mean", "ms", True, "-")
    add("token hit rate, multiturn", "multiturn", "hit_rate", "", False,
        f">= 1x and >= {bounds['grain_256_hit_rate']:.1%} (256 grain); ideal {bounds['ideal_hit_rate']:.1%}")
    cap = report["config"]
    add("requests that fit (computed from layout)", "capacity", "computed_requests", "", False, "-")
    add(f"requests that fit (measured; chunks shrink to fit, >= {cap.get('capacity_min_chunk_tokens', 256):,} tokens)",
        "capacity", "measured_requests", "", False,
        f">= 1x and >= {0.97 * ideal:.1f} (97% of byte-ideal {ideal:.1f})")
    add(f"requests that fit (measured; fixed {cap['chunk_tokens']:,}-token chunks)",
        "capacity_fixed_chunk", "measured_requests", "", False, "-")
    ours_all = report["results"].get("hybridkv", {})
    theirs = _get(report, "vLLM", "capacity", "measured_requests")
    for key in ("capacity_per_group", "capacity_sized"):
        extra = ours_all.get(key)
        if extra:
            ours = float(extra["measured_requests"])
            rows.append(dict(
                metric=f"requests that fit (measured), hybridkv per-group pools for {extra['max_running']} running",
                unit="", vllm=theirs, hybridkv=ours, ratio=ours / theirs if theirs else None,
                target=f">= 1x and >= {0.97 * ideal:.1f}",
            ))
    for key in ("capacity_bound", "capacity_bound_fixed_chunk"):
        bound = ours_all.get(key)
        if bound:
            rows.append(dict(
                metric=f"requests that fit if no byte were lost (these page sizes, last chunk "
                       f"{bound.get('chunk_tokens', cap['chunk_tokens']):,} tokens)",
                unit="", vllm=None, hybridkv=float(bound["requests"]), ratio=None, target="-",
            ))
    return rows


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "" and value <= 1.0:
        return f"{value:.1%}"
    if unit == "":
        return f"{value:,.1f}"
    return f"{value:,.2f} {unit}" if value < 100 else f"{value:,.0f} {unit}"


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    for name, result in report["results"].items():
        layout = result.get("layout")
        if not layout:
            continue
        specs = Table(title=f"{name}: per-layer cache specs")
        for column in ("spec", "layers", "block tokens", "window", "tokens/state", "page bytes", "dtype"):
            specs.add_column(column, justify="left" if column in ("spec", "dtype") else "right")
        for row in layout.get("specs", []):
            specs.add_row(row["spec_class"], str(row["layers"]), str(row["block_tokens"]),
                          str(row["window_tokens"] or "-"), str(row["tokens_per_state"]),
                          f"{row['page_bytes_real']:,} -> {row['page_bytes_padded']:,}", row["dtype"])
        console.print(specs)
        table = Table(title=f"{name} layout: {layout.get('num_blocks', '?'):,} blocks of "
                      f"{layout.get('block_stride_bytes', 0):,} B, layout {layout.get('layout')}, "
                      f"hit grain {layout.get('scheduler_block_tokens')} / hash {layout.get('hash_block_tokens')} tokens")
        held = result.get("capacity", {}).get("first_request_pages_per_group") or []
        for column in ("group", "spec", "layers", "block tokens", "window", "page bytes",
                       "blocks held by one context request"):
            table.add_column(column, justify="right" if column != "spec" else "left")
        for index, group in enumerate(layout.get("groups", [])):
            table.add_row(str(group["group"]), group["spec_class"], str(group["layers"]),
                          str(group["block_tokens"]), str(group["window_tokens"] or "-"),
                          f"{group['page_bytes']:,}", str(held[index]) if index < len(held) else "-")
        console.print(table)

    table = Table(title="DeepSeek-V4-Flash, FP8 indexer, "
                  f"{report['config']['kv_memory_bytes'] / GIB:g} GiB: vLLM vs hybridkv")
    for column in ("metric", "vLLM", "hybridkv", "ratio (ours better > 1)", "target"):
        table.add_column(column, justify="left" if column in ("metric", "target") else "right")
    for row in ratio_rows(report):
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        table.add_row(row["metric"], _fmt(row["vllm"], row["unit"]), _fmt(row["hybridkv"], row["unit"]),
                      ratio, row["target"])
    console.print(table)
    console.print(f"byte-ideal requests at {report['config']['context_tokens']:,} tokens: "
                  f"{report['byte_ideal_capacity']['requests']:.2f}; multiturn prompt tokens "
                  f"{report['multiturn_bounds']['prompt_tokens']:,}")


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-memory-gib", type=float, default=40.0)
    parser.add_argument("--max-model-len", type=int, default=131_072)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk = token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--decode-requests", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--prefill-requests", type=int, default=4)
    parser.add_argument("--prefill-tokens", type=int, default=32_768)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompt", type=int, default=2_000)
    parser.add_argument("--context", type=int, default=131_072)
    parser.add_argument("--capacity-limit", type=int, default=1_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the timed phases (decode, prefill); the median round is reported "
                             "(5: one disturbed round cannot decide it)")
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--capacity-min-chunk", type=int, default=256,
                        help="capacity phase: a refused chunk is retried at half size down to this "
                             "many tokens (the fixed-chunk phase runs too)")
    parser.add_argument("--capacity-max-running", type=int, default=96,
                        help="also measure hybridkv's capacity with pools sized for this many "
                             "running requests (0: skip)")
    parser.add_argument("--page-space", choices=("shared", "per-group"), default="shared",
                        help="hybridkv's page space for every phase (default shared)")
    parser.add_argument("--prompt-checkpoints", action=argparse.BooleanOptionalAction, default=True,
                        help="hybridkv only: keep low-priority checkpoints at every prompt boundary "
                             "(the manager's default; --no-prompt-checkpoints turns them off)")
    parser.add_argument("--state-checkpoint-interval", type=int, default=None,
                        help="hybridkv only: also keep state checkpoints every N tokens")
    parser.add_argument("--block-tables", "--decode-block-tables", dest="block_tables",
                        choices=("updates", "full"), default="updates",
                        help="hybridkv only: block table mode of every step (see docs/manager.md)")
    parser.add_argument("--write-slots", action=argparse.BooleanOptionalAction, default=True,
                        help="hybridkv only: compute write slots in every step (default); "
                             "--no-write-slots leaves them to the engine, as vLLM's manager does")
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke test")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    HybridkvSide.block_tables = args.block_tables
    HybridkvSide.write_slots = args.write_slots
    if args.quick:
        args.decode_requests, args.decode_steps = 32, 8
        args.prefill_requests, args.prefill_tokens = 1, 8_192
        args.conversations, args.turns, args.rounds = 4, 2, 1
        args.context, args.capacity_limit = 32_768, 8
    config = BenchConfig(
        kv_memory_bytes=int(args.kv_memory_gib * GIB),
        max_model_len=max(args.max_model_len, args.context),
        chunk_tokens=args.chunk,
        max_num_seqs=args.max_num_seqs,
        decode_requests=args.decode_requests,
        decode_steps=args.decode_steps,
        prefill_requests=args.prefill_requests,
        prefill_tokens=args.prefill_tokens,
        conversations=args.conversations,
        turns=args.turns,
        system_prompt_tokens=args.system_prompt,
        context_tokens=args.context,
        capacity_limit=args.capacity_limit,
        seed=args.seed,
        skip_capacity=args.skip_capacity,
        rounds=max(1, args.rounds),
        state_checkpoint_interval=args.state_checkpoint_interval,
        capacity_max_running=args.capacity_max_running or None,
        capacity_min_chunk_tokens=args.capacity_min_chunk,
        page_space=args.page_space,
        prompt_checkpoints=args.prompt_checkpoints,
    )
    return config, args.json


def load_vllm_factory() -> Callable[..., Any] | None:
    try:
        from vllm_side import VllmSide
    except ImportError as exc:
        print(f"vLLM side unavailable: {exc}", file=sys.stderr)
        return None
    return VllmSide


def main(argv: list[str] | None = None) -> int:
    config, json_path = parse_args(argv)
    vllm_factory = load_vllm_factory()
    if vllm_factory is None:
        print("Build the vLLM environment as bench/README.md describes, then run "
              ".venv-vllm/bin/python bench/vs_vllm.py", file=sys.stderr)
    report = run(config, vllm_factory, log=lambda line: print(line, file=sys.stderr))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print_report(report)
    print(f"JSON: {json_path}")
    ran = any("decode" in result for result in report["results"].values())
    return 0 if ran else 2


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH_DIR))
    raise SystemExit(main())
