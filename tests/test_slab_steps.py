"""Steps on a shared arena that need slabs: the step's own admission of spare slabs
(``kernels.admit_spare``, in ``kernels.step_spare`` for a prefill chunk, then
``kernels.grant_step``) decides as the general admission.

The same program (requests join with prompts of a small vocabulary, so prefixes are
shared, prefill in chunks, decode, leave) runs twice: as the manager runs it, and with
``admit_spare`` answering -1 every time (``general_admission``, the reference: every step
that is not clean goes through ``CacheManager``'s general admission and its Python slab
grants, ``Arena.kernel_grants`` answering None: else both sides grant spare slabs alone in
``kernels.grant_step``, and a make-room answer of its that is wrong goes unseen). Every batch,
table update, error, event, pool count and slab owner must match after every call. Since both
admissions would move together, the slabs a run of prefill chunks takes are also pinned
(``test_prefill_chunks_take_the_pinned_slabs``), and so is a grant step's packing
(``test_a_step_granting_a_spare_slab_packs_below_a_prefill_chunks_long_lived_pages``).
"""

import contextlib
from unittest import mock

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from hybridkv.memory.arena import Arena, arena_geometry
from hybridkv.runtime import kernels
from hybridkv.runtime.manager import CacheManager, CacheManagerError
from test_arena_stateful import ANCHOR, PAGE_BYTES
from test_table_updates import CONFIGS


@contextlib.contextmanager
def general_admission():
    """``admit_spare`` answering -1, also inside ``step_spare`` (``step`` alone, then -1), while a manager is
    built (it takes the kernels then) and runs; and ``Arena.kernel_grants`` answering None, so ``_admit``'s spare
    slabs move in Python too (``Arena.apply``, then ``_after_run``'s ``room_groups`` from the plan's counts), not
    in ``kernels.grant_step``, whose make-room answer the step's own admission relies on."""
    with mock.patch.multiple(kernels, admit_spare=lambda *args: -1,
                             step_spare=lambda *args: (*kernels.step(*args[:24]), -1)):
        with mock.patch.object(Arena, "kernel_grants", lambda self, grants: None):
            yield


def build(config, caching, budget_share, slab_pages, slabs_ahead=None):
    specs, pages, ctx, step = CONFIGS[config]
    budget = int(budget_share * sum(n * PAGE_BYTES[config][g] for g, n in pages.items()) / 2)
    geometry = arena_geometry(PAGE_BYTES[config], budget, anchor_group=ANCHOR[config], slab_anchor_pages=slab_pages)
    m = CacheManager(specs, None, max_context_tokens=ctx, max_step_tokens=step, enable_prefix_caching=caching,
                     arena=geometry, prefix_granularity=256 if config == "v4" else 60)
    if slabs_ahead is not None:
        m.arena.slabs_ahead = slabs_ahead
    return m


def record(m, batch, error, updates):
    """What a call left: its error or its batch's arrays, then the pools' counts, the
    arena's slabs and the prefix cache's events."""
    if error is not None:
        out = [error]
    else:
        out = [batch.request_ids] + [getattr(batch, name).tolist() for name in (
            "num_scheduled_tokens", "query_start_loc", "positions", "request_indices", "table_rows")]
        for gid, group in batch.groups.items():
            out.append([gid] + [None if x is None else x.tolist() for x in (
                None if updates else group.block_table, group.base_pages, group.write_slots)])
        if updates:
            u = batch.table_updates
            out.append(sorted(zip(u.group.tolist(), u.row.tolist(), u.column.tolist(), u.page.tolist())))
    return out + [m.stats(), m.arena.report(), m.prefix.drain_events() if m.prefix is not None else None]


def serve(m, program, seed):
    """Run ``program`` (("join", prompt length), ("leave", pick), ("step", block-table updates)) on
    ``m``; one record per step."""
    ctx, step = m.max_context_tokens, m.max_step_tokens
    rng, live, joined, records = np.random.default_rng(seed), {}, 0, []
    for kind, arg in program:
        if kind == "join" and len(live) < 5:
            rid, joined = f"r{joined}", joined + 1
            prompt = rng.integers(0, 3, arg) if rng.random() < 0.5 else np.zeros(arg, dtype=np.int64)
            m.add_request(rid, prompt.astype(np.int32), max_new_tokens=ctx // 3)
            live[rid] = arg
        elif kind == "leave" and live:
            rid = sorted(live)[arg % len(live)]
            del live[rid]
            m.free(rid)
        elif kind == "step" and live:
            items = []
            for rid, prompt in live.items():
                done = m.num_computed_tokens(rid)
                if done < prompt:
                    items.append((rid, min(prompt - done, step // 2)))
                    continue
                known = m.known_token_ids(rid).size  # a refused step leaves its token appended
                if known == done and known < prompt + ctx // 3:
                    m.append_token_ids(rid, np.asarray([int(rng.integers(0, 3))]))
                    known += 1
                if known > done:
                    items.append((rid, 1))
            batch, error = None, None
            try:
                batch = m.schedule(items, block_tables="updates" if arg else "full")
            except CacheManagerError as exc:
                error = str(exc)
            records.append(record(m, batch, error, arg))
    m.check_invariants()
    return records


@settings(max_examples=60, deadline=None)
@given(config=st.sampled_from(sorted(CONFIGS)), caching=st.booleans(), slab_pages=st.sampled_from([1, 2, 3]),
       budget_share=st.sampled_from([1.0, 1.5, 3.0]), seed=st.integers(0, 999), slabs_ahead=st.sampled_from([0, 2]),
       data=st.data())
def test_steps_admitted_with_spare_slabs_match_the_general_admission(config, caching, slab_pages, budget_share, seed,
                                                                     slabs_ahead, data):
    """``slabs_ahead``: none, or two slabs ahead for a group given slabs (``Arena.slabs_ahead``; these arenas are
    below ``AHEAD_MIN_SLABS``, so 0 by default): both admissions take the same ones."""
    ctx = CONFIGS[config][2]
    op = st.one_of(st.tuples(st.just("join"), st.integers(1, ctx // 3)), st.tuples(st.just("leave"), st.integers(0, 4)),
                   st.tuples(st.just("step"), st.booleans()), st.tuples(st.just("step"), st.booleans()))
    program = data.draw(st.lists(op, min_size=20, max_size=150), label="program")
    fast = serve(build(config, caching, budget_share, slab_pages, slabs_ahead), program, seed)
    with general_admission():
        general = serve(build(config, caching, budget_share, slab_pages, slabs_ahead), program, seed)
    assert len(fast) == len(general)
    for k, (a, b) in enumerate(zip(fast, general)):
        assert a == b, k


def test_served_conversations_take_the_same_slabs_as_with_the_general_admission():
    """120 six-turn conversations served one request at a time on a 2 GiB shared arena
    (bench/hit_sweep.py's multiturn line: slabs granted while the arena fills, then
    evictions and packing): the same hits and per-group counts (evictions by reason,
    cached pages, slabs) with the step's own spare-slab admission as without it."""
    from bench_support import load_bench_script
    from hybridkv.sim.workloads import in_waves, multiturn_workload

    sweep = load_bench_script("hit_sweep.py", "hit_sweep_for_slabs")
    runs = []
    for admission in (contextlib.nullcontext(), general_admission()):
        with admission:
            side = sweep.make_side("hybridkv shared", 2 * 2**30, 131_072, None)
            hits = sweep.serve_in_order(side, in_waves(multiturn_workload(120, 6, seed=0), 40))
            runs.append((hits.tolist(), sweep.group_diagnostics(side)))
    assert runs[0] == runs[1]


# Each group's total pages (``stats()``, manager group order) after each 2,048-token chunk of two unique
# 32,768-token prompts, one after the other, as recorded on 25ae5cc: only v4.swa_kv (first) and
# v4.c4a.compressed_kv (third) grow once the third chunk has run.
PINNED_SWA_PAGES = [37, 65, 74, 92, 110, 129, 138, 157, 175, 194, 202, 221, 239, 258, 266, 286,
                    295, 322, 332, 350, 369, 378, 397, 415, 434, 442, 461, 479, 498, 506, 526, 544]
PINNED_FIRST_PAGES = [[37, 514, 16, 258, 446, 536], [65, 1029, 16, 516, 446, 1072]]  # the first two chunks'
PINNED_OTHER_PAGES = (1029, None, 539, 446, 1072)  # after: None is v4.c4a.compressed_kv, 16 more every second chunk


def test_prefill_chunks_take_the_pinned_slabs():
    """A prefill chunk's spare slabs are admitted on the state before its row's commits (docs/manager.md, "One
    step", stage 1: release credit less a checkpoint window's pages per grain the step's commits complete), then
    the commits run, then the step. Admitting after the commits counts exactly and grants fewer slabs (a
    prototype that did: v4.swa_kv 82 pages after the fourth chunk, not 92); the general-admission tests above
    cannot see that (both admissions move together), so the slabs V4-Flash's 40 GiB arena grants over 32 chunks
    are pinned here (bench/step_profile.py's prefill workload)."""
    from hybridkv.models.layout import cache_layout
    from hybridkv.plan import Limits, plan_for_budget

    plan = plan_for_budget(cache_layout("deepseek-v4-flash", indexer="fp8"), 40 * 2**30, Limits(32, 8192, 131_072))
    manager = CacheManager.from_plan(plan, page_space="shared", enable_prefix_caching=True)
    manager.arena.slabs_ahead = 0  # the slabs each chunk's admission grants, none ahead (pinned one at a time)
    rng, totals = np.random.default_rng(0), []
    for k in range(2):
        manager.add_request(f"p{k}", rng.integers(0, 100_000, 32_768, dtype=np.int32), max_new_tokens=1)
        for _ in range(16):
            manager.schedule([(f"p{k}", 2048)], block_tables="updates")
            totals.append([stats.total_pages for stats in manager.stats().values()])
        manager.free(f"p{k}")
    assert [pages[0] for pages in totals] == PINNED_SWA_PAGES
    assert [pages[2] for pages in totals] == [16 * (1 + k // 2) for k in range(32)]
    assert totals[:2] == PINNED_FIRST_PAGES
    for k, pages in enumerate(totals[2:], start=2):
        assert tuple(pages[1:]) == (PINNED_OTHER_PAGES[0], pages[2], *PINNED_OTHER_PAGES[2:]), k


def serve_turns(manager, running, turns):
    """bench/step_profile.py's serving workload on ``manager``: ``running`` requests (seeded 512-1,536-token prompts of
    unique tokens) prefilled in 8,192-token steps, then ``turns`` steps in which the oldest request leaves, a new one
    joins and the step decodes one token of each other request and prefills the new prompt whole. Each turn's
    (``stats()``, the prefix cache's events)."""
    rng, live, prompts, out = np.random.default_rng(0), [], {}, []

    def join(rid):
        prompt = rng.integers(0, 100_000, int(rng.integers(512, 1537)), dtype=np.int32)
        manager.add_request(rid, prompt, max_new_tokens=4096)
        live.append(rid)
        prompts[rid] = prompt.size

    def sample(rids):
        manager.append_token_ids_many(tuple(rids), rng.integers(0, 100_000, (len(rids), 1), dtype=np.int32))

    for k in range(running):
        join(f"r{k}")
    pending = list(live)
    while pending:
        items, budget = [], 8192
        for rid in pending:
            n = min(prompts[rid] - manager.num_computed_tokens(rid), budget)
            if n:
                items.append((rid, n))
                budget -= n
        manager.schedule(items, block_tables="updates")
        sample([rid for rid, _ in items if manager.num_computed_tokens(rid) == prompts[rid]])
        pending = [rid for rid in pending if manager.num_computed_tokens(rid) < prompts[rid]]
    manager.prefix.drain_events()
    for turn in range(turns):
        manager.free(live.pop(0))
        join(f"t{turn}")
        manager.schedule([(rid, 1) for rid in live[:-1]] + [(live[-1], prompts[live[-1]])], block_tables="updates")
        sample(live)
        out.append((manager.stats(), [(e.kind, e.group_id, e.tokens) for e in manager.prefix.drain_events()]))
    return out


def test_a_step_granting_a_spare_slab_packs_below_a_prefill_chunks_long_lived_pages():
    """``grant_step``'s make-room answer counts the prefill row's transient window pages from the plan's token counts.
    On V4-Flash's 40 GiB arena (bench/step_profile.py's serving workload, 16 running), the second turn's step grants
    the anchor group, v4.c4a.compressed_kv, a spare slab (16 pages) inside the kernel while a new 1,045-token prompt
    prefills whole. v4.swa_kv (64-token pages, 128-token window) allocates 18 pages: the prompt's 17, of which the next
    step releases 14 (those below (1,045 - 128 + 1) // 64), and one decode row's; so 4 are long-lived and take the
    lowest free ids, above two idle low-priority prompt checkpoints at 256 tokens (their swa pages left behind by the
    window): the group makes room (``highest`` 14) and packing evicts both (2 swa pages and 1 page in each
    c4a compressor-state group each). A draft that read the granted pages per group as the rows' token counts (a
    shadowed ``counts``) asked no group and evicted nothing, and every other test passed (the general admission
    granted spare slabs in ``grant_step`` too); the general admission with Python's grants decides as pinned here."""
    from hybridkv.models.layout import cache_layout
    from hybridkv.plan import Limits, plan_for_budget

    plan = plan_for_budget(cache_layout("deepseek-v4-flash", indexer="fp8"), 40 * 2**30, Limits(16, 8192, 131_072))
    runs = []
    for admission in (contextlib.nullcontext(), general_admission()):
        with admission:
            manager = CacheManager.from_plan(plan, page_space="shared", enable_prefix_caching=True)
            manager.arena.slabs_ahead = 0  # so the second turn's step is the one that needs a slab
            runs.append(serve_turns(manager, 16, 2))
            assert manager.num_computed_tokens("t1") == 1045
    (first, _), (second, events) = runs[0]
    assert second["v4.c4a.compressed_kv"].total_pages == first["v4.c4a.compressed_kv"].total_pages + 16
    evicted = {gid: s.evicted_pages - first[gid].evicted_pages for gid, s in second.items()}
    assert evicted == {"v4.swa_kv": 4, "v4.c4a.compressor_state": 2, "v4.c4a.compressed_kv": 0,
                       "v4.c128a.compressor_state": 0, "v4.c128a.compressed_kv": 0,
                       "v4.c4a.indexer_compressor_state": 2}, evicted
    removed = [(gid, tokens) for kind, gid, tokens in events if kind == "removed"]
    assert removed == 2 * [("v4.swa_kv", 256), ("v4.c4a.compressor_state", 256),
                           ("v4.c4a.indexer_compressor_state", 256)], removed
    assert runs[0] == runs[1]
