"""One byte arena shared by every cache group, lent out in slabs (docs/architecture.md, "Page
space: one shared arena or per-group pools"): each group's kernel tensor is a view of the same
bytes from offset 0; a slab belongs to at most one group at a time. Its geometry (head, slabs,
pages per slab) is :mod:`hybridkv.memory.geometry`'s, re-exported here."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridkv._checks import as_int
from hybridkv.memory.geometry import (DEFAULT_SLAB_ANCHOR_PAGES, ArenaGeometry, anchor_group_for, arena_geometry,
                                      shared_arena_for, shared_concurrency)
from hybridkv.memory.pool import PagePool
from hybridkv.runtime import kernels

# While at least this share of the slabs is spare, the arena is roomy (Arena.roomy).
ROOMY_SPARE_FRACTION = 0.1
SLABS_AHEAD = 4  # spare slabs a group given slabs takes beyond its need while the arena stays roomy (``slabs_ahead``)
AHEAD_MIN_SLABS = 512  # the fewest slabs of an arena that takes slabs ahead by default (6.7 GiB of V4-Flash's)
# While roomy, a group's live pages may lie in this many slabs more than they fill.
SPREAD_SLABS = 2


_NO_PAGES = np.empty(0, dtype=np.int64)
Grant = tuple[str, int, "str | None"]  # (receiving group, slab, donor group or None for a spare slab)


@dataclass
class IdleScan:
    """Which pages count as idle at one admission decision (a slab whose pages all are may be lent),
    and per group what :meth:`Arena.plan` found (``Arena._idle``)."""

    idle: dict[str, tuple[np.ndarray, np.ndarray, int]] = field(default_factory=dict)
    releasing: Callable[[int], np.ndarray] | None = None  # group index -> pages the step frees before slabs move
    clean: bool = False  # keyed pages count only as ``before_tick`` says (evicting nothing else), releasing as spare
    # With ``clean``: idle keyed pages of low priority or idle since before this tick count as idle and
    # spare. None: no keyed page counts.
    before_tick: int | None = None
    group_ticks: dict[str, int] | None = None  # per donor group, its own ``before_tick`` where that differs

    def keyed_mode(self) -> int:
        """``kernels.idle_slabs``' ``keyed_mode``: 1 every idle keyed page counts, 2 ``before_tick``'s, 0 none."""
        return 1 if not self.clean else 0 if self.before_tick is None else 2


class Arena:
    """Slab ownership for the pools of one manager (one ``PageSpace``'s, in its order: the geometry's groups, each with
    its view's page ids and none granted, as ``CacheManager`` checks and builds them; docs/architecture.md, "Page
    space": a group uses the pages inside its slabs and those straddling two adjacent ones)."""

    def __init__(self, geometry: ArenaGeometry, pools: Mapping[str, PagePool]):
        self.geometry = geometry
        self.pools = dict(pools)
        self.group_ids = list(pools)
        self._space = self.pools[self.group_ids[0]].space  # the page space holding the pools, in this order
        # Per group (by index) and slab: inner page ids lo .. hi-1, left straddler (-1: none).
        ids = [(*geometry.slab_page_ranges(gid), geometry.boundary_pages(gid)) for gid in self.group_ids]
        self._slab_ids = lo, hi, straddle = tuple(np.stack(planes) for planes in zip(*ids))
        inner = self._inner = hi - lo  # inner pages per slab
        self._straddle = straddle  # left straddlers per slab
        n = geometry.num_slabs
        self._taken = np.empty(n, dtype=np.int64)  # plan's scratch: spare slabs taken
        self._spare_grants = np.empty((2, n), dtype=np.int64)  # groups; slabs
        self._slab_pages = np.asarray([geometry.slab_bytes // geometry.page_bytes[gid] - 1 for gid in self.group_ids],
                                      dtype=np.int64)
        self._most_slab_pages = int(inner.max()) + 2  # a slab's inner pages and its two straddlers
        # Per group: fewest inner pages of a slab, most pages a slab gains (inner and two straddlers).
        self._fewest_inner, self._most_gain = inner.min(axis=1), inner.max(axis=1) + 2
        self._owned = np.empty(len(self.group_ids), dtype=np.int64)  # ``surely_short``'s scratch
        self._least = np.maximum(self._fewest_inner, 1).tolist()  # the fewest pages a donor gives up with a slab
        self._slab_scratch = np.empty(2 * self._most_slab_pages, dtype=np.int64)  # ``apply``'s slab moves'
        self._index = {gid: i for i, gid in enumerate(self.group_ids)}
        self.owner = np.full(n, -1, dtype=np.int16)
        # Spare slabs, the fewest that slabs taken ahead leave spare (``roomy``'s count) and ``slabs_ahead``, in an
        # array ``admit_spare`` reads.
        self._spare = np.zeros(3, dtype=np.int64)
        # The arena's arguments of ``kernels.admit_spare``, ``must_pack_at`` and ``grant_step``.
        self.spare_args = (self.owner, self._spare, self._slab_pages, inner, straddle, self._taken, *self._spare_grants)
        # Per group: page bytes, reserved bytes, slab bytes (``kernels.released_per_slab``), fewest inner pages, spread.
        self._sizes = np.asarray([[geometry.page_bytes[gid], geometry.reserved_bytes, geometry.slab_bytes,
                                   max(int(k.min()), 1), SPREAD_SLABS] for gid, k in zip(self.group_ids, inner)],
                                 dtype=np.int64)
        self.packing = (self.owner, *self._slab_ids, self._sizes)
        self._roomy_slabs = math.ceil(ROOMY_SPARE_FRACTION * n)  # the fewest spare slabs of ``roomy``
        self._spare[1:] = self._roomy_slabs, SLABS_AHEAD if n >= AHEAD_MIN_SLABS else 0
        # ``kernels.grant_step``'s ``arena`` but its last item, the marks it leaves (the manager's ``_Scratch.marks``).
        self.grant_args = (self.owner, *self._slab_ids, self._space.offsets, self._most_slab_pages,
                           self._sizes, self._spare, self._roomy_slabs)
        self.slab_moves = 0
        self._spare_changed(n)
        for gid, pool in self.pools.items():
            pool.must_pack = self._packing_rule(gid)
        # ``kernels.admit_spare``'s grants as it writes them (``[2, n]`` in front: groups, slabs), as
        # :meth:`kernel_grants` gives them; None when a pool's free stack is not sorted (:meth:`apply` grants:
        # only on sorted free stacks do pages granted in one run per pool stack as they do slab by slab).
        self.spare_written = self._spare_grants if all(pool.lowest_first for pool in self.pools.values()) else None
        self._load_kernels()

    def _load_kernels(self) -> None:
        """Load (or compile) now, changing nothing, the kernels of slab moves and the packing rule."""
        gid, donors = self.group_ids[0], self.group_ids[1:]
        self.pools[gid].oldest_idle_tick()
        self.pools[gid].normal_tick_at(1)
        kernels.slab_move_pages(self.owner, -1, 0, *self._slab_ids, 0, self._slab_scratch)
        kernels.take_spare_slabs(self.owner.copy(), 0, self._inner[0], self._straddle[0], 0, self._taken)
        self.plan_spare(np.zeros(len(self.group_ids), dtype=np.int64))
        kernels.with_ahead(self.owner, self._inner, self._straddle, self._taken, *self._spare_grants, 0, 0, 0)
        self.surely_short(np.zeros(len(self.group_ids), dtype=np.int64), np.zeros(len(self.group_ids), dtype=np.int64))
        self._count(gid, 0, self.owner)
        kernels.must_pack_at(self.pools[gid].ref_counts, 0, self.packing, 0, int(self._slab_ids[0][0, 0]), 0,
                             self._space.per_group, None)
        many = self.geometry.num_slabs * self._most_slab_pages  # more than any donor can give
        self._take_from_donors(gid, 1, self.owner.copy(), [], {gid: 1}, (dict.fromkeys(donors, many), {}), IdleScan())

    def _packing_rule(self, gid: str) -> Callable[[int, int], bool]:
        """A group's ``PagePool.must_pack``: always unless the arena is roomy, then ``kernels.must_pack_at``."""
        pool, gi, packing, per_group = self.pools[gid], self._index[gid], self.packing, self._space.per_group
        return lambda page, pages: not self.roomy() or kernels.must_pack_at(pool.ref_counts, 0, packing, gi, page,
                                                                            pages, per_group, None)

    # --- counts ---------------------------------------------------------------
    @property
    def num_spare_slabs(self) -> int:
        return int(self._spare[0])

    def roomy(self) -> bool:
        """At least ``ROOMY_SPARE_FRACTION`` of the slabs are spare (docs/manager.md)."""
        return bool(self._spare[0] >= self._roomy_slabs)

    def _spare_changed(self, by: int) -> None:
        """``by`` slabs more are spare; ``PageSpace.skip_packing`` follows :meth:`roomy`."""
        self._spare[0] += by
        self._space.skip_packing.fill(self.roomy())

    def slabs_owned(self) -> dict[str, int]:
        counts = np.bincount(self.owner[self.owner >= 0], minlength=len(self.group_ids))
        return {gid: int(counts[i]) for i, gid in enumerate(self.group_ids)}

    def _count(self, gid: str, slab: int, own: np.ndarray) -> int:
        """Pages ``gid`` gains by taking (or loses by giving) ``slab`` under ``own``."""
        gi = self._index[gid]
        return int(kernels.slab_gain(own, gi, self._inner[gi], self._straddle[gi], slab))

    # --- planning ---------------------------------------------------------------
    def plan(self, deficit: Mapping[str, int], surplus: Mapping[str, int], scan: IdleScan | None = None, *,
             partial: bool = False, owner: np.ndarray | None = None) -> list[Grant] | None:
        """Slabs that cover every group's page ``deficit``: spare slabs first, then donors' idle slabs while each
        keeps its ``surplus`` (docs/manager.md, stage 1); None if short (with ``partial``, as many as there are).
        Pure, exact for :meth:`apply` in order; ``owner``: the owners to start from (:meth:`replay`)."""
        scan = scan if scan is not None else IdleScan()
        own = (self.owner if owner is None else owner).copy()
        left: dict[str, int] = {}
        grants: list[Grant] = []
        for gid in self.group_ids:
            short = int(deficit.get(gid, 0))
            if short <= 0:
                continue
            gi = self._index[gid]
            n_taken, short = kernels.take_spare_slabs(own, gi, self._inner[gi], self._straddle[gi], short, self._taken)
            grants.extend((gid, slab, None) for slab in self._taken[:n_taken].tolist())
            if short > 0:
                short = self._take_from_donors(gid, short, own, grants, deficit, (surplus, left), scan)
            if short > 0 and not partial:
                return None
        return grants

    def surely_short(self, deficit: np.ndarray, surplus: np.ndarray) -> bool:
        """Whether :meth:`plan` of ``deficit`` pages per group (int64, in ``group_ids`` order), donors keeping
        ``surplus``, with a scan that is not ``clean`` and not ``partial``, surely answers None: some group's
        deficit passes every spare slab and the slabs each donor's surplus can give up (``kernels.surely_short``)."""
        return kernels.surely_short(self.owner, deficit, surplus, self._fewest_inner, self._most_gain, self._owned)

    def plan_spare(self, short: np.ndarray, owner: np.ndarray | None = None) -> list[Grant] | None:
        """:meth:`plan` of ``short`` pages per group when spare slabs alone surely cover
        (``kernels.take_spare_for``); None when they might not. Pure; ``owner`` as for :meth:`plan`."""
        own = self.owner if owner is None else owner
        spare = self.num_spare_slabs if owner is None else int(np.count_nonzero(owner < 0))
        n = kernels.take_spare_for(short, self._slab_pages, spare, own, *self.spare_args[3:])  # inner .. slabs
        return None if n < 0 else self.spare_grants(n)  # written to ``_spare_grants``

    @property
    def slabs_ahead(self) -> int:
        """How many spare slabs a group given slabs in a step takes beyond its need, while the spare slabs left stay
        at least the ``roomy`` count (0: only what it needs; default ``SLABS_AHEAD`` on an arena of at least
        ``AHEAD_MIN_SLABS`` slabs, else 0: in a small arena slabs taken early sit in the groups that took them when
        memory turns short, measured to cost hits at 2 GiB). A group growing steadily (a history group as decode
        contexts grow) then takes a slab once in several steps, not once in a few; the slabs it holds ahead are free
        pages any admission can lend back (docs/manager.md, stage 1). Settable."""
        return int(self._spare[2])

    @slabs_ahead.setter
    def slabs_ahead(self, slabs: int) -> None:
        self._spare[2] = as_int("slabs_ahead", slabs, minimum=0)

    def ahead(self, grants: Sequence[Grant]) -> list[Grant]:
        """The spare slabs added to ``grants`` (``kernels.with_ahead``, as ``kernels.admit_spare`` adds them): up to
        ``slabs_ahead`` more for each group given a slab while the spare slabs left stay ``roomy``."""
        room = int(self._spare[0] - self._spare[1]) - sum(donor is None for _, _, donor in grants)
        if not grants or room <= 0 or not self._spare[2]:
            return []
        own, index, n = self.owner.copy(), self._index, len(grants)  # ``with_ahead`` gives the granted slabs first
        groups, slabs = np.empty((2, own.size), dtype=np.int64)
        groups[:n], slabs[:n] = [index[gid] for gid, _, _ in grants], [slab for _, slab, _ in grants]
        total = kernels.with_ahead(own, self._inner, self._straddle, self._taken, groups, slabs, n, int(self._spare[2]),
                                   room)
        ids = self.group_ids
        return [(ids[g], slab, None) for g, slab in zip(groups[n:total].tolist(), slabs[n:total].tolist())]

    def spare_grants(self, n: int) -> list[Grant]:
        """The ``n`` grants ``kernels.admit_spare`` just wrote to its scratch (``spare_args``)."""
        ids, (groups, slabs) = self.group_ids, self._spare_grants[:, :n].tolist()
        return [(ids[g], slab, None) for g, slab in zip(groups, slabs)]

    def kernel_grants(self, grants: Sequence[Grant]) -> np.ndarray | None:
        """``grants`` as ``kernels.grant_step`` grants them (``[2, n]``: groups, slabs)
        when they are spare slabs alone and every pool's free stack is sorted; else None (:meth:`apply`)."""
        if self.spare_written is None or any(donor is not None for _, _, donor in grants):
            return None
        index = self._index
        return np.array([[index[gid] for gid, _, _ in grants], [slab for _, slab, _ in grants]], dtype=np.int64)

    def _take_from_donors(self, gid: str, short: int, own: np.ndarray, grants: list[Grant],
                          deficit: Mapping[str, int], spare: tuple, scan: IdleScan) -> int:
        """:meth:`plan`'s second source: idle slabs of donors not short themselves while each keeps what it can
        spare (``spare``: surplus, and what is left per donor); the pages ``gid`` is still short."""
        gi = self._index[gid]
        for donor in self.group_ids:
            if short <= 0:
                break
            di = self._index[donor]  # (a donor spares no slab with less than its fewest inner pages to spare)
            if donor == gid or deficit.get(donor, 0) > 0 or self._left(donor, spare, scan, deficit) < self._least[di]:
                continue
            left = spare[1]
            inner_idle, edge_idle = self._idle(donor, scan)[:2]
            n_taken, short, left[donor] = kernels.take_donor_slabs(
                own, di, gi, *(ids[di] for ids in self._slab_ids), self._inner[gi], self._straddle[gi], left[donor],
                short, self._taken, inner_idle, edge_idle)
            grants.extend((gid, slab, donor) for slab in self._taken[:n_taken].tolist())
        return short

    def _left(self, donor: str, spare: tuple, scan: IdleScan, deficit: Mapping[str, int]) -> int:
        """What ``donor`` can still spare: at first its surplus, released pages and keyed pages of less value."""
        surplus, left = spare
        if donor not in left:
            freed = scan.releasing(self._index[donor]).size if scan.clean else 0
            left[donor] = int(surplus.get(donor, 0)) + freed
            # Keyed pages of less value count only when the rest might not cover every slab taken from it (more pages
            # than it can give up in a plan for ``deficit``).
            if scan.keyed_mode() == 2:
                per_slab, index = self._slab_pages.tolist(), self._index
                slabs = sum(-(-short // per_slab[index[gid]]) if per_slab[index[gid]] > 0 else self.geometry.num_slabs
                            for gid, short in deficit.items() if short > 0)
                if left[donor] < slabs * self._most_slab_pages:
                    left[donor] += self._idle(donor, scan)[2]
        return left[donor]

    def replay(self, grants: Sequence[Grant]) -> tuple[np.ndarray, dict[str, int]]:
        """Slab owners after ``grants`` (pure), and the pages each group gains (a donor's
        are negative: the pages it gives up)."""
        own, gained = self.owner.copy(), {}
        for gid, slab, donor in grants:
            if donor is not None:
                gained[donor] = gained.get(donor, 0) - self._count(donor, slab, own)
                own[slab] = -1
            gained[gid] = gained.get(gid, 0) + self._count(gid, slab, own)
            own[slab] = self._index[gid]
        return own, gained

    def _idle(self, gid: str, scan: IdleScan) -> tuple[np.ndarray, np.ndarray, int]:
        """``kernels.idle_slabs`` of ``gid`` (inner idle, edge idle, keyed pages counted), once per scan."""
        found = scan.idle.get(gid)
        if found is None:
            pool, gi, n = self.pools[gid], self._index[gid], self.geometry.num_slabs
            inner_idle, edge_idle = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
            released = _NO_PAGES if scan.releasing is None else scan.releasing(gi)
            tick = (scan.group_ticks or {}).get(gid, scan.before_tick)
            counted = kernels.idle_slabs(self.owner, gi, *(ids[gi] for ids in self._slab_ids), pool.ref_counts,
                                         pool.cached, pool.low_priority, pool.idle_tick, scan.keyed_mode(),
                                         tick or 0, released, self._sizes[gi], inner_idle, edge_idle)
            found = scan.idle[gid] = (inner_idle, edge_idle, int(counted))
        return found

    # --- mutation -------------------------------------------------------------
    def apply(self, grants: Sequence[Grant]) -> None:
        """Move the planned slabs, in order (donor pages revoked, receiver pages granted); nothing
        moves when a slab granted as spare is not (or is listed twice)."""
        spare = [slab for _, slab, donor in grants if donor is None]
        if len(set(spare)) < len(spare) or (self.owner[spare] >= 0).any():
            raise AssertionError("a slab granted is not spare")
        index, out = self._index, self._slab_scratch
        for gid, slab, donor in grants:
            gi, di = index[gid], -1 if donor is None else index[donor]
            given, n = kernels.slab_move_pages(self.owner, di, gi, *self._slab_ids, slab, out)  # neighbours stay
            if di >= 0:
                self.pools[donor].revoke(out[:given])
                self.slab_moves += 1
            else:
                self._spare_changed(-1)
            self.owner[slab] = gi
            self.pools[gid].grant(out[given:n])

    # --- checks ---------------------------------------------------------------
    def check_invariants(self) -> None:
        """The granted page ids are exactly those in slabs their group owns: groups never share a byte."""
        assert self.num_spare_slabs == int(np.count_nonzero(self.owner < 0)), "spare count drifted"
        assert (self._space.skip_packing == self.roomy()).all(), "skip_packing differs from roomy"
        for gid in self.group_ids:
            pool, gi = self.pools[gid], self._index[gid]
            (lo, hi, st), mine = (ids[gi] for ids in self._slab_ids), self.owner == gi
            expected = np.zeros(pool.num_pages, dtype=bool)
            for slab in np.flatnonzero(mine).tolist():
                expected[lo[slab] : hi[slab]] = True
            both = np.flatnonzero(mine[1:] & mine[:-1]) + 1
            expected[st[both][st[both] >= 0]] = True
            granted = pool.ref_counts > 0
            granted[pool.free_page_ids()] = True
            granted[pool.evictable_page_ids()] = True
            assert np.array_equal(granted, expected), f"{gid}: granted pages differ from its slabs"
            assert pool.usable_pages == int(expected.sum()), f"{gid}: granted page count drifted"

    def report(self) -> dict[str, Any]:
        g = self.geometry
        return dict(total_bytes=g.total_bytes, reserved_bytes=g.reserved_bytes, slab_bytes=g.slab_bytes,
                    num_slabs=g.num_slabs, spare_slabs=self.num_spare_slabs, slabs_owned=self.slabs_owned(),
                    slab_moves=self.slab_moves)


__all__ = ["Arena", "ArenaGeometry", "IdleScan", "DEFAULT_SLAB_ANCHOR_PAGES", "anchor_group_for", "arena_geometry",
           "shared_arena_for", "shared_concurrency"]
