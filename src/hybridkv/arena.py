"""One byte arena shared by every cache group, lent out in slabs.

Each group still sees its own kernel tensor, ``uint8[view_pages, page_bytes]``,
but all of them are views of the same arena starting at byte 0: page ``p`` of
a group with ``S``-byte pages is bytes ``[p*S, (p+1)*S)``. The arena is cut into
equal slabs after a reserved head (where every group's null page 0 lies). A
slab belongs to at most one group at a time; that group may use the page ids
lying wholly inside it. So window and compressor-state memory is taken only
while requests need it, and history groups grow into what others give back.

The slab size is a whole number of pages of one *anchor* group (the history
group with the most bytes per token), so that group loses nothing at slab
edges; other groups lose less than one page per slab they hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridkv._checks import as_int
from hybridkv.pool import PagePool

DEFAULT_SLAB_ANCHOR_PAGES = 16


@dataclass(frozen=True)
class ArenaGeometry:
    """Byte geometry of a shared arena: ``reserved_bytes + num_slabs * slab_bytes``."""

    page_bytes: Mapping[str, int]
    reserved_bytes: int
    slab_bytes: int
    num_slabs: int

    @property
    def total_bytes(self) -> int:
        return self.reserved_bytes + self.num_slabs * self.slab_bytes

    def view_pages(self, group_id: str) -> int:
        """Rows of the group's tensor view (page ids ``0 .. view_pages-1``; 0 is null)."""
        return self.total_bytes // self.page_bytes[group_id]

    def slab_page_ranges(self, group_id: str) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` per slab: the group's page ids wholly inside slab ``k`` are ``lo[k] .. hi[k]-1``."""
        size = self.page_bytes[group_id]
        start = self.reserved_bytes + np.arange(self.num_slabs, dtype=np.int64) * self.slab_bytes
        return -(-start // size), (start + self.slab_bytes) // size

    def slab_of(self, group_id: str, pages: np.ndarray) -> np.ndarray:
        """Slab index of each (non-null) page id of a group."""
        return (np.asarray(pages, dtype=np.int64) * self.page_bytes[group_id] - self.reserved_bytes) // self.slab_bytes


def arena_geometry(
    page_bytes: Mapping[str, int],
    budget_bytes: int,
    *,
    anchor_group: str,
    slab_anchor_pages: int = DEFAULT_SLAB_ANCHOR_PAGES,
) -> ArenaGeometry:
    """The arena that fits ``budget_bytes``: slabs of ``slab_anchor_pages`` anchor pages
    (raised so every slab holds at least two pages of the largest group), after a
    head of whole anchor pages covering the largest page (the null pages)."""
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
        raise ValueError(
            f"KV memory of {budget:,} B holds no slab: a shared arena needs {reserved + slab:,} B "
            f"at least ({reserved:,} B of null pages + one {slab:,} B slab)"
        )
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
        page_bytes,
        budget,
        anchor_group=anchor_group_for(plan.specs, page_bytes),
        slab_anchor_pages=DEFAULT_SLAB_ANCHOR_PAGES if slab_anchor_pages is None else slab_anchor_pages,
    )


def shared_concurrency(plan: Any, context_tokens: int, geometry: ArenaGeometry | None = None) -> int:
    """Requests at ``context_tokens`` a shared arena holds at once: the largest ``N``
    whose pages, ``N * plan.request_pages(context)`` per group plus one full step's
    chunk pages in every sliding group, fill whole slabs (each counted at its
    group's fewest pages per slab) within the arena. Memory only, like
    :meth:`hybridkv.plan.Plan.concurrency`."""
    geometry = geometry if geometry is not None else shared_arena_for(plan)
    need = plan.request_pages(context_tokens)
    sched = plan.limits.max_scheduled_tokens
    step = {s.group_id: (-(-sched // s.page_tokens) + 1 if s.is_sliding else 0) for s in plan.specs}
    per_slab = {}
    for s in plan.specs:
        lo, hi = geometry.slab_page_ranges(s.group_id)
        per_slab[s.group_id] = int((hi - lo).min())

    def slabs(n: int) -> int:
        return sum(-(-(n * need[g] + step[g]) // per_slab[g]) for g in need)

    fits, too_many = 0, geometry.num_slabs * max(per_slab.values()) + 2
    while too_many - fits > 1:
        mid = (fits + too_many) // 2
        if slabs(mid) <= geometry.num_slabs:
            fits = mid
        else:
            too_many = mid
    return fits


Grant = tuple[str, int, "str | None"]  # (receiving group, slab, donor group or None for a spare slab)


@dataclass
class _Scan:
    """Reclaimable slabs per group, computed once per admission decision."""

    reclaimable: dict[str, list[int]] = field(default_factory=dict)


class Arena:
    """Slab ownership for the pools of one manager; pools start with no pages."""

    def __init__(self, geometry: ArenaGeometry, pools: Mapping[str, PagePool]):
        if set(pools) != set(geometry.page_bytes):
            raise ValueError(f"arena groups {sorted(geometry.page_bytes)} differ from pools {sorted(pools)}")
        self.geometry = geometry
        self.pools = dict(pools)
        self.group_ids = list(pools)
        for gid, pool in self.pools.items():
            if pool.num_pages != geometry.view_pages(gid) or pool.usable_pages:
                raise ValueError(f"group {gid!r}: an arena pool starts empty with {geometry.view_pages(gid)} page ids")
        self._ranges = {gid: geometry.slab_page_ranges(gid) for gid in self.group_ids}
        self._index = {gid: i for i, gid in enumerate(self.group_ids)}
        self.owner = np.full(geometry.num_slabs, -1, dtype=np.int16)
        self._spare = list(range(geometry.num_slabs - 1, -1, -1))  # pop() hands out the lowest
        self.slab_moves = 0

    # --- counts ---------------------------------------------------------------
    @property
    def num_spare_slabs(self) -> int:
        return len(self._spare)

    def slabs_owned(self) -> dict[str, int]:
        counts = np.bincount(self.owner[self.owner >= 0], minlength=len(self.group_ids))
        return {gid: int(counts[i]) for i, gid in enumerate(self.group_ids)}

    def pages_in_slab(self, group_id: str, slab: int) -> int:
        lo, hi = self._ranges[group_id]
        return int(hi[slab] - lo[slab])

    # --- planning ---------------------------------------------------------------
    def plan(
        self, deficit: Mapping[str, int], surplus: Mapping[str, int], scan: _Scan | None = None
    ) -> list[Grant] | None:
        """Slabs that cover every group's page ``deficit`` (pages short), spare slabs
        first, then slabs of other groups that are wholly free or evictable, taken
        only while the donor keeps ``surplus`` (pages it can spare) >= 0. ``None``
        if they do not suffice. Pure."""
        scan = scan if scan is not None else _Scan()
        spare = list(self._spare)
        left = {g: int(surplus.get(g, 0)) for g in self.group_ids}
        taken: set[int] = set()
        grants: list[Grant] = []
        for gid in self.group_ids:
            short = int(deficit.get(gid, 0))
            while short > 0 and spare:
                slab = spare.pop()
                grants.append((gid, slab, None))
                short -= self.pages_in_slab(gid, slab)
            for donor in self.group_ids:
                if short <= 0:
                    break
                if donor == gid or deficit.get(donor, 0) > 0 or left[donor] <= 0:
                    continue
                for slab in self._reclaimable(donor, scan):
                    give = self.pages_in_slab(donor, slab)
                    if slab in taken or give > left[donor]:
                        continue
                    taken.add(slab)
                    left[donor] -= give
                    grants.append((gid, slab, donor))
                    short -= self.pages_in_slab(gid, slab)
                    if short <= 0:
                        break
            if short > 0:
                return None
        return grants

    def _reclaimable(self, gid: str, scan: _Scan) -> list[int]:
        """Slabs of ``gid`` whose pages are all free or evictable (lowest first)."""
        found = scan.reclaimable.get(gid)
        if found is None:
            pool, geometry = self.pools[gid], self.geometry
            idle = np.concatenate([pool.free_page_ids().astype(np.int64), pool.evictable_page_ids()])
            per_slab = np.bincount(geometry.slab_of(gid, idle), minlength=geometry.num_slabs) if idle.size else None
            lo, hi = self._ranges[gid]
            owned = self.owner == self._index[gid]
            if per_slab is None:
                found = []
            else:
                found = np.flatnonzero(owned & (per_slab == hi - lo)).tolist()
            scan.reclaimable[gid] = found
        return found

    # --- mutation -------------------------------------------------------------
    def apply(self, grants: Sequence[Grant]) -> None:
        """Move the planned slabs (donor pages revoked, receiver pages granted)."""
        for gid, slab, donor in grants:
            if donor is None:
                self._spare.remove(slab)
            else:
                lo, hi = self._ranges[donor]
                self.pools[donor].revoke(np.arange(lo[slab], hi[slab], dtype=np.int64))
                self.slab_moves += 1
            lo, hi = self._ranges[gid]
            self.owner[slab] = self._index[gid]
            self.pools[gid].grant(np.arange(lo[slab], hi[slab], dtype=np.int32))

    def release_idle(self) -> int:
        """Return every wholly free (not evictable) slab to the spare list; the count."""
        moved = 0
        for gid in self.group_ids:
            pool = self.pools[gid]
            free = pool.free_page_ids().astype(np.int64)
            if not free.size:
                continue
            per_slab = np.bincount(self.geometry.slab_of(gid, free), minlength=self.geometry.num_slabs)
            lo, hi = self._ranges[gid]
            idle = np.flatnonzero((self.owner == self._index[gid]) & (per_slab == hi - lo))
            for slab in idle.tolist():
                pool.revoke(np.arange(lo[slab], hi[slab], dtype=np.int64))
                self.owner[slab] = -1
                self._spare.append(slab)
                moved += 1
        self._spare.sort(reverse=True)
        return moved

    # --- checks ---------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every granted page id lies in a slab its group owns, and every owned slab's
        pages are granted: so live pages of different groups never share a byte."""
        assert sorted(self._spare) == sorted(np.flatnonzero(self.owner < 0).tolist()), "spare list drifted"
        for gid in self.group_ids:
            pool = self.pools[gid]
            lo, hi = self._ranges[gid]
            slabs = np.flatnonzero(self.owner == self._index[gid])
            expected = np.zeros(pool.num_pages, dtype=bool)
            for slab in slabs.tolist():
                expected[lo[slab] : hi[slab]] = True
            granted = pool.ref_counts > 0
            granted[pool.free_page_ids()] = True
            granted[pool.evictable_page_ids()] = True
            assert np.array_equal(granted, expected), f"{gid}: granted pages differ from its slabs"
            assert pool.usable_pages == int(expected.sum()), f"{gid}: granted page count drifted"

    def report(self) -> dict[str, Any]:
        g = self.geometry
        return dict(
            total_bytes=g.total_bytes,
            reserved_bytes=g.reserved_bytes,
            slab_bytes=g.slab_bytes,
            num_slabs=g.num_slabs,
            spare_slabs=self.num_spare_slabs,
            slabs_owned=self.slabs_owned(),
            slab_moves=self.slab_moves,
        )


__all__ = ["Arena", "ArenaGeometry", "DEFAULT_SLAB_ANCHOR_PAGES", "anchor_group_for", "arena_geometry", "shared_arena_for", "shared_concurrency"]
