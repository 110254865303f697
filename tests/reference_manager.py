"""An independent, slow, plain-Python model of the cache manager's documented rules, written from
docs/manager.md ("The rules", "Load steps") and docs/prefix-caching.md, never from src/hybridkv. Prefix keys
are token tuples; a sliding group's checkpoint window is its window; a boundary crossed past the prompt is held,
published at free. Not modelled: the shared arena's slabs, checkpoint intervals, salts, events."""

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
        self.total, self.stack = pages - 1, list(range(pages - 1, 0, -1))  # clean free pages, page 1 on top
        self.ref, self.key_of, self.entries, self.lru, self.cleaned = {}, {}, {}, [], []  # cleaned: for the test's ids

    def release(self, pages) -> None:
        """Drop a reference each; idle pages go on the stack (the first listed on top) or into the LRU."""
        for p in reversed(pages):
            self.ref[p] -= 1
            if self.ref[p] == 0:
                del self.ref[p]
                if p in self.key_of:  # low-priority pages at the evicting end
                    self.lru.insert(0 if self.entries[self.key_of[p]]["low"] else len(self.lru), p)
                else:
                    self.stack.append(p)
                    self.cleaned.append(p)

    def take(self, n: int) -> list[int]:
        """All or nothing (the caller checked): evict LRU entries while clean pages are short (idle low-priority
        ones up to 16 pages beyond the need), then pop."""
        if len(self.stack) < n:
            while self.lru and len(self.stack) < n + (16 if self.entries[self.key_of[self.lru[0]]]["low"] else 0):
                self.unpublish(self.key_of[self.lru[0]])
        out = [self.stack.pop() for _ in range(n)]
        self.ref.update((p, 1) for p in out)
        return out

    def hold(self, pages) -> None:
        self.lru = [p for p in self.lru if p not in pages]
        self.ref.update((p, self.ref.get(p, 0) + 1) for p in pages)

    def unpublish(self, key) -> None:
        """Remove an entry; its idle pages become clean free."""
        freed = [p for p in self.entries.pop(key)["pages"] if p not in self.ref]
        self.lru = [p for p in self.lru if p not in freed]
        self.stack += reversed(freed)
        self.cleaned += freed
        self.key_of = {p: k for p, k in self.key_of.items() if k != key}

    def demote(self, key) -> None:
        """Make an entry low-priority: its idle pages move to the LRU's evicting end."""
        self.entries[key]["low"] = True
        idle = [p for p in self.entries[key]["pages"] if p in self.lru]
        self.lru = idle + [p for p in self.lru if p not in idle]


class ReferenceManager:
    def __init__(self, specs, pages, *, table_widths=None, caching=False, grain=None, prompt_checkpoints=True):
        self.pools = {s.group_id: Pool(s, pages[s.group_id]) for s in specs}
        self.states = [p for p in self.pools.values() if not p.history]
        self.widths, self.caching, self.G, self.prompt_cps = table_widths, caching, grain, prompt_checkpoints
        self.reqs, self.last, self.serials = {}, [], itertools.count()  # serials own checkpoints, never reused

    def add_request(self, rid, ids=None, prompt_tokens=None, max_new=0) -> dict:
        """Register a request; with prefix caching borrow its hit. Returns the hit's numbers."""
        prompt = len(ids) if ids is not None else prompt_tokens
        r = {"prompt": prompt, "limit": prompt + max_new, "ids": list(ids) if ids is not None else None,
             "c": 0, "committed": 0, "published": 0, "junction": 0, "serial": next(self.serials),
             "base": dict.fromkeys(self.pools, 0), "pages": {g: [] for g in self.pools},  # pages from base up
             "held_at": 0, "held": {g: [] for g in self.pools}, "let_go": {g: [] for g in self.pools}}
        self.reqs[rid] = r
        return self.borrow(r) if self.caching else {"hit": 0}

    def hi(self, r, g) -> int:
        return r["base"][g] + len(r["pages"][g])

    def key(self, r, d):
        return tuple(r["ids"][:d])

    def group_reach(self, r, pool) -> int:
        """Cached prompt tokens (less the last) in one group: a run of blocks from 0, or the last checkpoint."""
        top = (r["prompt"] - 1) // self.G * self.G
        found = [d for d in range(self.G, top + 1, self.G) if self.key(r, d) in pool.entries]
        if pool.history:
            return next(d for d in range(0, top + 1, self.G) if d + self.G not in found)
        return max(found, default=0)

    def borrow(self, r) -> dict:
        """Borrow the longest hit that every history group's blocks and every state group's checkpoint cover."""
        reach = {g: self.group_reach(r, p) for g, p in self.pools.items()}
        d = history = min([reach[g] for g, p in self.pools.items() if p.history], default=0)
        while d and not all(self.key(r, d) in p.entries for p in self.states):
            d -= self.G
        r["junction"] = history if history > d else 0
        r["c"] = r["committed"] = r["published"] = d
        for g, p in self.pools.items() if d else ():  # borrow history blocks below d, checkpoints at d
            ends = range(self.G, d + 1, self.G) if p.history else [d]
            pages = [q for e in ends for q in p.entries[self.key(r, e)]["pages"]]
            if not p.history:
                p.entries[self.key(r, d)]["owners"].add(r["serial"])
            r["base"][g], r["pages"][g] = d // p.T - len(pages), pages
            p.hold(pages)
        return {"hit": d, "groups": reach, "history": history}

    def commit(self, r, freeing=False) -> None:
        """Publish the grain boundaries crossed since its last publication, then let go of its older checkpoints; at a
        step (not ``freeing``) a last boundary crossed past the prompt is held instead."""
        d = 0 if freeing else self.holds_at(r)
        old, r["committed"] = r["committed"], r["c"]
        if not self.caching or not freeing and r["c"] // self.G * self.G <= old:
            return  # no boundary crossed since the last step
        if d:
            self.hold(r, d)
            return
        old, r["published"] = r["published"], r["c"]
        crossed = range((old // self.G + 1) * self.G, r["c"] + 1, self.G)
        for d, p in itertools.product(crossed, self.pools.values()):
            self.publish(r, p, d, own=d in (crossed[-1], r["junction"]))
        for d, p in itertools.product(range(self.G, crossed[-1] if crossed else 0, self.G), self.states):
            e = p.entries.get(self.key(r, d), {"owners": set()})
            if d != r["junction"] and r["serial"] in e["owners"]:  # not pinned, still its own (maybe evicted)
                e["owners"].discard(r["serial"])
                if not e["owners"] and self.prompt_cps and d <= r["prompt"]:
                    p.demote(self.key(r, d))
                elif not e["owners"]:
                    p.unpublish(self.key(r, d))

    def holds_at(self, r) -> int:
        """The boundary r's next step holds: the last crossed since its commit if all lie past the prompt, else 0."""
        d, old = r["c"] // self.G * self.G if self.caching else 0, r["committed"]
        past = (old // self.G + 1) * self.G > r["prompt"] and r["ids"] is not None
        return d if d > old and past else 0

    def hold(self, r, d) -> None:
        """Each state group's window below d held (one reference more), the one held before let go at the slide."""
        for p in self.states:
            r["let_go"][p.gid], r["held"][p.gid] = r["held"][p.gid], self.window(r, p, d) or []
            p.hold(r["held"][p.gid])
        r["held_at"] = d

    def window(self, r, p, d):
        """Group p's pages of the window (history: the block) below d, None where they slid out."""
        if d == r["held_at"] and r["held"][p.gid]:
            return list(r["held"][p.gid])
        lo, hi = (d - (self.G if p.history else p.W)) // p.T - r["base"][p.gid], d // p.T - r["base"][p.gid]
        return r["pages"][p.gid][lo:hi] if 0 <= lo and hi <= len(r["pages"][p.gid]) else None

    def publish(self, r, p, d, own) -> None:
        """Publish the block or checkpoint ending at d in group p, low-priority if a state group's and not own."""
        key, pages = self.key(r, d), self.window(r, p, d)
        publish = p.history or pages is not None and (own or self.prompt_cps and d <= r["prompt"])
        if publish and key not in p.entries:
            p.entries[key] = {"pages": pages, "low": not (p.history or own), "owners": set()}
            p.key_of.update((q, key) for q in pages)
        if own and not p.history and key in p.entries:  # its own, whoever published it
            p.entries[key]["owners"].add(r["serial"])

    def new_base(self, r, p, n, load) -> int:
        """A sliding group's base after the release: the first position's window, or a load's end checkpoint."""
        if not p.W:
            return r["base"][p.gid]
        floor = max(0, r["c"] + n - p.W) // p.T if load else max(0, r["c"] - p.W + 1) // p.T
        return max(r["base"][p.gid], floor)

    def plan(self, r, n, load=False) -> dict:
        """Per group: (table width after a step of n tokens, pages it takes less pages it frees)."""
        d = self.holds_at(r)  # a hold at d keeps its window and lets go of r["held"]
        out = {}
        for g, p in self.pools.items():
            base, hi, new_base = r["base"][g], self.hi(r, g), self.new_base(r, p, n, load)
            need = max(cdiv(r["c"] + n, p.T), hi) if n else hi
            held = set(self.window(r, p, d) or []) if d else set()
            let_go = r["held"][g] if d else []
            gone = sum(1 for q in r["pages"][g][:new_base - base] + let_go if p.ref[q] == 1 and q not in held)
            out[g] = (need - new_base, need - max(hi, new_base) - gone)
        return out

    def fits(self, plans) -> bool:
        return all(sum(pl[g][1] for pl in plans) <= len(p.stack) + len(p.lru) for g, p in self.pools.items())

    def settling(self, items):
        """The previous batch's requests left out of this one that have tokens to commit."""
        return [rid for rid in self.last if rid in self.reqs and rid not in dict(items)
                and self.reqs[rid]["c"] > self.reqs[rid]["committed"]]

    def check_admission(self, items, fixed_width=False, load=False) -> list[bool]:
        chosen = [self.plan(self.reqs[rid], 0) for rid in self.settling(items)]
        plans = [self.plan(self.reqs[rid], n, load) for rid, n in items]
        ok = [not fixed_width or all(w <= self.widths[g] for g, (w, _) in pl.items()) for pl in plans]
        if not self.fits(chosen + [pl for pl, k in zip(plans, ok) if k]):
            for i, pl in enumerate(plans):  # greedy in batch order
                ok[i] = ok[i] and self.fits(chosen + [pl])
                if ok[i]:
                    chosen.append(pl)
        return ok

    def max_admissible_tokens(self, rid, max_tokens, batch=()) -> int:
        if not all(self.check_admission(list(batch))):
            raise RefError("batch not admissible")
        r = self.reqs[rid]
        cap = min(max_tokens, r["limit"] - r["c"], len(r["ids"]) - r["c"] if r["ids"] is not None else max_tokens)
        return next((k for k in range(cap, 0, -1) if all(self.check_admission(list(batch) + [(rid, k)]))), 0)

    def schedule(self, items, fixed_width=False, load=False) -> dict:
        """Commit the previous step's requests, paused ones first, then step each group."""
        if not all(self.check_admission(items, fixed_width, load)):
            raise RefError("denied")
        reqs = [(self.reqs[rid], n) for rid, n in items]
        slides = [(self.reqs[rid], 0, False) for rid in self.settling(items)] + [(r, n, load) for r, n in reqs]
        for r, _, _ in slides:
            self.commit(r)
        groups = {g: self.group_step(p, slides, reqs, fixed_width, with_slots=not load) for g, p in self.pools.items()}
        out = {"positions": [pos for r, n in reqs for pos in range(r["c"], r["c"] + n)],
               "request_indices": [i for i, (_, n) in enumerate(items) for _ in range(n)],
               "qsl": list(itertools.accumulate((n for _, n in items), initial=0)), "groups": groups}
        for r, n in reqs:
            r["c"] += n
        self.last = list(dict(items))
        return out

    def group_step(self, p, slides, reqs, fixed_width, with_slots) -> dict:
        """One group's release (each row's let-go hold and slid-out pages, in ``slides`` order) and allocation (in
        batch order), then its block table (rows padded with -1), base pages (sliding groups) and write slots."""
        g, gone, slots = p.gid, [], []
        for r, n, load in slides:
            k = self.new_base(r, p, n, load) - r["base"][g]
            gone += r["let_go"][g] + r["pages"][g][:k]
            r["let_go"][g] = []
            del r["pages"][g][:k]
            r["base"][g] += k
        p.release(gone)
        cells = [r["pages"][g] for r, n in reqs for _ in range(self.hi(r, g), cdiv(r["c"] + n, p.T))]
        for pages, q in zip(cells, p.take(len(cells))):
            pages.append(q)
        for r, n in reqs if with_slots else ():
            for pos in range(r["c"], r["c"] + n):  # a compressed group writes a row at its last token only
                page = r["pages"][g][pos // p.T - r["base"][g]]
                slots.append(-1 if (pos + 1) % p.m else page * p.rows + pos // p.m % p.rows)
        width = self.widths[g] if fixed_width else max(len(r["pages"][g]) for r, _ in reqs)
        return {"table": [r["pages"][g] + [-1] * (width - len(r["pages"][g])) for r, _ in reqs],
                "base_pages": [r["base"][g] for r, _ in reqs] if p.W else None, "write_slots": slots}

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
        self.commit(r, freeing=True)
        for g, p in self.pools.items():
            p.release(r["pages"][g] + r["held"][g])

    def stats(self) -> dict:
        return {g: {"total_pages": p.total, "free_pages": len(p.stack) + len(p.lru), "used_pages": len(p.ref),
                    "cached_pages": len(p.key_of), "evictable_pages": len(p.lru)}
                for g, p in self.pools.items()}
