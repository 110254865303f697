"""Prefix caching across hybrid groups (issue 5): keys, publication, matching, sharing, eviction.

Most tests use a small DeepSeek-V4 group set (window 128, ratios 0/4/128) with
the default 256-token grain:

    group                               family   page tokens  window
    v4.swa_kv                           state    64           128
    v4.c4a.compressor_state             state    4            8
    v4.c4a.compressed_kv                history  256          -
    v4.c128a.compressor_state           state    8            128
    v4.c128a.compressed_kv              history  256          -
    v4.c4a.indexer_compressor_state     state    4            8

Expected hits are worked out by hand in each test from the rules: tokens of a
step are committed at the request's next ``schedule`` or ``free``; a commit
publishes every completed 256-token block (history groups) and one state
checkpoint at the latest boundary it crossed; a request's older own checkpoint
is dropped when it publishes a newer one (unless on the interval); a hit needs
all history blocks below D and a checkpoint at exactly D in every state group,
with D <= prompt - 1.
"""

from __future__ import annotations

import hashlib
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.runtime.manager import CacheManager, CacheManagerError
from hybridkv.models.deepseek_v4 import build_v4_cache_specs
from hybridkv.models.layout import cache_layout
from hybridkv.prefix.cache import CacheEvent, PrefixHit
from hybridkv.spec import CacheGroupSpec
from hybridkv.memory.arena import arena_geometry
from hybridkv.memory.pool import PagePool
from pool_ops import allocate, decref, publish

SPECS = tuple(build_v4_cache_specs(SimpleNamespace(sliding_window=128), layer_ratio=[0, 4, 128]))
SWA = "v4.swa_kv"
C4S = "v4.c4a.compressor_state"
C4KV = "v4.c4a.compressed_kv"
C128S = "v4.c128a.compressor_state"
C128KV = "v4.c128a.compressed_kv"
IDX = "v4.c4a.indexer_compressor_state"
HISTORY = (C4KV, C128KV)
STATE = (SWA, C4S, C128S, IDX)
ALL = (SWA, C4S, C4KV, C128S, C128KV, IDX)
VOCAB = 129_280


def make_manager(pages: int = 1200, *, group_pages: dict[str, int] | None = None, specs=SPECS, **options):
    """Most tests below work out the base checkpoint policy (latest, junction, interval)
    by hand, so prompt checkpoints are off unless a test turns them on, and checkpoints
    store whole windows (the V4 default stores less: tests at the end of this file)."""
    sizes = {s.group_id: pages for s in specs}
    sizes.update(group_pages or {})
    options.setdefault("prompt_checkpoints", False)
    options.setdefault("checkpoint_window_tokens", {s.group_id: s.sliding_window_tokens for s in specs if s.is_sliding})
    return CacheManager(specs, sizes, max_context_tokens=8192, enable_prefix_caching=True, **options)


def ids(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, count, dtype=np.int32)


def cat(*parts) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])


def prefill(mgr: CacheManager, rid: str, prompt_tokens: int, chunk_tokens: int = 2048) -> None:
    while (done := mgr.num_computed_tokens(rid)) < prompt_tokens:
        mgr.schedule([(rid, min(chunk_tokens, prompt_tokens - done))])


def decode(mgr: CacheManager, rid: str, output_ids: np.ndarray) -> None:
    """Feed every sampled id but the last one (the last sampled token is never fed back)."""
    for token in np.asarray(output_ids)[:-1].tolist():
        mgr.append_token_ids(rid, [token])
        mgr.schedule([(rid, 1)])


def run_request(mgr, rid, prompt, output_ids=(), *, chunk_tokens=2048, salt=None) -> PrefixHit:
    """Add, prefill, decode and free one request; returns its hit."""
    output_ids = np.asarray(output_ids, dtype=np.int32)
    hit = mgr.add_request(rid, prompt, max_new_tokens=max(len(output_ids), 1), cache_salt=salt)
    prefill(mgr, rid, len(prompt), chunk_tokens)
    if len(output_ids):
        decode(mgr, rid, output_ids)
    mgr.free(rid)
    mgr.check_invariants()
    return hit


def events_of(events, kind: str, gid: str) -> list[int]:
    """Prefix lengths (``tokens``) of the events of one kind and group, in order."""
    return [e.tokens for e in events if e.kind == kind and e.group_id == gid]


def stored_key(events, gid: str, tokens: int) -> int:
    (event,) = [e for e in events if e.kind == "stored" and e.group_id == gid and e.tokens == tokens]
    return int(event.block_hash, 16)


# --------------------------------------------------------------------------- sharing


def test_shared_system_prompt_is_borrowed_by_every_later_request():
    mgr = make_manager()
    system = ids(1, 1024)
    first_prompt = cat(system, ids(2, 60))  # 1,084 tokens, prefilled in one step
    assert mgr.add_request("first", first_prompt, max_new_tokens=8).hit_tokens == 0
    prefill(mgr, "first", 1084)
    # The first decode step commits the prefill: blocks 0..3 and a checkpoint at 1024 (the
    # latest boundary the step crossed). 7 fed tokens -> 1,091 computed, no newer boundary.
    decode(mgr, "first", ids(3, 8))
    assert mgr.num_computed_tokens("first") == 1091

    extra_tokens = [1, 5, 200, 900]  # prompts of 1,025 .. 1,924 tokens
    borrowed = {}
    for i, extra in enumerate(extra_tokens):
        hit = mgr.add_request(f"user{i}", cat(system, ids(10 + i, extra)), max_new_tokens=4)
        # Shared prefix 1,024 = 4 blocks; the first's checkpoint sits at exactly 1,024.
        assert hit.hit_tokens == 1024
        assert hit.group_hit_tokens == {g: 1024 for g in ALL}
        assert mgr.num_computed_tokens(f"user{i}") == 1024
        for gid in ALL:
            base, pages = mgr.request_pages(f"user{i}", gid)
            borrowed.setdefault(gid, (base, pages.tolist()))
            assert (base, pages.tolist()) == borrowed[gid], gid  # every user borrows the same pages
        mgr.check_invariants()

    # History: the 4 blocks are the first request's own pages, now held by 1 + 4 requests.
    for gid in HISTORY:
        _, first_pages = mgr.request_pages("first", gid)
        assert borrowed[gid] == (0, first_pages[:4].tolist())
        assert mgr.pools[gid].ref_counts[first_pages[:4]].tolist() == [5, 5, 5, 5]
    # State: the checkpoint is the window [1024 - W, 1024): swa 896..1023 = pages 14..15,
    # c4 states 1016..1023 = pages 254..255, c128 state 896..1023 = pages 112..127.
    expected_window = {SWA: (14, 2), C4S: (254, 2), C128S: (112, 16), IDX: (254, 2)}
    for gid, (base, count) in expected_window.items():
        assert borrowed[gid][0] == base and len(borrowed[gid][1]) == count, gid
        _, first_pages = mgr.request_pages("first", gid)
        still_held_by_first = np.isin(borrowed[gid][1], first_pages)
        refs = mgr.pools[gid].ref_counts[borrowed[gid][1]]
        assert (refs == 4 + still_held_by_first).all(), gid
    # The first request's swa window moved on to base (1090 - 127) // 64 = 15: it still holds
    # page 15 of the checkpoint but released page 14 (kept cached, then borrowed).
    assert mgr.request_pages("first", SWA)[0] == 15

    for i in range(len(extra_tokens)):
        mgr.free(f"user{i}")
        refs = mgr.pools[C4KV].ref_counts[borrowed[C4KV][1]]
        assert refs.tolist() == [4 - i] * 4
    mgr.check_invariants()

    # A prompt that is exactly the system prompt may hit at most 768 (its last token is
    # computed), and no state group has a checkpoint at 768: no hit; history alone says 768.
    hit = mgr.add_request("exact", system)
    assert hit.hit_tokens == 0
    assert {g: hit.group_hit_tokens[g] for g in HISTORY} == {C4KV: 768, C128KV: 768}
    assert {g: hit.group_hit_tokens[g] for g in STATE} == {g: 0 for g in STATE}
    assert hit.limiting_groups == list(STATE)

    stats = mgr.prefix.stats[C4KV]
    assert stats.lookups == 6
    assert stats.queried_tokens == 1084 + sum(1024 + e for e in extra_tokens) + 1024
    assert stats.hit_tokens == 4 * 1024
    assert stats.token_hit_rate == pytest.approx(4096 / stats.queried_tokens)
    assert mgr.prefix.stats[SWA].alone_hit_tokens == 4 * 1024
    assert mgr.prefix.stats[C4KV].alone_hit_tokens == 4 * 1024 + 768


def test_superseded_checkpoint_leaves_every_state_group_at_once():
    """A commit unpublishes the checkpoint it supersedes from every state group (one
    unit): one "removed" event per state group, in the groups' order, after the new one's
    "stored" events; the same events as "group-lru", where each group lets go of its own."""
    events = {}
    for policy in ("value", "group-lru"):
        mgr = make_manager(eviction_policy=policy)
        run_request(mgr, "a", ids(30, 899), chunk_tokens=256)  # committed 899: 256, 512, 768, a chunk's commit each
        events[policy] = [(e.kind, e.group_id, e.block_hash, e.parent_hash, e.tokens, e.num_pages)
                          for e in mgr.prefix.drain_events()]
    assert events["value"] == events["group-lru"]
    removed = [(e[1], e[4]) for e in events["value"] if e[0] == "removed"]
    assert removed == [(g, d) for d in (256, 512) for g in mgr.prefix.state_ids]
    assert sorted(mgr.prefix.state_ids) == sorted(STATE)
    state_events = [(e[0], e[4]) for e in events["value"] if e[1] in STATE and (e[0], e[4]) != ("stored", 256)]
    assert state_events == [("stored", 512)] * 4 + [("removed", 256)] * 4 + [("stored", 768)] * 4 + [
        ("removed", 512)] * 4


def test_multi_turn_chat_hits_each_turns_terminal_checkpoint():
    """The worked example of docs/prefix-caching.md."""
    mgr = make_manager()
    prompt0 = ids(20, 700)
    answer0 = ids(21, 100)
    # Turn 0: prefill 700 in one step; decode feeds 99 of its 100 answer tokens.
    # Committed: 700 + 100 - 1 = 799; terminal = 799 // 256 * 256 = 768.
    assert run_request(mgr, "turn0", prompt0, answer0).hit_tokens == 0
    ev0 = mgr.prefix.drain_events()
    assert events_of(ev0, "stored", C4KV) == [256, 512, 768]
    assert events_of(ev0, "stored", SWA) == [512, 768]  # prefill commit: latest boundary 512
    assert events_of(ev0, "removed", SWA) == [512]  # superseded when decode crossed 768

    prompt1 = cat(prompt0, answer0, ids(22, 80))  # 880 tokens
    answer1 = ids(23, 300)
    hit1 = run_request(mgr, "turn1", prompt1, answer1)
    assert hit1.hit_tokens == 768  # (700 + 100 - 1) // 256 * 256
    ev1 = mgr.prefix.drain_events()
    # Committed 880 + 300 - 1 = 1,179 -> terminal 1,024. Turn 0's 768 is not turn 1's own
    # checkpoint, so it stays.
    assert events_of(ev1, "stored", SWA) == [1024]
    assert events_of(ev1, "removed", SWA) == []
    assert events_of(ev1, "stored", C4KV) == [1024]

    prompt2 = cat(prompt1, answer1, ids(24, 50))  # 1,230 tokens
    hit2 = run_request(mgr, "turn2", prompt2, ids(25, 20))
    assert hit2.hit_tokens == 1024  # (880 + 300 - 1) // 256 * 256
    assert mgr.prefix.drain_events() == []  # 1,024 .. 1,249 crosses no boundary
    for gid in STATE:
        assert mgr.stats()[gid].cached_pages == {SWA: 2, C4S: 2, C128S: 16, IDX: 2}[gid] * 2
    assert mgr.stats()[C4KV].cached_pages == 4
    assert mgr.prefix.stats[C4KV].token_hit_rate == pytest.approx((768 + 1024) / (700 + 880 + 1230))


def test_prompt_diverging_inside_a_block_hits_at_the_previous_boundary():
    mgr = make_manager()
    base = ids(30, 800)
    run_request(mgr, "a", base)  # committed 800: blocks 0..2, terminal checkpoint at 768
    hit = mgr.add_request("b", cat(base[:790], ids(31, 110)))  # diverges at 790 in [768, 1024)
    assert hit.hit_tokens == 768
    mgr.free("b")
    # Diverging at 768 exactly: block [768, 1024) differs, block 2 and the checkpoint match.
    assert mgr.add_request("c", cat(base[:768], ids(32, 100))).hit_tokens == 768
    mgr.free("c")
    # Diverging at 700 (inside block 2): history stops at 512, and no checkpoint at 512 exists.
    hit = mgr.add_request("d", cat(base[:700], ids(33, 200)))
    assert hit.hit_tokens == 0
    assert hit.group_hit_tokens[C4KV] == 512 and hit.group_hit_tokens[SWA] == 0
    mgr.free("d")


def test_divergence_with_every_boundary_checkpointed():
    # Prefilling in 256-token steps makes every boundary the latest of its step; the interval
    # keeps them all.
    mgr = make_manager(state_checkpoint_interval=256)
    base = ids(35, 1100)
    run_request(mgr, "a", base, chunk_tokens=256)
    for diverge_at, expected in [(1099, 1024), (1000, 768), (768, 768), (767, 512), (300, 256), (255, 0)]:
        prompt = cat(base[:diverge_at], ids(36 + diverge_at, 50))
        prompt[diverge_at] = (base[diverge_at] + 1) % VOCAB if diverge_at < base.size else prompt[diverge_at]
        hit = mgr.add_request(f"p{diverge_at}", prompt)
        assert hit.hit_tokens == expected, diverge_at
        assert hit.group_hit_tokens == {g: expected for g in ALL}, diverge_at
        mgr.free(f"p{diverge_at}")
    mgr.check_invariants()


# --------------------------------------------------------------------------- state checkpoints


def test_hit_refused_when_interior_checkpoint_was_superseded():
    mgr = make_manager()
    base = ids(40, 1100)
    # 256-token steps: checkpoints at 256, 512, 768 are each superseded by the next; the
    # terminal is 1,024 (crossed by the step [768, 1024), committed by the next one).
    run_request(mgr, "a", base, chunk_tokens=256)
    ev = mgr.prefix.drain_events()
    assert events_of(ev, "stored", C128S) == [256, 512, 768, 1024]
    assert events_of(ev, "removed", C128S) == [256, 512, 768]
    hit = mgr.add_request("b", cat(base[:900], ids(41, 100)))
    assert hit.hit_tokens == 0
    assert hit.group_hit_tokens == {SWA: 0, C4S: 0, C4KV: 768, C128S: 0, C128KV: 768, IDX: 0}
    assert sorted(hit.limiting_groups) == sorted(STATE)


def test_interval_checkpoint_rescues_an_interior_hit():
    mgr = make_manager(state_checkpoint_interval=512)
    base = ids(40, 1100)
    run_request(mgr, "a", base, chunk_tokens=256)
    ev = mgr.prefix.drain_events()
    assert events_of(ev, "removed", C128S) == [256, 768]  # 512 is on the interval, 1,024 too
    hit = mgr.add_request("b", cat(base[:900], ids(41, 100)))
    assert hit.hit_tokens == 512
    assert hit.group_hit_tokens == {SWA: 512, C4S: 512, C4KV: 768, C128S: 512, C128KV: 768, IDX: 512}


def test_one_evicted_state_group_cuts_the_hit_and_is_named():
    # The c128 state pool is tight: a second, unrelated prefill evicts the first request's
    # terminal checkpoint there, and (with every pool evicting by its own LRU: the
    # "group-lru" policy) only there. The default policy's answer is the next test.
    mgr = make_manager(group_pages={C128S: 141}, eviction_policy="group-lru")  # 140 usable
    a = ids(50, 1100)
    run_request(mgr, "a", a)  # one step: 138 c128-state pages; checkpoint 1,024 = 16 pages
    assert mgr.stats()[C128S].cached_pages == 16
    run_request(mgr, "x", ids(51, 1100))  # needs 138: 124 clean free, then evicts
    assert mgr.stats()[C128S].evicted_pages == 16  # the whole 16-page checkpoint goes at once
    assert sum(mgr.stats()[g].evicted_pages for g in ALL if g != C128S) == 0
    hit = mgr.add_request("b", cat(a, ids(52, 10)))
    assert hit.hit_tokens == 0
    assert hit.group_hit_tokens == {SWA: 1024, C4S: 1024, C4KV: 1024, C128S: 0, C128KV: 1024, IDX: 1024}
    assert hit.limiting_groups == [C128S]


def test_hit_lies_below_where_the_state_groups_reach_when_they_disagree():
    """State groups that lost different checkpoints: the hit is the last boundary where
    every one holds a checkpoint, below the smallest reach (the match looks a state group
    up from its last block down, then tries boundaries from the smallest reach down)."""
    mgr = make_manager(prompt_checkpoints=True, eviction_policy="group-lru")
    a = ids(60, 1100)
    run_request(mgr, "a", a)  # prompt checkpoints at 256, 512, 768 and 1,024
    events = mgr.prefix.drain_events()
    mgr.pools[SWA].unpublish(stored_key(events, SWA, 1024))
    mgr.pools[C4S].unpublish(stored_key(events, C4S, 768))
    hit = mgr.add_request("b", cat(a, ids(61, 10)))
    assert hit.hit_tokens == 512  # swa reaches 768, the ratio-4 state 1,024 but not 768
    assert hit.group_hit_tokens == {SWA: 768, C4S: 1024, C4KV: 1024, C128S: 1024, C128KV: 1024, IDX: 1024}
    assert hit.limiting_groups == [] and hit.junction_tokens == 1024  # no group alone stops at 512
    assert mgr.request_pages("b", C4KV)[1].size == 2 and mgr.request_pages("b", SWA)[0] == (512 - 128) // 64


def test_value_policy_evicts_the_whole_checkpoint_and_demotes_its_history():
    # As above, default policy: the c128 state evicts a's terminal checkpoint (1,024; 16
    # pages); the checkpoint then leaves every state group ("unit": 2 + 2 + 2 window and
    # state pages), and a's history blocks 256..1,024, below no checkpoint any more,
    # become orphans (nothing is evicted in those pools: they have room).
    mgr = make_manager(group_pages={C128S: 141})
    a = ids(50, 1100)
    run_request(mgr, "a", a)
    run_request(mgr, "x", ids(51, 1100))
    report = mgr.prefix.value_report()
    assert report[C128S].evicted_pages["lru"] == 16
    assert {g: report[g].evicted_pages["unit"] for g in (SWA, C4S, IDX)} == {SWA: 2, C4S: 2, IDX: 2}
    # x's checkpoint (1,024) is the only usable one; its 4 blocks are the only usable history.
    assert {g: report[g].usable_entries for g in ALL} == {SWA: 1, C4S: 1, C128S: 1, IDX: 1, C4KV: 4, C128KV: 4}
    assert {g: report[g].cached_entries for g in HISTORY} == {C4KV: 8, C128KV: 8}  # a's 4 are orphans
    hit = mgr.add_request("b", cat(a, ids(52, 10)))
    assert hit.hit_tokens == 0
    assert hit.group_hit_tokens == {SWA: 0, C4S: 0, C4KV: 1024, C128S: 0, C128KV: 1024, IDX: 0}


def test_interval_keeps_checkpoints_crossed_while_decoding():
    def run(interval):
        mgr = make_manager(state_checkpoint_interval=interval)
        prompt, answer = ids(60, 300), ids(61, 900)
        run_request(mgr, "a", prompt, answer)  # committed 300 + 899 = 1,199
        return mgr, cat(prompt, answer)

    mgr, seq = run(512)
    ev = mgr.prefix.drain_events()
    # Boundaries 256 (prefill), then 512 and 1,024 (multiples of the interval) committed while decoding; 768 held
    # and let go, never published.
    assert events_of(ev, "stored", SWA) == [256, 512, 1024]
    assert events_of(ev, "removed", SWA) == [256]
    cases = {600: 512, 800: 512, 1100: 1024}  # shared tokens -> hit
    for shared, expected in cases.items():
        hit = mgr.add_request(f"s{shared}", cat(seq[:shared], ids(62, 40)))
        assert hit.hit_tokens == expected, shared
        mgr.free(f"s{shared}")

    mgr, seq = run(None)
    ev = mgr.prefix.drain_events()
    assert events_of(ev, "stored", SWA) == [256, 1024]  # 1,024 held, published by the free
    assert events_of(ev, "removed", SWA) == [256]
    hits = [mgr.add_request(f"t{n}", cat(seq[:n], ids(62, 40))).hit_tokens for n in (600, 800, 1100)]
    assert hits == [0, 0, 1024]


def test_interval_checkpoints_inside_one_prefill_step():
    # Fixed in 6d92c6c: a commit crossing several boundaries publishes every interval one.
    mgr = make_manager(state_checkpoint_interval=512)
    base = ids(70, 1100)
    run_request(mgr, "a", base)  # one 1,100-token step crosses 256 .. 1,024
    ev = mgr.prefix.drain_events()
    assert events_of(ev, "stored", SWA) == [512, 1024]  # 256 and 768: neither interval nor latest
    assert events_of(ev, "removed", SWA) == []
    assert mgr.add_request("b", cat(base[:600], ids(71, 10))).hit_tokens == 512
    assert mgr.add_request("c", cat(base[:1050], ids(71, 10))).hit_tokens == 1024


def test_junction_checkpoint_makes_a_shared_system_prompt_hit():
    """A request whose history reaches past its hit pins a checkpoint there (the junction)."""
    mgr = make_manager()
    system = ids(72, 1000)  # boundaries 256, 512, 768 lie inside it
    first = run_request(mgr, "r1", cat(system, ids(73, 100)))  # one step: only 1,024 is kept
    assert (first.hit_tokens, first.history_hit_tokens, first.junction_tokens) == (0, 0, 0)
    mgr.prefix.drain_events()
    second = run_request(mgr, "r2", cat(system, ids(74, 100)))
    # Blocks 0..2 are shared with r1, block 3 is not, and no checkpoint sits at 768.
    assert (second.hit_tokens, second.history_hit_tokens, second.junction_tokens) == (0, 768, 768)
    ev = mgr.prefix.drain_events()
    assert events_of(ev, "stored", SWA) == [768, 1024]  # the junction, then r2's terminal
    assert events_of(ev, "stored", C4KV) == [1024]  # blocks 0..2 were already cached
    for i in range(3, 6):
        hit = mgr.add_request(f"r{i}", cat(system, ids(72 + i * 10, 50)))
        assert (hit.hit_tokens, hit.junction_tokens) == (768, 0)


def test_terminal_survives_a_concurrent_request_with_the_same_prefix():
    # Two samples of one 600-token prompt (parallel sampling). "c" commits first, so it
    # publishes the checkpoint at 512; "a" finds it present. "a" answers 100 tokens (committed
    # 699, terminal 512); "c" decodes on past 768 and supersedes "its" 512.
    mgr = make_manager()
    prompt, answer_a, answer_c = ids(85, 600), ids(86, 100), ids(87, 300)
    mgr.add_request("c", prompt, max_new_tokens=300)
    mgr.add_request("a", prompt, max_new_tokens=100)
    mgr.schedule([("c", 600), ("a", 600)])
    for i in range(299):
        mgr.append_token_ids("c", answer_c[i : i + 1])
        items = [("c", 1)]
        if i < 99:
            mgr.append_token_ids("a", answer_a[i : i + 1])
            items.append(("a", 1))
        mgr.schedule(items)
        if i == 99:
            mgr.free("a")
    assert mgr.num_computed_tokens("c") == 899
    hit = mgr.add_request("a-turn2", cat(prompt, answer_a, ids(88, 50)))
    assert hit.group_hit_tokens[C4KV] == 512
    assert hit.hit_tokens == 512  # (600 + 100 - 1) // 256 * 256


def running_x_with_its_checkpoint_at_512(seed: int):
    """A manager running "x" (a 600-token prompt of ``ids(seed, 600)``, two tokens decoded,
    which commits its prefill: its own checkpoint at 512); the manager and the prompt."""
    mgr = make_manager()
    x = ids(seed, 600)
    mgr.add_request("x", x, max_new_tokens=300)
    prefill(mgr, "x", 600)
    decode(mgr, "x", ids(seed + 1, 2))
    return mgr, x


def test_terminal_survives_when_the_borrowed_checkpoint_is_superseded():
    # "x" is still running with its own checkpoint at 512; "y" hits it, answers 40 tokens
    # (committed 550 + 40 - 1 = 589, terminal 512) and finishes; then "x" crosses 768.
    mgr, x = running_x_with_its_checkpoint_at_512(97)
    y_prompt, y_answer = cat(x[:540], ids(99, 10)), ids(100, 40)
    assert run_request(mgr, "y", y_prompt, y_answer).hit_tokens == 512
    decode(mgr, "x", ids(101, 200))  # x: 601 + 199 = 800 computed, crosses 768
    hit = mgr.add_request("y-turn2", cat(y_prompt, y_answer, ids(102, 30)))
    assert hit.hit_tokens == 512  # (550 + 40 - 1) // 256 * 256


def test_the_last_hold_let_go_unpublishes_a_borrowed_checkpoint():
    # "y" hits "x"'s own checkpoint at 512 while "x" runs: both hold it. "x" crossing 768
    # (published by its free) leaves it to "y"; "y" doing so lets go of the last hold and it is unpublished.
    mgr, x = running_x_with_its_checkpoint_at_512(103)
    assert mgr.add_request("y", cat(x[:540], ids(105, 10)), max_new_tokens=300).hit_tokens == 512
    prefill(mgr, "y", 550)
    mgr.prefix.drain_events()
    decode(mgr, "x", ids(106, 200))  # x: 800 computed, crosses 768
    mgr.free("x")
    assert events_of(mgr.prefix.drain_events(), "removed", SWA) == []
    decode(mgr, "y", ids(107, 230))  # y: 779 computed, crosses 768
    mgr.free("y")
    assert events_of(mgr.prefix.drain_events(), "removed", SWA) == [512]
    mgr.check_invariants()


def test_the_last_hold_let_go_unpublishes_a_concurrently_computed_checkpoint():
    # Two samples of one prompt: "c" publishes the checkpoint at 512, "a" finds it there and
    # holds it too. It is unpublished once both have crossed 768 (and published it: freed), not before.
    mgr = make_manager()
    prompt = ids(108, 600)
    mgr.add_request("c", prompt, max_new_tokens=300)
    mgr.add_request("a", prompt, max_new_tokens=300)
    mgr.schedule([("c", 600), ("a", 600)])
    decode(mgr, "c", ids(109, 200))  # c: 799 computed, crosses 768 (and commits a's 600 tokens)
    mgr.free("c")
    assert events_of(mgr.prefix.drain_events(), "removed", SWA) == []
    decode(mgr, "a", ids(110, 200))
    mgr.free("a")
    assert events_of(mgr.prefix.drain_events(), "removed", SWA) == [512]
    mgr.check_invariants()


# Two groups whose checkpoint (one 4-token page) goes idle before its owner's next commit,
# as a V4 window of 128 tokens does inside a 256-token grain.
SMALL_SPECS = (
    CacheGroupSpec("kv", "full_history", 4, 1),
    CacheGroupSpec("swa", "sliding_window", 4, 1, sliding_window_tokens=4, family="state"),
)


def _small_manager(shared: bool, policy: str) -> CacheManager:
    options = dict(max_context_tokens=64, enable_prefix_caching=True, prefix_granularity=8,
                   prompt_checkpoints=False, eviction_policy=policy)
    if not shared:
        return CacheManager(SMALL_SPECS, {"kv": 200, "swa": 12}, **options)
    # kv pages are small: the arena runs out of slabs while kv has room and swa must evict.
    arena = arena_geometry({"kv": 8, "swa": 64}, 64 + 6 * 128, anchor_group="swa", slab_anchor_pages=2)
    return CacheManager(SMALL_SPECS, None, arena=arena, **options)


def _swa_events(mgr: CacheManager) -> list[tuple[str, int]]:
    return [(e.kind, e.tokens) for e in mgr.prefix.drain_events() if e.group_id == "swa"]


@pytest.mark.parametrize("policy", ["value", "group-lru"])
@pytest.mark.parametrize("shared", [False, True], ids=["pools", "arena"])
def test_a_lost_hold_is_not_dropped_from_a_republished_checkpoint(shared, policy):
    # "a" publishes its own checkpoint at 8 on page x, slides past it (x idle) and loses it to an
    # eviction; "b" computes the same prefix (its junction: the history reaches 8) and republishes
    # the key on the same page x. When "a" crosses 16 (held; published by its free) it must not let go of "b"'s
    # checkpoint.
    mgr = _small_manager(shared, policy)
    a = ids(110, 40)
    mgr.add_request("a", a[:10], max_new_tokens=30)
    mgr.schedule([("a", 10)])
    x = int(mgr.request_pages("a", "swa")[1][1])  # "a"'s page of tokens [4, 8)
    for t in range(10, 13):  # commits the checkpoint at 8; by 12 "a" no longer holds x
        mgr.append_token_ids("a", a[t:t + 1])
        mgr.schedule([("a", 1)])
    assert ("stored", 8) in _swa_events(mgr)
    fillers = []  # one page each until the checkpoint at 8 is evicted (x goes to the last filler)
    while not _swa_events(mgr):
        fillers.append(f"f{len(fillers)}")
        mgr.add_request(fillers[-1], ids(120 + len(fillers), 4), max_new_tokens=1)
        mgr.schedule([(fillers[-1], 4)])
    assert mgr.add_request("b", cat(a[:8], ids(111, 2)), max_new_tokens=10).hit_tokens == 0
    mgr.free(fillers[0])
    mgr.schedule([("b", 4)])
    mgr.free(fillers[-1])  # x, the one free page: "b"'s page of tokens [4, 8)
    mgr.schedule([("b", 4)])
    assert int(mgr.request_pages("b", "swa")[1][1]) == x
    mgr.free(fillers[1])
    mgr.schedule([("b", 1)])
    assert _swa_events(mgr) == [("stored", 8)]  # "b"'s, on page x
    for t in range(13, 17):
        mgr.append_token_ids("a", a[t:t + 1])
        mgr.schedule([("a", 1)])
    mgr.free("a")
    assert _swa_events(mgr) == [("stored", 16)]  # and no removal of "b"'s checkpoint
    mgr.check_invariants()
    mgr.free("b")
    assert mgr.add_request("c", cat(a[:8], ids(112, 3))).hit_tokens == 8


# --------------------------------------------------------------------------- the last token


def test_last_prompt_token_is_never_a_hit():
    mgr = make_manager(state_checkpoint_interval=256)
    a = ids(80, 600)
    run_request(mgr, "a", a, chunk_tokens=256)  # checkpoints at 256 and 512 (both kept)
    hit = mgr.add_request("exact512", a[:512])  # fully cached, but token 511 must be computed
    assert hit.hit_tokens == 256
    assert hit.group_hit_tokens == {g: 256 for g in ALL}
    assert mgr.add_request("p513", a[:513]).hit_tokens == 512
    assert mgr.add_request("p257", a[:257]).hit_tokens == 256
    assert mgr.add_request("p256", a[:256]).hit_tokens == 0
    assert mgr.add_request("p1", a[:1]).hit_tokens == 0


# --------------------------------------------------------------------------- speculative tokens


def test_rejected_draft_tokens_are_never_published():
    mgr = make_manager()
    prompt = ids(90, 250)
    drafts = ids(91, 8)  # 1 sampled + 7 drafts at positions 250..257, crossing 256
    mgr.add_request("a", prompt, max_new_tokens=100)
    prefill(mgr, "a", 250)
    mgr.append_token_ids("a", drafts)
    mgr.schedule([("a", 8)])  # commits [0, 250): no boundary
    mgr.rewind("a", 252)  # accept 2 (positions 250, 251)
    assert mgr.prefix.drain_events() == []
    accepted = ids(92, 48)
    mgr.append_token_ids("a", accepted[:1])
    mgr.schedule([("a", 1)])  # commits [250, 252): still no boundary
    assert mgr.prefix.drain_events() == []
    assert mgr.stats()[C4KV].cached_pages == 0

    # Continue with different ids past 256; the committed block 0 is the accepted content.
    mgr.append_token_ids("a", accepted[1:])
    mgr.schedule([("a", 47)])  # positions 253..299
    mgr.free("a")  # commits up to 300: block 0 and the checkpoint at 256
    ev = mgr.prefix.drain_events()
    assert events_of(ev, "stored", C4KV) == [256] and events_of(ev, "stored", SWA) == [256]
    seq = cat(prompt, drafts[:2], accepted)
    assert mgr.add_request("good", cat(seq[:280], [5])).hit_tokens == 256
    assert mgr.add_request("rejected", cat(prompt, drafts, ids(93, 30))).hit_tokens == 0
    assert mgr.add_request("rejected-tail", cat(seq[:255], drafts[5:])).hit_tokens == 0


@pytest.mark.parametrize("seed", range(3))
def test_blocks_hashed_at_append_are_keyed_by_the_ids_kept_through_rewinds(seed):
    """Appends hash the blocks they complete (``append_token_ids`` and ``_many``), drafts included; a rewind
    drops the hashes past the ids it keeps. Every stored key is still the hash of the ids each request kept."""
    rng, mgr, rids = np.random.default_rng(seed), make_manager(), ("a", "b")
    for n, rid in enumerate(rids):
        mgr.add_request(rid, ids(100 + 2 * seed + n, 200 + 37 * n), max_new_tokens=2000)
        prefill(mgr, rid, 200 + 37 * n)
    for step in range(40):
        k = int(rng.integers(1, 40))
        tokens = rng.integers(0, VOCAB, (len(rids), k), dtype=np.int32)
        if step % 2:
            mgr.append_token_ids_many(rids[::-1], tokens[::-1])
        else:
            for rid, row in zip(rids, tokens):
                mgr.append_token_ids(rid, row)
        mgr.schedule([(rid, k) for rid in rids])
        mgr.rewind_many([(rid, mgr.num_computed_tokens(rid) - int(rng.integers(0, k))) for rid in rids])
    want = set()
    for rid in rids:
        kept = mgr.known_token_ids(rid)
        hashes = mgr.prefix.prompt_hashes(cat(kept, [0]), None)
        want.update(hashes.key(end) for end in range(256, kept.size + 1, 256))
        mgr.free(rid)
    stored = mgr.prefix.drain_events()
    assert {int(e.block_hash, 16) for e in stored if e.kind == "stored" and e.group_id == C4KV} == want


def test_rewind_onto_a_boundary_commits_exactly_that_boundary():
    mgr = make_manager()
    prompt, drafts = ids(95, 250), ids(96, 10)
    mgr.add_request("a", prompt, max_new_tokens=20)
    prefill(mgr, "a", 250)
    mgr.append_token_ids("a", drafts)
    mgr.schedule([("a", 10)])  # 250..259
    mgr.rewind("a", 256)  # accept 6: exactly block 0
    mgr.free("a")
    ev = mgr.prefix.drain_events()
    assert events_of(ev, "stored", C4KV) == [256] and events_of(ev, "stored", C128S) == [256]
    assert mgr.add_request("b", cat(prompt, drafts[:6], [1, 2])).hit_tokens == 256
    assert mgr.add_request("c", cat(prompt, drafts[:5], [1, 2])).hit_tokens == 0


# --------------------------------------------------------------------------- eviction


def test_clean_free_pages_are_used_before_cached_ones():
    mgr = make_manager(group_pages={C4KV: 14, C128KV: 14})  # 13 usable history pages
    run_request(mgr, "a", ids(100, 1030))  # 5 pages per history group; blocks 0..3 cached
    st = mgr.stats()[C4KV]
    assert (st.cached_pages, st.evictable_pages, st.free_pages, st.used_pages) == (4, 4, 13, 0)
    run_request(mgr, "b", ids(101, 2300))  # needs 9 pages = exactly the 9 clean ones
    assert mgr.stats()[C4KV].evicted_pages == 0
    assert mgr.add_request("a2", cat(ids(100, 1030), [1])).hit_tokens == 1024


def test_eviction_under_pressure_is_lru_tail_first():
    mgr = make_manager(group_pages={C4KV: 14, C128KV: 14})  # 13 usable history pages
    a, b = ids(110, 1030), ids(111, 1030)
    run_request(mgr, "a", a)
    run_request(mgr, "b", b)
    # LRU order: a3 a2 a1 a0 b3 b2 b1 b0 (8 evictable); 5 clean free pages.
    assert mgr.stats()[C4KV].evictable_pages == 8 and mgr.prefix.drain_events()
    x = ids(112, 1793)  # 8 pages: 5 clean + 3 evicted: a3, a2, a1
    mgr.add_request("x", x)
    assert mgr.check_admission([("x", 1793)])[0].ok  # evictable pages count as credit
    mgr.schedule([("x", 1793)])
    for gid in HISTORY:
        assert mgr.stats()[gid].evicted_pages == 3
    ev = mgr.prefix.drain_events()
    assert events_of(ev, "removed", C4KV) == [1024, 768, 512]  # tail of a's chain first
    # Block 1,024 gone, a's checkpoint there is useless: it leaves every state group too.
    assert events_of(ev, "removed", SWA) == [1024]
    removed_keys = [e.block_hash for e in ev if e.kind == "removed" and e.group_id == C4KV]
    assert len(set(removed_keys)) == 3
    hit_a = mgr.add_request("a2", cat(a, [7]))
    assert hit_a.group_hit_tokens[C4KV] == 256 and hit_a.hit_tokens == 0
    assert mgr.add_request("b2", cat(b, [7])).hit_tokens == 1024  # b's chain untouched
    mgr.check_invariants()


def test_borrowed_pages_are_never_evicted():
    mgr = make_manager(group_pages={C4KV: 9, C128KV: 9})  # 8 usable history pages
    a = ids(120, 1030)
    run_request(mgr, "a", a)  # blocks 0..3 cached
    assert mgr.add_request("a2", cat(a, ids(121, 10))).hit_tokens == 1024  # borrows them
    mgr.schedule([("a2", 16)])  # [1024, 1040): one own page -> 5 held, 3 free, 0 evictable
    _, held = mgr.request_pages("a2", C4KV)
    borrowed = held[:4].copy()
    mgr.add_request("x", ids(122, 1030))
    answer = mgr.check_admission([("x", 1030)])[0]
    assert not answer.ok and "compressed_kv" in answer.reason and "3 free or evictable" in answer.reason
    with pytest.raises(CacheManagerError):
        mgr.schedule([("x", 1030)])
    assert mgr.pools[C4KV].ref_counts[borrowed].tolist() == [1, 1, 1, 1]
    assert mgr.pools[C4KV].cached[borrowed].all()
    mgr.schedule([("x", 768)])  # 3 pages: exactly the clean ones
    assert mgr.stats()[C4KV].evicted_pages == 0
    assert not mgr.check_admission([("x", 262)])[0].ok  # 2 more pages, nothing free or evictable
    mgr.free("a2")  # a0..a3 evictable again, a2's own page clean
    mgr.schedule([("x", 262)])  # 1 clean + evicts a3
    assert mgr.stats()[C4KV].evicted_pages == 1
    assert events_of(mgr.prefix.drain_events(), "removed", C4KV)[-1:] == [1024]
    mgr.check_invariants()


# --------------------------------------------------------------------------- keys


def test_salt_isolates_identical_prompts():
    mgr = make_manager()
    a = ids(130, 600)
    run_request(mgr, "alice", a, salt="alice")
    assert mgr.add_request("bob", cat(a, [1]), cache_salt="bob").hit_tokens == 0
    assert mgr.add_request("nobody", cat(a, [1])).hit_tokens == 0
    assert mgr.add_request("alice2", cat(a, [1]), cache_salt="alice").hit_tokens == 512
    assert mgr.add_request("alice-bytes", cat(a, [1]), cache_salt=b"alice").hit_tokens == 512


def test_bad_salt_type_is_rejected_without_registering_the_request():
    mgr = make_manager()
    with pytest.raises(ValueError, match="cache_salt"):
        mgr.add_request("r", ids(1, 10), cache_salt=5)
    assert not mgr.has_request("r") and mgr.num_requests == 0


@pytest.mark.parametrize("salt", [0, 0.0, [], False, 5])
def test_non_string_salt_is_rejected(salt):
    mgr = make_manager()
    with pytest.raises(ValueError, match="cache_salt"):
        mgr.add_request("r", ids(1, 10), cache_salt=salt)
    assert not mgr.has_request("r")


def _expected_keys(algo: str, salt: bytes, tokens: np.ndarray, blocks: int) -> list[str]:
    """Block keys recomputed independently: h[-1] = H(root tag + salt), h[b] = H(h[b-1] || block b)."""
    if algo == "xxh3_128":
        digest = xxhash.xxh3_128_intdigest
    else:
        def digest(data):
            return int.from_bytes(hashlib.sha256(data).digest()[:16], "little")
    parent = digest(b"hybridkv-prefix-root\x00" + salt)
    out = []
    for b in range(blocks):
        block = tokens[b * 256 : (b + 1) * 256].astype("<i4").tobytes()
        parent = digest(parent.to_bytes(16, "little") + block)
        out.append(f"{parent:032x}")
    return out


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_hash_algorithms_give_the_same_hits_and_documented_keys(algo):
    mgr = make_manager(hash_algo=algo)
    a = ids(140, 600)
    run_request(mgr, "a", a, salt="s")
    ev = mgr.prefix.drain_events()
    keys = [e.block_hash for e in ev if e.kind == "stored" and e.group_id == C4KV]
    assert keys == _expected_keys(algo, b"s", a, 2)
    assert [e.parent_hash for e in ev if e.kind == "stored" and e.group_id == C4KV][1] == keys[0]
    assert stored_key(ev, SWA, 512) == int(keys[1], 16)  # a checkpoint is named by its prefix key
    assert mgr.add_request("b", cat(a, [3]), cache_salt="s").hit_tokens == 512
    assert mgr.add_request("c", cat(a, [3])).hit_tokens == 0


def test_default_and_sha256_keys_differ():
    a = ids(141, 300)
    assert _expected_keys("xxh3_128", b"", a, 1) != _expected_keys("sha256", b"", a, 1)


# --------------------------------------------------------------------------- events and stats


def test_events_json_lines_round_trip():
    mgr = make_manager()
    a = ids(150, 600)
    run_request(mgr, "a", a, chunk_tokens=256)  # checkpoints 256 (removed), 512 (terminal)
    mgr.clear_prefix_cache()
    stream = io.StringIO()
    written = mgr.prefix.write_events_jsonl(stream)
    lines = stream.getvalue().splitlines()
    assert written == len(lines) > 0
    records = [json.loads(line) for line in lines]
    fields = {"kind", "group_id", "block_hash", "parent_hash", "tokens", "num_pages"}
    assert all(set(r) == fields for r in records)
    assert [CacheEvent(**r) for r in records][0].to_json() == lines[0]
    # Every stored key is removed exactly once afterwards (superseded, then the clear).
    def entries(gid, kind):
        return [(r["block_hash"], r["tokens"]) for r in records if r["group_id"] == gid and r["kind"] == kind]

    for gid in ALL:
        stored = entries(gid, "stored")
        assert sorted(stored) == sorted(entries(gid, "removed")), gid
        for key, _ in stored:
            kinds = [r["kind"] for r in records if r["group_id"] == gid and r["block_hash"] == key]
            assert kinds == ["stored", "removed"], (gid, key)
    swa = [(r["kind"], r["tokens"], r["num_pages"]) for r in records if r["group_id"] == SWA]
    # A newer checkpoint is stored before the one it supersedes is removed.
    assert swa == [("stored", 256, 2), ("stored", 512, 2), ("removed", 256, 2), ("removed", 512, 2)]
    c4kv = [r for r in records if r["group_id"] == C4KV and r["kind"] == "stored"]
    assert c4kv[0]["parent_hash"] is not None and c4kv[1]["parent_hash"] == c4kv[0]["block_hash"]
    assert mgr.prefix.write_events_jsonl(io.StringIO()) == 0  # drained


def test_on_event_callback_receives_events_instead_of_the_buffer():
    seen: list[CacheEvent] = []
    mgr = make_manager(on_event=seen.append)
    run_request(mgr, "a", ids(160, 300))
    assert [(e.kind, e.group_id, e.tokens) for e in seen if e.group_id in (C4KV, SWA)] == [
        ("stored", C4KV, 256),
        ("stored", SWA, 256),
    ]
    assert len(seen) == 6  # one block per history group, one checkpoint per state group
    assert mgr.prefix.drain_events() == []
    assert mgr.prefix.stats[C128S].stored_entries == 1


def test_free_then_clear_returns_every_pool_to_full():
    mgr = make_manager()
    prompt, answer = ids(170, 1500), ids(171, 40)
    run_request(mgr, "a", prompt, answer)  # committed 1,539 -> blocks 0..5, terminal 1,536
    assert mgr.add_request("b", cat(prompt, answer[:39], [1, 2])).hit_tokens == 1536
    assert sum(mgr.stats()[g].cached_pages for g in ALL) > 0
    mgr.clear_prefix_cache()  # held (borrowed) pages stay held, lose their keys
    mgr.check_invariants()
    mgr.free("b")
    for gid, st in mgr.stats().items():
        assert st.free_pages == st.total_pages == 1199 and st.cached_pages == 0, gid
    ev = mgr.prefix.drain_events()
    assert len(events_of(ev, "removed", C4KV)) == len(events_of(ev, "stored", C4KV)) == 6


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "options, message",
    [
        ({"prefix_granularity": 320}, "multiple of group"),  # not a multiple of 256
        ({"prefix_granularity": 128}, "multiple of group"),
        ({"prefix_granularity": 0}, "positive"),
        ({"prefix_granularity": -256}, "positive"),
        ({"state_checkpoint_interval": 0}, "state_checkpoint_interval"),
        ({"state_checkpoint_interval": 300}, "state_checkpoint_interval"),
        ({"state_checkpoint_interval": -512}, "state_checkpoint_interval"),
        ({"prefix_granularity": 512, "state_checkpoint_interval": 256}, "state_checkpoint_interval"),
        ({"hash_algo": "md5"}, "hash_algo"),
    ],
)
def test_invalid_prefix_config_raises(options, message):
    with pytest.raises(ValueError, match=message):
        make_manager(**options)


def test_grain_smaller_than_a_window_raises():
    # A 64-token-page group set with a 128-token window: grain 64 divides every page but
    # checkpoints at 64-token boundaries would overlap.
    specs = (
        CacheGroupSpec("kv", "full_history", 64, 1),
        CacheGroupSpec("win", "sliding_window", 64, 1, sliding_window_tokens=128, family="state"),
    )
    with pytest.raises(ValueError, match="window"):
        make_manager(specs=specs, prefix_granularity=64)
    assert make_manager(specs=specs, prefix_granularity=128).prefix.granularity_tokens == 128


def test_default_and_explicit_grains():
    assert make_manager().prefix.granularity_tokens == 256
    mgr = make_manager(prefix_granularity=512, state_checkpoint_interval=1024)
    assert (mgr.prefix.granularity_tokens, mgr.prefix.state_checkpoint_interval) == (512, 1024)
    a = ids(180, 1100)
    run_request(mgr, "a", a)
    assert mgr.add_request("b", cat(a[:1050], [1])).hit_tokens == 1024
    assert mgr.add_request("c", cat(a[:1000], [1])).hit_tokens == 0  # no checkpoint at 512


@pytest.mark.parametrize("value", [256.5, 256.0, "256", True])
def test_non_integer_grain_is_rejected(value):
    with pytest.raises(ValueError, match="prefix_granularity"):
        make_manager(prefix_granularity=value)


@pytest.mark.parametrize("value", [512.9, 512.0, "512", True])
def test_non_integer_interval_is_rejected(value):
    with pytest.raises(ValueError, match="state_checkpoint_interval"):
        make_manager(state_checkpoint_interval=value)


def test_numpy_integer_grain_is_accepted():
    assert make_manager(prefix_granularity=np.int64(512)).prefix.granularity_tokens == 512


# --------------------------------------------------------------------------- real model specs


@pytest.mark.parametrize("model", ["deepseek-v4-flash", "deepseek-v4-pro"])
def test_bundled_v4_models_hit_at_the_terminal(model):
    specs = cache_layout(model).specs
    mgr = make_manager(specs=specs)
    assert mgr.prefix.granularity_tokens == 256
    prompt0, answer0 = ids(190, 1500), ids(191, 200)
    run_request(mgr, "t0", prompt0, answer0)  # committed 1,699 -> terminal 1,536
    hit = mgr.add_request("t1", cat(prompt0, answer0, ids(192, 100)), max_new_tokens=1)
    assert hit.hit_tokens == 1536
    assert hit.group_hit_tokens == {s.group_id: 1536 for s in specs}
    prefill(mgr, "t1", 1800)
    mgr.free("t1")
    mgr.check_invariants()


# --------------------------------------------------------------------------- a workload


def test_multiturn_workload_hits_follow_the_rules():
    """A small run of the study in bench/prefix_study.py, checked request by request."""
    from hybridkv.sim.workloads import LengthDistribution, ideal_hit_tokens, multiturn_workload

    answers = LengthDistribution(median_tokens=64, sigma=0.5, min_tokens=16, max_tokens=256)
    requests = multiturn_workload(6, 3, seed=3, answer_lengths=answers)
    mgr = make_manager(pages=4096, group_pages={C4KV: 1024, C128KV: 1024})
    hits = {
        r.request_id: run_request(mgr, r.request_id, r.prompt_token_ids, r.output_token_ids).hit_tokens
        for r in requests
    }
    by_id = {r.request_id: r for r in requests}
    for r in requests:
        if r.turn == 0:
            # conv0 finds nothing; conv1 shares the 2,000-token system prompt with conv0 but no
            # checkpoint sits inside it, so it pins the junction 1,792 = 2000 // 256 * 256;
            # every later first turn hits there.
            expected = {"conv0000": 0, "conv0001": 0}.get(r.conversation_id, 1792)
        else:
            prev = by_id[r.after_request_id]
            expected = (prev.prompt_tokens + prev.output_tokens - 1) // 256 * 256  # its terminal
        assert hits[r.request_id] == expected, r.request_id
    ideal = ideal_hit_tokens(requests, grain_tokens=256)
    got = np.array([hits[r.request_id] for r in requests])
    assert (got <= ideal).all()
    assert int((ideal - got).sum()) == 1792  # only conv1's first turn misses the ideal
    assert mgr.stats()[C4KV].evicted_pages == 0


# --- prompt checkpoints (an option, off by default) ---------------------------------------------------
def test_prompt_checkpoints_keep_every_boundary_inside_the_prompt():
    mgr = make_manager(prompt_checkpoints=True)
    base = ids(40, 1100)
    run_request(mgr, "a", base, chunk_tokens=256)
    ev = mgr.prefix.drain_events()
    # 256, 512, 768 are superseded as a's latest checkpoint but lie inside its prompt:
    # demoted to low priority, not removed. The same prompt with the base policy removes them.
    assert events_of(ev, "stored", C128S) == [256, 512, 768, 1024]
    assert events_of(ev, "removed", C128S) == []
    key_512 = stored_key(ev, C128S, 512)
    assert mgr.pools[C128S].low_priority[list(mgr.pools[C128S].lookup(key_512))].all()
    hit = mgr.add_request("b", cat(base[:900], ids(41, 100)))
    assert hit.hit_tokens == 768 and hit.group_hit_tokens == {g: 768 for g in ALL}
    mgr.check_invariants()


def test_prompt_checkpoints_inside_one_prefill_step_and_not_past_the_prompt():
    mgr = make_manager(prompt_checkpoints=True)
    prompt = ids(50, 700)
    # One 700-token step: its commit publishes 256 (inside the prompt, unheld, low priority)
    # and 512 (the latest, held). Decoding to 1,100 crosses 768 and 1,024 past the prompt:
    # plain latest checkpoints, held in turn; the free publishes 1,024 and demotes 512.
    run_request(mgr, "a", prompt, ids(51, 400), chunk_tokens=2048)
    ev = mgr.prefix.drain_events()
    assert events_of(ev, "stored", SWA) == [256, 512, 1024]
    assert events_of(ev, "removed", SWA) == []
    pool = mgr.pools[SWA]
    assert pool.low_priority[list(pool.lookup(stored_key(ev, SWA, 256)))].all()
    assert pool.low_priority[list(pool.lookup(stored_key(ev, SWA, 512)))].all()  # demoted
    assert not pool.low_priority[list(pool.lookup(stored_key(ev, SWA, 1024)))].any()
    hit = mgr.add_request("b", cat(prompt[:300], ids(52, 10)))
    assert hit.hit_tokens == 256
    mgr.check_invariants()


def test_prompt_checkpoints_of_one_step_hold_each_boundarys_window_pages():
    """One 1,100-token step publishes 256, 512 and 768 (prompt checkpoints, batched) and
    1,024 (the latest); each entry names exactly the pages that held ``[D - W, D)``."""
    mgr = make_manager(prompt_checkpoints=True)
    mgr.add_request("a", ids(60, 1100), max_new_tokens=4)
    batch = mgr.schedule([("a", 1100)])
    assert all(batch.groups[g].base_pages.tolist() == [0] for g in STATE)
    mgr.append_token_ids("a", [7])
    mgr.schedule([("a", 1)])  # commits the 1,100 tokens
    ev = mgr.prefix.drain_events()
    for spec in SPECS:
        gid = spec.group_id
        if gid not in STATE:
            continue
        table = batch.groups[gid].block_table[0]
        t, w = spec.page_tokens, spec.sliding_window_tokens
        assert events_of(ev, "stored", gid) == [256, 512, 768, 1024]
        for d in (256, 512, 768, 1024):
            want = tuple(table[max(0, d - w) // t : d // t].tolist())
            assert mgr.pools[gid].lookup(stored_key(ev, gid, d)) == want, (gid, d)
    mgr.check_invariants()


def test_low_priority_entries_are_evicted_before_older_ones():
    pool = PagePool("g", 8)
    old = allocate(pool, 2)
    new = allocate(pool, 2)
    assert publish(pool, "old", old) and publish(pool, "new", new, low_priority=True)
    decref(pool, old)
    decref(pool, new)  # LRU order would evict "old" first; low priority goes ahead of it
    allocate(pool, 5)  # 3 clean + 2 evicted
    assert pool.lookup("new") is None and pool.lookup("old") == tuple(old.tolist())
    # demote moves an entry that is already idle to the front as well
    pool2 = PagePool("g", 8)
    a, b = allocate(pool2, 2), allocate(pool2, 2)
    publish(pool2, "a", a), publish(pool2, "b", b)
    decref(pool2, a), decref(pool2, b)
    pool2.demote("b")
    allocate(pool2, 5)
    assert pool2.lookup("b") is None and pool2.lookup("a") is not None
    pool.check_invariants(), pool2.check_invariants()


def test_multiturn_workload_reaches_the_256_grain_bound_with_prompt_checkpoints():
    """The study of bench/prefix_study.py, small: with prompt checkpoints every request
    hits the ideal 256-grain boundary (conv1's first turn included)."""
    from hybridkv.sim.workloads import LengthDistribution, ideal_hit_tokens, multiturn_workload

    answers = LengthDistribution(median_tokens=64, sigma=0.5, min_tokens=16, max_tokens=256)
    requests = multiturn_workload(6, 3, seed=3, answer_lengths=answers)
    mgr = make_manager(pages=4096, group_pages={C4KV: 1024, C128KV: 1024}, prompt_checkpoints=True)
    got = np.array([
        run_request(mgr, r.request_id, r.prompt_token_ids, r.output_token_ids).hit_tokens for r in requests
    ])
    assert got.tolist() == ideal_hit_tokens(requests, grain_tokens=256).tolist()
    mgr.check_invariants()


# --------------------------------------------------------------------------- V4 checkpoint windows
V4_WINDOWS = {SWA: 128, C4S: 4, C128S: 0, IDX: 4}


def test_v4_checkpoint_windows_follow_what_a_resumed_request_reads():
    """Window KV: token D attends to [D-127, D], the whole window. Ratio 4 overlaps:
    the entry closing at D+3 pools the first halves of window [D-4, D). Ratio 128
    pools only its own window, which starts at D. Unknown sliding groups keep theirs."""
    from hybridkv.models.deepseek_v4 import v4_checkpoint_window_tokens
    from hybridkv.spec import CacheGroupSpec

    assert v4_checkpoint_window_tokens(SPECS) == V4_WINDOWS
    other = CacheGroupSpec("mine", "sliding_window", 8, 1, sliding_window_tokens=32, family="state")
    assert v4_checkpoint_window_tokens([*SPECS, other])["mine"] == 32
    # A verify width of 6 widens the ratio-4 state window to 10; a resume still needs 4.
    wide = tuple(build_v4_cache_specs(SimpleNamespace(sliding_window=128), layer_ratio=[0, 4, 128],
                                      speculative_tokens=6))
    assert {s.group_id: s.sliding_window_tokens for s in wide if s.is_sliding}[C4S] == 10
    assert v4_checkpoint_window_tokens(wide)[C4S] == 4
    assert CacheManager(SPECS, {s.group_id: 64 for s in SPECS}, max_context_tokens=4096,
                        enable_prefix_caching=True).prefix.checkpoint_windows == {
        gid: tokens for gid, tokens in V4_WINDOWS.items() if tokens}  # a group storing no rows stores no checkpoint


def test_v4_checkpoints_store_only_what_a_resume_reads_and_hit_the_same():
    """A terminal checkpoint at 768 holds 2 SWA pages (tokens 640..767), 1 page of each
    ratio-4 state (764..767) and nothing for the ratio-128 state: 4 pages instead of
    2 + 2 + 16 + 2 = 22. The next turn hits at 768 as with whole windows, and its rows
    restart there: the HCA state row is empty (base = hi = 768 / 8 = 96)."""
    mgr = make_manager(checkpoint_window_tokens=None)  # the V4 default
    prompt0, answer0 = ids(20, 700), ids(21, 100)
    assert run_request(mgr, "turn0", prompt0, answer0).hit_tokens == 0
    ev0 = mgr.prefix.drain_events()
    assert events_of(ev0, "stored", C128S) == []  # never checkpointed
    stored = {g: [e.num_pages for e in ev0 if e.kind == "stored" and e.group_id == g] for g in (SWA, C4S, IDX)}
    assert stored == {SWA: [2, 2], C4S: [1, 1], IDX: [1, 1]}  # prefill commit at 512, then 768
    assert mgr.pools[C128S].num_cached_pages == 0
    cached_state = sum(mgr.pools[g].num_cached_pages for g in STATE)
    assert cached_state == 2 + 1 + 1  # only the terminal at 768 is left (512 superseded)

    prompt1 = cat(prompt0, answer0, ids(22, 80))  # 880 tokens
    hit = mgr.add_request("turn1", prompt1, max_new_tokens=40)
    assert hit.hit_tokens == 768
    assert hit.group_hit_tokens[C128S] == 768  # (880 - 1) // 256 * 256: never limiting
    pages = {g: mgr.request_pages("turn1", g) for g in STATE}
    assert {g: (int(base), ids_.size) for g, (base, ids_) in pages.items()} == {
        SWA: (10, 2), C4S: (191, 1), IDX: (191, 1), C128S: (96, 0)}
    prefill(mgr, "turn1", 880)
    decode(mgr, "turn1", ids(23, 40))
    mgr.check_invariants()
    mgr.free("turn1")
    mgr.check_invariants()


def test_v4_checkpoint_windows_hit_like_whole_windows_on_a_multiturn_workload():
    """Storing less changes no hit: the same workload, the same hit per request."""
    from hybridkv.sim.workloads import multiturn_workload

    hits = []
    for windows in (None, {s.group_id: s.sliding_window_tokens for s in SPECS if s.is_sliding}):
        mgr = make_manager(pages=4096, group_pages={C4KV: 1024, C128KV: 1024}, checkpoint_window_tokens=windows)
        run = []
        for item in multiturn_workload(6, 3, system_prompt_tokens=600, seed=4):
            run.append(run_request(mgr, item.request_id, item.prompt_token_ids, item.output_token_ids).hit_tokens)
        hits.append(run)
    assert hits[0] == hits[1] and sum(hits[0]) > 0


@pytest.mark.parametrize("windows, message", [
    ({C4KV: 4}, "is not a sliding group"),
    ({C4S: 9}, "exceeds the group's window"),
    ({C4S: -1}, "checkpoint_window_tokens"),
    ({C4S: 2.5}, "checkpoint_window_tokens"),
])
def test_bad_checkpoint_windows_are_refused(windows, message):
    with pytest.raises(ValueError, match=message):
        make_manager(checkpoint_window_tokens=windows)


def test_event_buffer_drops_the_oldest_and_counts_them():
    """A full buffer keeps the newest events; every dropped one is counted; with a
    callback, events go to it and nothing is buffered. Managers run the same requests:
    one with the default buffer (every event), some with room for a few (a bound that
    cuts a commit's events short, too), one with a callback."""

    def run(mgr):
        for i in range(2):  # each: a 700-token prompt in 3 chunks, then freed (commits, frees)
            mgr.add_request(f"r{i}", ids(i, 700), max_new_tokens=4)
            for n in (256, 256, 188):
                mgr.schedule([(f"r{i}", n)])
            mgr.free(f"r{i}")

    bounds = (0, 1, 3, 7)
    whole, told, *small = [make_manager() for _ in range(2 + len(bounds))]
    for mgr, bound in zip(small, bounds):
        mgr.prefix.max_buffered_events = bound
    seen = []
    told.prefix.on_event = seen.append
    for mgr in (whole, told, *small):
        run(mgr)
    every = whole.prefix.drain_events()
    assert len(every) > max(bounds) and whole.prefix.dropped_events == 0
    for mgr, bound in zip(small, bounds):
        assert mgr.prefix.drain_events() == every[len(every) - bound:]
        assert mgr.prefix.dropped_events == len(every) - bound
    assert seen == every and not told.prefix.drain_events() and told.prefix.dropped_events == 0



@pytest.mark.parametrize("bound", [-1, 2.5, True, "10", None])
def test_a_bad_event_buffer_bound_is_refused_and_the_old_one_kept(bound):
    mgr = make_manager()
    mgr.prefix.max_buffered_events = 3
    with pytest.raises(ValueError, match="max_buffered_events must be"):
        mgr.prefix.max_buffered_events = bound
    assert mgr.prefix.max_buffered_events == 3
    mgr.add_request("r", ids(0, 700), max_new_tokens=4)
    for n in (256, 256, 188):
        mgr.schedule([("r", n)])
    mgr.free("r")  # blocks and checkpoints published, then removals: more events than 3
    assert len(mgr.prefix.drain_events()) == 3 and mgr.prefix.dropped_events > 0


def test_a_callback_that_is_not_callable_is_refused_and_the_old_one_kept():
    """``on_event`` is called inside a step: a value that cannot be called is refused when set, not mid-step."""
    mgr, seen = make_manager(), []
    mgr.prefix.on_event = seen.append
    with pytest.raises(ValueError, match="on_event must be callable"):
        mgr.prefix.on_event = 5
    assert mgr.prefix.on_event == seen.append
    mgr.add_request("r", ids(0, 700), max_new_tokens=4)
    for n in (256, 256, 188):
        mgr.schedule([("r", n)])
    assert seen and not mgr.prefix.drain_events()
    told = len(seen)
    mgr.prefix.on_event = None  # back to the buffer
    mgr.add_request("s", ids(1, 300), max_new_tokens=4)
    for n in (256, 44):
        mgr.schedule([("s", n)])
    assert mgr.prefix.drain_events() and len(seen) == told

def test_block_hashes_do_not_depend_on_the_token_array_layout():
    """The same tokens hash the same from the manager's int32 buffer, an int64 array,
    a big-endian array and a strided view (blocks are hashed as little-endian int32)."""
    from hybridkv.prefix.cache import RequestHashes

    tokens = np.random.default_rng(3).integers(0, 2**31 - 1, 600)
    layouts = [tokens.astype(np.int32), tokens.astype(np.int64), tokens.astype(">i4"),
               np.repeat(tokens.astype(np.int32), 2)[::2]]
    chains = []
    for ids in layouts:
        h = RequestHashes(7, 256, xxhash.xxh3_128_intdigest)
        h.extend_to(ids, 300)  # one block
        h.extend_to(ids, 600)  # the second
        chains.append(h.hashes)
    assert len(chains[0]) == 2
    assert all(c == chains[0] for c in chains)
    expected = xxhash.xxh3_128_intdigest((7).to_bytes(16, "little") + tokens[:256].astype("<i4").tobytes())
    assert chains[0][0] == expected


def test_block_hashes_one_block_a_call_match_many_at_once():
    """Extending a block a call (a decode commit's path) gives the chain one call over every block gives."""
    from hybridkv.prefix.cache import RequestHashes

    tokens = np.random.default_rng(4).integers(0, 2**31 - 1, 1100)
    for ids in (tokens.astype(np.int32), tokens.astype(">i4"), np.repeat(tokens.astype(np.int32), 2)[::2]):
        one, many = RequestHashes(7, 256, xxhash.xxh3_128_intdigest), RequestHashes(7, 256, xxhash.xxh3_128_intdigest)
        for end in range(0, 1101, 50):
            one.extend_to(ids, end)
        many.extend_to(ids, 1100)
        assert len(many.hashes) == 4 and one.hashes == many.hashes


def test_every_complete_prompt_block_is_hashed_when_added_so_commits_never_hash(monkeypatch):
    """A prompt's complete blocks (its last one too, when the prompt ends on a block) are hashed by
    ``prepare_prompt`` / ``add_request``, an output block by the append that completes it: no commit hashes."""
    from hybridkv.prefix.cache import RequestHashes

    mgr = make_manager()
    assert len(mgr.prefix.prompt_hashes(ids(6, 512), None).hashes) == 2
    assert len(mgr.prefix.prompt_hashes(ids(6, 511), None).hashes) == 1
    extend, in_schedule, hashed = RequestHashes.extend_to, [False], []

    def watched(self, token_ids, num_tokens):
        before = len(self.hashes)
        extend(self, token_ids, num_tokens)
        if in_schedule[0] and len(self.hashes) > before:
            hashed.append(len(self.hashes))

    def schedule(items, inner=mgr.schedule):
        in_schedule[0] = True
        try:
            return inner(items)
        finally:
            in_schedule[0] = False

    monkeypatch.setattr(RequestHashes, "extend_to", watched)
    mgr.schedule = schedule
    for n, rid in zip((512, 768, 700, 256), "abcd"):
        prompt = ids(7 + n, n)
        mgr.add_request(rid, mgr.prepare_prompt(prompt, max_new_tokens=300) if rid in "ac" else prompt,
                        max_new_tokens=0 if rid in "ac" else 300)
        run = ids(8 + n, 300)
        prefill(mgr, rid, n, 300)
        decode(mgr, rid, run)
        mgr.free(rid)  # publishes the blocks decoding completed
    assert not hashed
    assert mgr.prefix.stats[C4KV].stored_entries == (512 + 300 - 1) // 256 + (768 + 299) // 256 + (999 // 256) + 2


@pytest.mark.parametrize("policy", ["prompt-boundaries", "prefill-per-byte"])
def test_every_removal_names_what_its_publication_named(policy):
    """A commit keeps an entry's parent key and boundary once per key for every group:
    each "removed" event (superseded, evicted, unit, orphan) carries the parent, tokens
    and pages of the "stored" event that published that key in that group."""
    events: list[CacheEvent] = []
    mgr = make_manager(group_pages={C4KV: 24, C128KV: 24, SWA: 40}, prompt_checkpoints=None,
                       checkpoint_policy=policy, on_event=events.append)
    shared = ids(130, 700)
    for i in range(8):
        prompt = cat(shared, ids(131 + i, 300 + 97 * i))
        run_request(mgr, f"r{i}", prompt, ids(150 + i, 40), chunk_tokens=512)
    published, removed = {}, 0
    for e in events:
        if e.kind == "stored":
            published[(e.group_id, e.block_hash)] = (e.parent_hash, e.tokens, e.num_pages)
        else:
            removed += 1
            assert published.pop((e.group_id, e.block_hash)) == (e.parent_hash, e.tokens, e.num_pages)
    assert removed and published  # evictions happened, some entries stay


@pytest.mark.parametrize("last_step_tokens, published", [(100, []), (200, [256]), (400, [256, 512])])
def test_free_publishes_the_blocks_its_last_step_completed(last_step_tokens, published):
    """A step's tokens are committed at the next schedule or at free: a request freed after
    a step that completed no block publishes nothing, one freed after a step that completed
    blocks publishes them (history) and the checkpoint at the latest (state groups)."""
    mgr = make_manager()
    mgr.add_request("a", ids(40, 600))
    mgr.schedule([("a", 120)])
    mgr.schedule([("a", last_step_tokens)])  # commits the first step: 120 tokens, no block
    assert mgr.prefix.drain_events() == []
    mgr.free("a")
    events = mgr.prefix.drain_events()
    assert events_of(events, "stored", C4KV) == published
    assert events_of(events, "stored", SWA) == published[-1:]
    assert mgr.stats()[C4KV].cached_pages == len(published)


@pytest.mark.parametrize("chunk_tokens", [256, 2048])
def test_one_block_commits_publish_what_the_general_path_publishes(chunk_tokens):
    """A commit of one block whose end is the request's one checkpoint (a decode commit's,
    looked up in one pass) publishes, supersedes and hits exactly as the general path,
    taken here by an interval no request ever reaches: same events, same hits, under
    pool pressure, with shared prefixes (junctions), decode across several blocks, and a
    request repeated (its decode keys already published)."""
    runs = []
    for interval in (None, 256 * 1000):
        events: list[CacheEvent] = []
        mgr = make_manager(group_pages={C4KV: 40, C128KV: 40, SWA: 60}, state_checkpoint_interval=interval,
                           on_event=events.append)
        shared, hits = ids(170, 600), []
        for i in [*range(6), 5]:  # the last one again: its decode commits find their keys published
            prompt = cat(shared, ids(171 + i, 200 + 111 * i))
            hits.append(run_request(mgr, f"r{len(hits)}", prompt, ids(180 + i, 300 + 150 * (i % 3)),
                                    chunk_tokens=chunk_tokens))
        runs.append(([(e.kind, e.group_id, e.block_hash, e.parent_hash, e.tokens, e.num_pages) for e in events],
                     [h.hit_tokens for h in hits]))
    assert runs[0] == runs[1]
    assert any(kind == "removed" for kind, *_ in runs[0][0]) and any(runs[0][1])


def reference_match(mgr: CacheManager, prompt: np.ndarray) -> tuple[tuple, dict[str, tuple]]:
    """The hit by the rules above, from each pool's entries (``PagePool.lookup``) and keys
    chained by the documented formula (no salt): (hit, each group's own reach, the
    history's reach), and per group the pages a request that hits places (first logical
    page, page ids)."""
    g = mgr.prefix.granularity_tokens
    blocks = (len(prompt) - 1) // g
    keys, parent = [], xxhash.xxh3_128_intdigest(b"hybridkv-prefix-root\x00")
    for b in range(blocks):
        parent = xxhash.xxh3_128_intdigest(parent.to_bytes(16, "little") + prompt[b * g : (b + 1) * g].astype("<i4").tobytes())
        keys.append(parent)
    windows = mgr.prefix.checkpoint_windows
    found = {s.group_id: [mgr.pools[s.group_id].lookup(k) for k in keys] for s in mgr.specs}
    reach = {}
    for s in mgr.specs:
        entries = found[s.group_id]
        if not s.is_sliding:
            reach[s.group_id] = entries.index(None) if None in entries else blocks
        elif s.group_id in windows:
            reach[s.group_id] = max((b + 1 for b in range(blocks) if entries[b] is not None), default=0)
        else:
            reach[s.group_id] = blocks  # restorable at every boundary
    limit = min(reach[s.group_id] for s in mgr.specs if not s.is_sliding)
    hit = max((b for b in range(1, limit + 1) if all(found[gid][b - 1] is not None for gid in windows)), default=0)
    d, placed = hit * g, {}
    for s in mgr.specs:
        if not s.is_sliding:
            placed[s.group_id] = (0, [p for entry in found[s.group_id][:hit] for p in entry])
        elif s.group_id in windows and hit:
            placed[s.group_id] = (max(0, d - windows[s.group_id]) // s.page_tokens, list(found[s.group_id][hit - 1]))
        else:
            placed[s.group_id] = (d // s.page_tokens, [])
    return (d, {gid: n * g for gid, n in reach.items()}, limit * g), placed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_match_agrees_with_the_rules_over_random_caches(data):
    """Over caches that random shared-prefix requests filled and evicted (either eviction
    policy, with and without prompt checkpoints, whole or V4's default checkpoint windows), every request's match
    (``PrefixCache.match`` before it is added, and the hit ``add_request`` returns) is
    what the rules give from each group's entries, and the request's tables then hold
    exactly the pages the rules place. Under "group-lru" each state group also loses a
    random half of its checkpoints alone between requests, so state groups disagree."""
    policy = data.draw(st.sampled_from(["value", "group-lru"]), label="eviction policy")
    state_pages = data.draw(st.sampled_from([90, 1200]), label="ratio-4 state pages")  # few: they evict alone
    # V4's default windows (None) leave the ratio-128 state group restorable at every boundary: matched by no lookup.
    windows = data.draw(st.sampled_from([None, {s.group_id: s.sliding_window_tokens for s in SPECS if s.is_sliding}]),
                        label="checkpoint windows")
    mgr = make_manager(prompt_checkpoints=data.draw(st.booleans(), label="prompt checkpoints"),
                       eviction_policy=policy, checkpoint_window_tokens=windows,
                       group_pages={C4KV: 24, C128KV: 24, SWA: 40, C4S: state_pages, IDX: state_pages})
    seen = [ids(seed, 2000) for seed in range(2)]  # shared documents, then every request's tokens
    for i in range(data.draw(st.integers(1, 10), label="requests")):
        earlier = seen[data.draw(st.integers(0, len(seen) - 1), label=f"request {i} shares with")]
        shared = data.draw(st.integers(0, min(len(earlier), 2000)), label=f"request {i} shared tokens")
        tail = data.draw(st.integers(1, 400), label=f"request {i} tail tokens")
        prompt = cat(earlier[:shared], ids(1000 + i, tail))
        expected, placed = reference_match(mgr, prompt)
        got = mgr.prefix.match(mgr.prefix.new_request_hashes(None), prompt)
        assert (got.hit_tokens, got.group_hit_tokens, got.history_hit_tokens) == expected
        hit = mgr.add_request(f"r{i}", prompt, max_new_tokens=300)
        assert (hit.hit_tokens, hit.group_hit_tokens, hit.history_hit_tokens) == expected
        for gid, (first_page, pages) in placed.items():
            base_page, table = mgr.request_pages(f"r{i}", gid)
            assert (base_page, table.tolist()) == (first_page, pages), gid
        prefill(mgr, f"r{i}", len(prompt), chunk_tokens=256)
        output = ids(i, data.draw(st.integers(1, 300), label=f"request {i} output"))
        decode(mgr, f"r{i}", output)
        seen.append(cat(prompt, output[:-1]))
        mgr.free(f"r{i}")
        if policy == "group-lru":  # state groups lose checkpoints alone: the hit may sit below every reach
            rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label=f"request {i} drop seed"))
            for gid in mgr.prefix.checkpoint_windows:
                pool = mgr.pools[gid]
                for key in pool.entry_keys():
                    if rng.random() < 0.5:
                        pool.unpublish(key)
        mgr.check_invariants()


@pytest.mark.parametrize("policy", ["prompt-boundaries", "terminal-and-junctions", "prefill-per-byte"])
def test_multi_block_commits_emit_the_documented_stored_events_in_order(policy):
    """Prefill chunks of several blocks (each commit of a new prompt claims every entry,
    _publish_all) emit, per commit, the "stored" events written out here from
    the documented order: each history group's new blocks in order, then boundary by
    boundary (the speculative ones the policy keeps, then the latest) each state group;
    every field by the key formula. A second request sharing part of the prompt (its
    commits find some keys published: the general path) stores only what is new."""
    events: list[CacheEvent] = []
    mgr = make_manager(checkpoint_window_tokens=None)
    windows, page_tokens = mgr.prefix.checkpoint_windows, {s.group_id: s.page_tokens for s in SPECS}
    history = [s.group_id for s in SPECS if not s.is_sliding]
    state = [s.group_id for s in SPECS if s.group_id in windows]
    prompt = ids(200, 2900)
    keys = [int(k, 16) for k in _expected_keys("xxh3_128", b"", prompt, len(prompt) // 256)]
    root = xxhash.xxh3_128_intdigest(b"hybridkv-prefix-root\x00")

    def stored(gid, b):  # block b's entry (the prefix of b + 1 blocks)
        pages = 1 if gid in history else -(-windows[gid] // page_tokens[gid])
        return ("stored", gid, keys[b], keys[b - 1] if b else root, (b + 1) * 256, pages)

    def stored_events():
        out = [(e.kind, e.group_id, int(e.block_hash, 16), e.parent_hash and int(e.parent_hash, 16), e.tokens,
                e.num_pages) for e in events if e.kind == "stored"]
        events.clear()
        return out

    for chunks in ((700,), (700, 1300), (700, 1300, 900)):  # the last chunk's commit (2, 6, 3 blocks)
        mgr = make_manager(prompt_checkpoints=None, checkpoint_policy=policy, checkpoint_window_tokens=None,
                           on_event=events.append)
        mgr.add_request("a", prompt, max_new_tokens=1)
        for chunk in chunks:
            mgr.schedule([("a", chunk)])
        events.clear()
        mgr.free("a")  # commits the last chunk
        first, end = (sum(chunks) - chunks[-1]) // 256, sum(chunks) // 256
        crossed = range(first, end)
        speculative = [b for b in crossed[:-1] if policy != "terminal-and-junctions"]
        assert stored_events() == ([stored(gid, b) for gid in history for b in crossed]
                                   + [stored(gid, b) for b in [*speculative, end - 1] for gid in state]), chunks
    published = {(gid, keys[b]) for gid in history for b in range(len(keys))}
    hit = mgr.add_request("b", cat(prompt[:2600], ids(201, 1500)), max_new_tokens=1)
    prefill(mgr, "b", 4100)
    mgr.free("b")
    again = [(gid, key) for _, gid, key, *_ in stored_events() if (gid, key) in published]
    assert not again and hit.hit_tokens == (0 if policy == "terminal-and-junctions" else 2560)
    mgr.check_invariants()


def test_a_hits_borrow_with_a_free_page_is_refused_whole():
    """``lru.borrow_row`` (a hit's holds, LRU leave and placement, one compiled call) is
    refused whole when a listed page is free (it names the page) or the hit places another
    number of pages than listed: it changes no reference
    count, LRU link or table cell; with the cached pages alone it holds them once each and
    takes them out of the LRU."""
    from hybridkv.memory import lru

    mgr = make_manager()
    prompt = ids(3, 1100)
    mgr.add_request("a", prompt)
    prefill(mgr, "a", 1100)
    mgr.free("a")  # row 0 is free again; its history blocks are cached, idle
    pool, ts = mgr.pools[C4KV], mgr.tables[C4KV].table_set
    space, g = pool.space, mgr.tables[C4KV].group_index
    cached, free = pool.evictable_page_ids()[:2], pool.free_page_ids()[:1]
    windows = np.zeros(len(ts.tables), dtype=np.int64)  # no page below the hit but C4KV's (-1: all of them)
    windows[g] = -1

    def borrow(pages, placed=None):  # ``placed``: how many pages the hit places, if not as many as listed
        hit_tokens = (pages.size if placed is None else placed) * mgr.tables[C4KV].page_tokens
        return lru.borrow_row(ts.geometry, ts.pages, ts.bounds, space.ref_counts, space.cached, space.low_priority,
                              space.lru_prev, space.lru_next, space.per_group, 0, hit_tokens, windows,
                              pages.astype(np.int64), np.empty(3 * windows.size + pages.size, dtype=np.int64))

    def state():
        return [a.tolist() for a in (space.ref_counts, space.lru_prev, space.lru_next, space.lru_lengths,
                                     ts.pages, ts.bounds)]

    before = state()
    assert borrow(np.concatenate([cached, free])) == -1 - 2  # the free page, third listed
    assert state() == before
    assert borrow(cached, placed=3) == -1 - 2  # a page fewer listed than the hit places: refused whole
    assert state() == before
    assert borrow(cached) == 2
    assert pool.ref_counts[cached].tolist() == [1, 1] and not set(cached) & set(pool.evictable_page_ids())
    assert mgr.tables[C4KV].pages_in(0, 0, 2).tolist() == cached.tolist()
