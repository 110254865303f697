"""The compiled step (``hybridkv.runtime``) against a plain-Python reference of the rules.

The reference keeps, per group, a dict of each row's pages by logical page, a
free list (its end is the top) and ref counts, and applies docs/manager.md's
rules one request and one page at a time. Random programs of steps (prefill
chunks, decode, rows settling with zero tokens) through the manager's public
API must give the same arrays, tables and free counts on both; the same
programs run as plain Python (``NUMBA_DISABLE_JIT=1``) give the same batches.
"""

import os
import pickle
import subprocess
import sys

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from hybridkv.runtime.manager import CacheManager
from hybridkv.models.deepseek_v4 import build_v4_cache_specs
from hybridkv.memory.arena import anchor_group_for, arena_geometry
from hybridkv.runtime import kernels
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


def same_state(manager, ref, rows_seen):
    for g, spec in enumerate(ref.specs):
        assert manager.stats()[spec.group_id].free_pages == len(ref.free[g]), spec.group_id
        for row in rows_seen:
            base, hi = ref.base[g].get(row, 0), ref.hi[g].get(row, 0)
            got_base, got = manager.request_pages(f"r{row}", spec.group_id)
            assert (got_base, got.tolist()) == (base, [ref.table[g][row][L] for L in range(base, hi)])
    manager.check_invariants()


@settings(max_examples=60, deadline=None)
@given(config=st.sampled_from(sorted(CONFIGS)), data=st.data())
def test_random_steps_match_the_reference(config, data):
    """The manager's compiled step, driven through its public API (requests ``r0`` ..
    ``r9`` on table rows 0 .. 9; a request of the previous step left out settles)."""
    specs, ctx, step_limit = CONFIGS[config]
    pages = 4000
    manager = CacheManager(specs, {s.group_id: pages for s in specs}, max_context_tokens=ctx,
                           max_step_tokens=step_limit)
    for row in range(10):
        manager.add_request(f"r{row}", prompt_tokens=ctx)
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
        batch = manager.schedule([(f"r{r}", n) for r, n in zip(live, counts)])
        positions, indices, slots, bases, _ = ref.step(rows, all_counts, len(settle))
        assert batch.positions.tolist() == positions
        assert batch.request_indices.tolist() == indices
        assert batch.query_start_loc.tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()
        assert batch.table_rows.tolist() == live
        for g, spec in enumerate(specs):
            step = batch.groups[spec.group_id]
            assert step.write_slots.tolist() == slots[g]
            assert (step.base_pages.tolist() if spec.is_sliding else bases[g]) == bases[g]
        rows_seen.update(rows)
        for r, n in zip(rows, all_counts):
            computed[r] = computed.get(r, 0) + n
        last = live
        same_state(manager, ref, rows_seen)


_PAGE_SPACES = {
    "per-group": "{s.group_id: 300 for s in specs}, shuffle_seed=1,",
    # A shared arena: prefill chunks' transient pages take the highest ids (kernels.transient_pages).
    "shared": "None, arena=arena_geometry({s.group_id: 512 for s in specs}, 512 * 1200, "
              "anchor_group=anchor_group_for(specs, {s.group_id: 512 for s in specs}), slab_anchor_pages=4),",
    # Shuffled arena pools are LIFO: a chunk's transient pages take the ids popped after its survivors'.
    "shared-shuffled": "None, arena=arena_geometry({s.group_id: 512 for s in specs}, 512 * 1200, "
                       "anchor_group=anchor_group_for(specs, {s.group_id: 512 for s in specs}), "
                       "slab_anchor_pages=4), shuffle_seed=3,",
}


@pytest.mark.parametrize("space", sorted(_PAGE_SPACES))
def test_the_manager_gives_the_same_steps_without_the_jit(space):
    """A short program (prefill chunks, decode, rewinds, a free, prefix hits) through
    the manager: the batches' arrays are the same compiled and as plain Python."""
    code = (
        "import numpy as np\n"
        "from hybridkv.memory.arena import anchor_group_for, arena_geometry\n"
        "from hybridkv.runtime.manager import CacheManager\n"
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
        "m.append_token_ids_many(['a', 'b'], np.full((2, 8), 7))\n"
        "m.schedule_uniform(['a', 'b'], 8)\n"
        "m.rewind_many([('a', m.num_computed_tokens('a') - 8), ('b', m.num_computed_tokens('b') - 5)])\n"
        "out.append({g: (s.free_pages, m.request_pages('b', g)[1].tolist()) for g, s in m.stats().items()})\n"
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




@settings(max_examples=40, deadline=None)
@given(st.integers(0, 600), st.integers(0, 300), st.integers(0, 2**32 - 1))
def test_merge_free_moves_long_blocks_as_one_by_one(n_held, n_run, seed):
    """Long runs of stack ids below a freed id (moved as blocks, by long and short
    shifts) end where the one-by-one merge puts them: every id, descending."""
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(5000, n_held + n_run, replace=False))
    in_run = np.zeros(ids.size, dtype=bool)
    if rng.random() < 0.5:
        in_run[rng.choice(ids.size, n_run, replace=False)] = True  # freed ids among the held ones
    else:
        in_run[ids.size - n_run :] = True  # all above: every held id one block below them
    run = ids[in_run].astype(np.int32)
    held = ids[~in_run][::-1].astype(np.int32)
    stack = np.full(ids.size + 3, -7, dtype=np.int32)
    stack[: held.size] = held
    top = kernels.merge_free(stack, held.size, run)
    assert top == ids.size
    assert stack[:top].tolist() == ids[::-1].tolist()
    assert stack[top:].tolist() == [-7, -7, -7]

@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(1, 300), max_size=50), st.data())
def test_push_run_merges_ascending_and_unordered_runs_alike(ids, data):
    """A ``lowest`` stack gets the same sorted merge whether the freed run comes ascending
    (merged as is) or in any other order (sorted first)."""
    ids = sorted(ids)
    in_run = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    freed = [p for p, r in zip(ids, in_run) if r]
    held = [p for p, r in zip(ids, in_run) if not r]
    for run in (freed, data.draw(st.permutations(freed))):
        stack = np.full(len(ids) + 2, -7, dtype=np.int32)
        stack[: len(held)] = held[::-1]
        top = kernels.push_run(stack, len(held), True, np.array(run, dtype=np.int32))
        assert stack[:top].tolist() == ids[::-1]
        assert stack[top:].tolist() == [-7, -7]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 20), max_size=40), st.integers(0, 2**16), st.booleans())
def test_drop_released_takes_pages_as_the_two_pass_rule(listed, seed, in_place):
    """``drop_released`` (one pass while the pages listed are held once, two from the first held more often) against
    the plain rule: every listing drops a reference, then each page whose last went is taken at its first listing,
    unkeyed ones to ``freed`` in order (the list itself, as ``release_pages`` passes it, or another array after
    earlier pages), keyed ones to the idle list; counts end at 0."""
    rng = np.random.default_rng(seed)
    offset, n_pages = 3, 24
    holders = np.bincount(np.array(listed, dtype=np.int64), minlength=n_pages)
    ref = np.zeros(offset + n_pages, dtype=np.int32)
    ref[offset:] = holders + (rng.random(n_pages) < 0.3) * rng.integers(0, 3, n_pages)  # some held elsewhere too
    keyed = np.zeros(offset + n_pages, dtype=np.bool_)
    keyed[offset:] = rng.random(n_pages) < 0.3
    want_ref = ref.copy()
    for page in listed:
        want_ref[offset + page] -= 1
    taken = [p for i, p in enumerate(listed) if want_ref[offset + p] == 0 and p not in listed[:i]]
    pages, idle = np.array(listed, dtype=np.int64), np.full(8 + len(listed), -1, dtype=np.int64)
    freed, n_from = (pages, 0) if in_place else (np.full(2 + len(listed), -1, dtype=np.int64), 2)
    n_free, n_keyed = kernels.drop_released(ref, keyed, offset, pages, freed, n_from, idle, 8)
    assert freed[n_from:n_free].tolist() == [p for p in taken if not keyed[offset + p]]
    assert idle[8:n_keyed].tolist() == [p for p in taken if keyed[offset + p]]
    assert ref.tolist() == want_ref.tolist()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 40), st.integers(1, 8), st.lists(st.integers(0, 30), min_size=2, max_size=2))
def test_plan_views_tile_their_buffer_without_overlap(cap, n_groups, room):
    plan = np.full(kernels.plan_size(cap, n_groups, *room), -1, dtype=np.int64)
    plan[:3] = (cap, *room)
    views = kernels.plan_views(plan, n_groups)
    shapes = [(cap,), (cap,), (cap,), (2, n_groups, cap), (n_groups, cap), (2, n_groups), (cap,), (4,),
              (2, n_groups), (n_groups,), (room[0],), (room[1],)]
    # rows, counts, first, after, need, sums, crossing, totals, released, widths, scratch, idle keyed
    assert [v.shape for v in views] == shapes
    plan[:3] = -1  # the header: the room each view has
    for k, view in enumerate(views):
        assert np.shares_memory(view, plan) or view.size == 0
        view[...] = k  # every element past the header is written by exactly one view
    assert sorted(np.bincount(plan[3:], minlength=len(views)).tolist()) == sorted(v.size for v in views)
    assert (plan[3:] >= 0).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sets(st.integers(1, 200), max_size=12), st.lists(st.integers(1, 200), max_size=8,
                                                                              unique=True), st.booleans()),
                min_size=1, max_size=4))
def test_push_free_pushes_each_group_as_its_pool_would(groups):
    """Per group: the free ids on its stack, the freed ones (logical order) and whether it
    keeps its stack sorted. Reference: a sorted group's stack is every id, descending; any
    other's is its old stack with the freed ids pushed in reverse (the first listed on top)."""
    groups = [(sorted(free), [p for p in freed if p not in free], lowest) for free, freed, lowest in groups]
    size = 40
    stack = np.full(size * len(groups), -7, dtype=np.int32)
    top = np.array([len(free) for free, _, _ in groups], dtype=np.int64)
    offsets = np.arange(len(groups), dtype=np.int64) * size
    for g, (free, _, lowest) in enumerate(groups):
        stack[g * size : g * size + len(free)] = free[::-1] if lowest else free
    freed = np.array([p for _, f, _ in groups for p in f], dtype=np.int64)
    per_group = np.array([len(f) for _, f, _ in groups], dtype=np.int64)
    kernels.push_free(stack, top, offsets, np.array([lw for _, _, lw in groups]), per_group, freed)
    for g, (free, more, lowest) in enumerate(groups):
        want = sorted(free + more)[::-1] if lowest else free + more[::-1]
        assert top[g] == len(want)
        assert stack[g * size : g * size + top[g]].tolist() == want
        assert set(stack[g * size + top[g] : (g + 1) * size].tolist()) <= {-7}


def _spare_slabs_reference(owner, group, inner, straddle, short):
    """Arena.plan's spare-slab rule one slab at a time, with Python lists."""
    owner, taken = list(owner), []
    while short > 0:
        spare = [s for s, o in enumerate(owner) if o < 0]
        if not spare:
            break
        near = [s for s in spare if (s > 0 and owner[s - 1] == group) or (s + 1 < len(owner) and owner[s + 1] == group)]
        slab = (near or spare)[0]
        edges = sum(1 for b, n in ((slab, slab - 1), (slab + 1, slab + 1))
                    if 0 <= n < len(owner) and n != slab and owner[n] == group and straddle[b] >= 0)
        short -= inner[slab] + edges
        owner[slab] = group
        taken.append(slab)
    return owner, taken, short


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(-1, 2), min_size=1, max_size=20), st.integers(0, 2), st.integers(0, 60), st.data())
def test_take_spare_slabs_matches_the_one_slab_at_a_time_rule(owner, group, short, data):
    n = len(owner)
    inner = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    straddle = [-1] + data.draw(st.lists(st.sampled_from([-1, 9]), min_size=n - 1, max_size=n - 1))
    want_owner, want_taken, want_short = _spare_slabs_reference(owner, group, inner, straddle, short)
    own = np.array(owner, dtype=np.int16)
    taken = np.empty(n, dtype=np.int64)
    n_taken, left = kernels.take_spare_slabs(own, group, np.array(inner, dtype=np.int64),
                                             np.array(straddle, dtype=np.int64), short, taken)
    assert (taken[:n_taken].tolist(), left, own.tolist()) == (want_taken, want_short, want_owner)
    # Told where the spare tail starts (past the last slab owned), the search stops there: the same takes.
    own, end = np.array(owner, dtype=np.int16), max([s + 1 for s, o in enumerate(owner) if o >= 0], default=0)
    n_taken, left = kernels.take_spare_slabs(own, group, np.array(inner, dtype=np.int64),
                                             np.array(straddle, dtype=np.int64), short, taken, end)
    assert (taken[:n_taken].tolist(), left, own.tolist()) == (want_taken, want_short, want_owner)


def test_take_spare_slabs_told_the_spare_tail_goes_on_past_it():
    """Slabs taken past ``end`` join the group's: the next take is their spare neighbour, not a lower spare."""
    ones, none = np.ones(5, dtype=np.int64), np.full(5, -1, dtype=np.int64)
    answers = []
    for end in (-1, 3):
        own, taken = np.array([-1, 1, 0, -1, -1], dtype=np.int16), np.empty(5, dtype=np.int64)
        n_taken, left = kernels.take_spare_slabs(own, 0, ones, none, 2, taken, end)
        answers.append((taken[:n_taken].tolist(), left, own.tolist()))
    assert answers == [([3, 4], 0, [-1, 1, 0, 0, 0])] * 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20), st.integers(0, 20), st.integers(0, 60),
                          st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=5), st.booleans())
def test_note_peaks_raises_each_allocating_groups_peak_to_its_used_pages(groups, joined):
    """Per group (granted, top, LRU length, peak, pages allocated, keyed pages gone idle
    that join the LRU next): where it allocated, its peak becomes the larger of the old
    one and granted - top - LRU - not joined (not joined: 0 when none are passed); the
    other groups and rows stay."""
    per_group = np.zeros((kernels.PER_GROUP_ROWS, len(groups)), dtype=np.int64)
    for g, (granted, top, lru, peak, _, _) in enumerate(groups):
        per_group[[kernels.GRANTED_PAGES, kernels.TOP, kernels.LRU_PAGES, kernels.PEAK_USED_PAGES], g] = (
            granted, top, lru, peak)
    allocated = np.array([a for *_, a, _ in groups], dtype=np.int64)
    not_joined = np.array([k for *_, k in groups], dtype=np.int64) if joined else allocated[:0]
    before = per_group.copy()
    kernels.note_peaks(per_group, allocated, not_joined)
    for g, (granted, top, lru, peak, a, k) in enumerate(groups):
        used = granted - top - lru - (k if joined else 0)
        assert per_group[kernels.PEAK_USED_PAGES, g] == (max(peak, used) if a else peak)
    per_group[kernels.PEAK_USED_PAGES] = before[kernels.PEAK_USED_PAGES]
    assert np.array_equal(per_group, before)


def test_a_kernels_entry_point_answers_as_the_kernel_for_the_same_argument_types():
    """``kernels.entry_point``: the compiled code for the argument types given runs as the
    dispatcher does (``slab_gain`` on random owners); a plain function (no JIT) is its own."""
    rng = np.random.default_rng(0)
    owner = rng.integers(-1, 3, 40).astype(np.int16)
    inner, straddle = rng.integers(1, 9, 40), rng.integers(-1, 50, 40)
    args = (owner, 1, inner, straddle, 0)
    run = kernels.entry_point(kernels.slab_gain, args)
    for s in range(40):
        assert run(owner, 1, inner, straddle, s) == kernels.slab_gain(owner, 1, inner, straddle, s)

    def plain(*args):
        return len(args)

    assert kernels.entry_point(plain, args) is plain


def _array_returns(entries):
    """Kernels reached from ``entries`` (by name, through the module's globals; not past one that sets ``_nrt=True``)
    that return an array, as compiled so far (one inlined, ``inline="always"``, is part of its caller)."""
    seen, todo, found = set(), list(entries), set()
    while todo:
        name = todo.pop()
        f = getattr(kernels, name, None)
        if name in seen or not hasattr(f, "py_func") or f.targetoptions.get("_nrt") is True:
            continue
        seen.add(name)
        todo += f.py_func.__code__.co_names
        returns = (str(c.signature.return_type) for c in f.overloads.values())
        if f.targetoptions.get("inline") != "always" and any("array(" in r for r in returns):
            found.add(name)
    return found


def test_the_step_kernels_compile_first_on_an_empty_cache(tmp_path):
    """``step_spare``, ``step`` and ``grant_step`` run without reference counting, and so do the kernels they call
    unless compiled first elsewhere. In a fresh process on an empty cache they compile before any other kernel, for
    the argument types a manager on an arena calls them with (no kernel they reach allocates unless it sets
    ``_nrt=True``), and no kernel they reach returns an array (a view not counted, to a counting caller, would be
    freed early); the check finds a copy's."""
    if os.environ.get("NUMBA_DISABLE_JIT") == "1":
        pytest.skip("kernels run as plain Python")
    pages = {s.group_id: 512 for s in V4}
    arena = arena_geometry(pages, 512 * 1200, anchor_group=anchor_group_for(V4, pages), slab_anchor_pages=4)
    CacheManager(V4, None, arena=arena, max_context_tokens=1500, max_step_tokens=64,
                 enable_prefix_caching=True)  # its build compiles or loads every step kernel here
    sigs = [(name, sig) for name in ("step_spare", "step", "grant_step") for sig in getattr(kernels, name).signatures]
    code = ("import pickle, sys\nimport numpy as np\nfrom numba import njit\nsys.path.insert(0, sys.argv[1])\n"
            "from hybridkv.runtime import kernels\nfrom test_kernels import _array_returns\n"
            "for name, sig in pickle.load(sys.stdin.buffer):\n    getattr(kernels, name).compile(sig)\n"
            "def copy_of(a):\n    return a.copy()\n"
            "kernels.copy_of = njit(copy_of)\nkernels.copy_of(np.zeros(1, np.int64))\n"
            "print(sorted(_array_returns(['step_spare', 'grant_step'])), sorted(_array_returns(['copy_of'])))\n")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], input=pickle.dumps(sigs), env=env,
                          capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == ["[]", "['copy_of']"]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 9), st.integers(1, 300), st.integers(0, 320), st.integers(0, 320), st.integers(1, 12),
       st.sampled_from([0.0, 0.02, 0.3, 1.0]), st.integers(0, 2**16))
def test_low_idle_ids_lists_what_a_page_by_page_scan_finds(offset, size, start, bound, most, density, seed):
    """``kernels.low_idle_ids`` (and its plain-Python form: ``NUMBA_DISABLE_JIT``), which skips
    8 flags a word where none is set, over a pool's view at any offset of a page space's flags,
    against the flags read page by page: the first ``most`` idle low-priority ids in ``[start, bound)``."""
    rng = np.random.default_rng(seed)
    low_all = rng.random(offset + size) < density
    keyed_all = low_all | (rng.random(offset + size) < 0.5)
    keyed_all &= rng.random(offset + size) < 0.9
    ref_all = (rng.random(offset + size) < 0.2).astype(np.int32)
    low, keyed, ref = low_all[offset:], keyed_all[offset:], ref_all[offset:]
    start, bound = min(start, size), min(bound, size)
    want = [p for p in range(start, bound) if low[p] and keyed[p] and ref[p] == 0][:most]
    for scan in (kernels.low_idle_ids, getattr(kernels.low_idle_ids, "py_func", kernels.low_idle_ids)):
        out = np.full(most, -1, dtype=np.int64)
        n = scan(low, keyed, ref, start, bound, out)
        assert out[:n].tolist() == want
