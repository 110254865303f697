"""The runtime cache manager: the one object an engine calls every step.

Flow of one step: ``check_admission`` (pure) -> ``schedule`` (commit the previous step's tokens to the prefix cache,
release slid-out pages, allocate, build the kernel arrays) -> the engine runs the step -> optionally ``rewind``
(speculative tokens rejected) -> next step. ``free`` ends a request.

Every public method validates its whole input before it mutates anything.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Any

import numpy as np

from hybridkv._checks import (as_int, check_cache_salt, check_empty_token_batch, check_items, check_request_ids,
                              check_token_ids)
from hybridkv.memory.arena import Arena, ArenaGeometry, IdleScan, shared_arena_for
from hybridkv.memory.geometry import check_page_space
from hybridkv.runtime.batch import Admission, GroupStats, GroupStep, StepBatch, TableUpdates
from hybridkv.memory.pool import PagePool, PageSpace
from hybridkv.prefix.cache import PrefixCache, PrefixHit, RequestHashes
from hybridkv.runtime import kernels
from hybridkv.spec import CacheGroupSpec
from hybridkv.tables.store import TableSet, cdiv


__all__ = ["Admission", "CacheManager", "CacheManagerError", "GroupStats", "GroupStep", "PrefixHit", "PreparedPrompt",
           "StepBatch", "TableUpdates"]

_BLOCK_TABLE_MODES = ("full", "updates")
# Reasons that say the call itself is wrong (a malformed item, an unknown or repeated id): a refusal lists them first.
_CALL_ERRORS = ("each item must be", "unknown request", "appears twice")


class CacheManagerError(ValueError):
    """A misuse of the manager (unknown id, inadmissible step, bad count...). State is unchanged."""


@dataclass(slots=True)  # compact: a request's fields are read cold, as it joins and finishes
class _Request:
    request_id: str
    row: int
    prompt_tokens: int
    max_total_tokens: int
    token_ids: np.ndarray | None  # its known ids: the first ``CacheManager._known[row]``
    hashes: RequestHashes | None = None
    own_checkpoints: list = field(default_factory=list)
    keep_boundaries: frozenset = frozenset()
    thrash_hit_tokens: int = -1  # the prefix cache's thrash guard (``PrefixCache.match_and_borrow`` sets it)
    hit_checkpoints: list = field(default_factory=list)  # its hit's checkpoint (``PrefixCache.match_and_borrow``)


class PreparedPrompt:
    """A prompt checked, copied and (with prefix caching) hashed by ``CacheManager.prepare_prompt`` when the
    request arrives, off the step's path; ``add_request`` of the same manager takes it, and again once the request it
    made is freed (a request refused admission, or preempted to be recomputed from this prompt): hashed once."""

    __slots__ = ("prompt_tokens", "total_tokens", "cache_salt", "_manager", "_request", "_prompt", "_address")

    def __init__(self, manager: CacheManager, request: _Request, cache_salt: str | bytes | None, address: int):
        self.prompt_tokens, self.total_tokens, self.cache_salt = request.prompt_tokens, request.max_total_tokens, \
            cache_salt
        # The request made here, named and given a row when added; once named, a later add makes a fresh one of it.
        self._manager, self._request = manager, request
        # Made here, off the adding step: the prompt's view; the buffer's address (``_prompt_buffer``'s: no ``ctypes``).
        self._prompt, self._address = request.token_ids[: request.prompt_tokens], address


@dataclass
class _StepPlan:
    """One admissible step as ``kernels.prepare_step`` plans it (pure): the rows it
    touches, the settling ones first (zero new tokens), and what it does to them."""

    rows: np.ndarray  # int64 [R] table rows
    counts: np.ndarray  # int64 [R] new tokens
    first: np.ndarray  # int64 [R] computed tokens before the step
    after: np.ndarray  # int64 [2, G, R] base and hi pages after the step
    need: np.ndarray  # int64 [G, R] pages holding the rows' tokens after the step
    sums: np.ndarray  # int64 [2, G] pages released and allocated per group
    crossing: np.ndarray  # rows whose uncommitted tokens complete a prefix grain (commit first)
    settle: int  # leading rows that only settle (previous step's requests not in this one)
    clean: bool  # every group's free stack covers its allocations: no credit, slab or eviction
    totals: tuple[int, int, int, int]  # tokens, pages released, most released in one group, pages allocated
    request_ids: tuple | None = None  # the batch's ids in order, once known
    grants: list | None = None  # arena slabs to move before allocating (shared page space)
    spare_grants: np.ndarray | None = None  # or spare slabs alone, as ``kernels.grant_step`` grants them


_INT32, _INT64 = np.dtype(np.int32), np.dtype(np.int64)
_new_object, _pack_into = object.__new__, struct.pack_into


_PACK_FROM = 64  # ``_int64_array`` packs this many ints or more


def _int64_array(values: tuple, n: int) -> np.ndarray:
    """A fresh int64 ``[n]`` of ``n`` ints (each in range): ``np.fromiter`` for a few, else one
    ``struct.pack_into`` of them all (about half ``fromiter``'s time from ``_PACK_FROM`` on)."""
    if n < _PACK_FROM:
        return np.fromiter(values, _INT64, n)
    out = np.empty(n, _INT64)
    _pack_into(f"{n}q", out, 0, *values)
    return out


_NO_CELLS = np.empty((3, 0), dtype=np.int64), np.empty(0, dtype=np.int32)  # ``kernels.finish_step`` reads no cells
_COMPUTED = np.empty(0, dtype=np.int64)  # ``prepare_step``'s load_tokens of a step that computes
_NEVER = 1 << 62  # ``kernels.DEFER_FROM`` of a row that holds no checkpoint (no token ids: it publishes nothing)


class _Scratch:
    """``run_step``'s working buffers, kept between steps and grown as steps need."""

    def __init__(self, n_groups: int):
        self.n_groups, self.buffer, self.plan_rows = n_groups, None, 0
        self._grow(0, 0, 0)
        self.marks = np.empty(n_groups, dtype=np.int64)  # ``room_groups``' marks (``grant_step``'s too)

    def plan_arrays(self, n_rows: int) -> tuple:
        """``prepare_step``'s outputs (``kernels.plan_views``) with room for more than ``n_rows`` rows; each plan
        overwrites the last (so ``after[:, :, :n]`` is never contiguous: one argument type for the kernels)."""
        if n_rows >= self.plan_rows:
            self._grow(2 * n_rows + 1, self.pages.size, self.idle_keyed.size)
        return self.plan

    def _grow(self, n_rows: int, n_pages: int, n_keyed: int) -> None:
        """A new buffer with that much room; views made before stay valid, and with as many rows the plan
        moves over (``reserve``: the kernels read the plan from ``buffer``)."""
        old, sizes = self.buffer, (n_rows, n_pages, n_keyed)
        self.buffer = np.empty(kernels.plan_size(n_rows, self.n_groups, n_pages, n_keyed), dtype=np.int64)
        if old is not None and n_rows == self.plan_rows:
            end = kernels.plan_size(n_rows, self.n_groups, 0, 0)
            self.buffer[:end] = old[:end]
        self.plan_rows = n_rows
        self.buffer[:3] = sizes
        views = kernels.plan_views(self.buffer, self.n_groups)
        self.plan, (self.released, self.widths, self.pages, self.idle_keyed) = views[:8], views[8:]

    def reserve(self, most_released: int, released_pages: int) -> None:
        """Grow the release scratch and idle keyed pages where a run needs more."""
        sizes = (self.pages.size, self.idle_keyed.size)
        if most_released > sizes[0] or released_pages > sizes[1]:
            wanted = (most_released, released_pages)
            self._grow(self.plan_rows, *(2 * w if w > n else n for w, n in zip(wanted, sizes)))


@dataclass
class _Verdict:
    """What admission decided for a batch (pure); ``plan`` is None when no item is valid."""

    answers: list  # Admission for each invalid item, None for the valid ones
    ok_idx: Sequence[int]
    fits: np.ndarray
    deny: dict[int, str]
    plan: _StepPlan | None


class _Releases:
    """What a planned step's releases free in each group, worked out once per group asked (pure)."""

    def __init__(self, tableset: TableSet, space: PageSpace, counters: np.ndarray, plan: _StepPlan):
        self._tableset, self._space, self._counters, self.plan = tableset, space, counters, plan
        self._found: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def of(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Group ``k``: per plan row its release credit (pages below its new base only it holds, and those of
        a checkpoint it lets go), those pages, and the ones among them without a key (``kernels.release_credit``)."""
        found = self._found.get(k)
        if found is None:
            plan, ts = self.plan, self._tableset
            # Only windowed groups release; a row may also let go of the checkpoint it held.
            n_pages = int(plan.sums[0, k]) + ts.row_held_pages * plan.rows.size
            credit = np.empty(plan.rows.size, dtype=np.int64)
            sole, unkeyed = np.empty(n_pages, dtype=np.int64), np.empty(n_pages, dtype=np.int64)
            n_sole, n_unkeyed = kernels.release_credit(
                ts.geometry, ts.pages, ts.bounds, self._space.ref_counts, self._space.cached, self._counters, k,
                plan.rows, plan.after[0, k], credit, sole, unkeyed, 0)
            found = self._found[k] = (credit, sole[:n_sole], unkeyed[:n_unkeyed])
        return found

    def credit(self) -> np.ndarray:
        """Every group's release credit per plan row (``[G, R]``; none where a group releases nothing and holds no
        checkpoint)."""
        plan = self.plan
        credit = np.zeros((plan.sums.shape[1], plan.rows.size), dtype=np.int64)
        for k in np.flatnonzero(plan.sums[0] + self._tableset.geometry[:, kernels.HOLD_TOKENS]).tolist():
            credit[k] = self.of(k)[0]
        return credit


_ADMITTED = Admission(True)  # (frozen: every admitted item's answer)
_ANY_IDS = np.zeros(4, dtype=np.int32)[::2]  # a read-only strided view: ``_copy_ids``' type for the ids
_ANY_IDS.flags.writeable = False
_ANY_TOKENS = np.zeros((2, 4), dtype=np.int32)[:, ::2]  # the same for ``_append_ids``' [n, k] ids
_ANY_TOKENS.flags.writeable = False


class CacheManager:
    """Pages, tables and slots for every request and every cache group."""

    def __init__(self, specs: Sequence[CacheGroupSpec], group_pages: Mapping[str, int] | None, *,
                 max_context_tokens: int, max_step_tokens: int | None = None,
                 table_widths: Mapping[str, int] | None = None, shuffle_seed: int | None = None,
                 enable_prefix_caching: bool = False, prefix_granularity: int | None = None,
                 hash_algo: str = "xxh3_128", state_checkpoint_interval: int | None = None,
                 prompt_checkpoints: bool | None = None, checkpoint_policy: str | None = None,
                 checkpoint_interval_tokens: int | None = None, on_event: Any = None,
                 arena: ArenaGeometry | None = None, checkpoint_window_tokens: Mapping[str, int] | None = None,
                 eviction_policy: str = "value", tier_link: Any = None):
        self.specs = tuple(specs)
        ids = [s.group_id for s in self.specs]
        group_pages = _pages_per_group(ids, group_pages, arena)
        self.max_context_tokens = as_int("max_context_tokens", max_context_tokens, minimum=1)
        self.max_step_tokens = as_int("max_step_tokens", self.max_context_tokens if max_step_tokens is None
                                      else max_step_tokens, minimum=1)
        self.table_widths = _checked_widths(ids, table_widths)
        self._init_memory(group_pages, shuffle_seed, arena)
        self._capture_widths = None if self.table_widths is None else tuple(
            self.table_widths[s.group_id] for s in self.specs)
        self.tables = {s.group_id: t for s, t in zip(self.specs, self._tableset.tables)}
        self._group_ids = ids
        # Per group: its id, its base pages' row of ``per_request`` (``kernels.batch_arrays_for``; 0: not sliding) and
        # its write slots' row of ``per_token`` (``_build_batch``); and "updates" mode's block tables (None for every
        # group).
        self._batch_rows = tuple((s.group_id, 2 + g if s.is_sliding else 0, 1 + g) for g, s in enumerate(self.specs))
        self._no_tables = (None,) * len(self.specs)
        self._init_registry()
        self.prefix: PrefixCache | None = None
        if enable_prefix_caching:
            self.prefix = PrefixCache(
                self.specs, self.pools, self.tables, granularity_tokens=prefix_granularity, hash_algo=hash_algo,
                state_checkpoint_interval=state_checkpoint_interval, prompt_checkpoints=prompt_checkpoints,
                checkpoint_policy=checkpoint_policy, checkpoint_interval_tokens=checkpoint_interval_tokens,
                on_event=on_event, checkpoint_window_tokens=checkpoint_window_tokens, eviction_policy=eviction_policy)
        self._init_windows(ids)
        self._init_holds()
        self._init_checkpoint_holds(state_checkpoint_interval)
        self._load_kernels()
        self.tier_link = tier_link
        if tier_link is not None:
            tier_link.attach(self)

    def _init_windows(self, ids: list[str]) -> None:
        """The prefix grain, and per group the checkpoint window (tokens; 0: none), a load step's
        ``load_tokens`` and the most pages a checkpoint keeps cached (``kernels.short_pages``)."""
        self._grain = self.prefix.granularity_tokens if self.prefix is not None else 0
        windows = self.prefix.checkpoint_windows if self.prefix is not None else {}
        window_tokens = [windows.get(gid, 0) for gid in ids]
        self._load_tokens = np.asarray(window_tokens, dtype=np.int64)
        self._window_pages = np.asarray([-(-w // s.page_tokens) + 1 if w else 0
                                         for w, s in zip(window_tokens, self.specs)], dtype=np.int64)
        # ``short_pages``' answer, the low-priority pages a roomy arena keeps (none), ``admit_spare``'s scratch too.
        self._spare_rows = np.zeros((4, len(ids)), dtype=np.int64)
        self._short, self._no_low = self._spare_rows[0], self._spare_rows[1]

    def _init_checkpoint_holds(self, pin_interval: int | None) -> None:
        """With prefix caching, a checkpoint a step crosses past its request's prompt is held by the step kernel and
        published with the blocks below it when the request is freed (docs/prefix-caching.md, "Past the prompt"),
        but where a policy keeps checkpoints there (multiples of a pinning interval or of the ``"interval"`` policy's:
        a crossing of one commits at the next step)."""
        prefix = self.prefix
        if prefix is None:
            return
        keep_every = math.gcd(pin_interval or 0, prefix.checkpoint_interval_tokens or 0)
        windows = {self.tables[gid].group_index: n for gid, n in prefix.checkpoint_windows.items()}
        self._tableset.hold_checkpoints(windows, self._grain, keep_every)

    def _init_memory(self, group_pages: dict[str, int], shuffle_seed: int | None,
                     arena: ArenaGeometry | None) -> None:
        """The pools, the page space the kernels own, the arena and the table store."""
        if shuffle_seed is not None:
            shuffle_seed = as_int("shuffle_seed", shuffle_seed, minimum=0)
        self.pools = {s.group_id: PagePool(s.group_id, group_pages[s.group_id],
                                           shuffle_seed=None if shuffle_seed is None else shuffle_seed + i,
                                           granted=arena is None, lowest_first=arena is not None)
                      for i, s in enumerate(self.specs)}
        self._pool_list = [self.pools[s.group_id] for s in self.specs]
        self._space = PageSpace(self._pool_list)
        self.arena = Arena(arena, self.pools) if arena is not None else None
        self._grant_room = None  # ``grant_step``'s scratch (``kernels.grant_scratch``), kept while large enough
        # On an arena, a sliding group's pages released again next step come last (kernels.transient_pages).
        self._transient = np.asarray([arena is not None and s.is_sliding for s in self.specs], dtype=np.bool_)
        self._scratch = _Scratch(len(self.specs))
        self._grant_args = None if arena is None else (*self.arena.grant_args, self._scratch.marks)  # grant_step's
        self._tableset = TableSet(self.specs, max_context_tokens=self.max_context_tokens,
                                  max_step_tokens=self.max_step_tokens, id_offsets=self._space.offsets.tolist())

    def _init_holds(self) -> None:
        """Tier state: requests waiting for a load (admission refuses them), each request's last load
        step (tokens before, after), the requests rewound below one (refused until freed), and pages
        held outside any request (``hold_pages``: one array, a view per group)."""
        self.pending_loads: set[str] = set()
        self._load_spans: dict[str, tuple[int, int]] = {}
        self._rewound_loads: set[str] = set()
        self._held_all = np.zeros(self._space.ref_counts.size, dtype=np.int64)
        self._held_outside = {s.group_id: self._held_all[off : off + self.pools[s.group_id].num_pages]
                              for s, off in zip(self.specs, self._space.offsets.tolist())}
        self._space_limits = np.array([self.pools[s.group_id].num_pages for s in self.specs], dtype=np.int64)

    def _init_registry(self) -> None:
        """No requests yet: the id -> record maps, free table rows, per-row counters."""
        self._version = 0  # bumped by every mutation; keys the admission cache
        self._admitted: tuple | None = None  # (version, items, fixed_width, _Verdict) of the last check
        self._requests: dict[str, _Request] = {}
        self._row_of: dict[str, int] = {}  # request id -> table row (batch validation reads only this)
        # Rows scheduled in the previous step. A row freed since may stay listed (and be reused):
        # until its next step its committed tokens equal its computed ones, so it never settles.
        self._last_rows = np.zeros(0, dtype=np.int64)
        self._state: tuple | None = None  # ``_kernel_state``, until a new table row grows the arrays
        self._spare_entry, self._spare_args = None, ()  # on an arena: ``kernels.step_spare``'s, its last arguments
        self._row_owner: dict[int, _Request] = {}
        self._free_rows: list[int] = []
        self._next_row = 0
        self._row_arrays: list[np.ndarray] = []  # per table row, int64 [1] holding it: a one-row step's rows
        # Per table row, views of one array: computed, committed and known token ids (max total without ids), the tokens
        # past which its step kernels hold checkpoints (its prompt's; ``_NEVER`` without ids) and its published tokens
        # (the step kernels take these five whole, ``_counters``: ``kernels.DEFER_FROM``, ``PUBLISHED``), the max total,
        # the known ids rewinds keep (prompt; no ids: total) and the address of its request's token ids
        # (``_Request.token_ids``' data, which the request keeps alive; 0 without ids or a request:
        # ``kernels.append_token_ids`` writes there).
        self._set_by_row(np.zeros((8, 64), dtype=np.int64))
        self._one_count = np.zeros(1, dtype=np.int64)  # a uniform step's count, for every row (no array made)
        self._one_count_tokens = 0  # ``_one_count[0]`` as a plain int (written only when it changes)
        self._one_row = np.zeros(1, dtype=np.int64)  # the row ``free`` commits (no array made)
        # ``kernels.copy_token_ids``' and ``append_token_ids``' compiled code for any int32 ids (a read-only
        # strided view's type covers every layout): ``_prompt_buffer`` and ``append_token_ids_many`` skip the
        # type dispatch.
        self._copy_ids = kernels.entry_point(kernels.copy_token_ids, (_ANY_IDS, np.empty(0, _INT32)))
        self._append_ids = kernels.entry_point(kernels.append_token_ids, (self._token_addr, self._one_row, self._known,
                                               self._max_total, _ANY_TOKENS, self._in_batch, 0, self._one_row))
        self._completed_rows = np.empty(64, dtype=np.int64)  # the rows an append completed a block of

    def _set_by_row(self, by_row: np.ndarray) -> None:
        """``_by_row`` and its views, and ``prepare_step``'s scratch ``_in_batch`` (one flag per row)."""
        self._by_row, self._counters, self._in_batch = by_row, by_row[:5], np.zeros(by_row.shape[1], dtype=np.bool_)
        (self._computed, self._committed, self._known, self._defer_from, self._published, self._max_total,
         self._known_floor, self._token_addr) = by_row

    @classmethod
    def from_plan(cls, plan: Any, *, page_space: str | None = None, slab_anchor_pages: int | None = None,
                  **options: Any) -> CacheManager:
        """Build from a ``hybridkv.plan.Plan`` (pages per group, limits, capture widths).

        ``page_space`` (default: the plan's own, ``plan.page_space``): ``"shared"``, one arena of the plan's budget
        (its bytes when it has no budget) lent to the groups in slabs (:mod:`hybridkv.memory.arena`);
        ``"per-group"``, one pool per group with the plan's page counts, refused when those exceed the plan's
        budget (``plan.fits_per_group``)."""
        page_space = check_page_space(plan.page_space if page_space is None else page_space)
        if page_space == "per-group" and slab_anchor_pages is not None:
            raise ValueError("slab_anchor_pages applies only to page_space='shared'")
        if page_space == "per-group" and not plan.fits_per_group:
            raise ValueError(f"per-group pools of this plan need {plan.total_bytes:,} B, beyond its "
                             f"{plan.budget_bytes:,} B budget: use page_space='shared', or plan fewer running requests")
        arena = shared_arena_for(plan, slab_anchor_pages) if page_space == "shared" else None
        return cls(plan.specs, None if arena is not None else plan.group_pages, arena=arena,
                   max_context_tokens=plan.limits.max_context_tokens, max_step_tokens=plan.limits.max_scheduled_tokens,
                   table_widths=plan.table_widths, **options)

    # --- requests -------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Iterable[int] | np.ndarray | None = None, *,
                    prompt_tokens: int | None = None, max_new_tokens: int = 0,
                    cache_salt: str | bytes | None = None) -> PrefixHit:
        """Register a request; with prefix caching, borrow its cached prefix. Returns the hit.
        ``prompt_token_ids`` may be a ``PreparedPrompt`` of this manager (then give nothing else)."""
        prepared = prompt_token_ids
        if type(prepared) is PreparedPrompt:  # checked before anything changes
            if prompt_tokens is not None or max_new_tokens != 0 or cache_salt is not None:
                raise CacheManagerError("a PreparedPrompt carries its length, max_new_tokens and cache_salt: "
                                        "give them to prepare_prompt, not add_request")
            if prepared._manager is not self:
                raise CacheManagerError("this PreparedPrompt was made by another CacheManager")
            self._check_new_id(request_id)
            req, prompt, address = prepared._request, prepared._prompt, prepared._address
            if req.request_id is not None:  # added before: its request must be freed, then it is made anew
                req = prepared._request = self._request_again(req)
            req.request_id, cache_salt = request_id, prepared.cache_salt
        else:
            req, prompt, address = self._new_prompt(request_id, prompt_token_ids, prompt_tokens, max_new_tokens,
                                                    cache_salt)
        self._version += 1  # invalidates a cached admission
        row = req.row = self._free_rows.pop() if self._free_rows else self._take_row()
        if self.prefix is not None and prompt is not None:
            hit = self.prefix.match_and_borrow(req, prompt, cache_salt, req.hashes)
        else:
            hit = PrefixHit.none(self.specs)
        self._computed[row] = self._committed[row] = self._published[row] = hit.hit_tokens
        self._defer_from[row] = _NEVER if prompt is None else req.prompt_tokens
        self._requests[request_id] = self._row_owner[row] = req
        self._row_of[request_id] = row
        self._max_total[row] = total = req.max_total_tokens
        self._known[row] = self._known_floor[row] = total if prompt is None else req.prompt_tokens
        self._token_addr[row] = address
        if self.tier_link is not None and prompt is not None:
            self.tier_link.on_add(request_id, req.hashes, prompt, hit.hit_tokens, total - req.prompt_tokens,
                                  cache_salt)
        return hit

    def _new_prompt(self, request_id: Any, prompt_token_ids: Any, prompt_tokens: Any, max_new_tokens: Any,
                    cache_salt: Any) -> tuple[_Request, np.ndarray | None, int]:
        """``add_request``'s arguments checked in order: the request (no row yet; no token buffer without ids), its
        prompt ids and their address (None and 0 without ids)."""
        check_cache_salt(cache_salt, CacheManagerError)
        if prompt_token_ids is not None and type(prompt_token_ids) is not np.ndarray:  # an array passes
            check_token_ids("prompt_token_ids", prompt_token_ids, CacheManagerError)
        self._check_new_id(request_id)
        buf, prompt_len, total, address = self._prompt_buffer(request_id, prompt_token_ids, prompt_tokens,
                                                              max_new_tokens)
        return _Request(request_id, -1, prompt_len, total, buf), buf if buf is None else buf[:prompt_len], address

    def _request_again(self, made: _Request) -> _Request:
        """A fresh request (no id, no row) of the prompt that ``made`` (added from a ``PreparedPrompt``, since freed)
        was made of: its buffer, whose prompt ids no append overwrote (known ids never fall below the prompt), and a
        copy of its prompt's hashes (what the appends and rewinds of ``made`` did to its own record stays there)."""
        if self._requests.get(made.request_id) is made:
            raise CacheManagerError(f"this PreparedPrompt's request {made.request_id!r} is live: free it before "
                                    "adding the prompt again (one request at a time)")
        hashes = made.hashes if made.hashes is None else made.hashes.prefix_copy(made.prompt_tokens)
        return _Request(None, -1, made.prompt_tokens, made.max_total_tokens, made.token_ids, hashes)

    def _check_new_id(self, request_id: Any) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise CacheManagerError(f"request id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise CacheManagerError(f"request {request_id!r} already exists")

    def _prompt_buffer(self, request_id: Any, prompt_token_ids: Any, prompt_tokens: Any,
                       max_new_tokens: Any) -> tuple[np.ndarray | None, int, int, int]:
        """The token buffer (None without ids), the prompt's length, the total tokens and the buffer's address (0
        without ids), checked (errors name request ``request_id``; None: a prepared prompt). The ids are copied, and
        int32 ids checked, in one compiled call (``kernels.copy_token_ids``)."""
        if prompt_token_ids is None and prompt_tokens is None:
            raise CacheManagerError("give prompt_token_ids or prompt_tokens")
        ids = prompt_token_ids  # int32 ids: the copy checks them
        if not (type(ids) is np.ndarray and ids.ndim == 1 and ids.dtype == _INT32):
            ids = None if ids is None else _token_array(ids)
        prompt_len = ids.size if prompt_tokens is None else as_int("prompt_tokens", prompt_tokens, minimum=0,
                                                                  error=CacheManagerError)
        if ids is not None and prompt_len != ids.size:
            raise CacheManagerError(f"prompt_tokens={prompt_tokens} disagrees with {ids.size} prompt token ids")
        who = "a prepared prompt" if request_id is None else f"request {request_id!r}"
        if prompt_len < 1:
            raise CacheManagerError(f"{who}: the prompt must have at least one token")
        max_new = as_int("max_new_tokens", max_new_tokens, minimum=0, error=CacheManagerError)
        total = prompt_len + max_new
        if total > self.max_context_tokens:
            raise CacheManagerError(
                f"{who}: prompt {prompt_len} + max_new_tokens {max_new} = {total} tokens "
                f"exceeds the plan's max context of {self.max_context_tokens} tokens")
        if ids is None:
            return None, prompt_len, total, 0
        buf = np.empty(total, dtype=np.int32)  # at least the prompt's one token
        address = self._copy_ids(ids, buf)
        if not address:
            raise CacheManagerError("token ids must be in [0, 2**31)")  # a negative one (``_token_array``'s words)
        return buf, prompt_len, total, address

    def prepare_prompt(self, prompt_token_ids: Iterable[int] | np.ndarray, *, max_new_tokens: int = 0,
                       cache_salt: str | bytes | None = None) -> PreparedPrompt:
        """Check and copy a prompt, and with prefix caching hash its blocks, for ``add_request``: what an engine
        does when a request arrives (as vLLM hashes a request's blocks when it is made), so the step that adds the
        request does not, nor do the adds that follow a ``free`` (one live request of it at a time: the same request
        as one added from the ids each time). Nothing in the manager changes."""
        check_cache_salt(cache_salt, CacheManagerError)
        if prompt_token_ids is None:
            raise CacheManagerError("prepare_prompt needs prompt_token_ids")
        check_token_ids("prompt_token_ids", prompt_token_ids, CacheManagerError)
        buf, prompt_len, total, address = self._prompt_buffer(None, prompt_token_ids, None, max_new_tokens)
        hashes = None if self.prefix is None else self.prefix.prompt_hashes(buf[:prompt_len], cache_salt)
        return PreparedPrompt(self, _Request(None, -1, prompt_len, total, buf, hashes), cache_salt, address)

    def append_token_ids(self, request_id: str, token_ids: Iterable[int] | np.ndarray) -> None:
        """Extend a request's known tokens (sampled outputs, draft tokens)."""
        ids = _small_token_list(token_ids)  # a few valid ids need no other check
        if ids is None:
            check_token_ids("token_ids", token_ids, CacheManagerError)
        self._version += 1  # invalidates a cached admission
        req = self._get(request_id)
        if ids is None:
            ids = _token_array(token_ids)
        n = self._known.item(req.row)
        if req.token_ids is None or n + len(ids) > req.max_total_tokens:
            self._refuse_append((request_id,), len(ids))
        if len(ids) == 1:
            req.token_ids[n] = ids[0]  # a scalar store: a decode step's token
        else:
            req.token_ids[n : n + len(ids)] = ids
        self._known[req.row] = n + len(ids)
        if req.hashes is not None and (n + len(ids)) // self._grain > n // self._grain:
            req.hashes.extend_to(req.token_ids, n + len(ids))  # a block completed: hashed now, read at its commit

    def append_token_ids_many(self, request_ids: Sequence[str], token_ids: Any) -> None:
        """Append ``k`` token ids to each of many requests (``token_ids``: ints ``[n, k]``).

        The decode-step form of ``append_token_ids``: one compiled call checks and writes every row (an int32
        ``[n, k]`` array as is, anything else checked and converted first); all or nothing.
        """
        if type(request_ids) is not tuple and type(request_ids) is not list:
            check_request_ids("request_ids", request_ids, CacheManagerError)
        n = len(request_ids)
        if n == 0:
            return check_empty_token_batch(token_ids, CacheManagerError)
        self._version += 1  # invalidates a cached admission
        tokens = token_ids
        if not (type(tokens) is np.ndarray and tokens.ndim == 2 and tokens.shape[0] == n and tokens.dtype == _INT32):
            tokens = _token_matrix(token_ids, n)
        rids = request_ids if type(request_ids) is tuple else tuple(request_ids)
        rows = self._rows_of(rids)
        if rows is not None and rows.size > self._completed_rows.size:
            self._completed_rows = np.empty(2 * rows.size, dtype=np.int64)
        completed = -1 if rows is None else self._append_ids(self._token_addr, rows, self._known, self._max_total,
                                                             tokens, self._in_batch, self._grain, self._completed_rows)
        if completed < 0:
            _token_matrix(tokens, n)  # a negative id
            self._refuse_append(rids, tokens.shape[1])
        if completed:
            self._hash_completed(completed)

    def _hash_completed(self, completed: int) -> None:
        """Hash the blocks the rows an append listed (``_completed_rows``' first ``completed``) completed, as vLLM
        hashes a request's blocks as its outputs are appended: a commit then only reads them."""
        known, owners = self._known, self._row_owner
        for row in self._completed_rows[:completed].tolist():
            req = owners[row]
            if req.hashes is not None:
                req.hashes.extend_to(req.token_ids, known.item(row))

    def _refuse_append(self, rids: tuple, k: int) -> None:
        """Raise the reason ``k`` more ids for each of ``rids`` are refused."""
        reqs = [self._get(rid) for rid in rids]
        if len({r.request_id for r in reqs}) != len(reqs):
            raise CacheManagerError("a request appears twice")
        bare = [r.request_id for r in reqs if r.token_ids is None]
        if bare:
            raise CacheManagerError(f"request {bare[0]!r} was added without token ids")
        r = next(r for r in reqs if self._known.item(r.row) + k > r.max_total_tokens)
        raise CacheManagerError(f"request {r.request_id!r}: {self._known.item(r.row)} + {k} tokens exceeds its "
                                f"declared total of {r.max_total_tokens} (prompt + max_new_tokens)")

    def num_computed_tokens(self, request_id: str) -> int:
        return int(self._computed[self._get(request_id).row])

    def known_token_ids(self, request_id: str) -> np.ndarray:
        """Debug view: a copy of the token ids known for ``request_id`` (its prompt and
        every appended id, computed or not); empty for a request added without ids."""
        req = self._get(request_id)
        return np.empty(0, np.int32) if req.token_ids is None else req.token_ids[: self._known[req.row]].copy()

    def has_request(self, request_id: str) -> bool:
        return type(request_id) is str and request_id in self._requests  # ids are str: anything else is not one

    num_requests = property(lambda self: len(self._requests))

    # --- admission -----------------------------------------------------------
    def check_admission(self, items: Sequence[tuple[str, int]], *, fixed_width: bool = False,
                        load: bool = False) -> list[Admission]:
        """Would each (request, new tokens) fit, taken greedily in order? Never mutates.
        ``load``: as a load step (``schedule(..., load=True)``)."""
        check_items(items, CacheManagerError)
        verdict = self._admit(items, fixed_width, load=load)
        # schedule() right after, with the same items and no mutation between, reuses it: kept only when every item
        # is a tuple, which no one can change after the check (a list or an array item can be edited in place), and
        # kept and reused only for plain int counts (1.0 and True equal 1 but are no token counts).
        pairs = list(items)
        self._admitted = None if load or [*map(type, pairs)].count(tuple) != len(pairs) or not _int_counts(pairs) \
            else (self._version, pairs, fixed_width, verdict)
        fits = verdict.fits.tolist()  # (a clean plan's also holds its settling rows, each admitted)
        if len(verdict.ok_idx) == len(verdict.answers) and all(fits):
            return [_ADMITTED] * len(verdict.answers)  # every item valid and admitted (most steps)
        answers = list(verdict.answers)  # the verdict keeps None for valid items (schedule's reasons)
        for k, i in enumerate(verdict.ok_idx):
            answers[i] = _ADMITTED if fits[k] else Admission(False, verdict.deny[k])
        return answers

    def max_admissible_tokens(self, request_id: str, max_tokens: int, *, batch: Sequence[tuple[str, int]] = (),
                              fixed_width: bool = False) -> int:
        """The most new tokens, up to ``max_tokens``, that ``request_id`` can schedule in a step together with
        ``batch`` (0 if not even one): for schedulers that shrink a prefill chunk to the memory left. Pure (a
        binary search of :meth:`check_admission`s); ``schedule`` right after reuses the last one."""
        req = self._get(request_id)
        limit = as_int("max_tokens", max_tokens, minimum=1, error=CacheManagerError)
        check_items(batch, CacheManagerError)
        batch = list(batch)
        if any(isinstance(item, (tuple, list)) and item and item[0] == request_id for item in batch):
            raise CacheManagerError(f"request {request_id!r} is already in the batch")
        for answer in self.check_admission(batch, fixed_width=fixed_width) if batch else ():
            if not answer.ok:
                raise CacheManagerError(f"the rest of the batch is not admissible: {answer.reason}")
        # Known ids past the computed ones (a request without token ids: its declared total).
        hi = min(limit, self.max_step_tokens, self._known.item(req.row) - self._computed.item(req.row))
        if hi < 1:
            return 0

        def fits(n: int) -> bool:
            # Every item: greedy admission may deny an earlier one instead of ours.
            return all(a.ok for a in self.check_admission(batch + [(request_id, n)], fixed_width=fixed_width))

        if fits(hi):
            return hi
        lo = 0  # fits(lo) holds for lo = 0 (nothing scheduled); fits(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        if lo:
            fits(lo)  # leave the answer's admission cached for schedule()
        return lo

    def _admit(self, items, fixed_width, uniform=None, planned: _StepPlan | None = None, load: bool = False
               ) -> _Verdict:
        """Stages 1 and 2, pure: validate, plan every row and decide which requests fit. ``uniform``
        (ids, one count) stands for ``items``; ``planned``: a plan ``_step`` made of valid items; ``load``: a load
        step's (rows hold only their checkpoint window in a sliding group)."""
        if fixed_width and self.table_widths is None:
            raise CacheManagerError(
                "fixed_width needs capture widths: build the manager with table_widths (from_plan does)")
        if planned is not None:
            answers, ok_idx, plan = [None] * len(planned.request_ids), range(len(planned.request_ids)), planned
        else:
            answers, ok_idx, plan = self._validated_plan(items, uniform, load)
        if plan is None:
            return _Verdict(answers, ok_idx, np.zeros(0, dtype=bool), {}, None)
        fits = np.ones(plan.rows.size, dtype=bool)
        deny: dict[int, str] = {}
        if plan.clean and not fixed_width:
            plan.grants = []  # clean free pages cover every allocation (most decode steps)
            return _Verdict(answers, ok_idx, fits, deny, plan)
        if fixed_width:
            self._deny_past_capture_width(plan, fits, deny)
        releases = _Releases(self._tableset, self._space, self._counters, plan)
        space, wanted = self._space, plan.sums[1]
        n_short = -1 if deny else self._short_pages(plan, wanted, space.tops, space.tops + space.lru_lengths)
        if n_short >= 0:
            # No credit needed. On an arena, a group that would evict cached pages grows instead.
            surplus = space.tops - wanted if n_short and self.arena is not None else None
            plan.grants = [] if surplus is None else self._grow_instead_of_evicting(self._short, surplus, releases)
        else:
            self._fit_with_credit(releases, fits, deny)
        self._slabs_ahead(plan)
        off = plan.settle
        return _Verdict(answers, ok_idx, fits[off:], {k - off: v for k, v in deny.items() if k >= off}, plan)

    def _slabs_ahead(self, plan: _StepPlan) -> None:
        """A group ``plan`` gives slabs takes more spare ones ahead while the arena stays roomy (``Arena.ahead``)."""
        if plan.grants:
            plan.grants = plan.grants + self.arena.ahead(plan.grants)

    def _validated_plan(self, items, uniform, load: bool) -> tuple[list, Sequence[int], _StepPlan | None]:
        """(answers, valid indices, plan of the valid items or None): vectorized when all are valid, else item by
        item with a reason for each invalid one."""
        if load and self.prefix is None:
            raise CacheManagerError("a load step needs prefix caching (it stands for a prefix hit)")
        load_tokens = self._load_tokens if load else _COMPUTED
        fast = self._fast_rows(items) if uniform is None else self._fast_rows_uniform(*uniform)
        plan = None if fast is None else self._plan(fast[0], fast[1], load_tokens)
        if plan is not None:  # every item valid (the plan checked rows and known tokens)
            plan.request_ids = fast[2]
            return [None] * fast[0].size, range(fast[0].size), plan
        if uniform is not None:
            items = [(rid, uniform[1]) for rid in uniform[0]]  # the per-item path words the reasons
        answers: list[Admission | None] = [None] * len(items)
        seen: set[str] = set()
        ok_idx, rows, counts = [], [], []
        for i, item in enumerate(items):
            reason = self._item_error(item, seen)
            if reason:
                answers[i] = Admission(False, reason)
                continue
            ok_idx.append(i)
            rows.append(self._requests[item[0]].row)
            counts.append(int(item[1]))
        rows, counts = (np.asarray(column, dtype=np.int64) for column in (rows, counts))
        return answers, ok_idx, self._plan(rows, counts, load_tokens) if ok_idx else None

    def _deny_past_capture_width(self, plan: _StepPlan, fits: np.ndarray, deny: dict[int, str]) -> None:
        """Deny every request whose table in some group would be wider than its capture width."""
        for g, gid in enumerate(self._group_ids):
            width = plan.need[g] - plan.after[0, g]
            over = width > self.table_widths[gid]
            over[: plan.settle] = False
            for k in np.flatnonzero(over & fits).tolist():
                fits[k] = False
                deny[k] = (f"group {gid!r} needs {int(width[k])} table columns, more than the "
                           f"capture width {self.table_widths[gid]}")

    def _short_pages(self, plan: _StepPlan, wanted: np.ndarray, clean: np.ndarray, free: np.ndarray) -> int:
        """``kernels.short_pages`` into ``self._short``: how many groups lack clean pages for ``wanted``,
        or -1 when one wants more than its ``free`` pages (release credit decides)."""
        ts, space = self._tableset, self._space
        roomy = space.skip_packing[0]  # the arena's ``roomy`` (never set without an arena)
        return kernels.short_pages(ts.geometry, ts.pages, ts.bounds, space.ref_counts, space.cached, plan.rows,
                                   plan.after[0], plan.first, self._counters, self._grain, self._window_pages,
                                   plan.sums[0], wanted, clean, free, self._no_low if roomy else space.low_idle,
                                   self._short)

    def _fit_with_credit(self, releases: _Releases, fits: np.ndarray, deny: dict[int, str]) -> None:
        """Admission when the allocations alone do not fit: spare slabs, else the totals net of release
        credit (a donor's released pages count as idle), else greedy in batch order. Sets ``plan.grants``."""
        plan, ids, arena = releases.plan, self._group_ids, self.arena
        avail = self._space.tops + self._space.lru_lengths  # free and evictable pages per group
        # Pages each plan row allocates per group (from hi, or from a load row's new base past it).
        alloc = plan.after[1] - np.maximum(self._tableset.bounds[1][:, plan.rows], plan.after[0])
        gross = alloc[:, fits].sum(axis=1)  # the rows denied already left out
        # Releases run before allocations: only the admitted totals matter. Gross: spare slabs only.
        plan.grants = _grants_to_fit(arena, ids, gross, avail, None)
        if plan.grants is None:
            scan = IdleScan(releasing=lambda k: releases.of(k)[1])  # pages only their row holds
            need = alloc - releases.credit()
            net = need[:, fits].sum(axis=1)
            plan.grants = _grants_to_fit(arena, ids, net, avail, scan)
            if plan.grants is None:
                self._deny_greedily(alloc, need, avail, net, fits, deny, scan, plan)
                return
        if arena is not None:
            # A group that would evict cached pages grows instead, after those grants (gross sums: the releases'
            # freed pages count; free: the gross, as credit covered them).
            own, gained = arena.replay(plan.grants) if plan.grants else (None, {})
            clean = self._space.tops + np.fromiter(map(gained.get, ids, repeat(0)), _INT64, len(ids))
            if self._short_pages(plan, gross, clean, gross):
                plan.grants = plan.grants + self._grow_instead_of_evicting(self._short, clean - gross, releases, own)

    def _grow_instead_of_evicting(self, short: np.ndarray, surplus: np.ndarray, releases: _Releases,
                                  own: np.ndarray | None = None) -> list:
        """Slabs for the groups ``short`` of clean pages: spare slabs, else other groups' slabs that are
        clean free after the releases (``surplus``: clean free less allocations); ``own``: owners so far."""
        grants = self.arena.plan_spare(short, own)
        if grants is not None:
            return grants  # spare slabs surely cover: no donor's values or releases needed
        ids, counts = self._group_ids, short.tolist()
        wanting = {gid: n for gid, n in zip(ids, counts) if n > 0}
        spare = {gid: left for gid, n, left in zip(ids, counts, surplus.tolist()) if n <= 0}
        scan = IdleScan(releasing=lambda k: releases.of(k)[2], clean=True)  # unkeyed: freed
        if self.prefix is not None and self.prefix.eviction.acts:
            scan.before_tick, scan.group_ticks = self._worth_less_ticks(wanting)
        return self.arena.plan(wanting, spare, scan, partial=True, owner=own)

    def _worth_less_ticks(self, wanting: dict[str, int]) -> tuple[int | None, dict[str, int] | None]:
        """A donor's entries idle since before these ticks are worth less than what the ``wanting`` groups (group ->
        pages short) would evict of their own, and count as spare (docs/prefix-caching.md, "Eviction by value", 5):
        a history group's, the oldest idle tick a wanting group would evict; a state group's, the latest tick up to
        which a wanting group's own evictions would reach (its low-priority pages first), since each of its units
        has an entry in every state group and leaves whole. None: no wanting group holds an entry of normal priority."""
        oldest = {g: t for g in wanting if (t := self.pools[g].oldest_idle_tick()) is not None}
        if not oldest:
            return None, None
        reached = max(self._tick_reached(g, wanting[g], tick) for g, tick in oldest.items())
        return min(oldest.values()), dict.fromkeys(self.prefix.state_ids, reached)

    def _tick_reached(self, gid: str, short_pages: int, oldest_tick: int) -> int:
        """The idle tick up to which ``gid``'s own evictions would reach for ``short_pages`` pages, its low-priority
        idle pages first (``oldest_tick``: its oldest normal-priority idle page's, where one page or none would go)."""
        pool = self.pools[gid]
        normal_pages = short_pages - int(pool.num_low_priority_idle_pages)
        return oldest_tick if normal_pages <= 1 else pool.normal_tick_at(normal_pages)

    def _deny_greedily(self, alloc, need, avail, net, fits, deny, scan, plan) -> None:
        """In batch order, admit a request only if everything admitted so far still fits (``[G, R]`` arrays
        ``alloc`` and ``need``, its allocations gross and net; ``net``: the sums of ``need`` over ``fits``, which
        do not fit). The rows before the first whose running sum passes ``avail`` fit with no slab (one pass);
        from there each sum asks ``_grants_to_fit`` once (an admitted row that needs nothing, or the last one
        admitted, repeats a sum already asked)."""
        ids, arena = self._group_ids, self.arena
        need = np.where(fits, need, 0)  # the rows denied already add nothing
        sums = np.cumsum(need, axis=1)
        first = int((sums > avail[:, None]).any(axis=0).argmax())
        used, plan.grants = sums[:, first - 1] if first else np.zeros_like(avail), []
        asked = {tuple(net.tolist()): None}
        for k in (np.flatnonzero(fits[first:]) + first).tolist():
            want = used + need[:, k]
            key = tuple(want.tolist())
            if key not in asked:
                asked[key] = _grants_to_fit(arena, ids, want, avail, scan)
            grants = asked[key]
            if grants is None:
                g = int((want > avail).argmax())
                fits[k] = False
                deny[k] = (f"group {ids[g]!r} needs {int(alloc[g, k])} new pages "
                           f"(after {int(alloc[g, k] - need[g, k])} released), "
                           f"{max(int(avail[g] - used[g]), 0)} free or evictable"
                           + ("" if arena is None else ", and no slab of the shared arena can be lent"))
            else:
                used, plan.grants = want, grants

    def _fast_rows(self, items) -> tuple[np.ndarray, np.ndarray, tuple, int] | None:
        """(rows, counts, ids, tokens) of valid-looking pairs, vectorized; None sends the batch to the
        per-item path. The plan checks distinct rows, known tokens and each count's range."""
        try:  # strict: an item of another length among pairs is no pair either
            if len(items) == 1:  # one pair (a prefill chunk): its count checked as a uniform step's, no unzip
                (rid, count), = items
                return self._fast_rows_uniform((rid,), count)
            rids, counts = zip(*items, strict=True)
        except (TypeError, ValueError):
            return None  # not all pairs
        n = len(counts)
        if [*map(type, counts)].count(int) != n:  # not all plain ints (the type count keeps out True)
            kinds = set(map(type, counts))
            if bool in kinds or not all(k is int or issubclass(k, np.integer) for k in kinds):
                return None  # bool is an int subclass but not a token count
            counts = tuple(map(int, counts))  # numpy ints: exact plain ints for the tokens' sum
        if counts.count(counts[0]) == n:  # one count (a prefill chunk, decode, verify): one scalar check
            return self._fast_rows_uniform(rids, counts[0])
        rows = self._rows_of(rids)
        if rows is None or (self.pending_loads and not self.pending_loads.isdisjoint(rids)):
            return None
        try:
            out = _int64_array(counts, n)
        except (OverflowError, struct.error):
            return None  # past int64, so past the limit
        # The sum sizes the batch's arrays; outside [n, n * max_step_tokens] a count lies outside what
        # ``prepare_step`` takes, [1, max_step_tokens]. Builtin ``sum`` below 128, numpy's from 128 on (a sum wrapped
        # past int64 has a count the kernel refuses).
        total = sum(counts) if n < 128 else int(out.sum())
        return (rows, out, rids, total) if n <= total <= n * self.max_step_tokens else None

    def _fast_rows_uniform(self, rids: tuple, count) -> tuple[np.ndarray, np.ndarray, tuple, int] | None:
        """``_fast_rows`` of ``(rid, count)`` for every id: one scalar count check."""
        if type(count) is not int:
            if not isinstance(count, np.integer):
                return None  # the per-item path words it (bool and np.bool_ included)
            count = int(count)
        if not 1 <= count <= self.max_step_tokens:
            return None
        rows = self._rows_of(rids)
        if rows is None or (self.pending_loads and not self.pending_loads.isdisjoint(rids)):
            return None
        if count != self._one_count_tokens:  # ``prepare_step`` reads one count as every row's
            self._one_count[0] = self._one_count_tokens = count
        return rows, self._one_count, rids, len(rids) * count

    def _rows_of(self, rids: tuple) -> np.ndarray | None:
        """Table rows of known request ids (one id: its row's ``_row_arrays``, no array made); None if an id is
        unknown or unhashable. Nothing writes the arrays the steps and appends take (``_last_rows`` keeps one)."""
        try:
            if len(rids) == 1:
                return self._row_arrays[self._row_of[rids[0]]]
            found = itemgetter(*rids)(self._row_of)  # one C-level lookup of every id
        except (KeyError, TypeError):
            return None
        return _int64_array(found, len(rids))

    def _item_error(self, item, seen: set[str]) -> str:
        try:
            rid, n = item
        except (TypeError, ValueError):
            return f"each item must be (request_id, num_new_tokens), got {item!r}"
        if not isinstance(rid, str) or rid not in self._requests:
            return f"unknown request {rid!r}"
        if rid in seen:
            return f"request {rid!r} appears twice in the batch"
        seen.add(rid)
        if rid in self._rewound_loads:
            return f"request {rid!r} was rewound below its load step (its window pages are gone): free it"
        if rid in self.pending_loads:
            return f"request {rid!r} waits for its tier load: run TierLink.take_loads() and confirm_load()"
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            return f"request {rid!r}: token count must be an int, got {n!r}"
        n = int(n)
        if n < 1:
            return f"request {rid!r}: token count must be positive, got {n}"
        if n > self.max_step_tokens:
            return f"request {rid!r}: {n} tokens exceed the per-step limit of {self.max_step_tokens}"
        req = self._requests[rid]
        done = int(self._computed[req.row])
        if done + n > req.max_total_tokens:
            return (f"request {rid!r}: {done} + {n} tokens exceeds its declared total of "
                    f"{req.max_total_tokens} (prompt + max_new_tokens)")
        known = self._known.item(req.row)
        if req.token_ids is not None and done + n > known:
            return (f"request {rid!r}: {done} + {n} tokens exceeds the {known} known token ids "
                    "(append_token_ids first)")
        return ""

    def _plan(self, rows_in: np.ndarray, counts_in: np.ndarray, load_tokens: np.ndarray) -> _StepPlan | None:
        """``kernels.prepare_step``'s plan (pure; scratch: only the latest is valid), settling rows first;
        None when a row is listed twice or passes its known tokens."""
        rows, counts, first, after, need, sums, crossing, totals = self._scratch.plan_arrays(
            rows_in.size + self._last_rows.size)
        ts = self._tableset
        n, settle, n_crossing, clean = kernels.prepare_step(
            ts.geometry, ts.bounds, self._counters, self._last_rows, rows_in, counts_in, self._grain, self._space.tops,
            self._in_batch, rows, counts, first, after, need, sums, crossing, totals, load_tokens)
        if n < 0:
            return None  # a row twice, or past its known tokens: the per-item path words it
        return self._plan_of(n, settle, n_crossing, clean)

    def _plan_of(self, n: int, settle: int, n_crossing: int, clean: bool) -> _StepPlan:
        """The ``_StepPlan`` that ``prepare_step`` just wrote to the scratch buffers."""
        rows, counts, first, after, need, sums, crossing, totals = self._scratch.plan
        return _StepPlan(rows[:n], counts[:n], first[:n], after[:, :, :n], need[:, :n], sums,
                         crossing[:n_crossing], settle, clean, tuple(totals.tolist()))

    # --- the step ------------------------------------------------------------
    def schedule(self, items: Sequence[tuple[str, int]], *, fixed_width: bool = False, block_tables: str = "full",
                 write_slots: bool = True, load: bool = False) -> StepBatch:
        """Release, allocate and build the kernel arrays for one step (all or nothing).

        ``block_tables="full"`` builds each group's ``[R, width]`` table; ``"updates"`` hands out only the table cells
        that changed (``StepBatch.table_updates``, applied by ``hybridkv.tables.mirror.BlockTableMirror``).
        ``write_slots=False`` leaves every ``GroupStep.write_slots`` None, for an engine that computes them itself from
        its mirrored tables and the positions. ``load=True`` (with ``write_slots=False``): a *load step* (a tier load,
        ``hybridkv.tierlink``): the items' tokens are copied in, not computed, so in a sliding group each request holds
        only the pages of the checkpoint at its new end, as after a prefix hit there (docs/manager.md, "Load steps").
        """
        if type(items) is not list:  # a list passes ``check_items``
            check_items(items, CacheManagerError)
        if load and write_slots:
            raise CacheManagerError("a load step computes nothing to write: schedule it with write_slots=False")
        items = items if type(items) is list else list(items)
        if not (items and type(write_slots) is bool and block_tables in _BLOCK_TABLE_MODES):
            _check_step_options(items, block_tables, write_slots)  # words the error
        return self._schedule(items, None, fixed_width, block_tables, write_slots, load)

    def schedule_uniform(self, request_ids: Sequence[str], num_tokens: int, *, fixed_width: bool = False,
                         block_tables: str = "full", write_slots: bool = True) -> StepBatch:
        """``schedule([(rid, num_tokens) for rid in request_ids])``, for a step in which every request gets the same
        count (decode, or verifying k draft tokens), without building the pairs. Same checks, errors and result."""
        if type(request_ids) is not tuple:  # a tuple passes ``check_request_ids``
            check_request_ids("request_ids", request_ids, CacheManagerError)
            request_ids = tuple(request_ids)
        if not (request_ids and type(write_slots) is bool and block_tables in _BLOCK_TABLE_MODES):
            _check_step_options(request_ids, block_tables, write_slots)  # words the error
        return self._schedule(None, (request_ids, num_tokens), fixed_width, block_tables, write_slots)

    def _schedule(self, items, uniform, fixed_width: bool, block_tables: str, write_slots: bool = True,
                  load: bool = False) -> StepBatch:
        """``schedule`` of ``items`` or ``uniform`` (ids, one count), options checked; most steps take
        ``_step``'s one call."""
        if self.tier_link is not None and self.tier_link.loads_in_flight:
            self.tier_link.check_schedule()
        updates = block_tables == "updates"
        verdict = self._admitted and self._checked_verdict(items, fixed_width)
        if load:
            verdict = self._admit(items, fixed_width, load=True)
        elif verdict is None and not fixed_width and (self._tableset.n_logged is None) != updates:
            # Valid pairs in the previous step's block-table mode: ``_step``'s batch, or its plan for ``_admit``.
            fast = self._fast_rows(items) if uniform is None else self._fast_rows_uniform(uniform[0], uniform[1])
            if fast is not None:
                done = self._step(fast, write_slots, updates)
                if type(done) is StepBatch:
                    return done
                if done is not None:
                    verdict = self._admit(items, False, uniform, planned=done)
        if verdict is None:
            verdict = self._admit(items, fixed_width, uniform)
        return self._run_verdict(verdict, items, uniform, write_slots, updates, fixed_width, load)

    def _checked_verdict(self, items, fixed_width: bool) -> _Verdict | None:
        """The last ``check_admission``'s verdict if it checked these items and nothing changed since (used once; the
        items it keeps are tuples: an ndarray item here compares elementwise and is no match)."""
        admitted, self._admitted = self._admitted, None
        try:
            same = admitted[:3] == (self._version, items, fixed_width)
        except ValueError:  # numpy's "truth value of an array ... is ambiguous"
            return None
        return admitted[3] if same and _int_counts(items) else None

    def _run_verdict(self, verdict: _Verdict, items, uniform, write_slots: bool, updates: bool, fixed_width: bool,
                     load: bool) -> StepBatch:
        """Raise ``verdict``'s refusal, else note a load step's spans and run stages 2-4."""
        n_items = len(items) if uniform is None else len(uniform[0])
        if len(verdict.ok_idx) != n_items or verdict.deny:  # a request fits unless denied
            deny = verdict.deny
            reasons = [a.reason for a in verdict.answers if a is not None] + [deny[k] for k in sorted(deny)]
            reasons.sort(key=lambda reason: not any(words in reason for words in _CALL_ERRORS))  # stable
            raise CacheManagerError(f"{len(reasons)} of {n_items} requests not admissible: {'; '.join(reasons[:3])}")
        plan = verdict.plan
        if plan.request_ids is None:
            plan.request_ids = uniform[0] if items is None else tuple(map(itemgetter(0), items))
        if load:
            first = plan.first[plan.settle :].tolist()
            self._load_spans.update((rid, (f, f + n)) for rid, f, n in zip(
                plan.request_ids, first, plan.counts[plan.settle :].tolist()))
        return self._commit_and_run(plan, write_slots, updates, fixed_width)

    def _commit_and_run(self, plan: _StepPlan, write_slots: bool, updates: bool, fixed_width: bool) -> StepBatch:
        """An admitted plan's stages 2-4 (docs/manager.md, "One step, in four stages"): its arrays and cell buffers
        and the scratch as large as it needs, then ``_run``."""
        ts, (n_tokens, released_pages, most_released, allocated_pages) = self._tableset, plan.totals
        if (ts.n_logged is None) == updates:  # the log's state changes: on for "updates", off for "full"
            ts.set_log(updates)
        # At most a cell per page released or allocated, after the cells logged since the last step (room for the
        # plan's cells, and at least two a group and row).
        cells = _NO_CELLS
        if updates and not ts.resync:
            room = max(2 * len(self.specs) * plan.rows.size + 16, ts.n_logged + released_pages + allocated_pages)
            cells = np.empty((3, room), _INT64), np.empty(room, _INT32)
        out = kernels.batch_arrays_for(len(self.specs), plan.rows.size - plan.settle, n_tokens, write_slots)
        self._scratch.reserve(most_released, released_pages)
        ts.reserve_log(released_pages + allocated_pages)
        grants = self.arena.kernel_grants(plan.grants) if plan.grants else plan.spare_grants
        rows = plan.rows[plan.settle :].copy()  # the plan's arrays are scratch
        grants = None if grants is None else (grants, grants.shape[1])
        return self._run(grants, plan, plan.request_ids, cells, out, updates, rows, fixed_width)

    def _step(self, fast: tuple, write_slots: bool, updates: bool) -> StepBatch | _StepPlan | None:
        """``fast``'s step in one compiled call (``kernels.step``; ``kernels.step_spare`` on an arena for a batch
        with more tokens than rows): the batch; else (nothing changed) the plan for ``_admit``, or None (a row
        twice, or past its known tokens)."""
        rows_in, counts_in, rids, n_tokens = fast
        sc, n_rows, n_groups = self._scratch, len(rids), len(self._pool_list)
        out = kernels.batch_arrays_for(n_groups, n_rows, n_tokens, write_slots)
        plan_rows = n_rows + self._last_rows.size
        if plan_rows >= sc.plan_rows:
            sc.plan_arrays(plan_rows)
        ts, cells = self._tableset, _NO_CELLS
        n_logged = ts.n_logged or 0  # the cells a ``free`` or prefix hit logged: the step's touched cells follow them
        if updates:
            # A cell per group and row (a one-token step allocates or releases at most a page in a group whose window
            # is a multiple of its page tokens: DeepSeek-V4's, up to 4 speculative tokens; ~1.3 cells a row in all), two
            # per further token (a chunk: ~1.3 a token); more (a row's first step past a chunk) overflows:
            # ``_build_batch`` then drains the log (same cells).
            room = n_groups * n_rows + 16 + 2 * (n_tokens - n_rows) + n_logged
            cells = np.empty((3, room), _INT64), np.empty(room, _INT32)
        args = (*(self._state or self._kernel_state()), sc.buffer, self._last_rows, rows_in, counts_in, ts.logged,
                n_logged, *cells, *out)
        if n_tokens > n_rows and self._spare_entry is not None:  # a chunk: ``admit_spare`` in the same call
            status, n, settle, n_crossing, clean, n_touched, n_keyed, n_spare = self._spare_entry(
                *args, *self._spare_args)
        else:  # decode: the int comparison alone
            status, n, settle, n_crossing, clean, n_touched, n_keyed = self._step_entry(*args)
            n_spare = None
        if status >= kernels.STEP_COMMITS:  # admitted (``STEP_SPARE``: ``admit_spare``'s spare slabs): commit, then run
            grants = (self.arena.spare_written, n_spare) if status == kernels.STEP_SPARE and n_spare else None
            return self._run(grants, (n, settle, n_crossing, clean), rids, cells, out, updates, rows_in)
        if status > kernels.STEP_NEEDS_PAGES:  # planned only
            return self._planned_step(status, (n, settle, n_crossing, clean), rids, rows_in, cells, out, write_slots,
                                      updates, n_spare)
        self._version += 1
        if status:  # ``STEP_NEEDS_PAGES``
            n_touched = self._after_run(n_touched, n_keyed, self._plan_of(n, settle, n_crossing, clean), out, cells)
        elif n_keyed:  # done whole (the kernel noted the peaks): idle keyed pages join their LRUs
            self._space.keyed_idle(sc.released[1], sc.idle_keyed)
        self._last_rows = rows_in  # the plan's rows after the settling ones (an array of ours nothing writes)
        return self._build_batch(rows_in, rids, out, False, n_touched if updates else -1, cells)

    def _planned_step(self, status: int, planned: tuple, rids: tuple, rows_in: np.ndarray, cells: tuple,
                      out: tuple, write_slots: bool, updates: bool,
                      n_spare: int | None) -> StepBatch | _StepPlan | None:
        """``_step`` once ``kernels.step`` only planned a plan it did not admit (``STEP_PLANNED``, ``STEP_COVERED``): the
        batch if ``_admit`` would admit it as is or with spare slabs alone, run without it (a clean plan; one
        ``STEP_COVERED`` granting no slab; else as ``admit_spare`` answers: its spare slabs for ``grant_step``, or
        ``Arena.apply``'s where none were written), else the plan or None (``n_spare``: ``admit_spare``'s answer if
        ``step_spare`` gave it)."""
        n, _, _, clean = planned
        if n < 0:
            return None
        plan, grants, spare = self._plan_of(*planned), [], None
        plan.request_ids = rids
        if not clean and not (status == kernels.STEP_COVERED and (self.arena is None or all(  # no slab granted
                n <= p.num_free_pages for n, p in zip(self._scratch.plan[5][1].tolist(), self._pool_list)
                if n > p.num_clean_free_pages))):
            if self.arena is None:
                return plan  # ``_admit`` decides
            if n_spare is None:
                n_spare = self._admit_entry(*self._admit_args(n))
            if n_spare < 0:
                return plan
            if n_spare and self.arena.spare_written is None:  # spare slabs, which ``Arena.apply`` moves
                grants = self.arena.spare_grants(n_spare)
            elif n_spare:
                spare = self.arena.spare_written[:, :n_spare].copy()
        plan.grants, plan.spare_grants = grants, spare  # admitted: ``_commit_and_run`` grows the buffers where needed
        return self._commit_and_run(plan, write_slots, updates, False)

    def _run(self, grants: tuple | None, plan: _StepPlan | tuple, rids: tuple, cells: tuple, out: tuple,
             updates: bool, rows_in: np.ndarray, fixed_width: bool = False) -> StepBatch:
        """Stages 2-4 of an admitted plan in the scratch buffer, its buffers large enough (``plan``: a ``_StepPlan``,
        or ``_step``'s (rows, settling, crossing, clean) of a ``STEP_COMMITS`` or ``STEP_SPARE`` plan; ``rows_in``: its
        rows after the settling ones): the rows crossing a grain commit, then ``run_step`` (``grant_step`` granting
        ``grants``, spare slabs: the first ``n`` columns of ``(array, n)``; ``run_step`` stopping for ``Arena.apply``
        of a ``_StepPlan``'s other grants), then the batch."""
        sc, step_plan = self._scratch, plan if type(plan) is _StepPlan else None
        n, settle, n_crossing, _ = plan if step_plan is None else (plan.rows.size, plan.settle, plan.crossing.size, 0)
        self._version += 1
        if n_crossing:
            self._commit_rows(sc.plan[6][:n_crossing])  # the stacks only grow: the plan is still admitted
        ts, state = self._tableset, (self._state or self._kernel_state())[:10]
        log = ts.logged, ts.n_logged or 0  # commits log no cell: the step's touched cells follow those logged
        if grants is None:  # both kernels join the keyed pages left idle (``n_keyed`` 0) unless a ranker is told
            hold = step_plan is not None and bool(step_plan.grants)
            status, n_touched, n_keyed = self._run_entry(*state, sc.buffer, n, settle, hold, *log, *cells, *out,
                                                         self._space.join_args)
        else:  # ``grant_step`` (its scratch kept for the next) stops only when groups make room, marked already
            arena, (grants, n_grants) = self._grant_args, grants
            self._grant_room = room = kernels.grant_scratch(n_grants, arena, len(self.specs), self._grant_room)
            status, n_touched, n_keyed = self._grant_entry(grants, n_grants, room, arena, self._space.join_args,
                                                           *state, sc.buffer, n, settle, *log, *cells, *out)
            if status < 0:
                raise AssertionError("a slab granted is not spare")
        if status != kernels.STEP_DONE:
            step_plan = step_plan or self._plan_of(*plan)
            n_touched = self._after_run(n_touched, n_keyed, step_plan, out, cells, grants is not None)
        elif n_keyed:  # done whole (the kernel noted the peaks): idle keyed pages join their LRUs
            self._space.keyed_idle(sc.released[1], sc.idle_keyed)
        self._last_rows = rows_in
        return self._build_batch(rows_in, rids, out, fixed_width, n_touched if updates else -1, cells)

    def _admit_args(self, n_rows: int) -> tuple:
        """``kernels.admit_spare``'s arguments for the plan of ``n_rows`` rows in the scratch buffer."""
        ts, space = self._tableset, self._space
        return (ts.geometry, ts.pages, ts.bounds, space.ref_counts, space.cached, space.per_group, self._counters,
                self._grain, self._window_pages, self._scratch.buffer, n_rows, self._spare_rows, *self.arena.spare_args)

    def _kernel_state(self) -> tuple:
        """``kernels.step``'s leading arguments: the same objects until ``_take_row`` grows the arrays."""
        ts, space = self._tableset, self._space
        self._state = (ts.geometry, ts.pages, ts.bounds, self._counters, space.ref_counts, space.cached,
                       space.low_priority, space.stack, space.per_group, self._transient, self._in_batch, self._grain)
        return self._state

    def _load_kernels(self) -> None:
        """Load (or compile) every kernel a step may call, over a plan of no rows (nothing changes), so no
        step late in a run stalls for one (docs/architecture.md)."""
        self._space.load_kernels(self._tableset, self._by_row)
        if self.prefix is not None:
            self.prefix.load_kernels()
        # ``_step``'s and the validation's kernels (``step`` and ``admit_spare`` by their compiled code, not run).
        sc, no_rows, out = self._scratch, np.empty(0, _INT64), kernels.batch_arrays_for(len(self.specs), 0, 0, True)
        args = (*self._kernel_state(), sc.buffer, self._last_rows, no_rows, self._one_count, self._tableset.logged, 0,
                *_NO_CELLS, *out)
        self._step_entry = kernels.entry_point(kernels.step, args)
        if self.arena is not None:
            self._admit_entry = kernels.entry_point(kernels.admit_spare, self._admit_args(0))
        if self.arena is not None and self.arena.spare_written is not None:  # ``STEP_SPARE`` runs its grants as written
            self._spare_args = (self._window_pages, self._spare_rows, *self.arena.spare_args)
            self._spare_entry = kernels.entry_point(kernels.step_spare, (*args, *self._spare_args))
        self._plan(no_rows, no_rows, _COMPUTED)
        self._tableset.ring_view()
        # ``_run``'s and ``_after_run``'s ``kernels.run_step`` and ``finish_step`` (``_step``'s cells and arrays), by
        # their compiled code looked up once; ``head`` and ``tail``: the arguments around a kernel's own ones.
        head, tail = (*self._kernel_state()[:10], sc.buffer, 0, 0), (self._tableset.logged, 0, *_NO_CELLS, *out)
        self._run_entry = kernels.entry_point(kernels.run_step, (*head, False, *tail, self._space.join_args))
        self._finish_entry = kernels.entry_point(kernels.finish_step, (*head, *tail, True))
        # Room for a step of every table row and as many settling (``_take_row`` grows it with the rows).
        rows, counts, first, after, need, sums, crossing, _ = sc.plan_arrays(2 * self._computed.size)
        sums[:] = 0  # no page released or allocated
        none = sums[1]
        plan = _StepPlan(rows[:0], counts[:0], first[:0], after[:, :, :1], need[:, :0], sums, crossing[:0], 0, True,
                         (0, 0, 0, 0), grants=[])
        self._short_pages(plan, none, none, none)
        _Releases(self._tableset, self._space, self._counters, plan).of(0)
        plan.request_ids = ()
        self._room_entry = kernels.entry_point(kernels.room_groups, self._room_args(plan))
        self._commit_and_run(plan, True, False, False)
        self._after_run(0, 0, plan, out)
        if self.arena is not None:  # ``_run``'s other kernel: ``grant_step``, granting no slab, by its compiled code
            plan.spare_grants = np.empty((2, 0), dtype=np.int64)
            self._grant_entry = kernels.entry_point(kernels.grant_step, (
                plan.spare_grants, 0, kernels.grant_scratch(0, self._grant_args, len(self.specs)),
                self._grant_args, self._space.join_args, *head, *tail))
            self._commit_and_run(plan, True, False, False)

    def _after_run(self, n_touched: int, n_keyed: int, plan: _StepPlan, out: tuple,
                   cells: tuple = _NO_CELLS, marked: bool = False) -> int:
        """Stage 3 in Python once the step kernel stopped after its releases (docs/manager.md, "One
        step, in four stages"): keyed pages join the LRU, slabs move, groups make room, ``finish_step``.
        ``marked``: ``room_groups``' marks, as it would answer now, are in ``_scratch.marks`` already
        (``grant_step`` stopped)."""
        sc = self._scratch
        if n_keyed:
            self._space.keyed_idle(sc.released[1], sc.idle_keyed)
        if plan.grants and not marked:  # ``marked``: ``grant_step`` granted them
            self.arena.apply(plan.grants)
        if marked or self._room_entry(*self._room_args(plan)):  # how many groups to ask
            # ``PagePool.make_room`` of each named group's allocated pages (its transient pages: ``highest``; one whose
            # free stack covers them packs); once one has evicted (telling of a removal may drop or demote entries of
            # later groups), ``room_groups`` names the later groups again, as they are now.
            allocated, marks, tops = plan.sums[1].tolist(), sc.marks.tolist(), self._space.tops
            for g, pool in enumerate(self._pool_list):
                if marks[g] >= 0:
                    before = pool.counters.evicted_pages
                    pool.make_room(allocated[g], marks[g], tops[g] >= allocated[g])
                    if pool.counters.evicted_pages != before and any(allocated[g + 1 :]):
                        self._room_entry(*self._room_args(plan, g + 1))
                        marks = sc.marks.tolist()
        short = np.flatnonzero(self._space.tops < plan.sums[1])
        if short.size:  # a plan that did not cover an allocation: an error, not a free stack read past its top
            g = int(short[0])
            raise AssertionError(f"group {self._group_ids[g]!r}: {int(self._space.tops[g])} free pages after making "
                                 f"room for a step allocating {int(plan.sums[1][g])}")
        # ``kernels.finish_step`` of the plan in the scratch buffer, by its compiled code (the same types every call).
        args = (*(self._state or self._kernel_state())[:10], sc.buffer, plan.rows.size, plan.settle,
                self._tableset.logged, n_touched, *cells, *out, True)
        return self._finish_entry(*args)

    def _room_args(self, plan: _StepPlan, start: int = 0) -> tuple:
        """``kernels.room_groups``' arguments (``_room_entry``: its compiled code) of ``plan`` now, from group ``start``
        on, into ``_scratch.marks`` (per group: its transient pages when ``make_room`` may evict, else -1)."""
        space, ts = self._space, self._tableset
        return (ts.geometry, ts.bounds, self._transient, plan.rows, plan.first, plan.counts, plan.after, plan.sums,
                space.stack, space.per_group, space.ref_counts, space.cached, space.low_priority,
                None if self.arena is None else self.arena.packing, self._scratch.marks, start, None, None)

    def _build_batch(self, rows: np.ndarray, request_ids: tuple, out: tuple, fixed_width: bool,
                     n_touched: int, cells: tuple = _NO_CELLS) -> StepBatch:
        """Stage 4: the ``StepBatch`` of ``rows``, block tables or (``n_touched`` >= 0) the cells changed."""
        widths = self._capture_widths if fixed_width else tuple(self._scratch.widths.tolist())
        ts = self._tableset
        # The batch's frozen dataclasses get their fields stored directly (no ``__init__`` frame each).
        if n_touched < 0:
            tables, table_updates = [ts.block_table(k, rows, width) for k, width in enumerate(widths)], None
        else:
            tables, table_updates = self._no_tables, _new_object(TableUpdates)
            if 0 < n_touched <= cells[1].size and not ts.resync:  # ``finish_step`` read them: the log drained
                (cells, page), n = cells, n_touched
                ts.drained()
                found = cells[0, :n], cells[1, :n], cells[2, :n], page[:n], False
            else:
                found = ts.drain_updates(n_touched)
            group, row, column, page, reset = found
            fields = table_updates.__dict__
            fields["group"], fields["row"], fields["column"], fields["page"] = group, row, column, page
            fields["widths"], fields["reset"] = widths, reset
        per_request, query_start_loc, request_indices, per_token = out
        slots = len(per_token) > 1
        groups = {}
        for (gid, base_row, slot_row), table in zip(self._batch_rows, tables):  # a view only where one is handed out
            groups[gid] = step = _new_object(GroupStep)
            fields = step.__dict__
            fields["block_table"], fields["base_pages"] = table, per_request[base_row] if base_row else None
            fields["write_slots"] = per_token[slot_row] if slots else None
        batch = _new_object(StepBatch)
        fields = batch.__dict__
        fields["request_ids"], fields["num_scheduled_tokens"] = request_ids, per_request[1]
        fields["query_start_loc"], fields["positions"] = query_start_loc, per_token[0]
        fields["request_indices"], fields["groups"] = request_indices, groups
        fields["table_rows"], fields["table_updates"] = per_request[0], table_updates
        return batch

    def _commit_rows(self, rows: np.ndarray) -> None:
        """Publish what each row's computed tokens completed since its last publication (its held checkpoint too:
        ``kernels.commit_unit`` reads it), in one
        ``PrefixCache.commit_requests`` call (row by row in order; it reads the blocks' keys that adding the
        requests and appending their ids hashed)."""
        owners, committed, published, computed = self._row_owner, self._committed, self._published, self._computed
        reqs, old, new = [], [], []
        for row in rows.tolist():  # a few rows a step: item reads beat two gathers
            req, done = owners[row], computed.item(row)
            if req.token_ids is not None:
                reqs.append(req), old.append(published.item(row)), new.append(done)
            committed[row] = published[row] = done
        if reqs:
            self.prefix.commit_requests(reqs, old, new)

    # --- rewind and free -----------------------------------------------------
    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` computed tokens; pages past them go back."""
        self.rewind_many([(request_id, num_tokens)])

    def rewind_many(self, items: Sequence[tuple[str, int]]) -> None:
        """``rewind`` for many requests: one compiled call that checks every item before changing anything."""
        if not isinstance(items, (list, tuple)):
            check_items(items, CacheManagerError)  # a str, None, a one-shot iterator: refused
            items = list(items)
        self._version += 1  # invalidates a cached admission
        rows, kept = self._rewind_rows(items)
        if not rows.size:
            return
        before = self._computed[rows] if self._load_spans else None
        ts, space = self._tableset, self._space
        ok, touched, keyed, keyed_per_group = kernels.rewind_rows(
            ts.geometry, ts.pages, ts.bounds, self._counters, self._known_floor, space.ref_counts, space.cached,
            space.stack, space.per_group, self._in_batch, rows, kept)
        if not ok:  # a row twice, or a count out of range: nothing changed
            self._rewind_items(items)  # raises, wording the first refused item
        ts.note_cells(touched)
        if keyed.size:
            space.keyed_idle(keyed_per_group, keyed)
        if before is not None:  # requests rewound below a load step just run lose its window: refused until freed
            for row, was, num_tokens in zip(rows.tolist(), before.tolist(), kept.tolist()):
                rid = self._row_owner[row].request_id
                if self._load_spans.get(rid) == (int(self._committed[row]), was) and num_tokens < was:
                    self._rewound_loads.add(rid)
                    self.pending_loads.add(rid)
        if self.prefix is not None:  # ids past the known ones will be appended anew: their blocks' hashes go
            for row in rows.tolist():
                hashes = self._row_owner[row].hashes
                if hashes is not None:
                    hashes.cut_to(self._known.item(row))

    def _rewind_rows(self, items: list | tuple) -> tuple[np.ndarray, np.ndarray]:
        """Table rows and kept tokens of ``rewind_many``'s items (``_rewind_items`` words a refusal)."""
        try:
            rids, counts = zip(*items, strict=True)
            rows = self._rows_of(rids) if set(map(type, counts)) == {int} else None
            if rows is not None:
                return rows, np.array(counts, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):  # no pairs, or a count past int64 (out of range)
            pass
        return self._rewind_items(items)

    def _rewind_items(self, items: Sequence[tuple[str, int]]) -> tuple[np.ndarray, np.ndarray]:
        """The table rows and kept tokens of ``rewind_many``'s items, each checked: a count lies between the
        tokens committed before the last step and the computed ones."""
        rows, keeps, seen = [], [], set()
        for item in items:
            try:
                request_id, num_tokens = item
            except (TypeError, ValueError):
                raise CacheManagerError(f"each item must be (request_id, num_tokens), got {item!r}") from None
            req = self._get(request_id)
            if request_id in seen:
                raise CacheManagerError(f"request {request_id!r} appears twice")
            seen.add(request_id)
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
                raise CacheManagerError(f"num_tokens must be an int, got {num_tokens!r}")
            num_tokens, row = int(num_tokens), req.row
            computed, committed = int(self._computed[row]), int(self._committed[row])
            if num_tokens > computed:
                raise CacheManagerError(
                    f"request {request_id!r}: cannot rewind forward to {num_tokens} (computed {computed})")
            if num_tokens < committed:
                raise CacheManagerError(f"request {request_id!r}: cannot rewind to {num_tokens}, below the "
                                        f"{committed} tokens committed before the last step")
            rows.append(row)
            keeps.append(num_tokens)
        return np.asarray(rows, dtype=np.int64), np.asarray(keeps, dtype=np.int64)

    def free(self, request_id: str) -> None:
        """End a request: commit its last step to the prefix cache, release every page."""
        self._version += 1  # invalidates a cached admission
        req = self._get(request_id)
        if self.tier_link is not None:
            self.tier_link.on_free(request_id)  # an unconfirmed load is rewound, not committed
        self._load_spans.pop(request_id, None)  # its load step's span
        if request_id in self._rewound_loads:
            self._rewound_loads.discard(request_id)
            self.pending_loads.discard(request_id)
        row, prefix, tables = req.row, self.prefix, self._tableset
        first_in_line = self._pages_past_hit(req) if req.thrash_hit_tokens >= 0 else None
        # Its pages leave the tables, one release, and its row of ``_by_row`` becomes 0 (its token ids go with it); first
        # its last step publishes when it completed a grain.
        if not self._space.free_row(tables, self._by_row, row, self._grain):
            self._one_row[0] = row
            self._commit_rows(self._one_row)
            self._space.free_row(tables, self._by_row, row, 0)
        if first_in_line and self._space.first_in_line(first_in_line):  # the thrash guard: what it published past
            prefix.thrash_guarded_requests += 1  # its hit is evicted next, not last
        if req.hit_checkpoints:  # the prefix cache's moved-past demotion
            prefix.note_moved_past(req)
        if prefix is not None and prefix.values is not None:  # else forgetting it changes nothing
            prefix.forget_request(req)
        del self._requests[request_id]
        del self._row_of[request_id]
        del self._row_owner[row]
        self._free_rows.append(row)  # it may stay in _last_rows: it never settles (see there)

    def _pages_past_hit(self, req: _Request) -> list[int]:
        """A request's pages from the one holding its first token past its hit (``req.thrash_hit_tokens``: the
        blocks and checkpoint it borrowed stay where they are) as ``PageSpace.first_in_line`` lists them: per group its
        index in the page space, its page count, its pages."""
        listed, row, hit_tokens = [], req.row, req.thrash_hit_tokens
        for index, spec in enumerate(self.specs):
            table = self.tables[spec.group_id]
            lo = max(int(table.base[row]), hit_tokens // table.page_tokens)
            pages = table.pages_in(row, lo, max(lo, int(table.hi[row]))).tolist()
            listed += (index, len(pages), *pages)
        return listed

    # --- observability -------------------------------------------------------
    def stats(self) -> dict[str, GroupStats]:
        return {gid: GroupStats(
            group_id=gid, total_pages=pool.usable_pages, free_pages=pool.num_free_pages, used_pages=pool.num_used_pages,
            peak_used_pages=pool.peak_used_pages, cached_pages=pool.num_cached_pages,
            utilization=pool.num_used_pages / pool.usable_pages if pool.usable_pages else 0.0,
            evictable_pages=pool.num_evictable_pages, **pool.counters.as_dict()) for gid, pool in self.pools.items()}

    def request_pages(self, request_id: str, group_id: str) -> tuple[int, np.ndarray]:
        """(base logical page, held page ids in logical order) of one request in one group."""
        req = self._get(request_id)
        table = self.tables.get(group_id) if isinstance(group_id, str) else None  # a list is no group (unhashable)
        if table is None:
            raise CacheManagerError(f"unknown group {group_id!r}; groups are {list(self.tables)}")
        base = int(table.base[req.row])
        return base, table.pages_in(req.row, base, table.hi[req.row])

    def hold_pages(self, local_pages: np.ndarray, pages_per_group: np.ndarray) -> None:
        """Hold pages (held or cached; twice listed, twice held) outside any request until
        :meth:`release_held_pages` (a tier offload's rows being copied), in one compiled call. The pages are
        listed group-major (int64 local ids, in ``specs`` order), ``pages_per_group[g]`` of group ``g``. Refused
        whole when an id is out of range or a page is free."""
        self._outside(local_pages, pages_per_group, self._space.hold_outside, "page ids must lie in [1, {n})",
                      "page {page} is free; only held or cached pages can be held")

    def release_held_pages(self, local_pages: np.ndarray, pages_per_group: np.ndarray) -> None:
        """Drop holds taken by :meth:`hold_pages` (as a step's release does), the pages listed as it lists
        them; refused whole when a page is released more often than it is held."""
        refusal = "releasing pages that hold_pages did not hold"
        self._outside(local_pages, pages_per_group, self._space.release_outside, refusal, refusal)

    def _outside(self, local_pages: Any, pages_per_group: Any, change: Any, range_error: str, refusal: str) -> None:
        """:meth:`hold_pages` or :meth:`release_held_pages` by ``change`` (``PageSpace.hold_outside`` or
        ``release_outside``, which refuse a mislisted list); ``range_error`` words a page out of range (``{n}``: its
        pool's page count), ``refusal`` one ``change`` refused (``{page}``: free, or released more than held)."""
        for name, a in (("local_pages", local_pages), ("pages_per_group", pages_per_group)):
            if not (type(a) is np.ndarray and a.dtype == _INT64 and a.ndim == 1):
                raise CacheManagerError(f"{name} must be a 1-D int64 array")
        found = change(local_pages, pages_per_group, self._space_limits, self._held_all)
        if found == kernels.MISLISTED:
            raise CacheManagerError(f"pages_per_group must hold {len(self._group_ids)} non-negative counts summing to "
                                    f"the number of pages listed, got {pages_per_group.tolist()}")
        if found < 0:  # -1 - the index of a page out of range, or -1 - the list's length - that of one refused
            bad, error = -1 - found, range_error
            if bad >= local_pages.size:
                bad, error = bad - local_pages.size, refusal
            gid = self._group_ids[int(np.searchsorted(np.cumsum(pages_per_group), bad, side="right"))]
            raise CacheManagerError(f"group {gid!r}: " + error.format(n=self.pools[gid].num_pages,
                                                                      page=int(local_pages[bad])))
        self._version += 1  # invalidates a cached admission

    def held_outside_pages(self, group_id: str) -> int:
        """Holds taken by :meth:`hold_pages` and not released (a page held twice counts twice)."""
        held = self._held_outside.get(group_id) if type(group_id) is str else None
        if held is None:
            raise CacheManagerError(f"unknown group {group_id!r}; groups are {list(self._held_outside)}")
        return int(held.sum())

    def clear_prefix_cache(self) -> None:
        """Unpublish every cached entry (pages held by requests stay held)."""
        self._version += 1  # invalidates a cached admission
        if self.prefix is not None:
            self.prefix.clear()

    def check_invariants(self) -> None:
        """Assert that ref counts equal the tables' holdings, pools are consistent, every row's token-id address
        is its request's and every prefix-cache hold is on a cached entry (:meth:`PrefixCache.check_holds`)."""
        assert self._row_of == {rid: req.row for rid, req in self._requests.items()}, "id -> row map is stale"
        assert np.array_equal(self._token_addresses(), self._token_addr), "a row's token-id address is stale"
        ts = self._tableset
        for gid in self._group_ids:
            table, pool = self.tables[gid], self.pools[gid]
            expected = np.zeros(pool.num_pages, dtype=np.int64)
            for req in self._requests.values():
                pages = table.pages_in(req.row, table.base[req.row], table.hi[req.row])
                assert np.all(pages > 0), f"{gid}: request {req.request_id} has a hole in its table"
                # A one-token step then needs at most one new page (schedule relies on it).
                assert table.hi[req.row] >= cdiv(int(self._computed[req.row]), table.page_tokens), (
                    f"{gid}: request {req.request_id} has computed tokens without pages")
                np.add.at(expected, pages, 1)
            expected += self._held_outside[gid]
            held = ts.bounds[kernels.HELD_PAGES:, table.group_index]  # the checkpoints rows hold (a page id, or 0)
            np.add.at(expected, held[held > 0], 1)
            assert np.array_equal(expected, pool.ref_counts), f"{gid}: ref counts differ from tables"
            for name in ("ref_counts", "cached", "low_priority"):  # still the page space's views
                assert np.shares_memory(getattr(pool, name), getattr(self._space, name)), f"{gid}: {name} rebound"
            pool.check_invariants()
            if self.prefix is not None:  # a commit asks no group for a key the eviction policy does not know
                assert all(map(self.prefix.eviction.knows, pool.entry_keys())), f"{gid}: a key without a node"
        if self.prefix is not None:
            self.prefix.check_holds(list(self._requests.values()))
        if self.arena is not None:
            self.arena.check_invariants()

    # --- helpers --------------------------------------------------------------
    def _token_addresses(self) -> np.ndarray:
        """What ``_token_addr`` must hold (appends write only into live requests' own token ids)."""
        addresses = np.zeros_like(self._token_addr)
        for req in self._requests.values():
            addresses[req.row] = 0 if req.token_ids is None else req.token_ids.ctypes.data
        return addresses

    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise CacheManagerError(f"unknown request {request_id!r}") from None

    def _take_row(self) -> int:
        """A new table row (``add_request`` reuses a free one first)."""
        row = self._next_row
        self._next_row += 1
        self._row_arrays.append(np.full(1, row, dtype=np.int64))
        self._state = None  # the table store and the counters may grow
        if row >= self._computed.size:
            self._set_by_row(np.concatenate([self._by_row, np.zeros_like(self._by_row)], axis=1))
            self._scratch.plan_arrays(2 * self._computed.size)  # room for any step's rows, grown here, not in a step
        self._tableset.ensure_rows(row + 1)
        return row


def _pages_per_group(ids: list[str], group_pages: Mapping[str, int] | None,
                     arena: ArenaGeometry | None) -> Mapping[str, int]:
    """Page ids per group: the arena's views, or ``group_pages``, checked against the groups."""
    if not ids:
        raise ValueError("a cache manager needs at least one cache group")
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate group ids in {ids}")
    if arena is not None:
        if set(arena.page_bytes) != set(ids):
            raise ValueError(f"arena groups {sorted(arena.page_bytes)} do not match the groups {sorted(ids)}")
        return {gid: arena.view_pages(gid) for gid in ids}
    if group_pages is None or set(group_pages) != set(ids):
        raise ValueError(f"group_pages keys {sorted(group_pages or {})} do not match the groups {sorted(ids)}")
    return group_pages


def _checked_widths(ids: list[str], table_widths: Mapping[str, int] | None) -> dict[str, int] | None:
    """The capture widths (table columns) per group: one positive int for every group, no other."""
    if table_widths is None:
        return None
    if set(table_widths) != set(ids):
        raise ValueError(f"table_widths keys {list(table_widths)} do not match the groups {ids}")
    return {gid: as_int(f"table_widths[{gid!r}]", table_widths[gid], minimum=1) for gid in ids}


_SECOND = itemgetter(1)


def _int_counts(pairs: list[tuple]) -> bool:
    """Whether every pair's second item is a plain int (``check_admission``'s verdict is kept and reused only then)."""
    try:
        return [*map(type, map(_SECOND, pairs))].count(int) == len(pairs)
    except IndexError:  # a tuple too short to be a pair
        return False


def _grants_to_fit(arena: Arena | None, ids: list[str], want: np.ndarray, avail: np.ndarray,
                   scan: IdleScan | None) -> list | None:
    """Slab moves that let each group (``ids``) get ``want`` pages out of ``avail`` (``[]``: fit already; None:
    cannot). Donors' slabs only with a ``scan``, else spare slabs alone."""
    if (want <= avail).all():
        return []
    if arena is None:
        return None
    deficit, surplus = want - avail, avail - want if scan is not None else np.zeros_like(want)
    if arena.surely_short(deficit, surplus):
        return None  # (the plan's scan is not clean: its donors give only their surplus)
    return arena.plan(dict(zip(ids, deficit.tolist())), dict(zip(ids, surplus.tolist())) if scan is not None else {},
                      scan)


def _check_step_options(ids: Sequence, block_tables: str, write_slots: bool) -> None:
    if block_tables not in _BLOCK_TABLE_MODES:
        raise CacheManagerError(f"block_tables must be one of {_BLOCK_TABLE_MODES}, got {block_tables!r}")
    if type(write_slots) is not bool:
        raise CacheManagerError(f"write_slots must be True or False, got {write_slots!r}")
    if not ids:
        raise CacheManagerError("empty batch")


_MAX_TOKEN_ID = int(np.iinfo(np.int32).max)


def _small_token_list(token_ids: Any) -> list[int] | None:
    """A short list of valid ids (decode), checked without numpy reductions; None otherwise."""
    if type(token_ids) is np.ndarray and token_ids.ndim == 1 and token_ids.size <= 16 and token_ids.dtype.kind in "iu":
        token_ids = token_ids.tolist()
    if type(token_ids) not in (list, tuple) or len(token_ids) > 16:
        return None
    for t in token_ids:
        if type(t) is not int or not 0 <= t <= _MAX_TOKEN_ID:
            return None  # the array path words the error
    return list(token_ids)


def _token_matrix(token_ids: Any, n: int) -> np.ndarray:
    """``append_token_ids_many``'s ids for ``n`` requests as an int32 ``[n, k]`` array, checked."""
    arr = _as_array(token_ids, f"token_ids must be [{n}, k] for {n} requests")
    if arr.ndim != 2 or arr.shape[0] != n:
        raise CacheManagerError(f"token_ids must be [{n}, k] for {n} requests, got {arr.shape}")
    return _token_array(arr.reshape(-1)).reshape(arr.shape)


def _as_array(values: Any, shape_rule: str) -> np.ndarray:
    """``np.asarray(values)``; a ragged nesting, which numpy refuses with its own ``ValueError``, is a
    ``CacheManagerError`` stating ``shape_rule``."""
    try:
        return np.asarray(values)
    except ValueError:
        raise CacheManagerError(f"{shape_rule}, got a ragged nesting of sequences") from None


def _token_array(token_ids: Any) -> np.ndarray:
    arr = _as_array(token_ids, "token ids must be 1-D")
    if arr.ndim != 1:
        raise CacheManagerError(f"token ids must be 1-D, got shape {arr.shape}")
    kind = arr.dtype.kind
    if arr.size and kind not in "iu":
        raise CacheManagerError(f"token ids must be integers, got dtype {arr.dtype}")
    # Signed ids of at most 32 bits cannot pass the top of the range, unsigned ones cannot go below 0.
    if arr.size and ((kind == "i" and arr.min() < 0)
                     or ((kind == "u" or arr.dtype.itemsize > 4) and arr.max() > _MAX_TOKEN_ID)):
        raise CacheManagerError("token ids must be in [0, 2**31)")
    return arr.astype(np.int32, copy=False)
