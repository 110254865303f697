"""Moving a request's cache rows between instances and tiers, by logical position.

What a request resumed at boundary ``D`` needs, per group:

* a full-history group: every row below ``D``, as one object per block of
  ``block_tokens`` (the last one partial when ``D`` is not a block multiple);
* a sliding group: the checkpoint at ``D``, only its trailing rows
  (:func:`checkpoint_tokens`); a group whose checkpoint is empty needs nothing.

Plans name objects (:class:`PlannedObject`) and the pages their rows sit in
on one side (:class:`~hybridkv.tiers.rows.GroupPages`, logical order), never a
page id of the other side, so instances with different page ids and page sizes
exchange the same rows. A load checks every object before it writes a row and
writes only what serves a usable boundary: on a missing or bad object it falls
back to a shorter boundary (or none), never to wrong rows.

Page views come from the manager's public API: :func:`pages_from_step` (a
full-mode ``StepBatch``) or :func:`pages_from_manager` (``request_pages``).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from hybridkv.models.deepseek_v4 import v4_checkpoint_window_tokens
from hybridkv.models.layout import ModelCacheLayout
from hybridkv.tiers.keys import ObjectKey, chained_keys
from hybridkv.tiers.namespace import Namespace
from hybridkv.tiers.objects import NamespaceMismatch, RowsObject, header_size
from hybridkv.tiers.pools import GroupPools
from hybridkv.tiers.rows import GroupPages, MissingRows, gather_objects, rows_for_tokens, scatter_objects
from hybridkv.tiers.store import ObjectStore
from hybridkv.tiers.worker import OffloadWorker


@dataclass(frozen=True)
class PlannedObject:
    """One object of a plan: ``key``'s rows for tokens ``[first_token, end_token)``."""

    key: ObjectKey
    first_token: int
    end_token: int
    boundary_tokens: int  # the boundary this object serves (a block: its end; a checkpoint: D)

    @classmethod
    def of_fields(cls, key: ObjectKey, first_token: int, end_token: int, boundary_tokens: int) -> PlannedObject:
        """``PlannedObject(key, first_token, end_token, boundary_tokens)`` without the frozen
        dataclass's setattr per field (a tier link makes one per offload, on the step thread)."""
        out = object.__new__(cls)
        out.__dict__.update(key=key, first_token=first_token, end_token=end_token, boundary_tokens=boundary_tokens)
        return out


@dataclass(frozen=True)
class HandoffPlan:
    """What a decode instance needs of one request at boundary ``D``: history below, checkpoint at."""

    namespace: Namespace
    boundary_tokens: int
    objects: tuple[PlannedObject, ...]

    def keys(self) -> list[ObjectKey]:
        return [o.key for o in self.objects]

    def export(self, pools: Mapping[str, GroupPools], pages: Mapping[str, GroupPages]) -> list[RowsObject]:
        """The plan's objects read from the prefill side's pools (its page view ``pages``)."""
        return export_objects(self.objects, pools, pages)

    def load(self, store: ObjectStore, pools: Mapping[str, GroupPools], pages: Mapping[str, GroupPages]) -> LoadResult:
        """Load the plan into the decode side's pools (its page view ``pages``): all or nothing."""
        if store.namespace.digest != self.namespace.digest:
            raise NamespaceMismatch(
                f"plan of namespace {self.namespace.hex} loaded into a store of namespace {store.namespace.hex}")
        return load_objects(store, self.objects, [self.boundary_tokens], pools, pages)


@dataclass(frozen=True)
class LoadResult:
    boundary_tokens: int  # tokens the target now holds rows for (0: fall back to a full prefill)
    loaded_objects: int
    missing: tuple[ObjectKey, ...]  # objects absent or refused by verification


def aligned_grain_tokens(layout: ModelCacheLayout) -> int:
    """Boundaries where a checkpoint is narrowest: multiples of every history group's row stride."""
    strides = [g.spec.entry_stride_tokens for g in layout.groups if not g.spec.is_sliding]
    return math.lcm(*strides) if strides else 1


def checkpoint_tokens(layout: ModelCacheLayout, group_id: str, boundary_tokens: int) -> int:
    """Trailing tokens of a sliding group's checkpoint at ``boundary_tokens``.

    At a boundary that closes every compressor window (a multiple of
    :func:`aligned_grain_tokens`), the model's checkpoint window
    (``v4_checkpoint_window_tokens``: the whole KV window, 4 tokens of each
    ratio-4 state, none of the ratio-128 state on V4). Elsewhere, the window
    less one token: what the model still reads at ``D`` (the window ending at
    ``D`` itself and the open compressor windows) and what the manager keeps.
    """
    spec = layout.group(group_id).spec
    if not spec.is_sliding:
        raise ValueError(f"group {group_id} is not a sliding group")
    if boundary_tokens % aligned_grain_tokens(layout) == 0:
        tokens = v4_checkpoint_window_tokens(layout.specs)[group_id]
    else:
        tokens = spec.sliding_window_tokens - 1
    return min(tokens, boundary_tokens)


def _history_objects(layout: ModelCacheLayout, keys: Sequence[bytes], block_tokens: int, end: int):
    out = []
    for group in layout.groups:
        if group.spec.is_sliding:
            continue
        for index in range(-(-end // block_tokens)):
            start, stop = index * block_tokens, min((index + 1) * block_tokens, end)
            if rows_for_tokens(group.spec, start, stop)[1] == 0:
                continue  # a partial block with no whole row yet (its tokens live in a state)
            out.append(PlannedObject(ObjectKey("block", group.group_id, keys[index]), start, stop, stop))
    return out


def _checkpoint_objects(layout: ModelCacheLayout, key: bytes, boundary: int) -> list[PlannedObject]:
    out = []
    for group in layout.groups:
        if group.spec.is_sliding:
            tokens = checkpoint_tokens(layout, group.group_id, boundary)
            if tokens:
                out.append(PlannedObject(ObjectKey("checkpoint", group.group_id, key), boundary - tokens, boundary, boundary))
    return out


def plan_handoff(
    store: ObjectStore,
    token_ids: object,
    boundary_tokens: int,
    *,
    block_tokens: int = 256,
    salt: bytes = b"",
    peer_namespace: Namespace | None = None,
) -> HandoffPlan:
    """The objects a decode instance needs to resume ``token_ids`` at ``boundary_tokens``.

    ``peer_namespace``: the other instance's layout namespace; a different one
    raises :class:`NamespaceMismatch` (its rows would be read as the wrong layout).
    """
    if peer_namespace is not None and peer_namespace.digest != store.namespace.digest:
        raise NamespaceMismatch(
            f"peer layout namespace {peer_namespace.hex} differs from this instance's {store.namespace.hex}: "
            "the two instances run different models, dtypes or cache geometry"
        )
    tokens = np.asarray(token_ids)
    if isinstance(boundary_tokens, bool) or not isinstance(boundary_tokens, int) or not 1 <= boundary_tokens <= tokens.size:
        raise ValueError(f"boundary_tokens must be an int in [1, {tokens.size}], got {boundary_tokens!r}")
    keys = chained_keys(tokens[:boundary_tokens], block_tokens, salt=salt)
    objects = _history_objects(store.layout, keys, block_tokens, boundary_tokens)
    objects += _checkpoint_objects(store.layout, keys[-1], boundary_tokens)
    return HandoffPlan(store.namespace, boundary_tokens, tuple(objects))


def export_objects(
    objects: Sequence[PlannedObject], pools: Mapping[str, GroupPools], pages: Mapping[str, GroupPages]
) -> list[RowsObject]:
    """Copy each planned object's rows out of the source pools (source page view ``pages``)."""
    return gather_objects(dict(pools), dict(pages), [(o.key, o.first_token, o.end_token) for o in objects])


def _serves(o: PlannedObject, boundary: int) -> bool:
    """Whether resuming at ``boundary`` needs object ``o``: a block below it, its own checkpoint."""
    if o.key.kind == "block":
        return o.first_token < boundary
    return o.boundary_tokens == boundary


def usable_boundary(objects: Sequence[PlannedObject], present: Sequence[bool], boundaries: Sequence[int]) -> int:
    """The largest of ``boundaries`` whose objects (blocks below it, checkpoints at it) are all present."""
    for boundary in sorted(set(boundaries), reverse=True):
        needed = [ok for o, ok in zip(objects, present) if _serves(o, boundary)]
        if boundary > 0 and needed and all(needed):
            return boundary
    return 0


TWO_THREAD_LOAD_BYTES = 4 << 20  # a smaller load is verified and copied on the calling thread alone


def load_objects(
    store: ObjectStore,
    objects: Sequence[PlannedObject],
    boundaries: Sequence[int],
    pools: Mapping[str, GroupPools],
    pages: Mapping[str, GroupPages],
) -> LoadResult:
    """Fetch and verify ``objects``; write the rows serving the largest usable of ``boundaries``
    into the target pools (target page view ``pages``). A boundary whose checkpoint or any
    history block below it is missing, corrupted or refused is not used; nothing is written
    for it, and 0 means nothing was written. Everything is received in one fetch and verified
    before the first row is written; from ``TWO_THREAD_LOAD_BYTES`` received, the checksums and
    then the copies run on two threads (this one and a helper), each about half the bytes."""
    rows = [rows_for_tokens(store.layout.group(o.key.group_id).spec, o.first_token, o.end_token)[1] for o in objects]
    keys = [o.key for o in objects]
    values = store.receive(keys, rows)
    large = sum(len(v) for v in values if v is not None) >= TWO_THREAD_LOAD_BYTES
    with ThreadPoolExecutor(1, thread_name_prefix="hybridkv-load") if large else contextlib.nullcontext() as helper:
        got, bad = store.verify(keys, values, helper=helper)
        store.discard(bad)
        got = [  # an intact object under the planned key but of other tokens is not used
            obj if obj is not None and (obj.first_token, obj.num_tokens) == (o.first_token, o.end_token - o.first_token)
            else None
            for o, obj in zip(objects, got)
        ]
        boundary = usable_boundary(objects, [obj is not None for obj in got], boundaries)
        chosen = [obj for o, obj in zip(objects, got) if boundary and _serves(o, boundary)]
        scatter_objects(dict(pools), dict(pages), chosen, helper=helper)
    missing = tuple(o.key for o, obj in zip(objects, got) if obj is None)
    return LoadResult(boundary, len(chosen), missing)


def gather_planned(pools: dict[str, GroupPools], objects: Sequence[PlannedObject], sources: Sequence[GroupPages],
                   indices: list[int], *, hold_gil: bool = False) -> list[RowsObject]:
    """The planned objects ``indices`` gathered from their page views, each payload after room
    for its header (encoded in place); ``hold_gil``: on the engine's step thread (see
    ``gather_objects``)."""
    if not indices:
        return []
    chosen = [objects[i] for i in indices]
    ranges = [(o.key, o.first_token, o.end_token) for o in chosen]
    heads = [header_size(o.key, pools[o.key.group_id].parts) for o in chosen]
    return gather_objects(pools, [sources[i] for i in indices], ranges, room_bytes=heads, hold_gil=hold_gil)


class DeferredCopies:
    """The rows of a plan's *deferred* objects (``TierLink(defer_offloads=True)``): their pages are
    not held, so the worker gathers them later, and an object whose cache entry is removed
    before the worker has gathered it is *rescued*: gathered on the step thread at the next plan
    (:meth:`OffloadPlan.submit` or :meth:`OffloadPlan.run`, before the engine writes a page
    handed out since), and the worker puts that copy instead of its own. One lock orders the
    two threads: an object the worker has settled is never rescued, and a rescued one is
    never taken from the worker's gather (which may have read pages being rewritten)."""

    def __init__(self, objects: Sequence[PlannedObject], sources: Sequence[GroupPages], indices: Sequence[int]):
        self._objects, self._sources = objects, sources  # a plan's, made on first use (PlanParts)
        self._lock = threading.Lock()
        self._pending = set(indices)  # neither settled by the worker nor rescued
        self._rescued: dict[int, RowsObject] = {}

    def rescue(self, index: int, pools: dict[str, GroupPools]) -> bool:
        """Gather object ``index`` now (its entry left the cache) unless the worker has settled it;
        whether it was gathered."""
        return self.rescue_many([index], pools) == 1

    def rescue_many(self, indices: Sequence[int], pools: dict[str, GroupPools]) -> int:
        """:meth:`rescue` of every object in ``indices``, in one gather (one compiled copy per
        group, layer and plane); how many were gathered."""
        with self._lock:
            chosen = [i for i in dict.fromkeys(indices) if i in self._pending]
            if not chosen:
                return 0
            self._pending.difference_update(chosen)
            self._rescued.update(zip(chosen, gather_planned(pools, self._objects, self._sources, chosen, hold_gil=True)))
            return len(chosen)

    def settle(self, gathered: dict[int, RowsObject], held: Sequence[int] = ()) -> None:
        """On the worker, after gathering: the rescued objects' copies replace its own; ``held``
        (objects the store held already, not gathered) need no copy either."""
        with self._lock:
            for index in gathered:
                if index in self._rescued:
                    gathered[index] = self._rescued.pop(index)
            self._pending.difference_update(gathered)
            self._pending.difference_update(held)
            for index in held:
                self._rescued.pop(index, None)


class PlanParts:
    """A plan's objects and page views, made together on first use by ``make`` (one call, on
    whichever thread asks first): a tier link takes a plan on the engine's step thread and the
    offload worker makes its objects. ``objects`` and ``sources`` read as tuples."""

    def __init__(self, count: int, make: Callable[[], tuple[tuple[PlannedObject, ...], tuple[GroupPages, ...]]]):
        self.count = count
        self._make: Callable | None = make
        self._made: tuple[tuple, tuple] | None = None
        self._lock = threading.Lock()
        self.objects: Sequence[PlannedObject] = MadeTuple(self, 0)
        self.sources: Sequence[GroupPages] = MadeTuple(self, 1)

    def made(self) -> tuple[tuple[PlannedObject, ...], tuple[GroupPages, ...]]:
        made = self._made
        if made is None:
            with self._lock:
                if self._made is None:
                    self._made, self._make = self._make(), None
                made = self._made
        return made


class MadeTuple(Sequence):
    """One of :class:`PlanParts`' tuples (0: objects, 1: page views), made on first use; its
    length is known before."""

    def __init__(self, parts: PlanParts, which: int):
        self._parts, self._which = parts, which

    def __len__(self) -> int:
        return self._parts.count

    def __getitem__(self, index):
        return self._parts.made()[self._which][index]

    def __iter__(self) -> Iterator:
        return iter(self._parts.made()[self._which])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, MadeTuple)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


class StoreCheck:
    """What a plan taken without asking the store (a tier link's plan whose every copy runs
    later) asks when it runs, on the thread that runs it: ``contains`` of its objects. ``held``:
    the indices of the objects the store held then; they are neither copied nor put, and come
    back stored (True)."""

    def __init__(self, store: ObjectStore):
        self.store = store
        self.held: list[int] = []

    def ask(self, objects: Sequence[PlannedObject]) -> list[int]:
        found = self.store.contains([o.key for o in objects])
        self.held = [i for i, h in enumerate(found) if h]
        return self.held


@dataclass(frozen=True)
class OffloadPlan:
    """Objects to write to a tier and, per object, the pages its rows sit in now (logical order
    from the object's first page). What the manager hands the engine when it evicts or, under
    write-through, publishes a block or a checkpoint.

    ``pinned`` (per object; empty: none): the manager holds the object's pages until the engine
    confirms ``ticket`` (``TierLink.confirm_offloads``), so its rows may be copied later, on
    another thread. ``deferred`` (per object; empty: none): the object's entry is still
    published and its rows are copied later too, without a hold: ``copies`` rescues the rows of
    an entry removed before that. ``rescues``: earlier plans' deferred objects whose entries were
    removed since, gathered first by :meth:`submit` and :meth:`run`. Every other object must be
    copied before the engine writes any page the manager handed out since (:meth:`submit`
    copies those at once). ``store_check`` (None: the store was asked when the plan was taken,
    and the objects it held left out): the store is asked when the plan runs (on the worker,
    for :meth:`submit`), and the objects it held then are neither copied nor put and come back
    stored; ``store_check.held`` lists them."""

    objects: Sequence[PlannedObject]  # a tuple, or a PlanParts' (made on first use)
    sources: Sequence[GroupPages]
    pinned: tuple[bool, ...] = ()
    ticket: int | None = None
    deferred: tuple[bool, ...] = ()
    copies: DeferredCopies | None = None
    rescues: tuple[tuple[DeferredCopies, int], ...] = ()
    store_check: StoreCheck | None = field(default=None, compare=False)

    def is_pinned(self, index: int) -> bool:
        return bool(self.pinned) and self.pinned[index]

    def is_later(self, index: int) -> bool:
        """Whether object ``index``'s rows may be copied after the engine writes new pages
        (pinned or deferred)."""
        return self.is_pinned(index) or (bool(self.deferred) and self.deferred[index])

    def rescue(self, pools: Mapping[str, GroupPools]) -> int:
        """Gather the rows of ``rescues`` the worker has not settled yet, those of one earlier plan
        in one gather; how many were gathered."""
        pools, by_plan = dict(pools), {}
        for copies, index in self.rescues:
            by_plan.setdefault(id(copies), (copies, []))[1].append(index)
        return sum(copies.rescue_many(indices, pools) for copies, indices in by_plan.values())

    def submit(self, worker: OffloadWorker, pools: Mapping[str, GroupPools]) -> bool:
        """Hand the plan to ``worker``: the rescues and the rows of objects that are neither
        pinned nor deferred are gathered now, on this thread (their pages may be written next);
        the others are gathered on the worker; the worker puts them all. False: the worker's
        queue was full and the plan was dropped (its ticket still comes back from
        ``worker.finished()``). Empty plans are not queued."""
        if self.rescues:
            self.rescue(pools)
        flags = self.pinned if not self.deferred else self._later_flags()
        if not flags:
            if not self.objects:
                return True
            flags = (False,) * len(self.objects)
        pools = dict(pools)
        if all(flags):  # write-through: every copy runs on the worker
            now, later, staged = [], list(range(len(flags))), []
        else:
            now = [i for i, flag in enumerate(flags) if not flag]
            later = [i for i, flag in enumerate(flags) if flag]
            staged = gather_planned(pools, self.objects, self.sources, now, hold_gil=True)
        # every buffer is new (gathered here, on the worker, or rescued): the tier may keep it
        return worker.submit(self.ticket, partial(self._make_on_worker, pools, later, dict(zip(now, staged))),
                             len(flags), in_place=True, given=True)

    def _later_flags(self) -> tuple[bool, ...]:
        """Per object, :meth:`is_later`."""
        if not self.deferred:
            return self.pinned or (False,) * len(self.objects)
        if not self.pinned:
            return self.deferred
        return tuple(p or d for p, d in zip(self.pinned, self.deferred))

    def _make_on_worker(self, pools: dict[str, GroupPools], later: list[int], staged: dict[int, RowsObject]
                        ) -> list[RowsObject | None]:
        """A submitted job's objects, on the worker: ask the store (``store_check``), gather the
        later objects it lacks, take the rescued copies and the ``staged`` ones; ``None`` for
        what the store holds (not put)."""
        objects, sources, check = tuple(self.objects), tuple(self.sources), self.store_check
        held = set(check.ask(objects)) if check is not None else ()
        todo = [i for i in later if i not in held] if held else later
        gathered = dict(zip(todo, gather_planned(pools, objects, sources, todo)))
        if self.copies is not None:
            self.copies.settle(gathered, sorted(held))
        gathered.update(staged)
        return [gathered.get(i) for i in range(len(objects))]

    def run(self, store: ObjectStore, pools: Mapping[str, GroupPools]) -> list[bool]:
        """Copy the rows out and put the objects; per object, whether a tier stored it. The rows of
        all objects that share a page view are copied by one compiled call per (group, layer,
        plane), each payload after room for its header, which is then written in place, into the
        tier's ``put_buffer`` when it lends one (the Mooncake tier then sends from there): no
        payload is copied again on this side (``gather_objects``, ``encode_object``). The
        rescues are gathered first (their jobs put them)."""
        if self.rescues:
            self.rescue(pools)
        if self.store_check is not None:
            return self._run_unheld(store, pools)
        by_view: dict[tuple[str, int], list[int]] = {}
        for i, (o, view) in enumerate(zip(self.objects, self.sources)):
            by_view.setdefault((o.key.group_id, id(view)), []).append(i)
        heads = [header_size(o.key, pools[o.key.group_id].parts) for o in self.objects]
        total = sum(
            head + rows_for_tokens(pools[o.key.group_id].spec, o.first_token, o.end_token)[1]
            * sum(size for _, _, size in pools[o.key.group_id].parts)
            for o, head in zip(self.objects, heads)
        )
        objects: list[RowsObject | None] = [None] * len(self.objects)
        with store.tier.put_buffer(total) as staging:
            used = 0
            for (gid, _), members in by_view.items():
                planned = [self.objects[i] for i in members]
                gathered = gather_objects(
                    dict(pools), {gid: self.sources[members[0]]},
                    [(o.key, o.first_token, o.end_token) for o in planned],
                    room_bytes=[heads[i] for i in members], into=None if staging is None else staging[used:],
                )
                for i, obj in zip(members, gathered):
                    objects[i] = obj
                    used += heads[i] + obj.payload.size
            return store.put(objects, in_place=True, given=staging is None)  # new buffers: the tier's

    def _run_unheld(self, store: ObjectStore, pools: Mapping[str, GroupPools]) -> list[bool]:
        """:meth:`run` of a plan that asks the store when it runs: the objects it holds come
        back stored, the others are copied and put."""
        held = set(self.store_check.ask(self.objects))
        todo = [i for i in range(len(self.objects)) if i not in held]
        rest = OffloadPlan(tuple(self.objects[i] for i in todo), tuple(self.sources[i] for i in todo))
        stored = dict(zip(todo, rest.run(store, pools) if todo else ()))
        return [stored.get(i, True) for i in range(len(self.objects))]


@dataclass(frozen=True)
class LoadPlan:
    """Objects to load into the pages admission allocated (``targets``: the request's page view),
    and the boundaries the load may end at, longest usable first."""

    objects: tuple[PlannedObject, ...]
    boundaries: tuple[int, ...]

    @property
    def boundary_tokens(self) -> int:
        return max(self.boundaries, default=0)

    def run(self, store: ObjectStore, pools: Mapping[str, GroupPools], targets: Mapping[str, GroupPages]) -> LoadResult:
        """Load what serves the longest boundary whose objects all arrive verified; write nothing else."""
        return load_objects(store, self.objects, self.boundaries, pools, targets)


def prefix_objects(
    layout: ModelCacheLayout,
    token_ids: object,
    end_tokens: int,
    *,
    checkpoints_at: Sequence[int] | None = None,
    block_tokens: int = 256,
    salt: bytes = b"",
) -> tuple[list[PlannedObject], list[int]]:
    """History blocks below ``end_tokens`` (whole blocks only) and checkpoints at the block
    boundaries ``checkpoints_at`` (default: every one); returns them and those boundaries."""
    whole = end_tokens // block_tokens * block_tokens
    boundaries = list(range(block_tokens, whole + 1, block_tokens))
    if checkpoints_at is not None:
        unknown = sorted(set(checkpoints_at) - set(boundaries))
        if unknown:
            raise ValueError(f"checkpoints must sit on block boundaries up to {whole}, got {unknown}")
        boundaries = sorted(set(checkpoints_at))
    if whole == 0:
        return [], []
    keys = chained_keys(np.asarray(token_ids)[:whole], block_tokens, salt=salt)
    objects = _history_objects(layout, keys, block_tokens, whole)
    for boundary in boundaries:
        objects += _checkpoint_objects(layout, keys[boundary // block_tokens - 1], boundary)
    return objects, boundaries


def plan_prefix_offload(
    store: ObjectStore,
    token_ids: object,
    end_tokens: int,
    pages: Mapping[str, GroupPages],
    *,
    checkpoints_at: Sequence[int] | None = None,
    block_tokens: int = 256,
    salt: bytes = b"",
) -> OffloadPlan:
    """Offload a request's prefix from its page view ``pages``: the whole blocks below
    ``end_tokens`` and checkpoints at ``checkpoints_at`` (default: the last block boundary; a
    checkpoint costs a whole window of rows, so storing one at every boundary is a policy choice).
    A checkpoint whose rows the request no longer holds is left out."""
    whole = end_tokens // block_tokens * block_tokens
    at = ([whole] if whole else []) if checkpoints_at is None else checkpoints_at
    objects, _ = prefix_objects(store.layout, token_ids, end_tokens, checkpoints_at=at,
                                block_tokens=block_tokens, salt=salt)
    kept, sources = [], []
    for o in objects:
        spec = store.layout.group(o.key.group_id).spec
        first_row, num_rows = rows_for_tokens(spec, o.first_token, o.end_token)
        try:
            pages[o.key.group_id].slots(spec, first_row, num_rows)
        except MissingRows:
            if o.key.kind == "block":
                raise
            continue  # a checkpoint whose window the request has already released
        kept.append(o)
        sources.append(pages[o.key.group_id])
    return OffloadPlan(tuple(kept), tuple(sources))


def plan_prefix_load(store: ObjectStore, token_ids: object, *, block_tokens: int = 256, salt: bytes = b"") -> LoadPlan:
    """The boundaries of ``token_ids`` (below its last token, which must be computed) the tiers can
    serve by ``contains``: every history block below and the checkpoint at. The plan fetches
    those checkpoints and the blocks below the longest; its load verifies and may fall back."""
    tokens = np.asarray(token_ids)
    objects, boundaries = prefix_objects(store.layout, tokens, max(tokens.size - 1, 0),
                                         block_tokens=block_tokens, salt=salt)
    if not objects:
        return LoadPlan((), ())
    present = store.contains([o.key for o in objects])
    usable = tuple(b for b in boundaries if usable_boundary(objects, present, [b]) == b)
    chosen = tuple(o for o in objects if any(_serves(o, b) for b in usable))
    return LoadPlan(chosen, usable)


def pages_from_step(step: object, request_id: str) -> dict[str, GroupPages]:
    """Every group's page view of ``request_id`` from a ``StepBatch`` with full block tables."""
    try:
        row = step.request_ids.index(request_id)
    except ValueError:
        raise KeyError(f"request {request_id!r} is not in this step") from None
    out = {}
    for gid, group in step.groups.items():
        if group.block_table is None:
            raise ValueError("the step carries no block tables (block_tables='updates'): use pages_from_manager")
        base = 0 if group.base_pages is None else int(group.base_pages[row])
        out[gid] = GroupPages(base, np.asarray(group.block_table[row], dtype=np.int64))
    return out


def pages_from_manager(manager: object, request_id: str) -> dict[str, GroupPages]:
    """Every group's page view of ``request_id`` from ``CacheManager.request_pages``."""
    out = {}
    for spec in manager.specs:
        base, pages = manager.request_pages(request_id, spec.group_id)
        out[spec.group_id] = GroupPages(int(base), np.asarray(pages, dtype=np.int64))
    return out
