"""The manager drives tier movement (hybridkv.tierlink): evicted or published entries become
offload plans, a prefix match past the device hit becomes a pending load, and the rows that
arrive are the rows the model reads: every output equals the dense reference.

Real bytes throughout: the reference layers' pools, HostTier and DiskTier objects, and the
engine's part played here (gather, put, fetch, verify, scatter) through the plans' own
``run``. Two instances have their own managers and shuffled page ids.
"""

from dataclasses import replace

import numpy as np
import pytest

from hybridkv.inflight import InFlightRule
from hybridkv.runtime.manager import CacheManager, CacheManagerError
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_tokens
from hybridkv.reference.config import ReferenceConfig, build_model
from hybridkv.reference.dense import dense_forward
from hybridkv.reference.paged import PagedStack
from hybridkv.tiers import DiskTier, HostTier, ObjectKey, ObjectStore, OffloadWorker, group_pools_from_layers
from hybridkv.tierlink import TierLink, TierLinkError
from hybridkv.transfer import OffloadPlan

CONFIG = ReferenceConfig()
LAYOUT = cache_layout(CONFIG.hf_config(), speculative_tokens=3)
ATOL = 1e-9  # two chunks round differently from one at about 1e-15; a wrong row moves far more
GRAIN = 256


class Instance:
    """A manager with a tier link, the reference layers' pools, and the engine's side of the plans."""

    def __init__(self, store, shuffle_seed, *, total_tokens=4096, step_tokens=1024, interval=None, **link_options):
        self.model = build_model(CONFIG, seed=0)
        limits = Limits(max_running_requests=8, max_scheduled_tokens=step_tokens, max_context_tokens=1024,
                        speculative_tokens=3)
        plan = plan_for_tokens(LAYOUT, total_tokens, limits, page_space="per-group")  # the stack holds plan.group_pages
        self.store = store
        self.link = TierLink(store, **link_options)
        options = {} if interval is None else {"state_checkpoint_interval": interval}
        self.manager = CacheManager.from_plan(plan, shuffle_seed=shuffle_seed, enable_prefix_caching=True,
                                              prefix_granularity=GRAIN, tier_link=self.link, **options)
        self.stack = PagedStack(self.model, self.manager.specs, plan.group_pages)
        self.pools = group_pools_from_layers(LAYOUT, self.stack.pools)
        self.stored = []

    def offload(self):
        """Run what the manager handed out for offload (before any page is written)."""
        self.stored += self.link.take_offloads().run(self.store, self.pools)

    def take_loads(self):
        loads = self.link.take_loads()
        self.offload()
        return loads

    def load(self, rid, limit=8):
        """Take, run and confirm loads until ``rid`` is no longer pending; its computed tokens."""
        for _ in range(limit):
            if not self.link.pending(rid):
                break
            for load in self.take_loads():
                self.link.confirm_load(load.request_id, load.plan.run(self.store, self.pools, load.targets))
        return self.manager.num_computed_tokens(rid)

    def step(self, rid, tokens):
        batch = self.manager.schedule([(rid, len(tokens))])
        self.offload()
        return self.stack.forward(batch, np.asarray(tokens)).hidden

    def compute_rest(self, rid, prompt, tail=()):
        """The prompt past what is computed, then ``tail`` decoded; outputs by position."""
        got = self.manager.num_computed_tokens(rid)
        outs = [self.step(rid, prompt[got:])]
        for token in tail:
            self.manager.append_token_ids(rid, [token])
            outs.append(self.step(rid, [token]))
        return np.concatenate(outs)


def dense(model, tokens):
    return dense_forward(model, np.asarray(tokens)).hidden


def prompts(seed, shared=600, length=700):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, CONFIG.vocab_size, length)
    other = np.concatenate([prompt[:shared], rng.integers(0, CONFIG.vocab_size, 50)])
    return prompt, other, rng.integers(0, CONFIG.vocab_size, 4)


@pytest.fixture(params=["host", "disk"])
def store(request, tmp_path):
    tier = HostTier(1 << 30) if request.param == "host" else DiskTier(tmp_path / "objects")
    return ObjectStore(tier, LAYOUT)


def compute_prompt(instance, rid, prompt, decode=(1,)):
    instance.manager.add_request(rid, prompt, max_new_tokens=8)
    instance.step(rid, prompt)
    for token in decode:  # the next step commits the prompt's blocks and checkpoint
        instance.manager.append_token_ids(rid, [token])
        instance.step(rid, [token])


def block(gid, prompt, end, manager):
    """The object key of history block ``[end - 256, end)`` of ``prompt`` in ``manager``'s hashes."""
    probe = manager.prefix.new_request_hashes(None)
    probe.extend_to(np.asarray(prompt, dtype=np.int32), end)
    return ObjectKey("block", gid, probe.key(end))


# --- end to end ---------------------------------------------------------------------
def test_write_through_then_another_instance_hits_from_the_tier(store):
    prompt, other, tail = prompts(0)
    a = Instance(store, 3, write_through=True, interval=GRAIN)
    compute_prompt(a, "p", prompt)
    assert a.stored and all(a.stored)
    kinds = {(o.key.kind, o.key.group_id) for o in a.link.take_offloads().objects}
    assert kinds == set()  # nothing new: every published entry went out with its step
    b = Instance(store, 11)
    hit = b.manager.add_request("q", other, max_new_tokens=8)
    assert hit.hit_tokens == 0 and b.link.pending("q")
    assert b.load("q") == 512
    np.testing.assert_allclose(b.compute_rest("q", other, tail), dense(b.model, np.concatenate([other, tail]))[512:],
                               rtol=0, atol=ATOL)
    stats = b.link.stats()
    assert (stats.planned_loads, stats.confirmed_loads, stats.loaded_tokens) == (1, 1, 512)
    b.manager.check_invariants()


def test_evicted_entries_are_offloaded_and_the_prefix_comes_back_from_the_tier(store):
    prompt, other, tail = prompts(1)
    a = Instance(store, 5, total_tokens=1536)  # write-back: objects leave only when evicted
    compute_prompt(a, "p", prompt)
    a.manager.free("p")
    assert a.link.take_offloads().objects == ()  # published, not evicted: nothing to move yet
    rng = np.random.default_rng(7)
    for i in range(5):  # other prompts need the pages: the prefix's entries are evicted
        a.manager.add_request(f"x{i}", rng.integers(0, CONFIG.vocab_size, 900), max_new_tokens=8)
        a.manager.schedule([(f"x{i}", 900)])  # (not computed: nothing reads these rows)
        a.offload()
        a.manager.free(f"x{i}")
    assert a.link.stats().offload_objects > 0 and all(a.stored)
    hit = a.manager.add_request("q", other, max_new_tokens=8)
    assert hit.hit_tokens < 512 and a.link.pending("q")
    assert a.load("q") == 512
    np.testing.assert_allclose(a.compute_rest("q", other, tail), dense(a.model, np.concatenate([other, tail]))[512:],
                               rtol=0, atol=ATOL)
    a.manager.check_invariants()


def test_a_hit_longer_than_a_step_loads_in_rounds():
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    prompt, other, tail = prompts(2, shared=800, length=900)
    a = Instance(store, 3, write_through=True, interval=GRAIN)  # checkpoints at 256, 512, 768
    compute_prompt(a, "p", prompt)
    b = Instance(store, 13, step_tokens=256)
    b.manager.add_request("q", other, max_new_tokens=8)
    firsts = []
    for _ in range(4):
        loads = b.take_loads()
        if not loads:
            break
        firsts.append((loads[0].from_tokens, loads[0].boundary_tokens))
        b.link.confirm_load("q", loads[0].plan.run(store, b.pools, loads[0].targets))
    assert firsts == [(0, 256), (256, 512), (512, 768)]
    np.testing.assert_allclose(b.compute_rest("q", other, tail), dense(b.model, np.concatenate([other, tail]))[768:],
                               rtol=0, atol=ATOL)


# --- faults -------------------------------------------------------------------------
def test_a_block_lost_after_planning_falls_back_to_the_shorter_boundary(store):
    prompt, other, tail = prompts(3)
    a = Instance(store, 3, write_through=True, interval=GRAIN)  # checkpoints at 256 and 512
    compute_prompt(a, "p", prompt)
    b = Instance(store, 17)
    b.manager.add_request("q", other, max_new_tokens=8)
    (load,) = b.take_loads()
    assert load.boundary_tokens == 512
    lost = block("v4.c4a.compressed_kv", prompt, 512, b.manager)
    assert store.delete([lost]) == 1
    before = b.pools["v4.swa_kv"].planes[0].pool.copy()
    result = load.plan.run(store, b.pools, load.targets)
    assert result.boundary_tokens == 0 and lost in result.missing
    np.testing.assert_array_equal(b.pools["v4.swa_kv"].planes[0].pool, before)  # not one row written
    assert b.link.confirm_load("q", result) == 0 and b.link.pending("q")  # planned again, below 512
    assert b.load("q") == 256
    np.testing.assert_allclose(b.compute_rest("q", other, tail), dense(b.model, np.concatenate([other, tail]))[256:],
                               rtol=0, atol=ATOL)
    assert b.link.stats().failed_loads == 1
    b.manager.check_invariants()


def test_a_corrupted_object_is_a_clean_miss_counted_and_the_prompt_is_computed(store):
    prompt, other, tail = prompts(4)
    a = Instance(store, 3, write_through=True, interval=GRAIN)
    compute_prompt(a, "p", prompt)
    b = Instance(store, 19)
    b.manager.add_request("q", other, max_new_tokens=8)
    (load,) = b.take_loads()
    name = store.name(block("v4.c128a.compressed_kv", prompt, 256, b.manager))
    raw = bytearray(store.tier.get([name])[0])
    raw[len(raw) // 2] ^= 1
    store.tier.delete([name])
    assert store.tier.put([(name, bytes(raw))]) == [True]
    result = load.plan.run(store, b.pools, load.targets)
    assert result.boundary_tokens == 0 and store.stats().corrupt == 1
    assert b.link.confirm_load("q", result) == 0
    assert not b.link.pending("q")  # block [0, 256) is gone (deleted when it failed): no boundary left
    np.testing.assert_allclose(b.compute_rest("q", other, tail), dense(b.model, np.concatenate([other, tail])),
                               rtol=0, atol=ATOL)


def test_a_missing_checkpoint_before_planning_gives_the_shorter_plan(store):
    prompt, other, _ = prompts(5)
    a = Instance(store, 3, write_through=True, interval=GRAIN)
    compute_prompt(a, "p", prompt)
    b = Instance(store, 23)
    probe = b.manager.prefix.new_request_hashes(None)
    probe.extend_to(np.asarray(prompt, dtype=np.int32), 512)
    assert store.delete([ObjectKey("checkpoint", "v4.c4a.compressor_state", probe.key(512))]) == 1
    b.manager.add_request("q", other, max_new_tokens=8)
    (load,) = b.take_loads()
    assert (load.from_tokens, load.boundary_tokens) == (0, 256)
    assert {o.end_token for o in load.plan.objects} == {256}


# --- pending requests -----------------------------------------------------------------
def test_a_pending_request_is_not_scheduled_until_its_load_is_confirmed():
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    prompt, other, _ = prompts(6)
    a = Instance(store, 3, write_through=True)
    compute_prompt(a, "p", prompt)
    b = Instance(store, 29)
    b.manager.add_request("q", other, max_new_tokens=8)
    b.manager.add_request("r", prompt[::-1].copy(), max_new_tokens=8)  # no hit anywhere
    assert not b.link.pending("r")
    (answer,) = b.manager.check_admission([("q", 4)])
    assert not answer.ok and "waits for its tier load" in answer.reason
    for call in (lambda: b.manager.schedule([("q", 4)]), lambda: b.manager.schedule_uniform(["q", "r"], 4)):
        with pytest.raises(CacheManagerError, match="tier load"):
            call()
    (load,) = b.take_loads()
    with pytest.raises(TierLinkError, match="in flight"):
        b.manager.schedule([("r", 4)])  # a step now would commit tokens not loaded yet
    with pytest.raises(TierLinkError, match="confirm_load"):
        b.link.take_loads()
    with pytest.raises(TierLinkError, match="no tier load"):
        b.link.confirm_load("r", 0)
    assert b.link.loads_in_flight
    assert b.link.confirm_load("q", load.plan.run(store, b.pools, load.targets)) == 512
    assert not b.link.loads_in_flight  # schedule no longer asks the link
    assert all(x.ok for x in b.manager.check_admission([("q", 4), ("r", 4)]))
    b.manager.schedule([("q", 4), ("r", 4)])


def test_freeing_a_request_with_a_load_in_flight_publishes_nothing():
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    prompt, other, _ = prompts(7)
    a = Instance(store, 3, write_through=True)
    compute_prompt(a, "p", prompt)
    b = Instance(store, 31)
    b.manager.add_request("q", other, max_new_tokens=8)
    b.take_loads()
    b.manager.free("q")  # nothing was loaded: its pages must not become a device hit
    assert not b.link.loads_in_flight
    b.manager.check_invariants()
    assert b.manager.add_request("q2", other, max_new_tokens=8).hit_tokens == 0
    assert b.link.pending("q2")
    assert b.load("q2") == 512


def test_a_load_without_pages_keeps_the_device_hit():
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    prompt, other, _ = prompts(8)
    a = Instance(store, 3, write_through=True)
    compute_prompt(a, "p", prompt)
    b = Instance(store, 37, total_tokens=1024)
    rng = np.random.default_rng(1)
    for i in range(16):  # requests take every page there is
        b.manager.add_request(f"big{i}", rng.integers(0, CONFIG.vocab_size, 1000), max_new_tokens=8)
        fit = b.manager.max_admissible_tokens(f"big{i}", 1000)
        if not fit:
            break
        b.manager.schedule([(f"big{i}", fit)])
        b.offload()
    b.manager.add_request("q", other, max_new_tokens=8)
    assert b.link.pending("q") and b.link.take_loads() == []
    assert not b.link.pending("q") and b.link.stats().denied_loads == 1
    assert b.manager.num_computed_tokens("q") == 0


def fill_chunks(instance, chunks, chunk=64):
    """Requests of random tokens computed ``chunk`` tokens a step, ``chunks`` steps in all."""
    rng = np.random.default_rng(1)
    i, done = 0, 0
    instance.manager.add_request("f0", rng.integers(0, CONFIG.vocab_size, 1000), max_new_tokens=8)
    for _ in range(chunks):
        if done + chunk > 960:
            i, done = i + 1, 0
            instance.manager.add_request(f"f{i}", rng.integers(0, CONFIG.vocab_size, 1000), max_new_tokens=8)
        instance.manager.schedule([(f"f{i}", chunk)])
        instance.offload()
        done += chunk
    return [f"f{j}" for j in range(i + 1)]


def test_a_load_too_big_alone_is_cut_to_what_fits_and_the_rest_follows():
    """The store serves 768 tokens of q's prompt; with 39 steps of 64 filler tokens held, a load
    of 768 tokens does not fit alone but one of 256 does: q loads [0, 256) now (before, the load
    was dropped and q computed from 0), then the rest once the fillers are gone."""
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    prompt, other, tail = prompts(2, shared=800, length=900)
    a = Instance(store, 3, write_through=True, interval=GRAIN)  # checkpoints at 256, 512, 768
    compute_prompt(a, "p", prompt)
    b = Instance(store, 13, total_tokens=1024)
    fillers = fill_chunks(b, 39)
    b.manager.add_request("q", other, max_new_tokens=8)
    loads = b.take_loads()
    assert [(x.from_tokens, x.boundary_tokens) for x in loads] == [(0, 256)]
    stats = b.link.stats()
    assert (stats.denied_loads, stats.shortened_loads) == (1, 1)
    assert b.link.confirm_load("q", loads[0].plan.run(store, b.pools, loads[0].targets)) == 256
    for rid in fillers:
        b.manager.free(rid)
    loads = b.take_loads()  # the rest of the hit, now that it fits
    assert [(x.from_tokens, x.boundary_tokens) for x in loads] == [(256, 768)]
    assert b.link.confirm_load("q", loads[0].plan.run(store, b.pools, loads[0].targets)) == 768
    assert b.link.stats().denied_loads == 1
    np.testing.assert_allclose(b.compute_rest("q", other, tail), dense(b.model, np.concatenate([other, tail]))[768:],
                               rtol=0, atol=ATOL)


class Clock:
    def __init__(self):
        self.now = 0

    def __call__(self):
        return self.now


def test_a_load_cut_for_pages_asks_for_no_checkpoint_nobody_holds():
    """The cluster run's expired waits, worked small. The store serves q's prompt to 768 with a
    checkpoint at 768 only (A checkpoints at its prompt's end); B's fillers leave pages for a
    256-token load, not a 768-token one. Before: the load was cut to 256, the store had no
    checkpoint there, and q asked the wanted board for one and waited its whole bound for it:
    no device holds a checkpoint where B's free pages ran out. Now the cut finds nothing and
    q keeps its device hit at once; added again once the fillers are gone, it loads all 768."""
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    prompt, other, tail = prompts(2, shared=800, length=900)
    a = Instance(store, 3, write_through=True)
    compute_prompt(a, "p", prompt)
    clock = Clock()
    rule = InFlightRule(wait=5, ttl=20, clock=clock)
    b = Instance(store, 13, total_tokens=1024, write_through=True, in_flight=rule)
    fillers = fill_chunks(b, 39)
    b.manager.add_request("q", other, max_new_tokens=8)
    assert b.link.pending("q") and b.take_loads() == []
    stats = b.link.stats()
    assert (stats.denied_loads, stats.shortened_loads, stats.checkpoint_waits, stats.waits) == (1, 0, 0, 0)
    assert not b.link.pending("q") and not b.link.waiting("q") and b.link.markers.board() == {}
    assert b.manager.num_computed_tokens("q") == 0
    b.manager.free("q")
    for rid in fillers:
        b.manager.free(rid)
    b.manager.add_request("q", other, max_new_tokens=8)
    (load,) = b.take_loads()
    assert (load.from_tokens, load.boundary_tokens) == (0, 768)
    assert b.link.confirm_load("q", load.plan.run(store, b.pools, load.targets)) == 768
    assert b.link.stats().denied_loads == 1
    np.testing.assert_allclose(b.compute_rest("q", other, tail), dense(b.model, np.concatenate([other, tail]))[768:],
                               rtol=0, atol=ATOL)


# --- what is offloaded ----------------------------------------------------------------
def test_write_through_skips_what_the_store_holds_and_dropped_checkpoints_stay_put():
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    prompt, _, _ = prompts(9)
    a = Instance(store, 3, write_through=True)
    compute_prompt(a, "p", prompt)
    first = a.link.stats().offload_objects
    c = Instance(store, 41, write_through=True)
    c.manager.add_request("p", prompt, max_new_tokens=8)
    assert c.load("p") == 512
    c.compute_rest("p", prompt, [1])  # publishes the same blocks and checkpoint: all in the store
    assert first > 0 and c.link.stats().offload_objects == 0 and c.link.stats().offload_skipped == first
    # write-back, decoding across boundaries: each checkpoint past the prompt is held in place of the last (none
    # published, none evicted); the free publishes the last one: nothing to offload
    d = Instance(ObjectStore(HostTier(1 << 30), LAYOUT), 43)
    rng = np.random.default_rng(3)
    d.manager.add_request("s", rng.integers(0, CONFIG.vocab_size, 250), max_new_tokens=300)
    d.step("s", rng.integers(0, CONFIG.vocab_size, 250))
    swa = d.manager.prefix.stats["v4.swa_kv"]
    stored = None  # the prompt's entries, committed by the first decode step
    for token in rng.integers(0, CONFIG.vocab_size, 280):
        d.manager.append_token_ids("s", [token])
        d.step("s", [token])
        stored = swa.stored_entries if stored is None else stored
    assert swa.stored_entries == stored and swa.removed_entries == 0
    d.manager.free("s")
    assert swa.stored_entries == stored + 1
    assert d.link.stats().offload_objects == 0


def test_a_link_checks_what_it_is_attached_to():
    store = ObjectStore(HostTier(1 << 20), LAYOUT)
    limits = Limits(max_running_requests=8, max_scheduled_tokens=1024, max_context_tokens=1024, speculative_tokens=3)
    plan = plan_for_tokens(LAYOUT, 4096, limits)
    with pytest.raises(TierLinkError, match="prefix caching"):
        CacheManager.from_plan(plan, tier_link=TierLink(store))
    link = TierLink(store)
    CacheManager.from_plan(plan, enable_prefix_caching=True, tier_link=link)
    with pytest.raises(TierLinkError, match="another manager"):
        CacheManager.from_plan(plan, enable_prefix_caching=True, tier_link=link)
    history = next(s for s in LAYOUT.specs if not s.is_sliding)
    for spec, message in ((replace(history, group_id="x.other"), "not in the store's layout"),
                          (replace(history, rows_per_page=history.rows_per_page * 2), "geometry")):
        with pytest.raises(TierLinkError, match=message):
            CacheManager([spec], {spec.group_id: 64}, max_context_tokens=1024, enable_prefix_caching=True,
                         tier_link=TierLink(store))
    with pytest.raises(TypeError):
        TierLink(HostTier(1 << 20))


def _plan_after_prompt(store, prompt, **link_options):
    """A write-through instance's one offload plan after computing ``prompt`` (nothing taken before)."""
    link, plan, _ = _instance_plan_after_prompt(store, prompt, **link_options)
    return link, plan


def _instance_plan_after_prompt(store, prompt, **link_options):
    inst = Instance(store, 3, write_through=True, plan_loads=False, **link_options)
    inst.manager.add_request("p", prompt, max_new_tokens=8)
    inst.manager.schedule([("p", len(prompt))])
    inst.manager.append_token_ids("p", [1])
    inst.manager.schedule([("p", 1)])  # commits the prompt's blocks and checkpoints
    return inst.link, inst.link.take_offloads(), inst


def _store_holding_a_first_block():
    """A store that holds a 300-token prompt's objects (written through by another
    instance), and a longer prompt that starts with it."""
    shared = ObjectStore(HostTier(1 << 30), LAYOUT)
    prompt, _, _ = prompts(11)
    first = Instance(shared, 3, write_through=True)
    compute_prompt(first, "a", prompt[:300])  # the store holds the first block's objects
    rng = np.random.default_rng(12)
    return shared, np.concatenate([prompt[:300], rng.integers(0, CONFIG.vocab_size, 500)])


def test_a_plan_leaves_out_what_the_store_holds_and_keeps_the_rest_as_planned():
    shared, longer = _store_holding_a_first_block()
    link, plan = _plan_after_prompt(shared, longer)
    _, whole = _plan_after_prompt(ObjectStore(HostTier(1 << 30), LAYOUT), longer)  # the reference: nothing held
    held = shared.contains([o.key for o in whole.objects])
    assert 0 < held.count(True) < len(held)
    kept = [i for i, h in enumerate(held) if not h]
    assert plan.objects == tuple(whole.objects[i] for i in kept)
    assert [(v.base_page, v.pages.tolist()) for v in plan.sources] == \
        [(whole.sources[i].base_page, whole.sources[i].pages.tolist()) for i in kept]
    stats = link.stats()
    assert (stats.offload_skipped, stats.offload_objects) == (held.count(True), len(kept))
    assert stats.offload_bytes == sum(link.object_payload_bytes(o) for o in plan.objects)
    assert link.take_offloads() == OffloadPlan((), ())  # nothing queued since: an empty plan, no ticket


@pytest.mark.parametrize("through_worker", [True, False])
def test_a_deferred_plan_asks_the_store_when_it_runs_and_counts_as_one_that_asked_at_take(through_worker):
    """Every entry deferred: the store is asked when the plan runs (on the worker), not at take;
    what it held then is neither copied nor put, comes back stored, and the link counts it as
    skipped, as a take that asked would have (the stats equal the asking link's). A pinned plan
    asks at take (a pin on what the store holds would change what the manager evicts)."""
    shared, longer = _store_holding_a_first_block()
    asking, kept = _plan_after_prompt(shared, longer)  # asks at take: the reference (not run)
    pinning, pinned = _plan_after_prompt(shared, longer, pin_offloads=True)
    assert pinned.store_check is None and pinned.objects == kept.objects and all(pinned.pinned)
    assert pinning.stats().offload_skipped == asking.stats().offload_skipped > 0
    link, plan, inst = _instance_plan_after_prompt(shared, longer, defer_offloads=True)
    _, whole = _plan_after_prompt(ObjectStore(HostTier(1 << 30), LAYOUT), longer)  # nothing held
    assert plan.store_check is not None and plan.store_check.held == []  # not asked yet
    assert len(plan.objects) == len(whole.objects) and plan.objects == whole.objects
    assert [(v.base_page, v.pages.tolist()) for v in plan.sources] == \
        [(v.base_page, v.pages.tolist()) for v in whole.sources]
    held = shared.contains([o.key for o in whole.objects])
    assert 0 < held.count(True) < len(held)
    offered = shared.stats().offered
    if through_worker:
        with OffloadWorker(shared) as worker:
            assert plan.submit(worker, inst.pools)
        results = worker.finished()
    else:
        results = [(plan.ticket, plan.run(shared, inst.pools))]
    assert results == [(plan.ticket, [True] * len(held))]
    assert plan.store_check.held == [i for i, h in enumerate(held) if h]
    assert shared.stats().offered - offered == held.count(False)  # only what it lacked was put
    link.confirm_offloads(results)
    got, want = link.stats(), asking.stats()
    for name in ("offload_objects", "offload_bytes", "offload_skipped"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.offload_stored == got.offload_objects == len(kept.objects)
    assert all(shared.contains([o.key for o in whole.objects]))
