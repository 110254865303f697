"""The inverse plan: the KV memory ``N`` requests at context ``L`` need.

:func:`memory_for_requests` answers it in both page spaces:

* per-group pools: the smallest token budget (whole scheduler pages) whose
  :class:`~hybridkv.plan.Plan` fits ``N`` requests at ``L`` in every group
  (``Plan.concurrency(L) >= N``), and that plan's bytes per group;
* a shared arena: the fewest slabs whose arena holds ``N`` requests at ``L``
  (:func:`hybridkv.memory.arena.shared_concurrency`), and the slabs each group fills.

Both are memory only, for one cache (one GPU, or one attention data-parallel
rank; tensor-parallel ranks each hold the whole V4 cache, which has one KV head).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv._checks import as_int
from hybridkv.models.layout import ModelCacheLayout
from hybridkv.plan import Limits, Plan, plan_for_tokens, scheduler_page_tokens
from hybridkv.units import format_bytes


@dataclass(frozen=True)
class RequestMemory:
    """What ``requests`` requests at ``context_tokens`` need (see module doc)."""

    requests: int
    context_tokens: int
    per_group_plan: Plan  # the smallest per-group plan that fits them
    shared_total_bytes: int  # the smallest shared arena that fits them
    shared_group_bytes: dict[str, int]  # slab bytes each group fills in it
    shared_reserved_bytes: int
    shared_slab_bytes: int
    shared_num_slabs: int

    @property
    def per_group_total_bytes(self) -> int:
        return self.per_group_plan.total_bytes

    @property
    def per_group_bytes(self) -> dict[str, int]:
        return self.per_group_plan.group_bytes

    def report(self) -> dict:
        plan = self.per_group_plan
        return {
            "requests": self.requests,
            "context_tokens": self.context_tokens,
            "request_pages": plan.request_pages(self.context_tokens),
            "per_group": {
                "total_bytes": self.per_group_total_bytes,
                "total_tokens": plan.total_tokens,
                "group_pages": plan.group_pages,
                "group_bytes": self.per_group_bytes,
            },
            "shared": {
                "total_bytes": self.shared_total_bytes,
                "reserved_bytes": self.shared_reserved_bytes,
                "slab_bytes": self.shared_slab_bytes,
                "num_slabs": self.shared_num_slabs,
                "group_bytes": self.shared_group_bytes,
            },
        }


def _smallest_per_group_plan(layout: ModelCacheLayout, limits: Limits, requests: int, context: int) -> Plan:
    grain = scheduler_page_tokens(layout.specs)
    k = limits.speculative_tokens

    def fits(pages: int) -> bool:
        return plan_for_tokens(layout, pages * grain, limits).max_concurrent_requests(context) >= requests

    too_few = 0
    enough = -(-requests * (context + k + grain) // grain) + 1
    while enough - too_few > 1:
        mid = (too_few + enough) // 2
        if fits(mid):
            enough = mid
        else:
            too_few = mid
    return plan_for_tokens(layout, enough * grain, limits, page_space="per-group")


def _shared_arena(plan: Plan, budget: int):
    from hybridkv.memory.arena import shared_arena_for

    return shared_arena_for(Plan(plan.layout, plan.limits, plan.total_tokens, budget))


def _shared_fits(plan: Plan, budget: int, requests: int, context: int) -> bool:
    from hybridkv.memory.arena import shared_concurrency

    shaped = Plan(plan.layout, plan.limits, plan.total_tokens, budget)
    return shared_concurrency(shaped, context, _shared_arena(plan, budget)) >= requests


def _smallest_shared_budget(plan: Plan, requests: int, context: int) -> int:
    """Fewest slabs (as bytes) whose arena fits the requests; ``plan`` gives the shape."""
    from hybridkv.memory.arena import anchor_group_for, arena_geometry

    page_bytes = plan.page_bytes
    probe = arena_geometry(
        page_bytes, 2**62, anchor_group=anchor_group_for(plan.specs, page_bytes)
    )
    reserved, slab = probe.reserved_bytes, probe.slab_bytes
    too_few, enough = 0, 1
    while not _shared_fits(plan, reserved + enough * slab, requests, context):
        too_few, enough = enough, enough * 2
    while enough - too_few > 1:
        mid = (too_few + enough) // 2
        if _shared_fits(plan, reserved + mid * slab, requests, context):
            enough = mid
        else:
            too_few = mid
    return reserved + enough * slab


def _shared_group_bytes(plan: Plan, geometry, requests: int, context: int) -> dict[str, int]:
    need = plan.request_pages(context)
    sched = plan.limits.max_scheduled_tokens
    out = {}
    for spec in plan.specs:
        lo, hi = geometry.slab_page_ranges(spec.group_id)
        per_slab = int((hi - lo).min())
        step = -(-sched // spec.page_tokens) + 1 if spec.is_sliding else 0
        out[spec.group_id] = -(-(requests * need[spec.group_id] + step) // per_slab) * geometry.slab_bytes
    return out


def memory_for_requests(
    layout: ModelCacheLayout,
    limits: Limits,
    requests: int,
    context_tokens: int,
    *,
    max_total_bytes: int | None = None,
) -> RequestMemory:
    """KV memory for ``requests`` requests at ``context_tokens`` each, in both page spaces.

    ``limits.max_running_requests`` must be at least ``requests`` (they all run at
    once) and ``context_tokens`` at most ``limits.max_context_tokens``. With
    ``max_total_bytes``, a need beyond it raises ``ValueError`` before the shared
    arena (whose search allocates per slab) is sized.
    """
    count = as_int("requests", requests, minimum=1)
    context = as_int("context_tokens", context_tokens, minimum=1)
    if count > limits.max_running_requests:
        raise ValueError(
            f"requests={count:,} exceeds max_running_requests={limits.max_running_requests:,}: "
            "the requests must all run at once"
        )
    if context > limits.max_context_tokens:
        raise ValueError(
            f"context_tokens={context:,} exceeds max_context_tokens={limits.max_context_tokens:,}"
        )
    plan = _smallest_per_group_plan(layout, limits, count, context)
    if max_total_bytes is not None and plan.total_bytes > max_total_bytes:
        raise ValueError(
            f"{count:,} requests at {context:,} tokens need {format_bytes(plan.total_bytes)} "
            f"in per-group pools, beyond the {format_bytes(max_total_bytes)} hybridkv plans for"
        )
    budget = _smallest_shared_budget(plan, count, context)
    geometry = _shared_arena(plan, budget)
    return RequestMemory(
        requests=count,
        context_tokens=context,
        per_group_plan=plan,
        shared_total_bytes=geometry.total_bytes,
        shared_group_bytes=_shared_group_bytes(plan, geometry, count, context),
        shared_reserved_bytes=geometry.reserved_bytes,
        shared_slab_bytes=geometry.slab_bytes,
        shared_num_slabs=geometry.num_slabs,
    )


__all__ = ["RequestMemory", "memory_for_requests"]
