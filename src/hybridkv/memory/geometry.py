"""The byte geometry of a shared arena (docs/planning.md, "Shared page space"): head, slabs, the pages
of each group a slab holds, and what a plan's arena holds at once. Plain ints: the planner and
``hybridkv plan`` use it without numpy (only the per-slab arrays import it); :mod:`hybridkv.memory.arena`
lends the slabs at run time."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridkv._checks import as_int

if TYPE_CHECKING:
    import numpy as np

DEFAULT_SLAB_ANCHOR_PAGES = 16
PAGE_SPACES: tuple[str, ...] = ("shared", "per-group")  # how a budget is laid out; the first is the default


def check_page_space(page_space: object) -> str:
    """``page_space`` if it names a page space (``PAGE_SPACES``: one shared arena, or one pool per group);
    ``ValueError`` otherwise (for the planner and ``CacheManager.from_plan`` alike)."""
    if not isinstance(page_space, str) or page_space not in PAGE_SPACES:
        raise ValueError(f"page_space must be 'shared' or 'per-group', got {page_space!r}")
    return str(page_space)  # a str subclass as a plain str


@dataclass(frozen=True)
class ArenaGeometry:
    """Byte geometry of a shared arena: ``reserved_bytes + num_slabs * slab_bytes``."""

    page_bytes: Mapping[str, int]
    reserved_bytes: int
    slab_bytes: int
    num_slabs: int

    def __post_init__(self) -> None:
        """Refuse a geometry the arena cannot lend (one built by hand; :func:`arena_geometry`'s always passes): ints
        only, at least one slab, a head holding every group's null page (page 0), and every slab holding a whole
        page of every group (what the arena's admission bound, ``Arena.surely_short``, relies on)."""
        sizes = {gid: as_int(f"page_bytes[{gid!r}]", b, minimum=1) for gid, b in dict(self.page_bytes).items()}
        if not sizes:
            raise ValueError("an arena needs the page bytes of at least one group")
        object.__setattr__(self, "page_bytes", sizes)
        for name, minimum in (("reserved_bytes", 0), ("slab_bytes", 1), ("num_slabs", 1)):
            object.__setattr__(self, name, as_int(name, getattr(self, name), minimum=minimum))
        largest = max(sizes, key=sizes.get)
        if self.reserved_bytes < sizes[largest]:
            raise ValueError(f"a {self.reserved_bytes:,} B head cannot hold the null page of group {largest!r} "
                             f"({sizes[largest]:,} B): page 0 of every group lies in the head")
        for gid in sizes:  # two whole pages' bytes always hold one; one's may not (fewest_slab_pages says)
            if self.slab_bytes < 2 * sizes[gid] and self.fewest_slab_pages(gid) < 1:
                raise ValueError(f"a slab of {self.slab_bytes:,} B after a {self.reserved_bytes:,} B head holds no whole "
                                 f"{sizes[gid]:,} B page of group {gid!r}: every slab must hold a page of every group")

    @property
    def total_bytes(self) -> int:
        return self.reserved_bytes + self.num_slabs * self.slab_bytes

    def view_pages(self, group_id: str) -> int:
        """Rows of the group's tensor view (page ids ``0 .. view_pages-1``; 0 is null)."""
        return self.total_bytes // self.page_bytes[group_id]

    def fewest_slab_pages(self, group_id: str) -> int:
        """The fewest of the group's pages wholly inside one slab (the least ``hi - lo`` of ``slab_page_ranges``),
        in plain ints. A slab of ``whole`` pages and ``extra`` bytes starting ``r`` bytes into a page holds
        ``whole`` pages when ``r == 0`` or ``r + extra >= size``, else ``whole - 1``; the offsets ``r`` of
        successive slabs repeat with period ``size // gcd(extra, size)``."""
        size = self.page_bytes[group_id]
        whole, extra = divmod(self.slab_bytes, size)
        offset = self.reserved_bytes % size
        for _ in range(min(self.num_slabs, size // math.gcd(extra, size))):
            if 0 < offset < size - extra:
                return whole - 1
            offset = (offset + extra) % size
        return whole

    def slab_page_ranges(self, group_id: str) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` per slab: the group's page ids wholly inside slab ``k`` are ``lo[k] .. hi[k]-1``."""
        import numpy as np  # here, so that planning (``hybridkv plan``) imports no numpy

        size = self.page_bytes[group_id]
        start = self.reserved_bytes + np.arange(self.num_slabs, dtype=np.int64) * self.slab_bytes
        return -(-start // size), (start + self.slab_bytes) // size

    def boundary_pages(self, group_id: str) -> np.ndarray:
        """Per slab ``k``: the group's page straddling slabs ``k-1`` and ``k``, or -1 (none, or ``k == 0``)."""
        import numpy as np

        lo, hi = self.slab_page_ranges(group_id)  # slab k-1 ends inside a page iff slab k starts past its last one
        return np.concatenate([[-1], np.where(lo[1:] > hi[:-1], hi[:-1], -1)])


def arena_geometry(page_bytes: Mapping[str, int], budget_bytes: int, *, anchor_group: str,
                   slab_anchor_pages: int = DEFAULT_SLAB_ANCHOR_PAGES) -> ArenaGeometry:
    """The arena that fits ``budget_bytes``: slabs of ``slab_anchor_pages`` anchor pages (at least two of the
    largest group's pages) after a head of whole anchor pages covering the largest page (the null pages)."""
    sizes = {gid: as_int(f"page_bytes[{gid!r}]", b, minimum=1) for gid, b in page_bytes.items()}
    if anchor_group not in sizes:
        raise ValueError(f"anchor group {anchor_group!r} is not one of {sorted(sizes)}")
    budget = as_int("budget_bytes", budget_bytes, minimum=0)
    anchor_pages = as_int("slab_anchor_pages", slab_anchor_pages, minimum=1)
    anchor, largest = sizes[anchor_group], max(sizes.values())
    reserved = -(-largest // anchor) * anchor
    slab = max(anchor_pages, -(-2 * largest // anchor)) * anchor
    slabs = (budget - reserved) // slab if budget > reserved else 0
    if slabs < 1:
        raise ValueError(f"KV memory of {budget:,} B holds no slab: a shared arena needs {reserved + slab:,} B "
                         f"at least ({reserved:,} B of null pages + one {slab:,} B slab)")
    return ArenaGeometry(dict(sizes), reserved, slab, int(slabs))


def anchor_group_for(specs: Sequence[Any], page_bytes: Mapping[str, int]) -> str:
    """The full-history group with the most bytes per token (any group if none is full)."""
    history = [s for s in specs if not s.is_sliding] or list(specs)
    return max(history, key=lambda s: page_bytes[s.group_id] / s.page_tokens).group_id


def shared_arena_for(plan: Any, slab_anchor_pages: int | None = None) -> ArenaGeometry:
    """The arena for a :class:`hybridkv.plan.Plan`: its byte budget (its planned
    bytes when it was built from a token count)."""
    page_bytes = plan.page_bytes
    budget = plan.budget_bytes if plan.budget_bytes is not None else plan.total_bytes
    return arena_geometry(
        page_bytes, budget, anchor_group=anchor_group_for(plan.specs, page_bytes),
        slab_anchor_pages=DEFAULT_SLAB_ANCHOR_PAGES if slab_anchor_pages is None else slab_anchor_pages)


def shared_concurrency(plan: Any, context_tokens: int, geometry: ArenaGeometry | None = None) -> int:
    """Requests at ``context_tokens`` a shared arena holds at once: the largest ``N`` whose pages (plus one
    step's chunk in every sliding group) fill whole slabs within it. Memory only, like ``Plan.concurrency``."""
    geometry = geometry if geometry is not None else shared_arena_for(plan)
    need = plan.request_pages(context_tokens)
    sched = plan.limits.max_scheduled_tokens
    step = {s.group_id: (-(-sched // s.page_tokens) + 1 if s.is_sliding else 0) for s in plan.specs}
    per_slab = {s.group_id: geometry.fewest_slab_pages(s.group_id) for s in plan.specs}
    # The slabs N requests fill grow with N; more than the arena holds is surely too many.
    too_many = bisect.bisect_right(range(geometry.num_slabs * max(per_slab.values()) + 2), geometry.num_slabs,
                                   key=lambda n: sum(-(-(n * need[g] + step[g]) // per_slab[g]) for g in need))
    return max(too_many - 1, 0)


__all__ = ["ArenaGeometry", "DEFAULT_SLAB_ANCHOR_PAGES", "PAGE_SPACES", "anchor_group_for", "arena_geometry",
           "check_page_space", "shared_arena_for", "shared_concurrency"]
