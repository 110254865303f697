"""The incremental "prefill-per-byte" order (hybridkv.checkpoints.CheckpointOrder)
against its reference, the full sort at every freed request
(PrefixCache.use_full_sort_ranking): same random programs, same decisions.

Same small DeepSeek-V4 group set as tests/test_prefix.py (grain 256)."""

from __future__ import annotations

import random

import pytest

from hybridkv.manager import CacheManagerError
from hybridkv.pool import PoolExhausted
from test_prefix import C4KV, C4S, C128KV, C128S, IDX, STATE, SWA, cat, ids, make_manager

TIGHT = {SWA: 40, C4S: 240, C128S: 160, IDX: 240, C4KV: 14, C128KV: 14}


def pair(group_pages):
    """An incremental manager and its full-sort reference."""
    fast = make_manager(prompt_checkpoints=None, checkpoint_policy="prefill-per-byte", group_pages=group_pages)
    slow = make_manager(prompt_checkpoints=None, checkpoint_policy="prefill-per-byte", group_pages=group_pages)
    slow.prefix.use_full_sort_ranking()
    return fast, slow


def step(mgr, program_step, stems, live, outcomes):
    """Apply one op to ``mgr``; append what it observed to ``outcomes``."""
    op, a, b, c = program_step
    if op == 0 and len(live) < 4:  # a new request over stem a: b shared tokens, c fresh
        rid = f"r{len(outcomes)}"
        prompt = cat(stems[a][:b], ids(1000 + len(outcomes), c + 1))[:1500]
        try:
            hit = mgr.add_request(rid, prompt, max_new_tokens=512)
        except (CacheManagerError, PoolExhausted) as e:
            outcomes.append(("refused", type(e).__name__))
            return
        live[rid] = [len(prompt), 0]
        outcomes.append(("hit", rid, hit.hit_tokens))
        return
    if not live:
        outcomes.append(("idle",))
        return
    rid = sorted(live)[a % len(live)]
    if op == 1:  # one step: prefill a chunk, or decode one token
        total, decoded = live[rid]
        done = mgr.num_computed_tokens(rid)
        if done < total:
            n = min(256 * (1 + b % 3), total - done)
        elif decoded < 400:  # decode a chunk: the window slides past a hit's checkpoint
            n = 1 + c % 97
            mgr.append_token_ids(rid, ids(5000 + c, n).tolist())
            live[rid][1] += n
        else:
            n = 0
        if n:
            try:
                mgr.schedule([(rid, n)])
                outcomes.append(("step", rid, n))
            except (CacheManagerError, PoolExhausted) as e:
                outcomes.append(("full", rid, type(e).__name__))
        return
    mgr.free(rid)  # op 2
    del live[rid]
    outcomes.append(("free", rid))


def observe(mgr):
    events = [(e.kind, e.group_id, e.block_hash, e.tokens) for e in mgr.prefix.drain_events()]
    report = {g: (r.cached_pages, r.usable_entries, dict(r.evicted_pages)) for g, r in mgr.prefix.value_report().items()}
    return events, report, {g: mgr.pools[g].num_low_priority_idle_pages for g in STATE}


def program_of(seed: int, ops: int = 90) -> list[tuple[int, int, int, int]]:
    """A random program of ``ops`` ops (``step``'s tuples), from ``seed``."""
    r = random.Random(seed)
    return [(r.randint(0, 2), r.randint(0, 2), r.randint(0, 1400), r.randint(0, 700)) for _ in range(ops)]


# Programs where a block evicted mid-chain (a gap, hybridkv.eviction) demotes checkpoints
# beyond it: there the incremental order and the full sort disagree on which demoted
# checkpoint is promoted back at a freed request (a known defect of both, found when the
# gap rule and this order were merged: neither should promote an entry eviction holds low).
GAP_SEEDS = (17, 31, 273715)


def run_both(seed):
    fast, slow = pair(TIGHT)
    stems = [ids(40 + s, 1500) for s in range(3)]
    live_fast, live_slow, out_fast, out_slow = {}, {}, [], []
    for op in program_of(seed):
        step(fast, op, stems, live_fast, out_fast)
        step(slow, op, stems, live_slow, out_slow)
        assert out_fast == out_slow
        assert observe(fast) == observe(slow)
    fast.check_invariants()


# Seeds 13 and 20 told apart an order that let a checkpoint hit and gone idle again
# since the last free keep its place from before the hit (the reference puts it
# behind, where it went idle); seed 3 one that demoted a class highest score first.
# Fixed seeds, not drawn: hypothesis finds the gap programs above in a few percent of draws.
@pytest.mark.parametrize("seed", [s for s in range(40) if s not in GAP_SEEDS])
def test_incremental_order_makes_the_full_sorts_decisions(seed):
    run_both(seed)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="gap-demoted checkpoints: the two orders promote differently")
@pytest.mark.parametrize("seed", GAP_SEEDS)
def test_the_orders_still_disagree_after_a_gap(seed):
    run_both(seed)


def test_full_sort_reference_needs_prefill_per_byte_and_an_empty_cache():
    mgr = make_manager(prompt_checkpoints=None, checkpoint_policy="prompt-boundaries")
    with pytest.raises(ValueError, match="use_full_sort_ranking needs checkpoint_policy='prefill-per-byte'"):
        mgr.prefix.use_full_sort_ranking()
    mgr, _ = pair(None)
    mgr.add_request("a", ids(1, 700), max_new_tokens=1)
    mgr.schedule([("a", 700)])
    mgr.free("a")
    with pytest.raises(ValueError, match="an empty cache"):
        mgr.prefix.use_full_sort_ranking()
