"""stream_load: many objects into pools, the next batch fetched while this one is written."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.models.layout import cache_layout
from hybridkv.tiers import (
    GroupPages,
    HostTier,
    MissingRows,
    ObjectKey,
    ObjectStore,
    gather_objects,
    new_group_pools,
    scatter_object,
    stream_load,
)

FLASH = cache_layout("deepseek-v4-flash")
C4, C128, SWA = "v4.c4a.compressed_kv", "v4.c128a.compressed_kv", "v4.swa_kv"
PAGES = {C4: 12, C128: 12, SWA: 36}  # 8 blocks at most; the window checkpoint ends by logical page 32


class RingTier(HostTier):
    """A host tier whose ``fetch`` receives into ``buffers`` buffers that take turns, as the
    Mooncake tier does, and fills a buffer with 0xEE before reusing it: a view used after
    its buffer was reused reads 0xEE, not the object."""

    def __init__(self, buffers: int) -> None:
        super().__init__(1 << 30)
        self.fetch_views_kept = buffers
        self._rings = [np.zeros(8 << 20, dtype=np.uint8) for _ in range(buffers)]
        self._turn = 0
        self.fetches = 0

    def _fetch(self, names, sizes):
        ring = self._rings[self._turn]
        self._turn = (self._turn + 1) % len(self._rings)
        self.fetches += 1
        ring[...] = 0xEE
        out, at = [], 0
        for value in self._get(names):
            if value is None:
                out.append(None)
                continue
            ring[at : at + len(value)] = np.frombuffer(value, dtype=np.uint8)
            out.append(memoryview(ring)[at : at + len(value)].toreadonly())
            at += len(value)
        return out


def new_pools():
    return new_group_pools(FLASH, {g.group_id: PAGES.get(g.group_id, 1) for g in FLASH.groups})


def source(seed):
    pools, rng = new_pools(), np.random.default_rng(seed)
    for group in pools.values():
        for plane in group.planes:
            plane.pool[...] = np.frombuffer(rng.bytes(plane.pool.size), dtype=np.uint8).reshape(plane.pool.shape)
    views = {gid: GroupPages(0, rng.permutation(np.arange(1, pages))) for gid, pages in PAGES.items()}
    return pools, views


def ranges_of(blocks):
    """Blocks of the two compressed groups, and a window checkpoint at the end."""
    out = [(ObjectKey("block", gid, bytes([i + 1]) * 4), 256 * i, 256 * (i + 1))
           for i in range(blocks) for gid in (C4, C128)]
    return out + [(ObjectKey("checkpoint", SWA, b"\x09" * 4), 256 * blocks - 128, 256 * blocks)]


def stored(tier, blocks, seed=0):
    pools, views = source(seed)
    store = ObjectStore(tier, FLASH)
    ranges = ranges_of(blocks)
    objects = gather_objects(pools, views, ranges)
    assert all(store.put(objects))
    return store, ranges, objects


def copies(pools):
    return {gid: [p.pool.copy() for p in g.planes] for gid, g in pools.items()}


def same(a, b):
    return all(np.array_equal(x, y) for gid in a for x, y in zip(a[gid], b[gid]))


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 8), st.integers(1, 5), st.sampled_from([1, 2, 3]), st.booleans(), st.integers(0, 2**31))
def test_stream_load_writes_what_one_object_at_a_time_writes(blocks, batch_objects, buffers, overlap, seed):
    tier = RingTier(buffers)
    store, ranges, objects = stored(tier, blocks)
    streamed, views = source(seed)
    reference = {gid: [p.pool.copy() for p in g.planes] for gid, g in streamed.items()}
    reference_pools = new_pools()
    for gid, group in reference_pools.items():
        for plane, pool in zip(group.planes, reference[gid]):
            plane.pool[...] = pool
    for obj in objects:
        scatter_object(reference_pools[obj.key.group_id], views[obj.key.group_id], obj)
    written = stream_load(store, ranges, streamed, views, batch_objects=batch_objects, overlap=overlap)
    assert written == [True] * len(ranges)
    assert same(copies(streamed), copies(reference_pools))
    assert tier.fetches == -(-len(ranges) // batch_objects)


def test_a_corrupted_missing_or_misplaced_object_is_not_written_and_the_others_are():
    tier = RingTier(2)
    store, ranges, objects = stored(tier, 4)
    bad_name = store.name(ranges[2][0])
    data = bytearray(tier.get([bad_name])[0])
    data[-5] ^= 1
    tier.delete([bad_name])  # a put keeps a name's first value: replace it
    tier.put([(bad_name, bytes(data))])
    store.delete([ranges[5][0]])
    planned = list(ranges)
    planned[7] = (ranges[7][0], 256 * 3 + 4, 256 * 4)  # the object holds other tokens than planned
    pools, views = source(1)
    before = copies(pools)
    written = stream_load(store, planned, pools, views, batch_objects=3)
    assert written == [i not in (2, 5, 7) for i in range(len(ranges))]
    assert store.stats().corrupt == 1
    for i, (key, _, _) in enumerate(ranges):  # rows of the refused objects are as they were
        group, obj = pools[key.group_id], objects[i]
        slots = views[key.group_id].slots(group.spec, obj.first_row, obj.num_rows)
        rpp = group.spec.rows_per_page
        for plane, old in zip(group.planes, before[key.group_id]):
            now = plane.codec.read_slot_bytes(plane.pool, slots, rpp)
            assert np.array_equal(now, plane.codec.read_slot_bytes(old, slots, rpp)) == (not written[i])


def test_targets_are_checked_before_anything_is_fetched_or_written():
    tier = RingTier(2)
    store, ranges, _ = stored(tier, 3)
    pools, views = source(2)
    before = copies(pools)
    holey = dict(views)
    holey[C128] = GroupPages(0, np.array([3, -1, 5]))  # the second block's page is not held
    with pytest.raises(MissingRows):
        stream_load(store, ranges, pools, holey, batch_objects=2)
    with pytest.raises(ValueError, match="same cache row"):
        stream_load(store, ranges + ranges[:1], pools, views)
    with pytest.raises(ValueError, match="batch_objects"):
        stream_load(store, ranges, pools, views, batch_objects=0)
    assert same(copies(pools), before) and tier.fetches == 0


def test_verify_with_a_helper_answers_and_counts_as_on_one_thread():
    from concurrent.futures import ThreadPoolExecutor

    answers = []
    for helper in (None, ThreadPoolExecutor(1)):
        tier = RingTier(2)
        store, ranges, objects = stored(tier, 4)
        keys = [key for key, _, _ in ranges]
        values = [None if v is None else bytearray(v) for v in tier.get([store.name(k) for k in keys])]
        values[1][-3] ^= 4  # corrupted
        values[4] = None  # missing
        values[6] = values[0]  # another object's bytes under this key
        got, bad = store.verify(keys, values, helper=helper)
        answers.append(([None if o is None else bytes(o.payload) for o in got], bad, store.stats()))
        if helper is not None:
            helper.shutdown()
    assert answers[0] == answers[1]
    got, bad, stats = answers[0]
    assert [o is None for o in got] == [i in (1, 4, 6) for i in range(len(got))]
    assert bad == [ranges[1][0], ranges[6][0]] and (stats.corrupt, stats.missing, stats.loaded) == (2, 1, len(got) - 3)


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_large_all_or_nothing_load_on_two_threads_writes_every_row_or_none(corrupt):
    """load_objects past TWO_THREAD_LOAD_BYTES (checksums and copies split with a helper): every
    object's rows as the one-object reference writes them, or, with one object corrupted, none."""
    from hybridkv.transfer import TWO_THREAD_LOAD_BYTES, PlannedObject, load_objects

    tier = HostTier(1 << 30)
    store, ranges, objects = stored(tier, 8)
    assert sum(o.payload.size for o in objects) > TWO_THREAD_LOAD_BYTES
    if corrupt:
        name = store.name(ranges[9][0])
        data = bytearray(tier.get([name])[0])
        data[100] ^= 0x10
        tier.delete([name])
        tier.put([(name, bytes(data))])
    planned = [PlannedObject(key, a, b, 256 * 8) for key, a, b in ranges]
    pools, views = source(3)
    before = copies(pools)
    expected = new_pools()
    for gid, group in expected.items():
        for plane, pool in zip(group.planes, before[gid]):
            plane.pool[...] = pool
    for obj in objects:
        scatter_object(expected[obj.key.group_id], views[obj.key.group_id], obj)
    result = load_objects(store, planned, [256 * 8], pools, views)
    if corrupt:
        assert (result.boundary_tokens, result.loaded_objects, result.missing) == (0, 0, (ranges[9][0],))
        assert same(copies(pools), before) and store.stats().corrupt == 1
    else:
        assert (result.boundary_tokens, result.loaded_objects) == (256 * 8, len(ranges))
        assert same(copies(pools), copies(expected))
