"""A serving run loads no compiled kernel after the manager is built.

A kernel loads (from numba's cache, or compiles) at its first call: milliseconds in
whichever step first needs it (a checkpoint superseded at a decode step's commit, a first
eviction, a first slab moved). ``CacheManager._load_kernels`` loads them when the manager
is built, with the argument types of their calls. Checked in a fresh process (the
dispatchers are the process's) on a filled cache: numba's ``signatures`` of every kernel of
``hybridkv.runtime.kernels`` and ``hybridkv.memory.lru`` after the build, then after a
run with prefix hits, commits, evictions, slab moves, frees and appended tokens.
"""

import os
import subprocess
import sys

import pytest

# Loaded at the first prefix hit (a call of no pages would still write the row's bounds, and
# the hit's spans are read-only arrays: another signature), at a serving run's start, not late.
FIRST_USE = {"hybridkv.memory.lru.borrow_row"}

_SERVE = """
import numpy as np
from hybridkv.memory import lru
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_budget
from hybridkv.runtime import kernels
from hybridkv.runtime.manager import CacheManager, CacheManagerError

def loaded():
    return {f"{mod.__name__}.{name}": len(f.signatures) for mod in (kernels, lru)
            for name, f in vars(mod).items() if hasattr(f, "signatures")}

plan = plan_for_budget(cache_layout("deepseek-v4-flash", indexer="fp8"), 3 * 2**29, Limits(8, 4096, 65536))
m = CacheManager.from_plan(plan, page_space="shared", enable_prefix_caching=True, prompt_checkpoints=True)
before = loaded()
rng = np.random.default_rng(0)
prefixes = [rng.integers(0, 1000, 1536).astype(np.int32) for _ in range(3)]
live = []
for step in range(600):
    while len(live) < 8:  # joiners share one of three prefixes
        rid = f"r{step}-{len(live)}"
        tail = rng.integers(0, 1000, int(rng.integers(200, 2000))).astype(np.int32)
        m.add_request(rid, np.concatenate([prefixes[len(live) % 3], tail]), max_new_tokens=600)
        live.append(rid)
    todo = [m.known_token_ids(rid).size - m.num_computed_tokens(rid) for rid in live]
    try:  # prefill chunks of 256 tokens, decode steps of one
        m.schedule([(rid, min(k, 256)) for rid, k in zip(live, todo)], block_tables="updates")
    except CacheManagerError:
        m.free(live.pop(0))
        continue
    done = tuple(rid for rid in live if m.known_token_ids(rid).size == m.num_computed_tokens(rid))
    if done:
        m.append_token_ids_many(done, rng.integers(0, 1000, (len(done), 1)).astype(np.int32))
    if step % 40 == 39:
        m.free(live.pop(int(rng.integers(len(live)))))
print(sum(s.evicted_pages for s in m.stats().values()), m.arena.slab_moves)
print(" ".join(sorted(name for name, n in loaded().items() if n != before[name])))
"""


def test_a_serving_run_loads_no_kernel_after_the_build():
    if os.environ.get("NUMBA_DISABLE_JIT") == "1":
        pytest.skip("kernels run as plain Python")
    # Twice: the first run fills numba's cache. Compiling a kernel (a cold cache) also compiles
    # the kernels it calls, each a dispatcher with a signature then; loading it from the cache
    # does not, so only a run on a filled cache says which kernels load late.
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _SERVE], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    counts, names = done.stdout.splitlines()
    evicted_pages, slab_moves = map(int, counts.split())
    assert evicted_pages > 0 and slab_moves > 0  # the run reached the late paths
    assert set(names.split()) - FIRST_USE == set()
