"""Several instances sharing one KV store: each its own manager and simulator, in lockstep.

Requests are spread round-robin (request ``i`` of the workload to instance
``i mod N``); a request that follows another (a conversation's next turn) waits
for it whichever instance ran it. Each instance's manager has a
:class:`~hybridkv.tierlink.TierLink` to one shared
:class:`~hybridkv.tiers.store.ObjectStore` (or none, for the comparison), and
:class:`TierEngine` plays the engine's part: real objects of the real sizes go
through the store (put, fetch, checksum verification), with zero rows, since
the simulation computes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np

from hybridkv.sim.driver import SimResult, SimulationError, Simulator
from hybridkv.inflight import InFlightRule
from hybridkv.sim.workloads import Request
from hybridkv.tierlink import PendingLoad, TierLink, TierLinkStats
from hybridkv.tiers.objects import RowsObject
from hybridkv.tiers.pools import layout_parts
from hybridkv.tiers.rows import rows_for_tokens
from hybridkv.tiers.store import ObjectStore
from hybridkv.transfer import LoadResult, usable_boundary

MAX_IDLE_ROUNDS = 100_000  # lockstep rounds in which no instance schedules anything
DEFAULT_MARKER_TTL_STEPS = 64


@dataclass
class MovedBytes:
    """What went through the store, headers included."""

    put_objects: int = 0
    put_bytes: int = 0  # offered to put (rows and headers)
    fetched_objects: int = 0
    fetched_bytes: int = 0  # verified and used by a load
    offloaded_keys: int = 0  # distinct prefix keys offloaded (blocks and checkpoints share a key)


class TierEngine:
    """The engine's side of a tier link in the simulation: moves objects, confirms loads."""

    def __init__(self, link: TierLink):
        self.link = link
        self.store: ObjectStore = link.store
        self.moved = MovedBytes()
        layout = self.store.layout
        self._parts = {g.group_id: layout_parts(layout, g.group_id) for g in layout.groups}
        self._specs = {g.group_id: g.spec for g in layout.groups}
        self._keys: set[bytes] = set()
        self._loaded: dict[str, int] = {}

    def offload(self) -> None:
        """Put every object the manager handed out (zero rows of the right size)."""
        plan = self.link.take_offloads()
        objects = []
        for obj in plan.objects:
            gid = obj.key.group_id
            first_row, num_rows = rows_for_tokens(self._specs[gid], obj.first_token, obj.end_token)
            row_bytes = sum(size for _, _, size in self._parts[gid])
            payload = np.zeros(num_rows * row_bytes, dtype=np.uint8)
            objects.append(RowsObject(obj.key, obj.first_token, obj.end_token - obj.first_token, first_row, num_rows,
                                      self._parts[gid], payload))
            self._keys.add(obj.key.key)
        if objects:
            self.store.put(objects)
            self.moved.put_objects += len(objects)
            self.moved.put_bytes += sum(_encoded_bytes(o) for o in objects)
            self.moved.offloaded_keys = len(self._keys)

    def load(self, request_id: str, limit: int = 64) -> tuple[int, bool, bool]:
        """Load ``request_id``'s tier hit (rounds and fallbacks included): its computed tokens,
        whether a load was denied pages (the request then holds only what loaded before), and
        whether it waits for blocks another request is computing (then it is not to be scheduled:
        :meth:`poll` each step moves it on)."""
        denied = self.link.stats().denied_loads
        for _ in range(limit):
            if not self.link.pending(request_id) or self.link.waiting(request_id):
                break
            if not self._take_and_confirm(request_id) and not self.link.pending(request_id):
                break
        waiting = self.link.waiting(request_id)
        return self.link.manager.num_computed_tokens(request_id), self.link.stats().denied_loads > denied, waiting

    def resume(self) -> None:
        """Match again the waiting requests whose wait is over (their loads: :meth:`load`)."""
        self.link.resume_waits()

    def loaded_tokens(self, request_id: str) -> int:
        """Tokens ``request_id`` gained from confirmed loads since :meth:`forget` (or ever)."""
        return self._loaded.get(request_id, 0)

    def waiting(self, request_id: str) -> bool:
        return self.link.waiting(request_id)

    def forget(self, request_id: str) -> None:
        self._loaded.pop(request_id, None)

    def _take_and_confirm(self, request_id: str) -> bool:
        loads = self.link.take_loads([request_id])
        self.offload()  # the load's pages may have evicted entries: out before they are written
        for load in loads:
            result = self._fetch(load)
            self.link.confirm_load(load.request_id, result)
            if result.boundary_tokens == load.boundary_tokens:
                gained = load.boundary_tokens - load.from_tokens
                self._loaded[load.request_id] = self._loaded.get(load.request_id, 0) + gained
        return bool(loads)

    def _fetch(self, load: PendingLoad) -> LoadResult:
        objects = load.plan.objects
        rows = [rows_for_tokens(self._specs[o.key.group_id], o.first_token, o.end_token)[1] for o in objects]
        got = self.store.fetch([o.key for o in objects], rows)
        present = [obj is not None and obj.first_token == o.first_token for o, obj in zip(objects, got)]
        boundary = usable_boundary(objects, present, load.plan.boundaries)
        used = [obj for obj, ok in zip(got, present) if ok] if boundary else []
        self.moved.fetched_objects += len(used)
        self.moved.fetched_bytes += sum(_encoded_bytes(o) for o in used)
        missing = tuple(o.key for o, ok in zip(objects, present) if not ok)
        return LoadResult(boundary, len(used), missing)


def _encoded_bytes(obj: RowsObject) -> int:
    from hybridkv.tiers.objects import encoded_size

    return encoded_size(obj.key, obj.parts, obj.num_rows)


@dataclass
class ClusterResult:
    instances: int
    results: list[SimResult]
    links: list[TierLinkStats]
    moved: MovedBytes
    grain_tokens: int

    def summary(self) -> dict:
        records = [r for result in self.results for r in result.requests]
        prompt = sum(r.prompt_tokens for r in records)
        hits = sum(r.first_hit_tokens for r in records)
        link = TierLinkStats()
        for stats in self.links:
            for f in fields(TierLinkStats):
                setattr(link, f.name, getattr(link, f.name) + getattr(stats, f.name))
        return {
            "instances": self.instances,
            "requests_finished": len(records),
            "steps": max((r.steps for r in self.results), default=0),
            "prompt_tokens": prompt,
            "hit_tokens": hits,
            "tier_hit_tokens": sum(r.first_tier_hit_tokens for r in records),
            "token_hit_rate": hits / prompt if prompt else 0.0,
            "preemptions": sum(int(r.preemptions.sum()) for r in self.results),
            "loads": {"planned": link.planned_loads, "confirmed": link.confirmed_loads, "failed": link.failed_loads,
                      "denied": link.denied_loads},
            "in_flight": {"waits": link.waits, "waited_out": link.waited_out,
                          "checkpoint_waits": link.checkpoint_waits, "wanted_checkpoints": link.wanted_checkpoints},
            "put_objects": self.moved.put_objects,
            "put_bytes": self.moved.put_bytes,
            "fetched_objects": self.moved.fetched_objects,
            "fetched_bytes": self.moved.fetched_bytes,
            "offloaded_prefix_tokens": self.moved.offloaded_keys * self.grain_tokens,
        }


def spread(requests: Sequence[Request], instances: int) -> list[list[Request]]:
    """Round-robin: request ``i`` (in workload order) to instance ``i mod instances``."""
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise ValueError(f"instances must be a positive int, got {instances!r}")
    return [list(requests[i::instances]) for i in range(instances)]


def run_cluster(
    make_manager: Callable[[TierLink | None], object],
    requests: Sequence[Request],
    instances: int,
    *,
    store: ObjectStore | None = None,
    write_through: bool = True,
    simulator_options: dict | None = None,
    on_round: Callable[[int], None] | None = None,
    wait_steps: int = 0,
    marker_ttl_steps: int = DEFAULT_MARKER_TTL_STEPS,
) -> ClusterResult:
    """Run ``requests`` over ``instances`` managers (``make_manager(link)`` builds one) in lockstep,
    all linked to ``store`` (None: no store).

    ``wait_steps`` > 0: the links mark the blocks their requests compute, and a request whose
    next block another request is computing waits up to that many lockstep rounds
    (:class:`~hybridkv.inflight.InFlightRule`, its clock the round counter; markers expire after
    ``marker_ttl_steps``)."""
    rounds = [0]  # lockstep rounds so far: the in-flight rule's clock
    rule = None
    if wait_steps:
        rule = InFlightRule(wait=wait_steps, ttl=marker_ttl_steps, clock=lambda: rounds[0])
    sims, links, engines = [], [], []
    for part in spread(requests, instances):
        link = TierLink(store, write_through=write_through, in_flight=rule) if store is not None else None
        engine = TierEngine(link) if link is not None else None
        sims.append(Simulator(make_manager(link), part, tier=engine, **(simulator_options or {})))
        links.append(link)
        engines.append(engine)
    results = _lockstep(sims, rounds, on_round)
    moved = MovedBytes()
    for engine in engines:
        if engine is not None:
            for f in fields(MovedBytes):
                setattr(moved, f.name, getattr(moved, f.name) + getattr(engine.moved, f.name))
    grain = sims[0].manager.prefix.granularity_tokens if sims[0].manager.prefix is not None else 0
    return ClusterResult(instances, results, [link.stats() for link in links if link is not None], moved, grain)


def _lockstep(sims: list[Simulator], rounds: list[int], on_round: Callable[[int], None] | None,
              ) -> list[SimResult | None]:
    """Step every simulator once a round until all are done (``rounds[0]`` counts the
    rounds); their results. ``SimulationError`` when no instance works for
    ``MAX_IDLE_ROUNDS`` rounds."""
    finished: set[str] = set()
    steps = [sim.steps(finished_ids=finished) for sim in sims]
    results: list[SimResult | None] = [None] * len(sims)
    live, idle = list(range(len(sims))), 0
    while live:
        worked = False
        for i in list(live):
            try:
                worked = next(steps[i]) or worked
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
        rounds[0] += 1
        idle = 0 if worked else idle + 1
        if idle > MAX_IDLE_ROUNDS:
            raise SimulationError(f"{len(live)} instances wait for requests that never run")
        if on_round is not None:
            on_round(len(finished))
    return results


def naive_bytes_per_token(layout) -> float:
    """Bytes a store keeps per prefix token when it stores every group's full pages (no retention)."""
    return float(sum(g.page_bytes / g.spec.page_tokens for g in layout.groups))
