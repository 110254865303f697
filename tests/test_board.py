"""The wanted board (hybridkv.inflight) and the write-once versions under it (hybridkv.tiers.versions).

Two links share one store: one reads the board, the other changes it, the first sees the change.
On Mooncake (a real master on loopback, two clients) this failed before the board was written
as write-once generations: once a client had read the board, the master refused its delete for
the read lease and a put under the same name kept the old value. The host and disk tiers go
through the same interface. Expiry is judged on each reader's own clock from its first sight,
so two links whose clocks differ by a day agree on it.
"""

import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridkv.inflight import BOARD_ATTEMPTS, InFlightRule
from hybridkv.tiers import DiskTier, HostTier
from marker_support import TTL, Clock, MooncakeMaster, WatchedTier, client, close_pair, markers, needs_mooncake, start_master

from hybridkv.tiers.versions import VersionLog

def key(i):
    return (1000 + i).to_bytes(16, "big")


# --- the versions: one reader and many writers, the newest always found ---------------------------

def true_kept(head, keep):
    """The generations the keeping rule holds when ``head`` is the newest."""
    return {g for g in range(1, head + 1) if head - g < keep * (g & -g)}


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=120),
       st.integers(3, 6))
@example(ops=[(0, False)] * 5 + [(2, True), (1, True)] + [(1, False)] * 5 + [(0, False)] * 2, keep=3)
def test_any_reader_finds_the_newest_generation_written(ops, keep):
    """Three writers on one host tier, each appending when told (from what it knows, stale or
    not): an append wins only at the newest plus one; a reader that lags any distance, or
    starts from nothing, finds the newest; the tier holds exactly the kept set."""
    tier = HostTier(1 << 20)
    logs = [VersionLog(tier, "t/board", keep=keep) for _ in range(3)]
    head, stale_puts = 0, 0
    for who, fresh in ops:
        log = logs[who]
        generation = log.newest() if fresh else log.known
        won = log.append(generation + 1, f"{who}:{generation + 1}".encode())
        assert won == (generation == head)
        head += int(won)
        stale_puts += int(generation + 1 < head)
    held = {g for g in range(1, head + 2) if tier.contains([logs[0].name(g)])[0]}
    kept = true_kept(head, keep)
    assert kept <= held and len(held - kept) <= stale_puts  # made again by a stale writer: left
    for reader in logs + [VersionLog(tier, "t/board", keep=keep)]:
        assert reader.newest() == head
    generation, value = VersionLog(tier, "t/board", keep=keep).read()
    assert generation == head and (value is None) == (head == 0)


def test_the_kept_generations_stay_few():
    tier = HostTier(1 << 24)
    log = VersionLog(tier, "t/board", keep=8)
    for g in range(1, 3001):
        assert log.append(g, b"x")
    held = sum(tier.contains([log.name(g) for g in range(1, 3001)]))
    assert held == len(true_kept(3000, 8)) and held <= 8 * 12
    assert log.stats().deleted == 3000 - held and log.stats().deletes_failed == 0
    fresh = VersionLog(tier, "t/board", keep=8)
    assert fresh.newest() == 3000 and fresh.stats().searches == 1
    with pytest.raises(ValueError, match="keep"):
        VersionLog(tier, "t/x", keep=2)


# --- the board through each tier's interface ------------------------------------------------------

@pytest.fixture(params=["host", "disk"])
def local_tier(request, tmp_path):
    tier = HostTier(1 << 24) if request.param == "host" else DiskTier(tmp_path / "disk")
    yield tier
    tier.close()


def check_two_links_see_each_others_changes(tier_a, tier_b):
    a, b = markers(tier_a), markers(tier_b)
    assert a.board() == {} and b.board() == {}
    assert b.want([1001])  # B adds a key after A has read the board
    assert list(a.board()) == [key(1)]
    assert a.want([1002]) and not a.want([1002])  # listed already: nothing written
    assert list(b.board()) == [key(1), key(2)]
    assert b.unwant([1001]) and not b.unwant([1001])
    assert list(a.board()) == [key(2)]
    for i in range(3, 40):  # many changes, each read by the other link at once
        (a if i % 2 else b).want([1000 + i])
        assert key(i) in (b if i % 2 else a).board()
    assert len(a.board()) == 38 and a.board().keys() == b.board().keys()
    return a, b


def test_two_links_see_each_others_board_changes(local_tier):
    a, b = check_two_links_see_each_others_changes(local_tier, local_tier)
    assert a.stats().board_changes_lost == 0 and b.stats().board.conflicts == 0


def test_two_writers_at_once_lose_nothing_the_loser_tries_again():
    shared = HostTier(1 << 24)
    racing = WatchedTier(shared, watch="/marker/board/")
    a, b = markers(shared), markers(racing)
    assert b.board() == {}
    racing.before_put = lambda: a.want([1001])  # A writes generation 1 between B's read and put
    assert b.want([1002])
    assert b.stats().board.conflicts == 1 and b.stats().board_changes_lost == 0
    assert list(a.board()) == [key(1), key(2)] and list(b.board()) == [key(1), key(2)]


def test_a_change_that_keeps_losing_is_given_up_and_counted():
    shared = HostTier(1 << 24)
    racing = WatchedTier(shared, watch="/marker/board/")
    a, b = markers(shared), markers(racing)
    left = [BOARD_ATTEMPTS]

    def another():  # before each of B's puts, A writes first
        a.want([1100 + left[0]])
        left[0] -= 1
        if left[0]:
            racing.before_put = another

    racing.before_put = another
    assert not b.want([1002])
    assert b.stats().board_changes_lost == 1 and b.stats().board.conflicts == BOARD_ATTEMPTS
    assert key(2) not in a.board()  # lost: its waiter adds it again at its next poll
    assert b.want([1002]) and key(2) in a.board()


# --- expiry on each reader's own clock ------------------------------------------------------------

def test_board_entries_expire_on_each_readers_clock_whatever_the_skew():
    tier = HostTier(1 << 24)
    ahead, behind = Clock(86_400.0), Clock(-5.0)  # a day apart
    a, b = markers(tier, ahead), markers(tier, behind)
    assert b.want([1001])
    assert list(a.board()) == [key(1)]  # A's first sight: now on A's clock
    ahead.now += TTL - 1
    behind.now += TTL - 2
    assert list(a.board()) == [key(1)] and list(b.board()) == [key(1)]
    behind.now += 2  # TTL past B's write on B's clock: expired for its writer first
    assert b.board() == {} and list(a.board()) == [key(1)]
    assert b.want([1001])  # the writer renews it: a new stamp, a new first sight for everyone
    ahead.now += 5
    assert list(a.board()) == [key(1)]
    ahead.now += TTL - 1
    assert list(a.board()) == [key(1)]
    ahead.now += 1
    assert a.board() == {}
    assert a.want([1002]) and list(b.board()) == [key(2)]  # A's write dropped what it saw expire


def test_a_marker_expires_ttl_after_a_reader_first_sees_it():
    tier = HostTier(1 << 24)
    writer_clock, reader_clock = Clock(1e9), Clock(3.0)
    writer, reader = markers(tier, writer_clock), markers(tier, reader_clock)
    writer.put("computing", [7], "r1")
    reader_clock.now = 50.0  # the marker lay there: life counts from the first sight
    assert reader.others("computing", [7], "r2") == [True]
    reader_clock.now += TTL - 0.5
    assert reader.others("computing", [7], "r2") == [True]
    reader_clock.now += 0.5
    assert reader.others("computing", [7], "r2") == [False]
    assert reader.present("computing", [7]) == [False]  # the reader deleted it
    writer.put("computing", [7], "r1")  # put again: a new stamp, a new life
    assert reader.others("computing", [7], "r2") == [True]


def test_the_default_clock_is_monotonic():
    assert InFlightRule().clock is time.monotonic


# --- Mooncake: two clients on a real master ---------------------------------------------------------

@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with start_master(tmp_path_factory.mktemp("board")) as m:
        yield m


@pytest.fixture
def mooncake_pair(master):
    a, b = client(master), client(master)
    yield a, b
    close_pair([a, b])


@needs_mooncake
def test_on_mooncake_a_board_read_by_one_client_changes_for_another(mooncake_pair):
    """The bug this fixes: A reads the board, B adds a key, A sees it (before, A never did)."""
    tier_a, tier_b = mooncake_pair
    a, b = check_two_links_see_each_others_changes(tier_a, tier_b)
    assert tier_a.stats().errors == 0 and tier_b.stats().errors == 0
    assert a.stats().board_changes_lost == 0 and b.stats().board_changes_lost == 0


@needs_mooncake
def test_on_mooncake_refused_deletes_are_counted_and_tried_again(mooncake_pair, master):
    """Within a reader's lease the master refuses a delete: counted, never raised, and done at a
    later call once the lease has run out (the master's lease here: ``lease_ms``)."""
    tier_a, tier_b = mooncake_pair
    a, b = markers(tier_a), markers(tier_b)
    a.put("computing", [7], "r1")
    assert b.others("computing", [7], "r2") == [True]  # B's read starts a lease
    assert a.delete("computing", [7]) == 0
    assert a.stats().deletes_failed == 1
    assert b.present("computing", [7]) == [True]
    time.sleep(3 * master.lease_ms / 1000)
    a.board()  # any later call tries the delete again
    assert b.present("computing", [7]) == [False]
    assert b.others("computing", [7], "r2") == [False]
    for g in range(40):  # old generations under leases: their deletes wait, then go
        assert b.want([2000 + g])
        a.board()
    assert b.stats().board.deletes_failed > 0  # A read each new generation: leases ran
    for g in (3000, 3001):  # the next appends, the leases over, try the refused deletes again
        time.sleep(3 * master.lease_ms / 1000)
        assert b.want([g])
    names = [f"{b.board_name()}/{g}" for g in range(1, 43)]
    held = {g for g, ok in zip(range(1, 43), tier_a.contains(names)) if ok}
    assert held == true_kept(42, 8)
    assert b.stats().board.deletes_dropped == 0


@needs_mooncake
def test_a_dead_master_is_a_clean_miss_and_a_counted_error(tmp_path):
    with MooncakeMaster(log_path=str(tmp_path / "master.log")) as master:
        tier_a, tier_b = client(master, retry_after_s=0.5), client(master, retry_after_s=0.5)
        try:
            a, b = markers(tier_a), markers(tier_b)
            assert b.want([1001]) and list(a.board()) == [key(1)]
            master.stop()
            assert a.board() == {}  # a clean miss
            assert not b.want([1002])  # not written, counted
            assert b.stats().board_changes_lost == 1
            assert a.others("computing", [7], "r") == [False]
            assert tier_a.stats().errors >= 1 and tier_b.stats().errors >= 1
            master.start()  # a new master, empty: the board starts again once the clients are back
            deadline = time.monotonic() + 20
            while not b.want([1003]) and time.monotonic() < deadline:
                time.sleep(0.5)
            while list(a.board()) != [key(3)] and time.monotonic() < deadline:
                time.sleep(0.5)
            assert list(a.board()) == [key(3)] and list(b.board()) == [key(3)]
        finally:
            tier_a.close()
            tier_b.close()
