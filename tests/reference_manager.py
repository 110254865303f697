"""An independent, slow, plain-Python model of the cache manager's documented rules.

Written from docs/manager.md ("The rules", "Load steps"), docs/prefix-caching.md and docs/architecture.md
only, never from src/hybridkv. One dict per request, one small pool object per group, no numpy. Page ids
follow a per-group pool's documented order: fresh 1, 2, 3...; freed pages reused first, LIFO, the first page
of a release on top; a step releases and allocates once per group ("Order within a step"). Prefix keys are the
token tuples themselves (equal keys <=> equal content), not hashes; a sliding group's checkpoint window is its
sliding window. Where the docs leave it open this follows the manager: an eviction takes idle low-priority
entries while it has freed fewer than its need plus 16 pages. Not modelled: the shared arena's slabs, the
checkpoint interval, salts, events. ``tests/test_reference_equivalence.py`` runs random programs on this and
on ``CacheManager`` and compares what they hand out.
"""

from __future__ import annotations

import itertools


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RefError(Exception):
    """What the manager raises as CacheManagerError."""


class Pool:
    """One group: spec numbers, page ids, reference counts and (prefix caching) keyed entries and the LRU."""

    def __init__(self, spec, pages: int):
        self.gid, self.rows, self.m = spec.group_id, spec.rows_per_page, spec.entry_stride_tokens
        self.T, self.W, self.history = self.rows * self.m, spec.sliding_window_tokens, not spec.is_sliding
        self.total, self.fresh, self.stack = pages - 1, 1, []
        self.ref, self.key_of, self.entries, self.lru = {}, {}, {}, []
        self.cleaned = []  # pages that went back to clean free (drained by the test's id matcher)

    def clean(self) -> int:
        return len(self.stack) + self.total + 1 - self.fresh

    def free(self) -> int:
        return self.clean() + len(self.lru)

    def release(self, pages) -> None:
        """Drop one reference each; idle pages go on the stack (first listed on top) or into the LRU
        (low-priority ones at its evicting end, first listed first)."""
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
        """All or nothing (the caller checked): when clean pages are short evict LRU entries first (low-priority
        ones up to 16 pages beyond the need), then hand out freed pages (LIFO), then fresh ones in id order."""
        short, evicted = n - self.clean(), 0
        while short > 0 and self.lru:
            key = self.key_of[self.lru[0]]
            if evicted >= short + (16 if self.entries[key]["low"] else 0):
                break
            evicted += self.unpublish(key)
        k = min(n, len(self.stack))
        out = [self.stack.pop() for _ in range(k)] + list(range(self.fresh, self.fresh + n - k))
        self.fresh += n - k
        self.ref.update((p, 1) for p in out)
        return out

    def hold(self, pages) -> None:
        for p in pages:
            if p not in self.ref:
                self.lru.remove(p)
            self.ref[p] = self.ref.get(p, 0) + 1

    def publish(self, key, pages, low=False) -> None:
        if key not in self.entries:
            self.entries[key] = {"pages": pages, "low": low, "owners": set()}
            self.key_of.update((p, key) for p in pages)

    def unpublish(self, key) -> int:
        """Remove an entry; its idle pages become clean free. Returns how many."""
        pages = self.entries.pop(key)["pages"]
        freed = [p for p in pages if p not in self.ref]
        self.lru = [p for p in self.lru if p not in freed]
        self.stack += reversed(freed)
        self.cleaned += freed
        for p in pages:
            if self.key_of.get(p) == key:
                del self.key_of[p]
        return len(freed)

    def demote(self, key) -> None:
        """Make an entry low-priority: its idle pages move to the LRU's evicting end."""
        self.entries[key]["low"] = True
        idle = [p for p in self.entries[key]["pages"] if p in self.lru]
        self.lru = idle + [p for p in self.lru if p not in idle]


class ReferenceManager:
    def __init__(self, specs, pages, *, table_widths=None, caching=False, grain=None, prompt_checkpoints=True):
        self.pools = {s.group_id: Pool(s, pages[s.group_id]) for s in specs}
        self.widths, self.caching, self.G, self.prompt_cps = table_widths, caching, grain, prompt_checkpoints
        self.reqs, self.last = {}, []
        # Checkpoint owners are request serials, never reused: a freed request keeps its holds, and a new
        # request must not count as the freed one.
        self.serials = itertools.count()

    def add_request(self, rid, ids=None, prompt_tokens=None, max_new=0) -> dict:
        """Register a request; with prefix caching borrow its hit. Returns the hit's numbers."""
        prompt = len(ids) if ids is not None else prompt_tokens
        r = {"prompt": prompt, "limit": prompt + max_new, "ids": list(ids) if ids is not None else None,
             "c": 0, "committed": 0, "junction": 0, "serial": next(self.serials),
             "base": dict.fromkeys(self.pools, 0), "pages": {g: [] for g in self.pools}}  # pages from base up
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
        """The prompt's (less its last token) cached tokens in one group: the run of blocks from the start
        (history), or its last checkpoint (state)."""
        top = (r["prompt"] - 1) // self.G * self.G
        found = [d for d in range(self.G, top + 1, self.G) if self.key(r, d) in pool.entries]
        if pool.history:
            return next(d for d in range(0, top + 1, self.G) if d + self.G not in found)
        return max(found, default=0)

    def borrow(self, r) -> dict:
        reach = {g: self.group_reach(r, p) for g, p in self.pools.items()}
        history = min([reach[g] for g, p in self.pools.items() if p.history], default=0)
        d = history
        while d and not all(self.key(r, d) in p.entries for p in self.pools.values() if not p.history):
            d -= self.G
        r["junction"] = history if history > d else 0
        r["c"] = r["committed"] = d
        if d:
            self.lend(r, d)
        return {"hit": d, "groups": reach, "history": history}

    def lend(self, r, d) -> None:
        """Borrow the hit's pages: history blocks below d, each state group's checkpoint at d."""
        for g, p in self.pools.items():
            if p.history:
                pages = [q for e in range(self.G, d + 1, self.G) for q in p.entries[self.key(r, e)]["pages"]]
            else:
                pages = list(p.entries[self.key(r, d)]["pages"])
                p.entries[self.key(r, d)]["owners"].add(r["serial"])
            r["base"][g], r["pages"][g] = d // p.T - len(pages), pages
            p.hold(pages)

    def commit(self, r) -> None:
        """Publish what the computed tokens crossed (blocks; state checkpoints: its last and the junction, owned,
        and low-priority prompt ones), then let go of its older checkpoints."""
        old, r["committed"] = r["committed"], r["c"]
        crossed = list(range((old // self.G + 1) * self.G, r["c"] + 1, self.G)) if self.caching else []
        for d in crossed:
            own = d in (crossed[-1], r["junction"])
            for g, p in self.pools.items():
                lo, hi = (d - (self.G if p.history else p.W)) // p.T - r["base"][g], d // p.T - r["base"][g]
                # None: pages a load step slid out (published only by someone else).
                pages = r["pages"][g][lo:hi] if 0 <= lo and hi <= len(r["pages"][g]) else None
                if p.history or pages is not None and (own or self.prompt_cps and d <= r["prompt"]):
                    p.publish(self.key(r, d), pages, low=not (p.history or own))
                if own and not p.history and self.key(r, d) in p.entries:  # its own, whoever published it
                    p.entries[self.key(r, d)]["owners"].add(r["serial"])
        for d in range(self.G, crossed[-1] if crossed else 0, self.G):
            if d != r["junction"]:
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
    def new_base(self, r, p, n, load) -> int:
        """A sliding group's base after the step's release: from the first position written, or for a load
        step the first page of the checkpoint window at the load's end (may pass hi)."""
        base = r["base"][p.gid]
        if not p.W:
            return base
        if load:
            return max(base, max(0, r["c"] + n - p.W) // p.T)
        return max(base, min(max(0, r["c"] - p.W + 1) // p.T, self.hi(r, p.gid)))

    def plan(self, r, n, load=False):
        """Per group: the table width after a step of n tokens, and the pages it allocates less those it
        releases as their last holder."""
        widths, costs = {}, {}
        for g, p in self.pools.items():
            base, hi, new_base = r["base"][g], self.hi(r, g), self.new_base(r, p, n, load)
            need = max(cdiv(r["c"] + n, p.T), hi) if n else hi
            gone = sum(1 for q in r["pages"][g][:new_base - base] if p.ref[q] == 1)
            widths[g], costs[g] = need - new_base, need - max(hi, new_base) - gone
        return widths, costs

    def fits(self, costs) -> bool:
        return all(sum(c[g] for c in costs) <= p.free() for g, p in self.pools.items())

    def settling(self, items):
        names = {rid for rid, _ in items}
        return [rid for rid in self.last if rid in self.reqs and rid not in names
                and self.reqs[rid]["c"] > self.reqs[rid]["committed"]]

    def check_admission(self, items, fixed_width=False, load=False) -> list[bool]:
        chosen = [self.plan(self.reqs[rid], 0)[1] for rid in self.settling(items)]
        plans = [self.plan(self.reqs[rid], n, load) for rid, n in items]
        ok = [not fixed_width or all(w <= self.widths[g] for g, w in widths.items()) for widths, _ in plans]
        if self.fits(chosen + [costs for (_, costs), k in zip(plans, ok) if k]):
            return ok
        for i, (_, costs) in enumerate(plans):  # greedy in batch order
            ok[i] = ok[i] and self.fits(chosen + [costs])
            if ok[i]:
                chosen.append(costs)
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
        for rid in settle + [rid for rid, _ in items]:  # paused requests commit first
            self.commit(self.reqs[rid])
        gone = {g: [] for g in self.pools}  # one release per group: paused requests, then the batch
        for rid, n, step_load in [(rid, 0, False) for rid in settle] + [(rid, n, load) for rid, n in items]:
            r = self.reqs[rid]
            for g, p in self.pools.items():
                k = self.new_base(r, p, n, step_load) - r["base"][g]
                gone[g] += r["pages"][g][:k]
                del r["pages"][g][:k]
                r["base"][g] += k
        reqs = [(self.reqs[rid], n) for rid, n in items]
        for g, p in self.pools.items():  # then one allocation per group, handed out in batch order
            p.release(gone[g])
            cells = [r["pages"][g] for r, n in reqs for _ in range(self.hi(r, g), cdiv(r["c"] + n, p.T))]
            for pages, q in zip(cells, p.take(len(cells))):
                pages.append(q)
        out = {"positions": [pos for r, n in reqs for pos in range(r["c"], r["c"] + n)],
               "request_indices": [i for i, (_, n) in enumerate(items) for _ in range(n)],
               "qsl": list(itertools.accumulate((n for _, n in items), initial=0)),
               "groups": {g: self.group_step(reqs, p, fixed_width, not load) for g, p in self.pools.items()}}
        for r, n in reqs:
            r["c"] += n
        self.last = [rid for rid, _ in items]
        return out

    def group_step(self, reqs, p, fixed_width, with_slots):
        """One group's block table (rows padded with -1), base pages (sliding groups) and write slots."""
        g, slots = p.gid, []
        for r, n in reqs if with_slots else ():
            for pos in range(r["c"], r["c"] + n):
                if (pos + 1) % p.m:
                    slots.append(-1)
                else:
                    row = pos // p.m
                    slots.append(r["pages"][g][row // p.rows - r["base"][g]] * p.rows + row % p.rows)
        width = self.widths[g] if fixed_width else max(len(r["pages"][g]) for r, _ in reqs)
        return {"table": [r["pages"][g] + [-1] * (width - len(r["pages"][g])) for r, _ in reqs],
                "base_pages": [r["base"][g] for r, _ in reqs] if p.W else None, "write_slots": slots}

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
                keep = max(cdiv(n, p.T) - r["base"][g], 0)
                gone[g] += r["pages"][g][keep:]
                del r["pages"][g][keep:]
        for g, p in self.pools.items():
            p.release(gone[g])

    def free(self, rid) -> None:
        r = self.reqs.pop(rid)
        self.commit(r)
        for g, p in self.pools.items():
            p.release(r["pages"][g])

    def stats(self) -> dict:
        return {g: {"total_pages": p.total, "free_pages": p.free(), "used_pages": len(p.ref),
                    "cached_pages": len(p.key_of), "evictable_pages": len(p.lru)}
                for g, p in self.pools.items()}
