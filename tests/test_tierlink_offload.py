"""Offloads off the step (hybridkv.tierlink ``pin_offloads``, hybridkv.tiers.worker): an object
written later holds the rows its entry had when the plan was taken, whatever the steps in between
wrote; a dropped or failed offload is a clean miss; the pages pinned for an offload are not
handed out, counted as used, and given back when the engine confirms.

The codecs' byte pools stand in for device memory. A fake forward writes fresh random bytes into
every row a step computes, so a page reused while its old rows were still to be copied would put
different bytes into the object than the snapshot taken with the plan.
"""

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hybridkv.runtime.manager import CacheManager, CacheManagerError
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_tokens
from hybridkv.reference.config import ReferenceConfig, build_model
from hybridkv.reference.dense import dense_forward
from hybridkv.reference.paged import PagedStack
from hybridkv.tierlink import TierLink, TierLinkError
from hybridkv.tiers import (
    DiskTier,
    GroupPages,
    HostTier,
    MissingRows,
    ObjectKey,
    ObjectStore,
    OffloadWorker,
    gather_object,
    gather_objects,
    group_pools_from_layers,
    new_group_pools,
)
from hybridkv.tiers.rows import populated_buffer

CONFIG = ReferenceConfig()
LAYOUT = cache_layout(CONFIG.hf_config(), speculative_tokens=3)
LIMITS = Limits(max_running_requests=4, max_scheduled_tokens=512, max_context_tokens=1024, speculative_tokens=3)
ATOL = 1e-9


class DeferredWorker:
    """An ``OffloadWorker`` stand-in that keeps each job until the test runs or drops it."""

    def __init__(self):
        self.jobs = []

    def submit(self, ticket, make_objects, num_objects, *, in_place=False, given=False):
        assert given == in_place  # an offload plan hands its new buffers over
        self.jobs.append((ticket, make_objects, num_objects, in_place))
        return True


class Engine:
    """A manager with a pinned write-through link (or write-back), byte pools and a fake forward."""

    def __init__(self, total_tokens=2048, *, write_through=True, seed=0, max_pinned_pages=None,
                 page_space="per-group", defer=False):
        plan = plan_for_tokens(LAYOUT, total_tokens, LIMITS)
        self.store = ObjectStore(HostTier(1 << 30), LAYOUT)
        self.link = TierLink(self.store, write_through=write_through, pin_offloads=not defer, defer_offloads=defer,
                             max_pinned_pages=max_pinned_pages)
        self.manager = CacheManager.from_plan(plan, shuffle_seed=seed, enable_prefix_caching=True,
                                              prefix_granularity=256, tier_link=self.link, page_space=page_space)
        self.pools = new_group_pools(LAYOUT, {gid: pool.num_pages for gid, pool in self.manager.pools.items()})
        self.rng = np.random.default_rng(seed)
        self.worker = DeferredWorker()
        self.expected = {}  # object key -> the rows its entry held when the plan was taken

    def forward(self, items):
        """Fresh random bytes into every row the step computes (rows already written stay)."""
        for rid, n in items:
            end = self.manager.num_computed_tokens(rid)
            for gid, group in self.pools.items():
                stride, rpp = group.spec.entry_stride_tokens, group.spec.rows_per_page
                rows = np.arange((end - n) // stride, end // stride, dtype=np.int64)
                base, pages = self.manager.request_pages(rid, gid)
                logical = rows // rpp - base
                ok = (logical >= 0) & (logical < pages.size)
                page = np.where(ok, pages[np.clip(logical, 0, max(pages.size - 1, 0))] if pages.size else -1, -1)
                slots = np.where(page > 0, page * rpp + rows % rpp, -1)
                for plane in group.planes:
                    data = self.rng.integers(0, 256, (rows.size, plane.codec.row_bytes), dtype=np.uint8)
                    plane.codec.write_slot_bytes(plane.pool, slots, data, rpp)

    def take(self):
        """Take the offloads, snapshot every object's rows now, queue the plan (deferred)."""
        plan = self.link.take_offloads()
        if plan.objects:
            now = gather_objects(self.pools, list(plan.sources),
                                 [(o.key, o.first_token, o.end_token) for o in plan.objects])
            for obj in now:
                self.expected[obj.key] = obj.payload.copy()
        plan.submit(self.worker, self.pools)
        return plan

    def step(self, items):
        self.manager.schedule(items)
        self.take()
        self.forward(items)

    def run_jobs(self, drop=False):
        """Run (or drop) every queued job and confirm it; the objects now in the store."""
        results = []
        for ticket, make_objects, num_objects, in_place in self.worker.jobs:
            results.append((ticket, [None] * num_objects if drop else self.put(make_objects(), in_place)))
        self.worker.jobs.clear()
        self.link.confirm_offloads(results)

    def put(self, objects, in_place):
        """As the worker puts a job's objects: ``None`` (the store held it when the job ran) is
        not put and comes back stored."""
        put = iter(self.store.put([obj for obj in objects if obj is not None], in_place=in_place))
        return [True if obj is None else next(put) for obj in objects]

    def check_store(self):
        """Every stored object holds exactly the rows snapshot when its plan was taken."""
        keys = list(self.expected)
        for key, obj in zip(keys, self.store.get(keys)):
            if obj is not None:
                np.testing.assert_array_equal(obj.payload, self.expected[key])

    def pinned(self):
        return sum(self.manager.held_outside_pages(s.group_id) for s in self.manager.specs)


def prompt(rng, shared, length):
    return np.concatenate([shared, rng.integers(0, CONFIG.vocab_size, length - shared.size)])


def compute(engine, rid, tokens, decode=1):
    engine.manager.add_request(rid, tokens, max_new_tokens=decode + 4)
    done = engine.manager.num_computed_tokens(rid)
    while done < tokens.size:
        n = min(tokens.size - done, LIMITS.max_scheduled_tokens)
        engine.step([(rid, n)])
        done += n
    for token in range(decode):
        engine.manager.append_token_ids(rid, [token])
        engine.step([(rid, 1)])


# --- pinned pages -----------------------------------------------------------------------------
def test_pinned_rows_survive_steps_that_reuse_every_free_page():
    engine = Engine(total_tokens=2048)
    rng = np.random.default_rng(1)
    compute(engine, "p", rng.integers(0, CONFIG.vocab_size, 600))
    assert engine.link.stats().offload_pinned > 0 and engine.pinned() > 0
    engine.manager.free("p")
    held = engine.pinned()
    for i in range(6):  # other prompts fill the cache; the pinned pages are never handed out
        rid = f"x{i}"
        engine.manager.add_request(rid, rng.integers(0, CONFIG.vocab_size, 700), max_new_tokens=4)
        fit = engine.manager.max_admissible_tokens(rid, 700)
        if fit:
            engine.manager.schedule([(rid, fit)])
            engine.forward([(rid, fit)])
        engine.manager.check_invariants()
        engine.manager.free(rid)
    assert engine.pinned() >= held  # nothing confirmed yet: still held
    engine.run_jobs()
    engine.check_store()
    stats = engine.link.stats()
    assert stats.offload_stored == stats.offload_objects and stats.pinned_pages == 0 == engine.pinned()
    engine.manager.check_invariants()


def test_pinned_pages_count_as_used_until_confirmed():
    engine = Engine(total_tokens=2048)
    rng = np.random.default_rng(2)
    compute(engine, "p", rng.integers(0, CONFIG.vocab_size, 600))
    engine.manager.free("p")
    stats = engine.manager.stats()
    pinned = {gid: engine.manager.held_outside_pages(gid) for gid in stats}
    assert sum(pinned.values()) > 0
    for gid, st_ in stats.items():  # the freed prompt's pinned pages are neither free nor evictable
        assert st_.used_pages >= pinned[gid]
    before = {gid: s.free_pages for gid, s in stats.items()}
    engine.run_jobs()
    after = engine.manager.stats()
    for gid in stats:
        assert after[gid].free_pages == before[gid] + pinned[gid]  # cached again: evictable
    engine.manager.check_invariants()


def test_a_full_pin_budget_leaves_the_entry_for_its_eviction():
    engine = Engine(total_tokens=2048, max_pinned_pages=0)
    rng = np.random.default_rng(3)
    compute(engine, "p", rng.integers(0, CONFIG.vocab_size, 600))
    stats = engine.link.stats()
    assert stats.offload_objects > 0 and stats.offload_pinned == 0 and engine.pinned() == 0
    engine.run_jobs()  # the unpinned rows were staged when the plan was taken
    engine.check_store()
    assert engine.link.stats().offload_stored == stats.offload_objects


def test_deferred_rows_evicted_before_the_worker_copies_them_are_rescued_at_the_next_plan():
    engine = Engine(total_tokens=1536, defer=True)
    rng = np.random.default_rng(5)
    compute(engine, "p", rng.integers(0, CONFIG.vocab_size, 600))
    stats = engine.link.stats()
    assert stats.offload_deferred == stats.offload_objects > 0 and stats.offload_pinned == 0
    engine.manager.free("p")
    assert engine.pinned() == 0  # nothing held: p's entries are evictable at once
    for i in range(5):  # other prompts evict p's entries and write their pages; no job has run
        rid = f"x{i}"
        engine.manager.add_request(rid, rng.integers(0, CONFIG.vocab_size, 900), max_new_tokens=4)
        fit = engine.manager.max_admissible_tokens(rid, 900)
        engine.step([(rid, fit)])
        engine.manager.free(rid)
    assert engine.link.stats().offload_rescues > 0
    engine.run_jobs()
    engine.check_store()  # every object, rescued or not, holds its rows of take time
    stats = engine.link.stats()
    assert stats.offload_stored == stats.offload_objects and stats.pinned_pages == 0
    engine.manager.check_invariants()


def test_a_rescue_after_the_worker_settled_gathers_nothing_and_before_it_replaces_its_copy():
    engine = Engine(total_tokens=2048, defer=True)
    rng = np.random.default_rng(6)
    engine.manager.add_request("p", rng.integers(0, CONFIG.vocab_size, 600), max_new_tokens=4)
    engine.step([("p", 512)])
    engine.run_jobs()
    engine.manager.schedule([("p", 88)])  # publishes the first 512 tokens' entries
    plan = engine.link.take_offloads()
    assert len(plan.objects) >= 2 and plan.copies is not None and all(plan.deferred)
    truth = gather_objects(engine.pools, list(plan.sources), [(o.key, o.first_token, o.end_token) for o in plan.objects])
    worker_copy = {0: gather_objects(engine.pools, [plan.sources[0]], [(plan.objects[0].key, 0, 0)])[0]}
    assert plan.copies.rescue(1, engine.pools) is True  # before the worker: gathered now, on this thread
    for group in engine.pools.values():  # every page changes after the rescue
        for plane in group.planes:
            plane.pool.fill(0)
    settled = {0: truth[0], 1: worker_copy[0]}
    plan.copies.settle(settled)
    np.testing.assert_array_equal(settled[1].payload, truth[1].payload)  # the rescued copy, not the worker's
    assert settled[0] is truth[0]
    assert plan.copies.rescue(0, engine.pools) is False  # settled by the worker: nothing to do


def test_a_plan_s_rescues_are_gathered_together_and_each_once():
    engine = Engine(total_tokens=2048, defer=True)
    rng = np.random.default_rng(7)
    engine.manager.add_request("p", rng.integers(0, CONFIG.vocab_size, 600), max_new_tokens=4)
    engine.step([("p", 512)])
    engine.run_jobs()
    engine.manager.schedule([("p", 88)])  # publishes the first 512 tokens' entries
    plan = engine.link.take_offloads()
    n = len(plan.objects)
    assert n >= 2 and plan.copies is not None and all(plan.deferred)
    truth = gather_objects(engine.pools, list(plan.sources), [(o.key, o.first_token, o.end_token) for o in plan.objects])
    assert plan.copies.rescue_many([n - 1, 0, n - 1] + list(range(n)), engine.pools) == n  # each once
    for group in engine.pools.values():  # every page changes after the rescue
        for plane in group.planes:
            plane.pool.fill(0)
    settled = {i: None for i in range(n)}
    plan.copies.settle(settled)
    for i in range(n):
        assert (settled[i].key, settled[i].first_row, settled[i].num_rows) == (truth[i].key, truth[i].first_row,
                                                                               truth[i].num_rows)
        np.testing.assert_array_equal(settled[i].payload, truth[i].payload)
    assert plan.copies.rescue_many(range(n), engine.pools) == 0  # rescued already: nothing to gather


def test_pinning_and_deferring_exclude_each_other():
    with pytest.raises(ValueError, match="exclude each other"):
        TierLink(ObjectStore(HostTier(1 << 20), LAYOUT), pin_offloads=True, defer_offloads=True)


def test_write_back_evicted_rows_are_staged_at_take_time():
    engine = Engine(total_tokens=1536, write_through=False)
    rng = np.random.default_rng(4)
    compute(engine, "p", rng.integers(0, CONFIG.vocab_size, 600))
    engine.manager.free("p")
    for i in range(5):
        rid = f"x{i}"
        engine.manager.add_request(rid, rng.integers(0, CONFIG.vocab_size, 900), max_new_tokens=4)
        fit = engine.manager.max_admissible_tokens(rid, 900)
        engine.step([(rid, fit)])  # evicts p's entries and writes their pages in the same step
        engine.manager.free(rid)
    stats = engine.link.stats()
    assert stats.offload_objects > 0 and stats.offload_pinned == 0  # evicted: nothing left to pin
    engine.run_jobs()
    engine.check_store()


# --- one page view per object: the batched gather against the one-object reference ----------
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), count=st.integers(1, 6))
def test_gather_with_a_view_per_object_equals_gathering_each_alone(seed, count):
    rng = np.random.default_rng(seed)
    pools = new_group_pools(LAYOUT, {g.group_id: 12 for g in LAYOUT.groups})
    for group in pools.values():
        for plane in group.planes:
            plane.pool[...] = rng.integers(0, 256, plane.pool.shape, dtype=np.uint8)
    ranges, views = [], []
    for i in range(count):
        group = LAYOUT.groups[int(rng.integers(len(LAYOUT.groups)))]
        page_tokens = group.spec.page_tokens
        base = int(rng.integers(0, 3))
        first = base * page_tokens + int(rng.integers(0, page_tokens))
        end = first + int(rng.integers(1, 3 * page_tokens))
        pages = rng.permutation(np.arange(1, 12))[: -(-end // page_tokens) - base]
        ranges.append((ObjectKey("block", group.group_id, i), first, end))
        views.append(GroupPages(base, pages))
    got = gather_objects(pools, views, ranges)
    held = gather_objects(pools, views, ranges, hold_gil=True)  # (as an engine's step thread)
    for (key, first, end), view, obj, other in zip(ranges, views, got, held):
        alone = gather_object(pools[key.group_id], view, key, first, end)
        assert (obj.first_row, obj.num_rows) == (alone.first_row, alone.num_rows)
        np.testing.assert_array_equal(obj.payload, alone.payload)
        np.testing.assert_array_equal(other.payload, alone.payload)
    gid = LAYOUT.groups[0].group_id
    with pytest.raises(MissingRows):
        gather_objects(pools, [GroupPages(0, np.array([-1]))], [(ObjectKey("block", gid, 0), 0, 4)])


@pytest.mark.parametrize("hold_gil", [False, True])
@pytest.mark.parametrize("nbytes", [0, 100, (1 << 16) - 1, 1 << 16, 3 << 20, (5 << 20) + 7])
def test_a_populated_buffer_is_a_new_array_the_host_tier_keeps_whole(nbytes, hold_gil):
    buffer = populated_buffer(nbytes, hold_gil=hold_gil)
    assert (buffer.dtype, buffer.shape, buffer.base) == (np.uint8, (nbytes,), None)
    assert buffer.flags.c_contiguous and buffer.flags.writeable
    buffer[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)  # every byte writable
    assert not np.shares_memory(buffer, populated_buffer(nbytes))
    if nbytes >= 100:  # given views of it: kept without a copy, the buffer counted whole
        tier = HostTier(1 << 30)
        half = nbytes // 2
        assert tier.put([("a", memoryview(buffer)[:half]), ("b", memoryview(buffer)[half:])], given=True) == [True] * 2
        assert tier.stats().held_bytes == nbytes
        buffer[0] ^= 0xFF  # the tier holds views of the buffer itself
        assert bytes(tier.get(["a"])[0][:1]) == bytes(buffer[:1])


# --- dropped and failed offloads ---------------------------------------------------------------
def test_a_dropped_offload_releases_its_pins_and_is_a_clean_miss():
    engine = Engine(total_tokens=2048)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, CONFIG.vocab_size, 600)
    compute(engine, "p", tokens)
    taken = engine.link.stats().offload_objects
    engine.run_jobs(drop=True)
    stats = engine.link.stats()
    assert stats.offload_dropped == taken and stats.offload_stored == 0 and engine.pinned() == 0
    assert not any(engine.store.contains(list(engine.expected)))
    engine.manager.check_invariants()
    link = TierLink(engine.store)
    manager = CacheManager.from_plan(plan_for_tokens(LAYOUT, 2048, LIMITS), enable_prefix_caching=True,
                                     prefix_granularity=256, tier_link=link)
    assert manager.add_request("q", tokens, max_new_tokens=4).hit_tokens == 0 and not link.pending("q")


@pytest.mark.parametrize("bad", [(5,), (None, None), "ab", (["t"], [True])])
def test_a_malformed_result_refuses_the_whole_confirmation_and_leaks_no_pin(bad):
    """A good plan's result then a malformed one: before, the good plan's pins were dropped from the link
    and its pages never released (held outside any request for good)."""
    engine = Engine(total_tokens=2048)
    compute(engine, "p", np.random.default_rng(5).integers(0, CONFIG.vocab_size, 600))
    engine.manager.free("p")
    (ticket, make_objects, num_objects, in_place), = engine.worker.jobs
    pinned = engine.pinned()
    assert pinned > 0
    results = [(ticket, engine.put(make_objects(), in_place))]
    with pytest.raises(TierLinkError, match="pairs"):
        engine.link.confirm_offloads(results + [bad])
    assert engine.pinned() == pinned
    engine.link.confirm_offloads(results)
    assert engine.pinned() == 0 and engine.link.stats().offload_stored == num_objects
    engine.manager.check_invariants()


def test_the_worker_drops_what_does_not_fit_its_queue_and_counts_failures():
    store = ObjectStore(HostTier(1 << 20), LAYOUT)
    gate = threading.Event()
    with OffloadWorker(store, max_queued_objects=3) as worker:
        assert worker.submit("slow", lambda: gate.wait(10) and [], 2)
        assert not worker.submit("full", lambda: [], 2)  # 2 + 2 > 3: dropped at once
        assert worker.finished() == [("full", [None, None])]

        def boom():
            raise OSError("device copy failed")

        assert worker.submit("bad", boom, 1)
        gate.set()
        assert worker.drain(10)
        done = dict(worker.finished())
        assert done == {"slow": [], "bad": [None]}
        stats = worker.stats()
        assert (stats.dropped_jobs, stats.dropped_objects, stats.failed_jobs) == (1, 2, 1)
        assert "device copy failed" in stats.last_error and stats.queued_objects == 0
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit("late", lambda: [], 1)
    with pytest.raises(ValueError):
        OffloadWorker(store, max_queued_objects=0)
    with pytest.raises(TypeError):
        OffloadWorker(HostTier(1 << 20))


def _store_and_one_job(seed: int):
    """An empty store, and the one offload job (ticket, make_objects, objects, in_place) an
    engine's 600-token prompt of seed ``seed`` queued on its worker."""
    engine = Engine(total_tokens=2048)
    compute(engine, "p", np.random.default_rng(seed).integers(0, CONFIG.vocab_size, 600))
    (job,) = engine.worker.jobs
    return ObjectStore(HostTier(1 << 30), LAYOUT), job


def test_the_worker_puts_only_what_a_job_made_and_reports_the_rest_stored():
    store, (ticket, make_objects, n, in_place) = _store_and_one_job(8)
    made = make_objects()
    assert n >= 3 and all(obj is not None for obj in made)  # the engine's store holds none of them
    held = [made[i] if i % 2 else None for i in range(n)]  # None: the store held it when the job ran
    calls = []
    put = store.put
    store.put = lambda objects, **kw: calls.append([obj.key for obj in objects]) or put(objects, **kw)
    with OffloadWorker(store, put_batch_objects=2) as worker:
        assert worker.submit(ticket, lambda: held, n, in_place=in_place)
        assert worker.submit("all held", lambda: [None, None], 2)
        assert worker.drain(30)
        assert worker.finished() == [(ticket, [True] * n), ("all held", [True, True])]
    assert [key for keys in calls for key in keys] == [obj.key for obj in held if obj is not None]
    assert store.contains([obj.key for obj in made]) == [obj is not None for obj in held]


def test_a_paused_worker_starts_nothing_until_resumed_and_puts_in_batches():
    store, (ticket, make_objects, n, in_place) = _store_and_one_job(8)
    assert in_place  # an offload plan's payloads have room for their headers
    assert n >= 3
    calls = []
    put = store.put
    store.put = lambda objects, **kw: calls.append(len(objects)) or put(objects, **kw)
    with OffloadWorker(store, put_batch_objects=2) as worker:
        worker.pause()
        assert worker.submit(ticket, make_objects, n, in_place=in_place)
        assert worker.finished() == [] and calls == []  # held before the job starts
        threading.Event().wait(0.2)
        assert worker.finished() == [] and calls == []
        worker.resume()
        assert worker.drain(30)
        (done,) = worker.finished()
    assert done[0] == ticket and done[1] == [True] * n
    assert calls == [2] * (n // 2) + [n % 2] * (n % 2)
    with pytest.raises(ValueError, match="put_batch_objects"):
        OffloadWorker(store, put_batch_objects=0)
    with pytest.raises(ValueError, match="put_batch_bytes"):
        OffloadWorker(store, put_batch_bytes=0)
    sizes = [obj.payload.size for obj in make_objects()]
    calls.clear()
    with OffloadWorker(store, put_batch_objects=n, put_batch_bytes=max(sizes)) as worker:  # bytes cut the batches
        assert worker.submit(ticket, make_objects, n, in_place=in_place)
        assert worker.drain(30)
    expected, batch, nbytes = [], 0, 0
    for size in sizes:
        if batch and nbytes + size > max(sizes):
            expected.append(batch)
            batch, nbytes = 0, 0
        batch, nbytes = batch + 1, nbytes + size
    assert calls == expected + [batch] and sum(calls) == n


def test_the_worker_gathers_a_new_job_before_the_next_put_of_an_earlier_one():
    store, (ticket, make_objects, n, in_place) = _store_and_one_job(9)
    objects = make_objects()
    events, first_put, second_job = [], threading.Event(), threading.Event()
    put = store.put

    def slow_put(batch, **kw):
        events.append(("put", batch[0].key))
        if len(events) == 1:  # the first put waits until the second job is submitted
            first_put.set()
            second_job.wait(10)
        return put(batch, **kw)

    store.put = slow_put
    with OffloadWorker(store, put_batch_objects=1) as worker:
        assert worker.submit("a", lambda: objects[:2], 2, in_place=in_place)
        assert first_put.wait(10)
        assert worker.submit("b", lambda: events.append(("make", "b")) or objects[2:3], 1, in_place=in_place)
        second_job.set()
        assert worker.drain(30)
        done = worker.finished()
    assert events == [("put", objects[0].key), ("make", "b"), ("put", objects[1].key), ("put", objects[2].key)]
    assert done == [("a", [True, True]), ("b", [True])]


def test_close_runs_what_is_queued_and_the_engine_confirms_it():
    engine = Engine(total_tokens=2048)
    rng = np.random.default_rng(6)
    compute(engine, "p", rng.integers(0, CONFIG.vocab_size, 600))
    jobs, engine.worker.jobs = engine.worker.jobs, []
    worker = OffloadWorker(engine.store)
    for ticket, make_objects, n, in_place in jobs:
        assert worker.submit(ticket, make_objects, n, in_place=in_place)
    assert worker.close(30)
    engine.link.confirm_offloads(worker.finished())
    stats = engine.link.stats()
    assert stats.offload_stored == stats.offload_objects > 0 and engine.pinned() == 0
    engine.check_store()
    engine.manager.check_invariants()


def test_an_entry_stored_through_is_not_offloaded_again_when_evicted():
    engine = Engine(total_tokens=1536)
    rng = np.random.default_rng(10)
    compute(engine, "p", rng.integers(0, CONFIG.vocab_size, 600))
    engine.run_jobs()
    first = set(engine.expected)
    engine.manager.free("p")
    def removed():
        return sum(s.removed_entries for s in engine.manager.prefix.stats.values())

    removed_before = removed()
    for i in range(4):
        compute(engine, f"x{i}", rng.integers(0, CONFIG.vocab_size, 900))
        engine.run_jobs()  # the pins go: the next request's pages come out of p's entries
        engine.manager.free(f"x{i}")
    assert removed() > removed_before  # entries went (p's first: least recently used)
    assert engine.link.stats().offload_skipped == 0  # not even asked about: known stored
    offloaded_again = [o.key for o in engine.link.take_offloads().objects]
    assert not first & set(offloaded_again)


def test_an_offload_only_link_plans_no_load():
    engine = Engine(total_tokens=2048)
    tokens = np.random.default_rng(9).integers(0, CONFIG.vocab_size, 600)
    compute(engine, "p", tokens)
    engine.run_jobs()
    plan = plan_for_tokens(LAYOUT, 2048, LIMITS)
    for plan_loads, pending in ((False, False), (True, True)):
        link = TierLink(engine.store, plan_loads=plan_loads)
        manager = CacheManager.from_plan(plan, enable_prefix_caching=True, prefix_granularity=256, tier_link=link)
        manager.add_request("q", tokens, max_new_tokens=4)
        assert link.pending("q") is pending and link.stats().planned_loads == int(pending)


def test_hold_pages_refuses_bad_ids_and_release_refuses_what_was_not_held():
    engine = Engine()
    counts = np.zeros(len(engine.manager.specs), dtype=np.int64)
    counts[0] = 1  # one page of the first group
    with pytest.raises(CacheManagerError, match="page ids"):
        engine.manager.hold_pages(np.array([0]), counts)
    with pytest.raises(CacheManagerError, match="is free"):
        engine.manager.hold_pages(np.array([1]), counts)
    with pytest.raises(CacheManagerError, match="did not hold"):
        engine.manager.release_held_pages(np.array([1]), counts)
    with pytest.raises(CacheManagerError, match="counts"):
        engine.manager.hold_pages(np.array([1]), counts[:1])
    with pytest.raises(ValueError, match="max_pinned_pages"):
        TierLink(engine.store, max_pinned_pages=-1)


# --- a random program --------------------------------------------------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["add"] * 3 + ["step"] * 6 + ["free"] * 2 + ["run", "drop"]),
                         st.integers(0, 3), st.integers(1, 700)), min_size=10, max_size=40)


SEQUENTIAL = [op for slot in range(4) for op in
              (("add", slot, 700), ("step", slot, 512), ("step", slot, 700), ("step", slot, 5), ("free", slot, 1))]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(ops=SEQUENTIAL, seed=1, write_through=True, shared=False, defer=False)
@example(ops=SEQUENTIAL, seed=2, write_through=False, shared=False, defer=False)
@example(ops=SEQUENTIAL, seed=3, write_through=True, shared=True, defer=False)
@example(ops=SEQUENTIAL, seed=4, write_through=True, shared=False, defer=True)
# A checkpoint published again (recomputed: other random bytes) while its first copy is queued:
# copied once, so the store holds the first snapshot (it used to be offered again and the
# second snapshot expected, while a store keeps the first value put under a name).
@example(ops=[("add", 0, 2), ("add", 1, 1), ("add", 3, 1), ("step", 0, 256), ("step", 1, 1), ("free", 0, 1),
              ("add", 0, 365), ("step", 3, 277), ("step", 0, 365), ("step", 0, 1)],
         seed=0, write_through=True, shared=True, defer=False)
@given(ops=OPS, seed=st.integers(0, 1000), write_through=st.booleans(), shared=st.booleans(), defer=st.booleans())
def test_stored_rows_are_the_rows_at_take_time_whatever_runs_between(ops, seed, write_through, shared, defer):
    engine = Engine(total_tokens=1024, write_through=write_through, seed=seed, defer=defer,
                    page_space="shared" if shared else "per-group")  # shared: one arena lent in slabs
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, CONFIG.vocab_size, 300)
    live = {}
    for op, slot, n in ops:
        rid = f"r{slot}"
        mgr = engine.manager
        if op == "add" and rid not in live:
            tokens = prompt(rng, shared if n % 2 else shared[:0], max(n, 301))  # odd: shares a prefix
            mgr.add_request(rid, tokens, max_new_tokens=8)
            live[rid] = tokens.size
        elif op == "step" and rid in live:
            left = live[rid] - mgr.num_computed_tokens(rid)
            want = min(max(left, 1), n) if left > 0 else 1
            if left <= 0:
                if mgr.num_computed_tokens(rid) >= live[rid] + 7:
                    continue
                mgr.append_token_ids(rid, [n])
            fit = mgr.max_admissible_tokens(rid, want)
            if fit:
                engine.step([(rid, fit)])
        elif op == "free" and rid in live:
            mgr.free(rid)
            del live[rid]
        elif op in ("run", "drop"):
            engine.run_jobs(drop=op == "drop")
        mgr.check_invariants()
        assert engine.pinned() == engine.link.stats().pinned_pages
    engine.run_jobs()
    engine.check_store()
    assert engine.pinned() == 0
    engine.manager.check_invariants()


# --- with the reference layers ----------------------------------------------------------------
@pytest.mark.parametrize("defer,kind", [(False, "host"), (True, "host"), (False, "disk"), (True, "disk")])
def test_offloads_through_the_worker_serve_another_instance_with_correct_outputs(defer, kind, tmp_path):
    # disk: a tier that copies what it is given (the host tier keeps the worker's buffers)
    limits = Limits(max_running_requests=8, max_scheduled_tokens=1024, max_context_tokens=1024, speculative_tokens=3)
    model = build_model(CONFIG, seed=0)
    store = ObjectStore(HostTier(1 << 30) if kind == "host" else DiskTier(tmp_path / "disk"), LAYOUT)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, CONFIG.vocab_size, 700)

    def instance(link, seed, total_tokens=4096):
        plan = plan_for_tokens(LAYOUT, total_tokens, limits, page_space="per-group")  # the stack holds plan.group_pages
        mgr = CacheManager.from_plan(plan, shuffle_seed=seed, enable_prefix_caching=True, prefix_granularity=256,
                                     state_checkpoint_interval=256, tier_link=link)
        stack = PagedStack(model, mgr.specs, plan.group_pages)
        return mgr, stack, group_pools_from_layers(LAYOUT, stack.pools)

    link_a = TierLink(store, write_through=True, pin_offloads=not defer, defer_offloads=defer)
    mgr_a, stack_a, pools_a = instance(link_a, 3, total_tokens=1536)
    with OffloadWorker(store) as worker:
        mgr_a.add_request("p", tokens, max_new_tokens=8)
        for items, ids in (([("p", 700)], tokens), ([("p", 1)], [5])):
            if len(ids) == 1:
                mgr_a.append_token_ids("p", ids)
            batch = mgr_a.schedule(items)
            link_a.confirm_offloads(worker.finished())
            link_a.take_offloads().submit(worker, pools_a)  # before the forward writes a page
            stack_a.forward(batch, np.asarray(ids))
        mgr_a.free("p")
        for i in range(4):  # the freed prompt's pages would be reused here, were they not pinned (or rescued)
            rid = f"x{i}"
            mgr_a.add_request(rid, rng.integers(0, CONFIG.vocab_size, 700), max_new_tokens=8)
            fit = mgr_a.max_admissible_tokens(rid, 700)
            if fit:
                batch = mgr_a.schedule([(rid, fit)])
                link_a.confirm_offloads(worker.finished())
                link_a.take_offloads().submit(worker, pools_a)
                stack_a.forward(batch, rng.integers(0, CONFIG.vocab_size, fit))
            mgr_a.free(rid)
        assert worker.drain(60)
        link_a.confirm_offloads(worker.finished())
    assert link_a.stats().offload_stored > 0 and link_a.stats().pinned_pages == 0
    mgr_a.check_invariants()

    link_b = TierLink(store)
    mgr_b, stack_b, pools_b = instance(link_b, 11)
    assert mgr_b.add_request("q", tokens, max_new_tokens=8).hit_tokens == 0 and link_b.pending("q")
    (load,) = link_b.take_loads()
    assert link_b.confirm_load("q", load.plan.run(store, pools_b, load.targets)) == 512
    batch = mgr_b.schedule([("q", 700 - 512)])
    hidden = stack_b.forward(batch, tokens[512:]).hidden
    np.testing.assert_allclose(hidden, dense_forward(model, tokens).hidden[512:], rtol=0, atol=ATOL)


# --- the engine's one call a step ---------------------------------------------------------------
def _offload_program(combined, mode, seed):
    """A seeded program of adds, steps and frees on an Engine with a real OffloadWorker, offloading
    once a step before the forward either with ``TierLink.offload_step`` (``combined``) or with
    the three calls; the worker drained after each, so both see the same jobs finished. The link's,
    worker's and tier's stats and the pinned pages after every op."""
    engine = Engine(1024, write_through=mode != "back", defer=mode == "defer", seed=seed)
    rng, live, seen = np.random.default_rng(seed + 1), {}, []
    shared = rng.integers(0, CONFIG.vocab_size, 300)
    with OffloadWorker(engine.store, max_queued_objects=6) as worker:  # small: some plans are dropped
        def offload():
            if combined:
                engine.link.offload_step(worker, engine.pools)
            else:
                engine.link.confirm_offloads(worker.finished())
                engine.link.take_offloads().submit(worker, engine.pools)
            worker.drain()

        for _ in range(300):
            op, rid, n = rng.choice(["add", "step", "step", "free"]), f"r{rng.integers(4)}", int(rng.integers(1, 400))
            mgr = engine.manager
            if op == "add" and rid not in live:
                tokens = prompt(rng, shared if n % 2 else shared[:0], max(n, 301))
                mgr.add_request(rid, tokens, max_new_tokens=8)
                live[rid] = tokens.size
            elif op == "step" and rid in live:
                left = live[rid] - mgr.num_computed_tokens(rid)
                if left <= 0:
                    mgr.append_token_ids(rid, [n])
                fit = mgr.max_admissible_tokens(rid, max(min(left, n), 1))
                if fit:
                    mgr.schedule([(rid, fit)])
                    offload()
                    engine.forward([(rid, fit)])
            elif op == "free" and rid in live:
                mgr.free(rid)
                del live[rid]
            seen.append((engine.link.stats(), worker.stats(), engine.store.tier.stats(), engine.pinned()))
        offload()  # confirms the last jobs
        seen.append((engine.link.stats(), worker.stats(), engine.store.tier.stats(), engine.pinned()))
    return seen


@pytest.mark.parametrize("mode", ["through", "defer", "back"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_offload_step_does_what_confirm_take_and_submit_do(mode, seed):
    one, three = _offload_program(True, mode, seed), _offload_program(False, mode, seed)
    assert one == three  # link, worker and tier stats (objects and bytes stored) and pins after every op
    final = one[-1][0]
    assert final.offload_objects > 0 and final.pinned_pages == 0 and final.offload_stored > 0
