"""The compiled step (``hybridkv.runtime``) against a plain-Python reference of the rules.

The reference keeps, per group, a dict of each row's pages by logical page, a
free list (its end is the top) and ref counts, and applies docs/manager.md's
rules one request and one page at a time. Random programs of steps (joins,
prefill chunks, decode, rows settling with zero tokens) must give the same
arrays, tables, free stacks and ref counts on both.
"""

import os
import subprocess
import sys

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from hybridkv.models.deepseek_v4 import build_v4_cache_specs
from hybridkv.runtime import kernels
from hybridkv.runtime.state import StepState, capacity_pages
from hybridkv.spec import CacheGroupSpec

V4 = build_v4_cache_specs({"sliding_window": 16}, layer_ratio=[0, 4, 128])
ODD = [
    CacheGroupSpec("s7", "sliding_window", rows_per_page=3, entry_stride_tokens=1, sliding_window_tokens=7),
    CacheGroupSpec("s6x2", "sliding_window", rows_per_page=2, entry_stride_tokens=2, sliding_window_tokens=6),
    CacheGroupSpec("f10", "full_history", rows_per_page=2, entry_stride_tokens=5),
]
CONFIGS = {"v4": (V4, 1500, 64), "odd": (ODD, 90, 12)}


class Reference:
    """One group at a time, one page at a time."""

    def __init__(self, specs, pages):
        self.specs = specs
        self.free = [list(range(pages - 1, 0, -1)) for _ in specs]  # end = top: page 1 first
        self.ref = [dict() for _ in specs]
        self.table = [dict() for _ in specs]  # row -> {logical page: page id}
        self.base = [dict() for _ in specs]
        self.hi = [dict() for _ in specs]
        self.computed = {}
        self.keyed = [set() for _ in specs]

    def step(self, rows, counts, settle):
        idle_keyed = []
        for g, spec in enumerate(self.specs):
            T, released = spec.page_tokens, []
            for row in rows:
                first, base, hi = self.computed.get(row, 0), self.base[g].get(row, 0), self.hi[g].get(row, 0)
                if spec.is_sliding:
                    new_base = max(base, min(max(first - spec.sliding_window_tokens + 1, 0) // T, hi))
                    for logical in range(base, new_base):
                        page = self.table[g][row].pop(logical)
                        self.ref[g][page] -= 1
                        if self.ref[g][page] == 0:
                            (idle_keyed.append((g, page)) if page in self.keyed[g] else released.append(page))
                    self.base[g][row] = new_base
            self.free[g].extend(reversed(released))  # the first released ends on top
        for g, spec in enumerate(self.specs):
            T = spec.page_tokens
            for row, n in zip(rows, counts):
                first, hi = self.computed.get(row, 0), self.hi[g].get(row, 0)
                for logical in range(hi, max(hi, -(-(first + n) // T))):
                    page = self.free[g].pop()
                    self.ref[g][page] = 1
                    self.table[g].setdefault(row, {})[logical] = page
                    self.hi[g][row] = logical + 1
        positions, indices, slots = [], [], [[] for _ in self.specs]
        for k, (row, n) in enumerate(zip(rows[settle:], counts[settle:])):
            for pos in range(self.computed.get(row, 0), self.computed.get(row, 0) + n):
                positions.append(pos)
                indices.append(k)
                for g, spec in enumerate(self.specs):
                    m, per = spec.entry_stride_tokens, spec.rows_per_page
                    if (pos + 1) % m:
                        slots[g].append(-1)
                    else:
                        page = self.table[g][row][pos // m // per]
                        slots[g].append(page * per + (pos // m) % per)
        for row, n in zip(rows, counts):
            self.computed[row] = self.computed.get(row, 0) + n
        bases = [[self.base[g].get(row, 0) for row in rows[settle:]] for g in range(len(self.specs))]
        return positions, indices, slots, bases, idle_keyed


def same_state(state, ref, rows_seen):
    for g, spec in enumerate(ref.specs):
        offset = int(state.geometry[g, kernels.ID_OFFSET])
        top = int(state.top[g])
        assert state.stack[offset : offset + top].tolist() == ref.free[g], spec.group_id
        cap = capacity_pages(spec, *CONFIG_LIMITS[spec.group_id])
        for row in rows_seen:
            base, hi = ref.base[g].get(row, 0), ref.hi[g].get(row, 0)
            assert state.bounds[:, g, row].tolist() == [base, hi]
            want = np.full(state.pages.shape[2], -1)
            for logical, page in ref.table[g].get(row, {}).items():
                want[logical % cap if spec.is_sliding else logical] = page
            assert state.pages[g, row].tolist() == want.tolist(), (spec.group_id, row)
        held = {page: n for page, n in ref.ref[g].items() if n}
        got = {p: int(state.ref[offset + p]) for p in np.flatnonzero(state.ref[offset : offset + state.num_pages[g]])}
        assert got == held, spec.group_id


CONFIG_LIMITS = {s.group_id: (ctx, step) for specs, ctx, step in CONFIGS.values() for s in specs}


@settings(max_examples=60, deadline=None)
@given(config=st.sampled_from(sorted(CONFIGS)), data=st.data())
def test_random_steps_match_the_reference(config, data):
    specs, ctx, step_limit = CONFIGS[config]
    pages = 4000
    state = StepState(specs, {s.group_id: pages for s in specs}, max_context_tokens=ctx,
                      max_step_tokens=step_limit, table_rows=4)
    ref = Reference(specs, pages)
    computed, rows_seen, last = {}, set(), []
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        live = sorted(data.draw(st.sets(st.integers(0, 9), min_size=1, max_size=6), label="rows"))
        counts = [data.draw(st.integers(1, min(step_limit, ctx - computed.get(r, 0))), label="n")
                  if computed.get(r, 0) < ctx else 0 for r in live]
        live = [r for r, n in zip(live, counts) if n]
        counts = [n for n in counts if n]
        if not live:
            continue
        settle = [r for r in last if r not in live]
        rows, all_counts = settle + live, [0] * len(settle) + counts
        state.ensure_rows(max(rows) + 1)
        out = state.step(np.asarray(rows, dtype=np.int64), np.asarray(all_counts, dtype=np.int64), len(settle))
        positions, indices, slots, bases, _ = ref.step(rows, all_counts, len(settle))
        assert out.positions.tolist() == positions
        assert out.request_indices.tolist() == indices
        assert out.query_start_loc.tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()
        assert out.write_slots.tolist() == slots
        assert out.base_pages.tolist() == bases
        rows_seen.update(rows)
        for r, n in zip(rows, all_counts):
            computed[r] = computed.get(r, 0) + n
        last = live
        same_state(state, ref, rows_seen)


def test_touched_cells_name_every_changed_cell():
    specs, ctx, step = CONFIGS["v4"]
    state = StepState(specs, {s.group_id: 500 for s in specs}, max_context_tokens=ctx, max_step_tokens=step,
                      table_rows=2)
    rows = np.array([0, 1], dtype=np.int64)
    for counts in ([40, 7], [1, 1], [30, 60], [1, 1]):
        before = state.pages.copy()
        out = state.step(rows, np.asarray(counts, dtype=np.int64))
        changed = np.flatnonzero(before.reshape(-1) != state.pages.reshape(-1))
        assert set(changed.tolist()) <= set(out.touched_cells.tolist())
        assert out.touched_cells.size == len(set(out.touched_cells.tolist()))  # one move a cell a step here


def test_keyed_pages_go_to_the_caller_not_the_free_stack():
    spec = CacheGroupSpec("s", "sliding_window", rows_per_page=2, entry_stride_tokens=1, sliding_window_tokens=2)
    state = StepState([spec], {"s": 10}, max_context_tokens=64, max_step_tokens=8, table_rows=1)
    row, one = np.array([0], dtype=np.int64), np.array([1], dtype=np.int64)
    state.step(row, np.array([6], dtype=np.int64))  # pages 1, 2, 3 for tokens 0..5
    assert state.pages[0, 0, :4].tolist() == [1, 2, 3, -1]
    state.keyed[1] = True  # page 1 carries a content key
    out = state.step(row, one)  # first 6: floor (6 - 1) // 2 = 2, pages 1 and 2 go
    assert out.idle_keyed_pages.tolist() == [1]
    # The unkeyed one went on top of the stack and token 6 (logical page 3) took it.
    assert state.bounds[:, 0, 0].tolist() == [2, 4]
    assert state.pages[0, 0, :4].tolist() == [-1, -1, 3, 2]
    assert state.stack[state.top[0] - 1] == 4


def test_a_short_stack_asks_the_caller_for_room_after_the_releases():
    spec = CacheGroupSpec("f", "full_history", rows_per_page=1, entry_stride_tokens=1)
    state = StepState([spec], {"f": 6}, max_context_tokens=64, max_step_tokens=8, table_rows=1)
    row = np.array([0], dtype=np.int64)
    state.step(row, np.array([3], dtype=np.int64))  # pages 1, 2, 3; the stack keeps 5, 4 (4 on top)
    state.top[0] = 0  # as if 4 and 5 were cached pages in the prefix cache's LRU
    with pytest.raises(RuntimeError, match="short by \\[2\\]"):
        state.step(row, np.array([2], dtype=np.int64))
    asked = []

    def room(short):
        asked.append(short.tolist())
        state.top[0] = 2  # as an eviction would: the pages go back on the stack

    out = state.step(row, np.array([2], dtype=np.int64), make_room=room)
    assert asked == [[2]]
    assert state.pages[0, 0, :5].tolist() == [1, 2, 3, 4, 5]
    assert out.write_slots.tolist() == [[4, 5]]


def test_the_same_kernels_run_as_plain_python():
    code = (
        "import numpy as np\n"
        "from hybridkv.runtime import kernels\n"
        "from hybridkv.runtime.state import StepState\n"
        "from hybridkv.models.deepseek_v4 import build_v4_cache_specs\n"
        "assert not hasattr(kernels.run_step, 'py_func')\n"
        "specs = build_v4_cache_specs({'sliding_window': 16}, layer_ratio=[0, 4, 128])\n"
        "s = StepState(specs, {x.group_id: 400 for x in specs}, max_context_tokens=1500, max_step_tokens=64)\n"
        "rows = np.array([0, 1], dtype=np.int64)\n"
        "s.step(rows, np.array([50, 20], dtype=np.int64))\n"
        "print(s.step(rows, np.array([1, 1], dtype=np.int64)).write_slots.tolist())\n"
    )
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    specs = V4
    s = StepState(specs, {x.group_id: 400 for x in specs}, max_context_tokens=1500, max_step_tokens=64)
    rows = np.array([0, 1], dtype=np.int64)
    s.step(rows, np.array([50, 20], dtype=np.int64))
    assert plain.stdout.strip() == str(s.step(rows, np.array([1, 1], dtype=np.int64)).write_slots.tolist())


_PAGE_SPACES = {
    "per-group": "{s.group_id: 300 for s in specs}, shuffle_seed=1,",
    # A shared arena: prefill chunks' transient pages take the highest ids (kernels.transient_ranks).
    "shared": "None, arena=arena_geometry({s.group_id: 512 for s in specs}, 512 * 1200, "
              "anchor_group=anchor_group_for(specs, {s.group_id: 512 for s in specs}), slab_anchor_pages=4),",
}


@pytest.mark.parametrize("space", sorted(_PAGE_SPACES))
def test_the_manager_gives_the_same_steps_without_the_jit(space):
    """A short program (prefill chunks, decode, a rewind, a free, prefix hits) through
    the manager: the batches' arrays are the same compiled and as plain Python."""
    code = (
        "import numpy as np\n"
        "from hybridkv.arena import anchor_group_for, arena_geometry\n"
        "from hybridkv.manager import CacheManager\n"
        "from hybridkv.models.deepseek_v4 import build_v4_cache_specs\n"
        "specs = build_v4_cache_specs({'sliding_window': 16}, layer_ratio=[0, 4, 128])\n"
        f"m = CacheManager(specs, {_PAGE_SPACES[space]} max_context_tokens=1500, max_step_tokens=64,\n"
        "                 enable_prefix_caching=True, prefix_granularity=256)\n"
        "out = []\n"
        "for rid in ('a', 'b'):\n"
        "    m.add_request(rid, np.arange(300, dtype=np.int32) % 50, max_new_tokens=40)\n"
        "    while m.num_computed_tokens(rid) < 300:\n"
        "        b = m.schedule([(rid, min(64, 300 - m.num_computed_tokens(rid)))])\n"
        "        out.append([g.write_slots.tolist() for g in b.groups.values()])\n"
        "for i in range(30):\n"
        "    m.append_token_ids_many(['a', 'b'], np.full((2, 1), i))\n"
        "    b = m.schedule_uniform(['a', 'b'], 1, block_tables='updates' if i % 2 else 'full')\n"
        "    out.append([b.positions.tolist()] + [g.write_slots.tolist() for g in b.groups.values()])\n"
        "    if i == 10:\n"
        "        m.rewind('b', m.num_computed_tokens('b') - 1)\n"
        "m.free('a')\n"
        "hit = m.add_request('c', np.arange(300, dtype=np.int32) % 50).hit_tokens\n"
        "out.append({g: s.free_pages for g, s in m.stats().items()})\n"
        "m.check_invariants()\n"
        "print(out)\n"
        "print('hit', hit)\n"
    )
    runs = []
    for jit_off in ("0", "1"):
        env = dict(os.environ, NUMBA_DISABLE_JIT=jit_off)
        runs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True).stdout)
    assert runs[0] == runs[1] and runs[0].endswith("hit 256\n")


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(1, 500), max_size=60), st.data())
def test_merge_free_keeps_the_stack_descending_with_the_run_merged_in(ids, data):
    ids = sorted(ids)
    in_run = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    run = np.array([p for p, r in zip(ids, in_run) if r], dtype=np.int32)
    held = [p for p, r in zip(ids, in_run) if not r]
    stack = np.full(len(ids) + 3, -7, dtype=np.int32)
    stack[: len(held)] = held[::-1]
    top = kernels.merge_free(stack, len(held), run)
    assert top == len(ids)
    assert stack[:top].tolist() == ids[::-1]
    assert stack[top:].tolist() == [-7, -7, -7]  # nothing written past the new top


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(1, 300), min_size=1, max_size=40), st.data())
def test_take_lowest_takes_the_lowest_of_stack_and_pending(ids, data):
    ids = sorted(ids)
    in_pending = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    pending = np.array([p for p, r in zip(ids, in_pending) if r], dtype=np.int32)
    held = [p for p, r in zip(ids, in_pending) if not r]
    stack = np.zeros(len(ids) + 2, dtype=np.int32)
    stack[: len(held)] = held[::-1]
    low = data.draw(st.integers(0, len(ids)))
    taken, top, rest = kernels.take_lowest(stack, len(held), pending, low)
    assert taken.tolist() == ids[:low]
    left = stack[:top].tolist()
    assert left == sorted(left, reverse=True)  # still a descending stack
    assert sorted(left + rest.tolist()) == ids[low:]  # nothing lost, nothing twice
