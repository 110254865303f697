"""Two processes on one DiskTier directory (hybridkv.tiers.disk): the directory is the truth.

Each process opens its own DiskTier on the same directory (multiprocessing, spawn). What one
writes the other reads at once, what one deletes the other misses at once, one byte budget
holds for both (the bytes in the directory never exceed it, and the held bytes every process
reports are the directory's), and a full disk refuses puts in both without a half-written
file. Values are worked from their names, so any wrong byte read is seen.
"""

import hashlib
import multiprocessing
import os
import random
import subprocess

import pytest

from hybridkv.tiers import DiskTier

BUDGET = 48 << 10
KIB = 1 << 10


def value_of(name: str, size: int) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def directory_bytes(root) -> tuple[int, int]:
    sizes = [os.path.getsize(os.path.join(root, n)) for n in os.listdir(root) if n.endswith(".hkv")]
    return sum(sizes), len(sizes)


def held(tier) -> tuple[int, int]:
    stats = tier.stats()
    return stats.held_bytes, stats.held


# --- what each process does (module level: spawn imports them) ---------------------------------------

def visibility(who, root, barrier, out):
    tier = DiskTier(root)
    names = [f"s/{i}" for i in range(4)]
    barrier.wait()  # both have opened the directory (and counted it) before anything is written
    if who == 0:
        out.put(("put", tier.put([(n, value_of(n, KIB)) for n in names])))
    barrier.wait()
    if who == 1:  # written after this tier opened the directory: seen at once
        out.put(("seen", tier.contains(names), tier.get(names) == [value_of(n, KIB) for n in names]))
        out.put(("deleted", tier.delete(names[:2])))
    barrier.wait()
    if who == 0:  # deleted by the other: gone here too, and not deleted twice
        out.put(("after", tier.contains(names), tier.get(names[1:2]), tier.delete(names[:1])))
    barrier.wait()
    out.put(("held", who, held(tier)))


def budget(who, root, barrier, out):
    """Puts of random sizes under one budget, reads of the other's names, deletes of some of its own."""
    tier = DiskTier(root, budget_bytes=BUDGET)
    rng = random.Random(who)
    barrier.wait()
    wrong = over = 0
    for i in range(60):
        name = f"b/{who}/{i}"
        size = rng.randrange(1, 6) * KIB
        tier.put([(name, value_of(name, size))])
        over += held(tier)[0] > BUDGET
        other = [f"b/{1 - who}/{j}" for j in range(max(0, i - 8), i)]
        for got, n in zip(tier.get(other), other):
            wrong += got is not None and got != value_of(n, len(got))
        if i % 7 == 3:
            tier.delete([f"b/{who}/{i - 2}"])
    barrier.wait()
    out.put(("budget", who, wrong, over, held(tier), tier.stats().evicted))


def full_disk(who, root, barrier, out, limit_fsize):
    """Both fill a small disk at once (a 1 MiB tmpfs, or a per-process file size limit)."""
    if limit_fsize:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (400 * KIB, 400 * KIB))
    tier = DiskTier(root)
    barrier.wait()
    sizes = [300 * KIB] * 4 if not limit_fsize else [300 * KIB, 500 * KIB, 200 * KIB]
    names = [f"f/{who}/{i}" for i in range(len(sizes))]
    stored = tier.put([(n, value_of(n, s)) for n, s in zip(names, sizes)])
    stats = tier.stats()
    barrier.wait()
    others = [f"f/{1 - who}/{i}" for i in range(len(sizes))]
    got = tier.get(others)
    readable = all(g is None or g == value_of(n, len(g)) for g, n in zip(got, others))
    out.put(("full", who, stored, stats.refused, stats.errors, stats.last_error, readable,
             [g is not None for g in got], held(tier)))


def run_two(target, root, *args):
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=target, args=(who, str(root), barrier, out, *args)) for who in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    messages = []
    while not out.empty():
        messages.append(out.get())
    return messages


# --- the tests ------------------------------------------------------------------------------------

def test_one_process_sees_what_another_wrote_and_deleted_at_once(tmp_path):
    messages = {m[0] if m[0] != "held" else ("held", m[1]): m for m in run_two(visibility, tmp_path)}
    assert messages["put"][1] == [True] * 4
    assert messages["seen"][1:] == ([True] * 4, True)
    assert messages["deleted"][1] == 2
    assert messages["after"][1:] == ([False, False, True, True], [None], 0)
    for who in (0, 1):  # both count the directory's 2 objects of 1 KiB, not what each wrote
        assert messages[("held", who)][2] == (2 * KIB, 2)
    assert directory_bytes(tmp_path) == (2 * KIB, 2)


def test_one_budget_holds_for_two_processes_writing_reading_and_deleting(tmp_path):
    results = sorted(m for m in run_two(budget, tmp_path))
    total, files = directory_bytes(tmp_path)
    assert total <= BUDGET
    for _, who, wrong, over, held_now, evicted in results:
        assert wrong == 0 and over == 0
        assert held_now == (total, files)  # each process's count is the directory's
        assert evicted > 0
    assert sum(r[5] for r in results) >= 2 * 60 * KIB / BUDGET  # the budget made them evict
    assert held(DiskTier(tmp_path)) == (total, files)  # a fresh tier counts the same


def _mount_tmpfs(path) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("disk", ["tmpfs", "file size limit"])
def test_a_full_disk_refuses_puts_in_both_processes_and_leaves_no_half_file(tmp_path, disk):
    root = tmp_path / "small"
    root.mkdir()
    if disk == "tmpfs" and not _mount_tmpfs(root):
        pytest.skip("cannot mount a tmpfs here (not root); the file size limit case covers the same path")
    try:
        results = sorted(run_two(full_disk, root, disk != "tmpfs"))
        total, files = directory_bytes(root)
        stored = [ok for r in results for ok in r[2]]
        if disk == "tmpfs":  # 8 puts of 300 KiB into 1 MiB: the first of each fit, at most three in all
            assert 2 <= stored.count(True) <= 3 and total == stored.count(True) * 300 * KIB
        else:  # each process's 500 KiB write passes its 400 KiB limit: refused, the rest stored
            assert [r[2] for r in results] == [[True, False, True]] * 2 and total == 2 * 500 * KIB
        for _, who, mine, refused, errors, last_error, readable, seen, held_now in results:
            assert refused == errors == mine.count(False) > 0
            assert ("No space left" if disk == "tmpfs" else "File too large") in last_error
            assert readable  # what the other stored reads back whole here
        assert results[0][7] == results[1][2] and results[1][7] == results[0][2]
        assert results[0][8] == results[1][8] == (total, files)
        assert not any(n.endswith(".tmp") for n in os.listdir(root))
    finally:
        if disk == "tmpfs":
            subprocess.run(["umount", str(root)], check=False)
