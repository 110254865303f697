"""The issue's faults on the load path (stream_load): a full host tier, a full disk, an object
of another layout's namespace. Each is a counted refusal or miss; the load writes exactly the
objects the tier still holds intact, and nothing raises. (A killed Mooncake master and a
corrupted object: tests/test_tiers_mooncake.py, tests/test_tiers_stream.py,
tests/test_verify_tier.py.)"""

import subprocess
import sys
import textwrap

import numpy as np

from hybridkv.models.layout import cache_layout
from hybridkv.tiers import GroupPages, HostTier, ObjectKey, ObjectStore, gather_objects, new_group_pools, stream_load

FLASH = cache_layout("deepseek-v4-flash")
C4, C128 = "v4.c4a.compressed_kv", "v4.c128a.compressed_kv"
BLOCKS = 6


def source(seed):
    rng = np.random.default_rng(seed)
    pools = new_group_pools(FLASH, {g.group_id: (BLOCKS + 2 if g.group_id in (C4, C128) else 1) for g in FLASH.groups})
    for gid in (C4, C128):
        for plane in pools[gid].planes:
            plane.pool[...] = rng.integers(0, 256, plane.pool.shape, dtype=np.uint8)
    views = {gid: GroupPages(0, rng.permutation(np.arange(1, BLOCKS + 2))[:BLOCKS]) for gid in (C4, C128)}
    return pools, views


def ranges_of(gid):
    return [(ObjectKey("block", gid, bytes([i + 1]) * 8), 256 * i, 256 * (i + 1)) for i in range(BLOCKS)]


def loaded_as_written(target, views, ranges, objects, written):
    """Written objects' rows equal the source's; the others' rows differ (the target's own)."""
    back = gather_objects(target, views, ranges)
    return all(np.array_equal(b.payload, o.payload) == w for b, o, w in zip(back, objects, written))


def test_a_full_host_tier_evicts_and_refuses_and_the_load_writes_what_it_holds():
    ranges = ranges_of(C4)
    pools, views = source(0)
    objects = gather_objects(pools, views, ranges)
    store = ObjectStore(HostTier(3 * 877_000), FLASH)  # room for three c4 blocks of 876,744 bytes
    assert store.put(objects) == [True] * BLOCKS  # each put fits after evicting the oldest
    assert store.tier.stats().evicted == 3
    big = ObjectStore(HostTier(500_000), FLASH)
    assert big.put(objects[:1]) == [False] and big.tier.stats().refused == 1  # larger than the budget
    target, _ = source(1)
    written = stream_load(store, ranges, target, views, batch_objects=4)
    assert written == [False] * 3 + [True] * 3
    assert loaded_as_written(target, views, ranges, objects, written)
    assert store.stats().missing == 3


def test_an_object_of_another_namespace_under_this_name_is_refused_and_not_written():
    ranges = ranges_of(C128)
    pools, views = source(2)
    objects = gather_objects(pools, views, ranges)
    host = HostTier(1 << 24)
    mine, theirs = ObjectStore(host, FLASH), ObjectStore(host, FLASH, model_id="other-weights")
    assert mine.put(objects[:3]) == [True] * 3 and theirs.put(objects[3:]) == [True] * 3
    for key, _, _ in ranges[3:]:  # their bytes planted under my names
        host.put([(mine.name(key), host.get([theirs.name(key)])[0])])
    target, _ = source(3)
    written = stream_load(mine, ranges, target, views)
    assert written == [True] * 3 + [False] * 3
    assert loaded_as_written(target, views, ranges, objects, written)
    assert mine.stats().refused == 3 and "namespace" in mine.stats().last_error


FULL_DISK = """
import os, resource, signal, sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_tiers_faults import BLOCKS, C4, C128, FLASH, loaded_as_written, ranges_of, source
from hybridkv.tiers import DiskTier, ObjectStore, gather_objects, stream_load
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
ranges = [r for pair in zip(ranges_of(C4), ranges_of(C128)) for r in pair]
pools, views = source(4)
objects = gather_objects(pools, views, ranges)
tier = DiskTier({root!r})
store = ObjectStore(tier, FLASH)
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, hard))  # a c128 block (23 kB) fits, a c4 (877 kB) not
print(store.put(objects))
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # the load may compile and cache kernels
s = tier.stats()
print(s.refused, s.errors, "File too large" in s.last_error, any(n.endswith(".tmp") for n in os.listdir({root!r})))
target, _ = source(5)
written = stream_load(store, ranges, target, views, batch_objects=5)
print(written, loaded_as_written(target, views, ranges, objects, written))
"""


def test_a_full_disk_refuses_the_objects_it_cannot_write_and_the_load_writes_the_rest(tmp_path):
    # RLIMIT_FSIZE makes writes past 256 KiB fail (EFBIG) as a full disk fails (ENOSPC), without root
    # (tests/test_tiers_local.py also fills a 1 MiB tmpfs where it may mount one).
    tests = str(__import__("pathlib").Path(__file__).parent)
    script = textwrap.dedent(FULL_DISK.format(tests=tests, root=str(tmp_path)))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    pattern = [False, True] * BLOCKS  # c4 refused, c128 stored
    assert lines[0] == str(pattern)
    assert lines[1] == f"{BLOCKS} {BLOCKS} True False"
    assert lines[2] == f"{pattern} True"
