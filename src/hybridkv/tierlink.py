"""The manager drives movement between its device pages and a KV tier; the engine moves bytes.

A :class:`TierLink` joins a ``CacheManager`` (with prefix caching) to an
:class:`~hybridkv.tiers.store.ObjectStore`. Object keys are the manager's own
chained prefix hashes (one per grain block), so every manager with the same
hash algorithm, grain and layout names the same content the same way.

**Offload.** The prefix cache tells the link what it publishes and what it
removes. An entry *evicted* from the device (its pages about to be reused)
becomes an offload: a history block's rows (``kind = "block"``, tokens
``[D - G, D)``) or a checkpoint's trailing rows only (``kind = "checkpoint"``,
tokens ``[D - W, D)``, ``W`` the group's checkpoint window). With
``write_through`` every entry is offloaded when it is published instead
(low-priority prompt checkpoints excepted). A checkpoint that is *dropped*
(superseded by the request's next one, or the cache cleared) is not
offloaded. :meth:`TierLink.take_offloads` hands the engine one
:class:`~hybridkv.transfer.OffloadPlan` for everything gathered since the last
call, less the objects the store already holds (one ``contains``; with
``defer_offloads``, a plan whose every entry is deferred asks when it runs
instead, on the offload worker). The engine
runs it **before it writes any page** the manager handed out since (a step's,
or a load's): until then the evicted pages still hold their rows.

**Load.** When ``add_request``'s device hit ``D0`` is shorter than what the
store serves, the link finds, by ``contains``, the longest grain boundary
``D`` with every history block in ``[D0, D)`` and a checkpoint at ``D`` in
every state group (the device rule: history below, checkpoint at), at most
``max_step_tokens`` past ``D0``. The request is then *pending*:
``schedule`` and ``check_admission`` refuse it. :meth:`TierLink.take_loads`
gives it pages for tokens ``[D0, D)`` (a *load step* of ``D - D0`` tokens of
that request alone, ``schedule(..., load=True)``: history groups get pages for
the whole span, sliding groups only those of the checkpoint at ``D``, as a
device hit at ``D`` holds; the engine computes nothing for it; a load that does
not fit alone is cut to the longest served boundary that does, the rest
planned after it) and returns a :class:`PendingLoad` per request: a
:class:`~hybridkv.transfer.LoadPlan` and the pages to load into. The engine
runs the offloads, then the loads, and reports each with
:meth:`TierLink.confirm_load`:

* ``D`` loaded: the request holds ``D`` computed tokens and may be scheduled
  (or it is pending again when the store serves more, past ``max_step_tokens``);
* anything less (a missing or corrupted object: the load wrote nothing): the
  request goes back to its device hit and is planned again below ``D`` (the
  objects that failed verification were deleted from the store, so the new
  plan is the usable prefix that is left); never wrong rows.

While a load is taken and not confirmed, ``schedule`` refuses every batch (a
step would commit the unloaded tokens). ``free`` of a pending request drops
its load.

**In flight** (``in_flight=InFlightRule(...)``, :mod:`hybridkv.inflight`). A
request that will compute blocks puts a *computing* marker in the store under
each of them that is neither held (device or store) nor marked by another
request; the marker goes when the block is published (at the second
:meth:`TierLink.take_offloads` after, once the engine has put it) or when the
request is freed, and expires after ``ttl`` in any case. A request whose next
block carries another request's live marker (any instance's: one rule for all)
*waits* instead of computing: it is pending, puts a *wanted* marker at the
boundary where its prompt leaves the marked (or held) blocks, and
:meth:`TierLink.resume_waits` (which ``take_loads()`` calls) matches it again
(device, then store) once that marker is gone or after ``wait`` in all. With
markers, write-through puts a checkpoint (low-priority prompt boundaries
included) only when a wanted marker asks for it or as the last one of a
request that is freed; history blocks still go when committed. A request that
finds blocks in the store but no checkpoint among them asks for the checkpoint
it needs on the *wanted board* and waits (the same bound); every link reads the
board at ``take_offloads`` and writes through the listed checkpoints its
device holds. A load cut for pages asks for nothing (no device holds a
checkpoint where the free pages ran out): it is dropped when the store serves
no boundary below the cut. Markers only delay a request; rows come from verified objects
or the device as always. What the link knows of its markers and waits is kept
in an :class:`~hybridkv.inflight_state.InFlightState`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import chain
from typing import Any

import numpy as np

from hybridkv.inflight import InFlightRule, Markers
from hybridkv.inflight_state import InFlightState
from hybridkv.runtime.manager import CacheManagerError
from hybridkv.tiers.keys import ObjectKey, name_prefix, store_names
from hybridkv.tiers.pools import GroupPools, layout_parts
from hybridkv.tiers.rows import GroupPages, rows_for_tokens
from hybridkv.tiers.store import ObjectStore
from hybridkv.tiers.worker import OffloadWorker
from hybridkv.transfer import (DeferredCopies, LoadPlan, LoadResult, OffloadPlan, PlannedObject, PlanParts,
                               StoreCheck, pages_from_manager)


_NO_OFFLOADS = OffloadPlan((), ())


class TierLinkError(CacheManagerError):
    """A misuse of the link: an unknown load, a schedule while a load is in flight."""


@dataclass(frozen=True)
class PendingLoad:
    """A request's load: ``plan``'s objects into ``targets`` (its pages after admission)."""

    request_id: str
    from_tokens: int  # what the request held before (its device hit)
    plan: LoadPlan
    targets: dict[str, GroupPages]

    @property
    def boundary_tokens(self) -> int:
        return self.plan.boundary_tokens


@dataclass
class TierLinkStats:
    planned_loads: int = 0  # requests found to hit past the device
    denied_loads: int = 0  # no pages for the whole load alone (cut, or dropped)
    shortened_loads: int = 0  # of those, planned again to the longest boundary that fits (the rest later)
    taken_loads: int = 0
    confirmed_loads: int = 0
    failed_loads: int = 0  # confirmed short: the request went back to its device hit
    loaded_tokens: int = 0  # tokens gained by confirmed loads
    offload_objects: int = 0  # objects handed to the engine
    offload_bytes: int = 0  # their payload bytes (rows only)
    offload_skipped: int = 0  # objects the store already held
    offload_pinned: int = 0  # handed out with their pages held for a later copy (pin_offloads)
    offload_deferred: int = 0  # handed out for a later copy without a hold (defer_offloads)
    offload_rescues: int = 0  # of those, removed from the cache before confirmed: copied at the next plan if not yet
    offload_stored: int = 0  # confirmed stored by a tier (confirm_offloads)
    offload_refused: int = 0  # confirmed, no tier stored them
    offload_dropped: int = 0  # confirmed dropped or failed (a full worker queue, a fault): never stored
    pinned_pages: int = 0  # pages held now for offloads not confirmed yet
    load_objects: int = 0
    load_bytes: int = 0
    waits: int = 0  # requests that waited for blocks another request was computing (each wait once)
    waited_out: int = 0  # of those, resumed by the bound on waiting with the marker still live
    markers_put: int = 0  # computing markers put
    wanted_checkpoints: int = 0  # checkpoints offloaded because a waiter asked for them
    checkpoint_waits: int = 0  # times a request waited for a checkpoint another device may hold


@dataclass
class _Plan:
    from_tokens: int
    boundary_tokens: int
    objects: tuple[PlannedObject, ...]
    taken: bool = False


@dataclass
class _Args:
    hashes: Any  # the request's RequestHashes
    token_ids: np.ndarray
    max_new_tokens: int
    cache_salt: Any


def _checked_results(results: Any) -> list[tuple[int | None, list]]:
    """``confirm_offloads``' results as ``(ticket, list of per-object results)`` pairs, or a ``TierLinkError``
    before any plan is confirmed (one confirmed and then a malformed one would leave its pins held for good)."""
    try:
        checked = [(ticket, list(stored)) for ticket, stored in results]
    except (TypeError, ValueError):
        checked = None
    if checked is None or not all(ticket is None or isinstance(ticket, (int, np.integer)) for ticket, _ in checked):
        raise TierLinkError("confirm_offloads takes (ticket, per-object results) pairs, as OffloadWorker.finished() "
                            f"gives them, got {results!r}")
    return checked


def _id_set(request_ids: Any) -> set:
    """``take_loads``' request ids as a set: refused when a str (it would read as its characters) or not an
    iterable of hashable ids."""
    try:
        if not isinstance(request_ids, (str, bytes)):
            return set(request_ids)
    except TypeError:
        pass
    raise TierLinkError(f"request_ids must be a sequence of request ids, got {request_ids!r}")


class TierLink:
    """Offload and load plans between one manager's prefix cache and ``store``.

    ``write_through``: offload entries when published, not when evicted.
    ``offload_low_priority``: also offload evicted low-priority prompt checkpoints
    (published at every prompt boundary in case another request leaves there).
    ``in_flight``: mark the blocks a request computes and let a request wait for the
    blocks another is computing (None: never wait).
    ``pin_offloads``: hold the pages of entries still published until
    :meth:`confirm_offloads` (their copy may run off the step), at most
    ``max_pinned_pages`` at once. ``defer_offloads`` (instead of pinning): entries still
    published are copied later without a hold; one removed from the cache before the worker
    copied it is copied at the next plan, on the step thread (:class:`~hybridkv.transfer.DeferredCopies`).
    ``plan_loads=False``: offload only, never load.
    """

    def __init__(self, store: ObjectStore, *, write_through: bool = False, offload_low_priority: bool = False,
                 in_flight: InFlightRule | None = None, pin_offloads: bool = False,
                 max_pinned_pages: int | None = None, plan_loads: bool = True, defer_offloads: bool = False):
        if not isinstance(store, ObjectStore):
            raise TypeError(f"store must be an ObjectStore, got {type(store).__name__}")
        if in_flight is not None and not isinstance(in_flight, InFlightRule):
            raise TypeError(f"in_flight must be an InFlightRule or None, got {type(in_flight).__name__}")
        if max_pinned_pages is not None and (isinstance(max_pinned_pages, bool) or not isinstance(max_pinned_pages, int)
                                             or max_pinned_pages < 0):
            raise ValueError(f"max_pinned_pages must be a non-negative int or None, got {max_pinned_pages!r}")
        if pin_offloads and defer_offloads:
            raise ValueError("pin_offloads and defer_offloads exclude each other: choose one")
        self._flight = InFlightState(Markers(store.tier, store.namespace, in_flight) if in_flight else None)
        self.store = store
        self.write_through = bool(write_through)
        self.offload_low_priority = bool(offload_low_priority)
        self.pin_offloads = bool(pin_offloads)
        self.defer_offloads = bool(defer_offloads)
        self._deferred: dict[tuple[str, int], tuple[DeferredCopies, int]] = {}  # entry -> its copy, in flight
        self._rescues: list[tuple[DeferredCopies, int]] = []  # deferred entries removed since the last plan
        self.plan_loads = bool(plan_loads)  # False: offload only (nothing is ever pending)
        self.max_pinned_pages = max_pinned_pages
        self._tickets = 0
        self._jobs_out = 0  # jobs offload_step submitted whose results it has not confirmed
        # ticket -> (pinned pages as CacheManager.hold_pages takes them or None, pinned or deferred
        # entries, every entry of the plan in order, its StoreCheck or None, each entry's payload bytes)
        self._pins: dict[int, tuple[tuple[np.ndarray, np.ndarray] | None, list, list, StoreCheck | None,
                                    list[int]]] = {}
        # Entries of plans not confirmed yet (pinned, deferred or copied): not offered again, so an
        # entry published twice while its first copy is on its way is copied once.
        self._offloading: set[tuple[str, int]] = set()
        self._sent: set[tuple[str, int]] = set()  # device entries a tier confirmed stored
        self.manager: Any = None
        self._scheduling = False  # take_loads' own step
        # True while a taken load may be unconfirmed: ``schedule`` asks check_schedule only then
        self.loads_in_flight = False
        self._stats = TierLinkStats()
        self._entries: dict[tuple[str, int], tuple[int, tuple[int, ...], bool]] = {}
        self._queue: list[tuple[str, int, int, tuple[int, ...]]] = []
        self._plans: dict[str, _Plan] = {}
        self._args: dict[str, _Args] = {}
        self._below: dict[str, int] = {}  # re-plans after a failed load stay below it
        self._row_bytes = {g.group_id: sum(size for _, _, size in layout_parts(store.layout, g.group_id))
                           for g in store.layout.groups}

    @property
    def markers(self) -> Markers | None:
        """The link's markers in the store (None without an in-flight rule)."""
        return self._flight.markers

    # --- wiring (called by CacheManager and PrefixCache) ---------------------------
    def attach(self, manager: Any) -> None:
        """Bind to ``manager`` (its constructor calls this): checks the layout, hooks the prefix cache."""
        if self.manager is not None:
            raise TierLinkError("this TierLink is attached to another manager already")
        if manager.prefix is None:
            raise TierLinkError("a tier link needs prefix caching (enable_prefix_caching=True)")
        layout = self.store.layout
        for spec in manager.specs:
            try:
                other = layout.group(spec.group_id).spec
            except (KeyError, ValueError):
                raise TierLinkError(f"group {spec.group_id!r} is not in the store's layout {layout.name}") from None
            mine = (spec.page_tokens, spec.rows_per_page, spec.entry_stride_tokens, spec.is_sliding)
            theirs = (other.page_tokens, other.rows_per_page, other.entry_stride_tokens, other.is_sliding)
            if mine != theirs:
                raise TierLinkError(f"group {spec.group_id!r}: manager geometry {mine} differs from the store's {theirs}")
        self.manager = manager
        self._prefix = manager.prefix
        self._first_history = manager.prefix.history_ids[0] if manager.prefix.history_ids else None
        self._state_ids = frozenset(manager.prefix.state_ids)
        self._specs = {s.group_id: s for s in manager.specs}
        self._kinds = {s.group_id: "checkpoint" if s.is_sliding else "block" for s in manager.specs}
        # per group: (object kind, tokens before the boundary an object holds: a block's G, a checkpoint's W,
        # page tokens, entry stride tokens, row bytes), for _take_queue and _offload_objects
        self._offload_shapes = {
            s.group_id: (self._kinds[s.group_id],
                         self._prefix.checkpoint_windows.get(s.group_id, 0) if s.is_sliding
                         else self._prefix.granularity_tokens,
                         s.page_tokens, s.entry_stride_tokens, self._row_bytes[s.group_id])
            for s in manager.specs}
        # per group: what its objects' store names start with (``ObjectStore.name`` less the key's hex)
        self._name_prefixes = {gid: name_prefix(self.store.namespace, gid, kind) for gid, kind in self._kinds.items()}
        self._group_order = tuple(s.group_id for s in manager.specs)  # CacheManager.hold_pages' group order
        self._prefix.tier_hook = self

    def stored(self, published: Iterable[tuple[str, int, int, Sequence[int], bool]]) -> None:
        """The prefix cache published entries ``(group, key, boundary tokens, pages, low
        priority)`` (a block ending at, or a checkpoint at, the boundary), in order: one call a
        commit's group or state boundaries (``PrefixCache``'s ``tier_hook``)."""
        entries = self._entries
        if self._flight.markers is not None:
            for gid, key, boundary, pages, low in published:
                pages = tuple(pages)
                entries[(gid, key)] = (boundary, pages, low)
                self._stored_marked(gid, key, boundary, pages, low)
            return
        queue = self._queue if self.write_through else None  # (most links: no in-flight rule)
        for gid, key, boundary, pages, low in published:
            pages = tuple(pages)
            entries[(gid, key)] = (boundary, pages, low)
            if queue is not None and not low:
                queue.append((gid, key, boundary, pages))

    def _stored_marked(self, group_id: str, key: int, boundary_tokens: int, pages: tuple[int, ...],
                       low_priority: bool) -> None:
        """:meth:`stored` of one entry with an in-flight rule: a written-through checkpoint goes
        when wanted or as its request's last."""
        flight = self._flight
        if self.write_through and group_id in self._state_ids:
            flight.fresh.append((group_id, key))
        elif self.write_through and not low_priority:
            self._queue.append((group_id, key, boundary_tokens, pages))
        if group_id == self._first_history:
            flight.published(key)

    def removed(self, names: Iterable[tuple[str, int]], dropped: bool) -> None:
        """The prefix cache removed the entries ``(group, key)``, in order: evicted (``dropped``
        False) or superseded/cleared; one call a batch of removals (``PrefixCache``'s
        ``tier_hook``)."""
        entries, served, deferred, sent = self._entries, self._flight.served, self._deferred, self._sent
        for name in names:
            entry = entries.pop(name, None)
            served.discard(name)
            if deferred:
                copies = deferred.pop(name, None)
                if copies is not None:  # its pages may be written after the next plan: copied then
                    self._rescues.append(copies)
                    self._stats.offload_rescues += 1
            if name in sent:  # written through already: nothing to move at eviction
                sent.discard(name)
                continue
            if entry is None or dropped:
                continue
            boundary, pages, low = entry
            if not low or self.offload_low_priority:
                self._queue.append((*name, boundary, pages))

    def on_add(self, request_id: str, hashes: Any, token_ids: np.ndarray, hit_tokens: int,
               max_new_tokens: int, cache_salt: Any) -> None:
        """After ``add_request``'s device match: plan a load when the store serves more."""
        if hashes is None or not self.plan_loads:
            return
        self._args[request_id] = _Args(hashes, token_ids, max_new_tokens, cache_salt)
        self._plan_load(request_id, hashes, token_ids.size, hit_tokens)
        if self.markers is not None and request_id not in self._plans:
            self._mark_or_wait(request_id, hit_tokens)

    def on_free(self, request_id: str) -> None:
        """Before ``free``: a taken, unconfirmed load goes back to the device hit (nothing unloaded is
        committed); the request's computing markers go."""
        plan = self._plans.pop(request_id, None)
        self.manager.pending_loads.discard(request_id)
        args = self._args.pop(request_id, None)
        self._below.pop(request_id, None)
        self._flight.forget(request_id)
        if plan is not None and plan.taken:
            self.loads_in_flight = any(p.taken for p in self._plans.values())
            self.manager.rewind(request_id, plan.from_tokens)
        if self._flight.on and self.write_through and args is not None and not self._flight.resuming:
            # its last checkpoint (published now or before) goes through at the next take_offloads
            grain = self._prefix.granularity_tokens
            self._flight.ending.append((args.hashes, self.manager.num_computed_tokens(request_id) // grain * grain))

    def check_schedule(self) -> None:
        """Called by ``schedule`` while ``loads_in_flight``: refuse while a taken load is not confirmed."""
        if self._scheduling:
            return
        for rid, plan in self._plans.items():
            if plan.taken:
                raise TierLinkError(
                    f"request {rid!r} has a tier load in flight: confirm_load() it before the next step"
                )

    # --- the engine's side -----------------------------------------------------
    def pending(self, request_id: str) -> bool:
        """Whether ``request_id`` waits for a load, or for blocks another request computes
        (``schedule`` refuses it; ``take_loads`` moves it on)."""
        return request_id in self._plans or request_id in self._flight.waiting

    def waiting(self, request_id: str) -> bool:
        """Whether ``request_id`` waits for blocks another request is computing."""
        return request_id in self._flight.waiting

    def take_offloads(self) -> OffloadPlan:
        """Everything evicted (or, with write-through, published) since the last call, less what
        the store holds. Unpinned objects: copy them before writing any page handed out since.
        With ``pin_offloads``, entries still published keep their pages held (pinned) until
        :meth:`confirm_offloads` reports the plan's ticket, so their copy may run later."""
        if not self._queue and not self._rescues and self._flight.markers is None:
            return _NO_OFFLOADS  # most steps: nothing queued (no plan, no ticket)
        if self._flight.markers is not None:
            self.markers.delete_deferred()
            self._queue_ending()
            self._queue_wanted()
            self._queue_board()
            self._flight.retire()
        rescues, self._rescues = tuple(self._rescues), []
        plan = self._take_queue()
        if rescues:
            plan = replace(plan, rescues=rescues)
        return plan

    def _take_queue(self) -> OffloadPlan:
        """The plan of the queued entries (see :meth:`take_offloads`), without rescues; its objects
        and page views are made on first use (``PlanParts``: on the worker, for a plan copied
        later). With ``defer_offloads``, a plan whose every entry is deferred asks the store when
        it runs (on the worker) instead of now: it holds no page meanwhile. (A pinned plan asks
        now: a pin on what the store holds would change what the manager evicts.)"""
        entries, later = self._fresh_entries(self.pin_offloads or self.defer_offloads)
        if not entries:
            return _NO_OFFLOADS
        check = StoreCheck(self.store) if self.defer_offloads and all(later) else None
        if check is None:
            entries, later = self._not_stored(entries, later)
            if not entries:
                return _NO_OFFLOADS
            if self.pin_offloads and self.max_pinned_pages is not None:
                later = self._within_room(entries, later)
        parts = PlanParts(len(entries), partial(_offload_parts, self._offload_shapes, entries))
        if later is not None:
            return self._hand_out(entries, later, parts.objects, parts.sources, check)
        self._count_offloads(entries)
        self._tickets += 1
        return OffloadPlan(parts.objects, parts.sources, (), self._tickets)

    def _not_stored(self, entries: list[tuple[tuple[str, int], tuple[int, tuple[int, ...]]]], later: list[bool] | None
                    ) -> tuple[list[tuple[tuple[str, int], tuple[int, tuple[int, ...]]]], list[bool] | None]:
        """``entries`` (and their ``later`` flags) less those whose objects the store holds (one
        ``contains`` of the tier, by the names ``ObjectStore.name`` gives their keys; counted as
        skipped)."""
        held = self.store.tier.contains(store_names(self._name_prefixes, [entry for entry, _ in entries]))
        if True not in held:
            return entries, later
        keep = [entry for entry, h in zip(entries, held) if not h]
        self._stats.offload_skipped += len(entries) - len(keep)
        return keep, None if later is None else [ok for ok, h in zip(later, held) if not h]

    def _fresh_entries(self, published: bool) -> tuple[list[tuple[tuple[str, int], tuple[int, tuple[int, ...]]]],
                                                       list[bool] | None]:
        """The queue emptied: its entries ``((group, key), (boundary, pages))``, the first of each,
        less those whose copy is still in flight; with ``published``, per entry whether its copy
        may run later: it is still published with the pages it was queued with (an evicted
        entry's pages may be reused already). One pass."""
        queue, self._queue = self._queue, []
        fresh: dict[tuple[str, int], tuple[int, tuple[int, ...]]] = {}
        offloading, pools = self._offloading, self.manager.pools
        later: list[bool] | None = [] if published else None
        for gid, key, boundary, pages in queue:
            entry = (gid, key)
            if entry not in fresh and entry not in offloading:
                fresh[entry] = (boundary, pages)
                if published:
                    later.append(pools[gid].lookup(key) == pages)
        return list(fresh.items()), later

    def _within_room(self, entries: list[tuple[tuple[str, int], tuple[int, tuple[int, ...]]]], later: list[bool]
                     ) -> list[bool]:
        """``later`` less the pins past ``max_pinned_pages``, in order."""
        room, out = self.max_pinned_pages - self._stats.pinned_pages, []
        for (_, (_, pages)), ok in zip(entries, later):
            ok = ok and len(pages) <= room
            if ok:
                room -= len(pages)
            out.append(ok)
        return out

    def _hand_out(self, entries: list, later: list[bool], objects: Sequence[PlannedObject],
                  views: Sequence[GroupPages], check: StoreCheck | None) -> OffloadPlan:
        """The plan of ``entries`` under a new ticket, recorded until confirmed (and counted:
        :meth:`_count_offloads`); the ``later`` ones pinned (their pages held, every group's in
        one ``CacheManager.hold_pages`` array built in the same pass and kept for the release)
        or deferred (copied later without a hold, rescued if removed first). Recorded even
        with nothing later: what a tier stores need not move again at eviction."""
        self._tickets += 1
        ticket, stats, pin = self._tickets, self._stats, self.pin_offloads
        payload_bytes = self._count_offloads(entries)
        every, keys, by_group = [], [], {}
        for (entry, (_, pages)), ok in zip(entries, later):
            every.append(entry)
            if ok:
                keys.append(entry)
                if pin:
                    by_group.setdefault(entry[0], []).extend(pages)
        held = None
        if pin:
            if by_group:
                counts = [len(by_group.get(gid, ())) for gid in self._group_order]
                for gid in self._group_order:  # the pages group-major, in the manager's order, after the counts
                    counts += by_group.get(gid, ())
                both, n_groups = np.array(counts, dtype=np.int64), len(self._group_order)
                held = both[n_groups:], both[:n_groups]  # one array made: the pages, the count per group
                self.manager.hold_pages(*held)
                stats.pinned_pages += both.size - n_groups
            stats.offload_pinned += len(keys)
            plan = OffloadPlan(objects, views, tuple(later), ticket, store_check=check)
        else:
            indices = [i for i, ok in enumerate(later) if ok]
            copies = DeferredCopies(objects, views, indices) if indices else None
            deferred = self._deferred
            for i in indices:
                deferred[every[i]] = (copies, i)
            stats.offload_deferred += len(keys)
            plan = OffloadPlan(objects, views, (), ticket, tuple(later), copies, store_check=check)
        self._pins[ticket] = (held, keys, every, check, payload_bytes)
        self._offloading.update(every)
        return plan

    def offload_step(self, worker: OffloadWorker, pools: Mapping[str, GroupPools]) -> bool:
        """A step's offload work in one call, before the forward: :meth:`confirm_offloads` of what
        ``worker`` finished, :meth:`take_offloads`, and ``OffloadPlan.submit`` of the plan to
        ``worker`` (``pools``: the device pages' bytes). With no job of this call's in flight and
        nothing queued (most steps) it returns at once. False: the plan was dropped (the
        worker's queue was full; its ticket comes back as any other). An engine uses this call
        or the three, not both: the results it confirms are those of the jobs it submitted."""
        if not self._jobs_out and not self._queue and not self._rescues and self._flight.markers is None:
            return True
        if self._jobs_out:
            results = worker.finished()
            if results:
                self._jobs_out -= len(results)
                self.confirm_offloads(results)
        plan = self.take_offloads()
        if plan is _NO_OFFLOADS:
            return True
        if len(plan.objects):  # (a plan of rescues alone queues no job)
            self._jobs_out += 1
        return plan.submit(worker, pools)

    def confirm_offloads(self, results: Iterable[tuple[int | None, Sequence[bool | None]]]) -> None:
        """Report offload plans the engine has run: ``(ticket, per object True stored, False
        refused by the tier, None dropped or failed)`` each, as ``OffloadWorker.finished()`` gives
        them. The pages pinned for a plan are released (those no request holds go back to the
        pool), those of every plan reported in one ``CacheManager.release_held_pages`` (group-major,
        each group's plan after plan); an unknown ticket (a plan with nothing pinned) only counts."""
        if isinstance(results, list) and not results:
            return  # most steps: no plan finished
        released: list[tuple[np.ndarray, np.ndarray]] = []
        for ticket, stored in _checked_results(results):  # all checked first: a plan confirmed releases its pins
            held = self._confirm_plan(ticket, stored)
            if held is not None:
                released.append(held)
        if not released:
            return
        if len(released) == 1:  # (most calls: one plan)
            local, per_group = released[0]
        else:  # each plan's pages group-major: merged group by group, plans in order (a stable sort by group)
            local = np.concatenate([pages for pages, _ in released])
            counts = np.stack([n for _, n in released])
            groups = np.repeat(np.tile(np.arange(counts.shape[1]), counts.shape[0]), counts.ravel())
            local, per_group = local[np.argsort(groups, kind="stable")], counts.sum(axis=0)
        self.manager.release_held_pages(local, per_group)
        self._stats.pinned_pages -= local.size

    def _confirm_plan(self, ticket: int | None, stored: list[bool | None]) -> tuple[np.ndarray, np.ndarray] | None:
        """Count a confirmed plan's results; settle its entries (the stored ones sent, none
        offloading or deferred any more); its pinned pages (as ``CacheManager.hold_pages``
        took them), None if none."""
        stats = self._stats
        pins = self._pins.pop(ticket, None) if ticket is not None else None
        n_stored, n_refused = stored.count(True), stored.count(False)
        counted = (n_stored, n_refused, len(stored) - n_stored - n_refused)
        if pins is not None and pins[3] is not None and pins[3].held:
            counted = self._uncount_held(stored, pins, counted)
        stats.offload_stored += counted[0]
        stats.offload_refused += counted[1]
        stats.offload_dropped += counted[2]
        if pins is None:
            return None
        held, keys, every, _, _ = pins
        if n_stored == len(every):  # (most plans: every object stored)
            self._sent.update(self._entries.keys() & every)
        elif n_stored:
            entries = self._entries
            self._sent.update(entry for entry, ok in zip(every, stored) if ok is True and entry in entries)
        self._offloading.difference_update(every)
        if self._deferred:
            for entry in keys:
                self._deferred.pop(entry, None)
        return held

    def _uncount_held(self, stored: list[bool | None], pins: tuple, counted: tuple[int, int, int]
                      ) -> tuple[int, int, int]:
        """A plan's ``counted`` results less the objects its store check found held: those are
        counted as skipped, as a take that asked would have, not as handed out."""
        stats, held = self._stats, pins[3].held
        skipped = [stored[i] for i in held]
        stats.offload_skipped += len(held)
        stats.offload_objects -= len(held)
        stats.offload_bytes -= sum(pins[4][i] for i in held)
        return (counted[0] - skipped.count(True), counted[1] - skipped.count(False),
                counted[2] - skipped.count(None))

    def take_loads(self, request_ids: Iterable[str] | None = None) -> list[PendingLoad]:
        """Pages for the planned loads (one step of those requests, nothing computed) and the
        plans. Without ``request_ids``, after resuming the waiting requests whose wait is over
        (:meth:`resume_waits`), every planned load; with them, only theirs (an engine building a
        batch takes one request's load without touching the others' pages).
        Loads are admitted in plan order while they fit together; one that fits alone but not
        beside those stays planned for the next call; one that does not fit alone is planned
        again to the longest boundary the store serves whose load fits alone (taken now when it
        fits beside the others; the rest of the hit comes in the next rounds); when none does,
        it is dropped: the request keeps its device hit. Run :meth:`take_offloads` and its plan
        first (the step may have evicted pages)."""
        if any(p.taken for p in self._plans.values()):
            raise TierLinkError("confirm_load() the loads taken before taking more")
        if request_ids is None:
            self.resume_waits()
            rids = list(self._plans)
        else:
            wanted = _id_set(request_ids)
            rids = [rid for rid in self._plans if rid in wanted]
        items = self._admit_loads(rids)
        if not items:
            return []
        mgr = self.manager
        self._scheduling = True
        try:
            mgr.schedule(items, write_slots=False, load=True)
        finally:
            self._scheduling = False
        out = []
        for rid, _ in items:
            plan = self._plans[rid]
            plan.taken = True
            self.loads_in_flight = True
            mgr.pending_loads.add(rid)
            self._stats.taken_loads += 1
            self._stats.load_objects += len(plan.objects)
            self._stats.load_bytes += sum(self.object_payload_bytes(o) for o in plan.objects)
            load = LoadPlan(plan.objects, (plan.boundary_tokens,))
            out.append(PendingLoad(rid, plan.from_tokens, load, pages_from_manager(mgr, rid)))
        return out

    def _admit_loads(self, rids: Sequence[str]) -> list[tuple[str, int]]:
        """The loads of ``rids`` admission takes together, in order; the ones that fit alone stay planned."""
        mgr = self.manager
        items = [(rid, self._plans[rid].boundary_tokens - self._plans[rid].from_tokens) for rid in rids]
        mgr.pending_loads.difference_update(rid for rid, _ in items)
        if items and all(a.ok for a in mgr.check_admission(items, load=True)):
            return items
        taken: list[tuple[str, int]] = []
        for item in items:
            if all(a.ok for a in mgr.check_admission(taken + [item], load=True)):
                taken.append(item)
            elif mgr.check_admission([item], load=True)[0].ok:
                mgr.pending_loads.add(item[0])  # for the next call
            else:
                plan = self._plans.pop(item[0])
                self._stats.denied_loads += 1
                shorter = self._plan_shorter(item[0], plan)
                if shorter is not None:  # taken now when it fits beside the others, else next call
                    mgr.pending_loads.discard(item[0])
                    if all(a.ok for a in mgr.check_admission(taken + [shorter], load=True)):
                        taken.append(shorter)
                    else:
                        mgr.pending_loads.add(item[0])
        return taken

    def _plan_shorter(self, request_id: str, plan: _Plan) -> tuple[str, int] | None:
        """``plan`` does not fit alone: plan the longest load that does (a shorter boundary the
        store serves; the rest comes in the next rounds), or None: the request keeps its device
        hit. It never waits for a checkpoint at the boundary that fits: that boundary is where
        the free pages ran out, which no request chose, so no device holds a checkpoint there."""
        grain = self._prefix.granularity_tokens
        fit = self._fitting_grains(request_id, (plan.boundary_tokens - plan.from_tokens) // grain - 1)
        if fit == 0:
            return None
        cap = plan.from_tokens + fit * grain
        args = self._args[request_id]
        self._plan_load(request_id, args.hashes, args.token_ids.size, plan.from_tokens, cap_tokens=cap)
        if request_id in self._plans:
            self._stats.shortened_loads += 1
            return request_id, self._plans[request_id].boundary_tokens - plan.from_tokens
        return None

    def _fitting_grains(self, request_id: str, most: int) -> int:
        """The most grains (at most ``most``) a step of ``request_id`` alone is admitted for."""
        grain, lo, hi = self._prefix.granularity_tokens, 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.manager.check_admission([(request_id, mid * grain)], load=True)[0].ok:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def confirm_load(self, request_id: str, result: LoadResult | int) -> int:
        """Report a taken load: its ``LoadResult`` (or the tokens it loaded). Returns the request's
        computed tokens now; check :meth:`pending` for a further load."""
        plan = self._plans.get(request_id) if isinstance(request_id, str) else None
        if plan is None or not plan.taken:
            raise TierLinkError(f"request {request_id!r} has no tier load in flight")
        if isinstance(result, bool) or not isinstance(result, (LoadResult, int, np.integer)):
            raise TierLinkError(f"result must be a LoadResult or the tokens loaded (an int), got {result!r}")
        loaded = result.boundary_tokens if isinstance(result, LoadResult) else int(result)
        del self._plans[request_id]
        self.loads_in_flight = any(p.taken for p in self._plans.values())
        self.manager.pending_loads.discard(request_id)
        mgr = self.manager
        if loaded == plan.boundary_tokens:
            self._stats.confirmed_loads += 1
            self._flight.loaded_since_add.add(request_id)
            self._stats.loaded_tokens += loaded - plan.from_tokens
            args = self._args[request_id]
            self._plan_load(request_id, args.hashes, args.token_ids.size, loaded)
            if self.markers is not None and request_id not in self._plans:
                self._mark_or_wait(request_id, loaded)
            return mgr.num_computed_tokens(request_id)
        self._stats.failed_loads += 1
        args = self._args[request_id]
        mgr.rewind(request_id, plan.from_tokens)
        mgr.free(request_id)
        self._below[request_id] = plan.boundary_tokens
        try:
            mgr.add_request(request_id, args.token_ids, max_new_tokens=args.max_new_tokens,
                            cache_salt=args.cache_salt)
        finally:
            self._below.pop(request_id, None)
        return mgr.num_computed_tokens(request_id)

    def stats(self) -> TierLinkStats:
        return replace(self._stats)

    def object_payload_bytes(self, obj: PlannedObject) -> int:
        """Row bytes of a planned object (its payload, without the header)."""
        spec = self._specs[obj.key.group_id]
        return rows_for_tokens(spec, obj.first_token, obj.end_token)[1] * self._row_bytes[obj.key.group_id]

    # --- planning ------------------------------------------------------------------
    def _count_offloads(self, entries: list[tuple[tuple[str, int], tuple[int, tuple[int, ...]]]]) -> list[int]:
        """Count the objects of ``entries`` handed out (``offload_objects``, ``offload_bytes``);
        per entry its payload bytes (as :meth:`object_payload_bytes`)."""
        shapes, payload_bytes = self._offload_shapes, []
        for (gid, _), (boundary, _) in entries:
            _, span, _, stride, row_bytes = shapes[gid]
            payload_bytes.append(max(0, boundary // stride - -(-max(0, boundary - span) // stride)) * row_bytes)
        self._stats.offload_objects += len(entries)
        self._stats.offload_bytes += sum(payload_bytes)
        return payload_bytes

    def _plan_load(self, request_id: str, hashes: Any, prompt_tokens: int, hit_tokens: int,
                   cap_tokens: int | None = None) -> None:
        """Find the longest boundary past ``hit_tokens`` (at most ``cap_tokens``) the store serves;
        record it as pending."""
        last = self._load_reach(request_id, prompt_tokens, hit_tokens, cap_tokens)
        if last <= hit_tokens:
            return
        planned = list(self._load_objects(hashes, hit_tokens, last))
        objects = [obj for obj, _ in planned]
        present, copies = self._served(planned)
        boundary = _usable(objects, present, hit_tokens, last, self._prefix.granularity_tokens)
        if boundary <= hit_tokens:
            return
        chosen = [i for i, o in enumerate(objects) if present[i] and _needed(o, boundary)]
        for i in chosen:
            if i in copies:
                entry_boundary, pages, _ = copies[i]
                self._queue.append((objects[i].key.group_id, planned[i][1], entry_boundary, pages))
        self._plans[request_id] = _Plan(hit_tokens, boundary, tuple(objects[i] for i in chosen))
        self.manager.pending_loads.add(request_id)
        self._stats.planned_loads += 1

    def _load_reach(self, request_id: str, prompt_tokens: int, hit_tokens: int, cap_tokens: int | None) -> int:
        """The last boundary a load from ``hit_tokens`` may reach: below the prompt's last token,
        one step's tokens past the hit, below a failed load's boundary, at most ``cap_tokens``."""
        grain = self._prefix.granularity_tokens
        last = min((prompt_tokens - 1) // grain * grain, hit_tokens + self.manager.max_step_tokens // grain * grain)
        if request_id in self._below:
            last = min(last, (self._below[request_id] - 1) // grain * grain)
        return last if cap_tokens is None else min(last, cap_tokens)

    def _served(self, planned: list[tuple[PlannedObject, int]]) -> tuple[list[bool], dict[int, tuple]]:
        """Per planned object whether the store serves it (one ``contains``), counting an entry
        the device still holds and the store lacks (``copies``: index -> its entry): it goes out
        through the store first, since the engine runs the offloads before the loads."""
        present = self.store.contains([o.key for o, _ in planned])
        entries = self._entries
        copies = {i: entries[(o.key.group_id, key)] for i, (o, key) in enumerate(planned)
                  if not present[i] and (o.key.group_id, key) in entries}
        return [ok or i in copies for i, ok in enumerate(present)], copies

    # --- in flight ------------------------------------------------------------------
    def _mark_or_wait(self, request_id: str, start_tokens: int) -> None:
        """The request computes from ``start_tokens``: wait when its next blocks are another
        request's (marked), else mark the blocks it will compute that nobody holds or marks."""
        keys = self._block_keys_after(request_id, start_tokens)
        if not keys:
            return
        held, busy = self._held_and_busy(request_id, keys)
        run = next((i for i, (h, b) in enumerate(zip(held, busy)) if not (h or b)), len(keys))
        if self._waits(request_id, keys, busy, run):
            return
        self._mark_new(request_id, [k for k, h, b in zip(keys, held, busy) if not (h or b)])

    def _held_and_busy(self, request_id: str, keys: list[int]) -> tuple[list[bool], list[bool]]:
        """Per key, whether a device or the store holds its block, and whether another request
        marks it. A held block is done, whatever its marker says (on Mooncake a published block's
        marker may outlive its delete: a read lease); only the others are asked (one get that
        leases)."""
        held = self._blocks_held(keys)
        marked = iter(self.markers.others("computing", [k for k, h in zip(keys, held) if not h], request_id))
        return held, [not h and next(marked) for h in held]

    def _waits(self, request_id: str, keys: list[int], busy: list[bool], run: int) -> bool:
        """Whether the request waits: for another's blocks before ``run`` (the first block nobody
        holds or marks), else for a checkpoint at the last block one step reaches."""
        if any(busy[:run]):
            return self._wait_for_blocks(request_id, keys, busy.index(True), run)
        reach = min(run, self.manager.max_step_tokens // self._prefix.granularity_tokens)
        return bool(reach) and self._wait_for_checkpoint(request_id, keys[reach - 1])

    def _mark_new(self, request_id: str, free_keys: list[int]) -> None:
        """Mark the blocks nobody holds or marks that the request has not marked already."""
        new = [k for k in free_keys if self._flight.marked_by(k) != request_id]
        if new:
            self.markers.put("computing", new, request_id)
            self._stats.markers_put += len(new)
            self._flight.marked(request_id, new)

    def _block_keys_after(self, request_id: str, start_tokens: int) -> list[int]:
        """The keys of the request's whole blocks past ``start_tokens`` (below its last token)."""
        args = self._args[request_id]
        grain = self._prefix.granularity_tokens
        last = (args.token_ids.size - 1) // grain * grain
        if last <= start_tokens:
            return []
        return [args.hashes.key(end) for end in range(start_tokens + grain, last + 1, grain)]

    def _wait_for_blocks(self, request_id: str, keys: list[int], first: int, run: int) -> bool:
        """Block ``keys[first]`` is another request's (marked): wait for it, within the request's
        bound, with a wanted marker at ``keys[run - 1]`` (the checkpoint where the request leaves
        the marked or held blocks). Whether it waits."""
        now = self.markers.now()
        if self._flight.waited(request_id, now) >= self.markers.rule.wait:
            return False
        self.markers.put("wanted", [keys[run - 1]], request_id)
        self._stats.waits += self._flight.start_wait(request_id, keys[first], now)
        self.manager.pending_loads.add(request_id)
        return True

    def _wait_for_checkpoint(self, request_id: str, key: int) -> bool:
        """History blocks up to the boundary of ``key`` are held but the store has no checkpoint
        there: ask for it on the wanted board (a device that holds it writes it through) and
        wait for it, within the request's bound. Whether it waits. A request that loaded since it
        was added does not: its load took pages an engine's batch in the making may count on."""
        now = self.markers.now()
        if not self.write_through or not self._state_ids or request_id in self._flight.loaded_since_add:
            return False
        if self._flight.waited(request_id, now) >= self.markers.rule.wait:
            return False
        self.markers.want([key])
        self._stats.waits += self._flight.start_wait(request_id, key, now, checkpoint=True)
        self._stats.checkpoint_waits += 1
        self.manager.pending_loads.add(request_id)
        return True

    def _checkpoint_stored(self, key: int) -> bool:
        """Whether the store holds the checkpoint at ``key`` in every state group."""
        return all(self.store.contains([ObjectKey("checkpoint", gid, key) for gid in sorted(self._state_ids)]))

    def _still_waiting(self, request_id: str) -> bool:
        """Whether what ``request_id`` waits for is still to come: a block that is neither held
        (device or store) nor free of a live marker, or a checkpoint that is not stored (then its
        board entry is renewed, in case it was lost). A held block ends the wait though its
        marker is still there: a delete is not seen at once everywhere (Mooncake refuses one
        within a read's lease, and every poll of the marker would lease it again)."""
        key = self._flight.waiting[request_id]
        if request_id not in self._flight.checkpoint_waits:
            return not self._blocks_held([key])[0] and self.markers.others("computing", [key], request_id)[0]
        if self._checkpoint_stored(key):
            return False
        self.markers.want([key])
        return True

    def _blocks_held(self, keys: Sequence[int]) -> list[bool]:
        """Per block key: whether its first history group's rows are on the device or in the store."""
        gid = self._first_history
        if gid is None:
            return [True] * len(keys)
        device = [(gid, key) in self._entries for key in keys]
        ask = [i for i, d in enumerate(device) if not d]
        stored = self.store.contains([ObjectKey("block", gid, keys[i]) for i in ask]) if ask else []
        for i, ok in zip(ask, stored):
            device[i] = ok
        return device

    def resume_waits(self) -> None:
        """Match again (on the device, then the store) every waiting request whose block's marker is
        gone, or whose wait is over; ``take_loads`` calls it first."""
        flight = self._flight
        if not flight.waiting:
            return
        rids = list(flight.waiting)
        busy = [self._still_waiting(rid) for rid in rids]
        now = self.markers.now()
        for rid, still in zip(rids, busy):
            if still and flight.waited(rid, now) < self.markers.rule.wait:
                continue
            self._stats.waited_out += int(still)
            if rid in flight.checkpoint_waits:
                self.markers.unwant([flight.waiting[rid]])
            args = self._args[rid]
            flight.resuming = True
            try:
                self.manager.free(rid)  # commits what it loaded, if anything: the new match finds it
                self.manager.add_request(rid, args.token_ids, max_new_tokens=args.max_new_tokens,
                                         cache_salt=args.cache_salt)
            finally:
                flight.resuming = False

    def _queue_ending(self) -> None:
        """Queue the last checkpoint of every request freed since the last call (still cached)."""
        ending, self._flight.ending = self._flight.ending, []
        for hashes, boundary in ending:
            if boundary <= 0:  # (its blocks below the computed tokens are hashed: the known ones are)
                continue
            key = hashes.key(boundary)
            for gid in self._state_ids:
                entry = self._entries.get((gid, key))
                if entry is not None:
                    self._queue.append((gid, key, entry[0], entry[1]))

    def _queue_wanted(self) -> None:
        """Queue the checkpoints published since the last call that a waiter wants."""
        fresh, self._flight.fresh = self._flight.fresh, []
        fresh = [(gid, key) for gid, key in dict.fromkeys(fresh) if (gid, key) in self._entries]
        if not fresh:
            return
        keys = list(dict.fromkeys(key for _, key in fresh))
        wanted = {key for key, ok in zip(keys, self.markers.present("wanted", keys)) if ok}
        for gid, key in fresh:
            if key in wanted:
                boundary, pages, _ = self._entries[(gid, key)]
                self._queue.append((gid, key, boundary, pages))
                self._stats.wanted_checkpoints += 1
        if wanted:  # read just now (a lease on Mooncake): deleted at the next take_offloads
            self.markers.defer_delete("wanted", list(wanted))

    def _queue_board(self) -> None:
        """Queue (write through) the checkpoints on the wanted board this device holds (one ``get``)."""
        if not self.write_through:
            return
        for raw in self.markers.board():
            key = int.from_bytes(raw, "big")
            for gid in self._state_ids:
                entry = self._entries.get((gid, key))
                if entry is not None and (gid, key) not in self._flight.served:
                    self._flight.served.add((gid, key))
                    self._queue.append((gid, key, entry[0], entry[1]))
                    self._stats.wanted_checkpoints += 1

    def _load_objects(self, hashes: Any, hit_tokens: int, last: int) -> Iterable[tuple[PlannedObject, int]]:
        """Every block in ``[hit, last)`` and every checkpoint at a boundary in ``(hit, last]``, with its key."""
        grain = self._prefix.granularity_tokens
        ends = range(hit_tokens + grain, last + 1, grain)
        for gid in self._prefix.history_ids:
            for end in ends:
                key = hashes.key(end)
                yield PlannedObject(ObjectKey("block", gid, key), end - grain, end, end), key
        for gid, window in self._prefix.checkpoint_windows.items():  # the state groups', in order
            for end in ends:
                key = hashes.key(end)
                yield PlannedObject(ObjectKey("checkpoint", gid, key), max(0, end - window), end, end), key


def _offload_parts(shapes: dict[str, tuple], entries: list[tuple[tuple[str, int], tuple[int, tuple[int, ...]]]]
                   ) -> tuple[tuple[PlannedObject, ...], tuple[GroupPages, ...]]:
    """The objects of published entries ``((group, key), (boundary, pages))`` and their pages'
    views (slices of one array); ``shapes``: per group (object kind, tokens before the boundary
    an object holds, page tokens, ...), as ``TierLink.attach`` makes them. Pure: a plan's
    objects may be made on the offload worker (``PlanParts``)."""
    objects, views = [], []
    of_checked, planned, viewed = ObjectKey.of_checked, PlannedObject.of_fields, GroupPages.of_fields
    flat = np.fromiter(chain.from_iterable(pages for _, (_, pages) in entries), dtype=np.int64)
    end = 0
    for (gid, key), (boundary, pages) in entries:
        kind, span, page_tokens = shapes[gid][:3]
        first = max(0, boundary - span)
        objects.append(planned(of_checked(kind, gid, key), first, boundary, boundary))
        start, end = end, end + len(pages)
        views.append(viewed(first // page_tokens, flat[start:end]))
    return tuple(objects), tuple(views)


def _needed(obj: PlannedObject, boundary: int) -> bool:
    """Whether resuming at ``boundary`` reads ``obj``: a block below it, the checkpoint at it."""
    return obj.end_token <= boundary if obj.key.kind == "block" else obj.boundary_tokens == boundary


def _usable(objects: Sequence[PlannedObject], present: Sequence[bool], hit: int, last: int, grain: int) -> int:
    """The longest boundary in ``(hit, last]`` with every block below it and its checkpoints present."""
    blocks_ok = {}
    checkpoints_ok: dict[int, bool] = {}
    for obj, ok in zip(objects, present):
        if obj.key.kind == "block":
            blocks_ok[obj.end_token] = blocks_ok.get(obj.end_token, True) and ok
        else:
            checkpoints_ok[obj.boundary_tokens] = checkpoints_ok.get(obj.boundary_tokens, True) and ok
    best, end = hit, hit + grain
    while end <= last and blocks_ok.get(end, True):
        if checkpoints_ok.get(end, True):
            best = end
        end += grain
    return best
