"""Which cached entries go first when memory is short: one notion of value across groups.

A cached prefix is usable at ``D`` only with every history block below ``D`` and a checkpoint at ``D`` in every state
group. :class:`ValueEviction` keeps the pools' evictions consistent with that rule: *units* leave together, *orphans*
and entries beyond a *gap* are demoted (docs/prefix-caching.md, "Eviction by value").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from hybridkv.memory.pool import EVICTED_LOW, REVOKED, UNPUBLISHED, PagePool

UNIT = "unit"  # the ``cause`` of an entry removed because the rest of its unit went
REASONS = ("prompt", "orphan", "gap", "lru", "unit", "slab")  # why evicted pages went (GroupValueStats)
POLICIES = ("value", "group-lru")


@dataclass(frozen=True)
class GroupValueStats:
    """One group's cached entries by value, and its evicted pages by reason (``REASONS``;
    docs/prefix-caching.md, "Diagnostics"). ``usable_entries``: in a state group,
    checkpoints a hit could use now; in a history group, blocks below such a checkpoint."""

    group_id: str
    cached_pages: int
    cached_entries: int
    usable_entries: int
    evicted_pages: dict[str, int] = field(default_factory=dict)


class ValueEviction:
    """Unit coherence, orphan and gap demotion over one manager's pools (module docstring).

    :class:`hybridkv.prefix.cache.PrefixCache` reports every entry it publishes
    (:meth:`stored_blocks`, :meth:`stored_checkpoint`, :meth:`stored_commit`) and every removal its pools report
    (:meth:`removed`)."""

    def __init__(self, pools: Mapping[str, PagePool], history_ids: Sequence[str], state_ids: Sequence[str],
                 granularity_tokens: int, policy: str = "value"):
        if policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {POLICIES}, got {policy!r}")
        # "group-lru": count and report only; every pool evicts by its own LRU alone.
        self.acts = policy == "value"
        self.pools = pools
        self.history_ids = list(history_ids)
        self.state_ids = list(state_ids)
        self.granularity_tokens = int(granularity_tokens)  # a key at this boundary is a chain's first block
        self._state = frozenset(self.state_ids)
        self._history_pools = [pools[gid] for gid in self.history_ids]
        # Orphans exist only where a hit needs both kinds of group.
        self._track = bool(self.history_ids) and bool(self.state_ids)
        # One record per key for every group: [parent key, support, entries in any group, state groups holding it, child
        # keys (None; one child: a 1-tuple, made a dict by a second, ``_add_child``), cut (a block on its chain is
        # missing), first (a chain's first block), boundary tokens]. Children past one and waiting keys are dicts used
        # as insertion-ordered sets, so every walk goes in publication order, never in hash order.
        self._nodes: dict[Hashable, list] = {}
        self.knows: Callable[[Hashable], bool] = self._nodes.__contains__  # False: no group publishes it
        self._unborn: dict[Hashable, dict] = {}  # parent key -> keys published before it
        # (group, key) of state entries demoted because a block below them went (promoted back when mended).
        self._cut_demoted: set[tuple[str, Hashable]] = set()
        # Told the keys of state entries beyond a gap that regained their value (``CheckpointOrder.mended``).
        self.on_mended: Callable[[list], None] | None = None
        self.evicted_pages = {gid: dict.fromkeys(REASONS, 0) for gid in pools}
        # Per group, its pool's page space and index there (found again where the pool joined another since):
        # :meth:`_demote` lists a walk's entries at once.
        self._places = {gid: (pool.space, pool.space.pools.index(pool)) for gid, pool in pools.items()}

    # --- bookkeeping ---------------------------------------------------------------
    def stored_blocks(self, claims: Sequence[tuple[str, Sequence[int]]], keys: Sequence[Hashable],
                      parents: Sequence[Hashable | None], boundaries: Sequence[int]) -> None:
        """The blocks a commit published, history group by history group in turn: per (group, indices) of ``claims``,
        ``keys[i]`` (the prefix of ``boundaries[i]`` tokens, whose first ``boundaries[i] - granularity`` are
        ``parents[i]``'s) for each index in order; each key's node looked up once."""
        nodes, track, n_history = self._nodes, self._track, len(self.history_ids)
        got: list = [None] * len(keys)  # each key's node once found (one it stores in can not go)
        for gid, done in claims:
            for i in done:
                node = got[i]
                if node is None:
                    node = got[i] = nodes.get(keys[i]) or self._new_node(keys[i], parents[i], boundaries[i])
                node[2] += 1
                if track:
                    self._place_stored(gid, keys[i], node, node[2] - node[3] == n_history)

    def _place_stored(self, gid: str, key: Hashable, node: list, complete: bool) -> None:
        """Group ``gid`` stored block ``key`` (``complete``: every history group holds it now): promote it where it was
        demoted, mend its waiting children or itself when the chain above is whole (its parent's node is not cut, or it
        is a chain's first block), else demote it (beyond a missing block: worth nothing yet)."""
        if node[1] > 0 and self.acts:
            self.pools[gid].promote(key)
        if not node[5]:  # its children cut while its node was missing regain their value
            for child in list(node[4]) if complete and node[4] else ():
                if self._nodes[child][5]:
                    self._mend(child)
        elif complete and (not up[5] if (up := self._nodes.get(node[0])) is not None else node[6]):
            self._mend(key)
        else:
            self._demote((gid,), (key,))

    def stored_commit(self, keys: Sequence[Hashable], parents: Sequence[Hashable | None], boundaries: Sequence[int],
                      checkpoints: Sequence[Hashable]) -> None:
        """:meth:`stored_blocks` of blocks ``keys`` (a chain: ``parents[i + 1]`` is ``keys[i]``) in every history group,
        then :meth:`stored_checkpoint` of each of ``checkpoints`` (among ``keys``, in order, the last one last) in every
        state group: a commit claimed whole, of keys no group publishes (:attr:`knows` False: none has a node). Done at
        once on a whole chain (history and state groups; no key has a child waiting, the chain above is not cut), where
        nothing else changes: each node made with its counts (:meth:`_new_chain`), the chain's parent one support more
        (in place when it is supported already)."""
        nodes, unborn = self._nodes, self._unborn
        up = nodes.get(parents[0])
        if not self._track or (up[5] if up is not None else boundaries[0] > self.granularity_tokens) or (
                keys[0] in unborn if len(keys) == 1 else not unborn.keys().isdisjoint(keys)):
            self.stored_blocks([(gid, range(len(keys))) for gid in self.history_ids], keys, parents, boundaries)
            at = dict(zip(keys, zip(parents, boundaries)))
            for key in checkpoints:
                self.stored_checkpoint(self.state_ids, key, *at[key])
            return
        if len(keys) == 1:  # one block and its checkpoint (a decode commit): supported by it
            n_state = len(self.state_ids)
            nodes[keys[0]] = [parents[0], 1, len(self.history_ids) + n_state, n_state, None, False,
                              boundaries[0] <= self.granularity_tokens, boundaries[0]]
        else:
            self._new_chain(keys, parents, boundaries, checkpoints)
        if up is None:
            unborn.setdefault(parents[0], {})[keys[0]] = None
            return
        _add_child(up, keys[0])
        if up[1]:  # supported already: one more, nothing else changes
            up[1] += 1
        else:
            self._add_support(parents[0])

    def _new_chain(self, keys: Sequence[Hashable], parents: Sequence[Hashable | None], boundaries: Sequence[int],
                   checkpoints: Sequence[Hashable]) -> None:
        """The nodes of new blocks ``keys`` (a chain), each in every history group, those of
        ``checkpoints`` in every state group too: each supported by its own checkpoint and by
        the one beyond it (the last is one), each the one child of the one before."""
        nodes, n_history, n_state, g = self._nodes, len(self.history_ids), len(self.state_ids), self.granularity_tokens
        marks = None if checkpoints is keys else set(checkpoints)  # None: every block's end (a prompt chunk's)
        n_both, child, support = n_history + n_state, None, 1  # the last: its own checkpoint's support only
        for key, parent, boundary in zip(reversed(keys), reversed(parents), reversed(boundaries)):  # last first
            if marks is None or key in marks:
                nodes[key] = [parent, support, n_both, n_state, child, False, boundary <= g, boundary]
                support = 2
            else:
                nodes[key] = [parent, 1, n_history, 0, child, False, boundary <= g, boundary]
            child = (key,)  # the one before's one child (``_add_child``'s 1-tuple)

    def origin(self, key: Hashable) -> tuple[Hashable | None, int]:
        """The parent key and boundary tokens of a key published in some group (as
        it was published with them; (None, 0) if nothing is published under it)."""
        node = self._nodes.get(key)
        return (None, 0) if node is None else (node[0], node[7])

    def stored_checkpoint(self, gids: Sequence[str], key: Hashable, parent: Hashable | None, boundary: int) -> None:
        """One checkpoint (as :meth:`stored_blocks`' keys) published in each state group of ``gids`` in turn (a
        commit's publications of a boundary), its node looked up once."""
        node = self._nodes.get(key) or self._new_node(key, parent, boundary)
        held = node[3]
        node[2] += len(gids)
        node[3] += len(gids)
        if node[5]:
            self._demote(gids, (key,))  # beyond a missing block: worth nothing yet
        elif held < len(self.state_ids) == node[3] and self._track:
            self._add_support(key)

    def _new_node(self, key: Hashable, parent: Hashable | None, boundary: int) -> list:
        """The node of a key first published: a child of its parent's node, or waiting for it (a key published before
        its parent's, or after its parent's node was forgotten: with history groups that is beyond a missing block,
        so it is cut, unless it is a chain's first block); the nodes that waited for this one become its children,
        their support counts here and, beyond a cut, they are cut."""
        up = self._nodes.get(parent)
        first = boundary <= self.granularity_tokens
        children = self._unborn.pop(key, None)
        node = self._nodes[key] = [parent, 0, 0, 0, children, up[5] if up is not None else self._track and not first,
                                   first, boundary]
        if up is None:
            self._unborn.setdefault(parent, {})[key] = None
        else:
            _add_child(up, key)
        for child in children or ():
            if node[5] and not self._nodes[child][5]:
                self._cut(child, demote_first=True)
            elif self._nodes[child][1] > 0:
                self._add_support(key)
        return node

    def removed(self, gid: str, key: Hashable, cause: str, idle_pages: int) -> None:
        """An entry left group ``gid`` (``cause`` as the pool reports it, ``UNIT`` for this class's own removals); the
        rest of its unit follows: as evictions ("unit") after an eviction, unpublished after an unpublished entry (a
        superseded checkpoint, a cleared cache)."""
        node = self._nodes.get(key)
        if cause != UNPUBLISHED:
            self.evicted_pages[gid][self._reason(gid, node, cause)] += idle_pages
        if node is None:
            return
        if gid in self._state:  # as its whole unit leaving at once would
            self.unit_left(key, 1, node)
            others = self.state_ids
        else:
            if self._track and not node[5] and node[2] - node[3] == len(self.history_ids):
                self._cut(key)
            node[2] -= 1
            others = self.history_ids + self.state_ids
        follow = UNPUBLISHED if cause == UNPUBLISHED else UNIT
        for other in others if self.acts else ():
            pool = self.pools[other]
            if other != gid and pool.lookup(key) is not None:
                freed = pool.unpublish(key, follow)
                if follow == UNIT:
                    pool.counters.evicted_pages += freed
        self._forget_if_idle(key)

    def unit_evicted(self, gid: str, key: Hashable, cause: str, idle_pages: int,
                     count: int) -> tuple[Hashable | None, int]:
        """:meth:`removed` of an entry evicted (or revoked: ``cause``) from group ``gid``, ``idle_pages`` freed, the
        rest of its unit gone with it (``count`` entries in all; ``PrefixCache._evict_many``): its pages counted by
        reason; a block cuts what lies beyond it off (as :meth:`removed` does) and its blocks are counted out; then
        :meth:`unit_left` of its checkpoint's entries (none: its node's counts only). Returns its :meth:`origin` as it
        was."""
        node = self._nodes.get(key)
        self.evicted_pages[gid][self._reason(gid, node, cause)] += idle_pages
        if node is None:
            return None, 0
        if gid not in self._state:
            if self._track and not node[5] and node[2] - node[3] == len(self.history_ids):
                self._cut(key)
            node[2] -= count - node[3]
            count = node[3]
        return self.unit_left(key, count, node)

    def stirs(self, key: Hashable) -> bool:
        """Whether the eviction of block ``key`` from a history group (its whole unit) may demote entries: where it is
        not cut off yet (it cuts what lies beyond it off, and its checkpoint's support goes); a block beyond a gap
        leaves demoting nothing."""
        node = self._nodes.get(key)
        return node is not None and not node[5] and self._track

    def branches(self, key: Hashable) -> int:
        """How many published keys continue the prefix ``key`` names (its node's children; 0 without a node)."""
        node = self._nodes.get(key)
        return 0 if node is None or node[4] is None else len(node[4])

    def unit_left(self, key: Hashable, count: int, node: list | None = None) -> tuple[Hashable | None, int]:
        """A checkpoint left ``count`` state groups at once (its unit, evicted or unpublished; :meth:`removed`: one):
        its node's counts, its support where it was complete; evicted pages are not counted.
        ``node``: its node, where the caller has it. Returns its :meth:`origin`."""
        if node is None and (node := self._nodes.get(key)) is None:
            return None, 0
        if node[3] == len(self.state_ids) and self._track and not node[5]:
            if node[1] > 1:  # still supported (by a checkpoint beyond): nothing else changes
                node[1] -= 1
            else:
                self._drop_support(key)
        node[2] -= count
        node[3] -= count
        self._forget_if_idle(key)
        return node[0], node[7]

    def _reason(self, gid: str, node: list | None, cause: str) -> str:
        if cause == REVOKED:
            return "slab"
        if cause == UNIT:
            return "unit"
        if node is not None and node[5]:
            return "gap"
        if gid not in self._state and self._track and (node is None or node[1] == 0):
            return "orphan"
        if cause == EVICTED_LOW:
            return "prompt" if gid in self._state else "orphan"
        return "lru"

    def _add_support(self, key: Hashable) -> None:
        """A complete checkpoint at ``key``: +1 there, and up the chain while a block
        goes from unsupported to supported (promoted back if it was an orphan)."""
        nodes, pools = self._nodes, self._history_pools if self.acts else ()
        while (node := nodes.get(key)) is not None:
            node[1] += 1
            if node[1] > 1:
                return
            for pool in pools:
                pages = pool.lookup(key)
                if pages and pool.low_priority[pages[0]]:  # else promote changes nothing
                    pool.promote(key)
            key = node[0]

    def _drop_support(self, key: Hashable) -> None:
        """A complete checkpoint at ``key`` went: -1 there, and up the chain while a
        block loses its last support (demoted: an orphan goes before usable entries).
        The orphans are demoted head first, so the tail ends at the front of the LRU."""
        orphans = []
        while (node := self._nodes.get(key)) is not None and node[1] > 0:
            node[1] -= 1
            if node[1]:
                break
            orphans.append(key)
            parent = node[0]
            self._forget_if_idle(key)
            key = parent
        self._demote(self.history_ids, orphans[::-1])

    def _cut(self, key: Hashable, demote_first: bool = False) -> None:
        """The block at ``key`` leaves the history groups: every checkpoint at or beyond it loses its value at once
        (its support above goes), and the entries beyond it (with ``demote_first``, from it: a key found beyond a
        cut) are demoted head first, so the deepest end at the front of the LRU."""
        order, todo, whole = [], [key], len(self.state_ids)
        while todo:
            k = todo.pop()
            node = self._nodes.get(k)
            if node is None or (node[5] and k != key):
                continue  # beyond an earlier cut already
            node[5] = True
            if node[3] == whole:
                self._drop_support(k)
            order.append(k)
            if node[4]:
                todo.extend(node[4])
        self._demote(self.history_ids + self.state_ids, order if demote_first else order[1:])

    def _demote(self, gids: Sequence[str], keys: Sequence[Hashable]) -> None:
        """Demote the entries under ``keys`` in the groups ``gids``, key after key (orphans, or entries beyond a missing
        block: a state entry that was not low priority is remembered, to be promoted back by :meth:`_mend`), as
        ``PagePool.demote`` one after another would, in one ``PageSpace.demote`` a page space."""
        if not (self.acts and keys):
            return
        spaces: dict = {}
        for key in keys:
            for gid in gids:
                pool = self.pools[gid]
                pages = pool.lookup(key)
                if pages is None:
                    continue
                if gid in self._state and pages and not pool.low_priority[pages[0]]:
                    self._cut_demoted.add((gid, key))
                space, slot = self._places[gid]
                if space is not pool.space:  # the pool joined another page space since
                    space, slot = self._places[gid] = pool.space, pool.space.pools.index(pool)
                spaces.setdefault(space, []).extend((slot, len(pages), *pages))
        for space, listed in spaces.items():
            space.demote(listed)

    def _mend(self, key: Hashable) -> None:
        """The block at ``key`` is back (its chain above is whole): the entries beyond it whose blocks are all cached
        regain their value; the checkpoints among them support their chains again."""
        order, todo = [], [key]
        while todo:
            node = self._nodes.get(k := todo.pop())
            if node is None or node[2] - node[3] < len(self.history_ids):
                continue  # its own block is missing: it and what lies beyond stay cut
            node[5] = False
            order.append(k)
            if node[4]:
                todo.extend(node[4])
        for k in order:
            if self._nodes[k][3] == len(self.state_ids):
                self._add_support(k)
            for gid in self.state_ids:
                if (gid, k) in self._cut_demoted:
                    self._cut_demoted.discard((gid, k))
                    if self.acts and self.pools[gid].lookup(k) is not None:
                        self.pools[gid].promote(k)
        if self.on_mended is not None and self.acts:
            self.on_mended([k for k in order if self._nodes[k][3]])

    def beyond_gap(self, key: Hashable) -> bool:
        """Whether the policy holds the entries under ``key`` low for a gap (a block below them is missing)."""
        node = self._nodes.get(key)
        return self.acts and node is not None and node[5]

    def _forget_if_idle(self, key: Hashable) -> None:
        """Drop the node of a key nothing is published under, that supports nothing and
        has no child (then its parent's, in turn)."""
        while (node := self._nodes.get(key)) is not None and node[1] == 0 and node[2] == 0 and not node[4]:
            del self._nodes[key]
            for gid in self.state_ids:
                self._cut_demoted.discard((gid, key))
            up = self._nodes.get(node[0])
            if up is None:  # its parent's key was never published, or not since
                waiting = self._unborn[node[0]]
                waiting.pop(key, None)
                if not waiting:
                    del self._unborn[node[0]]
                return
            if up[4].__class__ is tuple:  # its one child (``_add_child``)
                up[4] = None
            else:
                up[4].pop(key, None)
            key = node[0]

    # --- diagnostics ------------------------------------------------------------
    def report(self) -> dict[str, GroupValueStats]:
        """Per group: cached pages and entries, usable entries, evicted pages by reason."""
        chain_ok: dict[Hashable, bool] = {}

        def held(key: Hashable) -> bool:
            """Whether every block from ``key`` up its chain is in every history group."""
            path = []
            while key not in chain_ok and (node := self._nodes.get(key)) is not None:
                path.append(key)
                key = node[0]
            # A key without a node: the salt root above a first block, else a missing block.
            ok = chain_ok[key] if key in chain_ok else not path or self._nodes[path[-1]][6]
            for k in reversed(path):
                ok = ok and all(self.pools[g].lookup(k) is not None for g in self.history_ids)
                chain_ok[k] = ok
            return ok

        # Usable: keys with a checkpoint in every state group and every block below it in every history group.
        keys = self.pools[self.state_ids[0]].entry_keys() if self.state_ids else []
        usable = {k for k in keys if all(self.pools[g].lookup(k) is not None for g in self.state_ids) and held(k)}
        below: set = set()
        for key in usable:
            while key in self._nodes and key not in below:
                below.add(key)
                key = self._nodes[key][0]
        out = {}
        for gid, pool in self.pools.items():
            keys = pool.entry_keys()
            count = sum(1 for k in keys if k in (usable if gid in self._state else below))
            out[gid] = GroupValueStats(gid, pool.num_cached_pages, len(keys), count, dict(self.evicted_pages[gid]))
        return out


def _add_child(node: list, key: Hashable) -> None:
    """``key`` joins the children of ``node``: the first as a 1-tuple (no dict made), a dict from the second on."""
    children = node[4]
    if children is None:
        node[4] = (key,)
    elif children.__class__ is dict:
        children[key] = None
    else:
        node[4] = dict.fromkeys((*children, key))


__all__ = ["GroupValueStats", "POLICIES", "REASONS", "UNIT", "ValueEviction"]
