"""Checkpoint policies: which boundaries keep a state checkpoint, and which goes first.

Policies differ in the *speculative* checkpoints (unheld, low priority) kept besides a request's latest
and its junction; ``"prefill-per-byte"`` also ranks checkpoints by value (:class:`CheckpointValues`,
kept in order by :class:`CheckpointOrder`). See docs/prefix-caching.md, "Checkpoint policies".
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from dataclasses import dataclass

from hybridkv._checks import as_int

CHECKPOINT_POLICIES = ("prompt-boundaries", "terminal-and-junctions", "interval", "prefill-per-byte")
DEFAULT_CHECKPOINT_POLICY = "prompt-boundaries"
ATTENTION_EQUAL_DEPTH_TOKENS = 131_072  # depth where a V4-Flash token's attention work equals its fixed work
CHECKPOINT_HISTORY_TOKENS = 1_046  # a V4-Flash checkpoint's bytes, in tokens of history
VALUE_HALF_LIFE_REQUESTS = 64  # a checkpoint's score drops by 1 (log2) per this many requests freed
REUSE_FLOOR = 0.25  # a speculative or reused class rated below this is low priority


@dataclass(frozen=True)
class CheckpointPolicy:
    """A named policy with its parameter (``interval_tokens``: ``"interval"`` only)."""

    name: str
    interval_tokens: int | None = None

    def speculative(self, boundary_tokens: int, prompt_tokens: int) -> bool:
        """Whether a boundary a request crosses keeps a speculative checkpoint (its own one there, superseded,
        is then demoted rather than unpublished): one :meth:`speculative_between` keeps (written out: a commit asks)."""
        if self.name == "interval":
            return boundary_tokens % self.interval_tokens == 0
        return self.name in ("prompt-boundaries", "prefill-per-byte") and boundary_tokens <= prompt_tokens

    def speculative_between(self, first_tokens: int, end_tokens: int, grain_tokens: int, prompt_tokens: int) -> range:
        """The boundaries ``first, first + grain, ...`` below ``end`` (multiples of the grain,
        as ``interval_tokens`` is) that :meth:`speculative` keeps, as one range."""
        if self.name == "interval":
            k = self.interval_tokens
            return range(-(-first_tokens // k) * k, end_tokens, k)
        if self.name in ("prompt-boundaries", "prefill-per-byte"):
            return range(first_tokens, min(end_tokens, prompt_tokens + 1), grain_tokens)
        return range(0)


def checkpoint_policy(name: str | None, prompt_checkpoints: bool | None, interval_tokens: int | None,
                      grain_tokens: int) -> CheckpointPolicy:
    """The policy from its name, the older ``prompt_checkpoints`` switch (True: ``"prompt-boundaries"``, False:
    ``"terminal-and-junctions"``) and its parameter; ValueError when the name is unknown, the two disagree, or the
    interval is missing, misplaced or not a positive multiple of the grain."""
    if name is not None and name not in CHECKPOINT_POLICIES:
        raise ValueError(f"checkpoint_policy must be one of {CHECKPOINT_POLICIES}, got {name!r}")
    if prompt_checkpoints is not None:
        implied = CHECKPOINT_POLICIES[0] if prompt_checkpoints else CHECKPOINT_POLICIES[1]
        if name is not None and name != implied:
            raise ValueError(f"prompt_checkpoints={prompt_checkpoints!r} contradicts checkpoint_policy={name!r}")
        name = implied
    name = name or DEFAULT_CHECKPOINT_POLICY
    if name != "interval":
        if interval_tokens is not None:
            raise ValueError(f"checkpoint_interval_tokens applies to checkpoint_policy='interval' only, not {name!r}")
        return CheckpointPolicy(name)
    if interval_tokens is None:
        raise ValueError("checkpoint_policy='interval' needs checkpoint_interval_tokens")
    return CheckpointPolicy(name, grain_multiple("checkpoint_interval_tokens", interval_tokens, grain_tokens))


def grain_multiple(name: str, value: int, grain_tokens: int) -> int:
    """``value`` checked: a positive multiple of the grain (ValueError naming ``name`` otherwise)."""
    n = as_int(name, value)
    if n <= 0 or n % grain_tokens:
        raise ValueError(f"{name} must be a positive multiple of the grain {grain_tokens}, got {n}")
    return n


def saved_prefill(boundary_tokens: int) -> float:
    """Prefill work a hit at ``D`` saves, in tokens' fixed work: ``D + D^2 / (2 ATTENTION_EQUAL_DEPTH_TOKENS)``."""
    d = float(boundary_tokens)
    return d + d * d / (2 * ATTENTION_EQUAL_DEPTH_TOKENS)


SPECULATIVE, OWN, REUSED = "speculative", "own", "reused"  # the classes of CheckpointValues
CLASSES = (SPECULATIVE, OWN, REUSED)


class CheckpointValues:
    """Saved prefill per byte, blended with recency, of a ``"prefill-per-byte"`` prefix cache's checkpoints (one
    record per key; the score and the expected reuse per class: docs/prefix-caching.md, "Checkpoint policies")."""

    def __init__(self, checkpoint_tokens: int = CHECKPOINT_HISTORY_TOKENS):
        self.checkpoint_tokens = as_int("checkpoint_tokens", checkpoint_tokens, minimum=1)
        self.freed_requests = 0  # the clock: requests freed so far
        # key -> [boundary tokens, class, last use, hits in its class, publication number]
        self._records: dict[Hashable, list] = {}
        self._published = itertools.count()
        # Keys published, hit or moved to another class since take_changed() last ran.
        self._changed: dict[Hashable, None] = {}
        self._members: dict[str, dict[Hashable, None]] = {kind: {} for kind in CLASSES}
        self.successes = dict.fromkeys(CLASSES, 0)
        self.failures = dict.fromkeys(CLASSES, 0)

    def published(self, key: Hashable, boundary_tokens: int, speculative: bool) -> None:
        if key not in self._records:
            kind = SPECULATIVE if speculative else OWN
            self._records[key] = [boundary_tokens, kind, self.freed_requests, 0, next(self._published)]
            self._members[kind][key] = None
            self._changed[key] = None

    def hit(self, key: Hashable) -> None:
        """A request hit at the checkpoint (a success of its class)."""
        record = self._records.get(key)
        if record is None:
            return
        self.successes[record[1]] += 1
        record[2] = self.freed_requests
        self._changed[key] = None
        if record[1] == SPECULATIVE:
            self._move(key, record, REUSED)
        else:
            record[3] += 1

    def superseded(self, key: Hashable, kept: bool) -> None:
        """The request holding it moved past it; ``kept``: it stays cached. An ``own``
        checkpoint is then no terminal: kept, it becomes ``speculative``."""
        record = self._records.get(key)
        if record is None or record[1] != OWN:
            return
        if kept:
            self._move(key, record, SPECULATIVE)
        else:
            self._forget(key)

    def _move(self, key: Hashable, record: list, kind: str) -> None:
        del self._members[record[1]][key]
        record[1], record[3] = kind, 0
        self._members[kind][key] = self._changed[key] = None

    def _forget(self, key: Hashable) -> list | None:
        record = self._records.pop(key, None)
        if record is not None:
            del self._members[record[1]][key]
            self._changed.pop(key, None)
        return record

    def removed(self, key: Hashable) -> None:
        """It left the cache: a failure of its class unless it was hit there."""
        record = self._forget(key)
        if record is not None and record[3] == 0:
            self.failures[record[1]] += 1

    def take_changed(self) -> list[Hashable]:
        """The recorded keys published, hit or moved to another class since the last
        call (in that order of first change), and forget them."""
        changed, self._changed = list(self._changed), {}
        return changed

    def members(self, kind: str) -> list[Hashable]:
        """The recorded keys of class ``kind``."""
        return list(self._members[kind])

    def kind(self, key: Hashable) -> str | None:
        """The checkpoint's class (None if not recorded)."""
        record = self._records.get(key)
        return None if record is None else record[1]

    def request_freed(self) -> None:
        self.freed_requests += 1

    def __len__(self) -> int:
        """Checkpoints recorded."""
        return len(self._records)

    def expected_reuse(self, kind: str) -> float:
        hits = self.successes[kind]
        return (hits + 1) / (hits + self.failures[kind] + 2)

    def low_priority(self, kind: str) -> bool:
        """Whether checkpoints of class ``kind`` go before anything usable: a
        speculative or reused class rated below ``REUSE_FLOOR``."""
        return kind != OWN and self.expected_reuse(kind) < REUSE_FLOOR

    def score_of(self, boundary_tokens: int, last_use: int, expected_reuse: float) -> float:
        """The score now of a checkpoint at ``boundary_tokens`` last used at ``last_use``
        in a class of that expected reuse."""
        d = boundary_tokens
        value = math.log2(saved_prefill(d) * expected_reuse / (d + self.checkpoint_tokens))
        return value - (self.freed_requests - last_use) / VALUE_HALF_LIFE_REQUESTS

    def order_key(self, key: Hashable) -> tuple:
        """Where the checkpoint stands in :meth:`eviction_order` among its priority: (its score now, higher: kept
        longer; boundary; publication number). KeyError if not recorded."""
        boundary, kind, last_use, _, number = self._records[key]
        return self.score_of(boundary, last_use, self.expected_reuse(kind)), boundary, number

    def static_key(self, key: Hashable) -> tuple:
        """The checkpoint's place in its class, which no freed request changes: (score less the class's
        ``log2(expected_reuse)``, plus the clock / H; boundary; publication number), then its last use (the
        clock at its publication or last hit)."""
        boundary, _, last_use, _, number = self._records[key]
        value = math.log2(saved_prefill(boundary) / (boundary + self.checkpoint_tokens))
        return value + last_use / VALUE_HALF_LIFE_REQUESTS, boundary, number, last_use

    def eviction_order(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """The recorded ``keys``, low-priority classes first, then by :meth:`order_key` (a full sort: the
        reference for :class:`CheckpointOrder`)."""
        low = {kind: self.low_priority(kind) for kind in CLASSES}
        records = self._records
        return sorted((k for k in keys if k in records),
                      key=lambda k: (not low[records[k][1]], *self.order_key(k)))


class CheckpointOrder:
    """The ``"prefill-per-byte"`` eviction order of the state pools' checkpoints, kept incrementally (the full sort's
    decisions, :meth:`CheckpointValues.eviction_order`): one heap per pool and class by
    :meth:`CheckpointValues.static_key`, then the checkpoints gone idle (or :meth:`mended`) since the last freed
    request (docs/prefix-caching.md, "Checkpoint policies"). A pool with ``ranker`` set to this object reports pages
    gone idle (:meth:`went_idle`) and takes its normal-priority victims from :meth:`victim`."""

    def __init__(self, values: CheckpointValues, pools: Sequence, idle_clock, beyond_gap: Callable[[Hashable], bool]):
        self.values = values
        self.pools = list(pools)
        self._idle_clock = idle_clock  # a tick later than every idle tick so far
        # Whether eviction holds a key's entries low for a gap (never promoted here).
        self._beyond_gap = beyond_gap
        self._mended: dict[Hashable, None] = {}  # keys mended since the last freed request
        self._heaps = {pool.group_id: {kind: [] for kind in CLASSES} for pool in self.pools}
        # Per pool: (page, key, idle tick, key's version) of normal-priority pages gone idle (or promoted back: mended)
        # since the last freed request, in LRU order; and how many of them victim() has passed.
        self._fresh: dict[str, list] = {pool.group_id: [] for pool in self.pools}
        self._fresh_seen = dict.fromkeys(self._heaps, 0)
        self._low = dict.fromkeys(CLASSES, False)  # each class's priority at the last freed request
        self._reuse = {kind: values.expected_reuse(kind) for kind in CLASSES}
        self._tick = 0  # the idle clock at the last freed request
        self._version: dict[Hashable, int] = {}
        self._versions = itertools.count(1)
        for pool in self.pools:
            pool.ranker = self

    def went_idle(self, group_id: str, pages: list, tick: int) -> None:
        """``pages`` ((page, key) of normal priority, in LRU order) of pool ``group_id`` went idle at ``tick``."""
        version = self._version.get
        self._fresh[group_id].extend((page, key, tick, version(key, 0)) for page, key in pages)

    def request_freed(self) -> None:
        """File again what changed since the last freed request (class docstring)."""
        values = self.values
        low = {kind: values.low_priority(kind) for kind in CLASSES}
        kinds = {key: values.kind(key) for key in self._changed_keys(low)}
        self._low = low
        self._reuse = {kind: values.expected_reuse(kind) for kind in CLASSES}
        self._tick = self._idle_clock()
        # Demote those of a low-priority class where still normal priority, each to the front of the LRU, the highest
        # score first, so the lowest ends first.
        demoted = sorted((k for k, kind in kinds.items() if kind is not None and low[kind]), key=values.order_key)
        for pool in self.pools:
            for key in reversed(demoted):
                pages = pool.lookup(key)
                if pages and not pool.low_priority[pages[0]]:
                    pool.demote(key)
        for key, kind in kinds.items():
            if kind is not None and not low[kind]:
                self._file(key, kind)
        self._compact()

    def _changed_keys(self, low: dict[str, bool]) -> list[Hashable]:
        """Keys to file again (class docstring), each once; empties the idle lists."""
        changed = dict.fromkeys(self.values.take_changed())
        changed.update(self._mended)
        self._mended.clear()
        for kind in CLASSES:
            if low[kind] != self._low[kind]:
                changed.update(dict.fromkeys(self.values.members(kind)))
        for group_id, fresh in self._fresh.items():
            changed.update((entry[1], None) for entry in fresh)
            fresh.clear()
            self._fresh_seen[group_id] = 0
        return list(changed)

    def _file(self, key: Hashable, kind: str) -> None:
        """Promote a normal-class checkpoint and push it, with a new version, on the heap
        of every pool where it has an idle page."""
        version = self._version[key] = next(self._versions)
        # The entry keeps what it was ranked by (the record's last use may change before
        # the next free files it again): static key, boundary, number, last use.
        entry = (*self.values.static_key(key), version, key)
        for pool in self.pools:
            pages = pool.lookup(key)
            if not pages:
                continue
            if pool.low_priority[pages[0]]:
                if self._beyond_gap(key):
                    continue  # held low until the missing block is back (mended)
                pool.promote(key)
            if any(pool.ref_counts[p] == 0 for p in pages):
                heapq.heappush(self._heaps[pool.group_id][kind], entry)

    def mended(self, keys: list[Hashable]) -> None:
        """The entries under ``keys`` lay beyond a gap and regained their value (those
        the gap had demoted promoted back, in this order, to the back of the LRU): each
        ranks as gone idle now until the next freed request files it again."""
        for key in keys:
            if self.values.kind(key) is None:
                continue
            # Its heap entries and its earlier places among the idle no longer stand.
            version = self._version[key] = next(self._versions)
            self._mended[key] = None
            for pool in self.pools:
                pages = pool.lookup(key)
                if pages and not pool.low_priority[pages[0]]:
                    ref, idle_tick = pool.ref_counts, pool.idle_tick
                    self._fresh[pool.group_id].extend(
                        (p, key, int(idle_tick[p]), version) for p in pages if ref[p] == 0)

    def _standing(self, pool, key: Hashable, version: int) -> bool:
        """Whether a heap entry still stands: current version, normal priority, a page
        idle since before the last freed request."""
        if self._version.get(key) != version or self.values.kind(key) is None:
            return False
        pages = pool.lookup(key)
        if not pages or pool.low_priority[pages[0]]:
            return False
        ref, idle_tick = pool.ref_counts, pool.idle_tick
        return any(ref[p] == 0 and idle_tick[p] <= self._tick for p in pages)

    def victim(self, pool, taken: Container[Hashable]) -> Hashable | None:
        """The next normal-priority checkpoint ``pool`` evicts (not in ``taken``): the lowest of the class heads,
        then those gone idle since the last freed request in LRU order; None if none is left."""
        best = None
        values = self.values
        for kind, heap in self._heaps[pool.group_id].items():
            while heap and (heap[0][-1] in taken or not self._standing(pool, heap[0][-1], heap[0][-2])):
                heapq.heappop(heap)
            if heap:
                _, boundary, number, last_use, _, _ = heap[0]
                rank = values.score_of(boundary, last_use, self._reuse[kind]), boundary, number
                if best is None or rank < best[0]:
                    best = (rank, heap)
        if best is not None:
            return heapq.heappop(best[1])[-1]
        return self._next_fresh(pool, taken)

    def _next_fresh(self, pool, taken: Container[Hashable]) -> Hashable | None:
        fresh, n = self._fresh[pool.group_id], self._fresh_seen[pool.group_id]
        ref, idle_tick, flags = pool.ref_counts, pool.idle_tick, pool.low_priority
        while n < len(fresh):
            page, key, tick, version = fresh[n]
            n += 1
            pages = pool.lookup(key)
            if (key not in taken and pages and page in pages and ref[page] == 0 and idle_tick[page] == tick
                    and not flags[page] and self._version.get(key, 0) == version):
                self._fresh_seen[pool.group_id] = n
                return key
        self._fresh_seen[pool.group_id] = n
        return None

    def _compact(self) -> None:
        """Drop heap entries of superseded versions or forgotten keys once they
        outnumber the live ones (amortised O(1) a push)."""
        live = len(self.values)
        for heaps in self._heaps.values():
            for heap in heaps.values():
                if len(heap) > 2 * live + 64:
                    heap[:] = [e for e in heap if self._version.get(e[-1]) == e[-2] and self.values.kind(e[-1])]
                    heapq.heapify(heap)
        if len(self._version) > 2 * live + 64:
            self._version = {k: v for k, v in self._version.items() if self.values.kind(k) is not None}


__all__ = ["ATTENTION_EQUAL_DEPTH_TOKENS", "CHECKPOINT_HISTORY_TOKENS", "CHECKPOINT_POLICIES", "CLASSES",
           "CheckpointOrder", "CheckpointPolicy", "CheckpointValues", "DEFAULT_CHECKPOINT_POLICY", "OWN", "REUSE_FLOOR",
           "REUSED", "SPECULATIVE", "VALUE_HALF_LIFE_REQUESTS", "checkpoint_policy", "grain_multiple", "saved_prefill"]
