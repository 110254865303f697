"""Memory planning: page counts per group, the token budget a byte budget buys,
capacity, concurrency and block-table widths. Pure functions of specs and limits.

Notation (``docs/planning.md`` has the derivations): ``T`` = a group's page
tokens, ``W`` its window, ``live`` = max running requests, ``sched`` = max
tokens scheduled per step, ``ctx`` = max context, ``k`` = speculative (verify)
tokens per decode step, ``total`` = token budget. Every group keeps page 0 as
the reserved null page.

* full history: ``ceil(total / T) + live + 1``
* sliding: ``live * ceil(min(max(W - 1, 0) + k - 1, ctx) / T)
  + ceil(min(sched, total) / T) + live + 1``
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable

from hybridkv._checks import as_int
from hybridkv.memory.geometry import PAGE_SPACES, check_page_space, shared_arena_for
from hybridkv.models.layout import ModelCacheLayout
from hybridkv.spec import CacheGroupSpec
from hybridkv.units import format_bytes

REPORT_SCHEMA_VERSION = 1

# Beyond these, block tables and positions (int32) would overflow or tables would
# not fit memory: refused when a Limits is built, before anything is allocated.
LIMIT_MAXIMA = {
    "max_running_requests": 2**20,
    "max_scheduled_tokens": 2**31 - 1,
    "max_context_tokens": 2**31 - 1,
    "speculative_tokens": 2**16,
}


def _positive(name: str, value: object) -> int:
    return as_int(name, value, minimum=1)


@dataclass(frozen=True)
class Limits:
    """Scheduler limits a plan is sized for.

    ``max_running_requests``: requests holding pages at once (``live``);
    ``max_scheduled_tokens``: tokens scheduled per step over all requests
    (``sched``, the chunk size); ``max_context_tokens``: longest request
    (``ctx``); ``speculative_tokens``: tokens a decoding request schedules per
    step (verify width ``k``; 1 without speculation), also the reservation
    horizon of block tables. Each must be a positive int no larger than
    ``LIMIT_MAXIMA`` gives (positions are int32).
    """

    max_running_requests: int
    max_scheduled_tokens: int
    max_context_tokens: int
    speculative_tokens: int = 1

    def __post_init__(self) -> None:
        for name, most in LIMIT_MAXIMA.items():
            value = _positive(name, getattr(self, name))
            if value > most:
                raise ValueError(f"{name}={value:,} is beyond {most:,}, the most hybridkv plans for")
            object.__setattr__(self, name, value)


def scheduler_page_tokens(specs: Iterable[CacheGroupSpec]) -> int:
    """Token grain of a plan: the LCM of the history groups' page tokens
    (of all groups' page tokens when there is no history group)."""
    specs = tuple(specs)
    if not specs:
        raise ValueError("no cache groups")
    history = [s.page_tokens for s in specs if not s.is_sliding]
    return math.lcm(*(history or [s.page_tokens for s in specs]))


def sliding_request_tokens(spec: CacheGroupSpec, limits: Limits) -> int:
    """Tokens of a sliding group one running request may hold between steps, beyond
    the page it partially fills: ``min(max(W - 1, 0) + k - 1, ctx)``."""
    window = spec.sliding_window_tokens
    return min(max(window - 1, 0) + limits.speculative_tokens - 1, limits.max_context_tokens)


def group_page_counts(
    specs: Iterable[CacheGroupSpec], limits: Limits, total_tokens: int
) -> dict[str, int]:
    """Pages per group (null page included) for a token budget of ``total_tokens``."""
    total = _positive("total_tokens", total_tokens)
    live = limits.max_running_requests
    counts: dict[str, int] = {}
    for spec in specs:
        page_tokens = spec.page_tokens
        if spec.is_sliding:
            pages = (
                live * -(-sliding_request_tokens(spec, limits) // page_tokens)
                + -(-min(limits.max_scheduled_tokens, total) // page_tokens)
                + live
                + 1
            )
        else:
            pages = -(-total // page_tokens) + live + 1
        counts[spec.group_id] = pages
    return counts


def table_widths(specs: Iterable[CacheGroupSpec], limits: Limits) -> dict[str, int]:
    """Block-table widths for graph capture: full ``ceil((ctx + k) / T)``, sliding
    ``ceil((min(W, ctx) + k) / T) + 1``."""
    k, ctx = limits.speculative_tokens, limits.max_context_tokens
    return {
        spec.group_id: (
            -(-(min(spec.sliding_window_tokens, ctx) + k) // spec.page_tokens) + 1
            if spec.is_sliding
            else -(-(ctx + k) // spec.page_tokens)
        )
        for spec in specs
    }


def _request_pages(spec: CacheGroupSpec, context_tokens: int, horizon_tokens: int) -> int:
    """Pages one request at ``context_tokens`` holds, with ``horizon_tokens`` reserved ahead."""
    t = spec.page_tokens
    whole = -(-(context_tokens + horizon_tokens) // t)
    if spec.is_sliding:
        # The next query reads W-1 earlier tokens plus the k it writes; at the worst
        # page alignment those span ceil((n + T - 1) / T) pages, never more than the
        # pages of the whole sequence.
        live_tokens = min(spec.sliding_window_tokens - 1, context_tokens) + horizon_tokens
        return min(-(-(live_tokens + t - 1) // t), whole)
    return whole


@dataclass(frozen=True)
class Plan:
    """Pages per group for a layout, limits and token budget. Build with
    :func:`plan_for_budget` or :func:`plan_for_tokens`.

    ``page_space`` is the page space the plan was made for and the one
    ``CacheManager.from_plan`` builds by default: ``"shared"`` (one arena of
    ``budget_bytes``, or of ``total_bytes`` without a budget) or ``"per-group"``
    (one pool per group with ``group_pages``). The per-group figures
    (``group_pages``, ``concurrency``, ``report``'s groups) are computed either way."""

    layout: ModelCacheLayout
    limits: Limits
    total_tokens: int
    budget_bytes: int | None = None
    page_space: str = PAGE_SPACES[0]

    def __post_init__(self) -> None:
        check_page_space(self.page_space)

    @property
    def specs(self) -> tuple[CacheGroupSpec, ...]:
        return self.layout.specs

    @cached_property
    def scheduler_page_tokens(self) -> int:
        return scheduler_page_tokens(self.specs)

    @property
    def scheduler_pages(self) -> int:
        return self.total_tokens // self.scheduler_page_tokens

    @cached_property
    def _group_pages(self) -> tuple[tuple[str, int], ...]:
        return tuple(group_page_counts(self.specs, self.limits, self.total_tokens).items())

    @property
    def group_pages(self) -> dict[str, int]:
        """Pages per group, the null page included."""
        return dict(self._group_pages)

    @property
    def page_bytes(self) -> dict[str, int]:
        return {g.group_id: g.page_bytes for g in self.layout.groups}

    @property
    def group_bytes(self) -> dict[str, int]:
        page_bytes = self.page_bytes
        return {gid: pages * page_bytes[gid] for gid, pages in self._group_pages}

    @property
    def fits_per_group(self) -> bool:
        """Whether per-group pools of this plan fit its budget (always, without one)."""
        return self.budget_bytes is None or self.total_bytes <= self.budget_bytes

    @property
    def total_bytes(self) -> int:
        return sum(self.group_bytes.values())

    @property
    def table_widths(self) -> dict[str, int]:
        return table_widths(self.specs, self.limits)

    @property
    def bytes_per_token_allocated(self) -> float:
        return self.total_bytes / self.total_tokens

    @property
    def ideal_bytes_per_token(self) -> float:
        return self.layout.ideal_bytes_per_token

    def request_pages(self, context_tokens: int) -> dict[str, int]:
        """Pages one request at ``context_tokens`` needs per group, reserving
        ``speculative_tokens`` ahead: full ``ceil((L + k) / T)``, sliding
        ``ceil((min(W, L) + k) / T) + 1`` (the table width once ``L >= W``)."""
        context = _positive("context_tokens", context_tokens)
        if context > self.limits.max_context_tokens:
            raise ValueError(
                f"context_tokens={context:,} exceeds max_context_tokens="
                f"{self.limits.max_context_tokens:,}"
            )
        k = self.limits.speculative_tokens
        return {spec.group_id: _request_pages(spec, context, k) for spec in self.specs}

    def concurrency(self, context_tokens: int) -> tuple[int, str]:
        """``(requests, limiting_group_id)``: how many requests at ``context_tokens``
        fit at once, counting every group: min over groups of
        ``(group_pages - 1) // request_pages`` (the first group in spec order wins ties).
        Memory only; the scheduler may cap running requests lower."""
        need = self.request_pages(context_tokens)
        best: tuple[int, str] | None = None
        for gid, pages in self._group_pages:
            fit = (pages - 1) // need[gid]
            if best is None or fit < best[0]:
                best = (fit, gid)
        assert best is not None
        return best

    def max_concurrent_requests(self, context_tokens: int) -> int:
        return self.concurrency(context_tokens)[0]

    def report(self, context_tokens: int | None = None) -> dict[str, Any]:
        """A JSON-ready summary (schema in ``docs/planning.md``)."""
        layout, limits = self.layout, self.limits
        total_bytes = self.total_bytes
        groups = self._group_reports(context_tokens)
        out: dict[str, Any] = {
            "schema_version": REPORT_SCHEMA_VERSION,
            "model": layout.name,
            "indexer": layout.indexer,
            "include_mtp": layout.include_mtp,
            "num_layers": layout.num_layers,
            "limits": {
                "max_running_requests": limits.max_running_requests,
                "max_scheduled_tokens": limits.max_scheduled_tokens,
                "max_context_tokens": limits.max_context_tokens,
                "speculative_tokens": limits.speculative_tokens,
            },
            "page_space": self.page_space,
            "budget_bytes": self.budget_bytes,
            "total_bytes": total_bytes,
            "unused_bytes": None if self.budget_bytes is None else self.budget_bytes - total_bytes,
            "scheduler_page_tokens": self.scheduler_page_tokens,
            "scheduler_pages": self.scheduler_pages,
            "total_tokens": self.total_tokens,
            "bytes_per_token_allocated": self.bytes_per_token_allocated,
            "ideal_bytes_per_token": self.ideal_bytes_per_token,
            "groups": groups,
        }
        if context_tokens is not None:
            count, limiting = self.concurrency(context_tokens)
            out["concurrency"] = {
                "context_tokens": int(context_tokens),
                "max_requests": count,
                "limiting_group": limiting,
            }
        return out

    def _group_reports(self, context_tokens: int | None) -> list[dict[str, Any]]:
        """``report``'s entry per group (with the pages a request of ``context_tokens``
        needs and how many such requests fit, when given)."""
        group_pages, group_bytes, widths = self.group_pages, self.group_bytes, self.table_widths
        need = self.request_pages(context_tokens) if context_tokens is not None else None
        groups = []
        for group in self.layout.groups:
            spec, gid = group.spec, group.group_id
            entry: dict[str, Any] = {
                "group_id": gid,
                "retention": spec.retention,
                "family": spec.family,
                "rows_per_page": spec.rows_per_page,
                "entry_stride_tokens": spec.entry_stride_tokens,
                "page_tokens": spec.page_tokens,
                "sliding_window_tokens": spec.sliding_window_tokens,
                "layers": list(group.layers),
                "num_layers": len(group.layers),
                "layer_plane_bytes": dict(group.plane_bytes),
                "page_bytes": group.page_bytes,
                "pages": group_pages[gid],
                "bytes": group_bytes[gid],
                "share": group_bytes[gid] / self.total_bytes,
                "table_width": widths[gid],
                "ideal_bytes_per_token": group.ideal_bytes_per_token,
            }
            if need is not None:
                entry["request_pages"] = need[gid]
                entry["max_requests"] = (group_pages[gid] - 1) // need[gid]
            groups.append(entry)
        return groups


def _check_layout_limits(layout: ModelCacheLayout, limits: Limits) -> None:
    if not isinstance(limits, Limits):
        raise ValueError(f"limits must be a Limits, got {type(limits).__name__}")
    if limits.speculative_tokens != layout.speculative_tokens:
        raise ValueError(
            f"limits.speculative_tokens={limits.speculative_tokens} but the layout's state "
            f"windows were built for speculative_tokens={layout.speculative_tokens}"
        )


def plan_for_tokens(
    layout: ModelCacheLayout, total_tokens: int, limits: Limits, *, page_space: str = PAGE_SPACES[0]
) -> Plan:
    """The plan for a token budget, a positive multiple of the scheduler page tokens, made for
    ``page_space`` (a shared arena of the plan's ``total_bytes``, or per-group pools)."""
    _check_layout_limits(layout, limits)
    page_space = check_page_space(page_space)
    total = _positive("total_tokens", total_tokens)
    grain = scheduler_page_tokens(layout.specs)
    if total % grain:
        raise ValueError(
            f"total_tokens={total:,} is not a whole number of {grain}-token scheduler pages"
        )
    return Plan(layout, limits, total, page_space=page_space)


def _plan_bytes(layout: ModelCacheLayout, limits: Limits, total_tokens: int) -> int:
    pages = group_page_counts(layout.specs, limits, total_tokens)
    return sum(pages[g.group_id] * g.page_bytes for g in layout.groups)


def plan_for_budget(
    layout: ModelCacheLayout, kv_memory_bytes: int, limits: Limits, *, page_space: str = PAGE_SPACES[0]
) -> Plan:
    """The largest plan, in whole scheduler pages, whose bytes fit ``kv_memory_bytes``:
    ``bytes(plan) <= budget < bytes(plan with one more scheduler page)``, made for
    ``page_space`` (default ``"shared"``: one arena of the whole budget; ``"per-group"``:
    one pool per group with the plan's page counts).

    Raises ``ValueError`` when no group grows with the token budget; with
    ``page_space="per-group"``, when even one scheduler page does not fit (the message
    names the minimum); with ``"shared"``, when the budget holds no arena slab.

    A shared arena reserves no window or state pages per running request, so with
    ``page_space="shared"`` a budget too small for per-group pools still gives a plan:
    the plan of one scheduler page with the budget kept, whose per-group figures
    exceed the budget (``Plan.fits_per_group`` is False).
    """
    page_space = check_page_space(page_space)
    _check_layout_limits(layout, limits)
    budget = as_int("kv_memory_bytes", kv_memory_bytes, minimum=0)
    grain = scheduler_page_tokens(layout.specs)
    # Bytes that every extra scheduler page adds at least (history groups only).
    growth_bytes = sum(
        grain // g.spec.page_tokens * g.page_bytes for g in layout.groups if not g.spec.is_sliding
    )
    if growth_bytes == 0:
        raise ValueError(
            f"{layout.name} has no full-history cache group: its token capacity is not "
            "bounded by memory"
        )
    minimum = _plan_bytes(layout, limits, grain)
    if minimum > budget and page_space == "per-group":
        raise ValueError(
            f"KV memory of {budget:,} B ({format_bytes(budget)}) is too small for per-group pools: one "
            f"{grain}-token scheduler page with {limits.max_running_requests:,} running "
            f"requests needs at least {minimum:,} B ({format_bytes(minimum)}); plan fewer running requests, "
            "or page_space='shared' (it reserves no pages per running request)"
        )
    # bytes(n) is non-decreasing in n and bytes(n) >= n * growth_bytes, so the
    # answer lies in [1, budget // growth_bytes]; below the minimum (shared only) it is 1.
    fits, too_big = 1, max(budget // growth_bytes + 1, 2)
    while too_big - fits > 1:
        mid = (fits + too_big) // 2
        if _plan_bytes(layout, limits, mid * grain) <= budget:
            fits = mid
        else:
            too_big = mid
    plan = Plan(layout, limits, fits * grain, budget, page_space)
    if page_space == "shared":
        shared_arena_for(plan)  # raises when the budget holds no slab
    return plan


__all__ = [
    "Limits",
    "PAGE_SPACES",
    "Plan",
    "REPORT_SCHEMA_VERSION",
    "group_page_counts",
    "plan_for_budget",
    "plan_for_tokens",
    "scheduler_page_tokens",
    "sliding_request_tokens",
    "table_widths",
]
