"""The checkpoint policies (hybridkv.prefix.checkpoints): which boundaries keep a checkpoint,
which goes first under pressure, worked by hand; their errors; a property for all four.

Same small DeepSeek-V4 group set and helpers as tests/test_prefix.py (grain 256,
whole-window checkpoints: a window-KV checkpoint is 2 pages of 64 tokens).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.prefix.checkpoints import (
    ATTENTION_EQUAL_DEPTH_TOKENS,
    CHECKPOINT_POLICIES,
    OWN,
    REUSED,
    SPECULATIVE,
    CheckpointValues,
    saved_prefill,
)
from hybridkv.prefix.checkpoints import checkpoint_policy as policy_from_options
from test_prefix import C4KV, C4S, C128KV, C128S, IDX, STATE, SWA, cat, events_of, ids, make_manager, run_request

POLICY_OPTIONS = {
    "prompt-boundaries": {},
    "terminal-and-junctions": {},
    "interval": {"checkpoint_interval_tokens": 512},
    "prefill-per-byte": {},
}


def manager(policy: str, **options):
    return make_manager(prompt_checkpoints=None, checkpoint_policy=policy, **POLICY_OPTIONS[policy], **options)


def held_boundaries(mgr, events) -> list[int]:
    """Boundaries of the checkpoints the window group holds now; every state group
    holds the same keys (a checkpoint is a unit)."""
    assert len({frozenset(mgr.pools[g].entry_keys()) for g in STATE}) == 1
    stored = {int(e.block_hash, 16): e.tokens for e in events if e.kind == "stored" and e.group_id == SWA}
    return sorted(stored[k] for k in mgr.pools[SWA].entry_keys())


# --------------------------------------------------------------------------- placement


@pytest.mark.parametrize("policy, stored, kept, low_pages", [
    # 600-token prompt in one step, 1,000-token answer fed back a token a step: commits
    # cross 256 + 512 (the prefill, 512 the latest); decode crosses 768, 1,024, 1,280,
    # 1,536 past the prompt, each checkpoint held in place of the last, and the free
    # publishes 1,536, the terminal (committed 1,599) with the blocks since 512. The
    # interval policy keeps 1,024 and 1,536 past the prompt: those crossings commit.
    ("prompt-boundaries", [256, 512, 1536], [256, 512, 1536], 4),  # 256, 512 low
    ("terminal-and-junctions", [512, 1536], [1536], 0),  # 512 superseded: unpublished
    ("interval", [512, 1024, 1536], [512, 1024, 1536], 4),  # multiples of 512, low
    ("prefill-per-byte", [256, 512, 1536], [256, 512, 1536], 0),  # the next test
])
def test_which_boundaries_keep_a_checkpoint(policy, stored, kept, low_pages):
    mgr = manager(policy)
    run_request(mgr, "a", ids(1, 600), ids(2, 1000))
    events = mgr.prefix.drain_events()
    assert events_of(events, "stored", SWA) == stored
    assert held_boundaries(mgr, events) == kept
    assert mgr.pools[SWA].num_low_priority_idle_pages == low_pages
    assert mgr.prefix.checkpoint_policy == policy


def test_prefill_per_byte_classes_after_one_request():
    """The request above, by the class rules: 256 published speculative; 512 and 1,536
    published own; 512 superseded inside the prompt: kept, now speculative; 768, 1,024,
    1,280 held past the prompt and let go, never published: counted nowhere (no
    terminals); 1,536 the terminal. No hit, nothing evicted: every class at the prior
    1/2, normal priority."""
    mgr = manager("prefill-per-byte")
    run_request(mgr, "a", ids(1, 600), ids(2, 1000))
    values, events = mgr.prefix.values, mgr.prefix.drain_events()
    keys = {e.tokens: int(e.block_hash, 16) for e in events if e.kind == "stored" and e.group_id == SWA}
    assert sorted(keys) == [256, 512, 1536]
    assert [values.kind(keys[d]) for d in (256, 512, 1536)] == [SPECULATIVE, SPECULATIVE, OWN]
    assert values.successes == values.failures == {SPECULATIVE: 0, OWN: 0, REUSED: 0}
    assert [values.expected_reuse(k) for k in (SPECULATIVE, OWN, REUSED)] == [0.5, 0.5, 0.5]


# --------------------------------------------------------------------------- order


def three_questions_on_one_document(policy: str, swa_pages: int | None = None):
    """a, b, c: one 512-token document, each with its own 300-token question (812-token
    prompts, no answer). a publishes 256 and 512 (speculative) and its terminal at 768;
    b and c hit at 512 (their block 768 differs) and leave terminals at 768 of their own."""
    mgr = manager(policy, group_pages=None if swa_pages is None else {SWA: swa_pages})
    doc = ids(10, 512)
    hits = [run_request(mgr, q, cat(doc, ids(11 + i, 300))).hit_tokens for i, q in enumerate("abc")]
    assert hits == [0, 512, 512]
    events = mgr.prefix.drain_events()
    keys = {}
    for e in events:
        if e.kind == "stored" and e.group_id == SWA:
            keys.setdefault(e.tokens, []).append(int(e.block_hash, 16))
    names = {keys[256][0]: "256", keys[512][0]: "512"}
    names.update({k: f"{q}768" for q, k in zip("abc", keys[768])})
    return mgr, doc, names


def test_prefill_per_byte_order_by_hand():
    """Scores at c's free (clock 3), worked from the rule. Successes: speculative 1 (b's
    hit at 512, which made it reused), reused 1 (c's); no failures (nothing left the
    cache). Expected reuse: speculative 2/3, own 1/2, reused 2/3; no class below the
    floor. saved_prefill: 256.25 (256), 513 (512), 770.25 (768); pinned: D + 1,046.

        256   log2(256.25 * 2/3 / 1302) - 3/64 = -2.977   (last use: published, clock 0)
        a768  log2(770.25 / 2 / 1814)   - 3/64 = -2.283
        b768  -2.236 - 2/64 = -2.267,  c768  -2.236 - 1/64 = -2.251
        512   log2(513 * 2/3 / 1558)    - 1/64 = -2.203   (c's hit at clock 2)

    So 256 goes first, the document's end last."""
    mgr, _, names = three_questions_on_one_document("prefill-per-byte")
    values = mgr.prefix.values
    assert (values.successes, values.failures) == ({SPECULATIVE: 1, OWN: 0, REUSED: 1},
                                                   {SPECULATIVE: 0, OWN: 0, REUSED: 0})
    by_name = {n: k for k, n in names.items()}
    assert values.order_key(by_name["256"])[0] == pytest.approx(math.log2(256.25 * 2 / 3 / 1302) - 3 / 64)
    assert values.order_key(by_name["512"])[0] == pytest.approx(math.log2(513 * 2 / 3 / 1558) - 1 / 64)
    assert values.order_key(by_name["a768"])[0] == pytest.approx(math.log2(770.25 / 2 / 1814) - 3 / 64)
    assert [names[k] for k in mgr.prefix.rank_checkpoints()] == ["256", "a768", "b768", "c768", "512"]
    assert mgr.pools[SWA].num_low_priority_idle_pages == 0


@pytest.mark.parametrize("policy, evicted, hit_d", [
    # prompt-boundaries: 256 and 512 are low priority (512 demoted again after c's hit,
    # so at the very front): both go in one pass (low-priority entries go up to 16 pages
    # beyond the need); d, the document with a fourth question, then misses.
    ("prompt-boundaries", {"512", "256"}, 0),
    # prefill-per-byte: everything at normal priority in score order (previous test):
    # 256, the lowest, goes alone; the document's end stays and d hits it.
    ("prefill-per-byte", {"256"}, 512),
])
def test_which_checkpoint_goes_first_under_pressure(policy, evicted, hit_d):
    """The window group has 24 pages: 10 hold the five checkpoints, 14 are free. x, an
    unrelated 1,000-token prompt in one step, needs 16 (ceil(1000 / 64)): 2 pages (one
    checkpoint) short."""
    mgr, doc, names = three_questions_on_one_document(policy, swa_pages=25)
    assert (mgr.pools[SWA].num_clean_free_pages, mgr.pools[SWA].num_evictable_pages) == (14, 10)
    run_request(mgr, "x", ids(20, 1000))
    removed = {names[int(e.block_hash, 16)] for e in mgr.prefix.drain_events()
               if e.kind == "removed" and e.group_id == SWA and int(e.block_hash, 16) in names}
    assert removed == evicted
    assert run_request(mgr, "d", cat(doc, ids(21, 300))).hit_tokens == hit_d


def test_values_by_hand():
    """The score pieces: saved prefill grows faster than depth; a class's expected reuse
    is (successes + 1) / (successes + failures + 2); what a hit pins is D + the
    checkpoint's tokens; age costs 1 / VALUE_HALF_LIFE_REQUESTS per request."""
    L = ATTENTION_EQUAL_DEPTH_TOKENS
    assert saved_prefill(L) == 1.5 * L  # token t costs 1 + t / L: L + L^2 / (2 L)
    assert saved_prefill(2048) / 2048 > saved_prefill(256) / 256
    assert saved_prefill(1024) == 1028  # 1024 + 1024^2 / 262144
    v = CheckpointValues(checkpoint_tokens=1024)
    v.published("k", 1024, speculative=True)
    assert v.order_key("k")[0] == pytest.approx(math.log2(1028 * 0.5 / 2048))
    v.request_freed()
    v.request_freed()
    assert v.order_key("k")[0] == pytest.approx(math.log2(1028 * 0.5 / 2048) - 2 / 64)
    v.hit("k")  # a success of speculative; now reused, used now
    assert (v.kind("k"), v.expected_reuse(SPECULATIVE), v.expected_reuse(REUSED)) == (REUSED, 2 / 3, 1 / 2)
    assert v.order_key("k")[0] == pytest.approx(math.log2(1028 / 2 / 2048))
    v.removed("k")  # left without a hit as reused: a failure of reused
    assert (v.kind("k"), v.failures[REUSED], v.expected_reuse(REUSED)) == (None, 1, 1 / 3)
    for i in range(4):  # four evicted unhit: a class drops to 1/6, below the floor
        for speculative in (True, False):
            v.published((i, speculative), 256, speculative=speculative)
            v.removed((i, speculative))
    assert (v.expected_reuse(SPECULATIVE), v.expected_reuse(OWN)) == (2 / 7, 1 / 6)
    assert (v.low_priority(SPECULATIVE), v.low_priority(OWN), v.low_priority(REUSED)) == (False, False, False)
    v.published(9, 256, speculative=True)
    v.removed(9)  # speculative: 1 success, 5 failures: 2/8 = the floor, not below
    v.published(10, 256, speculative=True)
    v.removed(10)  # 2/9: below; own, 1/6, never is (terminals stay normal)
    assert (v.low_priority(SPECULATIVE), v.low_priority(OWN)) == (True, False)
    with pytest.raises(ValueError, match="checkpoint_tokens must be positive"):
        CheckpointValues(checkpoint_tokens=0)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("options, match", [
    ({"checkpoint_policy": "every-boundary"}, r"checkpoint_policy must be one of \('prompt-boundaries', "),
    ({"checkpoint_policy": "interval"}, r"checkpoint_policy='interval' needs checkpoint_interval_tokens"),
    ({"checkpoint_interval_tokens": 512},
     r"checkpoint_interval_tokens applies to checkpoint_policy='interval' only, not 'prompt-boundaries'"),
    ({"checkpoint_policy": "interval", "checkpoint_interval_tokens": 300},
     r"must be a positive multiple of the grain 256, got 300"),
    ({"checkpoint_policy": "interval", "checkpoint_interval_tokens": -512}, r"positive multiple of the grain"),
    ({"checkpoint_policy": "interval", "checkpoint_interval_tokens": 512.0}, r"checkpoint_interval_tokens"),
    ({"checkpoint_policy": "prefill-per-byte", "prompt_checkpoints": True}, r"contradicts"),
])
def test_bad_policy_options_are_refused(options, match):
    options.setdefault("prompt_checkpoints", None)
    with pytest.raises(ValueError, match=match):
        make_manager(**options)


# --------------------------------------------------------------------------- property


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(CHECKPOINT_POLICIES), st.integers(1, 1400), st.integers(1, 700),
       st.sampled_from([256, 512, 2048]))
def test_one_request_leaves_exactly_the_policys_boundaries(policy, prompt_tokens, answer_tokens, chunk_tokens):
    """Without pressure, one request leaves a checkpoint at its terminal T = the last
    boundary of its P + A - 1 committed tokens, and at every boundary D < T its policy
    keeps: D <= P (prompt-boundaries, prefill-per-byte), D a multiple of 512 (interval),
    none (terminal-and-junctions); each is a usable hit for a prompt that goes past it."""
    mgr = manager(policy, pages=4096)
    prompt, answer = ids(30, prompt_tokens), ids(31, answer_tokens)
    run_request(mgr, "a", prompt, answer, chunk_tokens=chunk_tokens)
    committed = prompt_tokens + answer_tokens - 1
    terminal = committed // 256 * 256
    rule = {"prompt-boundaries": lambda d: d <= prompt_tokens, "prefill-per-byte": lambda d: d <= prompt_tokens,
            "interval": lambda d: d % 512 == 0, "terminal-and-junctions": lambda d: False}[policy]
    expected = [d for d in range(256, terminal, 256) if rule(d)] + ([terminal] if terminal else [])
    assert held_boundaries(mgr, mgr.prefix.drain_events()) == expected
    tokens = cat(prompt, answer[:-1], ids(32, 1))
    for d in expected:
        hit = mgr.add_request(f"probe{d}", tokens[: d + 1], max_new_tokens=1)
        assert hit.hit_tokens == d
        mgr.free(f"probe{d}")
    mgr.check_invariants()
    assert mgr.pools[C4KV].num_cached_pages == terminal // 256


@settings(max_examples=8, deadline=None)
@given(st.sampled_from(CHECKPOINT_POLICIES),
       st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1400), st.integers(1, 1200), st.integers(0, 400)),
                min_size=3, max_size=7))
def test_under_pressure_every_policy_keeps_units_and_usable_hits(policy, program):
    """Random requests over three shared stems, pools tight enough to evict in every
    group. Under every policy, after each request: the state groups hold the same
    checkpoints (a unit), the manager's invariants hold, and a hit is a multiple of the
    grain below the prompt's length that the next request of the same tokens repeats
    (a hit is usable: its checkpoint and history are both still cached)."""
    mgr = manager(policy, group_pages={SWA: 40, C4S: 240, C128S: 160, IDX: 240, C4KV: 14, C128KV: 14})
    stems = [ids(40 + s, 1400) for s in range(3)]
    for i, (stem, shared, fresh, answer) in enumerate(program):
        prompt = cat(stems[stem][:shared], ids(1000 + i, fresh))[:1500]
        hit = mgr.add_request(f"p{i}", prompt, max_new_tokens=1).hit_tokens
        mgr.free(f"p{i}")
        assert hit % 256 == 0 and hit <= len(prompt) - 1
        assert run_request(mgr, f"q{i}", prompt, ids(2000 + i, answer + 1), chunk_tokens=256).hit_tokens == hit
        assert len({frozenset(mgr.pools[g].entry_keys()) for g in STATE}) == 1
        report = mgr.prefix.value_report()
        assert all(report[g].usable_entries <= report[g].cached_entries for g in report)


def test_simulate_runs_each_policy(capsys):
    from hybridkv.cli import main

    for policy, extra in (("prefill-per-byte", []), ("interval", ["--checkpoint-interval-tokens", "1k"])):
        code = main(["simulate", "--requests", "6", "--checkpoint-policy", policy, *extra, "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert json.loads(out)["requests"] == 6


def test_hit_sweep_names_the_policy(capsys):
    """bench/hit_sweep.py: --checkpoint-policy reaches the hybridkv lines' manager and
    the JSON; a bad name or interval exits 2 before anything runs."""
    bench = str(Path(__file__).resolve().parent.parent / "bench")
    sys.path.insert(0, bench)
    try:
        import hit_sweep
    finally:
        sys.path.remove(bench)
    side = hit_sweep.make_side("hybridkv shared", 2 << 30, 8192, None, policy_from_options("interval", None, 1024, 256))
    assert (side.manager.prefix.checkpoint_policy, side.manager.prefix.checkpoint_interval_tokens) == ("interval", 1024)
    assert side.manager.prefix.thrash_guard
    assert not hit_sweep.make_side("hybridkv shared", 2 << 30, 8192, None, thrash_guard=False).manager.prefix.thrash_guard
    assert side.manager.prefix.demote_moved_past
    assert not hit_sweep.make_side("hybridkv shared", 2 << 30, 8192, None, moved_past=False).manager.prefix.demote_moved_past
    for argv, message in ((["--checkpoint-policy", "nope"], "invalid choice: 'nope'"),
                          (["--checkpoint-policy", "interval"], "'interval' needs --checkpoint-interval-tokens"),
                          (["--checkpoint-policy", "interval", "--checkpoint-interval-tokens", "300"],
                           "--checkpoint-interval-tokens must be a positive multiple of the grain 256, got 300"),
                          (["--checkpoint-interval-tokens", "512"], "applies to --checkpoint-policy 'interval' only")):
        with pytest.raises(SystemExit) as exit_:
            hit_sweep.main(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CHECKPOINT_POLICIES), st.integers(1, 8), st.integers(0, 40), st.integers(0, 40),
       st.integers(0, 12_000) | st.integers(1, 46).map(lambda k: k * 256))  # a prompt ending on a boundary too
def test_speculative_between_is_speculative_boundary_by_boundary(name, interval_grains, first, count, prompt):
    """``speculative_between`` (one range, what a commit asks) keeps exactly the crossed
    boundaries ``speculative`` keeps one by one, both as each policy's rule says (the reference)."""
    g = 256
    policy = policy_from_options(name, None, interval_grains * g if name == "interval" else None, g)
    lo, hi = (first + 1) * g, (first + 1 + count) * g
    rules = {"interval": lambda d: d % (interval_grains * g) == 0, "terminal-and-junctions": lambda d: False}
    expected = [d for d in range(lo, hi, g) if rules.get(name, lambda d: d <= prompt)(d)]
    assert list(policy.speculative_between(lo, hi, g, prompt)) == expected
    assert [d for d in range(lo, hi, g) if policy.speculative(d, prompt)] == expected


def test_prefill_per_byte_with_group_lru_evicts_each_pool_by_its_lru():
    """"group-lru" evicts each pool alone; the "prefill-per-byte" order ranked every state pool's checkpoints as one,
    so after the c4 state pool let go of a checkpoint the order no longer knew the indexer pool's idle page of it and
    the next eviction there stopped with "the checkpoint order lost idle pages" (an AssertionError inside schedule,
    found by an outside-user driver on a shared arena with load steps). With "group-lru" no order is kept."""
    import numpy as np

    from hybridkv.memory.arena import arena_geometry
    from hybridkv.models.deepseek_v4 import build_v4_cache_specs
    from hybridkv.runtime.manager import CacheManager

    specs = build_v4_cache_specs({"sliding_window": 16}, layer_ratio=[0, 4, 128])
    page_bytes = {SWA: 64, C4S: 64, C4KV: 128, C128S: 32, C128KV: 32, IDX: 64}
    m = CacheManager(specs, None, arena=arena_geometry(page_bytes, 8000, anchor_group=C4KV, slab_anchor_pages=2),
                     max_context_tokens=700, enable_prefix_caching=True, prefix_granularity=256,
                     eviction_policy="group-lru", checkpoint_policy="prefill-per-byte")
    rng = np.random.default_rng(0)
    p0 = rng.integers(0, 1000, 330, dtype=np.int32)
    m.add_request("r0", p0, max_new_tokens=1)
    m.schedule([("r0", 234)], load=True, write_slots=False)
    m.schedule([("r0", 74)])
    m.add_request("r1", prompt_tokens=345, max_new_tokens=355)
    m.schedule([("r1", 1)])
    m.add_request("r3", prompt_tokens=74, max_new_tokens=1)
    m.add_request("r4", np.concatenate([p0[:68], rng.integers(0, 1000, 113, dtype=np.int32)]), max_new_tokens=1)
    m.add_request("r5", rng.integers(0, 1000, 122, dtype=np.int32), max_new_tokens=578)
    m.schedule([("r5", 1), ("r1", 46), ("r4", 14), ("r3", 19), ("r0", 4)])
    m.free("r3")  # the checkpoint at 256 is ranked again
    m.add_request("r6", prompt_tokens=75, max_new_tokens=439)
    m.schedule([("r0", 4)], load=True, write_slots=False)
    evicted = {gid: st.evicted_pages for gid, st in m.stats().items()}
    m.schedule([("r4", 90), ("r5", 1), ("r0", 6), ("r6", 34)])  # both c4 state pools evict the checkpoint's page
    assert all(m.stats()[gid].evicted_pages == evicted[gid] + 1 for gid in (C4S, IDX))
    m.check_invariants()
