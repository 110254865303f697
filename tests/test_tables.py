"""The table store and the step kernels' table work: release point, page needs,
write slots and kernel tables (worked by hand)."""

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.runtime import kernels
from hybridkv.spec import CacheGroupSpec
from hybridkv.runtime.manager import CacheManager
from hybridkv.tables.store import NARROW_STEP_TOKENS, CommitPages, TableSet, cdiv, live_pages_bound

SWA_4_8 = CacheGroupSpec("swa", "sliding_window", 4, 1, sliding_window_tokens=8, family="state")
C4 = CacheGroupSpec("c4", "full_history", rows_per_page=64, entry_stride_tokens=4)
ROW0 = np.array([0])


def store(spec, max_context_tokens, max_step_tokens, rows=2):
    ts = TableSet([spec], max_context_tokens=max_context_tokens, max_step_tokens=max_step_tokens,
                  initial_rows=rows)
    return ts, ts.tables[0]


def place_row(ts, row, lo, counts, page_ids):
    """A prefix hit's placement as ``lru.borrow_row`` runs it: ``kernels.place_row``, every
    group in one call, each page's ring-view cell written over it (in a copy of ``page_ids``),
    then the cells it wrote logged."""
    cells = page_ids.copy()
    kernels.place_row(ts.geometry, ts.pages, ts.bounds, row, lo, counts, cells, cells)
    ts.note_cells(cells)


def place(ts, g, rows, lo, counts, page_ids):
    """The reference for ``kernels.place_row``, in plain steps: group ``g``'s ``page_ids``
    at logical pages ``[lo_r, lo_r + counts_r)`` of each of ``rows``, row-major (a row whose
    live pages then outgrow its narrow ring moves to its lane first: ``kernels.fit_ring``),
    the cells written logged; bounds unchanged."""
    if not len(page_ids):
        return
    table = ts.tables[g]
    for row, first, n in zip(rows.tolist(), lo.tolist(), counts.tolist()):
        base, hi = int(table.base[row]), int(table.hi[row])
        live = max(hi, first + n) - (min(base, first) if hi > base else first)
        if live > table.ring_pages or ts.bounds[kernels.LANE, g, row]:
            kernels.fit_ring(ts.geometry, ts.pages, ts.bounds, g, row, live)
    at = np.empty(int(counts.sum()), dtype=np.int64)
    view = np.empty_like(at)
    kernels.span_cells(ts.geometry, ts.bounds, g, rows, lo, lo + counts, at, view)
    ts.pages[at] = page_ids
    ts.note_cells(view)


def planned(ts, first, count=1):
    """(base after, pages needed) of row 0 writing ``count`` tokens from ``first`` (``prepare_step``)."""
    computed = np.zeros(ts.rows_capacity, dtype=np.int64)
    computed[0] = first
    out = [np.empty(1, dtype=np.int64) for _ in range(3)]
    after, need = np.empty((2, 1, 1), dtype=np.int64), np.empty((1, 1), dtype=np.int64)
    counters = np.stack([computed, computed, np.full(computed.size, 10**9), computed * 0, computed])
    kernels.prepare_step(ts.geometry, ts.bounds, counters, np.zeros(0, dtype=np.int64), ROW0,
                         np.array([count]), 0, np.array([10**6]), np.zeros(computed.size, dtype=np.bool_), *out,
                         after, need, np.empty((2, 1), dtype=np.int64), np.empty(1, dtype=np.int64),
                         np.empty(4, dtype=np.int64), np.zeros(0, dtype=np.int64))
    return int(after[0, 0, 0]), int(need[0, 0])


def slots_of(ts, rows, positions):
    slots = np.empty((1, len(positions)), dtype=np.int64)
    # One plan row per token: its row, from its position, one token.
    kernels.write_slots(ts.geometry, ts.pages, ts.bounds, np.asarray(rows, dtype=np.int64),
                        np.asarray(positions, dtype=np.int64), np.ones(len(positions), dtype=np.int64), 0, slots)
    return slots[0].tolist()


def test_cdiv():
    assert cdiv(0, 4) == 0 and cdiv(1, 4) == 1 and cdiv(4, 4) == 1 and cdiv(5, 4) == 2


def test_release_point_of_a_chunk_starting_at_12():
    """rows 4, W 8: a chunk starting at 12 reads from token 5, page (12-8+1)//4 = 1."""
    ts, table = store(SWA_4_8, 64, 16)
    table.hi[0] = 3  # tokens [0, 12) held on logical pages 0, 1, 2
    assert planned(ts, 12)[0] == 1
    # Token 4 (page 1) is still in the window of position 11: (11-7)//4 = 1.
    assert planned(ts, 11)[0] == 1
    # Position 10 reads token 3, on page 0: nothing released.
    assert planned(ts, 10)[0] == 0
    assert planned(ts, 0)[0] == 0
    # Never moves back below the current base.
    table.base[0] = 2
    assert planned(ts, 12)[0] == 2


def test_full_history_group_never_releases():
    ts, table = store(C4, 4096, 256)
    table.hi[0] = 5
    assert planned(ts, 2000)[0] == 0


def test_no_plan_for_a_row_listed_twice_or_past_its_known_tokens():
    ts, _ = store(C4, 4096, 256, rows=3)
    computed, known = np.array([5, 0, 9]), np.array([6, 4, 9])
    mark = np.zeros(3, dtype=np.bool_)

    def plan_rows(rows, counts):
        n = len(rows)
        out = [np.empty(n, dtype=np.int64) for _ in range(3)]
        return kernels.prepare_step(
            ts.geometry, ts.bounds, np.stack([computed, computed, known, known * 0, computed]), np.zeros(0, dtype=np.int64),
            np.array(rows), np.array(counts), 0, np.array([10**6]), mark, *out, np.empty((2, 1, n), dtype=np.int64),
            np.empty((1, n), dtype=np.int64), np.empty((2, 1), dtype=np.int64), np.empty(n, dtype=np.int64),
            np.empty(4, dtype=np.int64), np.zeros(0, dtype=np.int64))[0]

    assert plan_rows([0, 1], [1, 4]) == 2  # 5 + 1 <= 6 and 0 + 4 <= 4
    assert plan_rows([0, 1, 0], [1, 1, 1]) == -1  # row 0 twice
    assert not mark.any()  # the scratch flags are clear again
    assert plan_rows([0, 1], [2, 1]) == -1  # 5 + 2 > 6 known tokens
    assert plan_rows([1, 2], [1, 1]) == -1  # row 2 knows no token past its 9 computed
    assert plan_rows([0, 1], [1, 0]) == -1  # a count of 0
    ts.geometry[:, kernels.STEP_TOKENS] = 3  # the store's step limit: a row of 4 tokens refused
    assert plan_rows([1], [4]) == -1 and plan_rows([1], [3]) == 1


def test_compressed_pages_needed_for_1_256_257_tokens():
    ts, _ = store(C4, 4096, 512)
    # A c4 page spans 64 rows * 4 tokens = 256 tokens; a partial entry needs its page.
    assert [planned(ts, 0, n)[1] for n in (1, 256, 257)] == [1, 1, 2]


def test_compressed_write_slots_with_table_10_11():
    ts, table = store(C4, 4096, 256)
    place(ts, 0, ROW0, np.array([0]), np.array([2]), np.array([10, 11]))
    table.hi[0] = 2
    # 3 -> row 0 -> 10*64; 7 -> row 1; 127 -> row 31; 4 closes no window;
    # 259 -> row 64 = page 1 row 0 -> 11*64; 511 -> row 127 -> 11*64 + 63.
    assert slots_of(ts, [0] * 6, [3, 7, 127, 4, 259, 511]) == [640, 641, 671, -1, 704, 767]


def test_int64_slots_do_not_overflow():
    spec = CacheGroupSpec("kv", "full_history", rows_per_page=64, entry_stride_tokens=1)
    ts, table = store(spec, 128, 64)
    big = 40_000_000  # big * 64 > 2**31
    place(ts, 0, ROW0, np.array([0]), np.array([1]), np.array([big]))
    table.hi[0] = 1
    assert slots_of(ts, [0], [5]) == [big * 64 + 5]


def test_sliding_ring_table_columns_start_at_the_base_page():
    ts, table = store(SWA_4_8, 64, 8)
    # capacity = cdiv(8 - 1 + 8, 4) + 2 = 6 ring slots, rounded up to a power of two
    assert table.capacity_pages == 8
    rows = np.array([0, 1])
    # Row 0 holds logical pages 7..9 (the ring wraps at 8), row 1 holds logical page 0.
    place(ts, 0, rows, np.array([7, 0]), np.array([3, 1]), np.array([21, 22, 23, 30]))
    table.base[:2] = [7, 0]
    table.hi[:2] = [10, 1]
    assert ts.ring_view()[0, 0, [7, 0, 1]].tolist() == [21, 22, 23]
    assert ts.block_table(0, rows, 3).tolist() == [[21, 22, 23], [30, -1, -1]]
    assert ts.block_table(0, rows, 5).tolist() == [[21, 22, 23, -1, -1], [30, -1, -1, -1, -1]]
    # Token 30 is on logical page 7 (page 21), row 2 -> 21*4 + 2.
    # Token 37 is on logical page 9 (page 23), row 1 -> 93.
    assert slots_of(ts, [0, 0, 1], [30, 37, 3]) == [86, 93, 123]
    # pages_in() lists ids in logical order across the ring's wrap; a base past them hides them.
    assert table.pages_in(np.array([0]), np.array([7]), np.array([9])).tolist() == [21, 22]
    table.base[0] = 9
    assert ts.block_table(0, np.array([0]), 1).tolist() == [[23]]


def test_full_history_fixed_width_wider_than_capacity_is_padded():
    spec = CacheGroupSpec("kv", "full_history", rows_per_page=4, entry_stride_tokens=1)
    ts, table = store(spec, 8, 8)
    assert table.capacity_pages == 2
    place(ts, 0, ROW0, np.array([0]), np.array([2]), np.array([7, 9]))
    table.hi[0] = 2
    assert ts.block_table(0, ROW0, 4).tolist() == [[7, 9, -1, -1]]
    assert ts.block_table(0, ROW0, 2).tolist() == [[7, 9]]


def test_ensure_rows_keeps_existing_rows():
    ts, table = store(SWA_4_8, 64, 8, rows=1)
    place(ts, 0, ROW0, np.array([0]), np.array([1]), np.array([5]))
    table.hi[0] = 1
    ts.ensure_rows(3)
    table = ts.tables[0]
    assert ts.rows_capacity >= 3
    view = ts.ring_view()[0]
    assert view[0, 0] == 5 and np.all(view[0, 1:] == -1) and np.all(view[1:] == -1)
    assert table.hi.tolist()[:3] == [1, 0, 0]


def test_live_pages_bound_is_the_plans_widest_row():
    """cdiv(W + n + T - 2, T): no step of n tokens leaves a row more live pages, and
    some first position reaches it (hand check, W 8 T 4 n 1: cdiv(11, 4) = 3, e.g.
    first 10 keeps pages 0..2 for tokens 3..10)."""
    assert live_pages_bound(8, 4, 1) == 3
    for rows, stride, window in ((4, 1, 8), (3, 1, 7), (2, 2, 6), (8, 1, 128), (64, 1, 128)):
        spec = CacheGroupSpec("s", "sliding_window", rows, stride, sliding_window_tokens=window)
        t = rows * stride
        for n in sorted({1, 2, t - 1, t, t + 1, 3 * t + 2}):
            if n < 1:
                continue
            ts, table = store(spec, 10**6, n, rows=1)
            widest = 0
            for first in range(0, window + 3 * t):
                table.base[0], table.hi[0] = 0, cdiv(first, t)
                base, held = planned(ts, first, n)
                widest = max(widest, held - base)
            assert widest == live_pages_bound(window, t, n), (rows, stride, window, n)
            assert widest <= table.capacity_pages
            if n <= NARROW_STEP_TOKENS:
                assert widest <= table.ring_pages


def claim_space(pages: int) -> SimpleNamespace:
    """What ``CommitPages`` claims entries in (a page space's arrays) for three groups of ``pages`` held pages."""
    return SimpleNamespace(ref_counts=np.ones(3 * pages, np.int32), cached=np.zeros(3 * pages, np.bool_),
                           low_priority=np.zeros(3 * pages, np.bool_), pools=[SimpleNamespace(num_pages=pages)] * 3)


def wide_rows(ts) -> np.ndarray:
    """The rows whose group 0 pages sit in their lane now (the debug view ``lanes``)."""
    return np.flatnonzero(ts.lanes(0) >= 0)


def test_a_long_chunk_moves_a_row_to_its_lane_and_decode_moves_it_back():
    """W 8, T 4, steps up to 64 tokens: rings of 32 pages, narrow rings of 4."""
    m = CacheManager([SWA_4_8], {"swa": 64}, max_context_tokens=256, max_step_tokens=64)
    table = m.tables["swa"]
    ts = table.table_set
    assert (table.capacity_pages, table.ring_pages) == (32, 4)
    m.add_request("a", prompt_tokens=100, max_new_tokens=8)
    m.add_request("b", prompt_tokens=40, max_new_tokens=8)
    m.schedule([("b", 3)])
    batch = m.schedule([("a", 40), ("b", 1)])  # a: tokens [0, 40) on 10 pages, all live this step
    assert wide_rows(ts).size == 1  # a's row
    base, held = m.request_pages("a", "swa")
    assert base == 0 and held.size == 10
    assert batch.groups["swa"].block_table[0].tolist() == held.tolist()
    # Position 39's slot is on logical page 9.
    assert batch.groups["swa"].write_slots[39] == held[9] * 4 + 3
    batch = m.schedule([("a", 1), ("b", 1)])  # releases below (40 - 7) // 4 = 8: pages 8, 9, 10 live
    assert wide_rows(ts).size == 0
    base, now = m.request_pages("a", "swa")
    assert base == 8 and now[:2].tolist() == held[8:].tolist()
    assert batch.groups["swa"].block_table[0].tolist() == now.tolist()
    # b's chunk takes the lane a left (the lowest free one), then a free hands a's back.
    m.schedule([("a", 1), ("b", 30)])
    assert ts.lanes(0).max() == 0 and wide_rows(ts).size == 1
    m.free("b")
    assert wide_rows(ts).size == 0
    m.check_invariants()


def test_ensure_rows_keeps_a_wide_rows_lane():
    ts, table = store(SWA_4_8, 256, 64, rows=1)
    place(ts, 0, ROW0, np.array([3]), np.array([9]), np.arange(40, 49))
    table.base[0], table.hi[0] = 3, 12
    assert wide_rows(ts).tolist() == [0]
    before = ts.ring_view()[0, 0].copy()
    ts.ensure_rows(5)
    assert wide_rows(ts).tolist() == [0]
    assert np.array_equal(ts.ring_view()[0, 0], before)
    assert ts.block_table(0, ROW0, 9).tolist() == [list(range(40, 49))]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=3, max_size=3), st.integers(4, 40))
def test_ensure_rows_keeps_every_live_cell(spans, rows_after):
    """Growing the store keeps every row's live pages where every reader finds them (ring view,
    block tables, ``pages_in``, lanes): a full-history group, and sliding rows narrow, wrapped
    around their ring or wide (in a lane)."""
    ts = TableSet([C4, SWA_4_8, SWA_4_4], max_context_tokens=2048, max_step_tokens=64, initial_rows=3)
    start = 1
    for row, (first, n) in enumerate(spans):
        lo, counts = np.array([0, first, first]), np.array([min(n, 8), n, n])
        place_row(ts, row, lo, counts, np.arange(start, start + counts.sum()))
        start += counts.sum()
    rows = np.arange(3)
    before = ts.ring_view(), [ts.block_table(g, rows, 16) for g in range(3)], [ts.lanes(g) for g in range(3)]
    ts.ensure_rows(rows_after)
    assert ts.rows_capacity >= rows_after
    assert np.array_equal(ts.ring_view()[:, :3], before[0]) and np.all(ts.ring_view()[:, 3:] == -1)
    for g, table in enumerate(ts.tables):
        assert np.array_equal(ts.block_table(g, rows, 16), before[1][g])
        assert np.array_equal(ts.lanes(g)[:3], before[2][g])
        for row, held in enumerate(before[1][g]):
            assert table.pages_in(row, table.base[row], table.hi[row]).tolist() == held[held >= 0].tolist()


def test_every_reader_of_a_row_sees_the_same_pages():
    """``pages_in`` of one row and of many, the kernels' ``block_table`` and the ring view agree, for a
    wide sliding row (in its lane), a narrow one that wraps its ring, and a full-history row."""
    ts, table = store(SWA_4_8, 256, 64, rows=3)
    place(ts, 0, np.array([0, 1]), np.array([3, 5]), np.array([9, 3]), np.arange(40, 52))
    table.base[[0, 1]], table.hi[[0, 1]] = [3, 5], [12, 8]
    assert wide_rows(ts).tolist() == [0]  # 9 live pages outgrow the narrow ring of 4
    for row, base, pages in ((0, 3, list(range(40, 49))), (1, 5, [49, 50, 51])):
        hi = base + len(pages)
        assert table.pages_in(row, base, hi).tolist() == pages
        assert table.pages_in(row, base + 1, hi - 1).tolist() == pages[1:-1]
        assert table.pages_in(np.array([row]), np.array([base]), np.array([hi])).tolist() == pages
        assert ts.block_table(0, np.array([row]), len(pages)).tolist() == [pages]
        view = ts.ring_view()[0, row]
        assert [int(view[lp % table.capacity_pages]) for lp in range(base, hi)] == pages
    assert table.pages_in(np.array([1, 0]), np.array([5, 3]), np.array([8, 5])).tolist() == [49, 50, 51, 40, 41]
    full_ts, full = store(C4, 1024, 64, rows=2)
    place(full_ts, 0, np.array([1]), np.array([0]), np.array([3]), np.array([7, 8, 9]))
    full.hi[1] = 3
    assert full.pages_in(1, 0, 3).tolist() == [7, 8, 9] and full.pages_in(1, 1, 1).tolist() == []
    assert full.pages_in(np.array([1]), np.array([1]), np.array([3])).tolist() == [8, 9]


SWA_4_4 = CacheGroupSpec("swa4", "sliding_window", 4, 1, sliding_window_tokens=4, family="state")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2), st.integers(1, 5), st.integers(1, 20), st.data())
def test_commit_pages_reads_what_pages_in_reads(row, blocks, live_pages, data):
    """``CommitPages.read`` (one compiled call) gives, for a row of a full-history group
    and two sliding groups (one wide, in its lane, when its live pages outgrow the narrow
    ring), the pages ``GroupTable.pages_in`` gives span by span (the reference): the
    history group's blocks ``[first, end)``, then per boundary each sliding group's
    window, flagged live exactly when it lies in the row's ``[base, hi)``."""
    ts = TableSet([C4, SWA_4_8, SWA_4_4], max_context_tokens=2048, max_step_tokens=64, initial_rows=3)
    c4, swa8, swa4 = ts.tables
    rows = np.array([row])
    place(ts, 0, rows, np.array([0]), np.array([blocks]), np.arange(1, blocks + 1))
    c4.hi[row] = blocks
    end_pages = blocks * 64  # a 256-token block is 64 four-token pages
    for g, table in enumerate((swa8, swa4)):
        base = end_pages - min(live_pages, end_pages)
        place(ts, g + 1, rows, np.array([base]), np.array([end_pages - base]), np.arange(base, end_pages) + 1000 * (g + 1))
        table.base[row], table.hi[row] = base, end_pages
    first = data.draw(st.integers(0, blocks - 1))
    end = data.draw(st.integers(first + 1, blocks))
    boundaries = data.draw(st.lists(st.sampled_from([256 * b for b in range(1, blocks + 1)]), max_size=4))
    reader = CommitPages([(c4, 1)], [(swa8, 8), (swa4, 4)], claim_space(4096))
    pages, status = reader.read(row, first, end, boundaries)  # claims nothing
    assert status[:end - first] == [1] * (end - first)  # history blocks: always live
    live = status[end - first:]
    expected, expected_live = c4.pages_in(row, first, end).tolist(), []
    for d in boundaries:
        for table, window in ((swa8, 8), (swa4, 4)):
            lo, hi = (d - window) // 4, d // 4
            expected_live.append(int(lo >= table.base[row] and hi <= table.hi[row]))
            expected.extend(table.pages_in(row, lo, hi).tolist() if expected_live[-1] else [None] * (hi - lo))
    assert live == expected_live and len(pages) == len(expected)
    assert [p for p, e in zip(pages, expected) if e is not None] == [e for e in expected if e is not None]


def test_read_unit_of_one_block_claims_what_read_reads_before_and_after_the_store_grows():
    """``CommitPages.read_unit`` of one block and its checkpoint (a decode commit) gives the pages ``read`` gives
    (the reference) and keys them, a second claim of them None; again once the table store grew (new page and
    bound arrays, the block's pages placed in them alone)."""
    ts = TableSet([C4, SWA_4_8, SWA_4_4], max_context_tokens=2048, max_step_tokens=64, initial_rows=1)
    c4, swa8, swa4 = ts.tables
    space = claim_space(4096)
    reader = CommitPages([(c4, 1)], [(swa8, 8), (swa4, 4)], space)
    for blocks, shift in ((2, 0), (3, 300)):
        place(ts, 0, ROW0, np.array([0]), np.array([blocks]), np.arange(1, blocks + 1) + shift)
        c4.hi[0], end_pages = blocks, blocks * 64  # a 256-token block is 64 four-token pages
        for g, table in enumerate((swa8, swa4)):
            place(ts, g + 1, ROW0, np.array([end_pages - 2]), np.array([2]),
                  np.arange(end_pages - 2, end_pages) + 1000 * (g + 1) + shift)
            table.base[0], table.hi[0] = end_pages - 2, end_pages
        expected, status = reader.read(0, blocks - 1, blocks, [256 * blocks])
        assert status == [1, 1, 1]
        unit = (1, 0, blocks - 1, blocks, 0, 0, 0, 256 * blocks)
        assert reader.read_unit(unit) == expected
        assert space.cached[expected].all() and reader.read_unit(unit) is None
        ts.ensure_rows(4)


def test_read_unit_claims_a_commit_whole_or_not_at_all():
    """``CommitPages.read_unit`` (a commit of blocks and checkpoints claimed in one compiled call) gives ``read``'s
    pages (the reference) group by group, keys them and flags low the windows before the latest (``low`` 2); where
    a page of its latest window carries a key already it gives None and leaves every other page unkeyed."""
    ts = TableSet([C4, SWA_4_8, SWA_4_4], max_context_tokens=2048, max_step_tokens=512, initial_rows=1)
    c4, swa8, swa4 = ts.tables
    space = claim_space(4096)
    reader = CommitPages([(c4, 1)], [(swa8, 8), (swa4, 4)], space)
    place(ts, 0, ROW0, np.array([0]), np.array([3]), np.arange(1, 4))
    c4.hi[0] = 3
    for g, table in enumerate((swa8, swa4)):  # 70 live pages of 192 (a ring of them): windows at 512 and 768 live
        place(ts, g + 1, ROW0, np.array([122]), np.array([70]), np.arange(122, 192) + 1000 * (g + 1))
        table.base[0], table.hi[0] = 122, 192
    expected, status = reader.read(0, 1, 3, [512, 768])  # blocks 1, 2; at 512 swa8's 2, swa4's 1; at 768 the same
    assert status == [1] * 6 and len(expected) == 8
    by_group = expected[:2] + expected[2:4] + expected[5:7] + expected[4:5] + expected[7:]
    space.cached[expected[-1]] = True
    assert reader.read_unit((2, 0, 1, 3, 512, 256, 1, 768)) is None and space.cached.sum() == 1
    space.cached[expected[-1]] = False
    assert reader.read_unit((2, 0, 1, 3, 512, 256, 1, 768)) == by_group
    assert space.cached[by_group].all() and space.cached.sum() == 8
    assert sorted(np.flatnonzero(space.low_priority).tolist()) == sorted(expected[2:5])

def test_place_row_is_place_of_each_group_then_its_live_pages():
    """``kernels.place_row`` (a prefix hit's placement, which ``lru.borrow_row`` runs) against ``place`` (above)
    group by group with base and hi set after: the same store, bounds, lanes and logged cells,
    for a wide sliding row (9 pages outgrow the narrow ring of 4), a narrow one and a group
    that gets no page."""
    specs = [SWA_4_8, C4, CacheGroupSpec("swa2", "sliding_window", 4, 1, sliding_window_tokens=8, family="state")]
    cases = [(1, [3, 0, 5], [9, 3, 0]), (0, [1, 0, 2], [2, 5, 1])]
    for row, lo, counts in cases:
        sets = [TableSet(specs, max_context_tokens=256, max_step_tokens=64, initial_rows=3) for _ in range(2)]
        for ts in sets:
            ts.set_log(True)
            ts.drain_updates()  # the resync: only this row's cells are logged from here
        ids = np.arange(100, 100 + sum(counts), dtype=np.int64)
        place_row(sets[0], row, np.array(lo), np.array(counts), ids)
        start = 0
        for g, table in enumerate(sets[1].tables):
            place(sets[1], g, np.array([row]), np.array([lo[g]]), np.array([counts[g]]), ids[start : start + counts[g]])
            table.base[row], table.hi[row] = lo[g], lo[g] + counts[g]
            start += counts[g]
        fast, slow = sets
        # Lanes never written are address space, not memory: compare what a reader sees.
        assert np.array_equal(fast.ring_view(), slow.ring_view()) and np.array_equal(fast.bounds, slow.bounds)
        assert np.array_equal(fast.geometry, slow.geometry)
        assert [a.tolist() for a in fast.drain_updates()[:4]] == [a.tolist() for a in slow.drain_updates()[:4]]
        assert fast.tables[0].pages_in(row, lo[0], lo[0] + counts[0]).tolist() == list(range(100, 100 + counts[0]))
        assert wide_rows(fast).tolist() == ([row] if counts[0] > 4 else [])
    assert wide_rows(sets[0]).tolist() == []  # the second case stays narrow
