"""The value-based eviction policy (hybridkv.prefix.eviction), worked by hand, and a property.

Same small DeepSeek-V4 group set and helpers as tests/test_prefix.py (grain 256,
whole-window checkpoints, prompt checkpoints off unless a test turns them on).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridkv.runtime.manager import CacheManager
from hybridkv.prefix.eviction import ValueEviction
from hybridkv.memory.pool import EVICTED, PagePool, PageSpace
from pool_ops import allocate, decref, publish
from test_prefix import ALL, C4KV, C128KV, C128S, C4S, HISTORY, IDX, SPECS, STATE, SWA, cat, events_of, ids, \
    make_manager, run_request


def stored(policy: ValueEviction, gid: str, key, parent, boundary: int) -> None:
    """One entry published in group ``gid`` of ``policy``: a checkpoint
    (``stored_checkpoint``) in a state group, else a block (``stored_blocks``)."""
    if gid in policy.state_ids:
        policy.stored_checkpoint((gid,), key, parent, boundary)
    else:
        policy.stored_blocks([(gid, (0,))], (key,), (parent,), (boundary,))


def _checkpoint_key(events, gid: str, tokens: int) -> int:
    [h] = [e.block_hash for e in events if e.kind == "stored" and e.group_id == gid and e.tokens == tokens]
    return int(h, 16)


@pytest.mark.parametrize("policy", ["value", "group-lru"])
def test_a_lost_checkpoint_sends_its_history_first_tail_first(policy):
    """b runs, then a (1,030 tokens each: blocks 256..1,024 and a terminal at 1,024 each).
    a's checkpoint then leaves the window group (unpublished there, as an eviction would).
    x needs 8 history pages with 5 clean: 3 cached blocks go.

    value: a's checkpoint leaves every state group with it (a unit); a's four blocks are
    below no checkpoint, so they are demoted, tail first at the front: 1,024, 768, 512 go,
    and 256 in the same pass (low-priority entries go up to 16 pages beyond the need), and
    b, least recently used but usable, keeps its hit at 1,024.
    group-lru: each pool evicts its own LRU front, b's tail (older than a): b loses its hit,
    and a's state entries stay cached in three groups, useless."""
    mgr = make_manager(group_pages={C4KV: 14, C128KV: 14}, eviction_policy=policy)
    a, b = ids(120, 1030), ids(121, 1030)
    run_request(mgr, "b", b)
    mgr.prefix.drain_events()
    run_request(mgr, "a", a)
    key = _checkpoint_key(mgr.prefix.drain_events(), SWA, 1024)
    mgr.pools[SWA].unpublish(key)
    left = {g: mgr.pools[g].lookup(key) is not None for g in STATE}
    report = mgr.prefix.value_report()
    run_request(mgr, "x", ids(122, 1793))
    removed = events_of(mgr.prefix.drain_events(), "removed", C4KV)
    hit_b = mgr.add_request("b2", cat(b, [7])).hit_tokens
    if policy == "value":
        assert left == {SWA: False, C4S: False, C128S: False, IDX: False}
        assert {g: (report[g].usable_entries, report[g].cached_entries) for g in HISTORY} == {C4KV: (4, 8),
                                                                                              C128KV: (4, 8)}
        assert removed == [1024, 768, 512, 256] and hit_b == 1024
        assert mgr.prefix.value_report()[C4KV].evicted_pages["orphan"] == 4
    else:
        assert left == {SWA: False, C4S: True, C128S: True, IDX: True}
        assert removed == [1024, 768, 512] and hit_b == 0  # b's blocks, LRU front
    mgr.check_invariants()


def test_idle_prompt_checkpoints_a_state_group_evicts_count_as_prompt():
    """Worked by hand: with prompt checkpoints, a's 1,100 tokens in 256-token chunks leave
    256, 512 and 768 as idle low-priority prompt checkpoints and 1,024 as its latest, each a
    whole window: 2 window-KV pages (128 tokens, 64 a page), 2 in each c4 state group (8
    tokens, 4 a page), 16 in the c128 one (128 tokens, 8 a page). The window group has 11
    pages, 3 of them free: x's first chunk needs more, so it evicts the low-priority ones
    first, all three in one pass (up to 16 pages beyond the need), deepest first, and
    keeps 1,024. Their 6 window pages count as "prompt", the rest of their units in the
    other state groups as "unit": 6, 48 and 6 pages."""
    mgr = make_manager(prompt_checkpoints=True, group_pages={SWA: 12})
    run_request(mgr, "a", ids(40, 1100), chunk_tokens=256)
    latest = _checkpoint_key(mgr.prefix.drain_events(), SWA, 1024)
    assert mgr.pools[SWA].num_low_priority_idle_pages == 6 and mgr.pools[SWA].num_free_pages == 11
    run_request(mgr, "x", ids(41, 300), chunk_tokens=256)
    events = mgr.prefix.drain_events()
    assert {g: events_of(events, "removed", g) for g in STATE} == {g: [768, 512, 256] for g in STATE}
    assert all(mgr.pools[g].lookup(latest) is not None for g in STATE)
    report = mgr.prefix.value_report()
    evicted = {g: {r: n for r, n in report[g].evicted_pages.items() if n} for g in STATE}
    assert evicted == {SWA: {"prompt": 6}, C4S: {"unit": 6}, C128S: {"unit": 48}, IDX: {"unit": 6}}
    mgr.check_invariants()


def test_a_checkpoint_above_an_orphan_chain_promotes_it_back():
    """a's checkpoint goes (its blocks become orphans, low priority); c then computes a's
    prompt again past it, hits nothing (no checkpoint), pins its junction at 1,024 (a's
    blocks still reach there), and its checkpoint there makes a's blocks usable again:
    normal priority, so a later allocation takes clean pages and evicts nothing of them."""
    mgr = make_manager()
    a = ids(130, 1030)
    run_request(mgr, "a", a)
    key = _checkpoint_key(mgr.prefix.drain_events(), SWA, 1024)
    mgr.pools[SWA].unpublish(key)
    kv = mgr.pools[C4KV]
    assert kv.num_low_priority_idle_pages == 4
    hit = run_request(mgr, "c", cat(a[:1024], ids(131, 100)))
    assert (hit.hit_tokens, hit.junction_tokens) == (0, 1024)
    assert kv.num_low_priority_idle_pages == 0
    report = mgr.prefix.value_report()
    assert report[C4KV].usable_entries == report[C4KV].cached_entries == 4
    assert mgr.add_request("d", cat(a[:1024], ids(132, 50))).hit_tokens == 1024


def test_a_block_evicted_mid_chain_sends_everything_beyond_it_first_tail_first():
    """b runs, then a (1,030 tokens each: blocks 256..1,024, a terminal checkpoint at
    1,024). a's block 512 is evicted from one history group (its unit takes it from the
    other; it has no checkpoint). a's checkpoint at 1,024 is still complete in every state
    group but no hit can reach it: it and a's blocks 768, 1,024 lose their value at once
    (low priority, reason "gap"), and block 256, supported by nothing now, is an orphan.
    x then needs 8 history pages with 6 clean: a's entries go, the tail first (1,024, 768,
    then 256 in the same pass), and b, older but usable, keeps its hit at 1,024."""
    mgr = make_manager(group_pages={C4KV: 14, C128KV: 14})
    a, b = ids(180, 1030), ids(181, 1030)
    run_request(mgr, "b", b)
    mgr.prefix.drain_events()
    run_request(mgr, "a", a)
    events = mgr.prefix.drain_events()
    mgr.pools[C4KV].unpublish(_checkpoint_key(events, C4KV, 512), EVICTED)
    report = mgr.prefix.value_report()
    assert {g: (report[g].usable_entries, report[g].cached_entries) for g in ALL} == {
        C4KV: (4, 7), C128KV: (4, 7), SWA: (1, 2), C4S: (1, 2), IDX: (1, 2), C128S: (1, 2)}
    # Every entry of a's is low priority now: in the state groups its checkpoint, in the
    # history groups its three blocks left.
    a_pages = {g: sum(len(mgr.pools[g].lookup(_checkpoint_key(events, g, t)))
                      for t in (256, 768, 1024) if g in HISTORY or t == 1024) for g in ALL}
    assert {g: mgr.pools[g].num_low_priority_idle_pages for g in a_pages} == a_pages
    mgr.prefix.drain_events()
    run_request(mgr, "x", ids(182, 1793))
    removed = events_of(mgr.prefix.drain_events(), "removed", C4KV)
    assert removed == [1024, 768, 256]
    assert mgr.add_request("b2", cat(b, [7])).hit_tokens == 1024
    evicted = mgr.prefix.value_report()
    assert evicted[C4KV].evicted_pages["gap"] == 2 and evicted[C4KV].evicted_pages["orphan"] == 1
    assert evicted[SWA].evicted_pages["unit"] == 2  # a's checkpoint went with block 1,024
    mgr.check_invariants()


def test_a_block_published_again_gives_what_lies_beyond_it_its_value_back():
    """a's block 512 goes (as above); c computes a's first 1,024 tokens again (no hit: no
    checkpoint at 256) and publishes block 512 anew: a's blocks and its checkpoint at
    1,024 are usable again, at normal priority, and d hits there."""
    mgr = make_manager()
    a = ids(185, 1030)
    run_request(mgr, "a", a)
    events = mgr.prefix.drain_events()
    mgr.pools[C4KV].unpublish(_checkpoint_key(events, C4KV, 512), EVICTED)
    assert mgr.prefix.value_report()[SWA].usable_entries == 0
    assert run_request(mgr, "c", cat(a[:1024], ids(186, 40))).hit_tokens == 0
    report = mgr.prefix.value_report()
    # The window group: a's checkpoint at 1,024 and c's junction at 256 (its history hit).
    assert {g: (report[g].usable_entries, report[g].cached_entries) for g in (C4KV, SWA)} == {
        C4KV: (4, 4), SWA: (2, 2)}
    assert all(mgr.pools[g].num_low_priority_idle_pages == 0 for g in ALL)
    assert mgr.add_request("d", cat(a[:1024], ids(187, 10))).hit_tokens == 1024
    mgr.check_invariants()


@pytest.mark.parametrize("ranking", ["incremental", "full sort"])
def test_prefill_per_byte_keeps_a_checkpoint_beyond_a_gap_low_until_its_block_is_back(ranking):
    """"prefill-per-byte": a computes 1,030 tokens (own checkpoint at 1,024, speculative
    ones at 256, 512, 768); while it runs, its block 512 leaves the history groups, so its
    checkpoints at 768 and 1,024 lie beyond a gap (demoted). a's free then ranks every
    cached checkpoint by value; an own checkpoint is normal priority by class, but no hit
    can reach this one, so it stays low in every state group, as does the one at 768, and
    stays low after another request's free. c computes a's first 1,024 tokens again and
    publishes block 512 anew: both are promoted back (the gap is mended) and d hits at
    1,024. The same with the full-sort reference."""
    mgr = make_manager(prompt_checkpoints=None, checkpoint_policy="prefill-per-byte")
    if ranking == "full sort":
        mgr.prefix.use_full_sort_ranking()
    a = ids(188, 1030)
    mgr.add_request("a", a, max_new_tokens=2)
    mgr.schedule([("a", 1030)])
    mgr.append_token_ids("a", [5])
    mgr.schedule([("a", 1)])  # commits the prompt's blocks and checkpoints
    events = mgr.prefix.drain_events()
    mgr.pools[C4KV].unpublish(_checkpoint_key(events, C4KV, 512), EVICTED)
    beyond = [_checkpoint_key(events, SWA, t) for t in (768, 1024)]

    def low():  # per state group: whether each checkpoint beyond the gap is low priority
        return {g: [bool(mgr.pools[g].low_priority[mgr.pools[g].lookup(k)[0]]) for k in beyond] for g in STATE}

    mgr.free("a")
    assert low() == dict.fromkeys(STATE, [True, True])
    run_request(mgr, "b", ids(189, 300))
    assert low() == dict.fromkeys(STATE, [True, True])
    report = mgr.prefix.value_report()[SWA]  # a's 256, 768, 1,024 (512 went with its block), b's 256
    assert (report.usable_entries, report.cached_entries) == (2, 4)
    run_request(mgr, "c", cat(a[:1024], ids(190, 40)))
    assert low() == dict.fromkeys(STATE, [False, False])
    assert mgr.add_request("d", cat(a[:1024], ids(191, 10))).hit_tokens == 1024
    mgr.check_invariants()


def _round_robin(mgr) -> list[tuple[str, int, list[int]]]:
    """Three conversations a, b, c of 520-token first turns (blocks 256 and 512, a terminal at 512), then each a
    second turn of 300 tokens more, served one at a time in turn: per request its hit and the blocks it removed."""
    first = {name: ids(seed, 520) for name, seed in (("a", 1), ("b", 2), ("c", 3))}
    turns = [*first.items()] + [(f"{name}2", cat(prompt, ids(seed, 300)))
                                for (name, prompt), seed in zip(first.items(), (4, 5, 6))]
    out = []
    for rid, prompt in turns:
        mgr.prefix.drain_events()
        hit = run_request(mgr, rid, prompt)
        out.append((rid, hit.hit_tokens, events_of(mgr.prefix.drain_events(), "removed", C4KV)))
    return out


@pytest.mark.parametrize("guard", [True, False])
def test_the_thrash_guard_keeps_part_of_a_round_robin_working_set_hitting(guard):
    """Worked by hand. Each history group has 6 pages (and its null page); a 520-token prefill takes 3, a 820-token
    one 4 (the state groups have room). a and b publish 2 blocks each; c, short of one page, evicts the least
    recently used usable entry, a's block at 512 (its unit: the checkpoint there goes too), and a's block at 256,
    below no checkpoint now, is demoted. a2 hits nothing (0), but its prompt reaches past that to the checkpoint at
    512 just evicted: with the guard it is counted, and once freed, what it published (256, 512, 768) is next in line
    for eviction. It evicts a's orphan 256, then b's 512 and, orphaned, 256; b2 (the same as a2) evicts 3 pages:
    with the guard, a2's 768, 512, 256, so c keeps its blocks and c2 hits at 512; without, the least recently used:
    c's 512 and 256, then a2's 768, and c2 hits nothing."""
    mgr = make_manager(group_pages={C4KV: 7, C128KV: 7})
    mgr.prefix.thrash_guard = guard
    served = _round_robin(mgr)
    assert [(rid, hit) for rid, hit, _ in served] == [("a", 0), ("b", 0), ("c", 0), ("a2", 0), ("b2", 0),
                                                      ("c2", 512 if guard else 0)]
    removed = {rid: tokens for rid, _, tokens in served}
    assert removed["c"] == [512] and removed["a2"] == [256, 512, 256]
    assert removed["b2"] == ([768, 512, 256] if guard else [512, 256, 768])
    assert mgr.prefix.thrash_guarded_requests == (2 if guard else 0)
    mgr.check_invariants()


def test_clearing_the_prefix_cache_forgets_what_the_thrash_guard_remembers():
    """After the round robin, a2's prompt again: its checkpoint at 768 was evicted (b2 took it), so it is guarded;
    once ``clear_prefix_cache`` unpublishes everything, the same prompt misses with nothing evicted to blame."""
    mgr = make_manager(group_pages={C4KV: 7, C128KV: 7})
    _round_robin(mgr)
    again = cat(ids(1, 520), ids(4, 300), ids(7, 10))
    assert run_request(mgr, "a3", again).hit_tokens == 0
    assert mgr.prefix.thrash_guarded_requests == 3
    mgr.clear_prefix_cache()
    assert run_request(mgr, "a4", again).hit_tokens == 0
    assert mgr.prefix.thrash_guarded_requests == 3


def test_a_guarded_request_leaves_the_checkpoint_it_borrowed_in_its_place():
    """r1 (S + V, 812 tokens) publishes blocks 256, 512 and 768 (history pages 1, 2, 3) and a terminal at 768; r2
    (S + 18 tokens) finds S's blocks but no checkpoint at 512, so it computes them and pins the junction there (its
    window pages 7 and 8). x (1,014 unique tokens, 4 pages of each history group's 6) evicts one block, the least
    recently used: r1's chain's tail, 768, with its checkpoint. r3 (S + V again) hits at 512 and its prompt reaches
    768, evicted: it is guarded. It computes 10 tokens (window pages 7, 8 and 11; 11 holds no entry) and is freed:
    nothing of its own is published, nothing moves, and the junction's pages it borrowed go idle at the tail. r4 (the
    same) computes its prompt: short of a page it evicts x's block at 768 (x's 256 and 512 lose their checkpoint and
    are demoted to the front: 4, 3), publishes 768 on page 5 and a checkpoint on window pages 11 and 12, and is
    freed: those go next in line, behind the demoted ones, 12 and 5 first."""
    mgr = make_manager(group_pages={C4KV: 7, C128KV: 7})
    s, v = ids(1, 512), ids(2, 300)
    run_request(mgr, "r1", cat(s, v))
    mgr.prefix.drain_events()
    run_request(mgr, "r2", cat(s, ids(3, 18)))
    junction = mgr.pools[SWA].lookup(_checkpoint_key(mgr.prefix.drain_events(), SWA, 512))
    run_request(mgr, "x", ids(4, 1014))
    assert events_of(mgr.prefix.drain_events(), "removed", C4KV) == [768]
    assert mgr.pools[SWA].evictable_page_ids().tolist() == [8, 7, 14, 13] and junction == (7, 8)
    assert mgr.add_request("r3", cat(s, v), max_new_tokens=1).hit_tokens == 512
    mgr.schedule([("r3", 10)])
    assert mgr.request_pages("r3", SWA)[1].tolist() == [7, 8, 11]
    mgr.free("r3")
    assert mgr.prefix.thrash_guarded_requests == 0
    assert mgr.pools[SWA].evictable_page_ids().tolist() == [14, 13, 8, 7]
    assert run_request(mgr, "r4", cat(s, v)).hit_tokens == 512
    assert mgr.prefix.thrash_guarded_requests == 1
    assert mgr.pools[C4KV].evictable_page_ids().tolist() == [4, 3, 5, 2, 1]
    assert mgr.pools[SWA].evictable_page_ids().tolist() == [12, 11, 8, 7]
    mgr.check_invariants()


def _ticks_rise(pool) -> bool:
    """Along the pool's LRU, head to tail, the normal-priority pages' idle ticks never fall."""
    ticks = [int(pool.idle_tick[p]) for p in pool.evictable_page_ids().tolist() if not pool.low_priority[p]]
    return ticks == sorted(ticks)


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 700)), min_size=4, max_size=14), st.booleans())
@settings(max_examples=40, deadline=None)
def test_round_robins_keep_the_lru_whole_with_or_without_the_guard(turns, guard):
    """Random turns of five conversations (each turn its conversation's last prompt and 1-700 new tokens, at most
    1,500 in all), history pools of 6 pages: evictions on most turns, guarded frees on many. After each request the
    manager's invariants hold, every state group holds the same checkpoints, what no hit can use is low priority,
    and the normal-priority pages' idle ticks rise along each LRU (the guard gives what it moves the oldest)."""
    mgr = make_manager(group_pages={C4KV: 7, C128KV: 7}, prompt_checkpoints=None)
    mgr.prefix.thrash_guard = guard
    last = {c: ids(300 + c, 200) for c in range(5)}
    for i, (c, fresh) in enumerate(turns):
        last[c] = prompt = cat(last[c], ids(400 + i, fresh))[:1500]
        run_request(mgr, f"t{i}", prompt)
        _assert_units_whole_and_unusable_low(mgr)
        for g in ALL:
            assert _ticks_rise(mgr.pools[g]), g
    if not guard:
        assert mgr.prefix.thrash_guarded_requests == 0


class _TierHookStub:
    """What ``PrefixCache.tier_hook`` is told (a ``TierLink`` would offload what is stored): taken and dropped."""

    def stored(self, entries) -> None:
        list(entries)

    def removed(self, entries, dropping) -> None:
        pass


def test_the_thrash_guard_stands_aside_with_a_tier_link():
    """With a tier link told of every publication, an evicted checkpoint may be offloaded and loaded back, so the
    round robin guards no request and goes as LRU has it (c2 misses)."""
    mgr = make_manager(group_pages={C4KV: 7, C128KV: 7})
    mgr.prefix.tier_hook = _TierHookStub()
    served = _round_robin(mgr)
    assert mgr.prefix.thrash_guarded_requests == 0
    assert [hit for _, hit, _ in served] == [0] * 6


@pytest.mark.parametrize("options", [dict(eviction_policy="group-lru"),
                                     dict(prompt_checkpoints=None, checkpoint_policy="prefill-per-byte")])
def test_the_thrash_guard_acts_with_the_value_policy_alone(options):
    """The same round robin: each pool by its own LRU ("group-lru") or checkpoints ordered by their class's reuse
    ("prefill-per-byte") note no eviction for the guard, so no request is guarded and c2 misses as LRU has it."""
    mgr = make_manager(group_pages={C4KV: 7, C128KV: 7}, **options)
    served = _round_robin(mgr)
    assert mgr.prefix.thrash_guarded_requests == 0
    assert served[-1][1] == 0


def _turn_prompt(turn: int) -> np.ndarray:
    """Turn 0: 520 tokens; each later turn the last one's prompt and answer (40 tokens, ``ids(20 + turn, 40)``) and
    300 new tokens."""
    prompt = ids(1, 520)
    for k in range(1, turn + 1):
        prompt = cat(prompt, ids(20 + k - 1, 40), ids(10 + k, 300))
    return prompt


def test_a_step_whose_plan_left_a_group_short_raises_instead_of_allocating_past_its_free_pages(monkeypatch):
    """The round robin's c is short of a page and must evict one (above). Were making room to fall short (a plan that
    promised pages it could not free; here ``make_room`` does nothing), the step stops with an error naming the group
    before the compiled allocation reads past the free stack's top."""
    mgr = make_manager(group_pages={C4KV: 7, C128KV: 7})
    for name, seed in (("a", 1), ("b", 2)):
        run_request(mgr, name, ids(seed, 520))
    monkeypatch.setattr(PagePool, "make_room", lambda pool, *args, **kwargs: None)
    mgr.add_request("c", ids(3, 520), max_new_tokens=1)
    with pytest.raises(AssertionError, match="group 'v4.c4a.compressed_kv': 2 free pages after making room for a "
                                             "step allocating 3"):
        mgr.schedule([("c", 520)])


def _conversation(mgr, turns):
    """A conversation served turn by turn (``_turn_prompt``; no pressure: 1,200 pages a group): per turn its hit, and
    the key of every checkpoint published at a boundary (from the "stored" events)."""
    hits, keys = [], {}
    for turn in range(turns):
        mgr.prefix.drain_events()
        hits.append(run_request(mgr, f"t{turn}", _turn_prompt(turn), ids(20 + turn, 40)).hit_tokens)
        events = mgr.prefix.drain_events()
        keys.update({e.tokens: int(e.block_hash, 16) for e in events if e.kind == "stored" and e.group_id == SWA})
    return hits, keys


def _low(mgr, key) -> dict[str, bool]:
    """Per state group, whether its entry under ``key`` is low priority."""
    return {g: bool(mgr.pools[g].low_priority[mgr.pools[g].lookup(key)[0]]) for g in STATE}


def test_a_checkpoint_a_conversation_moved_past_goes_low_once_it_moves_on_again():
    """Worked by hand. t0 (520 + 40 tokens) leaves a terminal at 512; t1 (its 559 tokens and 300 more: 859) hits at
    512 and its prompt passes 768, a grain past its hit, so 512 is its moved-past checkpoint; it leaves a terminal at
    768 (896 tokens computed, the latest boundary 768). 512 stays of normal priority while a retry of t1 could still
    want it; t2 hits t1's terminal at 768: the conversation moved on twice, and 512 goes low in every state group
    (history below it keeps its support: 768 and t2's terminal at 1,024 lie beyond)."""
    mgr = make_manager()
    hits, keys = _conversation(mgr, 2)
    assert hits == [0, 512] and _low(mgr, keys[512]) == dict.fromkeys(STATE, False)
    mgr = make_manager()
    hits, keys = _conversation(mgr, 3)
    assert hits == [0, 512, 768] and mgr.prefix.moved_past_demoted == 1
    assert _low(mgr, keys[512]) == dict.fromkeys(STATE, True)
    assert _low(mgr, keys[768]) == _low(mgr, keys[1024]) == dict.fromkeys(STATE, False)
    assert all(mgr.pools[g].num_low_priority_idle_pages == 0 for g in HISTORY)
    assert mgr.add_request("retry", cat(ids(1, 520), ids(9, 10))).hit_tokens == 512  # low, still cached


def test_a_checkpoint_another_prefix_branches_off_or_a_short_turn_keeps_its_priority():
    """As above, but b (t0's first 512 tokens and 300 others) branches off 512 before t2: two prefixes continue it,
    so t2's hit demotes nothing. And where t1 adds only 100 tokens (prompt 660: no grain past its hit at 512, as
    when an agent's branch or a retry may fork at its hit) and answers 150 (a terminal at 768, beyond its hit),
    nothing is remembered: t2 hits at 768 and 512 keeps its priority; nor where t1 is freed before anything past
    its hit was published (a later hit at 512 demotes nothing)."""
    mgr = make_manager()
    _, keys = _conversation(mgr, 2)
    run_request(mgr, "b", cat(ids(1, 512), ids(30, 300)))
    assert run_request(mgr, "t2", _turn_prompt(2)).hit_tokens == 768
    assert mgr.prefix.moved_past_demoted == 0 and _low(mgr, keys[512]) == dict.fromkeys(STATE, False)
    mgr = make_manager()  # t1 freed after 100 of its tokens (aborted: nothing past its hit published)
    _, keys = _conversation(mgr, 1)
    assert mgr.add_request("t1", _turn_prompt(1)).hit_tokens == 512
    mgr.schedule([("t1", 100)])
    mgr.free("t1")
    assert run_request(mgr, "t1b", cat(ids(1, 520), ids(9, 10))).hit_tokens == 512
    assert mgr.prefix.moved_past_demoted == 0 and _low(mgr, keys[512]) == dict.fromkeys(STATE, False)
    mgr = make_manager()
    _, keys = _conversation(mgr, 1)
    t1 = cat(ids(1, 520), ids(20, 40), ids(11, 100))
    assert run_request(mgr, "t1", t1, ids(21, 150)).hit_tokens == 512
    assert run_request(mgr, "t2", cat(t1, ids(21, 150), ids(12, 300))).hit_tokens == 768
    assert mgr.prefix.moved_past_demoted == 0 and _low(mgr, keys[512]) == dict.fromkeys(STATE, False)


@pytest.mark.parametrize("options", [dict(eviction_policy="group-lru"),
                                     dict(prompt_checkpoints=None, checkpoint_policy="prefill-per-byte"),
                                     dict(switched_off=True), dict(tier_link=True)])
def test_the_moved_past_demotion_acts_with_the_value_policy_alone(options):
    """Three turns as above demote nothing where each pool evicts by its own LRU, where "prefill-per-byte" ranks
    checkpoints itself, with ``demote_moved_past = False``, or with a tier link (a demoted checkpoint may be
    offloaded, and loading it back loses no hit)."""
    switched_off, tier_link = options.pop("switched_off", False), options.pop("tier_link", False)
    mgr = make_manager(**options)
    mgr.prefix.demote_moved_past = not switched_off
    if tier_link:
        mgr.prefix.tier_hook = _TierHookStub()
    hits, keys = _conversation(mgr, 3)
    assert hits == [0, 512, 768] and mgr.prefix.moved_past_demoted == 0
    assert _low(mgr, keys[512]) == dict.fromkeys(STATE, False)


def test_group_lru_and_value_give_the_same_hits_without_pressure():
    hits = {}
    for policy in ("value", "group-lru"):
        mgr = make_manager(pages=4096, eviction_policy=policy)
        stem = ids(140, 700)
        hits[policy] = [run_request(mgr, f"r{i}", cat(stem, ids(141 + i, 300 + 37 * i))).hit_tokens
                        for i in range(6)]
        assert all(sum(r.evicted_pages.values()) == 0 for r in mgr.prefix.value_report().values())
    assert hits["value"] == hits["group-lru"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="eviction_policy must be one of"):
        make_manager(eviction_policy="lru")


@settings(max_examples=10, deadline=None)
def _assert_units_whole_and_unusable_low(mgr) -> None:
    """With every request idle: every state group holds the same checkpoints (a unit leaves as a whole), and in
    every group the entries no hit can use are low priority (evicted before anything usable); every group reports."""
    report = mgr.prefix.value_report()
    keys = {g: set(mgr.pools[g].entry_keys()) for g in STATE if g != C128S or report[g].cached_entries}
    assert len({frozenset(k) for k in keys.values()}) <= 1
    for g in ALL:
        pool = mgr.pools[g]
        low = sum(1 for k in pool.entry_keys() if pool.low_priority[pool.lookup(k)[0]])
        assert report[g].cached_entries - report[g].usable_entries <= low
    assert set(ALL) == set(report)


@given(st.sampled_from(["prompt-boundaries", "prefill-per-byte"]),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1400), st.integers(1, 1500), st.integers(0, 400)),
                min_size=3, max_size=8))
def test_no_group_keeps_what_cannot_produce_a_hit(policy, program):
    """Random requests over four shared stems, pools tight enough to evict in every group.
    After each request (all idle): every state group holds the same checkpoints (a unit
    leaves as a whole), and in every group the entries no hit can use (history blocks
    below no usable checkpoint, checkpoints beyond a missing block) are low priority,
    evicted before anything usable; "prefill-per-byte", which ranks every checkpoint by
    value at each free, must not promote one beyond a gap."""
    mgr = make_manager(group_pages={SWA: 40, C4S: 240, C128S: 160, IDX: 240, C4KV: 14, C128KV: 14},
                       prompt_checkpoints=None, checkpoint_policy=policy)
    stems = [ids(150 + s, 1400) for s in range(4)]
    for i, (stem, shared, fresh, answer) in enumerate(program):
        prompt = cat(stems[stem][:shared], ids(1000 + i, fresh))[:1500]
        run_request(mgr, f"q{i}", prompt, ids(2000 + i, answer + 1), chunk_tokens=256)
        _assert_units_whole_and_unusable_low(mgr)


def test_checkpoint_policy_names_and_the_older_switch():
    """``checkpoint_policy`` names what ``prompt_checkpoints`` switched: the default keeps
    every prompt boundary (low priority), "terminal-and-junctions" only the latest."""
    def stored_swa(**options):
        mgr = CacheManager(SPECS, {s.group_id: 1200 for s in SPECS}, max_context_tokens=8192,
                           enable_prefix_caching=True, **options)
        run_request(mgr, "a", ids(160, 1100))
        return mgr.prefix.checkpoint_policy, events_of(mgr.prefix.drain_events(), "stored", SWA)

    # 1,100-token prompt, one step: boundaries 256, 512, 768 inside it, 1,024 the latest.
    assert stored_swa() == ("prompt-boundaries", [256, 512, 768, 1024])
    assert stored_swa(checkpoint_policy="terminal-and-junctions") == ("terminal-and-junctions", [1024])
    assert stored_swa(prompt_checkpoints=False) == ("terminal-and-junctions", [1024])
    assert stored_swa(prompt_checkpoints=True, checkpoint_policy="prompt-boundaries")[0] == "prompt-boundaries"
    with pytest.raises(ValueError, match="contradicts"):
        stored_swa(prompt_checkpoints=False, checkpoint_policy="prompt-boundaries")
    with pytest.raises(ValueError, match="checkpoint_policy must be one of"):
        stored_swa(checkpoint_policy="every-boundary")



def _linked_out_of_order():
    """One history group ``h`` and one state group ``s`` (pools of 8 pages each, every
    page held): block k2 (parent k1) and the checkpoint at its end are published first,
    then block k1 (parent the root), as ``PrefixCache`` reports entries it publishes."""
    pools, policy = _hand_policy()
    h, s = allocate(pools["h"], 2), allocate(pools["s"], 1)
    for gid, key, parent, boundary, pages in (("h", "k2", "k1", 512, [h[1]]), ("s", "k2", "k1", 512, [s[0]]),
                                              ("h", "k1", "root", 256, [h[0]])):
        assert publish(pools[gid], key, pages)
        stored(policy, gid, key, parent, boundary)
    return pools, policy, h, s


def _hand_policy():
    """A history group ``h`` and a state group ``s`` of 8 pages each (grain 256), their
    removals reported to the policy as ``PrefixCache`` reports them."""
    pools = {g: PagePool(g, 8) for g in ("h", "s")}
    policy = ValueEviction(pools, ["h"], ["s"], 256)
    for gid, pool in pools.items():
        pool.on_removed = lambda key, cause, idle, gid=gid: policy.removed(gid, key, cause, idle)
    return pools, policy


def test_a_policy_made_before_its_pools_join_a_page_space_demotes_there():
    """The pools join one page space (as an arena's do) after the policy over them is made: the blocks of a
    checkpoint that goes are orphans all the same, demoted in that page space (low priority, counted idle, first
    in their LRU, the tail at the front), not in the arrays the pools viewed before."""
    pools = {g: PagePool(g, 8) for g in ("h", "s")}
    policy = ValueEviction(pools, ["h"], ["s"], 256)
    PageSpace(list(pools.values()))
    for gid, pool in pools.items():
        pool.on_removed = lambda key, cause, idle, gid=gid: policy.removed(gid, key, cause, idle)
    h, s = allocate(pools["h"], 2), allocate(pools["s"], 1)
    for gid, key, parent, boundary, pages in (("h", "k1", "root", 256, [h[0]]), ("h", "k2", "k1", 512, [h[1]]),
                                              ("s", "k2", "k1", 512, [s[0]])):
        assert publish(pools[gid], key, pages)
        stored(policy, gid, key, parent, boundary)
    decref(pools["h"], h)
    pools["s"].unpublish("k2")
    assert pools["h"].low_priority[h].tolist() == [True, True]
    assert pools["h"].num_low_priority_idle_pages == 2
    assert pools["h"].evictable_page_ids().tolist() == [h[1], h[0]]
    pools["h"].check_invariants()


def test_a_block_published_after_the_checkpoint_beyond_it_is_supported_by_it():
    """k1's block is published after k2's checkpoint: k1 is k2's parent all the same, so
    the checkpoint supports it, and when the checkpoint goes (unpublished) both blocks
    lose their last support and are demoted (low priority): k1 as much as k2."""
    pools, _, h, _ = _linked_out_of_order()
    assert not pools["h"].low_priority[h].any()
    pools["s"].unpublish("k2")
    assert pools["h"].low_priority[h].tolist() == [True, True]  # k1 (h[0]) was not demoted before the fix
    pools["h"].check_invariants()


def test_a_block_published_after_the_checkpoint_beyond_it_cuts_it_when_evicted():
    """k1's block, published after k2, is evicted: k2 lies beyond a missing block, so its
    block and checkpoint are demoted (a gap); once idle, the checkpoint goes first, for
    reason "gap"."""
    pools, policy, h, s = _linked_out_of_order()
    pools["h"].unpublish("k1", EVICTED)
    assert pools["s"].low_priority[s[0]] and pools["h"].low_priority[h[1]]  # neither before the fix
    decref(pools["s"], s)
    allocate(pools["s"], 7)  # 6 clean pages (page 0 is the null page) and the checkpoint's idle one
    assert pools["s"].lookup("k2") is None
    assert policy.report()["s"].evicted_pages["gap"] == 1


def test_a_block_published_after_its_parents_node_was_forgotten_is_beyond_a_gap():
    """Issue 21. k1 (the first block, 256 tokens) is published, goes idle and is evicted;
    nothing lies below or beyond it, so its node is forgotten. Then a request that had
    computed k1 itself (its own copy was not published: the key was taken) publishes k2
    (512 tokens, parent k1) and the checkpoint at 512. No hit can reach them: a match
    walks k1 first. So both start low priority (not so before the fix: k2 looked like a
    chain's first block), count as not usable, and an eviction names them "gap". Once
    k1 is published again, k2 regains its value: the checkpoint is promoted back and
    supports k1 and k2, and both count as usable."""
    pools, policy = _hand_policy()
    h, s = pools["h"], pools["s"]
    first = allocate(h, 1)
    assert publish(h, "k1", first)
    stored(policy, "h", "k1", "root", 256)
    decref(h, first)
    allocate(h, 7)  # 6 clean pages and k1's idle one: k1 is evicted
    assert h.lookup("k1") is None and policy.report()["h"].evicted_pages["orphan"] == 1
    decref(h, np.arange(1, 8))
    block, ckpt = allocate(h, 1), allocate(s, 1)
    assert publish(h, "k2", block) and publish(s, "k2", ckpt)
    stored(policy, "h", "k2", "k1", 512)
    stored(policy, "s", "k2", "k1", 512)
    assert h.low_priority[block[0]] and s.low_priority[ckpt[0]]
    report = policy.report()
    assert (report["s"].usable_entries, report["h"].usable_entries) == (0, 0)
    again = allocate(h, 1)
    assert publish(h, "k1", again)
    stored(policy, "h", "k1", "root", 256)
    assert not h.low_priority[block[0]] and not h.low_priority[again[0]] and not s.low_priority[ckpt[0]]
    report = policy.report()
    assert (report["s"].usable_entries, report["h"].usable_entries) == (1, 2)
    h.unpublish("k1", EVICTED)  # and evicted again: k2 is beyond the gap once more
    assert h.low_priority[block[0]] and s.low_priority[ckpt[0]]
    decref(s, ckpt)
    allocate(s, 7)
    assert s.lookup("k2") is None and policy.report()["s"].evicted_pages["gap"] == 1


def test_a_first_block_is_no_gap():
    """A chain's first block (parent the salt root, which is never a node) and the
    checkpoint at its end are usable, normal priority."""
    pools, policy = _hand_policy()
    block, ckpt = allocate(pools["h"], 1), allocate(pools["s"], 1)
    for gid, pages in (("h", block), ("s", ckpt)):
        assert publish(pools[gid], "k1", pages)
        stored(policy, gid, "k1", "root", 256)
    assert not pools["h"].low_priority[block[0]] and not pools["s"].low_priority[ckpt[0]]
    assert (policy.report()["s"].usable_entries, policy.report()["h"].usable_entries) == (1, 1)


def _lru_keys(pool, keys):
    """The keys of ``pool``'s idle entries (one page each) in LRU order, front first."""
    by_page = {int(pool.lookup(key)[0]): key for key in keys if pool.lookup(key) is not None}
    return [by_page[int(page)] for page in pool.evictable_page_ids()]


def test_a_cut_demotes_the_children_of_a_node_in_the_order_they_were_published():
    """Block 1 (the first, 256 tokens) has three children published in the order 30, 20,
    10 (three continuations, 512 tokens), and 20 a child 5 (768 tokens); all idle, normal
    priority. Block 1 is evicted: everything beyond it is cut and demoted, walked depth
    first with the children taken from the last published (a stack: 1, 10, 20, 5, 30),
    each demoted to the LRU's front, so the front ends 30, 5, 20, 10. Integer keys make
    hash order (10, 20, 30) differ from publication order: a set of children would give
    10, 5, 20, 30. (Insertion order is what compiled entry records, children in a linked
    list, can reproduce: issue 19.)"""
    pools, policy = _hand_policy()
    h = pools["h"]
    for key, parent, boundary in ((1, 0, 256), (30, 1, 512), (20, 1, 512), (10, 1, 512), (5, 20, 768)):
        pages = allocate(h, 1)
        assert publish(h, key, pages)
        stored(policy, "h", key, parent, boundary)
        if key != 1:
            decref(h, pages)
    assert _lru_keys(h, (30, 20, 10, 5)) == [30, 20, 10, 5]
    h.unpublish(1, EVICTED)
    assert _lru_keys(h, (30, 20, 10, 5)) == [30, 5, 20, 10]
    assert h.num_low_priority_idle_pages == 4
    h.check_invariants()


def test_a_parent_published_last_mends_its_waiting_children_in_the_order_they_were_published():
    """Blocks 30, 20, 10 (512 tokens, parent 1) and their checkpoints are published, in
    that order, before block 1: beyond a missing block, so each is demoted (front of the
    LRU: 10, 20, 30). Block 1 then comes: the keys that waited for it become its children
    and are mended in the order they were published, each checkpoint promoted to the
    LRU's tail, so both pools end 30, 20, 10 (a set of waiting keys: 10, 20, 30)."""
    pools, policy = _hand_policy()
    h, s = pools["h"], pools["s"]
    for key in (30, 20, 10):
        for gid in ("h", "s"):
            pages = allocate(pools[gid], 1)
            assert publish(pools[gid], key, pages)
            stored(policy, gid, key, 1, 512)
            decref(pools[gid], pages)
    assert _lru_keys(h, (30, 20, 10)) == _lru_keys(s, (30, 20, 10)) == [10, 20, 30]
    assert h.num_low_priority_idle_pages == s.num_low_priority_idle_pages == 3
    assert publish(h, 1, allocate(h, 1))
    stored(policy, "h", 1, 0, 256)
    assert _lru_keys(h, (30, 20, 10)) == _lru_keys(s, (30, 20, 10)) == [30, 20, 10]
    assert h.num_low_priority_idle_pages == s.num_low_priority_idle_pages == 0
    assert policy.report()["s"].usable_entries == 3
    h.check_invariants()
    s.check_invariants()


def _two_state_policy():
    """A history group ``h`` and two state groups ``s1``, ``s2`` of 64 pages each (grain
    256), their removals reported to the policy as ``PrefixCache`` reports them."""
    pools = {g: PagePool(g, 64) for g in ("h", "s1", "s2")}
    policy = ValueEviction(pools, ["h"], ["s1", "s2"], 256)
    for gid, pool in pools.items():
        pool.on_removed = lambda key, cause, idle, gid=gid: policy.removed(gid, key, cause, idle)
    return pools, policy


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["block", "checkpoint", "evict h", "evict s1", "evict s2"]),
                          st.integers(1, 3)), max_size=24))
@example([("block", 1), ("checkpoint", 1), ("evict s1", 1)])  # a supported block becomes an orphan
@example([("checkpoint", 2), ("block", 2), ("block", 1), ("evict h", 1), ("checkpoint", 1)])  # a gap
def test_stored_checkpoint_is_stored_in_each_group_in_turn(program):
    """``ValueEviction.stored_checkpoint`` (one call for a boundary's state entries, as a
    commit books them) leaves every flag, usable count and evicted count exactly as
    ``stored`` called for each state group in turn (the reference), over random
    publications and evictions along one chain of three keys (``k1`` .. ``k3``)."""
    sides = [_two_state_policy(), _two_state_policy()]
    for op, i in program:
        key, parent, boundary = f"k{i}", f"k{i - 1}" if i > 1 else "root", 256 * i
        for fast, (pools, policy) in enumerate(sides):
            if op == "block" and pools["h"].lookup(key) is None:
                assert publish(pools["h"], key, allocate(pools["h"], 1))
                stored(policy, "h", key, parent, boundary)
                decref(pools["h"], pools["h"].lookup(key))  # idle: evictions then free (and count) it
            elif op == "checkpoint":
                gids = [g for g in ("s1", "s2") if pools[g].lookup(key) is None]
                for gid in gids:
                    assert publish(pools[gid], key, allocate(pools[gid], 1))
                    decref(pools[gid], pools[gid].lookup(key))
                if fast:
                    policy.stored_checkpoint(gids, key, parent, boundary) if gids else None
                else:
                    for gid in gids:
                        stored(policy, gid, key, parent, boundary)
            elif op.startswith("evict") and pools[op[6:]].lookup(key) is not None:
                pools[op[6:]].unpublish(key, EVICTED)
        _assert_same_pools_and_policy(sides)


def _two_by_two_policy():
    """History groups ``h1``, ``h2`` and state groups ``s1``, ``s2`` of 64 pages each
    (grain 256), their removals reported to the policy as ``PrefixCache`` reports them."""
    pools = {g: PagePool(g, 64) for g in ("h1", "h2", "s1", "s2")}
    policy = ValueEviction(pools, ["h1", "h2"], ["s1", "s2"], 256)
    for gid, pool in pools.items():
        pool.on_removed = lambda key, cause, idle, gid=gid: policy.removed(gid, key, cause, idle)
    return pools, policy


def _publish_idle(pool, key):
    assert publish(pool, key, allocate(pool, 1))
    decref(pool, pool.lookup(key))  # idle: evictions then free (and count) it


def _commit_both_ways(pools, policy, chain, marks, fast):
    """A commit of new blocks ``chain`` (key, parent, boundary) in ``h1``, ``h2`` and of the
    checkpoints at chain places ``marks`` (its last among them) in ``s1``, ``s2``, published
    and booked in one ``stored_commit`` call (``fast`` where no key has a node, as ``PrefixCache`` calls it; a
    checkpoint at every block: the blocks' keys passed as the checkpoints', as ``PrefixCache`` does) or entry by
    entry, group by group (history groups first, then each boundary in turn)."""
    checkpoints = [chain[j] for j in marks]
    for gid in ("h1", "h2"):
        for key, _, _ in chain:
            _publish_idle(pools[gid], key)
    for key, _, _ in checkpoints:
        for gid in ("s1", "s2"):
            _publish_idle(pools[gid], key)
    if fast and not any(policy.knows(key) for key, _, _ in chain):
        keys, parents, ends = map(list, zip(*chain))
        policy.stored_commit(keys, parents, ends, keys if len(checkpoints) == len(chain) else
                             [key for key, _, _ in checkpoints])
        return
    for gid in ("h1", "h2"):
        for entry in chain:
            stored(policy, gid, *entry)
    for entry in checkpoints:
        for gid in ("s1", "s2"):
            stored(policy, gid, *entry)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["unit", "chain", "block h2", "evict h1", "evict h2", "evict s1"]),
                          st.integers(1, 4), st.integers(1, 3)), max_size=24))
@example([("chain", 1, 3), ("unit", 4, 1), ("evict h1", 2, 1), ("chain", 2, 1)])  # a gap, then mended
@example([("unit", 2, 1), ("chain", 1, 1), ("unit", 3, 1)])  # a key published before its parent
@example([("unit", 1, 1), ("unit", 2, 1), ("evict s1", 2, 1)])  # the parent keeps its own checkpoint's support
@example([("unit", 2, 2), ("unit", 1, 1)])  # a commit published before its parent's
def test_units_and_chains_are_stored_in_each_group_in_turn(program):
    """A commit's one-call bookings, ``ValueEviction.stored_commit`` (new blocks in every
    history group and the checkpoint at the last one's end in every state group) and
    ``ValueEviction.stored_blocks`` of a chain of blocks in every history group, leave every flag, LRU order and value report exactly
    as ``stored`` called entry by entry, group by group (the reference), over random
    publications and evictions along one chain of keys ``k1`` .. ``k6``."""
    sides = [_two_by_two_policy(), _two_by_two_policy()]
    for op, i, length in program:
        chain = [(f"k{j}", f"k{j - 1}" if j > 1 else "root", 256 * j) for j in range(i, i + length)]
        for fast, (pools, policy) in enumerate(sides):
            if op == "unit" and all(pools[g].lookup(key) is None for g in pools for key, _, _ in chain):
                _commit_both_ways(pools, policy, chain, [len(chain) - 1], fast)
            elif op == "chain" and all(pools[g].lookup(key) is None for g in ("h1", "h2") for key, _, _ in chain):
                for gid in ("h1", "h2"):
                    for key, _, _ in chain:
                        _publish_idle(pools[gid], key)
                if fast:
                    policy.stored_blocks([(g, range(length)) for g in ("h1", "h2")], *zip(*chain))
                else:
                    for gid in ("h1", "h2"):
                        for entry in chain:
                            stored(policy, gid, *entry)
            elif op == "block h2" and pools["h2"].lookup(chain[0][0]) is None:
                _publish_idle(pools["h2"], chain[0][0])
                stored(policy, "h2", *chain[0])
            elif op.startswith("evict") and pools[op[6:]].lookup(chain[0][0]) is not None:
                pools[op[6:]].unpublish(chain[0][0], EVICTED)
        _assert_same_pools_and_policy(sides)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["chain", "unit", "evict h1", "evict s1"]), st.integers(1, 4),
                          st.integers(1, 3), st.sets(st.integers(0, 3))), max_size=16))
@example([("unit", 1, 3, {0, 2}), ("evict s1", 3, 1, set())])  # k1 keeps its own support, k2 goes
@example([("unit", 1, 1, {0}), ("evict h1", 1, 1, set()), ("unit", 2, 2, {1})])  # beyond a gap: one at a time
@example([("unit", 1, 1, set()), ("chain", 2, 1, {0}), ("evict s1", 1, 1, set())])  # the parent stays supported
@example([("chain", 1, 1, {0, 3}), ("unit", 2, 1, set()), ("evict s1", 2, 1, set())])  # incomplete: no support
@example([("unit", 1, 2, {0, 1}), ("evict h1", 2, 1, set()), ("evict h1", 1, 1, set())])  # a chain forgotten
def test_commits_with_checkpoints_are_stored_at_once(program):
    """``ValueEviction.stored_commit`` (new blocks in every history group, the checkpoints
    at the marks and at the last block in every state group; at once where each key is
    new on a whole chain) and ``stored_blocks`` then ``stored_checkpoint`` of chains (3 in
    the marks: the first checkpoint in ``s1`` only; the boundaries in any order) leave
    every flag, LRU order and value report exactly as ``stored`` called entry by entry,
    group by group (the reference), over random commits, chains and evictions along keys
    ``k1`` .. ``k6``."""
    sides = [_two_by_two_policy(), _two_by_two_policy()]
    for op, i, length, marks in program:
        chain = [(f"k{j}", f"k{j - 1}" if j > 1 else "root", 256 * j) for j in range(i, i + length)]
        at = [chain[j] for j in sorted(marks, reverse=True) if j < length]  # not in chain order
        booked = [(["s1"] if 3 in marks and not n else ["s1", "s2"], *entry) for n, entry in enumerate(at)]
        for fast, (pools, policy) in enumerate(sides):
            if op == "chain" and all(pools[g].lookup(key) is None for g in pools for key, _, _ in chain):
                for gid in ("h1", "h2"):
                    for key, _, _ in chain:
                        _publish_idle(pools[gid], key)
                policy.stored_blocks([(g, range(length)) for g in ("h1", "h2")], *zip(*chain))
                for gids, key, _, _ in booked:
                    for gid in gids:
                        _publish_idle(pools[gid], key)
                for gids, *entry in booked:
                    if fast:
                        policy.stored_checkpoint(gids, *entry)
                    else:
                        for gid in gids:
                            stored(policy, gid, *entry)
            elif op == "unit" and all(pools[g].lookup(key) is None for g in pools for key, _, _ in chain):
                _commit_both_ways(pools, policy, chain, sorted({j for j in marks if j < length} | {length - 1}),
                                  fast)
            elif op.startswith("evict") and pools[op[6:]].lookup(chain[0][0]) is not None:
                pools[op[6:]].unpublish(chain[0][0], EVICTED)
        _assert_same_pools_and_policy(sides)


PAGE_BYTES = {SWA: 37, C4S: 23, C4KV: 50, C128S: 19, C128KV: 7, IDX: 11}  # invented, as test_arena_stateful


@settings(max_examples=10, deadline=None)
@given(st.sampled_from([6000, 8000]), st.sampled_from([1, 2]),
       st.sampled_from(["prompt-boundaries", "prefill-per-byte"]),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1400), st.integers(1, 1500), st.integers(0, 300)),
                min_size=3, max_size=8))
def test_state_groups_evict_in_batches_as_one_entry_at_a_time(budget, slab_pages, policy, program):
    """On a shared arena tight enough to pack prompt checkpoints, evict and move slabs:
    the state pools' batches (``evict_many``: each batch and the rest of its units taken from
    the state groups in one pass) and the history pools' packing batches (``evict_batch``)
    against the same managers with them cleared (each entry, then its unit, one at a time):
    the same events in the same order, the same value report (entries, usable ones, evicted
    pages by reason), free ids, slab moves, removed entries per group and ("prefill-per-byte")
    checkpoint failures."""
    assert _arena_run(budget, slab_pages, policy, program, True) == _arena_run(budget, slab_pages, policy, program,
                                                                                 False)


def test_history_groups_pack_in_batches_as_one_entry_at_a_time():
    """Packing a history pool's idle low-priority blocks takes them in batches (``PagePool.evict_batch``), each
    ending with the first block whose eviction may demote entries (``ValueEviction.stirs``: one not cut off yet),
    the flags scanned again after it: batches of several blocks, some ending with such a block, leave as one block
    at a time (``stirs`` true of every block, no ``evict_batch``) would: the same events, value report, free ids,
    slab moves, evicted pages and removed entries."""
    program = [(3, 0, 1847, 100), (3, 404, 2076, 100), (1, 0, 2898, 100), (3, 2186, 1686, 100), (1, 1541, 1520, 100),
               (0, 2096, 2701, 100), (1, 0, 2149, 100)]
    batches = []
    batched = _arena_run(20000, 1, "prompt-boundaries", program, True, 1024, 3000, 4000, batches, slabs_ahead=0)
    assert batched == _arena_run(20000, 1, "prompt-boundaries", program, False, 1024, 3000, 4000, slabs_ahead=0)
    assert {stirs for n, stirs in batches if n >= 2} == {False, True}  # batches of blocks ending either way


def _arena_run(budget, slab_pages, policy, program, batched, chunk_tokens=256, stem_tokens=1400, prompt_tokens=1500,
               batches=None, slabs_ahead=None):
    """A manager on a shared arena serving ``program`` (stem, tokens shared with it, fresh tokens, answer tokens
    per request, one after another, its prompt cut to ``prompt_tokens``); without ``batched``, its state pools evict each entry then its unit, its history
    pools pack one block at a time. ``batches``: each history pool's packing batch (blocks, whether the last stirs)
    logged there; ``slabs_ahead``: the arena's, if given (the fixed program below packs as it was written to with
    none). Returns its events, value report, free ids, slab moves, evicted pages, removed entries and
    ("prefill-per-byte") checkpoint failures."""
    from hybridkv.memory.arena import arena_geometry

    geometry = arena_geometry(PAGE_BYTES, budget, anchor_group=C4KV, slab_anchor_pages=slab_pages)
    mgr = CacheManager(SPECS, None, max_context_tokens=8192, enable_prefix_caching=True, arena=geometry,
                       prompt_checkpoints=None, checkpoint_policy=policy)
    if slabs_ahead is not None:
        mgr.arena.slabs_ahead = slabs_ahead
    for g in STATE if not batched else ():
        mgr.pools[g].evict_many = None
    for pool in [mgr.pools[g] for g in HISTORY]:
        if not batched:
            pool.stirs, pool.evict_batch = (lambda key: True), None
        elif batches is not None:
            pool.evict_batch = lambda keys, cause, evict=pool.evict_batch, stirs=pool.stirs: (
                batches.append((len(keys), stirs(keys[-1]))), evict(keys, cause))[1]
    stems = [ids(150 + s, stem_tokens) for s in range(4)]
    for i, (stem, shared, fresh, answer) in enumerate(program):
        prompt = cat(stems[stem][:shared], ids(1000 + i, fresh))[:prompt_tokens]
        run_request(mgr, f"q{i}", prompt, ids(2000 + i, answer + 1), chunk_tokens=chunk_tokens)
    return (mgr.prefix.drain_events(), mgr.prefix.value_report(), {g: mgr.pools[g].free_page_ids().tolist() for g in ALL},
            mgr.arena.slab_moves, {g: s.evicted_pages for g, s in mgr.stats().items()},
            {g: mgr.prefix.stats[g].removed_entries for g in ALL},
            None if mgr.prefix.values is None else dict(mgr.prefix.values.failures))


def _assert_same_pools_and_policy(sides):
    """The fast side's pools (flags, entries, LRU order), value report and the keys it knows (their
    origins: a node forgotten once nothing is published under it, below it or beyond it) equal the
    reference's."""
    (ref_pools, ref_policy), (pools, policy) = sides
    for gid, pool in pools.items():
        assert pool.low_priority.tolist() == ref_pools[gid].low_priority.tolist()
        assert pool.entry_keys() == ref_pools[gid].entry_keys()
        assert pool.evictable_page_ids().tolist() == ref_pools[gid].evictable_page_ids().tolist()  # LRU order
    assert policy.report() == ref_policy.report()
    keys = [f"k{j}" for j in range(1, 8)]
    assert [policy.origin(key) for key in keys] == [ref_policy.origin(key) for key in keys]
