"""The Mooncake Store tier against a real master on loopback (started and stopped here).

These tests need the [mooncake] extra and three Debian libraries
(scripts/install-test-deps.sh). Without them they skip on a developer machine
and fail under CI=true: CI must run them.
"""

import os
import time

import numpy as np
import pytest

from hybridkv.models.layout import cache_layout
from hybridkv.tiers import (
    GroupPages,
    HostTier,
    ObjectKey,
    ObjectStore,
    RowsObject,
    TierStack,
    TierUnavailable,
    layout_parts,
    new_group_pools,
    stream_load,
)
from hybridkv.tiers.mooncake import MooncakeMaster, MooncakeTier, load_store_class

try:
    load_store_class()
    MISSING = None
except TierUnavailable as exc:
    MISSING = str(exc)

if MISSING is not None:
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError(f"CI must run the Mooncake tests: {MISSING}")
    pytest.skip(MISSING, allow_module_level=True)

FLASH = cache_layout("deepseek-v4-flash")
C4 = "v4.c4a.compressed_kv"


# A read holds its lease until its transfer ends: the client refuses the value
# (LEASE_EXPIRED, a miss) when the transfer outlasts it, as 300 KB did at 50 ms on a
# loaded machine. Long enough for any read here (the class's default); deletes wait it out.
LEASE_MS = MooncakeMaster.lease_ms


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    with MooncakeMaster(log_path=str(log), lease_ms=LEASE_MS) as m:
        yield m


def test_a_master_whose_chosen_port_was_taken_starts_on_new_ports(tmp_path):
    """Another process binds the rpc port the master object chose before it starts: the master
    exits (its bind fails) and ``start`` tries again on new ports; ports given are kept."""
    import socket

    chosen = MooncakeMaster(log_path=str(tmp_path / "master.log"))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", chosen.rpc_port))
        taken = chosen.rpc_port
        with chosen:
            assert chosen.running and chosen.rpc_port != taken
        given = MooncakeMaster(log_path=str(tmp_path / "given.log"), rpc_port=taken)
        with pytest.raises(TierUnavailable, match="exited"):
            given.start()
        assert given.rpc_port == taken and not given.running


def past_the_lease(master):
    """Wait until the last read's lease (taken before it answered) has run out: removal is allowed."""
    time.sleep(1.2 * master.lease_ms / 1000)


def connect(master, **options):
    return MooncakeTier(master.master_address, master.metadata_url, segment_bytes=options.pop("segment_bytes", 32 << 20))


@pytest.fixture(scope="module")
def tier(master):
    t = connect(master)
    yield t
    t.close()


def restart_for(master, tier, client):
    """Start the killed master again, close ``client``, and wait until the module's ``tier`` stores
    again: its segment is mounted on the new master a while after the restart (the next test's puts
    found no space before it on a loaded machine)."""
    master.start()
    client.close()
    wait_until_stored(tier, timeout_s=60.0)


def wait_until_stored(tier, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if tier.put([(f"probe-{time.monotonic_ns()}", b"1")])[0]:
            return
        time.sleep(0.05)
    raise AssertionError("the client did not reconnect to the restarted master")


def c4_block(seed):
    parts = layout_parts(FLASH, C4)
    payload = np.random.default_rng(seed).integers(0, 256, 64 * 21 * 652, dtype=np.uint8)
    return RowsObject(ObjectKey("block", C4, seed.to_bytes(16, "big")), 0, 256, 0, 64, parts, payload)


def test_put_get_contains_delete(master, tier):
    values = [os.urandom(n) for n in (1, 1000, 300_000)]
    names = [f"t/{i}" for i in range(3)]
    assert tier.put(list(zip(names, values))) == [True] * 3
    assert tier.get(names + ["t/absent"]) == values + [None]
    assert tier.contains(["t/1", "t/absent"]) == [True, False]
    past_the_lease(master)
    assert tier.delete(["t/1", "t/absent"]) == 1
    assert tier.contains(["t/1"]) == [False]
    stats = tier.stats()
    assert stats.errors == 0 and stats.misses == 1 and stats.stored_bytes == sum(map(len, values))


def test_objects_put_by_one_client_load_verified_in_another(master, tier):
    other = connect(master)
    try:
        objects = [c4_block(i) for i in range(4)]
        assert ObjectStore(tier, FLASH).put(objects) == [True] * 4
        reader = ObjectStore(other, FLASH)
        got = reader.get([o.key for o in objects])
        assert all(np.array_equal(g.payload, o.payload) for g, o in zip(got, objects))
        refused = ObjectStore(other, FLASH, model_id="another-model")  # another namespace: other names
        assert refused.get([objects[0].key]) == [None]
        assert refused.stats().missing == 1
    finally:
        other.close()


def test_a_corrupted_object_is_a_clean_counted_miss(master, tier):
    store = ObjectStore(tier, FLASH)
    obj = c4_block(99)
    name = store.name(obj.key)
    store.put([obj])
    raw = bytearray(tier.get([name])[0])
    raw[100] ^= 0xFF
    past_the_lease(master)
    tier.delete([name])
    assert tier.put([(name, bytes(raw))]) == [True]
    assert store.get([obj.key]) == [None]
    assert store.stats().corrupt == 1


def test_a_full_store_refuses_puts_and_counts_them(tier):
    # more than every mounted segment holds (the fixture client's 32 MiB): refused, counted
    huge = b"f" * (48 << 20)
    assert tier.put([("full/a", b"small"), ("full/huge", huge)]) == [True, False]
    stats = tier.stats()
    assert stats.refused == 1 and stats.errors >= 1
    assert tier.get(["full/huge", "full/a"]) == [None, b"small"]  # still answering


def test_a_killed_master_gives_clean_misses_and_counted_errors_then_recovers(master, tier):
    client = MooncakeTier(master.master_address, master.metadata_url, segment_bytes=32 << 20, retry_after_s=0.5)
    try:
        assert client.put([("dead/a", b"payload")]) == [True]
        store = ObjectStore(TierStack([HostTier(1 << 20), client]), FLASH)
        obj = c4_block(5)
        assert store.put([obj]) == [True]
        master.stop()  # killed mid-run
        assert client.get(["dead/a"]) == [None]
        assert client.contains(["dead/a"]) == [False]
        assert client.put([("dead/b", b"x")]) == [False]
        stats = client.stats()
        assert stats.errors >= 3 and stats.refused == 1 and "unreachable" in stats.last_error
        # within the retry pause the tier answers without calling the dead master
        paused = time.monotonic()
        for _ in range(20):
            assert client.get(["dead/a"]) == [None]
        assert time.monotonic() - paused < 0.2
        # the host tier above still serves what it holds; nothing raised
        assert store.get([obj.key])[0] is not None
        store.tier.tiers[0].delete([store.name(obj.key)])
        assert store.get([obj.key]) == [None] and store.stats().missing == 1
        master.start()
        wait_until_stored(client)
        assert client.put([("dead/c", b"back")]) == [True] and client.get(["dead/c"]) == [b"back"]
    finally:
        restart_for(master, tier, client)


WRITER = """
import sys
import numpy as np
from hybridkv.models.layout import cache_layout
from hybridkv.tiers import ObjectKey, ObjectStore, RowsObject, layout_parts
from hybridkv.tiers.mooncake import MooncakeTier
layout = cache_layout("deepseek-v4-flash")
tier = MooncakeTier(sys.argv[1], sys.argv[2], segment_bytes=32 << 20)
parts = layout_parts(layout, "v4.c4a.compressed_kv")
objects = [RowsObject(ObjectKey("block", "v4.c4a.compressed_kv", bytes([i + 1]) * 16), 0, 256, 0, 64, parts,
                      np.random.default_rng(i).integers(0, 256, 64 * 21 * 652, dtype=np.uint8)) for i in range(3)]
print(ObjectStore(tier, layout).put(objects), flush=True)
sys.stdin.readline()  # the objects live in this process's segment: stay until the reader is done
tier.close()
"""


def test_objects_written_by_another_process_load_verified_here(master, tier):
    import subprocess
    import sys

    writer = subprocess.Popen([sys.executable, "-c", WRITER, master.master_address, master.metadata_url],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert writer.stdout.readline().strip() == "[True, True, True]"
        store = ObjectStore(tier, FLASH)
        keys = [ObjectKey("block", C4, bytes([i + 1]) * 16) for i in range(3)]
        got = store.get(keys)
        for i, obj in enumerate(got):
            expected = np.random.default_rng(i).integers(0, 256, 64 * 21 * 652, dtype=np.uint8)
            assert obj is not None and np.array_equal(obj.payload, expected)
    finally:
        writer.communicate("done\n", timeout=60)
    assert writer.returncode == 0


def test_ci_fails_loudly_when_mooncake_is_missing():
    import subprocess
    import sys

    # the module under CI=true with the package hidden: collection must fail, not skip
    script = (
        "import sys, runpy; sys.modules['mooncake'] = None; sys.modules['mooncake.store'] = None\n"
        f"runpy.run_path({__file__!r})\n"
    )
    env = dict(os.environ, CI="true")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "CI must run the Mooncake tests" in out.stderr


def test_fetch_receives_into_the_registered_buffer_and_falls_back_to_get(master):
    client = MooncakeTier(master.master_address, master.metadata_url, segment_bytes=32 << 20,
                          receive_bytes=2 << 20)
    try:
        store = ObjectStore(client, FLASH)
        objects = [c4_block(40 + i) for i in range(2)]  # 2 x 876 kB: fits the 2 MiB buffer
        assert store.put(objects) == [True, True]
        keys = [o.key for o in objects]
        got = store.fetch(keys, [64, 64])
        assert all(np.array_equal(g.payload, o.payload) for g, o in zip(got, objects))
        assert not got[0].payload.flags.writeable
        # a wrong size (another row count) misses the buffer path, then get finds the object
        assert np.array_equal(store.fetch(keys[:1], [63])[0].payload, objects[0].payload)
        # three objects do not fit the buffer: fetched through get
        third = c4_block(42)
        store.put([third])
        got = store.fetch(keys + [third.key], [64, 64, 64])
        assert np.array_equal(got[2].payload, third.payload)
        absent = ObjectKey("block", C4, b"\x77" * 16)
        assert store.fetch([absent], [64]) == [None]
        stats = client.stats()
        assert stats.errors == 0 and stats.misses == 1
    finally:
        client.close()


def test_the_receive_buffers_take_turns(master):
    client = MooncakeTier(master.master_address, master.metadata_url, segment_bytes=32 << 20,
                          receive_bytes=1 << 20, receive_buffers=2)
    try:
        values = {f"turns/{i}": bytes([i + 1]) * 1000 for i in range(3)}
        assert client.put(list(values.items())) == [True] * 3
        assert client.fetch_views_kept == 2
        first = client.fetch(["turns/0"], [1000])[0]
        second = client.fetch(["turns/1"], [1000])[0]
        assert bytes(first) == values["turns/0"] and bytes(second) == values["turns/1"]  # both valid
        client.fetch(["turns/2"], [1000])  # the third fetch reuses the first one's buffer
        assert bytes(first) == values["turns/2"] and bytes(second) == values["turns/1"]
    finally:
        client.close()


def c4_plan(blocks):
    """Pools with random rows, a page view, and the ranges of ``blocks`` c4 blocks."""
    rng = np.random.default_rng(blocks)
    pools = new_group_pools(FLASH, {g.group_id: (blocks + 2 if g.group_id == C4 else 1) for g in FLASH.groups})
    for plane in pools[C4].planes:
        plane.pool[...] = rng.integers(0, 256, plane.pool.shape, dtype=np.uint8)
    view = {C4: GroupPages(0, rng.permutation(np.arange(1, blocks + 2))[:blocks])}
    ranges = [(ObjectKey("block", C4, b"stream" + bytes([i]) * 10), 256 * i, 256 * (i + 1)) for i in range(blocks)]
    return pools, view, ranges


def test_stream_load_skips_a_corrupted_object_and_a_killed_master_loads_nothing(master, tier):
    from hybridkv.tiers import gather_objects

    client = MooncakeTier(master.master_address, master.metadata_url, segment_bytes=32 << 20, retry_after_s=30)
    try:
        store = ObjectStore(client, FLASH)
        pools, view, ranges = c4_plan(6)
        objects = gather_objects(pools, view, ranges)
        assert store.put(objects) == [True] * 6
        name = store.name(ranges[4][0])
        raw = bytearray(client.get([name])[0])
        raw[-1] ^= 0x01
        past_the_lease(master)
        client.delete([name])
        assert client.put([(name, bytes(raw))]) == [True]
        target, _, _ = c4_plan(6)
        assert stream_load(store, ranges, target, view, batch_objects=2) == [True] * 4 + [False, True]
        assert store.stats().corrupt == 1
        for i in (0, 5):
            got = gather_objects(target, view, [ranges[i]])[0]
            assert np.array_equal(got.payload, objects[i].payload)
        master.stop()  # killed mid-run: every object is a miss, nothing is written, nothing raises
        before = [p.pool.copy() for p in target[C4].planes]
        assert stream_load(store, ranges, target, view, batch_objects=2) == [False] * 6
        assert all(np.array_equal(p.pool, b) for p, b in zip(target[C4].planes, before))
        assert client.stats().errors >= 1 and "unreachable" in client.stats().last_error
    finally:
        restart_for(master, tier, client)


def test_views_of_the_put_buffer_are_sent_from_it_and_others_are_copied(tier):
    with tier.put_buffer(1 << 20) as staging:
        assert staging is not None and staging.size == 1 << 20
        with tier.put_buffer(10) as second:
            assert second is None  # lent once at a time
        staging[:300_000] = np.frombuffer(os.urandom(300_000), dtype=np.uint8)
        outside = np.frombuffer(os.urandom(5000), dtype=np.uint8).copy()
        items = [("pb/a", memoryview(staging)[:100_000]), ("pb/b", memoryview(outside)),
                 ("pb/c", memoryview(staging)[100_000:300_000]), ("pb/d", b"plain bytes")]
        expected = [bytes(v) for _, v in items]
        assert tier.put(items) == [True] * 4
        staging[:300_000] = 0  # the store holds its own copy
    assert tier.get([name for name, _ in items]) == expected
    with tier.put_buffer(1 << 40) as huge:
        assert huge is None  # larger than the tier's buffer: build values elsewhere
    tier.delete([name for name, _ in items])


def test_delete_is_one_batch_remove_counting_only_what_it_removed(tmp_path):
    """Six names: three held, one under another client's read lease (refused), two absent. One
    ``batch_remove`` call; the count is the three the store removed. (A put takes no lease; a
    get takes one of ``lease_ms``, long here so that it still runs at the delete.)"""
    with MooncakeMaster(log_path=str(tmp_path / "master.log"), lease_ms=5000) as master:
        writer, reader = connect(master), connect(master)
        try:
            names = [f"del/{i}" for i in range(4)]
            assert writer.put([(n, n.encode()) for n in names]) == [True] * 4
            assert reader.get(["del/3"]) == [b"del/3"]  # a read lease on del/3 now
            assert writer.delete(names + ["del/absent", "del/gone"]) == 3
            assert writer.remove_calls == {"batch_remove": 1, "remove": 0}
            assert writer.delete_each(["del/3", "del/0"]) == [None, False]  # leased still; gone
            assert writer.remove_calls == {"batch_remove": 2, "remove": 0}
            assert writer.contains(names) == [False, False, False, True]
            assert writer.stats().deleted == 3 and writer.stats().errors == 0
        finally:
            writer.close()
            reader.close()


def test_a_refused_batch_remove_falls_back_to_one_remove_per_name(master, monkeypatch):
    """A client that refuses ``batch_remove`` (an older wheel lacks it; here it raises): each
    name is removed on its own, and the count is the same."""
    import hybridkv.tiers.mooncake as mooncake

    real = load_store_class()

    class Refusing(real):
        def batch_remove(self, keys, force=False):
            raise RuntimeError("batch_remove refused")

    monkeypatch.setattr(mooncake, "load_store_class", lambda: Refusing)
    client = connect(master)
    try:
        names = [f"fallback/{i}" for i in range(5)]
        assert client.put([(n, b"x") for n in names]) == [True] * 5
        past_the_lease(master)
        assert client.delete(names[:3] + ["fallback/absent"]) == 3
        assert client.remove_calls == {"batch_remove": 0, "remove": 4}
        assert client.contains(names) == [False, False, False, True, True]
        assert "batch_remove refused" in client.stats().last_error
    finally:
        client.close()
