"""An offline bound on prefix-cache hits at a KV byte budget (Belady-style).

A hybrid model's cached prefix is usable at a boundary ``D`` (a multiple of
the grain ``G``, 256 tokens for DeepSeek-V4) only when the cache holds

* every **history block** below ``D``: ``G`` tokens of every history group
  (for V4 one 256-token page of each compressed group), and
* a **checkpoint** at ``D``: what a request resumed at ``D`` reads from every
  state group (for V4 the 128 trailing window-KV rows and the ratio-4
  compressor and indexer states; docs/prefix-caching.md).

:func:`offline_hit_bound` replays a request sequence with knowledge of the
future. The cache holds these *units* at their real byte sizes
(:class:`UnitBytes`); a request's **target** is the deepest boundary any
earlier request computed (the 256-grain ideal of ``ideal_hit_tokens``), and a
unit's **next use** is the next request whose target needs it. When the
budget is exceeded, the unit whose next use is farthest is evicted (no
future use first; ties: the deeper unit first, a checkpoint before the
history block at the same boundary, so a chain loses its tail first).

Concurrency model (an approximation, stated as such): requests are served
**one at a time in list order**, as ``bench/vs_vllm``'s multi-turn phase and
``bench/hit_sweep.py`` drive every manager. While a request runs, its own
memory is charged against the budget too: its history blocks not already
cached, its partial last block, and its state groups' rows at the peak of a
prefill step, window plus chunk (:attr:`UnitBytes.live_state_bytes`); the
cached units it reads are pinned.
When it finishes, its full blocks become cached units and a checkpoint is
kept at each of its boundaries that a later request's prompt passes (one
whose target is there has a next use; the others are fallbacks, kept only
while room remains).

This is a Belady-style offline policy, not a proven optimum: with units of
different sizes that depend on each other, the best eviction order is a hard
packing problem, and farthest-next-use can lose to a cleverer choice (a small
example is pinned in ``tests/test_offline_bound.py``). It never exceeds the
256-grain ideal, reaches it when the budget holds everything, and in the
tests sits at or above the hit rates hybridkv and vLLM measure on the same
sequence.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridkv.sim.requests import Request

NO_FUTURE_USE = 1 << 62
HISTORY, CHECKPOINT = 0, 1


@dataclass(frozen=True)
class UnitBytes:
    """Byte sizes of the bound's units."""

    grain_tokens: int
    history_block_bytes: int  # G tokens of every history group
    checkpoint_bytes: int  # one checkpoint in every state group
    live_state_bytes: int  # a running request's state-group pages at its peak (a prefill step)

    def __post_init__(self) -> None:
        for name in ("grain_tokens", "history_block_bytes", "checkpoint_bytes", "live_state_bytes"):
            value = getattr(self, name)
            minimum = 1 if name == "grain_tokens" else 0
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")

    @classmethod
    def from_layout(cls, layout: Any, *, chunk_tokens: int = 2048,
                    checkpoint_window_tokens: dict[str, int] | None = None) -> UnitBytes:
        """Sizes from a model layout's groups (``cache_layout(...)``).

        The grain is the LCM of the history groups' page tokens. A checkpoint
        holds ``ceil(C / page_tokens)`` pages of each state group (``C`` from
        ``v4_checkpoint_window_tokens`` unless given). A running request
        holds ``ceil((W + chunk_tokens) / page_tokens)`` pages of it while a
        ``chunk_tokens`` prefill step runs (the window plus every row the
        step writes: what ``CacheManager.stats()`` shows in use during such
        a step), its peak; for V4-Flash and 2,048-token steps that is about
        675 MB, far more than the window alone.
        """
        from hybridkv.models.deepseek_v4 import v4_checkpoint_window_tokens

        groups = list(layout.groups)
        windows = checkpoint_window_tokens or v4_checkpoint_window_tokens([g.spec for g in groups])
        history = [g for g in groups if not g.spec.is_sliding]
        state = [g for g in groups if g.spec.is_sliding]
        if not history:
            raise ValueError("the layout has no history group: nothing to bound")
        grain = math.lcm(*(g.spec.page_tokens for g in history))
        return cls(
            grain_tokens=grain,
            history_block_bytes=sum(g.page_bytes * (grain // g.spec.page_tokens) for g in history),
            checkpoint_bytes=sum(
                g.page_bytes * -(-windows.get(g.group_id, g.spec.sliding_window_tokens) // g.spec.page_tokens)
                for g in state
            ),
            live_state_bytes=sum(
                g.page_bytes * -(-(g.spec.sliding_window_tokens + chunk_tokens) // g.spec.page_tokens)
                for g in state
            ),
        )


@dataclass(frozen=True)
class BoundResult:
    hit_tokens: np.ndarray  # per request
    target_tokens: np.ndarray  # per request: the 256-grain ideal
    prompt_tokens: int
    budget_bytes: int
    peak_cached_bytes: int

    @property
    def hit_rate(self) -> float:
        return float(self.hit_tokens.sum() / self.prompt_tokens) if self.prompt_tokens else 0.0

    @property
    def ideal_hit_rate(self) -> float:
        return float(self.target_tokens.sum() / self.prompt_tokens) if self.prompt_tokens else 0.0


def block_keys(token_ids: np.ndarray, grain_tokens: int) -> list[bytes]:
    """Chained keys of the full ``grain_tokens`` blocks of ``token_ids``: key ``k`` names the prefix
    ``[0, (k + 1) * grain)``."""
    keys, previous = [], b""
    data = np.ascontiguousarray(token_ids, dtype=np.int32)
    for k in range(data.size // grain_tokens):
        previous = hashlib.blake2b(previous + data[k * grain_tokens : (k + 1) * grain_tokens].tobytes(),
                                   digest_size=16).digest()
        keys.append(previous)
    return keys


@dataclass
class _Plan:
    """Per request: committed keys, hit limit and target (in blocks), partial last block."""

    keys: list[list[bytes]]
    limit_blocks: list[int]
    target_blocks: list[int]
    partial: list[bool]
    uses: dict[tuple[int, bytes], deque]  # unit -> requests whose target needs it, ascending
    last_pass: dict[bytes, int]  # key -> last request whose prompt passes it within its hit limit


def _plan(requests: Sequence[Request], grain: int) -> _Plan:
    keys, limits, targets, partial = [], [], [], []
    uses: dict[tuple[int, bytes], deque] = {}
    last_pass: dict[bytes, int] = {}
    seen: set[bytes] = set()
    for i, request in enumerate(requests):
        committed = np.concatenate([request.prompt_token_ids, request.output_token_ids[:-1]])
        own = block_keys(committed, grain)
        limit = max(request.prompt_tokens - 1, 0) // grain
        target = 0
        while target < limit and own[target] in seen:
            target += 1
        for k in range(target):
            uses.setdefault((HISTORY, own[k]), deque()).append(i)
        if target:
            uses.setdefault((CHECKPOINT, own[target - 1]), deque()).append(i)
        for k in range(limit):
            last_pass[own[k]] = i
        seen.update(own)
        keys.append(own)
        limits.append(limit)
        targets.append(target)
        partial.append(committed.size % grain > 0)
    return _Plan(keys, limits, targets, partial, uses, last_pass)


class _Cache:
    """Units by farthest next use (lazy max-heap)."""

    def __init__(self, plan: _Plan, sizes: UnitBytes):
        self.plan, self.sizes = plan, sizes
        self.units: dict[tuple[int, bytes], tuple[int, int]] = {}  # unit -> (bytes, depth)
        self.rank: dict[tuple[int, bytes], tuple] = {}
        self.heap: list = []
        self.total_bytes = 0

    def next_use(self, unit) -> int:
        queue = self.plan.uses.get(unit)
        return queue[0] if queue else NO_FUTURE_USE

    def push(self, unit, depth: int) -> None:
        if unit not in self.units:
            size = self.sizes.checkpoint_bytes if unit[0] == CHECKPOINT else self.sizes.history_block_bytes
            self.units[unit] = (size, depth)
            self.total_bytes += size
        self.reprioritise(unit)

    def reprioritise(self, unit) -> None:
        depth = self.units[unit][1]
        rank = (-self.next_use(unit), -depth, -unit[0])
        self.rank[unit] = rank
        heapq.heappush(self.heap, (rank, unit))

    def evict_until(self, limit_bytes: int, pinned: set) -> bool:
        """Evict farthest-used unpinned units until ``total_bytes <= limit_bytes``."""
        held = []
        while self.total_bytes > limit_bytes and self.heap:
            rank, unit = heapq.heappop(self.heap)
            if self.rank.get(unit) != rank:
                continue  # stale entry
            if unit in pinned:
                held.append((rank, unit))
                continue
            del self.rank[unit]
            self.total_bytes -= self.units.pop(unit)[0]
        for item in held:
            heapq.heappush(self.heap, item)
        return self.total_bytes <= limit_bytes


def _hit_blocks(keys: Sequence, limit_blocks: int, cache: _Cache) -> int:
    """Blocks of the longest cached prefix (every history block below it cached, and a
    checkpoint at its end), at most ``limit_blocks``."""
    reach = hit = 0
    while reach < limit_blocks and (HISTORY, keys[reach]) in cache.units:
        reach += 1
        if (CHECKPOINT, keys[reach - 1]) in cache.units:
            hit = reach
    return hit


def _spend_uses(i: int, plan: _Plan, cache: _Cache) -> None:
    """Request ``i``'s uses of its units are spent: each cached one is ranked by its next use."""
    keys = plan.keys[i]
    for k in range(plan.target_blocks[i]):
        for unit in ((HISTORY, keys[k]), (CHECKPOINT, keys[k])):
            queue = plan.uses.get(unit)
            if queue and queue[0] == i:
                queue.popleft()
                if unit in cache.units:
                    cache.reprioritise(unit)


def _serve(i: int, request: Request, plan: _Plan, cache: _Cache, budget_bytes: int) -> int:
    """Hit, run and keep request ``i``; returns its hit tokens."""
    sizes, keys = cache.sizes, plan.keys[i]
    hit = _hit_blocks(keys, plan.limit_blocks[i], cache)
    _spend_uses(i, plan, cache)
    own = [(HISTORY, key) for key in keys]
    pinned = {unit for unit in own if unit in cache.units}
    if hit:
        pinned.add((CHECKPOINT, keys[hit - 1]))
    new_blocks = [k for k, unit in enumerate(own) if unit not in pinned]
    need = (len(new_blocks) + plan.partial[i]) * sizes.history_block_bytes + sizes.live_state_bytes
    if not cache.evict_until(budget_bytes - need, pinned):
        raise ValueError(
            f"request {request.request_id!r} does not fit a {budget_bytes:,}-byte budget: it needs "
            f"{need:,} B beside the {cache.total_bytes:,} B of cached units it reads"
        )
    for k in new_blocks:
        cache.push(own[k], k + 1)
    for k, key in enumerate(keys):
        if plan.last_pass.get(key, -1) > i:
            cache.push((CHECKPOINT, key), k + 1)
    cache.evict_until(budget_bytes, set())
    return hit * sizes.grain_tokens


def offline_hit_bound(requests: Sequence[Request], sizes: UnitBytes, budget_bytes: int) -> BoundResult:
    """Hit tokens per request of the Belady-style offline policy at ``budget_bytes``
    (module docstring: units, next use, the one-at-a-time concurrency model).

    ``ValueError`` if a request alone (its own memory and the units it reads)
    does not fit the budget.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)) or budget_bytes < 1:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    plan = _plan(requests, sizes.grain_tokens)
    cache = _Cache(plan, sizes)
    hits = np.zeros(len(requests), dtype=np.int64)
    peak = 0
    for i, request in enumerate(requests):
        hits[i] = _serve(i, request, plan, cache, int(budget_bytes))
        peak = max(peak, cache.total_bytes)
    targets = np.asarray(plan.target_blocks, dtype=np.int64) * sizes.grain_tokens
    return BoundResult(hits, targets, int(sum(r.prompt_tokens for r in requests)), int(budget_bytes), peak)
