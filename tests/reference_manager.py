"""An independent, slow, plain-Python model of the cache manager's documented rules.

Written from docs/manager.md ("The rules"), docs/prefix-caching.md and
docs/architecture.md only, never from src/hybridkv's runtime modules. One dict
per request, one small pool object per group, no numpy in the state. Page ids
follow the documented reuse order of a per-group pool: a fresh pool hands out
1, 2, 3...; freed pages are reused first, LIFO, the first page of a release on
top. Prefix keys are the token tuples themselves (equal keys <=> equal
content), not hashes. ``tests/test_reference_equivalence.py`` runs random
programs on this and on ``CacheManager`` and compares what they hand out.

Where the docs leave an order open this follows the manager (and says so):
a step's releases are one release per group (paused requests, then the batch,
each request's pages in logical order), a ``rewind_many`` one release in item
order; a step allocates once per group, in batch order, evicting before it
pops the stack; paused requests commit before the batch's; an eviction takes
idle low-priority entries while it has freed fewer than its need plus 16
pages; a rewind drops the known ids past ``max(n, prompt)``. A load step
(``load=True``, docs/manager.md "Load steps") holds a sliding group's pages of
``[c + n - C, c + n)`` only. Not modelled: the shared arena's slabs, the
checkpoint interval, salts, events.
"""

from __future__ import annotations

import itertools


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RefError(Exception):
    """What the manager raises as CacheManagerError."""


class Pool:
    """One group: spec numbers, page ids and (prefix caching) keyed entries and the LRU."""

    def __init__(self, spec, pages: int, checkpoint_tokens: int | None):
        self.gid, self.rows, self.m = spec.group_id, spec.rows_per_page, spec.entry_stride_tokens
        self.T, self.W = self.rows * self.m, spec.sliding_window_tokens
        self.history, self.C = not spec.is_sliding, checkpoint_tokens
        self.total, self.fresh, self.stack = pages - 1, 1, []
        self.ref, self.key_of, self.entries, self.lru = {}, {}, {}, []
        self.cleaned = []  # pages that went back to clean free (drained by the test's id matcher)

    def clean(self) -> int:
        return len(self.stack) + self.total + 1 - self.fresh

    def free(self) -> int:
        return self.clean() + len(self.lru)

    def release(self, pages) -> None:
        """Drop one reference each; idle pages go on the stack (first listed on top) or the LRU."""
        for p in reversed(pages):
            self.ref[p] -= 1
            if self.ref[p]:
                continue
            del self.ref[p]
            if p not in self.key_of:
                self.stack.append(p)
                self.cleaned.append(p)
            elif self.entries[self.key_of[p]]["low"]:
                self.lru.insert(0, p)
            else:
                self.lru.append(p)

    def take(self, n: int) -> list[int]:
        """All or nothing (the caller checked): clean pages first, then evict LRU entries."""
        short, evicted = n - self.clean(), 0
        while short > 0 and self.lru:  # low-priority entries (at the front) up to 16 pages beyond the need
            if evicted >= short + (16 if self.is_low(self.lru[0]) else 0):
                break
            evicted += self.unpublish(self.key_of[self.lru[0]])
        k = min(n, len(self.stack))
        out = [self.stack.pop() for _ in range(k)] + list(range(self.fresh, self.fresh + n - k))
        self.fresh += n - k  # freed pages first (LIFO), then fresh ones in id order
        self.ref.update((p, 1) for p in out)
        return out

    def is_low(self, page) -> bool:
        return self.entries[self.key_of[page]]["low"]

    def publish(self, key, pages, low=False) -> None:
        if key not in self.entries:
            self.entries[key] = {"pages": list(pages), "low": low, "owners": set()}
            for p in pages:
                self.key_of[p] = key

    def unpublish(self, key) -> int:
        """Remove an entry; its idle pages become clean free. Returns how many."""
        freed = [p for p in self.entries.pop(key)["pages"] if p not in self.ref]
        for p in freed:
            self.lru.remove(p)
        self.stack += reversed(freed)
        self.cleaned += freed
        for p in [p for p, k in self.key_of.items() if k == key]:
            del self.key_of[p]
        return len(freed)

    def demote(self, key) -> None:
        self.entries[key]["low"] = True
        idle = [p for p in self.entries[key]["pages"] if p in self.lru]
        for p in idle:
            self.lru.remove(p)
        self.lru[:0] = idle


class ReferenceManager:
    def __init__(self, specs, pages, *, table_widths=None, caching=False, grain=None, prompt_checkpoints=True):
        self.pools = {s.group_id: Pool(s, pages[s.group_id], s.sliding_window_tokens) for s in specs}
        self.widths, self.caching, self.G = table_widths, caching, grain
        self.prompt_cps = prompt_checkpoints
        self.reqs, self.last = {}, []
        # Owners of a checkpoint are request serials, never reused (a freed request's stay: its terminal
        # checkpoint keeps a hold, as the manager's do; ``id()`` of a new request may equal a freed one's).
        self.serials = itertools.count()

    # --- requests -------------------------------------------------------------------
    def add_request(self, rid, ids=None, prompt_tokens=None, max_new=0) -> dict:
        """Register a request; with prefix caching borrow its hit. Returns the hit's numbers."""
        prompt = len(ids) if ids is not None else prompt_tokens
        r = {"prompt": prompt, "limit": prompt + max_new, "ids": list(ids) if ids is not None else None,
             "c": 0, "committed": 0, "base": {}, "pages": {}, "own": {}, "junction": 0, "serial": next(self.serials)}
        for g in self.pools:
            r["base"][g], r["pages"][g] = 0, {}
        self.reqs[rid] = r
        return self.borrow(r) if self.caching else {"hit": 0}

    def append(self, rid, ids) -> None:
        self.reqs[rid]["ids"].extend(ids)

    def hi(self, r, g) -> int:
        return r["base"][g] + len(r["pages"][g])

    # --- prefix caching ---------------------------------------------------------------
    def key(self, r, d):
        return tuple(r["ids"][:d])

    def group_reach(self, r, pool) -> int:
        top = (r["prompt"] - 1) // self.G * self.G
        if pool.history:
            d = 0
            while d + self.G <= top and self.key(r, d + self.G) in pool.entries:
                d += self.G
            return d
        return max([d for d in range(self.G, top + 1, self.G) if self.key(r, d) in pool.entries], default=0)

    def borrow(self, r) -> None:
        reach = {g: self.group_reach(r, p) for g, p in self.pools.items()}
        history = min([reach[g] for g, p in self.pools.items() if p.history], default=0)
        d = history
        while d and not all(self.key(r, d) in p.entries for p in self.pools.values() if not p.history):
            d -= self.G
        r["junction"] = history if history > d else 0
        r["c"] = r["committed"] = d
        self.lend(r, d)
        return {"hit": d, "groups": reach, "history": history}

    def lend(self, r, d) -> None:
        """Borrow the hit's pages: history blocks below d, each state group's checkpoint at d."""
        if not d:
            return
        for g, p in self.pools.items():
            if p.history:
                pages = [q for b in range(d // self.G) for q in p.entries[self.key(r, (b + 1) * self.G)]["pages"]]
            else:
                pages = p.entries[self.key(r, d)]["pages"]
                p.entries[self.key(r, d)]["owners"].add(r["serial"])
                r["own"].setdefault(d, False)
            r["base"][g] = d // p.T - len(pages)
            r["pages"][g] = {r["base"][g] + i: q for i, q in enumerate(pages)}
            for q in pages:
                if q in p.ref:
                    p.ref[q] += 1
                else:
                    p.lru.remove(q)
                    p.ref[q] = 1

    def commit(self, r) -> None:
        old, new = r["committed"], r["c"]
        r["committed"] = new
        if not self.caching or new <= old:
            return
        crossed = list(range((old // self.G + 1) * self.G, new + 1, self.G))
        for g, p in self.pools.items():
            for d in crossed:
                lo = (d - (self.G if p.history else p.C)) // p.T
                # Not held: a boundary a load step crossed (published only by someone else).
                held = all(L in r["pages"][g] for L in range(lo, d // p.T))
                pages = [r["pages"][g][L] for L in range(lo, d // p.T)] if held else None
                if p.history:
                    p.publish(self.key(r, d), pages)
                elif d == crossed[-1] or d == r["junction"]:
                    if held:
                        p.publish(self.key(r, d), pages)
                    if self.key(r, d) in p.entries:  # its own, whoever published it
                        p.entries[self.key(r, d)]["owners"].add(r["serial"])
                elif held and self.prompt_cps and d <= r["prompt"]:
                    p.publish(self.key(r, d), pages, low=True)
        if crossed:
            for d in crossed:
                if d == crossed[-1] or d == r["junction"]:
                    r["own"][d] = d == r["junction"]
            for d, pinned in sorted(r["own"].items()):
                if d < crossed[-1] and not pinned:
                    del r["own"][d]
                    self.let_go(r, d)

    def let_go(self, r, d) -> None:
        for p in self.pools.values():
            e = p.entries.get(self.key(r, d))
            if p.history or e is None or r["serial"] not in e["owners"]:
                continue  # not (or no longer: evicted, maybe published again since) its own
            e["owners"].discard(r["serial"])
            if not e["owners"]:
                if self.prompt_cps and d <= r["prompt"]:
                    p.demote(self.key(r, d))
                else:
                    p.unpublish(self.key(r, d))

    # --- a step -------------------------------------------------------------------------
    def floor(self, r, p, n, load) -> int:
        """A sliding group's release point: from the first position written, or for a load
        step the first page of the checkpoint window at the load's end (may pass hi)."""
        if load:
            return max(0, r["c"] + n - p.C) // p.T
        return min(max(0, r["c"] - p.W + 1) // p.T, self.hi(r, p.gid))

    def plan(self, rid, n, g, load=False):
        """(new base, pages held after, pages allocated, pages whose last holder releases them)."""
        r, p = self.reqs[rid], self.pools[g]
        base, hi = r["base"][g], self.hi(r, g)
        new_base = max(base, self.floor(r, p, n, load)) if p.W else base
        need = max(cdiv(r["c"] + n, p.T), hi) if n else hi
        gone = sum(1 for L in range(base, min(new_base, hi)) if p.ref[r["pages"][g][L]] == 1)
        return new_base, need, need - max(hi, new_base), gone

    def settling(self, items):
        names = {rid for rid, _ in items}
        return [rid for rid in self.last if rid in self.reqs and rid not in names
                and self.reqs[rid]["c"] > self.reqs[rid]["committed"]]

    def check_admission(self, items, fixed_width=False, load=False) -> list[bool]:
        net = {g: -sum(self.plan(rid, 0, g)[3] for rid in self.settling(items)) for g in self.pools}
        plans = [{g: self.plan(rid, n, g, load) for g in self.pools} for rid, n in items]
        ok = [not fixed_width or all(pl[g][1] - pl[g][0] <= self.widths[g] for g in pl) for pl in plans]
        total = {g: net[g] + sum(pl[g][2] - pl[g][3] for pl, k in zip(plans, ok) if k) for g in self.pools}
        if all(total[g] <= p.free() for g, p in self.pools.items()):
            return ok
        for i, pl in enumerate(plans):
            if ok[i]:
                ok[i] = all(net[g] + pl[g][2] - pl[g][3] <= p.free() for g, p in self.pools.items())
                if ok[i]:
                    net = {g: net[g] + pl[g][2] - pl[g][3] for g in net}
        return ok

    def max_admissible_tokens(self, rid, max_tokens, batch=()) -> int:
        if not all(self.check_admission(list(batch))):
            raise RefError("batch not admissible")
        r = self.reqs[rid]
        cap = min(max_tokens, r["limit"] - r["c"], len(r["ids"]) - r["c"] if r["ids"] is not None else max_tokens)
        return next((k for k in range(cap, 0, -1) if all(self.check_admission(list(batch) + [(rid, k)]))), 0)

    def schedule(self, items, fixed_width=False, load=False) -> dict:
        if not all(self.check_admission(items, fixed_width, load)):
            raise RefError("denied")
        settle = self.settling(items)
        for rid in settle + [rid for rid, _ in items]:  # paused requests commit first (then the first
            self.commit(self.reqs[rid])  # publisher of a key is the first of them), then the batch's
        gone = {g: [] for g in self.pools}  # one release per group: the first page listed ends on top
        for rid in settle:
            self.release_below(self.reqs[rid], gone, 0, False)
        for rid, n in items:
            self.release_below(self.reqs[rid], gone, n, load)
        for g, p in self.pools.items():
            p.release(gone[g])
        out = {"positions": [], "request_indices": [], "qsl": [0], "groups": {}}
        for g, p in self.pools.items():  # one allocation per group, handed out in batch order
            cells = [(r, L) for r, n in ((self.reqs[rid], n) for rid, n in items)
                     for L in range(self.hi(r, g), cdiv(r["c"] + n, p.T))]
            for (r, L), q in zip(cells, p.take(len(cells))):
                r["pages"][g][L] = q
        for i, (rid, n) in enumerate(items):
            r = self.reqs[rid]
            out["positions"] += list(range(r["c"], r["c"] + n))
            out["request_indices"] += [i] * n
            out["qsl"].append(out["qsl"][-1] + n)
        for g, p in self.pools.items():
            out["groups"][g] = self.group_step(items, p, fixed_width, not load)
        for rid, n in items:
            self.reqs[rid]["committed"] = self.reqs[rid]["c"]
            self.reqs[rid]["c"] += n
        self.last = [rid for rid, _ in items]
        return out

    def release_below(self, r, gone, n, load) -> None:
        """A sliding group's pages below the step's release point (``floor``)."""
        for g, p in self.pools.items():
            if p.W:
                floor = self.floor(r, p, n, load)
                gone[g] += [r["pages"][g].pop(L) for L in range(r["base"][g], min(floor, self.hi(r, g)))]
                r["base"][g] = max(r["base"][g], floor)

    def group_step(self, items, p, fixed_width, with_slots=True):
        rows, slots = [], []
        for rid, n in items:
            r = self.reqs[rid]
            cells = r["pages"][p.gid]
            base = r["base"][p.gid]
            rows.append([cells[L] for L in range(base, base + len(cells))])
            for pos in range(r["c"], r["c"] + n) if with_slots else ():
                if (pos + 1) % p.m:
                    slots.append(-1)
                else:
                    row = pos // p.m
                    slots.append(cells[row // p.rows] * p.rows + row % p.rows)
        width = self.widths[p.gid] if fixed_width else max(len(x) for x in rows)
        table = [x + [-1] * (width - len(x)) for x in rows]
        bases = [self.reqs[rid]["base"][p.gid] for rid, _ in items] if p.W else None
        return {"table": table, "base_pages": bases, "write_slots": slots}

    # --- outside a step ----------------------------------------------------------------
    def rewind_many(self, items) -> None:
        """Keep the first n computed tokens of each; the pages past them go back as one release."""
        if not all(self.reqs[rid]["committed"] <= n <= self.reqs[rid]["c"] for rid, n in items):
            raise RefError("rewind out of range")
        gone = {g: [] for g in self.pools}
        for rid, n in items:
            r = self.reqs[rid]
            r["c"] = n
            if r["ids"] is not None:
                del r["ids"][max(n, r["prompt"]):]  # rejected draft ids go with their tokens
            for g, p in self.pools.items():
                keep = max(cdiv(n, p.T), r["base"][g])
                gone[g] += [r["pages"][g].pop(L) for L in range(keep, self.hi(r, g))]
        for g, p in self.pools.items():
            p.release(gone[g])

    def free(self, rid) -> None:
        r = self.reqs.pop(rid)
        self.commit(r)
        for g, p in self.pools.items():
            p.release([r["pages"][g][L] for L in sorted(r["pages"][g])])

    def stats(self) -> dict:
        return {g: {"total_pages": p.total, "free_pages": p.free(), "used_pages": len(p.ref),
                    "cached_pages": len(p.key_of), "evictable_pages": len(p.lru)}
                for g, p in self.pools.items()}
