"""Property: every page a request reads holds rows written for exactly that request's prefix.

A shadow model records, for every page row a step writes, the position of the
token that wrote it and a digest of the writer's whole token prefix up to that
position (a KV row depends on every earlier token, not only on its own span).
After every operation, for every live request and group, every row of every
page in its table that lies below its computed tokens must carry that
request's own digest at that position. Borrowed pages (prefix hits), released
and re-allocated pages, evicted and rewound pages are all covered by the one
check; it is what the stale-window bug serving engines hit (a window read past its release) would
break.

Random runs mix shared prefixes (lengths 1..1500), continuations of finished
requests (multi-turn), chunked prefill, batched decode, speculative verify +
rewind, frees and cache clears, over pools small enough that cached pages are
evicted.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.runtime.manager import CacheManager
from hybridkv.models.deepseek_v4 import build_v4_cache_specs

SPECS = tuple(build_v4_cache_specs(SimpleNamespace(sliding_window=128), layer_ratio=[0, 4, 128]))
# Small enough that cached pages get evicted in every group kind; large enough for one
# request of MAX_CONTEXT_TOKENS with 400-token chunks.
GROUP_PAGES = {
    "v4.swa_kv": 32,
    "v4.c4a.compressor_state": 240,
    "v4.c4a.compressed_kv": 16,
    "v4.c128a.compressor_state": 120,
    "v4.c128a.compressed_kv": 16,
    "v4.c4a.indexer_compressor_state": 240,
}
MAX_CONTEXT_TOKENS = 2048
MAX_LIVE = 5
VOCAB = 129_280


class Shadow:
    """What each page row was written for, and each live request's token sequence."""

    def __init__(self, mgr: CacheManager):
        self.mgr = mgr
        self.weights = np.random.default_rng(12345).integers(
            1, 2**63, MAX_CONTEXT_TOKENS, dtype=np.uint64
        )
        self.seq: dict[str, np.ndarray] = {}
        self.known: dict[str, int] = {}
        self.prompt: dict[str, int] = {}
        self.total: dict[str, int] = {}
        self.written_pos = {
            s.group_id: np.full((GROUP_PAGES[s.group_id], s.rows_per_page), -1, dtype=np.int64)
            for s in mgr.specs
        }
        self.written_key = {
            s.group_id: np.zeros((GROUP_PAGES[s.group_id], s.rows_per_page), dtype=np.uint64)
            for s in mgr.specs
        }

    def digest(self, rid: str) -> np.ndarray:
        """digest[p] names the prefix tokens[0..p] (a random linear hash mod 2**64)."""
        n = self.known[rid]
        terms = (self.seq[rid][:n].astype(np.uint64) + np.uint64(1)) * self.weights[:n]
        return np.cumsum(terms, dtype=np.uint64)

    def record(self, batch) -> None:
        qsl = batch.query_start_loc
        for i, rid in enumerate(batch.request_ids):
            positions = batch.positions[qsl[i] : qsl[i + 1]]
            keys = self.digest(rid)[positions]
            for s in self.mgr.specs:
                slots = batch.groups[s.group_id].write_slots[qsl[i] : qsl[i + 1]]
                w = slots >= 0
                page, row = slots[w] // s.rows_per_page, slots[w] % s.rows_per_page
                self.written_pos[s.group_id][page, row] = positions[w]
                self.written_key[s.group_id][page, row] = keys[w]

    def check(self, rid: str) -> None:
        computed = self.mgr.num_computed_tokens(rid)
        keys = self.digest(rid)
        for s in self.mgr.specs:
            gid, rpp, stride = s.group_id, s.rows_per_page, s.entry_stride_tokens
            base, pages = self.mgr.request_pages(rid, gid)
            logical = base + np.arange(pages.size)
            entry = logical[:, None] * rpp + np.arange(rpp)[None, :]
            last = (entry + 1) * stride - 1  # the token whose write completes the row
            live = last < computed
            page_ids = np.broadcast_to(pages[:, None], entry.shape)[live]
            rows = np.broadcast_to(np.arange(rpp)[None, :], entry.shape)[live]
            want = last[live]
            got_pos = self.written_pos[gid][page_ids, rows]
            got_key = self.written_key[gid][page_ids, rows]
            bad = (got_pos != want) | (got_key != keys[want])
            assert not bad.any(), (
                f"{rid} group {gid}: rows for positions {want[bad][:5].tolist()} hold "
                f"rows written at {got_pos[bad][:5].tolist()} for another prefix"
            )


class Chooser:
    """Random choices from hypothesis (shrinkable) or from a numpy generator (fixed runs)."""

    def __init__(self, data=None, rng=None):
        self.data, self.rng = data, rng

    def integer(self, lo: int, hi: int) -> int:
        if self.data is not None:
            return self.data.draw(st.integers(lo, hi))
        return int(self.rng.integers(lo, hi + 1))

    def pick(self, items):
        return items[self.integer(0, len(items) - 1)]


OPS = ("add",) * 9 + ("step",) * 22 + ("verify",) * 3 + ("free",) * 5 + ("clear",)


def run_random_ops(choose: Chooser, num_ops: int, *, mgr: CacheManager | None = None) -> dict[str, int]:
    """Drive a manager with random operations, checking the invariants after each one."""
    mgr = mgr or CacheManager(
        SPECS,
        GROUP_PAGES,
        max_context_tokens=MAX_CONTEXT_TOKENS,
        enable_prefix_caching=True,
        state_checkpoint_interval=choose.pick([None, 256, 512]),
    )
    shadow = Shadow(mgr)
    token_rng = np.random.default_rng(choose.integer(0, 2**32 - 1))
    prefixes = [
        token_rng.integers(0, VOCAB, choose.integer(1, 1500), dtype=np.int32)
        for _ in range(choose.integer(1, 3))
    ]
    finished: list[np.ndarray] = []
    counts = {"hits": 0, "hit_tokens": 0, "continuation_hits": 0, "steps": 0, "rewinds": 0, "clears": 0}
    next_id = 0

    def live() -> list[str]:
        return sorted(shadow.seq)

    def append(rid: str, count: int) -> None:
        """Make ``count`` ids past the computed tokens known (sampled or draft ids)."""
        have = shadow.known[rid] - mgr.num_computed_tokens(rid)
        new = token_rng.integers(0, VOCAB, max(0, count - have), dtype=np.int32)
        if new.size:
            mgr.append_token_ids(rid, new)
            k = shadow.known[rid]
            shadow.seq[rid][k : k + new.size] = new
            shadow.known[rid] = k + new.size

    def schedule(items) -> bool:
        answers = mgr.check_admission(items)
        items = [item for item, a in zip(items, answers) if a.ok]
        if not items:
            return False
        shadow.record(mgr.schedule(items))
        counts["steps"] += 1
        return True

    for _ in range(num_ops):
        op = choose.pick(OPS)
        if op == "add" and len(shadow.seq) < MAX_LIVE:
            continuation = bool(finished) and choose.integer(0, 1) == 0
            source = choose.pick(finished) if continuation else choose.pick(prefixes)
            cut = choose.pick([choose.integer(1, source.size), source.size])
            prompt = np.concatenate(
                [source[:cut], token_rng.integers(0, VOCAB, choose.integer(0, 64), dtype=np.int32)]
            )[: MAX_CONTEXT_TOKENS - 1]
            max_new = min(choose.integer(1, 200), MAX_CONTEXT_TOKENS - prompt.size)
            rid = f"r{next_id}"
            next_id += 1
            hit = mgr.add_request(rid, prompt, max_new_tokens=max_new)
            assert hit.hit_tokens % 256 == 0 and hit.hit_tokens <= prompt.size - 1
            assert mgr.num_computed_tokens(rid) == hit.hit_tokens
            if hit.hit_tokens:
                counts["hits"] += 1
                counts["hit_tokens"] += hit.hit_tokens
                counts["continuation_hits"] += continuation
            shadow.seq[rid] = np.zeros(prompt.size + max_new, dtype=np.int32)
            shadow.seq[rid][: prompt.size] = prompt
            shadow.known[rid] = shadow.prompt[rid] = prompt.size
            shadow.total[rid] = prompt.size + max_new
        elif op == "step" and shadow.seq:
            items = []
            for rid in live():
                if choose.integer(0, 3) == 0:
                    continue
                done = mgr.num_computed_tokens(rid)
                if done < shadow.prompt[rid]:
                    # Half the chunks end on a 256-token boundary (so they leave a checkpoint).
                    chunk = choose.pick([choose.integer(1, 400), 256 - done % 256])
                    items.append((rid, min(chunk, shadow.prompt[rid] - done)))
                elif done < shadow.total[rid]:
                    append(rid, 1)
                    items.append((rid, 1))
            if items:
                schedule(items)
        elif op == "verify" and shadow.seq:
            rid = choose.pick(live())
            done = mgr.num_computed_tokens(rid)
            room = shadow.total[rid] - done
            if done >= shadow.prompt[rid] and room > 0:
                width = choose.integer(1, min(6, room))
                append(rid, width)
                if schedule([(rid, width)]):
                    keep = done + choose.integer(0, width)
                    mgr.rewind(rid, keep)
                    shadow.known[rid] = min(shadow.known[rid], max(keep, shadow.prompt[rid]))
                    counts["rewinds"] += 1
        elif op == "free" and shadow.seq:
            # Mostly requests past their prompt, so their prefixes get committed and cached.
            past_prompt = [r for r in live() if mgr.num_computed_tokens(r) >= shadow.prompt[r]]
            rid = choose.pick(past_prompt if past_prompt and choose.integer(0, 3) else live())
            if mgr.num_computed_tokens(rid):
                finished.append(shadow.seq[rid][: mgr.num_computed_tokens(rid)].copy())
            mgr.free(rid)
            for table in (shadow.seq, shadow.known, shadow.prompt, shadow.total):
                del table[rid]
        elif op == "clear":
            mgr.clear_prefix_cache()
            counts["clears"] += 1
        mgr.check_invariants()
        for rid in live():
            shadow.check(rid)

    for rid in live():
        mgr.free(rid)
    mgr.check_invariants()
    stats = mgr.stats()
    counts["evicted_pages"] = sum(g.evicted_pages for g in stats.values())
    counts["evicted_history_pages"] = sum(
        g.evicted_pages for s, g in zip(mgr.specs, stats.values()) if not s.is_sliding
    )
    mgr.clear_prefix_cache()
    for gid, g in mgr.stats().items():
        assert g.free_pages == g.total_pages and g.cached_pages == 0 and g.used_pages == 0, gid
    mgr.check_invariants()
    return counts


@given(st.data())
def test_every_page_a_request_reads_holds_its_own_prefix(data):
    run_random_ops(Chooser(data=data), data.draw(st.integers(5, 40)))


def test_fixed_runs_exercise_hits_evictions_and_rewinds():
    """The random driver really reaches the interesting states (else the property is vacuous)."""
    totals: dict[str, int] = {}
    for seed in range(3, 8):
        counts = run_random_ops(Chooser(rng=np.random.default_rng(seed)), 120)
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
    assert totals["hits"] >= 10 and totals["continuation_hits"] >= 3, totals
    assert 0 < totals["evicted_history_pages"] < totals["evicted_pages"], totals  # both kinds evicted
    assert totals["rewinds"] > 0 and totals["clears"] > 0, totals


def test_the_check_catches_a_hit_served_for_another_prefix(monkeypatch):
    """Sabotage the content keys (ignore each block's last token): the check must fail."""
    mgr = CacheManager(SPECS, GROUP_PAGES, max_context_tokens=MAX_CONTEXT_TOKENS, enable_prefix_caching=True)
    monkeypatch.setattr(mgr.prefix, "_hash", lambda data: xxhash.xxh3_128_intdigest(bytes(data)[:-4]))
    shadow = Shadow(mgr)
    a = np.arange(1, 301, dtype=np.int32)
    b = a.copy()
    b[255] = 7  # differs only in the last token of block 0
    for rid, prompt in (("a", a), ("b", b)):
        hit = mgr.add_request(rid, prompt)
        shadow.seq[rid], shadow.known[rid] = prompt.copy(), prompt.size
        if rid == "a":
            shadow.record(mgr.schedule([("a", 300)]))
            mgr.free("a")
            del shadow.seq["a"], shadow.known["a"]
    assert hit.hit_tokens == 256  # the sabotaged key matched
    with pytest.raises(AssertionError, match="for another prefix"):
        shadow.check("b")
