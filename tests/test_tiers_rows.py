"""Rows between codec pools and objects, found by logical position through page views."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.models.layout import cache_layout
from hybridkv.reference.config import ReferenceConfig
from hybridkv.tiers import (
    GroupPages,
    MissingRows,
    ObjectError,
    check_scatter,
    ObjectKey,
    gather_object,
    gather_objects,
    layout_parts,
    new_group_pools,
    rows_for_tokens,
    scatter_object,
    scatter_objects,
)

LAYOUT = cache_layout(ReferenceConfig().hf_config(), speculative_tokens=3)
PAGES = 200


def random_pools(seed, only=None):
    pools = new_group_pools(LAYOUT, {g.group_id: PAGES if only in (None, g.group_id) else 0 for g in LAYOUT.groups})
    rng = np.random.default_rng(seed)
    for group in pools.values():
        for plane in group.planes:
            plane.pool[...] = rng.integers(0, 256, plane.pool.shape, dtype=np.uint8)
    return pools


def random_view(rng, spec, first_token, end_token):
    """Held pages for logical pages covering the tokens, a random base below them (as low as
    the PAGES - 1 page ids allow), random ids."""
    first_row, num_rows = rows_for_tokens(spec, first_token, end_token)
    lo = first_row // spec.rows_per_page
    hi = -(-(first_row + num_rows) // spec.rows_per_page)
    base = int(rng.integers(max(0, hi - (PAGES - 1)), lo + 1))  # at most PAGES - 1 ids to hand out
    pages = rng.permutation(np.arange(1, PAGES))[: hi - base]
    return GroupPages(base, pages)


def reference_rows(group_pools, view, first_row, num_rows):
    """Row by row: page = view.pages[row // R - base], slot = page * R + row % R; plane by plane."""
    spec, out = group_pools.spec, []
    for plane in group_pools.planes:
        codec, rows = plane.codec, []
        for row in range(first_row, first_row + num_rows):
            page = int(view.pages[row // spec.rows_per_page - view.base_page])
            rows.append(codec.read_slot_bytes(plane.pool, [page * spec.rows_per_page + row % spec.rows_per_page],
                                              spec.rows_per_page)[0])
        out.append(np.array(rows, dtype=np.uint8).reshape(num_rows, codec.row_bytes).reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, np.uint8)


GROUPS = [g.group_id for g in LAYOUT.groups]


@settings(max_examples=20)
@given(st.sampled_from(GROUPS), st.integers(0, 700), st.integers(0, 300), st.integers(0, 2**31))
def test_gather_matches_row_by_row_reference_and_scatter_moves_rows_by_position(gid, first, span, seed):
    rng = np.random.default_rng(seed)
    src, dst = random_pools(seed, gid), random_pools(seed + 1, gid)
    spec = LAYOUT.group(gid).spec
    first_token = first - first % spec.entry_stride_tokens  # objects start on a row
    end_token = first_token + span
    src_view = random_view(rng, spec, first_token, end_token)
    dst_view = random_view(rng, spec, first_token, end_token)
    key = ObjectKey("block", gid, b"k")
    obj = gather_object(src[gid], src_view, key, first_token, end_token)
    first_row, num_rows = rows_for_tokens(spec, first_token, end_token)
    assert (obj.first_row, obj.num_rows) == (first_row, num_rows)
    assert obj.parts == layout_parts(LAYOUT, gid)
    assert np.array_equal(obj.payload, reference_rows(src[gid], src_view, first_row, num_rows))

    before = [p.pool.copy() for p in dst[gid].planes]
    scatter_object(dst[gid], dst_view, obj)
    assert np.array_equal(reference_rows(dst[gid], dst_view, first_row, num_rows), obj.payload)
    # only the object's rows changed: every other row of every page is as it was
    written = dst_view.slots(spec, first_row, num_rows)
    for plane, old in zip(dst[gid].planes, before):
        all_slots = np.arange(PAGES * spec.rows_per_page)
        others = np.setdiff1d(all_slots, written)
        assert np.array_equal(plane.codec.read_slot_bytes(plane.pool, others, spec.rows_per_page),
                              plane.codec.read_slot_bytes(old, others, spec.rows_per_page))


def test_rows_for_tokens_counts_whole_rows_only():
    c4 = LAYOUT.group("v4.c4a.compressed_kv").spec
    c128 = LAYOUT.group("v4.c128a.compressed_kv").spec
    assert rows_for_tokens(c4, 256, 300) == (64, 11)  # tokens 256..299: rows 64..74, row 75 open
    assert rows_for_tokens(c128, 256, 300) == (2, 0)
    assert rows_for_tokens(c128, 0, 256) == (0, 2)
    with pytest.raises(ValueError):
        rows_for_tokens(c4, 10, 5)


def test_a_row_on_no_held_page_is_refused_before_anything_is_written():
    pools = random_pools(1)
    spec = LAYOUT.group("v4.swa_kv").spec  # 64 rows a page
    view = GroupPages(2, np.array([5, -1, 7]))  # logical pages 2..4, page 3 released
    with pytest.raises(MissingRows, match="row 192"):
        gather_object(pools["v4.swa_kv"], view, ObjectKey("checkpoint", "v4.swa_kv", b"k"), 150, 200)
    with pytest.raises(MissingRows, match="row 100"):  # below the base
        view.slots(spec, 100, 10)
    obj = gather_object(pools["v4.swa_kv"], GroupPages(0, np.arange(1, 5)), ObjectKey("checkpoint", "v4.swa_kv", b"k"),
                        150, 200)
    before = pools["v4.swa_kv"].planes[0].pool.copy()
    with pytest.raises(MissingRows):
        scatter_object(pools["v4.swa_kv"], view, obj)
    assert np.array_equal(before, pools["v4.swa_kv"].planes[0].pool)


def test_scatter_refuses_an_object_of_another_group_or_shape():
    pools = random_pools(2)
    view = GroupPages(0, np.arange(1, 10))
    obj = gather_object(pools["v4.c4a.compressed_kv"], view, ObjectKey("block", "v4.c4a.compressed_kv", b"k"), 0, 64)
    with pytest.raises(ObjectError, match="group"):
        scatter_object(pools["v4.c128a.compressed_kv"], view, obj)


@settings(max_examples=20)
@given(st.lists(st.tuples(st.sampled_from(GROUPS), st.integers(0, 3), st.integers(1, 100)), min_size=1, max_size=6),
       st.integers(0, 2**31))
def test_batched_gather_and_scatter_equal_one_object_at_a_time(items, seed):
    rng = np.random.default_rng(seed)
    pages = {g.group_id: 0 for g in LAYOUT.groups} | {gid: 110 for gid, _, _ in items}
    src, one, many = (new_group_pools(LAYOUT, pages) for _ in range(3))
    for group in src.values():
        for plane in group.planes:
            plane.pool[...] = rng.integers(0, 256, plane.pool.shape, dtype=np.uint8)
    views, ranges, used = {}, [], set()
    for gid, block, span in items:
        if (gid, block) in used:
            continue  # objects of one batch never share rows
        used.add((gid, block))
        ranges.append((ObjectKey("block", gid, bytes([block + 1])), block * 100, block * 100 + span))
    for gid, count in pages.items():
        views[gid] = GroupPages(0, rng.permutation(np.arange(1, count)))
    batched = gather_objects(src, views, ranges)
    held = gather_objects(src, views, ranges, hold_gil=True)  # the step thread's kernel: the same rows
    single = [gather_object(src[k.group_id], views[k.group_id], k, a, b) for k, a, b in ranges]
    for x, y, z in zip(batched, single, held):
        assert x.key == y.key and (x.first_row, x.num_rows) == (y.first_row, y.num_rows)
        assert np.array_equal(x.payload, y.payload) and np.array_equal(z.payload, y.payload)
    scatter_objects(many, views, batched)
    for obj in single:
        scatter_object(one[obj.key.group_id], views[obj.key.group_id], obj)
    for gid in one:
        for a, b in zip(one[gid].planes, many[gid].planes):
            assert np.array_equal(a.pool, b.pool)


def _first_missing_row(spec, views, ranges):
    """Row by row, object after object: the first row whose view holds no page for it (None: none)."""
    for view, (_, first_token, end_token) in zip(views, ranges):
        first_row, num_rows = rows_for_tokens(spec, first_token, end_token)
        for row in range(first_row, first_row + num_rows):
            logical = row // spec.rows_per_page - view.base_page
            if not 0 <= logical < len(view.pages) or view.pages[logical] < 0:
                return row
    return None


@settings(max_examples=30)
@given(st.sampled_from(GROUPS), st.lists(st.tuples(st.integers(0, 600), st.integers(0, 200), st.integers(0, 9)),
                                         min_size=1, max_size=6), st.integers(0, 2**31), st.booleans())
def test_gather_through_a_view_per_object_equals_one_object_at_a_time(gid, items, seed, hold_gil):
    """An offload's sources: each object read through its own page view (the compiled slot pass),
    against one object at a time; a view lacking a page refuses the first row on it, in order."""
    rng, src = np.random.default_rng(seed), random_pools(seed, only=gid)
    spec = src[gid].spec
    views, ranges = [], []
    for i, (first, span, hole) in enumerate(items):
        view = random_view(rng, spec, first, first + span)
        if hole == 0 and view.pages.size:  # a released page
            view = GroupPages(view.base_page, np.where(np.arange(view.pages.size) == rng.integers(view.pages.size),
                                                       -1, view.pages))
        elif hole == 1:  # a view starting above the object's first rows
            view = GroupPages(view.base_page + 1, view.pages[1:])
        views.append(view)
        ranges.append((ObjectKey("block", gid, bytes([i + 1])), first, first + span))
    missing = _first_missing_row(spec, views, ranges)
    if missing is not None:
        with pytest.raises(MissingRows, match=f"cache row {missing} "):
            gather_objects(src, views, ranges, hold_gil=hold_gil)
        return
    gathered = gather_objects(src, views, ranges, hold_gil=hold_gil)
    for obj, view, (_, first, end) in zip(gathered, views, ranges):
        first_row, num_rows = rows_for_tokens(spec, first, end)
        assert (obj.first_row, obj.num_rows) == (first_row, num_rows)
        assert np.array_equal(obj.payload, reference_rows(src[gid], view, first_row, num_rows))


# --- the compiled batched copies: sources, refusals, bounds -----------------------------

def _encoded_blob(objects):
    """The objects encoded one after the other in one buffer, decoded back as views of it
    (as a tier's receive buffer holds a fetched batch)."""
    from hybridkv.tiers import decode_object, encode_object, layout_namespace

    ns = layout_namespace(LAYOUT)
    encoded = [encode_object(o, ns) for o in objects]
    blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    views, at = [], 0
    for data in encoded:
        views.append(decode_object(memoryview(blob)[at : at + len(data)], ns))
        at += len(data)
    return views


@settings(max_examples=15)
@given(st.lists(st.tuples(st.sampled_from(GROUPS), st.integers(0, 3), st.integers(1, 100)), min_size=1, max_size=8),
       st.integers(0, 2**31), st.integers(0, 3))
def test_scatter_of_views_of_one_buffer_and_of_own_payloads_equals_one_object_at_a_time(items, seed, split):
    rng = np.random.default_rng(seed)
    pages = {g.group_id: 0 for g in LAYOUT.groups} | {gid: 110 for gid, _, _ in items}
    src, one, many = (new_group_pools(LAYOUT, pages) for _ in range(3))
    for group in src.values():
        for plane in group.planes:
            plane.pool[...] = rng.integers(0, 256, plane.pool.shape, dtype=np.uint8)
    ranges = sorted({(gid, block): (ObjectKey("block", gid, bytes([block + 1])), block * 100, block * 100 + span)
                     for gid, block, span in items}.values(), key=lambda r: (r[0].group_id, r[1]))
    views = {gid: GroupPages(0, rng.permutation(np.arange(1, count))) for gid, count in pages.items()}
    objects = [gather_object(src[k.group_id], views[k.group_id], k, a, b) for k, a, b in ranges]
    # the first `split` objects in one shared buffer, the rest with their own payloads
    mixed = _encoded_blob(objects[:split]) + [o for o in objects[split:]]
    scatter_objects(many, views, mixed)
    halves = new_group_pools(LAYOUT, pages)  # the copies split between this thread and a helper
    with ThreadPoolExecutor(1) as helper:
        scatter_objects(halves, views, mixed, helper=helper)
    for obj in objects:
        scatter_object(one[obj.key.group_id], views[obj.key.group_id], obj)
    for gid in one:
        for a, b, c in zip(one[gid].planes, many[gid].planes, halves[gid].planes):
            assert np.array_equal(a.pool, b.pool) and np.array_equal(a.pool, c.pool)


def _pools_copy(pools):
    return {gid: [p.pool.copy() for p in g.planes] for gid, g in pools.items()}


def _unchanged(pools, before):
    return all(np.array_equal(p.pool, old) for gid, g in pools.items() for p, old in zip(g.planes, before[gid]))


def test_batched_scatter_refuses_rows_written_twice_or_pages_outside_the_pools_before_writing():
    gid = "v4.c4a.compressed_kv"
    src, dst = random_pools(3), random_pools(4)
    view = GroupPages(0, np.arange(1, 20))
    a = gather_object(src[gid], view, ObjectKey("block", gid, b"a"), 0, 256)
    b = gather_object(src[gid], view, ObjectKey("block", gid, b"b"), 256, 512)
    overlap = gather_object(src[gid], view, ObjectKey("block", gid, b"c"), 128, 384)
    before = _pools_copy(dst)
    with pytest.raises(ValueError, match="same cache row"):
        scatter_objects(dst, {gid: view}, [a, b, overlap])
    outside = GroupPages(0, np.array([1, PAGES + 5]))  # page id beyond the pools
    with pytest.raises(ValueError, match="beyond"):
        scatter_objects(dst, {gid: outside}, [a, b])
    assert _unchanged(dst, before)
    scatter_objects(dst, {gid: view}, [a, b])
    assert not _unchanged(dst, before)


def test_check_scatter_answers_each_range_s_slots_and_scatter_takes_them():
    src, by_slots, by_views = random_pools(7), random_pools(8), random_pools(8)
    rng = np.random.default_rng(7)
    ranges = [(ObjectKey("block", gid, bytes([i + 1])), 256 * i, 256 * (i + 1)) for gid in GROUPS for i in range(3)]
    views = {gid: random_view(rng, src[gid].spec, 0, 768) for gid in GROUPS}
    slots = check_scatter(by_slots, views, ranges)
    for (key, a, b), got in zip(ranges, slots):  # the rows' slots, found row by row
        first_row, num_rows = rows_for_tokens(src[key.group_id].spec, a, b)
        rpp, view = src[key.group_id].spec.rows_per_page, views[key.group_id]
        rows = range(first_row, first_row + num_rows)
        expected = [int(view.pages[r // rpp - view.base_page]) * rpp + r % rpp for r in rows]
        assert got.tolist() == expected
    objects = gather_objects(src, views, ranges)
    assert objects[0].num_rows > 0
    scatter_objects(by_slots, views, objects, slots=slots)
    scatter_objects(by_views, views, objects)
    assert _unchanged(by_slots, _pools_copy(by_views))
    with pytest.raises(ValueError, match="slots for an object"):
        scatter_objects(by_slots, views, objects[:1], slots=[slots[0][:-1]])  # one slot short


@pytest.mark.parametrize("per_range", [False, True])
def test_gather_into_a_given_buffer_leaves_the_room_asked_for_before_each_payload(per_range):
    """Through one view per group, or one per range (an offload's sources: the compiled pass that
    finds each range's slots through its own view and copies in the same call)."""
    src = random_pools(9)
    rng = np.random.default_rng(9)
    ranges = [(ObjectKey("block", gid, bytes([i + 1])), 256 * i, 256 * (i + 1)) for gid in GROUPS[:3] for i in range(2)]
    views = {gid: random_view(rng, src[gid].spec, 0, 512) for gid in GROUPS}
    if per_range:
        views = [views[key.group_id] for key, _, _ in ranges]
    room = [int(n) for n in rng.integers(0, 50, len(ranges))]
    fresh = gather_objects(src, views, ranges)
    need = sum(room) + sum(o.payload.size for o in fresh)
    into = np.full(need + 10, 0xEE, dtype=np.uint8)
    placed = gather_objects(src, views, ranges, room_bytes=room, into=into)
    at = 0
    for a, b, gap in zip(fresh, placed, room):  # ranges are in group order: laid out one after the other
        assert np.array_equal(a.payload, b.payload) and np.shares_memory(b.payload, into)
        assert b.payload.ctypes.data - into.ctypes.data == at + gap and np.all(into[at : at + gap] == 0xEE)
        at += gap + b.payload.size
    assert np.all(into[need:] == 0xEE)
    with pytest.raises(ValueError, match="into holds"):
        gather_objects(src, views, ranges, room_bytes=room, into=into[: need - 1])


@pytest.mark.parametrize("hold_gil", [False, True])
def test_gather_through_views_refuses_a_page_outside_the_pools_before_writing(hold_gil):
    """A view naming a page past the pools' pages: ``ValueError`` naming the row, and the buffer
    given is left as it was (the slots are all checked before the first row is copied)."""
    src = random_pools(4)
    gid = GROUPS[0]
    rng = np.random.default_rng(4)
    ranges = [(ObjectKey("block", gid, bytes([i + 1])), 256 * i, 256 * (i + 1)) for i in range(3)]
    views = [random_view(rng, src[gid].spec, a, b) for _, a, b in ranges]
    fresh = gather_objects(src, views, ranges, hold_gil=hold_gil)
    bad = GroupPages(views[2].base_page, np.where(np.arange(views[2].pages.size) == views[2].pages.size - 1,
                                                  PAGES + 3, views[2].pages))
    into = np.full(sum(o.payload.size for o in fresh), 0xEE, dtype=np.uint8)
    first_row, num_rows = rows_for_tokens(src[gid].spec, 512, 768)
    outside = [r for r in range(first_row, first_row + num_rows)
               if r // src[gid].spec.rows_per_page - bad.base_page == bad.pages.size - 1][0]
    with pytest.raises(ValueError, match=f"cache row {outside} lies beyond"):
        gather_objects(src, views[:2] + [bad], ranges, into=into, hold_gil=hold_gil)
    assert np.all(into == 0xEE)


def test_batched_scatter_refuses_a_read_only_pool_before_writing():
    gid = "v4.c128a.compressed_kv"
    src, dst = random_pools(5), random_pools(6)
    view = GroupPages(0, np.arange(1, 20))
    obj = gather_object(src[gid], view, ObjectKey("block", gid, b"a"), 0, 1024)
    before = _pools_copy(dst)
    dst[gid].planes[-1].pool.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        scatter_objects(dst, {gid: view}, [obj])
    assert _unchanged(dst, before)


def test_row_copy_kernels_copy_nothing_when_a_row_is_out_of_bounds():
    from hybridkv.tiers.rowcopy import gather_rows, scatter_rows

    rpp, value_bytes, scale_bytes = 4, 6, 2
    pool = np.zeros((3, rpp * (value_bytes + scale_bytes)), dtype=np.uint8)
    src = np.arange(1, 1 + 2 * (value_bytes + scale_bytes), dtype=np.uint8)
    starts, rows = np.array([0], np.int64), np.array([2], np.int64)
    for slots in ([0, 12], [-1, 3], [0]):  # past the 12 slots, negative, fewer slots than rows
        assert scatter_rows(pool, src, starts, rows, np.array(slots, np.int64), value_bytes, scale_bytes, rpp) >= 0
        assert not pool.any()
    assert scatter_rows(pool, src, np.array([1], np.int64), rows, np.array([0, 5], np.int64), value_bytes,
                        scale_bytes, rpp) == 0  # the rows run past the end of src
    assert not pool.any()
    assert scatter_rows(pool, src, starts, rows, np.array([0, 5], np.int64), value_bytes, scale_bytes, rpp) == -1
    # slot 5 = page 1 row 1: its values at 1 * 6, its scales after the page's 4 * 6 value bytes
    assert pool[1, 6:12].tolist() == list(range(9, 15)) and pool[1, 26:28].tolist() == [15, 16]
    assert pool[0, 0:6].tolist() == list(range(1, 7)) and pool[0, 24:26].tolist() == [7, 8]
    back = np.zeros_like(src)
    assert gather_rows(pool, back, starts, rows, np.array([0, 5], np.int64), value_bytes, scale_bytes, rpp) == -1
    assert np.array_equal(back, src)
    assert gather_rows(pool, back[:-1], starts, rows, np.array([0, 5], np.int64), value_bytes, scale_bytes, rpp) == 0
