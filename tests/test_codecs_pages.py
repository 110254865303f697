"""Structure-of-arrays pages and slot pools for every codec: layout by hand, errors, properties."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.codecs import FP8IndexerCodec, KVRowCodec, MXFP4IndexerCodec, StateRowCodec

TINY = KVRowCodec(head_dim=128, rope_dim=64)
REAL = KVRowCodec(head_dim=512, rope_dim=64)
MX = MXFP4IndexerCodec(dim=128)
FP8 = FP8IndexerCodec(dim=128)
STATE = StateRowCodec(width=6)
CODECS = {"kv128": TINY, "kv512": REAL, "mxfp4": MX, "fp8": FP8, "state": STATE}


def tiny_x(*nope_first):
    x = np.zeros((len(nope_first), 128), np.float32)
    x[:, 0] = nope_first
    return x


# --- layout by hand ---------------------------------------------------------------------


def test_tiny_kv_page_layout_scale_and_pad_positions():
    # R = 2, 194-byte rows: token data [0, 384), scales [384, 388) as (scale, pad) per row,
    # padding [388, 576) untouched. Offsets [1, 0]: input row 0 goes to page row 1.
    page = np.full(TINY.page_stride_bytes(2), 0xEE, np.uint8)
    assert page.size == 576
    TINY.write_page(page, [1, 0], tiny_x(448.0, 0.0), 2)
    want = np.full(576, 0xEE, np.uint8)
    want[:384] = 0
    want[192] = 0x7E  # page row 1, first FP8 byte (448 at e = 0)
    want[384:388] = [105, 0, 127, 0]  # row 0: zero tile (byte 105) + pad; row 1: byte 127 + pad
    np.testing.assert_array_equal(page, want)
    np.testing.assert_array_equal(TINY.read_page(page, [0, 1, -1], 2), tiny_x(0.0, 448.0, 0.0))


def test_real_kv_page_and_pool_offsets():
    # R = 2: stride 1,728; row r token data at 576 r, scales at 1,152 + 8 r
    x = np.zeros((1, 512), np.float32)
    x[0, 0], x[0, 448] = 448.0, 1.0  # FP8 0x7E; rope bf16 1.0 = 80 3F
    page = REAL.new_pool(1, 2)[0]
    REAL.write_page(page, [1], x, 2)
    assert page[576] == 0x7E and list(page[576 + 448 : 576 + 450]) == [0x80, 0x3F]
    np.testing.assert_array_equal(page[1160:1168], [127, 105, 105, 105, 105, 105, 105, 0])
    assert not page[:576].any() and not page[1152:1160].any() and not page[1168:].any()
    # R = 64 pool: slot 3 * 64 + 5 -> page 3, token data at 5 * 576, scales at 64 * 576 + 5 * 8
    pool = REAL.new_pool(4, 64)
    REAL.write_slots(pool, np.array([197]), x, 64)
    assert pool[3, 5 * 576] == 0x7E
    np.testing.assert_array_equal(pool[3, 36_864 + 40 : 36_864 + 48], [127] + [105] * 6 + [0])
    assert np.count_nonzero(pool) == 1 + 1 + 1 + 7  # 0x7E, two rope bytes (0x80, 0x3F), 7 scales
    assert not pool[[0, 1, 2]].any()


def test_indexer_pages_are_structure_of_arrays_without_padding():
    x = np.zeros((1, 128), np.float32)
    x[0, 0] = 6.0  # MXFP4: value byte 0x07, scales [127, 1, 1, 1]
    pool = MX.new_pool(2, 4)
    assert pool.shape == (2, 272)
    MX.write_slots(pool, [6], x, 4)  # page 1, row 2: values at 128, scales at 256 + 8
    assert pool[1, 128] == 0x07
    np.testing.assert_array_equal(pool[1, 264:268], [127, 1, 1, 1])
    assert np.count_nonzero(pool) == 5

    x[0, 0] = 448.0  # FP8: value byte 0x7E, scale 1.0 = 00 00 80 3F
    pool = FP8.new_pool(2, 4)
    assert pool.shape == (2, 528)
    FP8.write_slots(pool, [5], x, 4)  # page 1, row 1: values at 128, scale at 512 + 4
    assert pool[1, 128] == 0x7E
    np.testing.assert_array_equal(pool[1, 516:520], [0, 0, 0x80, 0x3F])
    assert np.count_nonzero(pool) == 3


def test_state_rows_are_plain_float32_with_a_float_view():
    pool = STATE.new_pool(3, 4)
    assert pool.shape == (3, 96)  # 4 rows * 6 floats * 4 bytes
    x = np.arange(12, dtype=np.float32).reshape(2, 6) - 5.5
    STATE.write_slots(pool, [9, 2], x, 4)  # page 2 row 1, page 0 row 2
    np.testing.assert_array_equal(pool[2, 24:48].view(np.float32), x[0])
    view = STATE.float_view(pool, 4)
    assert view.shape == (3, 4, 6)
    np.testing.assert_array_equal(view[0, 2], x[1])
    view[1, 3] = 7.0  # writes go through to the pool
    np.testing.assert_array_equal(STATE.read_slots(pool, [7, 9, -1], 4), [[7.0] * 6, x[0], [0.0] * 6])
    np.testing.assert_array_equal(STATE.encode(x).view(np.float32), x)
    assert STATE.fake_quantize(x) is not x


def test_read_of_skip_slots_and_of_an_empty_pool():
    pool = MX.new_pool(0, 4)
    assert MX.read_slots(pool, [-1, -1], 4).shape == (2, 128)
    assert not MX.read_slot_bytes(pool, [-1], 4).any()
    MX.write_slots(pool, [-1], np.ones((1, 128), np.float32), 4)  # nothing to write
    assert MX.read_slots(pool, np.zeros(0, np.int64), 4).shape == (0, 128)


def test_skipped_rows_are_not_validated_but_written_rows_are():
    pool = TINY.new_pool(2, 2)
    x = tiny_x(1.0, np.nan)
    TINY.write_slots(pool, [0, -1], x, 2)  # the NaN row is skipped
    np.testing.assert_array_equal(TINY.read_slots(pool, [0], 2), tiny_x(1.0))
    before = pool.copy()
    with pytest.raises(ValueError, match="NaN"):
        TINY.write_slots(pool, [1, 2], x, 2)  # row 0 would be fine; row 1 is NaN
    np.testing.assert_array_equal(pool, before)


# --- errors: nothing is written -----------------------------------------------------------------


def expect_rejected(codec, pool, slots, x, rows_per_page, match=None):
    before = pool.copy()
    with pytest.raises(ValueError, match=match):
        codec.write_slots(pool, slots, x, rows_per_page)
    np.testing.assert_array_equal(pool, before)


@pytest.mark.parametrize(
    "slots, match",
    [
        ([0, 8], "out of range"),  # 2 pages * 4 rows
        ([-2, 0], "out of range"),
        ([3, 3], "more than once"),
        ([0.0, 1.0], "integer"),
        ([True, False], "integer"),
        ([[0, 1]], "1-D"),
        ([0], "shape"),  # 1 slot for 2 rows
    ],
)
def test_bad_slots_are_rejected(slots, match):
    pool = MX.new_pool(2, 4)
    pool[:] = 0x5A
    expect_rejected(MX, pool, slots, np.ones((2, 128), np.float32), 4, match)


def test_repeated_skip_slots_are_fine():
    pool = MX.new_pool(2, 4)
    MX.write_slots(pool, [-1, 7, -1], np.ones((3, 128), np.float32), 4)
    assert np.count_nonzero(pool) == 64 + 4
    big = np.arange(4000, dtype=np.int64)
    big[3999] = 17  # a repeat found by the sort path (capacity >> slots) and the bitmap path
    for pages in (1000, 40_000):
        expect_rejected(MX, MX.new_pool(pages, 4), big, np.ones((4000, 128), np.float32), 4, "17")


@pytest.mark.parametrize(
    "pool_fn, match",
    [
        (lambda: np.zeros((2, 272), np.float32), "uint8"),
        (lambda: np.zeros(544, np.uint8), "2-D"),
        (lambda: np.zeros((2, 204), np.uint8), "rows_per_page"),  # a pool made for R = 3
        (lambda: np.zeros((2, 544), np.uint8)[:, ::2], "contiguous"),
        (lambda: np.zeros((2, 272), np.uint8).T.copy().T, "contiguous"),
        (lambda: [[0] * 272] * 2, "uint8"),
    ],
)
def test_bad_pools_are_rejected(pool_fn, match):
    pool = pool_fn()
    with pytest.raises(ValueError, match=match):
        MX.write_slots(pool, [0], np.ones((1, 128), np.float32), 4)
    with pytest.raises(ValueError, match=match):
        MX.read_slots(pool, [0], 4)


def test_read_only_pool():
    pool = MX.new_pool(1, 4)
    pool.flags.writeable = False
    expect_rejected(MX, pool, [0], np.ones((1, 128), np.float32), 4, "read-only")
    assert MX.read_slots(pool, [0], 4).shape == (1, 128)


@pytest.mark.parametrize("rows_per_page", [0, -4, 4.0, True, None])
def test_bad_rows_per_page(rows_per_page):
    with pytest.raises(ValueError):
        MX.page_stride_bytes(rows_per_page)
    with pytest.raises(ValueError):
        MX.new_pool(2, rows_per_page)
    with pytest.raises(ValueError):
        MX.read_slots(MX.new_pool(1, 4), [0], rows_per_page)


@pytest.mark.parametrize("num_pages", [-1, 2.0, True])
def test_bad_num_pages(num_pages):
    with pytest.raises(ValueError):
        MX.new_pool(num_pages, 4)


@pytest.mark.parametrize(
    "x, match",
    [
        (np.ones(128, np.float32), "shape"),
        (np.ones((1, 127), np.float32), "last dimension"),
        (np.ones((1, 128), np.int32), "dtype"),
        (np.full((1, 128), np.inf, np.float32), "NaN or infinity"),
    ],
)
def test_bad_values_are_rejected(x, match):
    pool = FP8.new_pool(1, 4)
    pool[:] = 0x33
    expect_rejected(FP8, pool, [1], x, 4, match)


def test_bad_page_buffers():
    x = tiny_x(1.0)
    for page in (np.zeros(575, np.uint8), np.zeros((1, 576), np.uint8), np.zeros(576, np.int8)):
        with pytest.raises(ValueError, match="page_buf"):
            TINY.write_page(page, [0], x, 2)
        with pytest.raises(ValueError, match="page_buf"):
            TINY.read_page(page, [0], 2)
    page = TINY.new_pool(1, 2)[0]
    with pytest.raises(ValueError, match="out of range"):
        TINY.write_page(page, [2], x, 2)
    assert not page.any()


def test_bad_row_bytes():
    pool = MX.new_pool(1, 4)
    rows = MX.encode(np.ones((2, 128), np.float32))
    for bad in (rows[:, :67], rows.astype(np.int16), rows[0], [list(rows[0])]):
        with pytest.raises(ValueError):
            MX.write_slot_bytes(pool, [0, 1][: len(np.atleast_2d(bad))], bad, 4)
    assert not pool.any()


# --- properties ----------------------------------------------------------------------------------


@st.composite
def pool_case(draw, name):
    """A codec, R, a pool pre-filled with random bytes, unique slots (some -1) and valid rows."""
    codec = CODECS[name]
    rows_per_page = draw(st.sampled_from([1, 2, 3, 4, 64] if name != "kv512" else [1, 2, 3, 64]))
    num_pages = draw(st.integers(1, 3))
    capacity = num_pages * rows_per_page
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(0, min(capacity, 8)))
    slots = rng.permutation(capacity)[:n].astype(np.int64)
    skip = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    slots[skip] = -1
    x = (rng.standard_normal((n, codec.dim)) * 2.0 ** rng.integers(-20, 20, (n, 1))).astype(np.float32)
    pool = rng.integers(0, 256, (num_pages, codec.page_stride_bytes(rows_per_page)), dtype=np.uint8)
    return codec, rows_per_page, pool, slots, x


def row_byte_mask(codec, pool_shape, slots, rows_per_page):
    """Bytes the rows at ``slots`` own, from the layout formula (value part, scale part)."""
    mask = np.zeros(pool_shape, bool)
    vb, sb = codec.value_bytes, codec.scale_bytes
    for slot in slots[slots >= 0]:
        page, row = divmod(int(slot), rows_per_page)
        mask[page, row * vb : (row + 1) * vb] = True
        start = rows_per_page * vb + row * sb
        mask[page, start : start + sb] = True
    return mask


@pytest.mark.parametrize("name", CODECS)
@given(data=st.data())
def test_scatter_then_gather_returns_the_rows_and_touches_nothing_else(name, data):
    codec, rows_per_page, pool, slots, x = data.draw(pool_case(name))
    before = pool.copy()
    codec.write_slots(pool, slots, x, rows_per_page)
    written = slots >= 0
    mask = row_byte_mask(codec, pool.shape, slots, rows_per_page)
    np.testing.assert_array_equal(pool[~mask], before[~mask])  # other rows, pages, padding
    got = codec.read_slot_bytes(pool, slots, rows_per_page)
    np.testing.assert_array_equal(got[written], codec.encode(x)[written])
    assert not got[~written].any()
    values = codec.read_slots(pool, slots, rows_per_page)
    np.testing.assert_array_equal(values[written], codec.fake_quantize(x)[written])
    assert not values[~written].any()
    # the same rows again through one page at a time
    for page in np.unique(slots[written] // rows_per_page):
        here = written & (slots // rows_per_page == page)
        offsets = slots[here] % rows_per_page
        np.testing.assert_array_equal(
            codec.read_page(pool[page], offsets, rows_per_page), values[here]
        )


@pytest.mark.parametrize("name", ["kv128", "mxfp4", "fp8"])
@given(data=st.data())
def test_a_second_write_leaves_earlier_rows_alone(name, data):
    codec, rows_per_page, pool, slots, x = data.draw(pool_case(name))
    slots = slots[slots >= 0]
    x = x[: slots.size]
    half = slots.size // 2
    codec.write_slots(pool, slots[:half], x[:half], rows_per_page)
    first = codec.read_slot_bytes(pool, slots[:half], rows_per_page)
    codec.write_slots(pool, slots[half:], x[half:] * 3, rows_per_page)
    np.testing.assert_array_equal(codec.read_slot_bytes(pool, slots[:half], rows_per_page), first)
    np.testing.assert_array_equal(
        codec.read_slots(pool, slots[half:], rows_per_page), codec.fake_quantize(x[half:] * 3)
    )


def test_gather_across_chunk_boundaries_with_skips():
    codec = MXFP4IndexerCodec(dim=128)
    codec.GATHER_CHUNK_BYTES = 68 * 100  # 100-row byte chunks; read_slots uses 512-row chunks
    rng = np.random.default_rng(5)
    pool = codec.new_pool(400, 4)
    slots = rng.permutation(1600)[:1300].astype(np.int64)
    x = rng.standard_normal((1300, 128)).astype(np.float32)
    codec.write_slots(pool, slots, x, 4)
    slots[rng.random(1300) < 0.2] = -1
    written = slots >= 0
    got = codec.read_slot_bytes(pool, slots, 4)
    np.testing.assert_array_equal(got[written], codec.encode(x)[written])
    assert not got[~written].any()
    values = codec.read_slots(pool, slots, 4)
    np.testing.assert_array_equal(values[written], codec.fake_quantize(x)[written])
    assert not values[~written].any()
