"""Prefix caching across hybrid groups: content keys, publication, matching (docs/prefix-caching.md).

Content keys are chained hashes over blocks of ``granularity_tokens`` tokens: ``h[b] = H(h[b-1] || tokens of block b)``,
``h[-1] = H(salt)``. History groups publish block ``b``'s pages under ``h[b]`` once committed; state groups publish a
checkpoint at a boundary ``D`` (the pages of the window ``[D-W, D)``) under ``h[D/G - 1]``, a request keeping its
latest, its pinned ones and those its checkpoint policy keeps (:mod:`hybridkv.prefix.checkpoints`). A hit at
``D <= prompt - 1`` needs every history group's blocks below ``D`` and every state group's checkpoint at exactly ``D``.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial, reduce
from itertools import islice, repeat
from math import lcm
from operator import itemgetter
from typing import IO, Any, Protocol

import numpy as np
import xxhash

from hybridkv._checks import as_int
from hybridkv.prefix.checkpoints import OWN, REUSED, SPECULATIVE, CheckpointOrder, CheckpointValues, grain_multiple
from hybridkv.prefix.checkpoints import checkpoint_policy as policy_from_options
from hybridkv.prefix.eviction import GroupValueStats, ValueEviction
from hybridkv.memory import lru
from hybridkv.memory.pool import UNPUBLISHED, PagePool, idle_clock_tick
from hybridkv.runtime.kernels import entry_point
from hybridkv.spec import CacheGroupSpec
from hybridkv.tables.store import CommitPages, GroupTable

_HASHES: dict[str, Callable[[bytes], int]] = {
    "xxh3_128": xxhash.xxh3_128_intdigest,
    "sha256": lambda data: int.from_bytes(hashlib.sha256(data).digest()[:16], "little")}
HASH_ALGOS = tuple(_HASHES)


@dataclass(frozen=True)
class PrefixHit:
    """The reconciled hit (one number for every group) and what each group alone allowed."""

    hit_tokens: int
    group_hit_tokens: dict[str, int]
    history_hit_tokens: int = 0  # how far every history group reaches together

    @staticmethod
    def none(specs: Sequence[CacheGroupSpec]) -> PrefixHit:
        return PrefixHit(0, {s.group_id: 0 for s in specs})

    @property
    def junction_tokens(self) -> int:
        """Where this prompt leaves content other requests computed (0 if the hit reaches it); a checkpoint
        there is pinned when the request crosses it (docs/prefix-caching.md)."""
        return self.history_hit_tokens if self.history_hit_tokens > self.hit_tokens else 0

    @property
    def limiting_groups(self) -> list[str]:
        """Groups that alone could not reach past the reconciled hit."""
        return [g for g, t in self.group_hit_tokens.items() if t <= self.hit_tokens]


@dataclass(frozen=True)
class CacheEvent:
    kind: str  # "stored" | "removed"
    group_id: str
    block_hash: str
    parent_hash: str | None
    tokens: int  # prefix length the key names
    num_pages: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


_INT32_LE = np.dtype("<i4")  # the byte order blocks are hashed in
_new_object = object.__new__


class RequestHashes:
    """A request's chained block hashes, extended as its appended ids complete blocks (a prompt's: all at once)."""

    __slots__ = ("root", "granularity_tokens", "_hash", "hashes")

    def __init__(self, root: int, granularity_tokens: int, hash_fn: Callable[[bytes], int]):
        self.root = root
        self.granularity_tokens = granularity_tokens
        self._hash = hash_fn
        self.hashes: list[int] = []

    def extend_to(self, token_ids: np.ndarray, num_tokens: int) -> None:
        """Hash every complete block of the first ``num_tokens`` tokens not hashed yet."""
        g = self.granularity_tokens
        have, want = len(self.hashes), num_tokens // g
        if want <= have:
            return
        block = token_ids[have * g : want * g]
        if block.dtype is not _INT32_LE:  # a manager's buffer already is (``tobytes`` reads any layout in order)
            block = block.astype(_INT32_LE)
        parent = self.hashes[-1] if self.hashes else self.root
        if want == have + 1:  # one block (a decode commit): no slicing
            self.hashes.append(self._hash(parent.to_bytes(16, "little") + block.tobytes()))
            return
        data, block_bytes = block.tobytes(), 4 * g
        hash_fn, append = self._hash, self.hashes.append
        for start in range(0, len(data), block_bytes):  # bytes slices: faster than a memoryview's here
            parent = hash_fn(parent.to_bytes(16, "little") + data[start : start + block_bytes])
            append(parent)

    def prefix_copy(self, num_tokens: int) -> RequestHashes:
        """A new record holding these hashes of the complete blocks of the first ``num_tokens`` tokens (this one's
        later extensions and cuts leave it alone)."""
        copy = RequestHashes(self.root, self.granularity_tokens, self._hash)
        copy.hashes = self.hashes[: num_tokens // self.granularity_tokens]
        return copy

    def cut_to(self, num_tokens: int) -> None:
        """Forget the hashes of blocks past the first ``num_tokens`` tokens (their ids were rewound)."""
        del self.hashes[num_tokens // self.granularity_tokens :]

    def key(self, boundary_tokens: int) -> int:
        """Key of the prefix ``[0, boundary)`` (boundary a positive multiple of the grain)."""
        return self.hashes[boundary_tokens // self.granularity_tokens - 1]


@dataclass(slots=True)
class MatchTotals:
    """What every group's stats count alike as requests are matched: one object, shared by a cache's groups."""

    lookups: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0


@dataclass(slots=True)  # compact: every group's is updated as a request joins
class PrefixGroupStats:
    matched: MatchTotals = field(default_factory=MatchTotals)  # lookups, queried and hit tokens (every group's)
    alone_hit_tokens: int = 0
    stored_entries: int = 0
    removed_entries: int = 0

    lookups = property(lambda self: self.matched.lookups, doc="requests matched")
    queried_tokens = property(lambda self: self.matched.queried_tokens, doc="their prompt tokens")
    hit_tokens = property(lambda self: self.matched.hit_tokens, doc="their reconciled hits")
    token_hit_rate = property(lambda self: self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0)


@dataclass(slots=True)
class OwnCheckpoint:
    boundary_tokens: int
    pinned: bool = False  # an interval or junction checkpoint: never superseded
    # gid -> (key, pages): the very tuple the pool published, so ``_supersede`` knows the hold by identity.
    entries: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)


class CommittingRequest(Protocol):
    """What the prefix cache reads and keeps of a request (the manager's record)."""

    row: int  # its table row
    prompt_tokens: int
    hashes: RequestHashes  # its blocks' keys (a commit's crossed blocks: hashed when added or appended)
    own_checkpoints: list[OwnCheckpoint]
    keep_boundaries: frozenset[int]  # boundaries whose checkpoints it pins (its junction)
    token_ids: np.ndarray  # its known tokens (int32), hashed as it is added and as appends complete blocks
    thrash_hit_tokens: int  # its hit where its prompt reached past it to a checkpoint evicted lately, else -1
    hit_checkpoints: list  # the checkpoint its hit resumed from, as its first own checkpoints (none: no hit)


class PrefixCache:
    """Content-keyed pages over the manager's pools and tables."""

    def __init__(self, specs: Sequence[CacheGroupSpec], pools: Mapping[str, PagePool], tables: Mapping[str, GroupTable],
                 *, granularity_tokens: int | None = None, hash_algo: str = "xxh3_128",
                 state_checkpoint_interval: int | None = None, prompt_checkpoints: bool | None = None,
                 checkpoint_policy: str | None = None, checkpoint_interval_tokens: int | None = None,
                 on_event: Callable[[CacheEvent], None] | None = None, max_buffered_events: int = 100_000,
                 checkpoint_window_tokens: Mapping[str, int] | None = None, eviction_policy: str = "value"):
        self.specs = tuple(specs)
        windows = _checkpoint_windows(self.specs, checkpoint_window_tokens)
        self.pools = pools
        self.tables = tables
        if hash_algo not in HASH_ALGOS:  # a tuple: any value compares
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {hash_algo!r}")
        self._hash = _HASHES[hash_algo]
        self._unsalted_root = self._hash(b"hybridkv-prefix-root\x00")  # h[-1] of every unsalted request
        self.history_ids = [s.group_id for s in self.specs if not s.is_sliding]
        # State groups that store checkpoints (a window of 0 is restorable at every boundary).
        self.state_ids = [gid for gid, n in windows.items() if n > 0]
        g = self.granularity_tokens = _grain(self.specs, windows, granularity_tokens)
        self.state_checkpoint_interval = None if state_checkpoint_interval is None else grain_multiple(
            "state_checkpoint_interval", state_checkpoint_interval, g)
        self.policy = policy_from_options(checkpoint_policy, prompt_checkpoints, checkpoint_interval_tokens, g)
        self.checkpoint_policy = self.policy.name
        self.checkpoint_interval_tokens = self.policy.interval_tokens
        # "prefill-per-byte": each checkpoint's saved prefill, hits and last use.
        self.values = CheckpointValues() if self.policy.name == "prefill-per-byte" else None
        self.on_event = on_event  # checked (a property)
        # Without a callback, events wait for drain_events(); past the bound the oldest are dropped (counted). The
        # buffer holds raw events and commits' records (``_book``'s ``booked``: ``_raws`` expands them).
        self.events: deque[tuple] = deque()
        self.max_buffered_events = max_buffered_events  # checked (a property)
        self.dropped_events = 0
        self._buffered = 0  # events in the buffer
        self._front_dropped = 0  # events of its first item dropped already (a record cut short: not drained)
        self._matched = MatchTotals()  # every group's lookups, queried and hit tokens (``match_and_borrow``)
        self.stats = {s.group_id: PrefixGroupStats(self._matched) for s in self.specs}
        # Per state entry, how many requests keep it as an own checkpoint (unpublished at none).
        self._holders: dict[str, dict[int, int]] = {gid: {} for gid in self.state_ids}
        self._windows = windows
        self._init_hit_placement(tables)  # finds the pools' page space first
        self._init_commit_reader(pools, tables, windows)
        self.tier_hook = None  # a hybridkv.tierlink.TierLink: told what is published and removed
        self._dropping = False  # unpublishing a superseded checkpoint (not an eviction)
        self._init_eviction(eviction_policy)
        self._knows = self.eviction.knows  # whether some group may publish a key (False: none does)
        self._init_thrash_guard()

    def _init_thrash_guard(self) -> None:
        """The thrash guard (docs/prefix-caching.md, "Eviction by value"): with the value policy and a checkpoint
        policy that ranks no checkpoint ("prefill-per-byte" orders them itself), the keys of the checkpoints evicted
        last, as many as the first state group's pool has pages, oldest first; ``thrash_guard = False`` turns it off.
        With a tier link it stands aside: an evicted checkpoint may be offloaded, and loading it back loses no hit."""
        self.thrash_guard = True
        self.thrash_guarded_requests = 0  # requests whose pages the guard put next in line at their free
        self._guarding = self.eviction.acts and self.values is None and bool(self.state_ids)
        self._evicted_checkpoints: OrderedDict[int, None] = OrderedDict()
        self._evicted_bound = self.pools[self.state_ids[0]].num_pages if self.state_ids else 0
        # The moved-past demotion ("Eviction by value", 8; ``demote_moved_past = False`` turns it off): per key of a
        # checkpoint a request left at its free, the entries of the one it borrowed and moved past (as many keys).
        self.demote_moved_past = True
        self.moved_past_demoted = 0  # checkpoints it demoted
        self._moved_past: OrderedDict[int, list] = OrderedDict()

    def _remember(self, store: OrderedDict, key: int, value: Any = None) -> None:
        """``store[key] = value``, now the newest; past the bound (``_evicted_bound``) the oldest are forgotten."""
        store[key] = value
        store.move_to_end(key)
        while len(store) > self._evicted_bound:
            store.popitem(last=False)

    def _note_evicted(self, keys: Iterator[int] | Sequence[int]) -> None:
        """Checkpoints evicted (the thrash guard's), each now the newest."""
        for key in keys:
            self._remember(self._evicted_checkpoints, key)

    def note_moved_past(self, req: CommittingRequest) -> None:
        """At the free of ``req``, which hit a checkpoint: where its prompt passed that one by a grain and superseded
        it, and it is still published at normal priority, its entries are remembered under the key of the request's
        latest checkpoint, to be demoted when a request hits that one (:meth:`_demote_moved_past`)."""
        hit, own = req.hit_checkpoints[0], req.own_checkpoints
        entries = self._normal_entries(hit) if self._moved_on(req, hit, own) else None
        if entries:
            self._remember(self._moved_past, next(iter(own[-1].entries.values()))[0], entries)

    def _moved_on(self, req: CommittingRequest, hit: OwnCheckpoint, own: list) -> bool:
        """Whether ``req`` (freed, with the demotion acting) superseded the checkpoint it hit, its prompt passing it by
        a grain, and left one of its own."""
        return (self.demote_moved_past and self._guarding and self.tier_hook is None and bool(own)
                and bool(own[-1].entries) and all(c is not hit for c in own)
                and hit.boundary_tokens + self.granularity_tokens <= req.prompt_tokens)

    def _normal_entries(self, hit: OwnCheckpoint) -> list[tuple]:
        """``hit``'s entries still published at normal priority, as (lookup, key, pages, page space index)."""
        entries = []
        for gid, (key, pages) in hit.entries.items():
            lookup, _, slot = self._supersede_books[gid]
            if lookup(key) is pages and not self.pools[gid].low_priority[pages[0]]:
                entries.append((lookup, key, pages, slot))
        return entries

    def _demote_moved_past(self, key: int) -> None:
        """A hit at ``key``: the checkpoint its request moved past, where still published and no other prefix branches
        off it, goes low priority (its conversation moved on twice: "Eviction by value", 8)."""
        entries = self._moved_past.pop(key, None) if self._moved_past else None
        if entries and self.eviction.branches(entries[0][1]) <= 1:
            listed = []
            for lookup, passed, pages, slot in entries:
                if lookup(passed) is pages:  # not evicted (nor re-stored) since
                    listed += (slot, len(pages), *pages)
            if listed:
                self._space.demote(listed)
                self.moved_past_demoted += 1

    def _thrash_hit(self, req: CommittingRequest, blocks: int) -> int:
        """The hit's tokens where the guard is on and the prompt's blocks past the hit's ``blocks`` name a checkpoint
        evicted lately (a request that an eviction cost part of its hit), else -1."""
        evicted = self._evicted_checkpoints
        if not (evicted and self.thrash_guard) or self.tier_hook is not None or evicted.keys().isdisjoint(
                req.hashes.hashes[blocks:]):
            return -1
        return blocks * self.granularity_tokens

    def _init_commit_reader(self, pools: Mapping[str, PagePool], tables: Mapping[str, GroupTable],
                            windows: Mapping[str, int]) -> None:
        """What a commit publishes, read in one call (``_reader``): per history group (group, pool, pages per block,
        its stats), per state group storing checkpoints (group, pool, pages per checkpoint, its holders, its stats)."""
        g = self.granularity_tokens
        self._reader = CommitPages([(tables[gid], g // tables[gid].page_tokens) for gid in self.history_ids],
                                   [(tables[gid], windows[gid]) for gid in self.state_ids], self._space)
        self._history_lookups = [pools[gid].lookup for gid in self.history_ids]
        self._state_lookups = [pools[gid].lookup for gid in self.state_ids]
        self._history_groups = [(gid, pools[gid], n, self.stats[gid])
                                for gid, n in zip(self.history_ids, self._reader.block_pages)]
        self._state_groups = [(gid, pools[gid], n, self._holders[gid], self.stats[gid])
                              for gid, n in zip(self.state_ids, self._reader.checkpoint_pages)]
        self._entry_pages = {gid: n for gid, _, n, *_ in self._history_groups + self._state_groups}
        self._hit_holders = [(gid, holders) for gid, _, _, holders, _ in self._state_groups]  # hits' and commits' holds
        self._checkpoint_events = [(gid, n) for gid, _, n, *_ in self._state_groups]  # what a "stored" event names
        # Per state group, where its pages of each boundary lie in the state part of what a
        # commit reads: the i-th page of every window, one slice a page.
        step, offsets = self._reader.boundary_pages, np.cumsum([0, *self._reader.checkpoint_pages]).tolist()
        self._window_places = [[slice(at + i, None, step) for i in range(n)]
                               for at, n in zip(offsets, self._reader.checkpoint_pages)]
        self._init_units()

    def _init_units(self) -> None:
        """What commits claimed whole read (``_record``): every group in order, its pool's entries and pages'
        keys (``PageSpace.entry_maps``), pages, stats and whether it is a history group; each history group's id and
        pages (its events); each state group's holders and entries (where a commit's latest checkpoint is read
        back). Only with state groups and no pinning interval are commits claimed whole."""
        self._units = bool(self.state_ids) and self.state_checkpoint_interval is None
        unit = self._history_groups + [(gid, pool, n, stats) for gid, pool, n, _, stats in self._state_groups]
        maps = self._space.entry_maps([pool for _, pool, _, _ in unit])
        self._unit_parts = [(*maps[j], n, stats, j < len(self._history_groups))
                            for j, (_, _, n, stats) in enumerate(unit)]
        self._history_events = [(gid, n) for gid, _, n, _ in self._history_groups]  # what a block's event names
        self._unit_holders = [(gid, holders, self._unit_parts[j][0]) for j, (gid, _, _, holders, _)
                              in enumerate(self._state_groups, len(self._history_groups))]

    def _init_hit_placement(self, tables: Mapping[str, GroupTable]) -> None:
        """What a hit's placement (one ``lru.borrow_row`` call over the page space) reads, by table index."""
        self._table_set = tables[self.specs[0].group_id].table_set
        self._group_index = [tables[s.group_id].group_index for s in self.specs]
        self._space = self.pools[self.specs[0].group_id].space  # the manager's: one PageSpace, one TableSet
        space = self._space  # the page space's arrays a hit's ``lru.borrow_row`` changes (never replaced)
        self._borrow_space = (space.ref_counts, space.cached, space.low_priority, space.lru_prev, space.lru_next,
                              space.per_group)
        # Where each spec's own reach lies in ``_match``'s reaches (then one for groups restorable anywhere).
        matched = self.history_ids + self.state_ids
        self._spec_ids = [s.group_id for s in self.specs]
        self._reach_index = [matched.index(gid) if gid in matched else len(matched) for gid in self._spec_ids]
        self._no_reach = [0] * len(matched)  # their reaches where no group has a block of the prompt
        in_table_order = [s for _, s in sorted(zip(self._group_index, self.specs), key=itemgetter(0))]
        # Per group, by table index, the trailing tokens below a hit it places (-1: history, every page).
        self._hit_windows = np.array([self._windows[s.group_id] if s.is_sliding else -1 for s in in_table_order],
                                     dtype=np.int64)
        # The groups whose entries a hit places: (every block, else the checkpoint; index in its id list).
        self._picks = [(True, self.history_ids.index(s.group_id)) if not s.is_sliding
                       else (False, self.state_ids.index(s.group_id))
                       for s in in_table_order if s.group_id in matched]
        self._borrow: Callable[..., int] | None = None  # loaded at the first hit (``kernels.entry_point``)
        # Its scratch (``lru.borrow_row``'s ``work``): three per group and one per page a row holds at most.
        self._borrow_work = np.empty(3 * len(self.specs) + self._table_set.row_cells, dtype=np.int64)
        self._spec_stats = list(zip(self._spec_ids, self._reach_index, (self.stats[gid] for gid in self._spec_ids)))

    def _init_eviction(self, eviction_policy: str) -> None:
        """What goes first when a pool must evict (hybridkv.prefix.eviction: units, orphans,
        gaps), told of every removal; with "prefill-per-byte", the state pools' order too."""
        pools = self.pools
        # Per group, what booking a removal there reads: its holders (a state group's, else None), stats, entry pages.
        self._books = {gid: (self._holders.get(gid), self.stats[gid], self._entry_pages.get(gid, 0)) for gid in pools}
        self.eviction = ValueEviction(pools, self.history_ids, self.state_ids, self.granularity_tokens,
                                      eviction_policy)
        for gid, pool in pools.items():
            pool.on_removed = partial(self._removed, gid)
            if gid in self.state_ids:  # its removals take the rest of a unit from the other groups only
                pool.evict_many = partial(self._evict_many, gid)
        self._init_units_left()
        # Per state group, what superseding reads there: its pool's lookup, holders and index in the page space.
        self._supersede_books = {gid: (pools[gid].lookup, self._holders[gid], self._space.pools.index(pools[gid]))
                                 for gid in self.state_ids}
        self._order = None  # "prefill-per-byte": the state pools' eviction order, kept incrementally
        # Not with "group-lru": each pool evicts by its own LRU alone, and a checkpoint one pool lets go of would leave
        # the order without the pages the other pools still keep idle.
        if self.values is not None and self.state_ids and self.eviction.acts:
            self._order = CheckpointOrder(self.values, [pools[g] for g in self.state_ids], idle_clock_tick,
                                          self.eviction.beyond_gap)
            self.eviction.on_mended = self._order.mended

    def _init_units_left(self) -> None:
        """Per group storing entries, the pools its evictions leave: its own, then (the value policy takes whole
        units) those of the other groups its unit holds, in order: a state group's, every other state group; a history
        group's, every other group (history first, as ``ValueEviction.removed`` takes them), its pool packing then in
        batches (``PagePool.evict_batch``, each until a block that may demote entries: ``ValueEviction.stirs``)."""
        pools, acts, history = self.pools, self.eviction.acts, self.history_ids
        self._unit_pools = {gid: [pools[gid]] + [pools[o] for o in (history if gid in history else []) + self.state_ids
                                                 if o != gid and acts] for gid in history + self.state_ids}
        # Per group, what pops a unit's entries from those pools (``_evict_many``, ``_supersede``).
        self._unit_pops = {gid: self._space.entry_pops(unit) for gid, unit in self._unit_pools.items()}
        for gid in history if acts else ():
            pools[gid].stirs, pools[gid].evict_batch = self.eviction.stirs, partial(self._evict_many, gid)

    @property
    def checkpoint_windows(self) -> dict[str, int]:
        """Per state group that stores checkpoints, the trailing tokens one stores."""
        return {gid: self._windows[gid] for gid in self.state_ids}

    # --- keys ------------------------------------------------------------------
    def new_request_hashes(self, cache_salt: str | bytes | None) -> RequestHashes:
        if cache_salt is None:
            return RequestHashes(self._unsalted_root, self.granularity_tokens, self._hash)
        if not isinstance(cache_salt, (str, bytes)):
            raise ValueError(f"cache_salt must be str or bytes, got {type(cache_salt).__name__}")
        salt = cache_salt.encode() if isinstance(cache_salt, str) else (cache_salt or b"")
        root = self._hash(b"hybridkv-prefix-root\x00" + salt) if salt else self._unsalted_root
        return RequestHashes(root, self.granularity_tokens, self._hash)

    def prompt_hashes(self, prompt_ids: np.ndarray, cache_salt: str | bytes | None) -> RequestHashes:
        """The hashes ``match_and_borrow`` would start and extend for this prompt (every complete block), made ahead."""
        hashes = self.new_request_hashes(cache_salt)
        hashes.extend_to(prompt_ids, prompt_ids.size)
        return hashes

    # --- matching ---------------------------------------------------------------
    def match(self, hashes: RequestHashes, prompt_ids: np.ndarray) -> PrefixHit:
        """The hit for a prompt, without borrowing anything."""
        hashes.extend_to(prompt_ids, prompt_ids.size)  # (the prompt's from ``prompt_hashes``: hashed already)
        k, limit, reach, _, _ = self._match(hashes, prompt_ids)
        g = self.granularity_tokens
        return PrefixHit(k * g, {gid: reach[i] * g for gid, i in zip(self._spec_ids, self._reach_index)}, limit * g)

    def _match(self, hashes: RequestHashes, prompt_ids: np.ndarray) -> tuple[int, int, list[int], list[list], list]:
        """The hit for a prompt (its last token aside), in blocks; the blocks every history group holds from the first;
        each group's reach alone (``_reach_index`` says where a spec's lies); per history group its entries from the
        first block on, and per state group its entry at the hit ([] without one). Plain loops: cheaper run cold. The
        walks down start below the prompt's last blocks no group publishes (``ValueEviction.knows``): none at all, no
        lookup."""
        g = self.granularity_tokens
        max_blocks = (prompt_ids.size - 1) // g
        keys = hashes.hashes  # keys[b - 1] names the prefix of b blocks (every complete one of the prompt: hashed)
        if len(keys) > max_blocks:  # the last token's block: not matched
            keys = keys[:max_blocks]
        top, knows = len(keys), self._knows
        while top and not knows(keys[top - 1]):  # the prompt's own blocks: no group has them
            top -= 1
        if not top and self._no_reach:  # no group has any: every matched group reaches 0, the others every block
            return 0, 0 if self.history_ids else max_blocks, [*self._no_reach, max_blocks], [], []
        # Alone, a history group reaches its first missing block, a state group its last checkpoint.
        history, reach = [], []
        for lookup in self._history_lookups:
            entries = []
            for key in keys:
                entry = lookup(key)
                if entry is None:
                    break
                entries.append(entry)
            history.append(entries)
            reach.append(len(entries))
        limit = min(reach) if reach else max_blocks  # blocks every history group holds, from the first
        found, most = self._state_reach(keys, top, reach)
        reach.append(max_blocks)
        # The hit: the last boundary within the history where every state group holds a checkpoint.
        k = min(reach)
        if k and not (found and most == k):  # a state group's checkpoint is below k: walk down
            k, found = self._walk_down(keys, k)
        return k, limit, reach, history, found if k else []

    def _walk_down(self, keys: list[int], k: int) -> tuple[int, list]:
        """From block ``k`` down, the first boundary where every state group holds a checkpoint, and their entries
        there (0, and what it looked up last, without one)."""
        at_hit = []
        while k:
            key, at_hit = keys[k - 1], []
            for lookup in self._state_lookups:
                at_hit.append(lookup(key))
            if None not in at_hit:
                break
            k -= 1
        return k, at_hit

    def _state_reach(self, keys: list[int], top: int, reach: list[int]) -> tuple[list, int]:
        """``_match``'s walk down each state group to its last checkpoint among the first ``top`` blocks of ``keys``
        (appended to ``reach``); per state group its entry there (None without one), and the furthest one's blocks."""
        found, most = [], 0
        for lookup in self._state_lookups:
            n, entry = top, None
            while n:
                entry = lookup(keys[n - 1])
                if entry is not None:
                    break
                n -= 1
            reach.append(n)
            found.append(entry)
            if n > most:
                most = n
        return found, most

    def match_and_borrow(self, req: CommittingRequest, prompt_ids: np.ndarray,
                         cache_salt: str | bytes | None = None, hashes: RequestHashes | None = None) -> PrefixHit:
        """Start ``req.hashes`` (``hashes``: the prompt's from ``prompt_hashes``, with the same salt), match its
        prompt and borrow the hit's pages into its tables in one compiled call (``lru.borrow_row``); the checkpoint
        at the hit becomes the request's own."""
        req.hashes = hashes if hashes is not None else self.prompt_hashes(prompt_ids, cache_salt)
        blocks, limit, reach, history, at_hit = self._match(req.hashes, prompt_ids)
        g, queried, alone = self.granularity_tokens, prompt_ids.size, {}
        d = blocks * g
        for gid, i, st in self._spec_stats:  # each group's reach alone, and its stats
            alone[gid] = tokens = reach[i] * g
            if tokens:  # a cold object left alone where nothing adds
                st.alone_hit_tokens += tokens
        matched = self._matched  # what every group counts alike
        matched.lookups += 1
        matched.queried_tokens += queried
        matched.hit_tokens += d
        hit = _new_object(PrefixHit)  # its fields set as its frozen __init__ would, without the calls (cold: ~2 µs)
        hit.__dict__.update(hit_tokens=d, group_hit_tokens=alone, history_hit_tokens=limit * g)
        req.thrash_hit_tokens = self._thrash_hit(req, blocks)
        if limit > blocks:
            req.keep_boundaries = frozenset([limit * g])  # its junction
        if d == 0:
            return hit
        listed = []
        for whole, i in self._picks:
            if whole:
                for entry in history[i][:blocks]:
                    listed += entry
            else:
                listed += at_hit[i]
        page_ids = np.array(listed, dtype=np.int64)
        tables = self._table_set
        args = (tables.geometry, tables.pages, tables.bounds, *self._borrow_space, req.row, d, self._hit_windows,
                page_ids, self._borrow_work)
        if self._borrow is None:  # ``lru.borrow_row``'s compiled code for the types every hit passes
            self._borrow = entry_point(lru.borrow_row, args)
        n_idle = self._borrow(*args)
        if n_idle < 0:
            assert n_idle != -1 - page_ids.size, (page_ids.size, d)  # the groups place as many pages as listed
            raise ValueError(f"page {int(page_ids[-1 - n_idle])} is free, cannot be borrowed")
        tables.note_cells(page_ids)  # now the ring-view cells the hit wrote
        # The checkpoint at the hit becomes the request's own (every state group holds it).
        key, entries = req.hashes.hashes[blocks - 1], {}
        for (gid, holders), entry in zip(self._hit_holders, at_hit):
            entries[gid] = (key, entry)
            holders[key] = holders.get(key, 0) + 1
        if self.values is not None:
            self.values.hit(key)
        self._demote_moved_past(key)
        req.hit_checkpoints = req.own_checkpoints = [OwnCheckpoint(d, False, entries)] if at_hit else []
        return hit

    # --- publication -------------------------------------------------------------
    def commit_requests(self, reqs: Sequence[CommittingRequest], old_tokens: Sequence[int],
                        new_tokens: Sequence[int]) -> None:
        """Publish what each request's tokens ``[old, new)`` completed (history blocks and the checkpoints: the policy's
        speculative ones, the latest), request by request in order: the same entries, bookings and events (one call, in
        that order) as one commit at a time: each by :meth:`_commit_alone` (:meth:`_commit_one` with a pinning
        interval or no state group). The checkpoints superseding unpublishes or demotes leave their pools' lists at the
        end, in one call each (:meth:`_let_go`; before a request :meth:`_commit_one` commits)."""
        events, let_go, g = [], [], self.granularity_tokens
        for req, old, new in zip(reqs, old_tokens, new_tokens):
            if new // g > old // g:
                (self._commit_alone if self._units else self._commit_one)(req, old, new, events, let_go)
        if len(let_go) == 1:  # a commit's one unit (most often): what ``_let_go`` does, without its frame
            unpublished, listed = let_go[0]
            (self._space.drop_listed if unpublished else self._space.demote)(listed)
        elif let_go:
            self._let_go(let_go)
        self._emit_many(events)  # per request its "stored" events, then the removals superseding caused

    def _commit_alone(self, req: CommittingRequest, old_tokens: int, new_tokens: int, events: list[tuple],
                      let_go: list[tuple]) -> None:
        """A request's commit: where it publishes only keys no group has and pins no boundary, its unit (its blocks,
        its speculative checkpoints and its latest) read and claimed whole in one compiled call
        (``CommitPages.read_unit``), recorded (:meth:`_record`) and booked (:meth:`_book`: its blocks' keys, parents
        and ends, its checkpoints' keys, parents and boundaries); else, or where the claim fails, :meth:`_commit_one`."""
        hashes, g = req.hashes, self.granularity_tokens
        first, end, keep = old_tokens // g, new_tokens // g, req.keep_boundaries
        latest, speculative, low, hh = end * g, (), 1, hashes.hashes
        keys = hh[first:end]
        if end == first + 1:  # one block (a decode commit): its key and its end checked alone
            pages = None if latest in keep or self._knows(keys[0]) else self._reader.read_unit(
                (1, req.row, first, end, 0, 0, 0, latest))
        elif keep and not keep.isdisjoint(range((first + 1) * g, latest + 1, g)) or any(map(self._knows, keys)):
            pages = None
        else:  # its speculative boundaries too
            speculative = self.policy.speculative_between((first + 1) * g, latest, g, req.prompt_tokens)
            low = 2 if self.values is None or self.values.low_priority(SPECULATIVE) else 1
            pages = self._reader.read_unit((low, req.row, first, end, speculative.start, speculative.step,
                                            len(speculative), latest))
        if pages is None:
            self._commit_one(req, old_tokens, new_tokens, events, let_go)
            return
        parents = hh[first - 1:end - 1] if first else [hashes.root, *keys[:-1]]
        ends = range((first + 1) * g, latest + g, g)
        if len(speculative) + 1 == len(keys):  # every block's end (one block: its end)
            booked = keys, parents, ends, keys, parents, ends
        else:  # the speculative boundaries' blocks, then the last
            at, step = (speculative.start // g - 1 - first, speculative.step // g) if speculative else (0, 1)
            pick = slice(at, at + len(speculative) * step, step)
            booked = keys, parents, ends, keys[pick] + keys[-1:], parents[pick] + parents[-1:], [*speculative, latest]
        self._record(pages, keys, booked[3])
        self._book(req, booked, low, events, let_go)

    def _record(self, pages: list[int], block_keys: list, checkpoint_keys: list) -> None:
        """The entries of commits claimed whole (``pages``: ``CommitPages``' claim, group by group, entry by entry)
        recorded as ``PageSpace.adopt`` does, under ``block_keys`` in each history group and ``checkpoint_keys`` in
        each state group, and counted (plain loops: cheaper run cold than ``dict.update`` of zips)."""
        at = 0
        for published, page_key, size, stats, history in self._unit_parts:
            group_keys = block_keys if history else checkpoint_keys
            if size == 1:  # entries of one page: no slice made
                for key in group_keys:
                    page = pages[at]
                    published[key] = (page,)
                    page_key[page] = key
                    at += 1
            elif size == 2:  # two pages (V4's sliding-window checkpoints): no slice either
                for key in group_keys:
                    page, other = pages[at], pages[at + 1]
                    published[key] = (page, other)
                    page_key[page] = page_key[other] = key
                    at += 2
            else:
                for key in group_keys:
                    published[key] = entry = tuple(pages[at:at + size])
                    for page in entry:
                        page_key[page] = key
                    at += size
            stats.stored_entries += len(group_keys)

    def _book(self, req: CommittingRequest, booked: tuple, low: int, events: list[tuple],
              let_go: list[tuple]) -> None:
        """What one commit at a time books of a request's commit claimed whole (``booked``; its entries recorded in the
        groups' pools): its "stored" events (history group by group, then checkpoint by checkpoint every state group's),
        the state groups' holds of its latest checkpoint, tier link (in one call, in its events' order: :meth:`_raws`;
        the checkpoints before the latest low priority where ``low`` is 2), checkpoint values, one
        ``ValueEviction.stored_commit``, then its earlier checkpoints superseded."""
        keys, parents, ends, checkpoint_keys, _, boundaries = booked
        events.append(booked)  # its "stored" events, expanded when drained (``_raws``)
        key = checkpoint_keys[-1]
        own = _new_object(OwnCheckpoint)  # its fields stored directly (no ``__init__`` frame)
        own.boundary_tokens, own.pinned, own.entries = boundaries[-1], False, {}
        for gid, holders, published in self._unit_holders:  # a key no group had: no request holds it yet
            own.entries[gid] = (key, published[key])
            holders[key] = 1
        if self.tier_hook is not None:
            pools, state = self.pools, self._holders  # a state group's: speculative where not ``key``, the latest
            self.tier_hook.stored([(gid, k, end, pools[gid].lookup(k), low == 2 and k != key and gid in state)
                                   for _, gid, k, _, end, _ in self._raws((booked,))])
        if self.values is not None:
            for key, boundary in zip(checkpoint_keys, boundaries):
                self.values.published(key, boundary, speculative=boundary != boundaries[-1])
        self.eviction.stored_commit(keys, parents, ends, checkpoint_keys)
        self._supersede(req, [own], events, let_go)

    def _commit_one(self, req: CommittingRequest, old_tokens: int, new_tokens: int, stored: list[tuple],
                    let_go: list[tuple]) -> None:
        """One request's commit of tokens ``[old, new)`` (a block crossed at least): history blocks and the checkpoints
        (with state groups: the speculative boundaries, crossed, not pinned, kept by the policy, then the request's own
        ones: the pinned ones crossed, its junction and multiples of ``state_checkpoint_interval``, then the latest;
        ``pins``: for each whether the request pins it, None for a speculative one; their keys, parents and entries:
        :meth:`_found_checkpoints`), those missing read and claimed in one call (``CommitPages.read``); its "stored"
        events, then the removals superseding caused, onto ``stored``; what superseding lets go onto ``let_go`` (the
        earlier requests' let go first)."""
        g, hashes = self.granularity_tokens, req.hashes
        if let_go:
            self._let_go(let_go)
        first_block, end_block = old_tokens // g, new_tokens // g
        interval, keep, latest = self.state_checkpoint_interval, req.keep_boundaries, end_block * g
        speculative, own, pins = [], [], []
        keeps = None if self.checkpoint_policy == "terminal-and-junctions" else self.policy.speculative
        for d in range((first_block + 1) * g, latest + 1, g) if self.state_ids else ():  # crossed, then the latest
            if d in keep or (interval is not None and d % interval == 0):
                own.append(d), pins.append(True)
            elif d == latest:
                own.append(d), pins.append(False)
            elif keeps is not None and keeps(d, req.prompt_tokens):
                speculative.append(d)
        boundaries, pins = speculative + own, [None] * len(speculative) + pins
        keys, want = hashes.hashes[first_block:end_block], []
        for lookup in self._history_lookups:  # plain loops, no comprehension: each is a frame, costly run cold
            for key in keys:
                want.append(lookup(key) is None)
        checkpoint_keys, parents, found = self._found_checkpoints(hashes, boundaries, pins, want)
        pages, status = self._reader.read(req.row, first_block, end_block, boundaries, want)
        at = self._publish_blocks(hashes, first_block, keys, pages, status, stored)
        status = status[len(keys) * len(self.history_ids):]
        entries = self._publish_checkpoints(checkpoint_keys, parents, boundaries, pages[at:], status, found, stored)
        new_own = self._book_checkpoints(checkpoint_keys, parents, boundaries, pins, entries, status)
        if self.state_ids:
            self._supersede(req, new_own, stored, let_go)

    def _found_checkpoints(self, hashes: RequestHashes, boundaries: list[int], pins: list[bool | None],
                           want: list) -> tuple[list, list, list]:
        """Each checkpoint's key and parent key (``hashes``' at each of ``boundaries``) and its entry in each state
        group (None: not published), boundary by boundary; onto ``want`` (``CommitPages.read``'s, the blocks' part)
        whether to claim each: where it is missing (and its window live: the claim checks), low priority for a
        speculative one (``pins`` None: unheld; with ``"prefill-per-byte"`` low while that class rates low)."""
        n_speculative = pins.count(None)
        low = 2 if n_speculative and (self.values is None or self.values.low_priority(SPECULATIVE)) else 1
        g, hh, root, lookups = self.granularity_tokens, hashes.hashes, hashes.root, self._state_lookups
        checkpoint_keys, parents = [], []
        for d in boundaries:  # plain loops, no comprehension: each is a frame, costly cold
            checkpoint_keys.append(hh[d // g - 1]), parents.append(hh[d // g - 2] if d >= 2 * g else root)
        found = []
        for key, pinned in zip(checkpoint_keys, pins):
            code = low if pinned is None else 1
            for lookup in lookups:
                entry = lookup(key)
                found.append(entry)
                want.append(code if entry is None else 0)
        return checkpoint_keys, parents, found

    def _publish_blocks(self, hashes: RequestHashes, first_block: int, keys: list[int], pages: list[int],
                        status: list[int], stored: list[tuple]) -> int:
        """Every history group's blocks ``keys`` (from ``first_block``) that the commit claimed (``pages``,
        ``status``: ``CommitPages.read``'s, history groups first), recorded with one ``PageSpace.adopt`` call and
        booked in one ``ValueEviction.stored_blocks`` call for all groups (tier link, stats; ``stored`` takes their
        events, group by group, zipped in C from the keys); how many of ``pages`` were the history groups'."""
        g, hook, n_blocks, hh = self.granularity_tokens, self.tier_hook, len(keys), hashes.hashes
        parents = hh[first_block - 1:first_block - 1 + n_blocks] if first_block else [hashes.root, *keys[:-1]]
        ends = range((first_block + 1) * g, (first_block + n_blocks + 1) * g, g)
        claims, at, e, adopted = [], 0, 0, ([], [], [])  # adopted: (pools, keys, entries)
        for gid, pool, per_block, stats in self._history_groups:
            entries = list(zip(*[iter(pages[at:at + n_blocks * per_block])] * per_block))  # each block's pages
            at, e = at + n_blocks * per_block, e + n_blocks
            done = [i for i, st in enumerate(status[e - n_blocks:e]) if st == 2]  # the blocks it claimed
            if not done:
                continue
            columns = (entries, keys, parents, ends)  # cut to them where it did not claim all
            entries, done_keys, done_parents, done_ends = columns if len(done) == n_blocks else (
                [xs[i] for i in done] for xs in columns)
            adopted[0].append(pool), adopted[1].append(done_keys), adopted[2].append(entries)
            stored += zip(repeat("stored"), repeat(gid), done_keys, done_parents, done_ends, repeat(per_block))
            if hook is not None:  # the group's blocks in one call
                hook.stored(zip(repeat(gid), done_keys, done_ends, entries, repeat(False)))
            stats.stored_entries += len(done)
            claims.append((gid, done))
        self._space.adopt(*adopted)
        if claims:
            self.eviction.stored_blocks(claims, keys, parents, ends)
        return at

    def _publish_checkpoints(self, keys: list[int], parents: list[int], boundaries: list[int], state: list[int],
                             status: list[int], found: list, stored: list[tuple]) -> list:
        """The checkpoints at ``boundaries`` (``keys``, ``parents``) the commit claimed (``state``, ``status``:
        ``CommitPages.read``'s state part, boundary by boundary, state group by state group), recorded with one
        ``PageSpace.adopt`` call for all groups (stats); ``stored`` takes their events, boundary by boundary, group
        by group. Each boundary's entry in each state group, new or ``found`` (None where missing), in that order."""
        n, places, entries = len(self.state_ids), self._window_places, found  # ``found`` becomes them
        adopted = ([], [], [])  # one ``PageSpace.adopt`` call's pools, keys and entries
        for s, (gid, pool, _, _, stats) in enumerate(self._state_groups):
            windows = list(zip(*map(state.__getitem__, places[s])))  # each boundary's pages
            done = [j for j, st in enumerate(status[s::n]) if st == 2]
            if not done:
                continue  # present, borrowed pages or slid out
            windows = [windows[j] for j in done]
            for j, window in zip(done, windows):
                entries[j * n + s] = window
            adopted[0].append(pool), adopted[1].append([keys[j] for j in done]), adopted[2].append(windows)
            stats.stored_entries += len(windows)
        self._space.adopt(*adopted)
        for place, new in enumerate(status):
            if new == 2:
                j, (gid, per_entry) = place // n, self._checkpoint_events[place % n]
                stored.append(("stored", gid, keys[j], parents[j], boundaries[j], per_entry))
        return entries

    def _book_checkpoints(self, keys: list[int], parents: list[int], boundaries: list[int], pins: list[bool | None],
                          entries: list, status: list[int]) -> list[OwnCheckpoint]:
        """Book each checkpoint the commit published (``status`` 2; ``entries``: each boundary's pages in each state
        group, None where missing): tier link (:meth:`_tell_checkpoints`), then boundary by boundary the checkpoint
        values and ``ValueEviction.stored_checkpoint``; the request's own ones (``pins`` not None, after the
        speculative ones) returned, each held in every state group that has it."""
        gids, n, values = self.state_ids, len(self.state_ids), self.values
        if self.tier_hook is not None:
            self._tell_checkpoints(keys, boundaries, pins, entries, status)
        own_checkpoints = []
        for j in range(pins.count(None), len(pins)):  # the request's own ones (the speculative ones first)
            key, own = keys[j], OwnCheckpoint(boundaries[j], pins[j])
            for (gid, held), entry in zip(self._hit_holders, entries[j * n:(j + 1) * n]):
                if entry is not None:
                    own.entries[gid] = (key, entry)
                    held[key] = held.get(key, 0) + 1
            if own.entries:
                own_checkpoints.append(own)
        for j, (key, parent, boundary) in enumerate(zip(keys, parents, boundaries)):
            part = status[j * n:(j + 1) * n]
            if 2 in part:
                if values is not None:
                    values.published(key, boundary, speculative=pins[j] is None)
                self.eviction.stored_checkpoint([gid for gid, new in zip(gids, part) if new == 2], key, parent,
                                                boundary)
        return own_checkpoints

    def _tell_checkpoints(self, keys: list[int], boundaries: list[int], pins: list[bool | None], entries: list,
                          status: list[int]) -> None:
        """The tier link of each checkpoint entry the commit published (``status`` 2), in one call, boundary
        by boundary, state group by state group (a speculative one's low priority as claimed)."""
        values, gids, n = self.values, self.state_ids, len(self.state_ids)
        low = values is None or values.low_priority(SPECULATIVE) if None in pins else False
        self.tier_hook.stored([(gids[place % n], keys[place // n], boundaries[place // n], entries[place],
                                low and pins[place // n] is None) for place, new in enumerate(status) if new == 2])

    def _supersede(self, req: CommittingRequest, new_own: list, events: list[tuple], let_go: list[tuple]) -> None:
        """Drop the request's hold on every earlier own checkpoint that is not pinned, group by group (``new_own``
        become its own checkpoints); where it was the last: kept by value ("prefill-per-byte"), demoted (a speculative
        boundary: kept like the ones the policy publishes, low priority) or unpublished with the rest of its unit from
        the other state groups (as ``ValueEviction.removed`` would take it: its entries popped), booked at once; its
        entries go onto ``let_go``, listed for ``PageSpace.demote`` or ``PageSpace.drop_listed``, and its pages leave
        their lists at the commit's end (``_let_go``): the same removals, events (onto ``events``) and order as one at a
        time. One function, plain loops: cheaper run cold."""
        pinned, books, values = [], self._supersede_books, self.values
        for prev in req.own_checkpoints:
            if prev.pinned:
                pinned.append(prev)
                continue
            # Kept low where its last hold goes: a boundary the policy keeps (asked once, not a group).
            demote, demoted = values is None and self.policy.speculative(prev.boundary_tokens, req.prompt_tokens), []
            for gid, (key, pages) in prev.entries.items():
                lookup, holders, slot = books[gid]
                if lookup(key) is not pages:
                    continue  # evicted meanwhile, its hold gone (re-stored: another tuple, maybe equal)
                left = holders.pop(key, 1) - 1
                if left:
                    holders[key] = left
                elif values is not None and self._kept_by_value(key, prev.boundary_tokens, req):
                    continue  # its priority and place: rank_checkpoints
                elif demote:  # its entry listed (group, page count, pages)
                    demoted += (slot, len(pages), *pages)
                else:  # its entries popped; their pages leave their lists with the commit's others (``_let_go``)
                    gids, listed = [], []
                    let_go.append((True, listed))
                    for pop, group, other in self._unit_pops[gid]:  # a plain loop: cheaper run cold
                        popped = pop(key, None)
                        if popped is not None:
                            listed += (group, len(popped), *popped)
                            gids.append(other)
                    self._dropping = True  # its node first (as an eviction books it), then its removals
                    events += self._book_removals((key,), (gids,), (self.eviction.unit_left(key, len(gids)),))
                    self._dropping = False
                    if self.eviction.acts:
                        break  # the unit left every state group
            if demoted:  # every group's at once, with the commit's others (``_let_go``)
                let_go.append((False, demoted))
        req.own_checkpoints = pinned + new_own if pinned else new_own

    def _let_go(self, let_go: list[tuple]) -> None:
        """What superseding let go (each (True, the entries of a unit popped) or (False, the entries of a demoted
        unit), listed), then cleared: the pages of the unpublished units leave their lists in one
        ``PageSpace.drop_listed`` call, the last unit listed first (as ``PageSpace.drop_units``: as one unit after
        another), then the demoted units in one ``PageSpace.demote`` call (different pages, in the order given)."""
        dropped, demoted = [], []
        for unpublished, listed in let_go:
            if unpublished:
                dropped[:0] = listed
            else:
                demoted += listed
        if dropped:
            self._space.drop_listed(dropped)
        if demoted:
            self._space.demote(demoted)
        let_go.clear()

    def _kept_by_value(self, key: int, boundary_tokens: int, req: CommittingRequest) -> bool:
        """"prefill-per-byte": a superseded checkpoint stays if the policy's placement
        keeps its boundary or it produced a hit at a branch (class ``reused``)."""
        kept = self.policy.speculative(boundary_tokens, req.prompt_tokens) or self.values.kind(key) == REUSED
        self.values.superseded(key, kept)
        return kept

    def load_kernels(self) -> None:
        """Load (or compile) now the commit's kernels, reading nothing (``lru.borrow_row`` loads at the first hit)."""
        self._reader.read(0, 0, 0, [])
        self._reader.read_unit((1, 0, 0, 0, 0, 0, 0, 0))

    def forget_request(self, req: CommittingRequest) -> None:
        """A freed request's checkpoints stay cached; with ``"prefill-per-byte"`` they are then ranked again (only
        then does ``CacheManager.free`` call it: else it changes nothing the cache reads)."""
        req.own_checkpoints = []
        if self.values is not None:
            self.values.request_freed()
            if self._order is not None:
                self._order.request_freed()
            elif self.eviction.acts:  # "group-lru": no order, each pool by its own LRU
                self.rank_checkpoints()

    def check_holds(self, live: Sequence[CommittingRequest]) -> None:
        """Assert that every hold is on a cached entry, with at least the holds of the ``live`` requests keeping
        it (the rest: freed requests' terminals)."""
        kept = Counter((gid, key) for req in live for own in req.own_checkpoints  # the entries not evicted since
                       for gid, (key, pages) in own.entries.items() if self.pools[gid].lookup(key) is pages)
        for gid, holders in self._holders.items():
            assert all(self.pools[gid].lookup(key) is not None for key in holders), f"{gid}: a hold on no entry"
            assert min(holders.values(), default=1) >= 1, f"{gid}: an empty hold"
        for (gid, key), n in kept.items():
            assert self._holders[gid].get(key, 0) >= n, f"{gid}: {n} requests keep an entry with fewer holds"

    def use_full_sort_ranking(self) -> None:
        """``"prefill-per-byte"``: rank by :meth:`rank_checkpoints`' full sort (the reference) instead of
        ``CheckpointOrder``. Only before anything is cached; ValueError otherwise."""
        if self.values is None or any(pool.num_cached_pages for pool in self.pools.values()):
            raise ValueError("use_full_sort_ranking needs checkpoint_policy='prefill-per-byte' and an empty cache")
        for gid in self.state_ids:
            self.pools[gid].ranker = None
        self._order = None
        self.eviction.on_mended = None

    def rank_checkpoints(self) -> list[int]:
        """``"prefill-per-byte"``, the full-sort reference: low-priority classes' checkpoints to the front of
        each state pool's LRU (lowest score first), the others (but those beyond a gap) normal priority in
        ``CheckpointValues.eviction_order``. Returns that order ([] for other policies)."""
        if self.values is None or not self.state_ids:
            return []
        values = self.values
        order = values.eviction_order(self.pools[self.state_ids[0]].entry_keys())
        kinds = {kind: values.low_priority(kind) for kind in (SPECULATIVE, OWN, REUSED)}
        demoted = [key for key in order if kinds[values.kind(key)]]
        kept = order[len(demoted):]  # eviction_order puts the low-priority classes first
        for gid in self.state_ids:
            pool = self.pools[gid]
            low = pool.low_priority
            for key in reversed(demoted):  # each to the front: the lowest score ends first
                pages = pool.lookup(key)
                if pages is not None and not low[pages[0]]:
                    pool.demote(key)
            for key in kept:  # each to the back: the highest score ends last
                pages = pool.lookup(key)
                if pages is not None and not low[pages[0]]:
                    pool.touch(key)
                elif pages is not None and not self.eviction.beyond_gap(key):  # held low until its block is back
                    pool.promote(key)
        return order

    def clear(self) -> None:
        self._evicted_checkpoints.clear()  # what the thrash guard remembers goes with the entries
        self._moved_past.clear()
        self._dropping = True
        for pool in self.pools.values():
            for key in pool.entry_keys():  # held pages stay held
                pool.unpublish(key)
        self._dropping = False

    def value_report(self) -> dict[str, GroupValueStats]:
        """Per group: cached pages and entries, usable entries, evicted pages by reason
        (:class:`hybridkv.prefix.eviction.GroupValueStats`)."""
        return self.eviction.report()

    # --- events ---------------------------------------------------------------
    def _removed(self, gid: str, key: int, cause: str, idle_pages: int) -> None:
        """Group ``gid``'s pool's ``on_removed``: the removal booked, its event emitted, the eviction policy told."""
        self._emit_many(self._book_removals((key,), ((gid,),)))
        if cause != UNPUBLISHED and self.thrash_guard and self._guarding and gid in self._holders:
            self._note_evicted((key,))
        self.eviction.removed(gid, key, cause, idle_pages)

    def _evict_many(self, gid: str, keys: Sequence[int], cause: str) -> int:
        """State group ``gid``'s pool's ``evict_many`` (a history group's ``evict_batch``): entries evicted (or revoked)
        there, with the rest of their units (the value policy's) from the other groups ("unit"), in one
        ``PageSpace.drop_units``; then in the order
        one at a time gives, each key's ``ValueEviction.unit_evicted``, and their removals booked
        (:meth:`_book_removals`, events in one call). The idle pages freed in ``gid``."""
        eviction, pools = self.eviction, self._unit_pools[gid]
        left, idle, removals = self._space.drop_units(self._unit_pops[gid], keys, cause)  # first entry: ``gid``'s
        evicted = eviction.evicted_pages
        for pool, idle_pages in zip(pools, idle):
            pool.counters.evicted_pages += idle_pages
            if pool.group_id != gid:
                evicted[pool.group_id]["unit"] += idle_pages
        origins = [eviction.unit_evicted(gid, key, told_cause, freed, len(gids))
                   for (key, told_cause, freed), gids in zip(removals, left)]
        if self.thrash_guard and self._guarding:  # the checkpoints among the units
            state = self._holders
            self._note_evicted(removal[0] for removal, gids in zip(removals, left) if any(g in state for g in gids))
        self._emit_many(self._book_removals([removal[0] for removal in removals], left, origins))
        return idle[0]

    def _book_removals(self, keys: Sequence[int], left: Sequence[Sequence[str]],
                       origins: Sequence[tuple] | None = None) -> list[tuple]:
        """The entries under ``keys[i]`` left the groups ``left[i]`` (one unit's), in that
        order: forget their metadata and holders, tell the checkpoint values (once a key) and
        the tier hook; their "removed" events (raw). A key's origin (``origins[i]`` where
        given, as ``ValueEviction.origin`` told it) is read once: one record per key, every group's."""
        books, hook, values, raws = self._books, self.tier_hook, self.values, []
        for key, gids, (parent, boundary) in zip(keys, left, origins or map(self.eviction.origin, keys)):
            told = values is None
            for gid in gids:
                holders, stats, pages = books[gid]
                if holders is not None:  # a state group storing checkpoints
                    holders.pop(key, None)
                    if not told:  # a key's value record is every state group's: forgotten at the first
                        values.removed(key)
                        told = True
                stats.removed_entries += 1
                raws.append(("removed", gid, key, parent, boundary, pages if boundary else 0))
        if hook is not None:  # every removal in one call
            hook.removed([raw[1:3] for raw in raws], self._dropping)
        return raws

    def _emit_many(self, items: Sequence[tuple]) -> None:
        """Events, in order (raw tuples, or a commit's record, as :meth:`_raws` reads them): to ``on_event``, or to
        the buffer as they are (expanded, the hex keys formatted, when drained), the oldest events dropped (and
        counted) past ``max_buffered_events`` (a record cut short stays whole, its first events not drained)."""
        if self._on_event is not None:
            for raw in self._raws(items):
                self._on_event(_event(raw))
            return
        n, n_history, n_state = 0, len(self._history_events), len(self._checkpoint_events)
        for item in items:  # ``_events_in`` of each, written out (a frame each, costly run cold)
            n += 1 if item[0].__class__ is str else len(item[0]) * n_history + len(item[3]) * n_state
        events = self.events
        events.extend(items)
        self._buffered += n
        if self._buffered <= self._max_buffered:
            return
        excess = self._buffered - self._max_buffered  # the oldest events dropped and counted
        self._buffered -= excess
        self.dropped_events += excess
        excess += self._front_dropped  # the first item's dropped before: it leaves whole or stays cut short
        while excess:
            size = _events_in(events[0], n_history, n_state)
            if size > excess:
                break
            events.popleft()
            excess -= size
        self._front_dropped = excess

    def _raws(self, items: Sequence[tuple]) -> Iterator[tuple]:
        """The raw events of ``items`` in order: a raw event (kind, group, key, parent, tokens, pages) as it is; a
        commit's record (``_book``'s ``booked``: its blocks' keys, parents and ends, its checkpoints' keys,
        parents and boundaries) its "stored" events: its blocks history group by group, then its checkpoints
        boundary by boundary, state group by state group."""
        for item in items:
            if item[0].__class__ is str:
                yield item
                continue
            keys, parents, ends, checkpoint_keys, checkpoint_parents, boundaries = item
            for gid, size in self._history_events:
                for key, parent, end in zip(keys, parents, ends):
                    yield "stored", gid, key, parent, end, size
            for key, parent, boundary in zip(checkpoint_keys, checkpoint_parents, boundaries):
                for gid, size in self._checkpoint_events:
                    yield "stored", gid, key, parent, boundary, size

    @property
    def on_event(self) -> Callable[[CacheEvent], None] | None:
        """Called with each :class:`CacheEvent` as it happens, inside the step (None: events are buffered for
        :meth:`drain_events`). Set it to a callable or None."""
        return self._on_event

    @on_event.setter
    def on_event(self, callback: Callable[[CacheEvent], None] | None) -> None:
        if callback is not None and not callable(callback):  # it is called inside a step
            raise ValueError(f"on_event must be callable (it gets each CacheEvent), got {type(callback).__name__}")
        self._on_event = callback

    @property
    def max_buffered_events(self) -> int:
        """Events kept for :meth:`drain_events` without ``on_event``; past it the oldest are dropped (counted in
        ``dropped_events``) at the next event. Set it to any int >= 0."""
        return self._max_buffered

    @max_buffered_events.setter
    def max_buffered_events(self, bound: int) -> None:
        self._max_buffered = as_int("max_buffered_events", bound, minimum=0)

    def drain_events(self) -> list[CacheEvent]:
        out = [_event(raw) for raw in islice(self._raws(self.events), self._front_dropped, None)]
        self.events.clear()
        self._buffered = self._front_dropped = 0
        return out

    def write_events_jsonl(self, stream: IO[str]) -> int:
        """Write (and drain) recorded events as JSON lines; returns how many."""
        events = self.drain_events()
        stream.writelines(e.to_json() + "\n" for e in events)
        return len(events)


def _checkpoint_windows(specs: Sequence[CacheGroupSpec], overrides: Mapping[str, int] | None) -> dict[str, int]:
    """Per sliding group, the trailing tokens a checkpoint stores (the spec's, default the whole window, or
    ``overrides``')."""
    windows = {s.group_id: s.sliding_window_tokens if s.checkpoint_window_tokens is None else s.checkpoint_window_tokens
               for s in specs if s.is_sliding}
    for gid, n in (overrides or {}).items():
        if gid not in windows:
            raise ValueError(f"checkpoint_window_tokens: {gid!r} is not a sliding group")
        n = as_int(f"checkpoint_window_tokens[{gid!r}]", n, minimum=0)
        limit = next(s.sliding_window_tokens for s in specs if s.group_id == gid)
        if n > limit:
            raise ValueError(f"checkpoint_window_tokens[{gid!r}] = {n} exceeds the group's window ({limit} tokens)")
        windows[gid] = n
    return windows


def _grain(specs: Sequence[CacheGroupSpec], windows: Mapping[str, int], granularity_tokens: int | None) -> int:
    """The prefix grain: given, or the LCM of the history groups' (else every group's) page spans; checked."""
    history = [s for s in specs if not s.is_sliding]
    default = reduce(lcm, [s.page_tokens for s in (history or specs)], 1)
    g = default if granularity_tokens is None else as_int("prefix_granularity", granularity_tokens)
    if g <= 0:
        raise ValueError(f"prefix_granularity must be positive, got {granularity_tokens!r}")
    for s in specs:
        if g % s.page_tokens:
            raise ValueError(f"prefix_granularity {g} must be a multiple of group {s.group_id!r} page tokens "
                             f"({s.page_tokens}); the smallest valid grain here is "
                             f"{reduce(lcm, [x.page_tokens for x in specs], 1)}")
        if s.is_sliding and windows[s.group_id] > g:
            raise ValueError(f"prefix_granularity {g} is smaller than group {s.group_id!r} checkpoint window "
                             f"({windows[s.group_id]} tokens): checkpoints would overlap")
    return g


def _events_in(item: tuple, n_history: int, n_state: int) -> int:
    """How many events a buffered item stands for: 1 (a raw event), or a commit's record's (``_raws``: a block in
    each of ``n_history`` history groups, a checkpoint in each of ``n_state`` state groups)."""
    return 1 if item[0].__class__ is str else len(item[0]) * n_history + len(item[3]) * n_state


def _event(raw: tuple) -> CacheEvent:
    kind, gid, key, parent, boundary, num_pages = raw
    return CacheEvent(kind, gid, None if key is None else f"{key:032x}", None if parent is None else f"{parent:032x}",
                      boundary, num_pages)
