"""Host and disk tiers, the stack, and the object store's verification on top of them."""

import os
import subprocess
import sys
import textwrap
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.models.layout import cache_layout
from hybridkv.tiers import DiskTier, HostTier, ObjectKey, ObjectStore, RowsObject, TierStack, layout_parts

FLASH = cache_layout("deepseek-v4-flash")
C128 = "v4.c128a.compressed_kv"


def c128_object(seed, rows=2):
    parts = layout_parts(FLASH, C128)
    payload = np.random.default_rng(seed).integers(0, 256, rows * 20 * 584, dtype=np.uint8)
    return RowsObject(ObjectKey("block", C128, seed.to_bytes(16, "big")), 0, rows * 128, 0, rows, parts, payload)


# --- host -------------------------------------------------------------------------

ops = st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 7), st.integers(0, 40)), max_size=60)


@given(st.integers(0, 100), ops)
def test_host_tier_is_an_lru_within_its_budget(budget, program):
    tier, model = HostTier(budget), OrderedDict()  # model: name -> size, least recent first
    evicted = refused = 0
    for op, n, size in program:
        name = f"k{n}"
        if op == "put":
            stored = tier.put([(name, bytes([n]) * size)])[0]
            if name in model:
                model.move_to_end(name)
                assert stored
            elif size > budget:
                refused += 1
                assert not stored
            else:
                while sum(model.values()) + size > budget:
                    model.popitem(last=False)
                    evicted += 1
                model[name] = size
                assert stored
        elif op == "get":
            value = tier.get([name])[0]
            assert (value is not None) == (name in model)
            if name in model:
                assert value == bytes([n]) * model[name]
                model.move_to_end(name)
        else:
            assert tier.delete([name]) == int(model.pop(name, None) is not None)
        stats = tier.stats()
        assert stats.held == len(model) and stats.held_bytes == sum(model.values()) <= budget
        assert (stats.evicted, stats.refused) == (evicted, refused)


given_ops = st.lists(st.tuples(st.sampled_from(["put", "given", "get", "delete"]), st.integers(0, 7), st.integers(0, 2),
                               st.integers(1, 30)), max_size=60)


def _held_bytes(model, buffers):
    """What the model holds: its own values' bytes, and each buffer with a value in it once, whole."""
    return (sum(size for where, size in model.values() if where is None)
            + sum(buffers[b].nbytes for b in {where for where, _ in model.values() if where is not None}))


@given(st.integers(0, 120), given_ops)
def test_host_tier_keeps_given_views_and_counts_their_buffers_whole_within_its_budget(budget, program):
    """Views put ``given`` are kept, not copied, and each buffer counts once, whole, while any
    value in it is held: the tier's held bytes are the model's (recounted from scratch), at most
    the budget, and it evicts least recently used first as with its own values."""
    buffers = [np.arange(size, dtype=np.uint8) + i for i, size in enumerate((40, 64, 100))]
    tier, model, values = HostTier(budget), OrderedDict(), {}  # model: name -> (buffer or None, size)
    for op, n, b, size in program:
        name = f"k{n}"
        if op in ("put", "given"):
            at = n % 5
            view = memoryview(buffers[b])[at : at + size]
            where = b if op == "given" and buffers[b].nbytes <= budget else None
            stored = tier.put([(name, view)], given=op == "given")[0]
            if name in model:
                model.move_to_end(name)
                assert stored
                continue
            if len(view) > budget:
                assert not stored
                continue
            while model and _held_bytes({**model, name: (where, len(view))}, buffers) > budget:
                model.popitem(last=False)
            model[name], values[name] = (where, len(view)), bytes(view)
            assert stored
        elif op == "get":
            value = tier.get([name])[0]
            assert (value is not None) == (name in model)
            if name in model:
                model.move_to_end(name)
                assert bytes(value) == values[name]
                kept = np.frombuffer(value, dtype=np.uint8)
                assert np.shares_memory(kept, buffers[model[name][0]]) if model[name][0] is not None else True
        else:
            assert tier.delete([name]) == int(model.pop(name, None) is not None)
        stats = tier.stats()
        assert stats.held == len(model) and stats.held_bytes == _held_bytes(model, buffers) <= budget


def test_host_tier_counts_hits_and_misses():
    tier = HostTier(100)
    tier.put([("a", b"1"), ("b", b"22")])
    assert tier.get(["a", "c", "b"]) == [b"1", None, b"22"]
    assert [None if v is None else bytes(v) for v in tier.fetch(["b", "x"], [2, 5])] == [b"22", None]
    assert tier.contains(["a", "c"]) == [True, False]
    s = tier.stats()
    assert (s.lookups, s.hits, s.misses, s.stored, s.stored_bytes) == (5, 3, 2, 2, 3)
    with pytest.raises(ValueError, match="non-empty str"):
        tier.get([""])
    for bad in ("", 5, None):  # contains checks its names too (inline)
        with pytest.raises(ValueError, match="non-empty str"):
            tier.contains(["a", bad])
    assert tier.contains(name for name in ("b", "z")) == [True, False]  # any iterable of names
    with pytest.raises(ValueError, match="bytes"):
        tier.put([("x", "text")])


# --- disk -------------------------------------------------------------------------

def test_disk_tier_persists_across_instances_and_evicts_lru_within_budget(tmp_path):
    tier = DiskTier(tmp_path, budget_bytes=25)
    assert tier.put([("a", b"a" * 10), ("b", b"b" * 10)]) == [True, True]
    assert tier.get(["a"]) == [b"a" * 10]  # a is now the most recent
    assert tier.put([("c", b"c" * 10)]) == [True]  # evicts b
    assert tier.contains(["a", "b", "c"]) == [True, False, True]
    assert tier.stats().evicted == 1 and tier.stats().held_bytes == 20
    assert tier.put([("huge", b"h" * 26)]) == [False] and tier.stats().refused == 1
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".hkv")) == [".hkv-state"]
    assert len(os.listdir(tmp_path)) == 3
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / f".x.{int(dead.stdout)}.0.tmp").write_bytes(b"half")  # a crashed process's leftover
    (tmp_path / f".y.{os.getpid()}.0.tmp").write_bytes(b"half")  # a running process's write
    again = DiskTier(tmp_path, budget_bytes=25)
    assert again.get(["a", "c", "b"]) == [b"a" * 10, b"c" * 10, None]
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == [f".y.{os.getpid()}.0.tmp"]
    assert again.delete(["a", "b"]) == 1 and again.stats().held == 1


def test_disk_tier_read_fault_is_a_counted_miss(tmp_path):
    tier = DiskTier(tmp_path)
    tier.put([("a", b"x")])
    for name in [n for n in os.listdir(tmp_path) if n.endswith(".hkv")]:
        os.unlink(tmp_path / name)
        os.mkdir(tmp_path / name)  # now reading it fails with IsADirectoryError
    assert tier.get(["a"]) == [None]
    assert tier.stats().errors == 1 and "read failed" in tier.stats().last_error


def _mount_tmpfs(path):
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def test_disk_full_on_a_small_tmpfs_is_a_refusal_and_a_counted_error(tmp_path):
    root = tmp_path / "small"
    root.mkdir()
    if not _mount_tmpfs(root):
        pytest.skip("cannot mount a tmpfs here (not root); the RLIMIT_FSIZE test covers the same path")
    try:
        tier = DiskTier(root)
        chunk = b"z" * (300 << 10)
        stored = tier.put([(f"k{i}", chunk) for i in range(5)])  # 1.5 MiB into 1 MiB
        assert stored[:3] == [True, True, True] and stored[-1] is False
        stats = tier.stats()
        assert stats.refused == stored.count(False) and stats.errors == stats.refused
        assert "No space left" in stats.last_error
        assert not any(n.endswith(".tmp") for n in os.listdir(root))  # no half-written file stays
        assert tier.get(["k0"]) == [chunk]
    finally:
        subprocess.run(["umount", str(root)], check=False)


def test_disk_full_as_a_file_size_limit_is_a_refusal_and_a_counted_error(tmp_path):
    # Without root, RLIMIT_FSIZE makes writes past 64 KiB fail (EFBIG) as a full disk would.
    script = textwrap.dedent(f"""
        import os, resource, signal
        from hybridkv.tiers import DiskTier
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
        tier = DiskTier({str(tmp_path)!r})
        print(tier.put([("small", b"s" * 1000), ("big", b"b" * (100 << 10))]))
        s = tier.stats()
        print(s.refused, s.errors, "File too large" in s.last_error)
        print(sum(n.endswith(".hkv") for n in os.listdir({str(tmp_path)!r})), tier.get(["small", "big"])[1])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["[True, False]", "1 1 True", "1 None"]


@pytest.mark.parametrize("size", [128 << 10, (128 << 10) + 1, 876_744, (1 << 20) + 4095, 3 << 20])
def test_disk_tier_large_values_read_back_whole_at_their_length(size, tmp_path):
    # From 128 KiB (DIRECT_MIN_BYTES) a value is written past the page cache in whole blocks and cut
    # to its length: the file holds the value's bytes and no padding, whatever the view's alignment.
    tier = DiskTier(tmp_path)
    buffer = np.random.default_rng(size).integers(0, 256, size + 99, dtype=np.uint8)
    values = [memoryview(buffer)[3:3 + size], bytes(buffer[:size]), memoryview(buffer)[99:]]
    expected = [bytes(v) for v in values]
    assert tier.put([(f"v{i}", v) for i, v in enumerate(values)]) == [True] * 3
    buffer[...] = 0  # the files hold the bytes as they were when put
    assert tier.get([f"v{i}" for i in range(3)]) == expected
    files = sorted(n for n in os.listdir(tmp_path) if n.endswith(".hkv"))
    assert [os.path.getsize(tmp_path / n) for n in files] == [size] * 3
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))
    stats = tier.stats()
    assert (stats.stored, stats.stored_bytes, stats.held_bytes, stats.errors) == (3, 3 * size, 3 * size, 0)


def test_disk_tier_large_value_under_a_file_size_limit_is_stored_when_its_bytes_fit(tmp_path):
    # A value whose length fits the limit but whose whole blocks do not is still stored (the write
    # through the page cache takes it); one past the limit is refused with one counted error.
    script = textwrap.dedent(f"""
        import os, resource, signal
        from hybridkv.tiers import DiskTier
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ((200 << 10) + 100, (200 << 10) + 100))
        tier = DiskTier({str(tmp_path)!r})
        print(tier.put([("fits", b"f" * ((200 << 10) + 100)), ("big", b"b" * ((200 << 10) + 101))]))
        s = tier.stats()
        print(s.refused, s.errors, "File too large" in s.last_error)
        print(tier.get(["fits"])[0] == b"f" * ((200 << 10) + 100), any(n.endswith(".tmp") for n in os.listdir({str(tmp_path)!r})))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["[True, False]", "1 1 True", "True False"]


def test_disk_tier_large_object_torn_or_corrupted_is_a_clean_counted_miss(tmp_path):
    c4 = "v4.c4a.compressed_kv"
    parts = layout_parts(FLASH, c4)
    rows = 64
    row_bytes = sum(size for _, _, size in parts)
    store = ObjectStore(DiskTier(tmp_path), FLASH)
    objects = [RowsObject(ObjectKey("block", c4, bytes([i]) * 16), 0, 256, 0, rows, parts,
                          np.random.default_rng(i).integers(0, 256, rows * row_bytes, dtype=np.uint8)) for i in range(3)]
    files = []
    for obj in objects:  # one at a time: each put adds its object's file
        before = set(os.listdir(tmp_path))
        assert store.put([obj]) == [True]
        (new,) = set(os.listdir(tmp_path)) - before
        files.append(os.path.join(tmp_path, new))
    got = store.get([o.key for o in objects])
    assert all(np.array_equal(g.payload, o.payload) for g, o in zip(got, objects))
    torn, flipped = files[:2]
    os.truncate(torn, os.path.getsize(torn) // 2)  # a write cut short
    raw = bytearray(open(flipped, "rb").read())
    raw[len(raw) // 2] ^= 0x01
    open(flipped, "wb").write(raw)
    got = store.get([o.key for o in objects])
    assert got[0] is None and got[1] is None and np.array_equal(got[2].payload, objects[2].payload)
    assert store.stats().corrupt == 2


# --- the stack --------------------------------------------------------------------

def test_stack_writes_through_keeps_lower_tiers_and_promotes_hits(tmp_path):
    host, disk = HostTier(20), DiskTier(tmp_path)
    stack = TierStack([host, disk])
    assert stack.put([("a", b"a" * 10), ("b", b"b" * 10), ("c", b"c" * 10)]) == [True] * 3
    assert host.contains(["a", "b", "c"]) == [False, True, True]  # the host dropped a...
    assert disk.contains(["a", "b", "c"]) == [True] * 3  # ...the disk kept it
    assert stack.get(["a", "x"]) == [b"a" * 10, None]
    assert host.contains(["a"]) == [True]  # promoted on the hit
    assert stack.contains(["a", "b", "c", "x"]) == [True, True, True, False]
    assert stack.put([("huge", b"h" * 30)]) == [True]  # the host refuses, the disk stores
    assert host.stats().refused == 1
    assert stack.delete(["a"]) == 1 and stack.contains(["a"]) == [False]
    assert set(stack.tier_stats()) == {"0:host", "1:disk"}


# --- objects through a tier -------------------------------------------------------

def test_store_round_trips_objects_and_turns_a_corrupted_one_into_a_counted_miss(tmp_path):
    disk = DiskTier(tmp_path)
    store = ObjectStore(disk, FLASH)
    objects = [c128_object(i) for i in range(3)]
    assert store.put(objects) == [True] * 3
    got = store.get([o.key for o in objects])
    assert all(np.array_equal(g.payload, o.payload) for g, o in zip(got, objects))
    name = os.path.join(tmp_path, sorted(n for n in os.listdir(tmp_path) if n.endswith(".hkv"))[0])
    raw = bytearray(open(name, "rb").read())
    raw[-1] ^= 0x10
    open(name, "wb").write(raw)
    got = store.get([o.key for o in objects])
    assert sum(g is None for g in got) == 1
    stats = store.stats()
    assert (stats.corrupt, stats.loaded, stats.missing) == (1, 5, 0)
    assert "checksum" in stats.last_error
    assert sum(store.contains([o.key for o in objects])) == 2  # the bad object was deleted
    assert sum(g is None for g in store.get([o.key for o in objects])) == 1
    assert store.stats().missing == 1


def test_store_refuses_another_layouts_object_under_its_name():
    host = HostTier(1 << 20)
    mine = ObjectStore(host, FLASH)
    theirs = ObjectStore(host, FLASH, model_id="other-weights")
    obj = c128_object(7)
    theirs.put([obj])
    # planted under this store's name (a forged or colliding name): refused, not loaded
    host.put([(mine.name(obj.key), host.get([theirs.name(obj.key)])[0])])
    assert mine.get([obj.key]) == [None]
    assert mine.stats().refused == 1 and "refused" in mine.stats().last_error
    assert mine.name(obj.key) != theirs.name(obj.key)


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_view_put_into_a_local_tier_is_kept_as_it_was_when_put(kind, tmp_path):
    tier = HostTier(1 << 20) if kind == "host" else DiskTier(tmp_path / "d")
    buffer = np.arange(64, dtype=np.uint8)
    assert tier.put([("a", memoryview(buffer)[8:40]), ("b", bytearray(b"xyz"))]) == [True, True]
    buffer[...] = 0  # later writes to the buffer do not reach the stored object
    assert tier.get(["a", "b"]) == [bytes(range(8, 40)), b"xyz"]
    assert tier.stats().stored_bytes == 35


@pytest.mark.parametrize("stacked", [False, True])
def test_a_large_view_put_into_the_host_tier_is_copied_and_read_back_whole(stacked, tmp_path):
    # views of 64 KiB and more are copied with numpy (off the GIL), smaller ones into bytes
    host = HostTier(1 << 22)
    tier = TierStack([host, DiskTier(tmp_path / "d")]) if stacked else host
    buffer = np.random.default_rng(3).integers(0, 256, (1 << 20) + 3, dtype=np.uint8)
    expected = {"big": buffer[5 : 5 + (1 << 20)].tobytes(), "edge": buffer[: 64 << 10].tobytes(),
                "small": buffer[7 : 7 + (64 << 10) - 1].tobytes()}
    views = {"big": memoryview(buffer)[5 : 5 + (1 << 20)], "edge": memoryview(buffer)[: 64 << 10],
             "small": memoryview(buffer)[7 : 7 + (64 << 10) - 1]}
    assert tier.put(list(views.items())) == [True] * 3
    buffer[...] = 0
    got = host.get(list(expected))
    assert [bytes(value) for value in got] == list(expected.values())
    assert all(len(value) == len(expected[name]) for name, value in zip(expected, got))
    with pytest.raises(TypeError):  # what the tier answers cannot be written through
        got[0][0] = 1
    assert host.stats().held_bytes == sum(len(v) for v in expected.values())
    if stacked:
        host.delete(list(expected))
        assert [bytes(value) for value in tier.get(list(expected))] == list(expected.values())


@pytest.mark.parametrize("stacked", [False, True])
def test_views_put_given_are_kept_without_a_copy_and_their_buffer_counted_once(stacked, tmp_path):
    host = HostTier(1 << 22)
    tier = TierStack([host, DiskTier(tmp_path / "d")]) if stacked else host
    buffer = np.random.default_rng(4).integers(0, 256, 3 << 16, dtype=np.uint8)
    views = [("a", memoryview(buffer)[: 1 << 16]), ("b", memoryview(buffer)[1 << 16 : 3 << 16])]
    expected = [bytes(view) for _, view in views]
    assert tier.put(views, given=True) == [True, True]
    got = host.get(["a", "b"])
    assert [bytes(value) for value in got] == expected
    assert all(np.shares_memory(np.frombuffer(value, dtype=np.uint8), buffer) for value in got)  # no copy
    with pytest.raises(TypeError):  # what the tier answers cannot be written through
        got[0][0] = 1
    assert host.stats().held_bytes == buffer.nbytes  # the buffer, once
    assert host.delete(["a"]) == 1 and host.stats().held_bytes == buffer.nbytes  # b still holds it
    assert host.delete(["b"]) == 1 and host.stats().held_bytes == 0
    if stacked:  # the disk tier below wrote its own copy
        assert [bytes(value) for value in tier.get(["a", "b"])] == expected


def test_host_tier_serves_gets_beside_a_thread_that_puts_and_evicts():
    """The offload worker puts (and so evicts) while the step thread gets: a get of a name the
    other thread evicts in between is a miss, never an error; the budget holds throughout."""
    import threading

    tier = HostTier(8 * 64)
    names = [f"o{i}" for i in range(64)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def putter():
        try:
            while not stop.is_set():
                for name in names:
                    tier.put([(name, bytes(64))])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=putter)
    thread.start()
    try:
        for _ in range(3000):
            got = tier.get(names)
            assert all(value is None or len(value) == 64 for value in got)
            assert tier.stats().held_bytes <= 8 * 64
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)
    assert not errors
