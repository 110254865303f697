"""A tier load is admitted for its own pages (``CacheManager.schedule(..., load=True)``).

The load's rows are copied in, not computed, so a sliding group needs only the pages of
the checkpoint at the load's end ``D`` (tokens ``[D - C, D)``, ``C`` its checkpoint window),
exactly what a device hit at ``D`` holds; history groups hold the whole span. Real bytes:
the reference layers' pools, a HostTier, dense == paged for the tokens after the load.

Hand-worked numbers for the reference layout (grain 256; ``T`` page tokens, ``C`` checkpoint
window), a load of ``[0, 768)``:

====================================  ====  ====  ==========================  ============
group                                  T     C     pages held (base, count)    whole span
====================================  ====  ====  ==========================  ============
v4.swa_kv                              64    16    (768 - 16) // 64 = 11, 1    12
v4.c4a.compressor_state                4     4     (768 - 4) // 4 = 191, 1     192
v4.c4a.compressed_kv (history)         256   -     0, 768 / 256 = 3            3
v4.c128a.compressor_state              8     0     768 / 8 = 96, 0             96
v4.c128a.compressed_kv (history)       256   -     0, 3                        3
v4.c4a.indexer_compressor_state        4     4     191, 1                      192
====================================  ====  ====  ==========================  ============

9 pages in all, where the load admitted as a computed step of 768 tokens took 498.
"""

import numpy as np
import pytest

from hybridkv.runtime.manager import CacheManager, CacheManagerError
from hybridkv.plan import Limits, plan_for_tokens
from hybridkv.reference.config import build_model
from hybridkv.reference.paged import PagedStack
from hybridkv.tiers import HostTier, ObjectStore, group_pools_from_layers
from hybridkv.tierlink import TierLink, TierLinkError

from test_tierlink import ATOL, CONFIG, GRAIN, LAYOUT, Instance, compute_prompt, dense, prompts

HELD_AFTER_768 = {  # (base page, pages) per group, worked in the module docstring
    "v4.swa_kv": (11, 1),
    "v4.c4a.compressor_state": (191, 1),
    "v4.c4a.compressed_kv": (0, 3),
    "v4.c128a.compressor_state": (96, 0),
    "v4.c128a.compressed_kv": (0, 3),
    "v4.c4a.indexer_compressor_state": (191, 1),
}


class SmallStateInstance(Instance):
    """An ``Instance`` whose sliding groups have the pages of about 200 tokens (plus two):
    a computed step of 256 tokens does not fit there, a load of any length does."""

    def __init__(self, store, shuffle_seed):
        self.model = build_model(CONFIG, seed=0)
        limits = Limits(max_running_requests=8, max_scheduled_tokens=1024, max_context_tokens=1024,
                        speculative_tokens=3)
        plan = plan_for_tokens(LAYOUT, 4096, limits)
        pages = {s.group_id: (-(-200 // s.page_tokens) + 2 if s.is_sliding else plan.group_pages[s.group_id])
                 for s in plan.specs}
        self.store, self.link, self.stored = store, TierLink(store), []
        self.manager = CacheManager(plan.specs, pages, max_context_tokens=1024, max_step_tokens=1024,
                                    shuffle_seed=shuffle_seed, enable_prefix_caching=True, prefix_granularity=GRAIN,
                                    tier_link=self.link)
        self.stack = PagedStack(self.model, self.manager.specs, pages)
        self.pools = group_pools_from_layers(LAYOUT, self.stack.pools)


def held(manager, rid):
    out = {}
    for s in manager.specs:
        base, pages = manager.request_pages(rid, s.group_id)
        out[s.group_id] = (base, pages.size)
    return out


def writer(store):
    """Instance A: computes a 900-token prompt, checkpoints at 256, 512, 768 written through."""
    prompt, other, tail = prompts(2, shared=800, length=900)
    a = Instance(store, 3, write_through=True, interval=GRAIN)
    compute_prompt(a, "p", prompt)
    return a, prompt, other, tail


def test_a_load_holds_its_checkpoint_pages_only_as_a_device_hit_does():
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    a, _, other, tail = writer(store)
    b = Instance(store, 13)
    used = {gid: st.used_pages for gid, st in b.manager.stats().items()}
    b.manager.add_request("q", other, max_new_tokens=8)
    (load,) = b.take_loads()
    assert (load.from_tokens, load.boundary_tokens) == (0, 768)
    assert held(b.manager, "q") == HELD_AFTER_768
    gained = {gid: st.used_pages - used[gid] for gid, st in b.manager.stats().items()}
    assert gained == {gid: count for gid, (_, count) in HELD_AFTER_768.items()}
    # the same pages as a device hit at 768 (instance A holds the prompt's entries)
    assert a.manager.add_request("q", other, max_new_tokens=8).hit_tokens == 768
    assert held(a.manager, "q") == HELD_AFTER_768
    assert b.link.confirm_load("q", load.plan.run(store, b.pools, load.targets)) == 768
    assert {load.targets[gid].pages.size for gid in HELD_AFTER_768} == {0, 1, 3}
    np.testing.assert_allclose(b.compute_rest("q", other, tail), dense(b.model, np.concatenate([other, tail]))[768:],
                               rtol=0, atol=ATOL)
    b.manager.check_invariants()


def test_a_load_much_longer_than_the_window_is_admitted_where_its_computed_step_is_not():
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    _, _, other, tail = writer(store)
    b = SmallStateInstance(store, 13)
    rng = np.random.default_rng(11)
    b.manager.add_request("z", rng.integers(0, CONFIG.vocab_size, 850), max_new_tokens=8)  # no hit anywhere
    (answer,) = b.manager.check_admission([("z", 768)])
    assert not answer.ok and "new pages" in answer.reason  # e.g. 12 swa pages of 64 tokens; the pool has 5
    assert not b.manager.check_admission([("z", 256)])[0].ok  # not even one grain computed
    b.manager.add_request("q", other, max_new_tokens=8)
    loads = b.take_loads()
    assert [(x.from_tokens, x.boundary_tokens) for x in loads] == [(0, 768)]  # one load, the whole hit
    stats = b.link.stats()
    assert (stats.denied_loads, stats.shortened_loads) == (0, 0)
    assert held(b.manager, "q") == HELD_AFTER_768
    assert b.link.confirm_load("q", loads[0].plan.run(store, b.pools, loads[0].targets)) == 768
    np.testing.assert_allclose(b.compute_rest("q", other, tail), dense(b.model, np.concatenate([other, tail]))[768:],
                               rtol=0, atol=ATOL)
    b.manager.check_invariants()


def test_a_load_publishes_no_checkpoint_inside_its_span():
    """The load writes the checkpoint at its end only: the boundaries it crosses (256 and 512,
    pinned by the interval) must not be published from pages no row was copied into. A later
    prompt leaving at 600 then loads the checkpoint at 512 from the store, rows right."""
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    _, prompt, other, tail = writer(store)
    b = Instance(store, 13, interval=GRAIN)
    b.manager.add_request("q", other, max_new_tokens=8)
    assert b.load("q") == 768
    b.compute_rest("q", other, tail)  # commits [0, 768) and its checkpoint at 768
    third = np.concatenate([prompt[:600], np.random.default_rng(5).integers(0, CONFIG.vocab_size, 40)])
    hit = b.manager.add_request("r", third, max_new_tokens=8)
    assert hit.hit_tokens == 0 and b.link.pending("r")  # blocks below 512 on the device, no checkpoint
    assert b.load("r") == 512
    np.testing.assert_allclose(b.compute_rest("r", third, tail[:2]),
                               dense(b.model, np.concatenate([third, tail[:2]]))[512:], rtol=0, atol=ATOL)
    b.manager.check_invariants()


def test_a_failed_load_goes_back_to_the_device_hit_with_its_pages():
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    _, prompt, other, tail = writer(store)
    b = Instance(store, 13)
    free = {gid: st.free_pages for gid, st in b.manager.stats().items()}
    b.manager.add_request("q", other, max_new_tokens=8)
    (load,) = b.take_loads()
    assert store.delete([o.key for o in load.plan.objects]) == len(load.plan.objects)  # nothing loads
    result = load.plan.run(store, b.pools, load.targets)
    assert result.boundary_tokens == 0
    assert b.link.confirm_load("q", result) == 0 and not b.link.pending("q")
    b.manager.check_invariants()
    b.manager.free("q")
    assert {gid: st.free_pages for gid, st in b.manager.stats().items()} == free


def test_take_loads_and_confirm_load_refuse_ids_and_results_of_the_wrong_kind():
    """take_loads("q") read the str as its characters (no load taken, no error); an unhashable id was a
    TypeError; a result of None or "768" a TypeError/ValueError of int(); 767.9 was taken as 767, a failed load."""
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    _, _, other, _ = writer(store)
    b = Instance(store, 13)
    b.manager.add_request("q", other, max_new_tokens=8)
    for ids in ("q", b"q", [["q"]], 5):
        with pytest.raises(TierLinkError, match="request_ids must be a sequence of request ids"):
            b.link.take_loads(ids)
    assert b.link.pending("q")
    (load,) = b.link.take_loads(["q"])
    with pytest.raises(TierLinkError, match="no tier load in flight"):
        b.link.confirm_load(["q"], 768)
    before = (held(b.manager, "q"), b.manager.num_computed_tokens("q"))
    for result in (None, "768", 767.9, True):
        with pytest.raises(TierLinkError, match="result must be a LoadResult or the tokens loaded"):
            b.link.confirm_load("q", result)
    assert (held(b.manager, "q"), b.manager.num_computed_tokens("q")) == before
    assert b.link.confirm_load("q", load.plan.run(store, b.pools, load.targets)) == 768
    b.manager.check_invariants()


def test_a_load_step_needs_prefix_caching():
    limits = Limits(max_running_requests=8, max_scheduled_tokens=1024, max_context_tokens=1024, speculative_tokens=3)
    mgr = CacheManager.from_plan(plan_for_tokens(LAYOUT, 4096, limits))
    mgr.add_request("a", prompt_tokens=300)
    for call in (lambda: mgr.check_admission([("a", 256)], load=True),
                 lambda: mgr.schedule([("a", 256)], write_slots=False, load=True)):
        with pytest.raises(CacheManagerError, match="prefix caching"):
            call()
    with pytest.raises(CacheManagerError, match="write_slots=False"):
        mgr.schedule([("a", 256)], load=True)
    assert mgr.num_computed_tokens("a") == 0


@pytest.mark.parametrize("kept_tokens", [512, 767])
def test_a_request_rewound_below_its_load_step_is_refused_until_freed(kept_tokens):
    """Loaded to 768, a request holds only the window below 768 in a sliding group: kept at 767 or fewer tokens
    (allowed: the 0 committed before the load), it would need the token below that window; kept at 768, nothing
    changes."""
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    _, _, other, _ = writer(store)
    b = Instance(store, 13)
    mgr = b.manager
    mgr.add_request("q", other, max_new_tokens=8)
    (load,) = b.take_loads()
    b.link.confirm_load("q", load.plan.run(store, b.pools, load.targets))
    assert mgr.num_computed_tokens("q") == 768
    mgr.rewind("q", 768)
    assert mgr.check_admission([("q", 4)])[0].ok
    mgr.rewind("q", kept_tokens)
    (answer,) = mgr.check_admission([("q", 4)])
    assert not answer.ok and "rewound below its load step" in answer.reason
    with pytest.raises(CacheManagerError, match="free it"):
        mgr.schedule([("q", 4)])
    mgr.free("q")
    mgr.check_invariants()
    mgr.add_request("q", other, max_new_tokens=8)  # the same id again: a fresh request
    assert b.load("q") == 768
    assert mgr.check_admission([("q", 4)])[0].ok
