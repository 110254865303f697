"""CacheManager: worked examples, kernel arrays, rewind, free, stats, fixed widths,
admission and every misuse (which must leave the state exactly as it was).

Page ids below are worked out by hand from the pool's documented reuse order: a
fresh pool hands out 1, 2, 3...; freed pages go on top of a LIFO stack, the first
page listed in a release on top.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from hybridkv.runtime.manager import Admission, CacheManager, CacheManagerError
from hybridkv.models.deepseek_v4 import build_v4_cache_specs
from hybridkv.spec import CacheGroupSpec

SWA = CacheGroupSpec("swa", "sliding_window", 4, 1, sliding_window_tokens=8, family="state")
KV = CacheGroupSpec("kv", "full_history", rows_per_page=4, entry_stride_tokens=1)
C4 = CacheGroupSpec("c4", "full_history", rows_per_page=64, entry_stride_tokens=4)


def manager(specs, pages, *, ctx=4096, step=None, **kw):
    if isinstance(pages, int):
        pages = {s.group_id: pages for s in specs}
    return CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step, **kw)


def v4_specs(window=16):
    return build_v4_cache_specs({"sliding_window": window}, layer_ratio=[0, 4, 128])


def held(m, rid, gid):
    base, pages = m.request_pages(rid, gid)
    return base, pages.tolist()


def snapshot(m, rids=()):
    """Everything a rejected call must leave untouched."""
    pools = {
        gid: (
            p.ref_counts.tolist(),
            p.num_free_pages,
            p.num_clean_free_pages,
            p.num_evictable_pages,
            p.counters.as_dict(),
            p.peak_used_pages,
        )
        for gid, p in m.pools.items()
    }
    tables = {gid: (t.pages.tolist(), t.base.tolist(), t.hi.tolist()) for gid, t in m.tables.items()}
    requests = {
        rid: (m.num_computed_tokens(rid), {gid: held(m, rid, gid) for gid in m.pools})
        for rid in rids
        if m.has_request(rid)
    }
    return pools, tables, requests, m.num_requests


# --- worked examples ------------------------------------------------------------
def test_release_uses_the_first_position_of_the_step_not_the_chunk_end():
    """rows 4, W 8, a chunk starting at 12 releases the pages below (12-8+1)//4 = 1."""
    m = manager([SWA], 20, ctx=64)
    m.add_request("a", prompt_tokens=40)
    m.schedule([("a", 12)])
    assert held(m, "a", "swa") == (0, [1, 2, 3])
    batch = m.schedule([("a", 8)])  # positions 12..19
    # Logical page 0 (page 1) released first, then logical 3, 4 allocated: 1 (reused), 4.
    # Releasing from the chunk end, (19-8+1)//4 = 3, would also drop page 2 (tokens 4..7),
    # which position 12 still reads.
    assert held(m, "a", "swa") == (1, [2, 3, 1, 4])
    g = batch.groups["swa"]
    assert g.base_pages.tolist() == [1]
    assert g.block_table.tolist() == [[2, 3, 1, 4]]
    assert g.write_slots.tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    s = m.stats()["swa"]
    assert (s.allocated_pages, s.released_pages, s.used_pages) == (5, 1, 4)


def test_compressed_groups_need_a_page_for_a_partial_entry():
    """c4 (rows 64, stride 4, 256 tokens a page): 1, 256, 257 tokens need 1, 1, 2 pages."""
    m = manager(v4_specs(), 2000)
    for rid, n in [("a", 1), ("b", 256), ("c", 257)]:
        m.add_request(rid, prompt_tokens=n)
    m.schedule([("a", 1), ("b", 256), ("c", 257)])
    pages = {gid: [len(held(m, r, gid)[1]) for r in "abc"] for gid in m.pools}
    assert pages == {
        "v4.swa_kv": [1, 4, 5],  # 64 tokens a page; the whole first chunk is held
        "v4.c4a.compressor_state": [1, 64, 65],  # 4 tokens a page
        "v4.c4a.compressed_kv": [1, 1, 2],
        "v4.c128a.compressor_state": [1, 32, 33],  # 8 tokens a page
        "v4.c128a.compressed_kv": [1, 1, 2],  # 2 rows * 128 tokens
        "v4.c4a.indexer_compressor_state": [1, 64, 65],
    }


def test_compressed_write_slots_with_table_10_11():
    """Compressed slots for positions [3, 7, 127] with c4 table [10, 11] are [640, 641, 671]."""
    m = manager([C4], 20)
    m.add_request("filler", prompt_tokens=9 * 256)
    m.schedule([("filler", 9 * 256)])  # takes pages 1..9
    m.add_request("x", prompt_tokens=257)
    batch = m.schedule([("x", 257)])
    g = batch.groups["c4"]
    assert g.block_table.tolist() == [[10, 11]]
    assert g.base_pages is None
    slots = g.write_slots
    assert slots.shape == (257,)
    assert slots[[3, 7, 127]].tolist() == [640, 641, 671]
    assert slots[4] == -1
    assert slots[255] == 10 * 64 + 63 and slots[256] == -1
    assert np.count_nonzero(slots >= 0) == 64  # one row per closed window of 4
    assert np.all(slots[np.arange(257) % 4 != 3] == -1)


# --- the kernel arrays of a mixed batch, by hand ---------------------------------------
def test_mixed_prefill_and_decode_batches():
    m = manager([SWA, KV], 30)
    m.add_request("a", prompt_tokens=10, max_new_tokens=5)
    m.add_request("b", prompt_tokens=6, max_new_tokens=5)
    m.schedule([("a", 10)])  # swa and kv: pages 1, 2, 3

    batch = m.schedule([("b", 6), ("a", 1)])  # b's prefill with a's first decode
    assert batch.request_ids == ("b", "a")
    assert batch.num_scheduled_tokens.dtype == np.int32
    assert batch.num_scheduled_tokens.tolist() == [6, 1]
    assert batch.query_start_loc.dtype == np.int32
    assert batch.query_start_loc.tolist() == [0, 6, 7]
    assert batch.positions.dtype == np.int64
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 5, 10]
    assert batch.request_indices.dtype == np.int32
    assert batch.request_indices.tolist() == [0, 0, 0, 0, 0, 0, 1]
    swa, kv = batch.groups["swa"], batch.groups["kv"]
    for g in (swa, kv):
        assert g.block_table.dtype == np.int32 and g.write_slots.dtype == np.int64
        assert g.block_table.tolist() == [[4, 5, -1], [1, 2, 3]]
        # b: page 4 rows 0-3, page 5 rows 0-1; a: position 10 is page 3 row 2.
        assert g.write_slots.tolist() == [16, 17, 18, 19, 20, 21, 14]
    assert swa.base_pages.dtype == np.int32 and swa.base_pages.tolist() == [0, 0]
    assert kv.base_pages is None

    batch = m.schedule([("a", 1), ("b", 2)])  # a at 11 releases page 1 ((11-7)//4 = 1)
    swa, kv = batch.groups["swa"], batch.groups["kv"]
    assert batch.positions.tolist() == [11, 6, 7]
    assert swa.base_pages.tolist() == [1, 0]
    assert swa.block_table.tolist() == [[2, 3], [4, 5]]
    assert swa.write_slots.tolist() == [15, 22, 23]
    assert kv.block_table.tolist() == [[1, 2, 3], [4, 5, -1]]
    assert kv.write_slots.tolist() == [15, 22, 23]
    stats = m.stats()
    assert (stats["swa"].free_pages, stats["swa"].used_pages) == (25, 4)
    assert (stats["kv"].free_pages, stats["kv"].used_pages) == (24, 5)
    m.check_invariants()


def test_verify_then_rewind_returns_only_pages_past_the_accepted_length():
    m = manager([SWA, KV], 30)
    m.add_request("a", prompt_tokens=14, max_new_tokens=10)
    m.schedule([("a", 14)])  # pages 1..4 in both groups
    batch = m.schedule([("a", 4)])  # verify 14..17; swa releases page 1 then reuses it
    assert held(m, "a", "swa") == (1, [2, 3, 4, 1])
    assert held(m, "a", "kv") == (0, [1, 2, 3, 4, 5])
    assert batch.groups["swa"].write_slots.tolist() == [18, 19, 4, 5]
    assert batch.groups["kv"].write_slots.tolist() == [18, 19, 20, 21]

    m.rewind("a", 16)  # 2 of 4 accepted: logical page 4 (tokens 16..19) goes back
    assert m.num_computed_tokens("a") == 16
    assert held(m, "a", "swa") == (1, [2, 3, 4])
    assert held(m, "a", "kv") == (0, [1, 2, 3, 4])
    assert m.stats()["swa"].used_pages == 3 and m.stats()["kv"].used_pages == 4
    m.check_invariants()

    m.rewind("a", 16)  # rewinding to where it is changes nothing
    assert held(m, "a", "kv") == (0, [1, 2, 3, 4])

    batch = m.schedule([("a", 1)])  # from 16: swa releases page 2, then reuses it
    assert batch.positions.tolist() == [16]
    assert held(m, "a", "swa") == (2, [3, 4, 2])
    assert batch.groups["swa"].write_slots.tolist() == [8]
    assert batch.groups["kv"].write_slots.tolist() == [20]  # page 5 again
    m.check_invariants()


def test_rewind_inside_a_page_keeps_the_page():
    m = manager([KV], 10)
    m.add_request("a", prompt_tokens=5, max_new_tokens=8)
    m.schedule([("a", 5)])
    m.schedule([("a", 3)])  # tokens 5..7, still pages 1, 2
    m.rewind("a", 6)
    assert held(m, "a", "kv") == (0, [1, 2])
    m.rewind("a", 5)
    assert held(m, "a", "kv") == (0, [1, 2])


def test_a_row_freed_after_a_step_and_reused_by_a_hit_does_not_settle():
    """A request freed after its step leaves its row listed among the previous step's; a
    joiner that takes the row (with a prefix hit) and sits out the next step changes
    nothing there: the same pages, tokens and pools as when it takes a fresh row."""
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 1000, 512).tolist()
    outcomes = []
    for fresh_row in (False, True):
        m = manager(v4_specs(), 400, shuffle_seed=5, enable_prefix_caching=True)
        m.add_request("a", shared + [1, 2, 3], max_new_tokens=8)
        m.add_request("b", rng.integers(0, 1000, 40).tolist(), max_new_tokens=8)
        m.schedule([("a", 515), ("b", 40)])
        m.append_token_ids_many(("a", "b"), np.array([[7], [8]]))
        m.free("a")  # its last step commits here
        if fresh_row:
            m.add_request("filler", prompt_tokens=5)  # takes a's row
        hit = m.add_request("c", shared + [4, 5], max_new_tokens=4)
        assert hit.hit_tokens == 512
        m.schedule([("b", 1)])  # c sits out
        m.check_invariants()
        outcomes.append(({rid: (m.num_computed_tokens(rid), {gid: held(m, rid, gid) for gid in m.pools})
                          for rid in ("b", "c")}, snapshot(m)[0]))
        m.append_token_ids("b", [9])
        m.schedule([("c", 2), ("b", 1)])
        m.check_invariants()
        outcomes.append((m.num_computed_tokens("c"), {gid: held(m, "c", gid) for gid in m.pools}))
    assert outcomes[:2] == outcomes[2:]


def test_free_returns_every_pool_to_full_and_rows_are_reused_clean():
    m = manager(v4_specs(), 400, shuffle_seed=5)
    for i, n in enumerate([300, 70, 513]):
        m.add_request(f"r{i}", prompt_tokens=n, max_new_tokens=4)
    m.schedule([("r0", 300), ("r1", 70), ("r2", 200)])
    m.schedule([("r0", 2), ("r1", 1), ("r2", 313)])
    m.free("r1")
    m.check_invariants()
    m.add_request("new", prompt_tokens=3)
    assert m.num_computed_tokens("new") == 0
    assert all(held(m, "new", gid) == (0, []) for gid in m.pools)
    m.schedule([("new", 3)])
    for rid in ("r0", "r2", "new"):
        m.free(rid)
    assert m.num_requests == 0
    for gid, s in m.stats().items():
        assert s.total_pages == 399
        assert (s.free_pages, s.used_pages, s.utilization) == (399, 0, 0.0)
        assert s.peak_used_pages > 0
        assert s.allocated_pages == s.released_pages
    m.check_invariants()


def test_stats_figures():
    m = manager([SWA, KV], {"swa": 11, "kv": 21})
    m.add_request("a", prompt_tokens=13)
    m.schedule([("a", 9)])
    s = m.stats()["kv"]
    assert (s.group_id, s.total_pages, s.used_pages, s.free_pages) == ("kv", 20, 3, 17)
    assert s.utilization == pytest.approx(3 / 20)
    assert s.peak_used_pages == 3
    m.schedule([("a", 4)])  # from 9: swa releases page 1 ((9-7)//4 = 0: nothing); kv page 4
    m.rewind("a", 12)
    s = m.stats()["kv"]
    assert (s.used_pages, s.peak_used_pages, s.allocated_pages, s.released_pages) == (3, 4, 4, 1)


def test_shuffled_pools_give_consistent_non_contiguous_tables():
    m = manager([SWA, KV], 64, shuffle_seed=11)
    m.add_request("a", prompt_tokens=40)
    batch = m.schedule([("a", 40)])
    kv_pages = held(m, "a", "kv")[1]
    assert len(kv_pages) == 10 and kv_pages != list(range(1, 11))
    table = batch.groups["kv"].block_table[0]
    expected = table[np.arange(40) // 4].astype(np.int64) * 4 + np.arange(40) % 4
    assert batch.groups["kv"].write_slots.tolist() == expected.tolist()


def test_add_request_without_caching_reports_no_hit():
    m = manager(v4_specs(), 50)
    hit = m.add_request("a", np.arange(20), max_new_tokens=3)
    assert hit.hit_tokens == 0
    assert hit.group_hit_tokens == {s.group_id: 0 for s in m.specs}
    assert m.num_computed_tokens("a") == 0 and m.has_request("a")


# --- fixed widths -------------------------------------------------------------------
def test_fixed_width_tables_and_the_error_when_a_request_needs_more_columns():
    m = manager([SWA, KV], 40, ctx=64, table_widths={"swa": 3, "kv": 6})
    m.add_request("a", prompt_tokens=9, max_new_tokens=8)
    m.add_request("b", prompt_tokens=30)
    m.schedule([("a", 9)])
    batch = m.schedule([("a", 1)], fixed_width=True)
    assert batch.groups["swa"].block_table.shape == (1, 3)
    assert batch.groups["kv"].block_table.shape == (1, 6)
    assert batch.groups["kv"].block_table.tolist() == [[1, 2, 3, -1, -1, -1]]
    assert batch.groups["swa"].block_table.tolist() == [[1, 2, 3]]
    # b's 25-token chunk needs 7 kv columns (and 7 swa columns) > capture widths.
    before = snapshot(m, ["a", "b"])
    [adm] = m.check_admission([("b", 25)], fixed_width=True)
    assert not adm.ok and "capture width" in adm.reason
    with pytest.raises(CacheManagerError, match="capture width"):
        m.schedule([("b", 25)], fixed_width=True)
    assert snapshot(m, ["a", "b"]) == before
    assert m.check_admission([("b", 25)]) == [Admission(True)]  # fine without fixed widths


def test_from_plan_uses_the_plan_capture_widths():
    from hybridkv.models.layout import cache_layout
    from hybridkv.plan import Limits, plan_for_tokens

    layout = cache_layout("deepseek-v4-flash")
    plan = plan_for_tokens(layout, 8192, Limits(4, 1024, 4096), page_space="per-group")
    m = CacheManager.from_plan(plan)
    assert m.max_context_tokens == 4096 and m.max_step_tokens == 1024
    assert {g: p.num_pages for g, p in m.pools.items()} == plan.group_pages
    m.add_request("a", prompt_tokens=700, max_new_tokens=10)
    m.schedule([("a", 700)])
    batch = m.schedule([("a", 1)], fixed_width=True)
    for gid, width in plan.table_widths.items():
        assert batch.groups[gid].block_table.shape == (1, width)
    with pytest.raises(CacheManagerError, match="exceeds the plan's max context"):
        m.add_request("long", prompt_tokens=4000, max_new_tokens=97)


def test_fixed_width_without_capture_widths_is_a_misuse():
    m = manager([KV], 10)
    m.add_request("a", prompt_tokens=5)
    before = snapshot(m, ["a"])
    with pytest.raises(CacheManagerError):
        m.schedule([("a", 5)], fixed_width=True)
    assert snapshot(m, ["a"]) == before


# --- admission -------------------------------------------------------------------------
def test_admission_is_pure_and_answers_each_request_with_a_reason():
    m = manager([KV], 6, ctx=64, step=16)  # 5 usable pages
    m.add_request("a", prompt_tokens=12)
    m.add_request("b", prompt_tokens=12)
    m.add_request("c", prompt_tokens=40)
    m.add_request("d", prompt_tokens=40)
    m.add_request("e", prompt_tokens=4)
    before = snapshot(m, "abcde")
    answers = m.check_admission(
        [("a", 12), ("nope", 1), ("a", 1), ("b", 12), ("c", 0), ("d", 17), ("e", 4)]
    )
    assert snapshot(m, "abcde") == before
    assert [a.ok for a in answers] == [True, False, False, False, False, False, True]
    assert answers[0].reason == ""
    assert "unknown request 'nope'" in answers[1].reason
    assert "twice" in answers[2].reason
    assert "'kv' needs 3 new pages" in answers[3].reason and "2 free" in answers[3].reason
    assert "positive" in answers[4].reason
    assert "per-step limit of 16" in answers[5].reason
    assert m.check_admission([]) == []


def test_admission_is_greedy_in_batch_order():
    m = manager([KV], 5)  # 4 usable pages, 3 needed by a or b, 1 by c
    for rid, n in [("a", 12), ("b", 12), ("c", 4)]:
        m.add_request(rid, prompt_tokens=n)
    ok = lambda items: [a.ok for a in m.check_admission(items)]  # noqa: E731
    assert ok([("a", 12), ("b", 12)]) == [True, False]
    assert ok([("b", 12), ("a", 12)]) == [True, False]
    assert ok([("a", 12), ("b", 12), ("c", 4)]) == [True, False, True]
    assert ok([("c", 4), ("a", 12)]) == [True, True]
    before = snapshot(m, "abc")
    with pytest.raises(CacheManagerError, match="not admissible"):
        m.schedule([("a", 12), ("b", 12)])
    assert snapshot(m, "abc") == before  # no counters touched either


def _credit_setup(spec):
    m = manager([spec], 6, ctx=64)  # 5 usable pages
    m.add_request("a", prompt_tokens=24)
    m.schedule([("a", 16)])  # 4 pages held, 1 free
    return m


def test_pages_the_step_releases_count_as_credit():
    # From 16 the window starts at token 9: logical pages 0, 1 go back before the two
    # new pages (tokens 16..23) are allocated, so 2 pages fit in a pool with 1 free.
    m = _credit_setup(SWA)
    before = snapshot(m, "a")
    assert m.check_admission([("a", 8)]) == [Admission(True)]
    assert snapshot(m, "a") == before
    m.schedule([("a", 8)])
    assert held(m, "a", "swa") == (2, [3, 4, 1, 2])
    m.check_invariants()
    # The same step in a full-history group releases nothing and is denied.
    full = CacheGroupSpec("swa", "full_history", rows_per_page=4, entry_stride_tokens=1)
    m = _credit_setup(full)
    [adm] = m.check_admission([("a", 8)])
    assert not adm.ok and "needs 2 new pages" in adm.reason and "1 free" in adm.reason


def test_schedule_after_check_admission_schedules_the_items_as_they_are_now():
    """An item edited in place after the check (a list, not a tuple) is scheduled as edited: 3 tokens
    need a second page the pool lacks, so the step is refused, not run with the count checked."""
    m = manager([KV], 3, ctx=64)  # 2 usable pages of 4 tokens
    m.add_request("a", prompt_tokens=12)
    m.schedule([("a", 4)])  # a holds 1 page, 1 free
    items = [["a", 4]]
    assert m.check_admission(items) == [Admission(True)]
    items[0][1] = 8  # needs 2 new pages
    before = snapshot(m, "a")
    with pytest.raises(CacheManagerError, match="needs 2 new pages"):
        m.schedule(items)
    assert snapshot(m, "a") == before
    items[0][1] = 4
    assert m.schedule(items).num_scheduled_tokens.tolist() == [4]


def test_schedule_of_array_items_after_checking_them_as_tuples():
    """Array items compare elementwise with the checked tuples: the step is admitted afresh, not a numpy error."""
    m = manager([KV], 8, ctx=64)
    m.add_request("a", prompt_tokens=12)
    assert m.check_admission([("a", 4)]) == [Admission(True)]
    assert m.schedule([np.array(["a", 4], dtype=object)]).num_scheduled_tokens.tolist() == [4]
    assert m.check_admission(np.array([["a", 4]], dtype=object)) == [Admission(True)]
    assert m.schedule(np.array([["a", 4]], dtype=object)).num_scheduled_tokens.tolist() == [4]


@pytest.mark.parametrize("count", [4.0, True, np.float64(4.0)])
def test_schedule_after_check_admission_refuses_a_count_that_only_equals_the_checked_one(count):
    """4.0 == 4 and True == 1, but neither is a token count: schedule refuses them after the check as it does alone
    (the check's verdict was reused for them before)."""
    m = manager([KV], 8, ctx=64)
    m.add_request("a", prompt_tokens=12)
    checked = 1 if count is True else 4
    assert m.check_admission([("a", checked)]) == [Admission(True)]
    before = snapshot(m, "a")
    with pytest.raises(CacheManagerError, match="token count must be an int"):
        m.schedule([("a", count)])
    assert snapshot(m, "a") == before
    with pytest.raises(CacheManagerError, match="token count must be an int"):
        m.schedule([("a", count)])  # the same alone


def _two_request_credit_setup():
    m = manager([SWA], 7, ctx=64)  # 6 usable pages
    m.add_request("a", prompt_tokens=24)
    m.add_request("b", prompt_tokens=12)
    m.schedule([("a", 16)])  # a holds 4, 2 free
    return m


def test_a_later_request_releases_credit_for_an_earlier_one_in_batch_order():
    # a's step from 16 releases 2 and allocates 1 (net -1); b needs 3. Total 2 <= 2 free.
    m = _two_request_credit_setup()
    assert [x.ok for x in m.check_admission([("a", 4), ("b", 12)])] == [True, True]
    m.schedule([("a", 4), ("b", 12)])
    m.check_invariants()


def test_a_batch_whose_net_total_fits_is_admitted_in_any_order():
    m = _two_request_credit_setup()
    assert [x.ok for x in m.check_admission([("b", 12), ("a", 4)])] == [True, True]
    m.schedule([("b", 12), ("a", 4)])
    m.check_invariants()


# --- misuse: every one raises CacheManagerError and changes nothing ------------------------
def _misuse_manager():
    m = manager([SWA, KV], 12, ctx=64, step=16)
    m.add_request("a", prompt_tokens=20, max_new_tokens=4)
    m.add_request("ids", np.arange(5), max_new_tokens=3)
    m.schedule([("a", 12), ("ids", 5)])
    m.schedule([("a", 8)])  # a: computed 20, first of its last step 12
    return m


MISUSES = {
    "schedule unknown id": lambda m: m.schedule([("nope", 1)]),
    "schedule unknown among valid": lambda m: m.schedule([("a", 1), ("nope", 1)]),
    "rewind unknown id": lambda m: m.rewind("nope", 0),
    "free unknown id": lambda m: m.free("nope"),
    "computed of unknown id": lambda m: m.num_computed_tokens("nope"),
    "append to unknown id": lambda m: m.append_token_ids("nope", [1]),
    "add duplicate id": lambda m: m.add_request("a", prompt_tokens=3),
    "duplicate id in a batch": lambda m: m.schedule([("a", 1), ("a", 1)]),
    "empty batch": lambda m: m.schedule([]),
    "malformed item": lambda m: m.schedule([("a",)]),
    "negative count": lambda m: m.schedule([("a", -1)]),
    "zero count": lambda m: m.schedule([("a", 0)]),
    "float count": lambda m: m.schedule([("a", 1.0)]),
    "bool count": lambda m: m.schedule([("a", True)]),
    "str count": lambda m: m.schedule([("a", "1")]),
    "None count": lambda m: m.schedule([("a", None)]),
    "count over the step limit": lambda m: m.schedule([("a", 17)]),
    "beyond prompt + max_new_tokens": lambda m: m.schedule([("a", 5)]),
    "tokens beyond known ids": lambda m: m.schedule([("ids", 1)]),
    "append beyond the declared total": lambda m: m.append_token_ids("ids", [1, 2, 3, 4]),
    "append negative token ids": lambda m: m.append_token_ids("ids", [-1]),
    "append 2-D token ids": lambda m: m.append_token_ids("ids", [[1]]),
    "append float token ids": lambda m: m.append_token_ids("ids", [1.5]),
    "append to a request without ids": lambda m: m.append_token_ids("a", [1]),
    "rewind forward": lambda m: m.rewind("a", 21),
    "rewind negative": lambda m: m.rewind("a", -1),
    "rewind non-int": lambda m: m.rewind("a", 19.0),
    "prompt longer than max context": lambda m: m.add_request("z", prompt_tokens=65),
    "prompt + max_new over max context": lambda m: m.add_request("z", prompt_tokens=60, max_new_tokens=5),
    "token ids longer than max context": lambda m: m.add_request("z", np.zeros(65, dtype=np.int64)),
    "empty prompt": lambda m: m.add_request("z", prompt_tokens=0),
    "negative prompt": lambda m: m.add_request("z", prompt_tokens=-3),
    "no prompt": lambda m: m.add_request("z"),
    "ids and length disagree": lambda m: m.add_request("z", np.arange(4), prompt_tokens=5),
    "negative max_new_tokens": lambda m: m.add_request("z", prompt_tokens=3, max_new_tokens=-1),
    "empty request id": lambda m: m.add_request("", prompt_tokens=3),
    "non-str request id": lambda m: m.add_request(7, prompt_tokens=3),
}


@pytest.mark.parametrize("name", sorted(MISUSES))
def test_misuse_raises_and_changes_nothing(name):
    m = _misuse_manager()
    before = snapshot(m, ["a", "ids", "z"])
    with pytest.raises(CacheManagerError):
        MISUSES[name](m)
    assert snapshot(m, ["a", "ids", "z"]) == before
    m.check_invariants()


def test_scheduling_more_than_the_pools_admit_raises_and_changes_nothing():
    m = manager([SWA, KV], {"swa": 40, "kv": 8}, ctx=64)  # kv: 7 usable pages
    m.add_request("a", prompt_tokens=20)
    m.add_request("b", prompt_tokens=20)
    m.schedule([("a", 20)])  # kv: 5 pages, 2 free
    before = snapshot(m, "ab")
    with pytest.raises(CacheManagerError, match="'kv' needs 3 new pages"):
        m.schedule([("b", 12)])
    assert snapshot(m, "ab") == before


def test_rewind_below_the_last_step_start_is_refused():
    m = _misuse_manager()  # a: last step was [12, 20); swa released logical page 0
    before = snapshot(m, ["a", "ids"])
    with pytest.raises(CacheManagerError, match="below"):
        m.rewind("a", 11)
    assert snapshot(m, ["a", "ids"]) == before


def test_rewind_below_the_last_step_start_is_refused_with_prefix_caching():
    specs = [
        CacheGroupSpec("swa", "sliding_window", 4, 1, sliding_window_tokens=4, family="state"),
        KV,
    ]
    m = manager(specs, 12, ctx=64, enable_prefix_caching=True, prefix_granularity=4)
    m.add_request("a", np.arange(20), max_new_tokens=4)
    m.schedule([("a", 12)])
    m.schedule([("a", 8)])
    before = snapshot(m, ["a"])
    with pytest.raises(CacheManagerError, match="below"):
        m.rewind("a", 11)
    assert snapshot(m, ["a"]) == before
    m.rewind("a", 12)  # the first position of the last step is fine
    assert m.num_computed_tokens("a") == 12
    m.check_invariants()


def test_state_after_a_rejected_rewind_still_schedules_correctly():
    m = _misuse_manager()
    with pytest.raises(CacheManagerError):
        m.rewind("a", 21)
    batch = m.schedule([("a", 2)])
    assert batch.positions.tolist() == [20, 21]
    assert np.all(batch.groups["swa"].write_slots >= 0)
    m.check_invariants()


def test_an_unhashable_request_id_is_denied_not_a_type_error():
    m = _misuse_manager()
    before = snapshot(m, ["a", "ids"])
    [adm] = m.check_admission([(["a"], 1)])
    assert not adm.ok and "unknown request" in adm.reason
    with pytest.raises(CacheManagerError):
        m.schedule([(["a"], 1)])
    assert snapshot(m, ["a", "ids"]) == before


def test_previous_step_requests_settle_at_the_next_schedule():
    """A request left out of a step releases its slid-out pages then and can no longer rewind."""
    m = manager([SWA, KV], {"swa": 6, "kv": 20}, ctx=64)  # swa: 5 usable pages
    m.add_request("a", prompt_tokens=16, max_new_tokens=4)
    m.add_request("b", prompt_tokens=8)
    m.schedule([("a", 16)])  # a: swa pages 1..4, 1 free
    assert held(m, "a", "swa") == (0, [1, 2, 3, 4])
    # b needs 2 swa pages; a's settling releases logical pages 0, 1 ((16-7)//4 = 2) first.
    assert m.check_admission([("b", 8)]) == [Admission(True)]
    batch = m.schedule([("b", 8)])
    assert held(m, "a", "swa") == (2, [3, 4])
    assert batch.request_ids == ("b",)  # a settled without being part of the step
    assert batch.groups["swa"].block_table.tolist() == [[1, 2]]
    assert held(m, "a", "kv") == (0, [1, 2, 3, 4])
    with pytest.raises(CacheManagerError, match="below"):
        m.rewind("a", 15)
    m.rewind("a", 16)
    # b (in the last step) may still rewind into its step until the next schedule.
    m.rewind("b", 4)
    assert held(m, "b", "swa") == (0, [1])
    m.check_invariants()


# --- batched rewind ------------------------------------------------------------------
def _verify_pair():
    m = manager([SWA, KV], 40, ctx=64, step=16)
    for rid in "ab":
        m.add_request(rid, prompt_tokens=10, max_new_tokens=20)
    m.schedule([("a", 10), ("b", 10)])
    m.schedule([("a", 4), ("b", 4)])  # verify steps: positions 10..13 each
    return m


def test_rewind_many_equals_rewinding_one_by_one():
    one, many = _verify_pair(), _verify_pair()
    one.rewind("a", 11)
    one.rewind("b", 13)
    many.rewind_many([("a", 11), ("b", 13)])
    assert snapshot(one, "ab") == snapshot(many, "ab")
    # a keeps tokens [0, 11): kv pages ceil(11 / 4) = 3 (page 3 of 0..3 went back); b keeps 4.
    assert [len(held(many, rid, "kv")[1]) for rid in "ab"] == [3, 4]
    many.check_invariants()


@pytest.mark.parametrize(
    "items, match",
    [
        ([("a", 11), ("b", 15)], "forward"),
        ([("a", 11), ("a", 12)], "twice"),
        ([("a", 11), ("zz", 12)], "unknown"),
        ([("a", 11), ("b", 9)], "below"),
        ([("a", 11), ("b", 12.0)], "int"),
        ([("a", 11), ("b",)], "each item"),
    ],
)
def test_rewind_many_rejects_the_whole_batch(items, match):
    m = _verify_pair()
    before = snapshot(m, "ab")
    with pytest.raises(CacheManagerError, match=match):
        m.rewind_many(items)
    assert snapshot(m, "ab") == before


# --- batched append --------------------------------------------------------------------
def test_append_token_ids_many_equals_appending_one_by_one():
    one, many = (manager([SWA, KV], 40, ctx=64, step=16) for _ in range(2))
    for m in (one, many):
        m.add_request("a", np.arange(5), max_new_tokens=4)
        m.add_request("b", np.arange(7), max_new_tokens=2)
    one.append_token_ids("a", [9, 8])
    one.append_token_ids("b", [7, 6])
    many.append_token_ids_many(["a", "b"], np.array([[9, 8], [7, 6]]))
    for rid in "ab":
        assert np.array_equal(one.known_token_ids(rid), many.known_token_ids(rid))
    assert many.known_token_ids("a").tolist() == [0, 1, 2, 3, 4, 9, 8]
    # b declared 7 + 2 tokens: it now knows 9, and one more token is refused for the batch.
    before = snapshot(many, "ab")
    with pytest.raises(CacheManagerError, match="'b': 9 \\+ 1 tokens exceeds"):
        many.append_token_ids_many(["a", "b"], np.array([[1], [2]]))
    assert snapshot(many, "ab") == before and many.known_token_ids("a").size == 7


@pytest.mark.parametrize(
    "rids, ids, match",
    [
        (["a", "a"], [[1], [2]], "twice"),
        (["a", "zz"], [[1], [2]], "unknown"),
        (["a"], [[1], [2]], "must be"),
        (["a"], [1, 2], "must be"),
        (["a"], [[-1]], "token ids"),
        (["a"], [[1.5]], "integers"),
        (["n"], [[1]], "without token ids"),
    ],
)
def test_append_token_ids_many_rejects_bad_input(rids, ids, match):
    m = manager([SWA, KV], 40, ctx=64, step=16)
    m.add_request("a", np.arange(5), max_new_tokens=4)
    m.add_request("n", prompt_tokens=5, max_new_tokens=4)
    with pytest.raises(CacheManagerError, match=match):
        m.append_token_ids_many(rids, ids)
    assert m.known_token_ids("a").size == 5


def _append_refusal(model, totals, rids, tokens):
    """The refusal ``append_token_ids_many`` words for ``model`` (id -> known ids, None without ids), in its
    order: a negative id, an unknown request, one listed twice, one without ids, one past its total."""
    k = tokens.shape[1]
    if (tokens < 0).any():
        return "token ids must be in"
    if any(rid not in model for rid in rids):
        return "unknown request"
    if len(set(rids)) < len(rids):
        return "appears twice"
    if any(model[rid] is None for rid in rids):
        return "without token ids"
    if any(len(model[rid]) + k > totals[rid] for rid in rids):
        return "declared total"
    return None


_APPEND_OPS = hst.lists(hst.tuples(hst.lists(hst.sampled_from("abcdz"), min_size=1, max_size=5),
                                   hst.integers(0, 3), hst.integers(-1, 9), hst.sampled_from("abcd")), max_size=12)


@settings(max_examples=60, deadline=None)
@given(_APPEND_OPS)
def test_append_token_ids_many_matches_one_by_one_appends_and_its_refusals(ops):
    # The compiled batch path (int32 [n, k]) against append_token_ids one request at a time and a model:
    # the same known ids, refusals in the same order of checks that change nothing, rows freed and reused.
    fast, slow = (manager([SWA, KV], 60, ctx=64, step=16) for _ in range(2))
    model, totals = {}, {}

    def add(rid):
        for m in (fast, slow):
            if rid == "d":  # no token ids
                m.add_request(rid, prompt_tokens=3, max_new_tokens=4)
            else:
                m.add_request(rid, np.arange(3, dtype=np.int32) + ord(rid), max_new_tokens=3 + ord(rid) % 4)
        model[rid] = None if rid == "d" else list(range(ord(rid), ord(rid) + 3))
        totals[rid] = 3 + (4 if rid == "d" else 3 + ord(rid) % 4)

    for rid in "abcd":
        add(rid)
    for rids, k, token, gone in ops:
        tokens = (np.arange(len(rids) * k, dtype=np.int32).reshape(len(rids), k) + token) * np.int32(token)
        refusal = _append_refusal(model, totals, rids, tokens)
        if refusal is None:
            fast.append_token_ids_many(tuple(rids), tokens)
            for rid, line in zip(rids, tokens.tolist()):
                slow.append_token_ids(rid, line)
                model[rid] += line
        else:
            with pytest.raises(CacheManagerError, match=refusal):
                fast.append_token_ids_many(list(rids), tokens)
        for rid in model:
            assert fast.known_token_ids(rid).tolist() == slow.known_token_ids(rid).tolist() == (model[rid] or [])
        fast.check_invariants()  # each live row's token-id address is its request's, a freed row's 0
        if gone in model and len(model) > 1:  # its row goes back, and a new request takes it
            for m in (fast, slow):
                m.free(gone)
            del model[gone]
            add(gone)


def _known(m, rids):
    return {rid: m.known_token_ids(rid).tolist() for rid in rids}


def schedulable_up_to(m, counts):
    """Each request admits exactly its known tokens not yet computed (the step kernel's
    own count of known ids: one more is refused for lack of ids, or past the declared total
    where every declared id is known)."""
    for rid, known in counts.items():
        todo = known - m.num_computed_tokens(rid)
        assert todo == 0 or m.check_admission([(rid, todo)])[0].ok
        reason = m.check_admission([(rid, todo + 1)])[0].reason
        assert f"exceeds the {known} known token ids" in reason or f"declared total of {known} " in reason


def test_one_token_appends_in_every_form_equal_the_general_path():
    # k = 1 takes a scalar store per request, k = 2 the slice path; lists, tuples,
    # numpy rows and ids just scheduled (memoized rows) all give the same token ids.
    ms = [manager([SWA, KV], 40, ctx=64, step=16) for _ in range(4)]
    for m in ms:
        m.add_request("a", np.arange(5), max_new_tokens=6)
        m.add_request("b", np.arange(3), max_new_tokens=6)
    ms[3].schedule([("a", 5), ("b", 3)])  # ms[3]'s appends find the batch's rows memoized
    ms[0].append_token_ids("a", [11])
    ms[0].append_token_ids("b", (12,))
    ms[0].append_token_ids("a", np.array([13], dtype=np.int64))
    ms[0].append_token_ids("b", np.array([14, 15], dtype=np.uint16))
    ms[1].append_token_ids_many(["a", "b"], [[11], [12]])
    ms[1].append_token_ids_many(("a",), np.array([[13]]))
    ms[1].append_token_ids_many(["b"], np.array([[14, 15]]))
    for m in ms[2:]:
        m.append_token_ids_many(("a", "b"), np.array([[11], [12]], dtype=np.int32))
        m.append_token_ids_many(["a"], np.array([[13]], dtype=np.uint8))
        m.append_token_ids_many(("b",), np.array([[14, 15]]))
    want = {"a": [0, 1, 2, 3, 4, 11, 13], "b": [0, 1, 2, 12, 14, 15]}
    for m in ms:
        assert _known(m, "ab") == want
        schedulable_up_to(m, {"a": 7, "b": 6})


@pytest.mark.parametrize("ids, match", [
    (np.array([-1]), "token ids"),
    (np.array([2**31]), "token ids"),
    (np.array([1.0]), "integers"),
    (np.array([True]), "integers"),
    (np.array([[1]]), "1-D"),
])
def test_short_token_arrays_are_validated_like_lists(ids, match):
    m = manager([SWA, KV], 40, ctx=64, step=16)
    m.add_request("a", np.arange(5), max_new_tokens=4)
    with pytest.raises(CacheManagerError, match=match):
        m.append_token_ids("a", ids)
    assert _known(m, "a") == {"a": [0, 1, 2, 3, 4]}


def test_batched_append_refusals_for_a_scheduled_batch_change_nothing():
    # The ids were just scheduled (rows memoized): over the declared total, or a
    # request without token ids, is still refused with its reason, all or nothing.
    m = manager([SWA, KV], 40, ctx=64, step=16)
    m.add_request("a", np.arange(5), max_new_tokens=4)
    m.add_request("b", np.arange(7), max_new_tokens=1)
    m.add_request("n", prompt_tokens=5, max_new_tokens=4)
    m.schedule([("a", 5), ("b", 7), ("n", 5)])
    m.append_token_ids("b", [9])  # b now knows its declared 8
    before = _known(m, "ab")
    with pytest.raises(CacheManagerError, match="'b': 8 \\+ 1 tokens exceeds its declared total of 8"):
        m.append_token_ids_many(["a", "b"], [[1], [2]])
    with pytest.raises(CacheManagerError, match="'n' was added without token ids"):
        m.append_token_ids_many(("a", "n"), [[1], [2]])
    # One request at a time: the same reasons in the same words.
    with pytest.raises(CacheManagerError, match="'b': 8 \\+ 1 tokens exceeds its declared total of 8"):
        m.append_token_ids("b", [2])
    with pytest.raises(CacheManagerError, match="'n' was added without token ids"):
        m.append_token_ids("n", [])
    assert _known(m, "ab") == before
    schedulable_up_to(m, {"a": 5, "b": 8})


# --- shrinking a chunk to the memory left -------------------------------------------------
def test_max_admissible_tokens_worked_by_hand():
    # kv: 4-token pages, 9 pages with the null page -> 8 usable = 32 tokens.
    m = manager([KV], 9, ctx=256, step=64)
    m.add_request("a", prompt_tokens=12, max_new_tokens=8)
    m.schedule([("a", 12)])  # 3 pages
    m.add_request("b", prompt_tokens=100)
    # 5 pages left = 20 tokens; with "a" decoding one token in the same step (a 4th
    # page at position 12), 4 pages = 16 tokens.
    assert m.max_admissible_tokens("b", 100) == 20
    assert m.max_admissible_tokens("b", 100, batch=[("a", 1)]) == 16
    assert m.max_admissible_tokens("b", 7) == 7  # the asked count fits
    batch = m.schedule([("a", 1), ("b", 16)])  # reuses the last check
    assert batch.num_scheduled_tokens.tolist() == [1, 16]
    assert batch.groups["kv"].block_table.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert m.max_admissible_tokens("b", 100) == 0  # pool full: not even one token


def test_max_admissible_tokens_respects_step_and_known_token_limits():
    m = manager([KV], 64, ctx=256, step=10)
    m.add_request("a", np.arange(30, dtype=np.int32), max_new_tokens=5)
    assert m.max_admissible_tokens("a", 100) == 10  # max_step_tokens
    m.schedule([("a", 10)])
    m.schedule([("a", 10)])
    m.schedule([("a", 10)])
    assert m.max_admissible_tokens("a", 100) == 0  # every known token id computed
    m.append_token_ids("a", [1, 2])
    assert m.max_admissible_tokens("a", 100) == 2


def test_max_admissible_tokens_errors_change_nothing():
    m = manager([KV], 9, ctx=256, step=64)
    m.add_request("a", prompt_tokens=40)
    m.add_request("b", prompt_tokens=40)
    before = snapshot(m, ["a", "b"])
    with pytest.raises(CacheManagerError, match="unknown request"):
        m.max_admissible_tokens("zz", 4)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(CacheManagerError, match="max_tokens"):
            m.max_admissible_tokens("a", bad)
    with pytest.raises(CacheManagerError, match="already in the batch"):
        m.max_admissible_tokens("a", 4, batch=[("a", 1)])
    with pytest.raises(CacheManagerError, match="rest of the batch is not admissible"):
        m.max_admissible_tokens("a", 4, batch=[("b", 40)])  # 10 pages > 8
    assert snapshot(m, ["a", "b"]) == before


@given(
    pages=hst.integers(3, 40),
    others=hst.lists(hst.tuples(hst.integers(1, 300), hst.integers(1, 64)), max_size=3),
    want=hst.integers(1, 700),
    shared=hst.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_max_admissible_tokens_is_the_largest_count_admission_accepts(pages, others, want, shared):
    """Whatever the state: the answer is admitted with the batch, one more token is not
    (unless a non-memory limit caps it), and schedule() then succeeds."""
    specs = v4_specs()
    if shared:
        from hybridkv.memory.arena import arena_geometry

        sizes = {s.group_id: 10 + 7 * i for i, s in enumerate(specs)}
        geom = arena_geometry(sizes, 60 * pages, anchor_group="v4.c4a.compressed_kv", slab_anchor_pages=4)
        m = CacheManager(specs, None, max_context_tokens=4096, max_step_tokens=512, arena=geom)
    else:
        m = manager(specs, pages, step=512)
    candidates, batch = [], []
    for i, (prompt, step) in enumerate(others):
        m.add_request(f"o{i}", prompt_tokens=prompt, max_new_tokens=64)
        n = m.max_admissible_tokens(f"o{i}", prompt)  # a prefill chunk of what fits
        if n:
            m.schedule([(f"o{i}", n)])
            candidates.append((f"o{i}", min(step, prompt - n) or 1))
    for item in candidates:  # the rest of the step with "x": what is admitted together
        if all(a.ok for a in m.check_admission(batch + [item])):
            batch.append(item)
    m.add_request("x", prompt_tokens=600)
    n = m.max_admissible_tokens("x", want, batch=batch)
    cap = min(want, 512, 600)
    assert 0 <= n <= cap
    if n:
        assert all(a.ok for a in m.check_admission(batch + [("x", n)]))
    if n < cap:
        assert not all(a.ok for a in m.check_admission(batch + [("x", n + 1)]))
    if n:
        m.schedule(batch + [("x", n)])
    m.check_invariants()


def test_schedule_after_a_denying_check_names_only_the_denied_requests():
    m = manager([KV], 9, ctx=256, step=64)
    for rid in ("a", "b"):
        m.add_request(rid, prompt_tokens=20)
    items = [("a", 20), ("b", 20)]  # 5 + 5 pages of 8
    assert [a.ok for a in m.check_admission(items)] == [True, False]
    with pytest.raises(CacheManagerError, match=r"^1 of 2 requests not admissible: group 'kv' needs 5 new pages"):
        m.schedule(items)  # reuses the cached check


def test_check_admission_denies_an_invalid_item_beside_a_settling_row():
    """An invalid item is left out of the plan; when it was scheduled last step, its row settles first in the plan
    (one row per item again): its answer must still deny it, as schedule's error does."""
    m = manager([KV], 40, ctx=256, step=64)
    m.add_request("a", prompt_tokens=4)
    m.add_request("b", prompt_tokens=8)
    m.schedule([("a", 4)])  # a is done: 4 + 10 passes its declared total, and its row settles in the next plan
    items = [("a", 10), ("b", 8)]
    answers = m.check_admission(items)
    assert [a.ok for a in answers] == [False, True]
    assert "4 + 10 tokens exceeds its declared total of 4" in answers[0].reason
    with pytest.raises(CacheManagerError, match="exceeds its declared total"):
        m.schedule(items)


@settings(max_examples=60, deadline=None)
@given(hst.data())
def test_invalid_items_are_denied_in_any_batch_and_leave_the_valid_answers_alone(data):
    """Invalid items (past a declared total or the step limit, unknown, no tokens) are left out of the plan: in any
    batch, after any steps, each is denied, and the other items get the answers they get without them."""
    m = manager([SWA, KV], data.draw(hst.integers(6, 24)), ctx=64, step=16)
    totals = {}
    for i in range(4):
        prompt, extra = data.draw(hst.integers(1, 40)), data.draw(hst.integers(0, 8))
        m.add_request(f"r{i}", prompt_tokens=prompt, max_new_tokens=extra)
        totals[f"r{i}"] = prompt + extra
    left = lambda rid: totals[rid] - m.num_computed_tokens(rid)  # noqa: E731
    for _ in range(data.draw(hst.integers(0, 4))):  # steps before (the last one's rows may settle in the next plan)
        rids = data.draw(hst.lists(hst.sampled_from(sorted(totals)), unique=True, min_size=1, max_size=3))
        items = [(rid, min(data.draw(hst.integers(1, 16)), left(rid))) for rid in rids if left(rid) > 0]
        if items and all(a.ok for a in m.check_admission(items)):
            m.schedule(items)
    batch, invalid = [], []
    for rid in data.draw(hst.permutations(sorted(totals) + ["nope"])):
        if rid != "nope" and left(rid) > 0 and data.draw(hst.booleans()):
            batch.append((rid, data.draw(hst.integers(1, min(16, left(rid))))))
        elif data.draw(hst.booleans()):
            invalid.append(len(batch))
            batch.append((rid, data.draw(hst.sampled_from([0, 17] + ([] if rid == "nope" else [left(rid) + 1])))))
    answers = m.check_admission(batch)
    assert all(not answers[i].ok and answers[i].reason for i in invalid)
    valid = [i for i in range(len(batch)) if i not in invalid]
    assert [answers[i] for i in valid] == m.check_admission([batch[i] for i in valid])


def test_step_objects_are_whole_frozen_dataclasses():
    """The step's objects each carry exactly their fields and refuse assignment, in
    both table modes."""
    import dataclasses

    from hybridkv.runtime.batch import GroupStep, StepBatch, TableUpdates

    m = manager(v4_specs(), 64, step=512)
    m.add_request("a", prompt_tokens=300)
    for mode in ("full", "updates"):
        batch = m.schedule([("a", 100)], block_tables=mode)
        objects = [(batch, StepBatch)] + [(g, GroupStep) for g in batch.groups.values()]
        if batch.table_updates is not None:
            objects.append((batch.table_updates, TableUpdates))
        for obj, cls in objects:
            assert type(obj) is cls
            assert set(vars(obj)) == {f.name for f in dataclasses.fields(cls)}
            with pytest.raises(dataclasses.FrozenInstanceError):
                obj.__setattr__(dataclasses.fields(cls)[0].name, None)
    assert batch.table_updates is not None and isinstance(batch.table_updates.widths, tuple)


def test_check_invariants_catches_a_pool_array_rebound_off_the_page_space():
    """Releases go through PageSpace's arrays; a pool whose array was replaced would
    diverge from them silently, so check_invariants says so."""
    m = manager(v4_specs(), 64, step=512)
    m.add_request("a", prompt_tokens=100)
    m.schedule([("a", 100)])
    m.check_invariants()
    pool = next(iter(m.pools.values()))
    pool.cached = pool.cached.copy()
    with pytest.raises(AssertionError, match="cached rebound"):
        m.check_invariants()


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64])
def test_prompt_ids_of_every_integer_dtype_are_checked_against_the_int32_range(dtype):
    # Reference: the range check on Python ints, whatever the array's dtype.
    info = np.iinfo(dtype)
    for value in sorted(v for v in {0, 7, int(info.max), int(info.min), -1, 2**31 - 1, 2**31} if info.min <= v <= info.max):
        m = manager([SWA, KV], 40, ctx=64, step=16)
        prompt = np.array([1, value, 2], dtype=dtype)
        if 0 <= value < 2**31:
            m.add_request("a", prompt, max_new_tokens=1)
            assert m.has_request("a")
        else:
            with pytest.raises(CacheManagerError, match=r"token ids must be in \[0, 2\*\*31\)"):
                m.add_request("a", prompt, max_new_tokens=1)
            assert not m.has_request("a")


@pytest.mark.parametrize("caching", [False, True])
def test_free_of_a_request_holding_more_pages_than_the_free_buffers_is_one_release(caching):
    """``free`` of a request holding 500 pages of one group (more than the 256 the page
    space's free buffers start with, so they grow on this call): every page goes back in
    one release (the first page on top of the free stack: the next request gets 1, 2, ...),
    or, with prefix caching, its published blocks stay cached and idle and a request with
    the same prompt borrows them back."""
    m = manager([SWA, KV], {"swa": 300, "kv": 600}, enable_prefix_caching=caching, prefix_granularity=8)
    prompt = np.arange(2001, dtype=np.int32) % 97
    m.add_request("big", prompt)
    while m.num_computed_tokens("big") < 2001:
        m.schedule([("big", min(512, 2001 - m.num_computed_tokens("big")))])
    assert len(held(m, "big", "kv")[1]) == 501
    m.free("big")
    m.check_invariants()
    kv = m.stats()["kv"]
    assert kv.free_pages == 599 and kv.used_pages == 0
    assert kv.evictable_pages == (500 if caching else 0)  # blocks below 2000 published, the last one not
    hit = m.add_request("again", prompt)
    assert hit.hit_tokens == (2000 if caching else 0)
    m.schedule([("again", 1 if caching else 8)])
    assert held(m, "again", "kv")[1][:500 if caching else 2] == list(range(1, 501 if caching else 3))
    m.check_invariants()


def test_an_int32_prompt_array_is_added_as_the_same_list_and_refused_alike():
    """``add_request``'s common case (a 1-D int32 array, no salt) skips the checks' calls
    and copies the ids in one compiled call that checks them: it registers what the same
    prompt as a list registers (hit, pages, token ids), and what the checks refuse it
    refuses with the same error, nothing registered."""
    prompt = (np.arange(40, dtype=np.int32) * 7) % 13
    managers = [manager([SWA, KV], 64, enable_prefix_caching=True, prefix_granularity=8) for _ in range(2)]
    for m, as_given in zip(managers, (prompt.tolist(), prompt)):
        m.add_request("first", prompt.tolist(), max_new_tokens=2)
        m.schedule([("first", 40)])
        m.free("first")
        hit = m.add_request("again", as_given, max_new_tokens=3)
        assert hit.hit_tokens == 32
    assert snapshot(managers[0], ["again"]) == snapshot(managers[1], ["again"])
    assert [m.known_token_ids("again").tolist() for m in managers] == [prompt.tolist()] * 2
    m = managers[1]
    before = snapshot(m, ["again"])
    for args, kwargs, error in [
        (("again", prompt), {}, "already exists"),
        (("neg", np.array([3, -1], dtype=np.int32)), {}, r"in \[0, 2\*\*31\)"),
        (("empty", np.zeros(0, dtype=np.int32)), {}, "at least one token"),
        (("flag", prompt), {"max_new_tokens": True}, "max_new_tokens must be an integer"),
        (("neg_new", prompt), {"max_new_tokens": -1}, "max_new_tokens must be non-negative"),
        (("", prompt), {}, "non-empty str"),
        (("salt", prompt), {"cache_salt": 5}, "cache_salt"),
        (("long", prompt), {"max_new_tokens": 4096 - 39}, "exceeds the plan's max context"),
    ]:
        with pytest.raises(CacheManagerError, match=error):
            m.add_request(*args, **kwargs)
        assert snapshot(m, ["again"]) == before


def test_int32_prompt_arrays_of_any_layout_are_copied_alike():
    """The compiled copy of ``add_request``'s int32 ids is called past the type dispatch with one type for
    every layout: strided, reversed and read-only arrays register the ids a list does, and a negative id
    in a strided view is refused with nothing registered."""
    ids = (np.arange(120, dtype=np.int32) * 7) % 13
    read_only = ids.copy()
    read_only.flags.writeable = False
    m = manager([SWA, KV], 64, enable_prefix_caching=True, prefix_granularity=8)
    for rid, prompt in (("strided", ids[::3]), ("reversed", ids[::-1]), ("read_only", read_only),
                        ("offset", ids[1::2])):
        m.add_request(rid, prompt, max_new_tokens=2)
        assert m.known_token_ids(rid).tolist() == prompt.tolist()
    before = snapshot(m, ["strided"])
    negative = ids.copy()
    negative[9] = -4
    with pytest.raises(CacheManagerError, match=r"in \[0, 2\*\*31\)"):
        m.add_request("neg", negative[::3])
    assert snapshot(m, ["strided"]) == before and not m.has_request("neg")
