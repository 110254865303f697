"""The two sides: one adapter API over vLLM's ``KVCacheManager`` and hybridkv's ``CacheManager``.

``VllmSide`` (``vllm_side.py``, the only module that imports vLLM) and
:class:`HybridkvSide` offer the same methods (:class:`CacheSide`). A request
handle is the side's own object; the phases never look inside it. Every
manager call's wall time accumulates per method; ``take_timings`` returns
and resets it.

hybridkv is driven through its public API only: ``CacheManager.from_plan``,
``add_request``, ``schedule``, ``schedule_uniform``, ``append_token_ids``,
``append_token_ids_many``, ``free``, ``stats``, ``request_pages``,
``clear_prefix_cache`` and ``CacheManagerError``; ``plan_for_budget``,
``Limits`` and ``cache_layout`` for the plan; the arena module's
``shared_arena_for`` / ``shared_concurrency`` for the capacity figures.
"""

from __future__ import annotations

import importlib
import sys
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np

GIB = 2**30
# The manager time of a step: what each side's scheduler calls in it.
STEP_METHODS = ("begin_step", "probe_hit", "allocate", "free")


class CacheSide(Protocol):
    """What both adapters offer (see ``vllm_side.VllmSide`` for the semantics)."""

    name: str

    def describe(self) -> dict[str, Any]: ...
    def computed_capacity(self, context_tokens: int) -> float: ...
    def new_request(self, request_id: str, token_ids: Sequence[int], max_tokens: int = 1) -> Any: ...
    def probe_hit(self, request: Any) -> int: ...
    def allocate(self, request: Any, num_new_tokens: int) -> bool: ...
    def schedule_step(self, items: Sequence[tuple[Any, int]]) -> bool: ...
    def decode_step(self, requests: Sequence[Any]) -> bool: ...
    def append_tokens(self, request: Any, token_ids: Sequence[int]) -> None: ...
    def append_many(self, requests: Sequence[Any], token_ids: Sequence[int]) -> None: ...
    def free(self, request: Any) -> None: ...
    def begin_step(self) -> None: ...
    def num_computed_tokens(self, request: Any) -> int: ...
    def pages_per_group(self, request: Any) -> list[int]: ...
    def num_free_blocks(self) -> int: ...
    def num_total_blocks(self) -> int: ...
    def reset_prefix_cache(self) -> bool: ...
    def take_timings(self) -> dict[str, int]: ...


def step_ns(timings: dict[str, int]) -> int:
    """Manager time of one step from ``take_timings`` (hashing and token appends left out)."""
    return sum(timings.get(name, 0) for name in STEP_METHODS)


class _Handle:
    __slots__ = ("request_id", "token_ids", "max_tokens", "prepared", "added", "scheduled", "computed_tokens")

    def __init__(self, request_id: str, token_ids: np.ndarray, max_tokens: int):
        self.request_id = request_id
        self.token_ids = token_ids
        self.max_tokens = max_tokens
        self.prepared = None  # the manager's ``PreparedPrompt``, until ``add_request`` takes it
        self.added = False
        self.scheduled = False
        self.computed_tokens = 0


def _arena_module(package: str) -> Any:
    """The module with ``shared_arena_for`` / ``shared_concurrency`` (it may move in a re-layout)."""
    for name in (f"{package}.arena", f"{package}.memory.arena", f"{package}.memory"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "shared_concurrency"):
            return module
    return None


class HybridkvSide:
    """hybridkv's ``CacheManager`` behind the adapter API of ``vllm_side.VllmSide``.

    Same model (DeepSeek-V4-Flash, FP8 indexer), byte budget, context limit,
    step token budget and running limit. ``probe_hit`` adds the request
    (matching and borrowing its cached prefix); a refused first ``allocate``
    frees it again, so nothing changed. ``schedule_step`` and ``decode_step``
    schedule the whole batch in one call (the manager is built for whole-batch
    steps); ``append_many`` is one ``append_token_ids_many`` call.
    """

    name = "hybridkv"
    package = "hybridkv"  # the package the manager comes from (decode_ab.py sets an older copy)
    # "updates" (every step, as an engine keeping a BlockTableMirror runs it): the step
    # hands out the changed table cells (vLLM's manager likewise returns new block ids
    # and builds no tables); "full": [R, width] tables per group.
    block_tables = "updates"
    # True: every step also computes each group's write slots (the manager's default);
    # False: the engine derives them, as vLLM's model runner derives its slot mapping.
    write_slots = True
    # "uniform": a decode step is one ``schedule_uniform(ids, 1)``; "pairs": ``schedule([(id, 1), ...])``, as a
    # caller that builds its batch as pairs calls it (the list built before the timer).
    decode_call = "uniform"

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
        prompt_checkpoints: bool | None = None,
        checkpoint_policy: str | None = None,
        checkpoint_interval_tokens: int | None = None,
    ) -> None:
        manager = importlib.import_module(f"{self.package}.manager")
        layout = importlib.import_module(f"{self.package}.models.layout")
        plan = importlib.import_module(f"{self.package}.plan")
        self._error = manager.CacheManagerError
        self.layout = layout.cache_layout("deepseek-v4-flash", indexer="fp8")
        limits = plan.Limits(max_num_seqs, max_num_batched_tokens, max_model_len)
        self.plan = plan.plan_for_budget(self.layout, kv_memory_bytes, limits, page_space=page_space)
        self.page_space = page_space
        self.enable_prefix_caching = enable_prefix_caching
        self.manager = manager.CacheManager.from_plan(
            self.plan,
            page_space=page_space,
            enable_prefix_caching=enable_prefix_caching,
            state_checkpoint_interval=state_checkpoint_interval if enable_prefix_caching else None,
            prompt_checkpoints=prompt_checkpoints,
            **({} if checkpoint_policy is None else dict(checkpoint_policy=checkpoint_policy,
                                                          checkpoint_interval_tokens=checkpoint_interval_tokens)),
        )
        self.group_ids = [spec.group_id for spec in self.plan.specs]
        self.manager_ns: dict[str, int] = {}

    def _timed(self, name: str, start: int) -> None:
        self.manager_ns[name] = self.manager_ns.get(name, 0) + time.perf_counter_ns() - start

    # ------------------------------------------------------------------ layout facts

    def _arena_geometry(self) -> Any:
        arena = _arena_module(self.package) if self.page_space == "shared" else None
        return None if arena is None else arena.shared_arena_for(self.plan)

    def describe(self) -> dict[str, Any]:
        groups = [
            dict(group=g.group_id, spec_class=g.spec.retention, layers=len(g.layers),
                 block_tokens=g.spec.page_tokens, window_tokens=g.spec.sliding_window_tokens,
                 page_bytes=g.page_bytes)
            for g in self.layout.groups
        ]
        pages = self.plan.group_pages
        geometry = self._arena_geometry()
        return dict(
            layout="per-group pools" if geometry is None else
            f"one arena, {geometry.num_slabs:,} slabs of {geometry.slab_bytes:,} B",
            page_space=self.page_space,
            specs=[],
            groups=groups,
            group_pages=pages if geometry is None else None,
            num_blocks=sum(pages.values()) if geometry is None else geometry.num_slabs,
            block_stride_bytes=0 if geometry is None else geometry.slab_bytes,
            pool_bytes=self.plan.total_bytes if geometry is None else geometry.total_bytes,
            scheduler_block_tokens=self.plan.scheduler_page_tokens,
            block_tables=self.block_tables,
            write_slots=self.write_slots,
        )

    def computed_capacity(self, context_tokens: int) -> float:
        geometry = self._arena_geometry()
        if geometry is not None:
            arena = _arena_module(self.package)
            return float(arena.shared_concurrency(self.plan, context_tokens, geometry))
        return float(self.plan.max_concurrent_requests(context_tokens))

    # ------------------------------------------------------------------ requests

    def new_request(self, request_id: str, token_ids: Sequence[int], max_tokens: int = 1) -> Any:
        """A request as it arrives: its prompt checked, copied and hashed now (``prepare_prompt``, timed as
        ``hash`` and left out of the step's time, as vLLM's side times making its ``Request``)."""
        handle = _Handle(request_id, np.asarray(token_ids, dtype=np.int32), int(max_tokens))
        self._prepare(handle)
        return handle

    def _prepare(self, request: Any) -> None:
        if not hasattr(self.manager, "prepare_prompt"):  # an older version (``--against``) adds from the ids
            return
        start = time.perf_counter_ns()
        request.prepared = self.manager.prepare_prompt(request.token_ids, max_new_tokens=self._max_new(request))
        self._timed("hash", start)

    def _max_new(self, request: Any) -> int:
        # vLLM lets max_tokens run past max_model_len; ours refuses that, so clip.
        return max(0, min(request.max_tokens, self.plan.limits.max_context_tokens - request.token_ids.size))

    def probe_hit(self, request: Any) -> int:
        if request.prepared is None:
            self._prepare(request)  # a probe again after a refusal freed the request
        start = time.perf_counter_ns()
        if request.prepared is None:
            hit = self.manager.add_request(request.request_id, request.token_ids, max_new_tokens=self._max_new(request))
        else:
            hit = self.manager.add_request(request.request_id, request.prepared)
            request.prepared = None
        self._timed("probe_hit", start)
        request.added = True
        request.computed_tokens = hit.hit_tokens
        return hit.hit_tokens

    def allocate(self, request: Any, num_new_tokens: int) -> bool:
        """One request's step; a refusal changes nothing (and undoes a first probe)."""
        if not request.added:
            self.probe_hit(request)
        items = [(request.request_id, int(num_new_tokens))]
        start = time.perf_counter_ns()
        try:  # all or nothing: a step that does not fit raises and changes nothing
            self.manager.schedule(items, block_tables=self.block_tables, write_slots=self.write_slots)
            ok = True
        except self._error:
            ok = False
            if not request.scheduled:
                self.manager.free(request.request_id)  # undo the probe's borrow
                request.added = False
        self._timed("allocate", start)
        if ok:
            request.scheduled = True
            request.computed_tokens += int(num_new_tokens)
        return ok

    def schedule_step(self, items: Sequence[tuple[Any, int]]) -> bool:
        """A mixed step (decodes and prefill chunks) in one ``schedule`` call; False
        (nothing changed) if it does not fit."""
        pairs = [(request.request_id, int(n)) for request, n in items]
        start = time.perf_counter_ns()
        try:
            self.manager.schedule(pairs, block_tables=self.block_tables, write_slots=self.write_slots)
        except self._error:
            return False
        finally:
            self._timed("allocate", start)
        for request, n in items:
            request.scheduled = True
            request.computed_tokens += int(n)
        return True

    def decode_step(self, requests: Sequence[Any]) -> bool:
        """One token for every request, in one ``schedule_uniform`` call (``decode_call="pairs"``: ``schedule``)."""
        ids = tuple(r.request_id for r in requests)
        pairs = [(rid, 1) for rid in ids] if self.decode_call == "pairs" else None
        start = time.perf_counter_ns()
        try:
            if pairs is not None:
                self.manager.schedule(pairs, block_tables=self.block_tables, write_slots=self.write_slots)
            else:
                self.manager.schedule_uniform(ids, 1, block_tables=self.block_tables, write_slots=self.write_slots)
        except self._error:
            return False
        finally:
            self._timed("allocate", start)
        for request in requests:
            request.computed_tokens += 1
        return True

    def append_tokens(self, request: Any, token_ids: Sequence[int]) -> None:
        start = time.perf_counter_ns()
        self.manager.append_token_ids(request.request_id, np.asarray(token_ids, dtype=np.int32))
        self._timed("append", start)

    def append_many(self, requests: Sequence[Any], token_ids: Sequence[int]) -> None:
        if not requests:
            return  # (append_token_ids_many of no requests raises IndexError at 7e40ae6)
        ids = tuple(r.request_id for r in requests)
        tokens = np.asarray(token_ids, dtype=np.int32).reshape(len(ids), 1)
        start = time.perf_counter_ns()
        self.manager.append_token_ids_many(ids, tokens)
        self._timed("append", start)

    def free(self, request: Any) -> None:
        start = time.perf_counter_ns()
        self.manager.free(request.request_id)
        self._timed("free", start)
        request.added = request.scheduled = False
        request.computed_tokens = 0

    def begin_step(self) -> None:
        pass  # nothing per step outside schedule()

    def num_computed_tokens(self, request: Any) -> int:
        return request.computed_tokens if request.added else 0

    def pages_per_group(self, request: Any) -> list[int]:
        return [int(self.manager.request_pages(request.request_id, gid)[1].size) for gid in self.group_ids]

    def num_free_blocks(self) -> int:
        return sum(st.free_pages for st in self.manager.stats().values())

    def num_total_blocks(self) -> int:
        return sum(st.total_pages for st in self.manager.stats().values())

    def reset_prefix_cache(self) -> bool:
        if self.enable_prefix_caching:
            self.manager.clear_prefix_cache()
        return True

    def take_timings(self) -> dict[str, int]:
        timings, self.manager_ns = self.manager_ns, {}
        return timings


def load_vllm_side() -> Callable[..., Any] | str:
    """``VllmSide``, or why it cannot be had here."""
    try:
        from .vllm_side import VllmSide
    except ImportError as exc:
        return f"vLLM is not importable under {sys.executable} ({exc}); see bench/README.md"
    return VllmSide


def advance(side: CacheSide, request: Any, target_tokens: int, chunk_tokens: int,
            min_chunk_tokens: int | None = None) -> bool:
    """Schedule ``request`` in chunks, one step each, until it has computed
    ``target_tokens``; False if the pool refuses a chunk.

    With ``min_chunk_tokens``, a refused chunk is retried at half the size down to
    that many tokens (a scheduler that fills the last free memory with a shorter
    chunk rather than give up), the next chunk starting at full size again.
    """
    floor = chunk_tokens if min_chunk_tokens is None else min(min_chunk_tokens, chunk_tokens)
    while (done := side.num_computed_tokens(request)) < target_tokens:
        side.begin_step()
        tokens = min(chunk_tokens, target_tokens - done)
        while not side.allocate(request, tokens):
            if tokens <= floor:
                return False
            tokens = max(tokens // 2, floor)
    return True


def advance_settled(side: CacheSide, request: Any, target_tokens: int, chunk_tokens: int) -> bool:
    """``advance`` to ``target_tokens``, the last token in a step of its own, so the
    request holds its steady-state pages afterwards (vLLM releases the pages that
    slid out of a window only at the request's next step)."""
    if not advance(side, request, target_tokens - 1, chunk_tokens):
        return False
    side.begin_step()
    return side.allocate(request, 1)
