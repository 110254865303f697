"""Decode steps through ``schedule_uniform`` give the same step as ``schedule`` of pairs.

``fast`` takes every call as given; ``general`` (a ``Pairs`` wrapper) turns each
``schedule_uniform(ids, k)`` into ``schedule([(id, k), ...])``. Both get the same calls;
every ``StepBatch`` array, the prefix cache's entries and events must match.
Prompts end just below page and block boundaries, so decode steps cross page
boundaries in every group and release sliding pages.
"""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import event, given, settings

from hybridkv.memory.arena import arena_geometry
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_budget
from hybridkv.runtime.manager import CacheManager, CacheManagerError
from hybridkv.spec import CacheGroupSpec
from hybridkv.tables.mirror import BlockTableMirror
from test_arena_stateful import ANCHOR, PAGE_BYTES
from test_table_updates import CONFIGS


def pair(config, caching, seed, arena=False):
    """A fast and a general manager; ``arena``: on a shared arena (pools hand out their
    lowest free ids, releases wait in a pending list) of twice the pools' bytes."""
    specs, pages, ctx, step = CONFIGS[config]
    geometry = None
    if arena:
        budget = 2 * sum(n * PAGE_BYTES[config][gid] for gid, n in pages.items())
        geometry = arena_geometry(PAGE_BYTES[config], budget, anchor_group=ANCHOR[config])
    # Capture widths: a full-history group's is short enough to refuse long requests.
    widths = {s.group_id: -(-ctx // s.page_tokens) // (1 if s.is_sliding else 2) for s in specs}
    fast, general = (CacheManager(specs, None if arena else pages, max_context_tokens=ctx, max_step_tokens=step,
                                  shuffle_seed=seed, enable_prefix_caching=caching, arena=geometry, table_widths=widths,
                                  prefix_granularity=256 if config == "v4" else 60) for _ in range(2))
    return [fast, Pairs(general)]


class Pairs:
    """A manager whose uniform steps go through ``schedule`` of (id, count) pairs."""

    def __init__(self, manager):
        self.__dict__["_m"] = manager

    def __getattr__(self, name):
        return getattr(self._m, name)

    def schedule_uniform(self, request_ids, num_tokens, **options):
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool):
            return self._m.schedule_uniform(request_ids, num_tokens, **options)  # the same refusal
        return self._m.schedule([(rid, num_tokens) for rid in request_ids], **options)


def add_and_prefill(managers, prompts, *, vocab, chunk, max_new_tokens):
    """Requests r0, r1, ... with prompts of these lengths, prefilled one chunk at a time
    (every batch equal on both managers); their ids."""
    rids = tuple(f"r{i}" for i in range(len(prompts)))
    for rid, prompt in zip(rids, prompts):
        on_both(managers, "add_request", rid, np.arange(prompt, dtype=np.int32) % vocab, max_new_tokens=max_new_tokens)
        while managers[0].num_computed_tokens(rid) < prompt:
            n = min(chunk, prompt - managers[0].num_computed_tokens(rid))
            same(*on_both(managers, "schedule", [(rid, n)])[0])
    return rids


def same_cache(a, b):
    """Same prefix-cache entries (keys, pages, order), events and holds on both managers."""
    assert (a.prefix is None) == (b.prefix is None)
    if a.prefix is None:
        return
    assert a.prefix.drain_events() == b.prefix.drain_events()
    for s in a.specs:
        pa, pb = a.pools[s.group_id], b.pools[s.group_id]
        assert pa.entry_keys() == pb.entry_keys(), s.group_id
        assert [pa.lookup(k) for k in pa.entry_keys()] == [pb.lookup(k) for k in pb.entry_keys()], s.group_id
        assert a.prefix.stats[s.group_id] == b.prefix.stats[s.group_id]
        assert np.array_equal(pa.ref_counts, pb.ref_counts), s.group_id  # holds included


def table_ends(m, rids, gid):
    """Each request's end of its table (base logical page + pages held) in group ``gid``."""
    return np.array([base + pages.size for base, pages in (m.request_pages(r, gid) for r in rids)])


def same(a, b, tables=True):
    """Equal batches (``tables=False``: block tables not compared, one side in updates mode)."""
    assert a.request_ids == b.request_ids
    for name in ("num_scheduled_tokens", "query_start_loc", "positions", "request_indices", "table_rows"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    for gid, gb in b.groups.items():
        ga = a.groups[gid]
        for name in ("block_table", "base_pages", "write_slots")[0 if tables else 1 :]:
            x, y = getattr(ga, name), getattr(gb, name)
            assert (x is None) == (y is None)
            if x is not None:
                assert x.dtype == y.dtype and np.array_equal(x, y), (gid, name)


def on_both(managers, method, *args, **kwargs):
    results, errors = [], []
    for m in managers:
        try:
            results.append(getattr(m, method)(*args, **kwargs))
            errors.append(None)
        except CacheManagerError as exc:
            results.append(None)
            errors.append(str(exc))
    assert errors[0] == errors[1]
    return results, errors[0]


@settings(max_examples=50, deadline=None)
@given(config=st.sampled_from(sorted(CONFIGS)), caching=st.booleans(), seed=st.sampled_from([None, 5]),
       data=st.data())
def test_fast_path_equals_general_path(config, caching, seed, data):
    managers = pair(config, caching, seed)
    specs, _, ctx, step_limit = CONFIGS[config]
    big = max(s.page_tokens for s in specs)
    rng = np.random.default_rng(data.draw(st.integers(0, 999), label="rng"))
    live = {}
    crossed = set()
    for i in range(data.draw(st.integers(1, 4), label="requests")):
        # Just below a boundary of the widest page span: decode crosses every group's pages.
        blocks = data.draw(st.integers(1, max(1, (ctx - 40) // big)), label="blocks")
        prompt = max(1, blocks * big - data.draw(st.integers(1, 6), label="short"))
        ids = rng.integers(0, 30, prompt).astype(np.int32)
        rid = f"r{i}"
        _, err = on_both(managers, "add_request", rid, ids, max_new_tokens=30)
        if err is None:
            live[rid] = prompt
    while live:  # prefill every prompt
        todo = [(rid, min(step_limit, p - managers[0].num_computed_tokens(rid))) for rid, p in live.items()
                if managers[0].num_computed_tokens(rid) < p]
        if not todo:
            break
        batches, err = on_both(managers, "schedule", todo)
        if err is not None:
            return
        same(*batches)
    for _ in range(data.draw(st.integers(1, 24), label="steps")):
        kind = data.draw(st.sampled_from(["decode", "decode", "verify", "mixed", "subset", "undo"]), label="kind")
        rids = sorted(live)
        if kind == "subset":
            rids = data.draw(st.lists(st.sampled_from(sorted(live)), min_size=1, unique=True), label="subset")
        k = data.draw(st.integers(2, 4), label="k") if kind == "verify" else 1
        counts = [data.draw(st.integers(1, 3), label="n") if kind == "mixed" else k for _ in rids]
        items = [(rid, n) for rid, n in zip(rids, counts)]
        for rid, n in items:
            ids = rng.integers(0, 30, n).astype(np.int32)
            on_both(managers, "append_token_ids", rid, ids)
        before = {s.group_id: table_ends(managers[0], rids, s.group_id) for s in specs}
        batches, err = on_both(managers, "schedule", items)
        if err is not None:
            event("step refused (same reason on both)")
            break
        same(*batches)
        for s in specs:
            if (table_ends(managers[0], rids, s.group_id) > before[s.group_id]).any():
                crossed.add(s.group_id)
        if kind in ("verify", "undo"):  # undo: a decode step's token rejected (pages it took go back)
            keep = [(rid, managers[0].num_computed_tokens(rid) - data.draw(st.integers(0, k), label="rej"))
                    for rid in rids]
            on_both(managers, "rewind_many", keep)
    event(f"groups crossing a page boundary while decoding: {len(crossed)} of {len(specs)}")
    for m in managers:
        m.check_invariants()
    same_cache(*managers)


def test_decode_crosses_every_group_and_matches():
    """A deterministic case: 300 decode steps from just below a block boundary."""
    managers = pair("v4", True, 5)
    specs = CONFIGS["v4"][0]
    for i, prompt in enumerate((250, 509)):
        on_both(managers, "add_request", f"r{i}", np.arange(prompt, dtype=np.int32) % 40, max_new_tokens=300)
        while managers[0].num_computed_tokens(f"r{i}") < prompt:
            n = min(64, prompt - managers[0].num_computed_tokens(f"r{i}"))
            same(*on_both(managers, "schedule", [(f"r{i}", n)])[0])
    allocated = {s.group_id: managers[0].stats()[s.group_id].allocated_pages for s in specs}
    released = {s.group_id: managers[0].stats()[s.group_id].released_pages for s in specs}
    for _ in range(300):
        for rid in ("r0", "r1"):
            on_both(managers, "append_token_ids", rid, [7])
        same(*on_both(managers, "schedule", [("r0", 1), ("r1", 1)])[0])
    stats = managers[0].stats()
    for s in specs:
        assert stats[s.group_id].allocated_pages > allocated[s.group_id], s.group_id
        if s.is_sliding:
            assert stats[s.group_id].released_pages > released[s.group_id], s.group_id
    same_cache(*managers)


@pytest.mark.parametrize("caching, arena", [(True, False), (False, False), (True, True)])
def test_long_uniform_decode_runs_match_the_general_path(caching, arena):
    """schedule_uniform over hundreds of steps (planned several steps at a time on
    the fast side), with a rewind and a changed batch cutting runs short."""
    managers = pair("v4", caching, None if arena else 5, arena)  # an arena: lowest ids first
    # r0 and r1 cross 256-token pages at the same steps
    rids = add_and_prefill(managers, (250, 506, 1000, 3), vocab=40, chunk=64, max_new_tokens=400)
    for step in range(260):  # the test pool runs short at ~280
        batch = rids[:3] if 100 <= step < 113 else rids  # r3 sits out 13 steps
        on_both(managers, "append_token_ids_many", batch, np.full((len(batch), 1), step % 40))
        same(*on_both(managers, "schedule_uniform", batch, 1)[0])
        if step == 200:  # a rejected token: the run restarts from a rewound request
            on_both(managers, "rewind", "r1", managers[0].num_computed_tokens("r1") - 1)
        if step % 50 == 0:
            for m in managers:
                m.check_invariants()
    for m in managers:
        m.check_invariants()
    same_cache(*managers)


@pytest.mark.parametrize("caching", [True, False])
def test_decode_with_odd_page_spans_matches_the_general_path(caching):
    """Page spans of 2 to 10 tokens, not all powers of two (floor division), decoded
    for 200 steps: every step equals the general path's."""
    from test_table_updates import ODD_SPECS

    fast, general = (CacheManager(ODD_SPECS, {s.group_id: 400 for s in ODD_SPECS}, max_context_tokens=400,
                                  max_step_tokens=12, shuffle_seed=3, enable_prefix_caching=caching,
                                  prefix_granularity=60) for _ in range(2))
    out = [fast, Pairs(general)]
    # r0 and r2 cross grain boundaries at the same steps
    rids = add_and_prefill(out, (5, 13, 65, 2), vocab=7, chunk=12, max_new_tokens=300)
    mirror = BlockTableMirror.for_manager(out[0])
    for step in range(200):
        batch = rids[1:] if 60 <= step < 67 else rids
        on_both(out, "append_token_ids_many", batch, np.full((len(batch), 1), step % 7))
        fast = out[0].schedule_uniform(batch, 1, block_tables="updates")
        general = out[1].schedule_uniform(batch, 1)  # full tables
        same(fast, general, tables=False)
        mirror.apply(fast)  # the fast side's table updates rebuild the general side's tables
        for gid, table in mirror.block_tables().items():
            assert np.array_equal(table, general.groups[gid].block_table), (step, gid)
        if step == 120:
            on_both(out, "rewind", "r2", out[0].num_computed_tokens("r2") - 2)
    for m in out:
        m.check_invariants()
    same_cache(*out)


@settings(max_examples=25, deadline=None)
@given(caching=st.booleans(), arena=st.booleans(), data=st.data())
def test_random_uniform_decode_programs_match_the_general_path(caching, arena, data):
    """Runs of ``schedule_uniform`` decode steps broken at random: a request sits out
    or comes back, one is rewound, block-table mode, write slots and fixed widths
    switch; every step equals the general path's."""
    managers = pair("v4", caching, None if arena else 5, arena)
    rng = np.random.default_rng(data.draw(st.integers(0, 999), label="rng"))
    prompts = data.draw(st.lists(st.integers(1, 700), min_size=1, max_size=4), label="prompts")
    rids = add_and_prefill(managers, prompts, vocab=40, chunk=64, max_new_tokens=200)
    live = list(rids)
    for step in range(data.draw(st.integers(20, 120), label="steps")):
        event_kind = data.draw(st.sampled_from(["none"] * 12 + ["out", "back", "rewind", "full", "no slots", "fixed"]),
                               label="event")
        if event_kind == "out" and len(live) > 1:
            live.remove(data.draw(st.sampled_from(live), label="out"))
        elif event_kind == "back":
            back = data.draw(st.sampled_from(rids), label="back")
            live = [r for r in rids if r in live or r == back]
        elif event_kind == "rewind":
            rid = data.draw(st.sampled_from(live), label="rewound")
            keep = max(1, managers[0].num_computed_tokens(rid) - data.draw(st.integers(0, 2), label="by"))
            on_both(managers, "rewind", rid, keep)
        batch = tuple(live)
        on_both(managers, "append_token_ids_many", batch, rng.integers(0, 40, (len(batch), 1)))
        batches, err = on_both(managers, "schedule_uniform", batch, 1,
                               block_tables="full" if event_kind == "full" else "updates",
                               write_slots=event_kind != "no slots", fixed_width=event_kind == "fixed")
        if err is not None:
            event("step refused (same reason on both)")
            break
        same(*batches)
    for m in managers:
        m.check_invariants()
    same_cache(*managers)


def test_fixed_width_decode_refuses_at_the_capture_width():
    """Fixed-width decode steps: a request whose full-history
    tables outgrow the capture width (3 pages = 768 tokens) is refused at the same step,
    with the same reason, as on the general path."""
    managers = pair("v4", True, 5)
    rids = add_and_prefill(managers, (740, 300), vocab=40, chunk=64, max_new_tokens=100)
    for step in range(60):
        on_both(managers, "append_token_ids_many", rids, np.full((2, 1), step % 40))
        batches, err = on_both(managers, "schedule_uniform", rids, 1, fixed_width=True)
        if err is not None:
            break
        same(*batches)
    assert managers[0].num_computed_tokens("r0") == 768  # token 769 would need a fourth page
    assert "capture width" in err


def test_a_refused_decode_step_changes_nothing():
    """A step refused at admission (capture width) changes nothing: the same batch
    then verifies two tokens (a plan from the bounds the last step left) and decodes
    on, as on the general path."""
    managers = pair("v4", True, 5)
    rids = add_and_prefill(managers, (740, 300), vocab=40, chunk=64, max_new_tokens=100)
    mirror, refused = BlockTableMirror.for_manager(managers[0]), 0
    for step in range(60):
        on_both(managers, "append_token_ids_many", rids, np.full((2, 1), step % 40))
        while True:
            fast = general = None
            try:
                count = 2 if refused and managers[0].num_computed_tokens("r0") == 768 else 1
                fast = managers[0].schedule_uniform(rids, count, fixed_width=refused == 0, block_tables="updates")
                general = managers[1].schedule_uniform(rids, count, fixed_width=refused == 0)  # full tables
            except CacheManagerError as exc:
                assert "capture width" in str(exc) and fast is None  # refused on the fast side first
                with pytest.raises(CacheManagerError, match="capture width"):
                    managers[1].schedule_uniform(rids, 1, fixed_width=True)
                refused += 1  # then two tokens each, without capture widths
                on_both(managers, "append_token_ids_many", rids, np.full((2, 1), 3))
                continue
            break
        same(fast, general, tables=False)
        mirror.apply(fast)  # the fast side's table updates rebuild the general side's tables
        for gid, table in mirror.block_tables().items():
            assert np.array_equal(table, general.groups[gid].block_table), (step, gid)
    assert refused == 1 and managers[0].num_computed_tokens("r0") == 801
    for m in managers:
        m.check_invariants()
    same_cache(*managers)


def test_decode_after_the_table_store_grows_matches():
    """Rows beyond the store's first 64 (it regrows, moving base, hi and cells) between
    repeated decode steps: the fast path's kept cells and base/hi slots are not reused."""
    managers = pair("v4", True, 5)
    for i, prompt in enumerate((250, 509)):
        on_both(managers, "add_request", f"r{i}", np.arange(prompt, dtype=np.int32) % 40, max_new_tokens=300)
        while managers[0].num_computed_tokens(f"r{i}") < prompt:
            n = min(64, prompt - managers[0].num_computed_tokens(f"r{i}"))
            same(*on_both(managers, "schedule", [(f"r{i}", n)])[0])
    rows_before = next(iter(managers[0].tables.values())).table_set.rows_capacity
    for step in range(40):
        if step == 20:  # idle requests take rows 2..71: the store grows past 64 rows
            for k in range(70):
                on_both(managers, "add_request", f"idle{k}", np.arange(3, dtype=np.int32), max_new_tokens=1)
        for rid in ("r0", "r1"):
            on_both(managers, "append_token_ids", rid, [7])
        same(*on_both(managers, "schedule_uniform", ("r0", "r1"), 1, block_tables="updates")[0])
    assert next(iter(managers[0].tables.values())).table_set.rows_capacity > rows_before == 64
    for m in managers:
        m.check_invariants()
    same_cache(*managers)


@pytest.mark.parametrize("interval", [None, 512])
def test_decode_commits_of_shared_content_match(interval):
    """Decode crossings commit one block each; through ``schedule_uniform`` and through
    pairs they give the same entries, events and holds, also when requests share their
    content (a block already published, a checkpoint held twice) and under a checkpoint
    interval."""
    specs = CONFIGS["v4"][0]
    pages = {s.group_id: 2_000 for s in specs}
    managers = [CacheManager(specs, pages, max_context_tokens=2_048, max_step_tokens=256,
                             enable_prefix_caching=True, prefix_granularity=256,
                             state_checkpoint_interval=interval) for _ in range(2)]
    managers[1] = Pairs(managers[1])
    shared = np.arange(700, dtype=np.int32) % 50
    prompts = {"a": shared, "b": shared.copy(), "c": np.concatenate([shared[:300], shared[:100] + 1])}
    for rid, ids in prompts.items():
        on_both(managers, "add_request", rid, ids, max_new_tokens=700)
    for start in range(0, 700, 256):
        same(*on_both(managers, "schedule", [(rid, min(256, ids.size - start)) for rid, ids in prompts.items()
                                             if start < ids.size])[0])
    rng = np.random.default_rng(3)
    for step_index in range(650):
        tokens = rng.integers(0, 50, 1)  # a and b generate the same tokens: same keys
        for rid in prompts:
            on_both(managers, "append_token_ids", rid, tokens if rid != "c" else tokens + 1)
        same(*on_both(managers, "schedule_uniform", list(prompts), 1)[0])
        if step_index == 400:
            on_both(managers, "free", "b")
            prompts.pop("b")
    assert managers[0].prefix.stats[specs[0].group_id].stored_entries > 0
    for m in managers:
        m.check_invariants()
    same_cache(*managers)


def test_bool_and_float_counts_are_refused_in_a_decode_batch():
    specs, pages, ctx, step = CONFIGS["odd"]
    m = CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step)
    for rid in ("a", "b"):
        m.add_request(rid, prompt_tokens=4, max_new_tokens=4)
    m.schedule([("a", 4), ("b", 4)])
    for bad in (True, 1.0):
        with pytest.raises(CacheManagerError, match="token count must be an int"):
            m.schedule([("a", 1), ("b", bad)])
        assert m.num_computed_tokens("a") == 4 and m.num_computed_tokens("b") == 4
    # Counts are checked with builtins on the tuple: out of range, the per-item path words it.
    for bad, message in ((0, "token count must be positive"), (-1, "token count must be positive"),
                         (np.int64(0), "token count must be positive"), (step + 1, "per-step limit"),
                         (np.uint64(2**63 + 1), "per-step limit"), (2**70, "per-step limit")):
        with pytest.raises(CacheManagerError, match=message):
            m.schedule([("a", 1), ("b", bad)])
        assert m.num_computed_tokens("a") == 4 and m.num_computed_tokens("b") == 4
    batch = m.schedule([("a", np.int64(1)), ("b", 1)])  # numpy ints are counts
    assert batch.num_scheduled_tokens.tolist() == [1, 1]
    batch = m.schedule([("a", 1), ("b", 2)])
    assert batch.num_scheduled_tokens.tolist() == [1, 2] and batch.positions.tolist() == [5, 5, 6]


def prefilled_twins(seed, prompt_lengths, *, max_new_tokens):
    """Two identical V4 managers (caching on) with one request per prompt length,
    prefilled in 64-token chunks (every batch compared); the rng and request ids."""
    specs, pages, ctx, step = CONFIGS["v4"]
    managers = [CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step,
                             enable_prefix_caching=True, prefix_granularity=256) for _ in range(2)]
    rng = np.random.default_rng(seed)
    prompts = {f"r{i}": rng.integers(0, 30, n).astype(np.int32) for i, n in enumerate(prompt_lengths)}
    for rid, ids in prompts.items():
        on_both(managers, "add_request", rid, ids, max_new_tokens=max_new_tokens)
        while (done := managers[0].num_computed_tokens(rid)) < ids.size:
            same(*on_both(managers, "schedule", [(rid, min(64, ids.size - done))])[0])
    return managers, rng, list(prompts)


def test_schedule_uniform_equals_schedule_of_pairs():
    """Decode and verify steps through ``schedule_uniform`` give what ``schedule`` gives
    for the same (id, count) pairs, in both block-table modes."""
    managers, rng, rids = prefilled_twins(0, (60, 250, 130), max_new_tokens=400)
    for i in range(300):
        k = 3 if i % 7 == 0 else 1
        for rid in rids:
            on_both(managers, "append_token_ids", rid, rng.integers(0, 30, k).astype(np.int32))
        mode = "updates" if i % 2 else "full"
        a = managers[0].schedule_uniform(rids, k, block_tables=mode)
        b = managers[1].schedule([(rid, k) for rid in rids], block_tables=mode)
        same(a, b)
        assert a.request_ids == tuple(rids)
        if i % 7 == 0:
            keep = [(rid, managers[0].num_computed_tokens(rid) - 2) for rid in rids]
            on_both(managers, "rewind_many", keep)
    same_cache(*managers)


@pytest.mark.parametrize("request_ids, count, message", [
    ([], 1, "empty batch"),
    (["a", "nope"], 1, "unknown request 'nope'"),
    (["a", "a"], 1, "appears twice"),
    (["a", "b"], True, "token count must be an int"),
    (["a", "b"], 0, "token count must be positive"),
    (["a", "b"], 5, "exceeds its declared total"),
])
def test_schedule_uniform_refuses_what_schedule_refuses(request_ids, count, message):
    specs, pages, ctx, step = CONFIGS["odd"]
    m = CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step)
    for rid in ("a", "b"):
        m.add_request(rid, prompt_tokens=4, max_new_tokens=4)
    m.schedule_uniform(["a", "b"], 4)
    with pytest.raises(CacheManagerError, match=message):
        m.schedule_uniform(request_ids, count)
    assert m.num_computed_tokens("a") == 4 and m.num_computed_tokens("b") == 4
    batch = m.schedule_uniform(("a", "b"), np.int64(2))  # numpy ints are counts
    assert batch.num_scheduled_tokens.tolist() == [2, 2]


def test_steps_without_write_slots_change_nothing_else():
    """``write_slots=False`` leaves every group's write slots None and everything else
    (the batch, table updates, later steps' slots) as a manager that always builds them."""
    managers, rng, rids = prefilled_twins(1, (70, 300, 129), max_new_tokens=300)
    skipped = 0
    for i in range(200):
        k = 2 if i % 9 == 0 else 1
        for rid in rids:
            on_both(managers, "append_token_ids", rid, rng.integers(0, 30, k).astype(np.int32))
        slots = i % 3 != 0  # runs of decode steps with and without write slots
        mode = "updates" if i % 2 else "full"
        a = managers[0].schedule_uniform(rids, k, block_tables=mode, write_slots=slots)
        b = managers[1].schedule_uniform(rids, k, block_tables=mode)
        if slots:
            same(a, b)
        else:
            skipped += 1
            assert all(g.write_slots is None for g in a.groups.values())
            assert all(g.write_slots is not None for g in b.groups.values())
            for gid, g in a.groups.items():
                assert (g.base_pages is None) == (b.groups[gid].base_pages is None)
                if g.base_pages is not None:
                    assert np.array_equal(g.base_pages, b.groups[gid].base_pages)
                if g.block_table is not None:
                    assert np.array_equal(g.block_table, b.groups[gid].block_table)
            for name in ("positions", "query_start_loc", "num_scheduled_tokens", "request_indices"):
                assert np.array_equal(getattr(a, name), getattr(b, name))
        if mode == "updates":
            ua, ub = a.table_updates, b.table_updates
            assert ua.widths == ub.widths and ua.reset == ub.reset
            for name in ("group", "row", "column", "page"):
                assert np.array_equal(getattr(ua, name), getattr(ub, name)), name
    assert skipped
    same_cache(*managers)
    with pytest.raises(CacheManagerError, match="write_slots must be True or False"):
        managers[0].schedule_uniform(rids, 1, write_slots=None)


# Four-token pages and a nine-token window: a decode step writing token 4k of a row takes
# its page k and lets go of page k - 3 in the same step, so a pool with no free page left
# can still take the step, on the pages its own releases free first.
COVER_SPECS = [
    CacheGroupSpec("w9", "sliding_window", rows_per_page=4, entry_stride_tokens=1, sliding_window_tokens=9),
    CacheGroupSpec("f16", "full_history", rows_per_page=16, entry_stride_tokens=1),
]


@pytest.mark.parametrize("caching", [False, True])
def test_a_short_free_stack_covered_by_the_steps_releases_matches_admission(caching):
    """``schedule_uniform`` (the compiled step) against ``check_admission`` then
    ``schedule`` of the same pairs (the admission path) on two equal managers whose
    window pool runs out of free pages: a step whose allocations its own releases
    cover gives the same batch, free counts and refusals on both. With prefix caching each row also holds the
    checkpoint of the last 16-token boundary it crossed past its prompt (its pages of tokens 16k - 9 .. 16k - 1,
    logical pages 4k - 3 .. 4k - 1): three pages more a row at the peak."""
    requests = 3
    held_pages = 3 * requests if caching else 0
    managers = [CacheManager(COVER_SPECS, {"w9": 3 * requests + 1 + held_pages, "f16": 64}, max_context_tokens=96,
                             enable_prefix_caching=caching, prefix_granularity=16) for _ in range(2)]
    fast, admitted = managers
    rids = tuple(f"r{i}" for i in range(requests))
    for k, rid in enumerate(rids):
        on_both(managers, "add_request", rid, np.arange(8, dtype=np.int32) + 100 * k, max_new_tokens=80)
        on_both(managers, "schedule", [(rid, 8)])
    short_steps = 0
    for step in range(72):
        on_both(managers, "append_token_ids_many", rids, np.full((requests, 1), step, dtype=np.int32))
        window = fast.pools["w9"]
        if fast.num_computed_tokens(rids[0]) % 4 == 0 and window.num_clean_free_pages < requests:
            short_steps += 1  # every row takes a page the stack does not hold
        items = [(rid, 1) for rid in rids]
        assert all(a.ok for a in admitted.check_admission(items))
        same(fast.schedule_uniform(rids, 1), admitted.schedule(items))
        assert fast.stats() == admitted.stats()
        fast.check_invariants()
    assert short_steps >= 5


def test_steps_that_commit_first_hand_out_their_cells_and_keep_every_batch():
    """Decode steps in "updates" mode in which rows cross a prefix grain (planned, the
    rows committed, then run into the cell buffers the planning call made): a mirror of
    them equals a full-mode twin's block tables step by step, and every batch's arrays
    stay as handed out while later steps run (each step's arrays are its own)."""
    specs, pages, ctx, step = CONFIGS["v4"]
    updates, full = (CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step,
                                  enable_prefix_caching=True, prefix_granularity=256) for _ in range(2))
    mirror = BlockTableMirror.for_manager(updates)
    prompts = {"a": 250, "b": 509, "c": 200}
    for rid, prompt in prompts.items():
        for m in (updates, full):
            m.add_request(rid, np.arange(prompt, dtype=np.int32) % 40, max_new_tokens=200)
        for start in range(0, prompt, step):
            n = min(step, prompt - start)
            mirror.apply(updates.schedule([(rid, n)], block_tables="updates"))
            full.schedule([(rid, n)])
    kept = []
    for _ in range(80):  # every row crosses 256 or 512 tokens on the way
        for rid in prompts:
            for m in (updates, full):
                m.append_token_ids(rid, [5])
        batch = updates.schedule_uniform(tuple(prompts), 1, block_tables="updates")
        twin = full.schedule_uniform(tuple(prompts), 1)
        mirror.apply(batch)
        same(batch, twin, tables=False)
        for gid, group in twin.groups.items():
            assert np.array_equal(mirror.block_table(gid), group.block_table), gid
        arrays = [batch.positions, batch.query_start_loc, batch.table_rows, batch.table_updates.page,
                  batch.table_updates.row, *(a for g in batch.groups.values() for a in (g.base_pages, g.write_slots)
                                             if a is not None)]
        kept.append((arrays, [a.copy() for a in arrays]))
    for arrays, copies in kept:
        assert all(np.array_equal(a, c) for a, c in zip(arrays, copies))
    assert updates.prefix.stats[specs[0].group_id].stored_entries > 0


@pytest.mark.parametrize("arena", [False, True])
def test_each_pools_peak_is_the_most_pages_it_held_after_any_call(arena):
    """``peak_used_pages`` (noted by the step kernel on a step it runs whole, by Python on
    the others, by ``lru.borrow_row`` on a prefix hit's borrow) is the most used pages seen after any call:
    decode steps whose releases leave keyed pages idle, requests joining with prefix hits,
    requests sitting out and leaving."""
    m = pair("v4", True, None, arena)[0]
    peaks = {gid: 0 for gid in m.pools}

    def look():
        for gid, s in m.stats().items():
            peaks[gid] = max(peaks[gid], s.used_pages)
            assert s.peak_used_pages == peaks[gid], gid

    live = []
    for step in range(400):
        if step % 60 == 0:  # a joiner sharing the first one's prompt (a prefix hit once it is cached)
            rid = f"r{step}"
            m.add_request(rid, np.arange(300 + step % 7, dtype=np.int32) % 40, max_new_tokens=200)
            look()
            while m.num_computed_tokens(rid) < 300 + step % 7:
                m.schedule([(rid, min(64, 300 + step % 7 - m.num_computed_tokens(rid)))])
                look()
            live.append(rid)
        if step % 90 == 89:
            m.free(live.pop(0))
            look()
        batch = tuple(live[1:]) if step % 11 == 0 and len(live) > 1 else tuple(live)  # the first sits out at times
        m.append_token_ids_many(batch, np.full((len(batch), 1), step % 40))
        m.schedule_uniform(batch, 1, block_tables="updates" if step % 2 else "full")
        look()
    assert all(peaks.values())
    m.check_invariants()


@pytest.mark.parametrize("block_tables", ["updates", "full"])
def test_steps_that_commit_first_match_the_admitted_path(block_tables):
    """Decode steps whose rows cross a prefix grain (committed, then the plan run in one more call) equal
    the same steps admitted first (``check_admission``, then ``schedule``: ``_commit_and_run``): batches,
    cells handed out, entries, events and holds; requests join and leave between steps, so in "updates"
    mode the table log holds their cells when a step commits."""
    specs, pages, ctx, step = CONFIGS["v4"]
    fast, admitted = (CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step,
                                   enable_prefix_caching=True, prefix_granularity=256) for _ in range(2))
    prompts = {"a": 250, "b": 509, "c": 200, "d": 255}
    for rid, prompt in prompts.items():
        for m in (fast, admitted):
            m.add_request(rid, np.arange(prompt, dtype=np.int32) % 40, max_new_tokens=300)
        for start in range(0, prompt, step):
            items = [(rid, min(step, prompt - start))]
            same(fast.schedule(items, block_tables=block_tables), admitted.schedule(items, block_tables=block_tables))
    live = list(prompts)
    for k in range(120):  # every row crosses 256 or 512 tokens on the way
        if k % 6 == 5:  # one leaves, one joins with the same prompt (its cells logged, then a hit)
            gone, new = live.pop(0), f"n{k}"
            for m in (fast, admitted):
                m.free(gone)
                m.add_request(new, np.arange(prompts["a"], dtype=np.int32) % 40, max_new_tokens=300)
            while fast.num_computed_tokens(new) < prompts["a"]:
                items = [(new, min(step, prompts["a"] - fast.num_computed_tokens(new)))]
                same(fast.schedule(items, block_tables=block_tables),
                     admitted.schedule(items, block_tables=block_tables))
            live.append(new)
        for m in (fast, admitted):
            m.append_token_ids_many(live, np.full((len(live), 1), 5, dtype=np.int32))
        items = [(rid, 1) for rid in live]
        admitted.check_admission(items)
        a, b = fast.schedule(items, block_tables=block_tables), admitted.schedule(items, block_tables=block_tables)
        same(a, b)
        if block_tables == "updates":
            for name in ("group", "row", "column", "page", "reset", "widths"):
                assert np.array_equal(getattr(a.table_updates, name), getattr(b.table_updates, name)), name
        same_cache(fast, admitted)
    assert fast.prefix.stats[specs[0].group_id].stored_entries > 0


def test_a_batch_of_many_requests_gives_each_the_row_and_count_it_has_alone():
    """Past a few dozen requests the batch's rows and counts are packed in one call (past 128, numpy
    checks the counts): a batch of 200 (pairs with mixed counts, then ``schedule_uniform``), in shuffled
    order, hands each request the table row it gets scheduled alone and its own count."""
    specs, pages, ctx, step = CONFIGS["odd"]
    m = CacheManager(specs, {gid: 40 * n for gid, n in pages.items()}, max_context_tokens=ctx, max_step_tokens=step)
    rids = [f"r{i}" for i in range(200)]
    alone = {}
    for rid in rids:
        m.add_request(rid, prompt_tokens=3, max_new_tokens=20)
        alone[rid] = int(m.schedule([(rid, 3)], block_tables="updates").table_rows[0])
    rng = np.random.default_rng(0)
    order = [rids[k] for k in rng.permutation(len(rids))]
    counts = rng.integers(1, 3, len(order)).tolist()
    batch = m.schedule(list(zip(order, counts)), block_tables="updates")
    assert batch.table_rows.tolist() == [alone[rid] for rid in order]
    assert batch.num_scheduled_tokens.tolist() == counts
    order.reverse()
    batch = m.schedule_uniform(order, 2, block_tables="updates")
    assert batch.table_rows.tolist() == [alone[rid] for rid in order]
    assert batch.num_scheduled_tokens.tolist() == [2] * len(order)
    m.check_invariants()


@pytest.mark.parametrize("bad, message", [(0, "must be positive"), (-1, "must be positive"),
                                          (13, "exceed the per-step limit"), (np.int16(13), "exceed the per-step"),
                                          (np.int64(0), "must be positive"), (2**63, "exceed the per-step limit"),
                                          (np.uint64(2**64 - 1), "exceed the per-step limit"),
                                          (10**30, "exceed the per-step limit"), (-(10**30), "must be positive"),
                                          (True, "must be an int"), (2.0, "must be an int")])
def test_a_bad_count_in_a_batch_of_many_is_refused_as_alone(bad, message):
    """One count out of range (or not an int) alone or among 100 or 200 mixed counts: the batch is refused
    with the per-item reason, as a batch of two is, and nothing changes (the step kernel refuses a count
    out of range whose batch's sum is in range)."""
    specs, pages, ctx, step = CONFIGS["odd"]
    m = CacheManager(specs, {gid: 40 * n for gid, n in pages.items()}, max_context_tokens=ctx, max_step_tokens=step)
    rids = [f"r{i}" for i in range(200)]
    for rid in rids:
        m.add_request(rid, prompt_tokens=30, max_new_tokens=20)
    for size in (1, 2, 100, 200):
        items = [(rid, 1 + i % 2) for i, rid in enumerate(rids[:size])]
        items[size // 2] = (items[size // 2][0], bad)
        with pytest.raises(CacheManagerError, match=message):
            m.schedule(items)
    assert all(m.num_computed_tokens(rid) == 0 for rid in rids)
    batch = m.schedule([(rid, 1 + i % 2) for i, rid in enumerate(rids)])
    assert batch.num_scheduled_tokens.tolist() == [1 + i % 2 for i in range(200)]


BAD_DECODE_ITEMS = {  # each of (the request's id, the step limit)
    "bool": lambda rid, step: (rid, True), "float": lambda rid, step: (rid, 1.0),
    "numpy float": lambda rid, step: (rid, np.float64(1)), "numpy bool": lambda rid, step: (rid, np.True_),
    "zero": lambda rid, step: (rid, 0), "negative": lambda rid, step: (rid, -1),
    "past the limit": lambda rid, step: (rid, step + 1), "past int64": lambda rid, step: (rid, 2**70),
    "three": lambda rid, step: (rid, 1, 1), "one": lambda rid, step: (rid,),
    "mapping": lambda rid, step: {0: rid, 1: 1}, "unknown id": lambda rid, step: ("nope", 1),
    "repeated id": lambda rid, step: ("r0", 1), "unhashable id": lambda rid, step: ([rid], 1)}


@pytest.mark.parametrize("bad", BAD_DECODE_ITEMS.values(), ids=BAD_DECODE_ITEMS)
def test_a_bad_item_among_decode_pairs_is_refused_as_among_two(bad):
    """A decode step given to ``schedule`` as (id, 1) pairs (not ``schedule_uniform``): one bad item (a bool,
    float or numpy bool or float count, a count out of range, an item of another length, a mapping, which
    unpacks to its keys, an unknown or repeated id) among 2, 70 or 200 pairs is refused with the message a
    batch of two gets (its size aside), and nothing changes; then numpy-int counts and list pairs give the
    batch plain ints give."""
    specs, pages, ctx, step = CONFIGS["odd"]
    managers = [CacheManager(specs, {gid: 40 * n for gid, n in pages.items()}, max_context_tokens=ctx,
                             max_step_tokens=step) for _ in range(2)]
    rids = [f"r{i}" for i in range(200)]
    for rid in rids:
        on_both(managers, "add_request", rid, prompt_tokens=30, max_new_tokens=20)
    m = managers[0]
    messages = set()
    for size in (2, 70, 200):
        items = [(rid, 1) for rid in rids[:size] if rid != "r1"]
        items.insert(size // 2, bad("r1", step))  # r1's item, amid the others
        with pytest.raises(CacheManagerError) as refused:
            m.schedule(items)
        messages.add(str(refused.value).replace(f" of {size} requests", " of N requests"))
    assert len(messages) == 1 and messages.pop().startswith("1 of N requests not admissible: ")
    assert all(m.num_computed_tokens(rid) == 0 for rid in rids)
    for counts in ([np.int64(1)] * 200, [np.uint8(1)] * 199 + [1]):
        same(m.schedule([[rid, n] for rid, n in zip(rids, counts)]), managers[1].schedule([(rid, 1) for rid in rids]))


@pytest.mark.parametrize("seed", [1, 2])
def test_steps_on_a_shuffled_arena_match_the_admitted_path(seed):
    """On a shared arena whose pools' free stacks are shuffled (``shuffle_seed``: the arena moves spare slabs in
    Python, not in the step kernel), prefill chunks and decode steps that ``schedule`` admits on its own equal the
    same steps admitted first (``check_admission``, then ``schedule``): batches or refusals, entries, events, holds
    and slab moves; requests join with shared prefixes and leave."""
    plan = plan_for_budget(cache_layout("deepseek-v4-flash", indexer="fp8"), 3 * 2**29, Limits(8, 4096, 65536))
    fast, admitted = (CacheManager.from_plan(plan, page_space="shared", shuffle_seed=seed, enable_prefix_caching=True,
                                             prompt_checkpoints=True) for _ in range(2))
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 1000, 1536).astype(np.int32) for _ in range(3)]
    live = []
    for step in range(150):
        while len(live) < 8:
            rid, tail = f"r{step}-{len(live)}", rng.integers(0, 1000, int(rng.integers(200, 3000))).astype(np.int32)
            on_both((fast, admitted), "add_request", rid, np.concatenate([prefixes[len(live) % 3], tail]),
                    max_new_tokens=600)
            live.append(rid)
        chunk = int(rng.choice([64, 256, 1024]))
        items = [(rid, min(fast.known_token_ids(rid).size - fast.num_computed_tokens(rid), chunk)) for rid in live]
        admitted.check_admission(items)
        (a, b), refused = on_both((fast, admitted), "schedule", items)
        if refused:
            on_both((fast, admitted), "free", live.pop(0))
            continue
        same(a, b)
        done = tuple(rid for rid in live if fast.known_token_ids(rid).size == fast.num_computed_tokens(rid))
        if done:
            on_both((fast, admitted), "append_token_ids_many", done, rng.integers(0, 1000, (len(done), 1)))
        if step % 30 == 29:
            on_both((fast, admitted), "free", live.pop(int(rng.integers(len(live)))))
        same_cache(fast, admitted)
        assert fast.arena.slab_moves == admitted.arena.slab_moves
    assert fast.arena.slab_moves > 0
    fast.check_invariants()


def test_one_pair_steps_match_the_admitted_path():
    """A batch of one pair (a prefill chunk, ``schedule``'s scalar checks): plain and numpy int counts give
    what the same steps admitted first give (batches, entries, events, holds); a bad pair is refused with the
    per-item reason on both, and nothing changes."""
    specs, pages, ctx, step = CONFIGS["v4"]
    fast, admitted = (CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step,
                                   enable_prefix_caching=True, prefix_granularity=256) for _ in range(2))
    managers = (fast, admitted)
    for k, rid in enumerate(("a", "b", "c")):
        on_both(managers, "add_request", rid, np.arange(300 + 70 * k, dtype=np.int32) % 40, max_new_tokens=8)
        for i in range(9):  # past a prefix hit, 50 tokens a chunk
            n = min(50, 300 + 70 * k - fast.num_computed_tokens(rid))
            if not n:
                break
            items = [(rid, (int, np.int64, np.uint16)[i % 3](n))]
            admitted.check_admission(items)
            same(*on_both(managers, "schedule", items, block_tables="updates" if i % 2 else "full")[0])
            same_cache(fast, admitted)
    for items, message in (([("a", True)], "must be an int"), ([("a", 1.0)], "must be an int"),
                           ([("a", 0)], "must be positive"), ([("a", step + 1)], "per-step limit"),
                           ([("zz", 1)], "unknown request"), ([(["a"], 1)], "unknown request"),
                           ([("a", 1, 2)], "each item must be"), ([5], "each item must be"),
                           ([("a", 5)], "known token ids")):
        assert message in on_both(managers, "schedule", items)[1]
        assert fast.num_computed_tokens("a") == admitted.num_computed_tokens("a") == 300
    same_cache(fast, admitted)
