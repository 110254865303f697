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
call, less the objects the store already holds (one ``contains``). The engine
runs it **before it writes any page** the manager handed out since (a step's,
or a load's): until then the evicted pages still hold their rows.

**Load.** When ``add_request``'s device hit ``D0`` is shorter than what the
store serves, the link finds, by ``contains``, the longest grain boundary
``D`` with every history block in ``[D0, D)`` and a checkpoint at ``D`` in
every state group (the device rule: history below, checkpoint at), at most
``max_step_tokens`` past ``D0``. The request is then *pending*:
``schedule`` and ``check_admission`` refuse it. :meth:`TierLink.take_loads`
gives it pages for tokens ``[D0, D)`` (a step of ``D - D0`` tokens of that
request alone, admitted like any other; the engine computes nothing for it) and
returns a :class:`PendingLoad` per request: a
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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hybridkv.manager import CacheManagerError
from hybridkv.tiers.keys import ObjectKey
from hybridkv.tiers.pools import layout_parts
from hybridkv.tiers.rows import GroupPages, rows_for_tokens
from hybridkv.tiers.store import ObjectStore
from hybridkv.transfer import LoadPlan, LoadResult, OffloadPlan, PlannedObject, pages_from_manager


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
    denied_loads: int = 0  # no pages for the load: the request kept its device hit
    taken_loads: int = 0
    confirmed_loads: int = 0
    failed_loads: int = 0  # confirmed short: the request went back to its device hit
    loaded_tokens: int = 0  # tokens gained by confirmed loads
    offload_objects: int = 0  # objects handed to the engine
    offload_bytes: int = 0  # their payload bytes (rows only)
    offload_skipped: int = 0  # objects the store already held
    offload_pinned: int = 0  # handed out with their pages held for a later copy (pin_offloads)
    offload_stored: int = 0  # confirmed stored by a tier (confirm_offloads)
    offload_refused: int = 0  # confirmed, no tier stored them
    offload_dropped: int = 0  # confirmed dropped or failed (a full worker queue, a fault): never stored
    pinned_pages: int = 0  # pages held now for offloads not confirmed yet
    load_objects: int = 0
    load_bytes: int = 0


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


class TierLink:
    """Offload and load plans between one manager's prefix cache and ``store``.

    ``write_through``: offload entries when published, not when evicted.
    ``offload_low_priority``: also offload evicted low-priority prompt checkpoints
    (published at every prompt boundary in case another request leaves there).
    ``pin_offloads``: hold the pages of entries still published until
    :meth:`confirm_offloads` (their copy may run off the step), at most
    ``max_pinned_pages`` at once. ``plan_loads=False``: offload only, never load.
    """

    def __init__(self, store: ObjectStore, *, write_through: bool = False, offload_low_priority: bool = False,
                 pin_offloads: bool = False, max_pinned_pages: int | None = None, plan_loads: bool = True):
        if not isinstance(store, ObjectStore):
            raise TypeError(f"store must be an ObjectStore, got {type(store).__name__}")
        if max_pinned_pages is not None and (isinstance(max_pinned_pages, bool) or not isinstance(max_pinned_pages, int)
                                             or max_pinned_pages < 0):
            raise ValueError(f"max_pinned_pages must be a non-negative int or None, got {max_pinned_pages!r}")
        self.store = store
        self.write_through = bool(write_through)
        self.offload_low_priority = bool(offload_low_priority)
        self.pin_offloads = bool(pin_offloads)
        self.plan_loads = bool(plan_loads)  # False: offload only (nothing is ever pending)
        self.max_pinned_pages = max_pinned_pages
        self._tickets = 0
        # ticket -> (pinned pages by group, pinned entries, every entry of the plan in order)
        self._pins: dict[int, tuple[dict[str, np.ndarray], tuple, tuple]] = {}
        self._in_flight: set[tuple[str, int]] = set()  # pinned entries not confirmed yet
        self._sent: set[tuple[str, int]] = set()  # device entries a tier confirmed stored
        self.manager: Any = None
        self._scheduling = False  # take_loads' own step
        self._stats = TierLinkStats()
        self._entries: dict[tuple[str, int], tuple[int, tuple[int, ...], bool]] = {}
        self._queue: list[tuple[str, int, int, tuple[int, ...]]] = []
        self._plans: dict[str, _Plan] = {}
        self._args: dict[str, _Args] = {}
        self._below: dict[str, int] = {}  # re-plans after a failed load stay below it
        self._row_bytes = {g.group_id: sum(size for _, _, size in layout_parts(store.layout, g.group_id))
                           for g in store.layout.groups}

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
        self._specs = {s.group_id: s for s in manager.specs}
        self._prefix.tier_hook = self

    def stored(self, group_id: str, key: int, boundary_tokens: int, pages: Sequence[int], low_priority: bool) -> None:
        """The prefix cache published ``pages`` under ``key`` (a block ending at, or a checkpoint at, the boundary)."""
        pages = tuple(pages)
        self._entries[(group_id, key)] = (boundary_tokens, pages, low_priority)
        if self.write_through and not low_priority:
            self._queue.append((group_id, key, boundary_tokens, pages))

    def removed(self, group_id: str, key: int, dropped: bool) -> None:
        """The prefix cache removed an entry: evicted (``dropped`` False) or superseded/cleared."""
        entry = self._entries.pop((group_id, key), None)
        if (group_id, key) in self._sent:  # written through already: nothing to move at eviction
            self._sent.discard((group_id, key))
            return
        if entry is None or dropped:
            return
        boundary, pages, low = entry
        if low and not self.offload_low_priority:
            return
        self._queue.append((group_id, key, boundary, pages))

    def on_add(self, request_id: str, hashes: Any, token_ids: np.ndarray, hit_tokens: int,
               max_new_tokens: int, cache_salt: Any) -> None:
        """After ``add_request``'s device match: plan a load when the store serves more."""
        if hashes is None or not self.plan_loads:
            return
        self._args[request_id] = _Args(hashes, token_ids, max_new_tokens, cache_salt)
        self._plan_load(request_id, hashes, token_ids.size, hit_tokens)

    def on_free(self, request_id: str) -> None:
        """Before ``free``: a taken, unconfirmed load goes back to the device hit (nothing unloaded is committed)."""
        plan = self._plans.pop(request_id, None)
        self.manager.pending_loads.discard(request_id)
        self._args.pop(request_id, None)
        self._below.pop(request_id, None)
        if plan is not None and plan.taken:
            self.manager.rewind(request_id, plan.from_tokens)

    def check_schedule(self) -> None:
        """Called by ``schedule``: refuse while a taken load is not confirmed."""
        if self._scheduling:
            return
        for rid, plan in self._plans.items():
            if plan.taken:
                raise TierLinkError(
                    f"request {rid!r} has a tier load in flight: confirm_load() it before the next step"
                )

    # --- the engine's side -----------------------------------------------------
    def pending(self, request_id: str) -> bool:
        """Whether ``request_id`` waits for a load (``schedule`` refuses it)."""
        return request_id in self._plans

    def take_offloads(self) -> OffloadPlan:
        """Everything evicted (or, with write-through, published) since the last call, less what
        the store holds. Unpinned objects: copy them before writing any page handed out since.
        With ``pin_offloads``, entries still published keep their pages held (pinned) until
        :meth:`confirm_offloads` reports the plan's ticket, so their copy may run later."""
        queue, self._queue = self._queue, []
        if not queue:
            return OffloadPlan((), ())
        objects, sources, entries, seen = [], [], [], set(self._in_flight)
        for gid, key, boundary, pages in queue:
            if (gid, key) in seen:
                continue
            seen.add((gid, key))
            obj, view = self._offload_object(gid, key, boundary, pages)
            objects.append(obj)
            sources.append(view)
            entries.append((gid, key, pages))
        held = self.store.contains([o.key for o in objects])
        self._stats.offload_skipped += sum(held)
        keep = [i for i, h in enumerate(held) if not h]
        objects, sources, entries = [objects[i] for i in keep], [sources[i] for i in keep], [entries[i] for i in keep]
        self._stats.offload_objects += len(objects)
        self._stats.offload_bytes += sum(self.object_payload_bytes(o) for o in objects)
        if not objects:
            return OffloadPlan((), ())
        self._tickets += 1
        pinned = self._pin(self._tickets, entries) if self.pin_offloads else ()
        return OffloadPlan(tuple(objects), tuple(sources), pinned, self._tickets)

    def confirm_offloads(self, results: Iterable[tuple[int | None, Sequence[bool | None]]]) -> None:
        """Report offload plans the engine has run: ``(ticket, per object True stored, False
        refused by the tier, None dropped or failed)`` each, as ``OffloadWorker.finished()`` gives
        them. The pages pinned for a plan are released (those no request holds go back to the
        pool); an unknown ticket (a plan with nothing pinned) only counts."""
        released: dict[str, list[np.ndarray]] = {}
        for ticket, stored in results:
            self._stats.offload_stored += sum(1 for x in stored if x is True)
            self._stats.offload_refused += sum(1 for x in stored if x is False)
            self._stats.offload_dropped += sum(1 for x in stored if x is None)
            pins = self._pins.pop(ticket, None) if ticket is not None else None
            if pins is None:
                continue
            by_group, keys, every = pins
            self._sent.update(entry for entry, ok in zip(every, stored) if ok is True and entry in self._entries)
            for gid, pages in by_group.items():
                released.setdefault(gid, []).append(pages)
            self._in_flight.difference_update(keys)
        for gid, arrays in released.items():  # one release per group for every plan confirmed
            pages = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
            self.manager.release_held_pages(gid, pages)
            self._stats.pinned_pages -= pages.size

    def _pin(self, ticket: int, entries: list[tuple[str, int, tuple[int, ...]]]) -> tuple[bool, ...]:
        """Hold the pages of every entry still published as it was (within ``max_pinned_pages``);
        per entry, whether it is pinned. An evicted entry's pages may be reused already."""
        pools, budget = self.manager.pools, self.max_pinned_pages
        room = None if budget is None else budget - self._stats.pinned_pages
        pinned, by_group, keys = [], {}, []
        for gid, key, pages in entries:
            ok = pools[gid].lookup(key) == pages and (room is None or len(pages) <= room)
            if ok:
                if room is not None:
                    room -= len(pages)
                by_group.setdefault(gid, []).extend(pages)
                keys.append((gid, key))
            pinned.append(ok)
        arrays = {gid: np.asarray(pages, dtype=np.int64) for gid, pages in by_group.items()}
        for gid, pages in arrays.items():
            self.manager.hold_pages(gid, pages)
            self._stats.pinned_pages += pages.size
        # Recorded even with nothing pinned: what a tier stores need not move again at eviction.
        self._pins[ticket] = (arrays, tuple(keys), tuple((gid, key) for gid, key, _ in entries))
        self._in_flight.update(keys)
        self._stats.offload_pinned += len(keys)
        return tuple(pinned)

    def take_loads(self) -> list[PendingLoad]:
        """Pages for every planned load (one step of those requests, nothing computed) and the
        plans. A load admission cannot give pages is dropped: the request keeps its device hit.
        Run :meth:`take_offloads` and its plan first (the step may have evicted pages)."""
        if any(p.taken for p in self._plans.values()):
            raise TierLinkError("confirm_load() the loads taken before taking more")
        rids = list(self._plans)
        if not rids:
            return []
        mgr = self.manager
        mgr.pending_loads.difference_update(rids)
        items = [(rid, self._plans[rid].boundary_tokens - self._plans[rid].from_tokens) for rid in rids]
        while items:
            answers = mgr.check_admission(items)
            if all(a.ok for a in answers):
                break
            for (rid, _), answer in zip(items, answers):
                if not answer.ok:
                    del self._plans[rid]
                    self._stats.denied_loads += 1
            items = [item for item, answer in zip(items, answers) if answer.ok]
        if not items:
            return []
        self._scheduling = True
        try:
            mgr.schedule(items, write_slots=False)
        finally:
            self._scheduling = False
        out = []
        for rid, _ in items:
            plan = self._plans[rid]
            plan.taken = True
            mgr.pending_loads.add(rid)
            self._stats.taken_loads += 1
            self._stats.load_objects += len(plan.objects)
            self._stats.load_bytes += sum(self.object_payload_bytes(o) for o in plan.objects)
            load = LoadPlan(plan.objects, (plan.boundary_tokens,))
            out.append(PendingLoad(rid, plan.from_tokens, load, pages_from_manager(mgr, rid)))
        return out

    def confirm_load(self, request_id: str, result: LoadResult | int) -> int:
        """Report a taken load: its ``LoadResult`` (or the tokens it loaded). Returns the request's
        computed tokens now; check :meth:`pending` for a further load."""
        plan = self._plans.get(request_id)
        if plan is None or not plan.taken:
            raise TierLinkError(f"request {request_id!r} has no tier load in flight")
        loaded = result.boundary_tokens if isinstance(result, LoadResult) else int(result)
        del self._plans[request_id]
        self.manager.pending_loads.discard(request_id)
        mgr = self.manager
        if loaded == plan.boundary_tokens:
            self._stats.confirmed_loads += 1
            self._stats.loaded_tokens += loaded - plan.from_tokens
            args = self._args[request_id]
            self._plan_load(request_id, args.hashes, args.token_ids.size, loaded)
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
    def _offload_object(self, gid: str, key: int, boundary: int, pages: tuple[int, ...]):
        spec = self._specs[gid]
        if spec.is_sliding:
            first, kind = max(0, boundary - self._prefix.checkpoint_window_tokens(gid)), "checkpoint"
        else:
            first, kind = boundary - self._prefix.granularity_tokens, "block"
        obj = PlannedObject(ObjectKey(kind, gid, key), first, boundary, boundary)
        return obj, GroupPages(first // spec.page_tokens, np.asarray(pages, dtype=np.int64))

    def _plan_load(self, request_id: str, hashes: Any, prompt_tokens: int, hit_tokens: int) -> None:
        """Find the longest boundary past ``hit_tokens`` the store serves; record it as pending."""
        grain = self._prefix.granularity_tokens
        last = (prompt_tokens - 1) // grain * grain
        last = min(last, hit_tokens + self.manager.max_step_tokens // grain * grain)
        if request_id in self._below:
            last = min(last, (self._below[request_id] - 1) // grain * grain)
        if last <= hit_tokens:
            return
        hashes.extend_to(self._args[request_id].token_ids, last)
        planned = list(self._load_objects(hashes, hit_tokens, last))
        objects = [obj for obj, _ in planned]
        present = self.store.contains([o.key for o in objects])
        # An entry the device still holds (and the store lacks) goes out through the store
        # first: the engine runs the offloads before the loads.
        copies = {i: self._entries[(o.key.group_id, key)] for i, (o, key) in enumerate(planned)
                  if not present[i] and (o.key.group_id, key) in self._entries}
        present = [ok or i in copies for i, ok in enumerate(present)]
        boundary = _usable(objects, present, hit_tokens, last, grain)
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

    def _load_objects(self, hashes: Any, hit_tokens: int, last: int) -> Iterable[tuple[PlannedObject, int]]:
        """Every block in ``[hit, last)`` and every checkpoint at a boundary in ``(hit, last]``, with its key."""
        grain = self._prefix.granularity_tokens
        ends = range(hit_tokens + grain, last + 1, grain)
        for gid in self._prefix.history_ids:
            for end in ends:
                key = hashes.key(end)
                yield PlannedObject(ObjectKey("block", gid, key), end - grain, end, end), key
        for gid in self._prefix.state_ids:
            window = self._prefix.checkpoint_window_tokens(gid)
            for end in ends:
                key = hashes.key(end)
                yield PlannedObject(ObjectKey("checkpoint", gid, key), max(0, end - window), end, end), key


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
