"""Computing and wanted markers as write-once slots (hybridkv.inflight.Markers).

No marker name is put on while it holds an object: each key has MARKER_SLOTS names, a put takes
a free one and reads it back, and a writer that finds another's value there (a race) takes the
next. Checked against a reference of who marked what (hypothesis), through a tier that records
every put on a held name, with racing writers on the host and disk tiers and on two Mooncake
clients over a loopback master (the master started and stopped here). Expiry is judged on each
reader's own clock from its first sight of a slot's marker.
"""

import threading
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridkv.inflight import MARKER_ATTEMPTS, MARKER_SLOTS
from hybridkv.tiers import DiskTier, HostTier
from marker_support import TTL, Clock, WatchedTier, client, close_pair, markers, needs_mooncake, start_master


def owners(links, kind, key):
    """The (link index, request id) of every marker at ``key``."""
    index = {link.owner: i for i, link in enumerate(links)}
    return sorted((index[m.owner], m.request_id) for m in links[0].read(kind, [key])[0])


# --- one store, no race: against a reference ---------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["put", "delete_own", "delete_all", "others"]),
                         st.integers(0, 2), st.sampled_from("rst"), st.integers(0, 3)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(OPS)
# Another link deletes every slot and takes the one this link's record names: a renewal (and a
# delete of its own) must not delete that other marker.
@example([("put", 2, "t", 0), ("delete_all", 0, "r", 0), ("put", 0, "r", 0), ("put", 2, "t", 0)])
@example([("put", 0, "t", 0), ("delete_all", 1, "r", 0), ("put", 0, "r", 0), ("delete_own", 0, "t", 0)])
def test_markers_agree_with_a_reference_and_no_name_is_put_on_twice(ops):
    """Three links on one host tier, each putting, deleting and asking about markers of three
    requests on four keys (no clock moves: nothing expires). The reference: per key, the set of
    (link, request) that marked it; a put is stored when the key has a free slot (a renewal too:
    it takes a new slot, then drops its old one)."""
    watched = WatchedTier(HostTier(1 << 20))
    links = [markers(watched) for _ in range(3)]
    model: dict[int, set] = {k: set() for k in range(4)}
    for op, who, rid, key in ops:
        link, me = links[who], (who, rid)
        if op == "put":
            fits = len(model[key]) < MARKER_SLOTS
            assert link.put("wanted", [key], rid) == [fits]
            if fits:
                model[key].add(me)
        elif op == "delete_own":
            assert link.delete("wanted", [key], rid) == int(me in model[key])
            model[key].discard(me)
        elif op == "delete_all":
            assert link.delete("wanted", [key]) == len(model[key])
            model[key].clear()
        else:
            assert link.others("wanted", [key], rid) == [bool(model[key] - {me})]
        assert owners(links, "wanted", key) == sorted(model[key])
    assert watched.overwrites == 0
    assert sum(link.stats().races_lost for link in links) == 0


def test_a_put_again_takes_a_new_slot_and_drops_the_old_one():
    tier = HostTier(1 << 20)
    link = markers(tier)
    assert link.put("wanted", [7], "r") == [True]
    (first,) = link.read("wanted", [7])[0]
    assert link.put("wanted", [7], "r") == [True]
    (second,) = link.read("wanted", [7])[0]
    assert second.stamp != first.stamp
    names = link.names("wanted", 7)
    assert tier.contains(names) == [False, True] + [False] * (MARKER_SLOTS - 2)


def test_a_key_with_every_slot_held_stays_unmarked_and_is_counted():
    tier = HostTier(1 << 20)
    others = [markers(tier) for _ in range(MARKER_SLOTS)]
    for i, link in enumerate(others):
        assert link.put("computing", [3, 4], f"r{i}") == [True, True]
    late = markers(tier)
    assert late.delete("computing", [4], "r0") == 0  # not its marker: nothing deleted
    assert late.put("computing", [3], "x") == [False]
    assert late.stats().markers_refused == 1
    assert others[0].delete("computing", [3], "r0") == 1  # a slot frees
    assert late.put("computing", [3, 4], "x") == [True, False]
    assert late.others("computing", [3], "x") == [True]  # r1..r3 still compute it


def test_each_slot_expires_ttl_after_this_reader_first_sees_it():
    tier = HostTier(1 << 20)
    writer_clock, reader_clock = Clock(1e9), Clock(0.0)
    writer, reader = markers(tier, writer_clock), markers(tier, reader_clock)
    writer.put("computing", [5], "w")
    assert reader.others("computing", [5], "r") == [True]  # first sight at 0
    reader_clock.now = TTL - 1
    writer.put("computing", [5], "w")  # renewed: a new slot, a new stamp; the old slot deleted
    reader_clock.now = TTL + 1  # past the first marker's life, within the second's
    assert reader.others("computing", [5], "r") == [True]
    reader_clock.now = 2 * TTL + 1
    assert reader.others("computing", [5], "r") == [False]
    assert reader.present("computing", [5]) == [False]  # expired: the reader deleted it


# --- racing writers -------------------------------------------------------------------------------

def check_racing_writers(tier_a, tier_b, settle=lambda: None):
    """B's ``contains`` finds slot 0 free; A puts its marker there before B's put lands: B's put
    reads back A's value, counts a lost race and takes slot 1. Both are marked, each sees the
    other, and deleting one request's markers leaves the other's. (``settle`` waits out the
    read leases a store keeps before it lets a read name go.)"""
    watched = WatchedTier(tier_b)
    a, b = markers(tier_a), markers(watched)
    watched.before_put = lambda: a.put("computing", [11, 12], "ra")
    assert b.put("computing", [11, 12], "rb") == [True, True]
    assert b.stats().races_lost == 2 and b.stats().markers_refused == 0
    assert watched.overwrites == 2  # the two lost puts, on names A had just taken
    assert owners([a, b], "computing", 11) == [(0, "ra"), (1, "rb")]
    assert a.others("computing", [11, 12], "ra") == [True, True]
    assert b.others("computing", [11, 12], "rb") == [True, True]
    settle()
    assert b.delete("computing", [11], "rb") == 1
    assert owners([a, b], "computing", 11) == [(0, "ra")] and a.others("computing", [11], "ra") == [False]
    assert a.delete("computing", [12]) == 2  # every marker of a published block
    assert a.present("computing", [11, 12]) == [True, False]
    return a, b


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_racing_writers_on_a_local_tier_each_take_their_own_slot(kind, tmp_path):
    tier = HostTier(1 << 20) if kind == "host" else DiskTier(tmp_path)
    check_racing_writers(tier, tier)


def test_a_writer_that_keeps_losing_races_gives_up_and_counts_it():
    shared = HostTier(1 << 20)
    watched = WatchedTier(shared)
    b = markers(watched)
    rivals = [markers(shared) for _ in range(MARKER_ATTEMPTS)]
    left = list(rivals)

    def another():  # before each of B's puts another writer takes the slot B picked
        left.pop().put("computing", [9], "x")
        if left:
            watched.before_put = another

    watched.before_put = another
    assert b.put("computing", [9], "rb") == [False]
    assert b.stats().races_lost == MARKER_ATTEMPTS and b.stats().markers_refused == 1
    assert len(b.read("computing", [9])[0]) == MARKER_ATTEMPTS  # the rivals' markers, not B's


# --- Mooncake: two clients on a real master -----------------------------------------------------------

@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with start_master(tmp_path_factory.mktemp("markers")) as m:
        yield m


@pytest.fixture
def mooncake_pair(master):
    clients = [client(master), client(master)]
    yield clients
    close_pair(clients)


@needs_mooncake
def test_racing_writers_on_two_mooncake_clients_each_take_their_own_slot(mooncake_pair, master):
    tier_a, tier_b = mooncake_pair
    check_racing_writers(tier_a, tier_b, lambda: time.sleep(3 * master.lease_ms / 1000))
    assert tier_a.stats().errors == 0 and tier_b.stats().errors == 0


@needs_mooncake
def test_two_mooncake_clients_marking_the_same_blocks_at_once_both_land(mooncake_pair):
    """Two threads, one client each, put markers on the same 16 keys at the same moment, five
    rounds: every put is stored, each key holds exactly both markers (in two slots), and
    whoever lost a slot took the next one."""
    links = [markers(tier) for tier in mooncake_pair]
    for round_ in range(5):
        keys = [1000 * round_ + k for k in range(16)]
        start, answers = threading.Barrier(2), [None, None]

        def mark(i):
            start.wait()
            answers[i] = links[i].put("computing", keys, f"r{i}")

        threads = [threading.Thread(target=mark, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert answers == [[True] * 16, [True] * 16]
        for key in keys:
            assert owners(links, "computing", key) == [(0, "r0"), (1, "r1")]
        assert links[0].others("computing", keys, "r0") == [True] * 16
    assert all(link.stats().markers_refused == 0 for link in links)


@needs_mooncake
def test_on_mooncake_a_renewed_marker_is_seen_renewed_though_its_old_slot_is_leased(mooncake_pair, master):
    """A reader's get leases the slot it read; the writer's renewal takes another slot (a put on
    the leased name would keep the old value: the renewal would be lost and the marker expire
    for that reader), and its delete of the old slot, refused for the lease, goes through later."""
    tier_a, tier_b = mooncake_pair
    reader_clock = Clock(0.0)
    writer, reader = markers(tier_a), markers(tier_b, reader_clock)
    writer.put("computing", [21], "w")
    assert reader.others("computing", [21], "r") == [True]  # a lease on slot 0 for lease_ms
    reader_clock.now = TTL - 1
    assert writer.put("computing", [21], "w") == [True]
    assert writer.stats().deletes_failed == 1  # slot 0: leased
    reader_clock.now = TTL + 1
    assert reader.others("computing", [21], "r") == [True]  # the renewal, first seen at TTL + 1
    time.sleep(3 * master.lease_ms / 1000)
    writer.others("computing", [99], "w")  # any later call tries the refused delete again
    assert len(reader.read("computing", [21])[0]) == 1
    assert tier_a.contains(writer.names("computing", 21))[:2] == [False, True]
