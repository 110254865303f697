"""GroupTable: release point, page needs, write slots and kernel tables (worked by hand)."""

import numpy as np

from hybridkv.spec import CacheGroupSpec
from hybridkv.tables import GroupTable, cdiv, segment_arange

SWA_4_8 = CacheGroupSpec("swa", "sliding_window", 4, 1, sliding_window_tokens=8, family="state")
C4 = CacheGroupSpec("c4", "full_history", rows_per_page=64, entry_stride_tokens=4)
ROW0 = np.array([0])


def test_cdiv_and_segment_arange():
    assert cdiv(0, 4) == 0 and cdiv(1, 4) == 1 and cdiv(4, 4) == 1 and cdiv(5, 4) == 2
    assert segment_arange(np.array([2, 0, 3, 1])).tolist() == [0, 1, 0, 1, 2, 0]
    assert segment_arange(np.array([0, 0])).size == 0


def test_release_point_of_a_chunk_starting_at_12():
    """rows 4, W 8: a chunk starting at 12 reads from token 5, page (12-8+1)//4 = 1."""
    table = GroupTable(SWA_4_8, max_context_tokens=64, max_step_tokens=16)
    table.hi[0] = 3  # tokens [0, 12) held on logical pages 0, 1, 2
    assert table.new_base(ROW0, np.array([12])).tolist() == [1]
    # Token 4 (page 1) is still in the window of position 11: (11-7)//4 = 1.
    assert table.new_base(ROW0, np.array([11])).tolist() == [1]
    # Position 10 reads token 3, on page 0: nothing released.
    assert table.new_base(ROW0, np.array([10])).tolist() == [0]
    assert table.new_base(ROW0, np.array([0])).tolist() == [0]
    # Never moves back below the current base.
    table.base[0] = 2
    assert table.new_base(ROW0, np.array([12])).tolist() == [2]


def test_full_history_group_never_releases():
    table = GroupTable(C4, max_context_tokens=4096, max_step_tokens=256)
    table.hi[0] = 5
    assert table.new_base(ROW0, np.array([2000])).tolist() == [0]


def test_compressed_pages_needed_for_1_256_257_tokens():
    table = GroupTable(C4, max_context_tokens=4096, max_step_tokens=256)
    # A c4 page spans 64 rows * 4 tokens = 256 tokens; a partial entry needs its page.
    assert table.need_hi(np.array([1, 256, 257])).tolist() == [1, 1, 2]


def test_compressed_write_slots_with_table_10_11():
    table = GroupTable(C4, max_context_tokens=4096, max_step_tokens=256)
    table.place(ROW0, np.array([0]), np.array([2]), np.array([10, 11]))
    table.hi[0] = 2
    positions = np.array([3, 7, 127, 4, 259, 511])
    slots = table.write_slots(np.zeros(6, dtype=np.int64), positions)
    # 3 -> row 0 -> 10*64; 7 -> row 1; 127 -> row 31; 4 closes no window;
    # 259 -> row 64 = page 1 row 0 -> 11*64; 511 -> row 127 -> 11*64 + 63.
    assert slots.tolist() == [640, 641, 671, -1, 704, 767]
    assert slots.dtype == np.int64


def test_int64_slots_do_not_overflow():
    spec = CacheGroupSpec("kv", "full_history", rows_per_page=64, entry_stride_tokens=1)
    table = GroupTable(spec, max_context_tokens=128, max_step_tokens=64)
    big = 40_000_000  # big * 64 > 2**31
    table.place(ROW0, np.array([0]), np.array([1]), np.array([big]))
    table.hi[0] = 1
    assert table.write_slots(ROW0, np.array([5])).tolist() == [big * 64 + 5]


def test_sliding_ring_table_columns_start_at_the_base_page():
    table = GroupTable(SWA_4_8, max_context_tokens=64, max_step_tokens=8)
    # capacity = cdiv(8 - 1 + 8, 4) + 2 = 6 ring slots
    assert table.capacity_pages == 6
    rows = np.array([0, 1])
    table.ensure_rows(2)
    # Row 0 holds logical pages 5..7 (ring wraps at 6), row 1 holds logical page 0.
    table.place(rows, np.array([5, 0]), np.array([3, 1]), np.array([21, 22, 23, 30]))
    table.base[:2] = [5, 0]
    table.hi[:2] = [8, 1]
    bt = table.block_table(rows)
    assert bt.dtype == np.int32
    assert bt.tolist() == [[21, 22, 23], [30, -1, -1]]
    assert table.block_table(rows, width=5).tolist() == [[21, 22, 23, -1, -1], [30, -1, -1, -1, -1]]
    # Write slots: token 22 is on logical page 5 (page 21), row 2 -> 21*4 + 2.
    # Token 29 is on logical page 7 (page 23), row 1 -> 93.
    slots = table.write_slots(np.array([0, 0, 1]), np.array([22, 29, 3]))
    assert slots.tolist() == [86, 93, 123]
    # take() returns released ids in logical order and forgets them.
    assert table.take(np.array([0]), np.array([5]), np.array([7])).tolist() == [21, 22]
    table.base[0] = 7
    assert table.block_table(np.array([0])).tolist() == [[23]]


def test_full_history_fixed_width_wider_than_capacity_is_padded():
    spec = CacheGroupSpec("kv", "full_history", rows_per_page=4, entry_stride_tokens=1)
    table = GroupTable(spec, max_context_tokens=8, max_step_tokens=8)
    assert table.capacity_pages == 2
    table.place(ROW0, np.array([0]), np.array([2]), np.array([7, 9]))
    table.hi[0] = 2
    assert table.block_table(ROW0, width=4).tolist() == [[7, 9, -1, -1]]
    assert table.block_table(ROW0).tolist() == [[7, 9]]


def test_ensure_rows_keeps_existing_rows():
    table = GroupTable(SWA_4_8, max_context_tokens=64, max_step_tokens=8, initial_rows=1)
    table.place(ROW0, np.array([0]), np.array([1]), np.array([5]))
    table.hi[0] = 1
    table.ensure_rows(3)
    assert table.pages.shape[0] >= 3
    assert table.pages[0, 0] == 5 and np.all(table.pages[1:] == -1)
    assert table.hi.tolist()[:3] == [1, 0, 0]
