"""Requests wait for the blocks another request is computing (hybridkv.inflight, TierLink's
``in_flight`` rule): computing markers in the shared store, a bounded wait, expiry, a dead
peer, a freed owner, wanted checkpoints; and never wrong rows: every output equals the
dense reference. Real bytes: the reference layers' pools and a HostTier store shared by two
managers with shuffled page ids. The rule's clock is a counter the tests move.
"""

import numpy as np
import pytest

from hybridkv.inflight import (MAX_BOARD_KEYS, InFlightRule, Marker, Markers, decode_board, decode_marker, encode_board,
                               encode_marker)
from hybridkv.runtime.manager import CacheManager
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_tokens
from hybridkv.reference.config import ReferenceConfig, build_model
from hybridkv.reference.dense import dense_forward
from hybridkv.reference.paged import PagedStack
from hybridkv.tiers import HostTier, ObjectKey, ObjectStore, Tier, group_pools_from_layers
from hybridkv.tierlink import TierLink
from marker_support import needs_mooncake

CONFIG = ReferenceConfig()
LAYOUT = cache_layout(CONFIG.hf_config(), speculative_tokens=3)
ATOL = 1e-9
GRAIN = 256
WAIT, TTL = 5, 20


class Clock:
    def __init__(self):
        self.now = 0

    def __call__(self):
        return self.now


class Instance:
    """A manager linked (write-through, markers on) to the shared store; the engine's part."""

    def __init__(self, store, clock, shuffle_seed, *, write_through=True, rule=None):
        self.model = build_model(CONFIG, seed=0)
        limits = Limits(max_running_requests=8, max_scheduled_tokens=1024, max_context_tokens=1024,
                        speculative_tokens=3)
        plan = plan_for_tokens(LAYOUT, 4096, limits, page_space="per-group")  # the stack holds plan.group_pages
        self.store = store
        rule = rule or InFlightRule(wait=WAIT, ttl=TTL, clock=clock)
        self.link = TierLink(store, write_through=write_through, in_flight=rule)
        self.manager = CacheManager.from_plan(plan, shuffle_seed=shuffle_seed, enable_prefix_caching=True,
                                              prefix_granularity=GRAIN, tier_link=self.link)
        self.stack = PagedStack(self.model, self.manager.specs, plan.group_pages)
        self.pools = group_pools_from_layers(LAYOUT, self.stack.pools)

    def offload(self):
        self.link.take_offloads().run(self.store, self.pools)

    def load(self, rid, limit=8):
        """Resume, take, run and confirm loads until ``rid`` is not pending (or still waits)."""
        for _ in range(limit):
            loads = self.link.take_loads()
            self.offload()
            for load in loads:
                self.link.confirm_load(load.request_id, load.plan.run(self.store, self.pools, load.targets))
            if not self.link.pending(rid) or self.link.waiting(rid):
                break
        return self.manager.num_computed_tokens(rid)

    def step(self, rid, tokens):
        batch = self.manager.schedule([(rid, len(tokens))])
        self.offload()
        return self.stack.forward(batch, np.asarray(tokens)).hidden

    def compute(self, rid, prompt, decode=(1,)):
        """The prompt past what is computed, then ``decode`` (the next step commits the prompt)."""
        got = self.manager.num_computed_tokens(rid)
        outs = [self.step(rid, prompt[got:])]
        for token in decode:
            self.manager.append_token_ids(rid, [token])
            outs.append(self.step(rid, [token]))
        self.offload()  # the markers of the blocks put go at the take_offloads after
        return np.concatenate(outs)


def dense(model, tokens):
    return dense_forward(model, np.asarray(tokens)).hidden


def prompts(seed):
    """A 900-token prompt and another sharing its first 600 (two whole blocks, the junction at 512)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, CONFIG.vocab_size, 900)
    other = np.concatenate([prompt[:600], rng.integers(0, CONFIG.vocab_size, 50)])
    return prompt, other


def keys(manager, prompt, ends):
    probe = manager.prefix.new_request_hashes(None)
    probe.extend_to(np.asarray(prompt, dtype=np.int32), max(ends))
    return [probe.key(end) for end in ends]


@pytest.fixture
def store():
    return ObjectStore(HostTier(1 << 30), LAYOUT)


def test_a_request_waits_for_blocks_another_instance_computes_then_loads_them(store):
    clock = Clock()
    prompt, other = prompts(0)
    a, b = Instance(store, clock, 3), Instance(store, clock, 11)
    a.manager.add_request("p", prompt, max_new_tokens=8)  # marks blocks 256, 512, 768
    marked = keys(a.manager, prompt, [256, 512, 768])
    assert a.link.markers.present("computing", marked) == [True, True, True]
    assert b.manager.add_request("q", other, max_new_tokens=8).hit_tokens == 0
    assert b.link.pending("q") and b.link.waiting("q")
    (answer,) = b.manager.check_admission([("q", 16)])
    assert not answer.ok and "waits" in answer.reason
    assert b.load("q") == 0 and b.link.waiting("q")  # still marked: still waiting
    out_a = a.compute("p", prompt)
    np.testing.assert_allclose(out_a, dense(a.model, np.concatenate([prompt, [1]])), rtol=0, atol=ATOL)
    assert a.link.markers.present("computing", marked) == [False, False, False]  # landed: markers gone
    # 512 is a low-priority prompt boundary of p's (its own checkpoint is at 768): written
    # through because q asked for it
    assert a.link.stats().wanted_checkpoints == len(a.manager.prefix.state_ids)
    assert b.load("q") == 512 and not b.link.pending("q")
    out_b = b.compute("q", other, [2, 3])
    np.testing.assert_allclose(out_b, dense(b.model, np.concatenate([other, [2, 3]]))[512:], rtol=0, atol=ATOL)
    stats = b.link.stats()
    assert (stats.waits, stats.waited_out, stats.confirmed_loads, stats.loaded_tokens) == (1, 0, 1, 512)
    b.manager.check_invariants()


def test_the_wait_is_bounded_and_then_the_request_computes(store):
    clock = Clock()
    prompt, other = prompts(1)
    a, b = Instance(store, clock, 3), Instance(store, clock, 13)
    a.manager.add_request("p", prompt, max_new_tokens=8)  # marks, then never computes
    b.manager.add_request("q", other, max_new_tokens=8)
    for now in range(WAIT):
        clock.now = now
        assert b.load("q") == 0 and b.link.waiting("q")
    clock.now = WAIT
    assert b.load("q") == 0 and not b.link.pending("q")  # waited out: computes it all
    assert b.link.stats().waited_out == 1
    out = b.compute("q", other)
    np.testing.assert_allclose(out, dense(b.model, np.concatenate([other, [1]])), rtol=0, atol=ATOL)
    # the bound is the request's, in all: added again later, it does not wait again
    b.manager.add_request("q2", other[::-1].copy(), max_new_tokens=8)
    assert not b.link.pending("q2")


def test_a_dead_peers_markers_expire(store):
    """A marker lives ``ttl`` from when this reader first saw it, on the reader's own clock (no
    clock is compared across processes)."""
    clock = Clock()
    prompt, other = prompts(2)
    a, b = Instance(store, clock, 3), Instance(store, clock, 17)
    a.manager.add_request("p", prompt, max_new_tokens=8)
    del a  # the peer dies holding its markers: nobody frees "p"
    clock.now = 100  # the marker lay there a while: B's first sight starts its life
    b.manager.add_request("q", other, max_new_tokens=8)
    assert b.link.waiting("q")
    b.manager.free("q")
    clock.now = 100 + TTL - 1
    b.manager.add_request("q", other, max_new_tokens=8)
    assert b.link.waiting("q")  # not expired yet
    b.manager.free("q")
    clock.now = 100 + TTL
    key = keys(b.manager, prompt, [256])[0]
    assert b.link.markers.present("computing", [key]) == [True]
    b.manager.add_request("q", other, max_new_tokens=8)
    assert not b.link.pending("q")  # expired (and deleted): computes at once, and marks the block as its own
    (mine,) = b.link.markers.read("computing", [key])[0]
    assert (mine.request_id, mine.owner) == ("q", b.link.markers.owner)
    out = b.compute("q", other)
    np.testing.assert_allclose(out, dense(b.model, np.concatenate([other, [1]])), rtol=0, atol=ATOL)


def test_a_freed_request_takes_its_markers_away_and_waiters_move_on(store):
    clock = Clock()
    prompt, other = prompts(3)
    a, b = Instance(store, clock, 3), Instance(store, clock, 19)
    a.manager.add_request("p", prompt, max_new_tokens=8)
    b.manager.add_request("q", other, max_new_tokens=8)
    assert b.link.waiting("q")
    a.manager.free("p")  # preempted before computing anything: its markers go
    assert b.load("q") == 0 and not b.link.pending("q")  # resumed before the bound: nothing landed
    assert b.link.stats().waited_out == 0
    # q now computes and marks what it computes; a request of a's waits for q's blocks
    a.manager.add_request("p2", prompt, max_new_tokens=8)
    assert a.link.waiting("p2")


def test_one_instance_waits_by_the_same_rule_and_hits_on_its_device(store):
    clock = Clock()
    prompt, other = prompts(4)
    a = Instance(store, clock, 7)
    a.manager.add_request("p", prompt, max_new_tokens=8)
    a.manager.add_request("q", other, max_new_tokens=8)
    assert a.link.waiting("q") and not a.link.waiting("p")
    a.compute("p", prompt)
    assert a.load("q") == 512 and not a.link.pending("q")
    assert a.link.stats().confirmed_loads == 0  # matched again on the device, nothing loaded
    out = a.compute("q", other)
    np.testing.assert_allclose(out, dense(a.model, np.concatenate([other, [1]]))[512:], rtol=0, atol=ATOL)
    a.manager.check_invariants()


def test_a_marker_that_does_not_decode_never_blocks(store):
    clock = Clock()
    prompt, other = prompts(5)
    b = Instance(store, clock, 23)
    marked = keys(b.manager, prompt, [256, 512])
    names = [b.link.markers.names("computing", k)[0] for k in marked]
    good = encode_marker(Marker("computing", 100, bytes(16), "someone"))
    store.tier.put([(names[0], b"not a marker"), (names[1], good[:-1])])
    b.manager.add_request("q", other, max_new_tokens=8)
    assert not b.link.pending("q")
    # deleted: q computes these blocks and marks them as its own (in the slots they left free)
    assert [decode_marker(v).request_id for v in store.tier.get(names)] == ["q", "q"]
    assert [[m.request_id for m in at] for at in b.link.markers.read("computing", marked)] == [["q"], ["q"]]


def test_without_write_through_no_checkpoint_is_written_for_a_waiter(store):
    clock = Clock()
    prompt, other = prompts(6)
    a = Instance(store, clock, 3, write_through=False)
    b = Instance(store, clock, 29, write_through=False)
    a.manager.add_request("p", prompt, max_new_tokens=8)
    b.manager.add_request("q", other, max_new_tokens=8)
    assert b.link.waiting("q")
    a.compute("p", prompt)
    assert a.link.stats().wanted_checkpoints == 0 and a.link.stats().offload_objects == 0
    assert b.load("q") == 0 and not b.link.pending("q")  # nothing in the store: computes


def test_markers_round_trip_and_refuse_what_is_not_one():
    marker = Marker("wanted", 2**64 - 1, bytes(range(16)), "req-é")
    data = encode_marker(marker)
    assert decode_marker(data) == marker
    for bad in (None, b"", data[:-1], data + b"x", b"XXXX" + data[4:], data[:4] + b"\x01" + data[5:],
                data[:5] + b"\x09" + data[6:]):
        assert decode_marker(bad) is None
    with pytest.raises(ValueError, match="16 bytes"):
        encode_marker(Marker("computing", 0, b"short", "r"))


@pytest.mark.parametrize("options, match", [
    ({"wait": -1}, "wait"), ({"ttl": 0}, "ttl"), ({"wait": True}, "wait"), ({"ttl": "1"}, "ttl"),
    ({"clock": 3}, "clock"),
])
def test_the_rule_is_checked(options, match):
    with pytest.raises(ValueError, match=match):
        InFlightRule(**options)


def test_a_link_refuses_a_rule_of_another_type(store):
    with pytest.raises(TypeError, match="InFlightRule"):
        TierLink(store, in_flight={"wait": 1})
    markers = Markers(store.tier, store.namespace, InFlightRule())
    with pytest.raises(ValueError, match="marker kind"):
        markers.names("other", 1)


def test_take_loads_of_one_request_leaves_the_others_planned(store):
    # (an engine building a batch takes one request's load without spending pages the batch
    # admitted so far counted on)
    clock = Clock()
    prompt, _ = prompts(7)
    a, b = Instance(store, clock, 3), Instance(store, clock, 31)
    a.manager.add_request("p", prompt, max_new_tokens=8)
    a.compute("p", prompt)
    a.manager.free("p")  # its last checkpoint (768) goes through
    a.offload()
    b.manager.add_request("q", prompt, max_new_tokens=8)
    b.manager.add_request("r", prompt[:850].copy(), max_new_tokens=8)  # p's checkpoint at 768 too
    assert b.link.pending("q") and b.link.pending("r")
    (load,) = b.link.take_loads(["q"])
    assert load.request_id == "q" and b.link.pending("r")
    assert b.link.confirm_load("q", load.plan.run(store, b.pools, load.targets)) == 768
    assert b.link.take_loads(["nobody"]) == [] and b.link.pending("r")
    assert [x.request_id for x in b.link.take_loads()] == ["r"]


def test_with_markers_a_checkpoint_goes_through_when_wanted_or_as_its_requests_last(store):
    clock = Clock()
    prompt, _ = prompts(8)
    a = Instance(store, clock, 3)
    a.manager.add_request("p", prompt, max_new_tokens=8)
    out = [a.step("p", prompt[:512]), a.step("p", prompt[512:])]  # checkpoints at 512, then 768
    a.manager.append_token_ids("p", [1])
    out.append(a.step("p", [1]))
    a.offload()
    key = dict(zip((256, 512, 768), keys(a.manager, prompt, [256, 512, 768])))
    state = a.manager.prefix.state_ids
    blocks = [ObjectKey("block", gid, key[end]) for gid in a.manager.prefix.history_ids for end in key]
    checkpoints = {end: [ObjectKey("checkpoint", gid, key[end]) for gid in state] for end in (512, 768)}
    assert all(store.contains(blocks))  # blocks go through when committed
    assert not any(store.contains(checkpoints[512] + checkpoints[768]))  # checkpoints wait
    a.manager.free("p")
    a.offload()
    assert all(store.contains(checkpoints[768])) and not any(store.contains(checkpoints[512]))
    np.testing.assert_allclose(np.concatenate(out), dense(a.model, np.concatenate([prompt, [1]])), rtol=0, atol=ATOL)
    b = Instance(store, clock, 37)
    b.manager.add_request("q", prompt, max_new_tokens=8)
    assert b.load("q") == 768
    np.testing.assert_allclose(b.compute("q", prompt, [2]), dense(b.model, np.concatenate([prompt, [2]]))[768:],
                               rtol=0, atol=ATOL)


def test_a_checkpoint_on_another_device_is_asked_for_on_the_board_and_loaded(store):
    """The blocks landed, the junction's (low-priority) checkpoint is only on A's device: B asks
    for it on the wanted board, A writes it through at its next take_offloads, B loads it."""
    clock = Clock()
    prompt, other = prompts(9)
    a, b = Instance(store, clock, 3), Instance(store, clock, 17)
    a.manager.add_request("p", prompt, max_new_tokens=8)
    out_a = a.compute("p", prompt)
    a.offload()  # every marker retired; p runs on, so its checkpoints stay on A's device
    state = a.manager.prefix.state_ids
    (k512,) = keys(a.manager, prompt, [512])
    assert not any(store.contains([ObjectKey("checkpoint", gid, k512) for gid in state]))
    assert b.manager.add_request("q", other, max_new_tokens=8).hit_tokens == 0
    assert b.link.waiting("q") and b.link.stats().checkpoint_waits == 1
    assert list(b.link.markers.board()) == [k512.to_bytes(16, "big")]
    assert b.load("q") == 0 and b.link.waiting("q")  # nobody served it yet
    a.offload()  # A reads the board: its checkpoint at 512 goes through
    assert a.link.stats().wanted_checkpoints == len(state)
    assert b.load("q") == 512 and not b.link.pending("q")
    assert b.link.markers.board() == {}  # taken off by the waiter
    out_b = b.compute("q", other, [2, 3])
    np.testing.assert_allclose(out_a, dense(a.model, np.concatenate([prompt, [1]])), rtol=0, atol=ATOL)
    np.testing.assert_allclose(out_b, dense(b.model, np.concatenate([other, [2, 3]]))[512:], rtol=0, atol=ATOL)
    b.manager.check_invariants()


def test_a_checkpoint_nobody_serves_costs_at_most_the_wait(store):
    clock = Clock()
    prompt, other = prompts(10)
    a, b = Instance(store, clock, 3), Instance(store, clock, 19)
    a.manager.add_request("p", prompt, max_new_tokens=8)
    a.compute("p", prompt)
    a.offload()
    b.manager.add_request("q", other, max_new_tokens=8)
    for now in range(WAIT):  # A never reads the board
        clock.now = now
        assert b.load("q") == 0 and b.link.waiting("q")
    clock.now = WAIT
    assert b.load("q") == 0 and not b.link.pending("q")  # waited out: computes it all
    assert b.link.stats().waited_out == 1 and b.link.markers.board() == {}
    out = b.compute("q", other)
    np.testing.assert_allclose(out, dense(b.model, np.concatenate([other, [1]])), rtol=0, atol=ATOL)


def test_the_board_round_trips_and_refuses_what_is_not_one():
    entries = {b"\x01" * 16: 3, b"\x02" * 20: 2**64 - 1}
    assert decode_board(encode_board(entries)) == entries
    assert decode_board(encode_board({})) == {}
    data = encode_board(entries)
    for bad in (None, b"", data[:-1], data + b"x", b"HKVM" + data[4:], data[:4] + b"\x01" + data[5:]):
        assert decode_board(bad) == {}
    with pytest.raises(ValueError, match="at most"):
        encode_board({i.to_bytes(2, "big"): 1 for i in range(1, MAX_BOARD_KEYS + 2)})


class LeasedTier(Tier):
    """A host tier with Mooncake's read lease, worked by hand: a name read (``get`` or
    ``contains``) refuses its delete until :meth:`expire`."""

    def __init__(self):
        super().__init__()
        self.inner = HostTier(1 << 30)
        self.leased: set[str] = set()

    def expire(self):
        self.leased.clear()

    def _put(self, items):
        return self.inner.put(items)

    def _get(self, names):
        self.leased.update(names)
        return self.inner.get(names)

    def _contains(self, names):
        self.leased.update(names)
        return self.inner.contains(names)

    def _delete(self, names):
        return sum(out is True for out in self._delete_each(names))

    def _delete_each(self, names):
        return [None if name in self.leased and held else held and self.inner.delete([name]) == 1
                for name, held in zip(names, self.inner.contains(names))]


def test_a_wanted_marker_read_for_its_checkpoint_is_deleted_after_the_lease_not_refused():
    """A writes through the checkpoint q wants at 512 and takes q's wanted marker away. It read
    the marker (``contains``) just before: on Mooncake its delete then is refused within the
    read's lease (it was, once per checkpoint). Now the delete goes at A's next take_offloads."""
    leased = LeasedTier()
    store = ObjectStore(leased, LAYOUT)
    clock = Clock()
    prompt, other = prompts(11)
    a, b = Instance(store, clock, 3), Instance(store, clock, 23)
    a.manager.add_request("p", prompt, max_new_tokens=8)
    b.manager.add_request("q", other, max_new_tokens=8)
    assert b.link.waiting("q")
    (k512,) = keys(a.manager, prompt, [512])
    wanted = a.link.markers.names("wanted", k512)
    assert any(leased.inner.contains(wanted))
    leased.expire()
    a.step("p", prompt)
    a.manager.append_token_ids("p", [1])
    a.step("p", [1])  # commits the prompt: the checkpoint at 512 is written through, the marker read
    assert a.link.stats().wanted_checkpoints == len(a.manager.prefix.state_ids)
    assert a.link.markers.stats().deletes_failed == 0
    leased.expire()
    a.offload()
    assert not any(leased.inner.contains(wanted))
    assert a.link.markers.stats().deletes_failed == 0


# --- Mooncake: a real master, whose reads lease what they read ------------------------------------

@pytest.fixture
def mooncake_tiers(tmp_path):
    from marker_support import client, close_pair, start_master

    with start_master(tmp_path) as master:
        tiers = [client(master), client(master)]
        try:
            yield tiers
        finally:
            tiers[0].raw_remove_matching(".*")
            close_pair(tiers)


@needs_mooncake
def test_on_mooncake_a_waiter_moves_on_once_the_blocks_land_though_its_polls_lease_their_markers(mooncake_tiers):
    """B's poll of A's computing marker leases it (Mooncake), so A's delete of it once the block
    is published is refused, and every later poll leases it again: the marker outlives the
    block's landing. B waits for the block, not the marker's delete: it loads once the block is
    stored (it used to wait until its bound ran out, every wait on Mooncake)."""
    clock = Clock()
    prompt, other = prompts(0)
    a = Instance(ObjectStore(mooncake_tiers[0], LAYOUT), clock, 3)
    b = Instance(ObjectStore(mooncake_tiers[1], LAYOUT), clock, 11)
    a.manager.add_request("p", prompt, max_new_tokens=8)
    b.manager.add_request("q", other, max_new_tokens=8)
    assert b.link.waiting("q") and b.load("q") == 0 and b.link.waiting("q")  # marked: waits
    outs = [a.step("p", prompt)]
    a.manager.append_token_ids("p", [1])
    outs.append(a.step("p", [1]))  # commits the prompt: its blocks published and put
    b.load("q")  # a poll between the put and A's delete of its markers
    a.offload()  # deletes the markers (refused for any lease B's polls took)
    assert b.load("q") == 512 and not b.link.pending("q")
    np.testing.assert_allclose(np.concatenate(outs), dense(a.model, np.concatenate([prompt, [1]])), rtol=0, atol=ATOL)
    out_b = b.compute("q", other, [2, 3])
    np.testing.assert_allclose(out_b, dense(b.model, np.concatenate([other, [2, 3]]))[512:], rtol=0, atol=ATOL)
    stats = b.link.stats()
    assert (stats.waits, stats.waited_out, stats.confirmed_loads) == (1, 0, 1)
