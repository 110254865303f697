"""Incremental block tables: a mirror fed ``block_tables="updates"`` batches yields the full-mode tables.

Two managers get the same calls: ``full`` always schedules in full mode (the
oracle); ``inc`` schedules mostly in updates mode (sometimes full, whose changes
the next updates batch must carry) and a ``BlockTableMirror`` applies its
batches. Random programs mix new requests (prefix hits when caching is on),
prefill chunks, decode, speculative verify with ``rewind_many``, free, denied
steps and cache clears.
"""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import event, given, settings

from hybridkv.runtime.manager import CacheManager, CacheManagerError
from hybridkv.tables.mirror import BlockTableMirror
from hybridkv.models.deepseek_v4 import build_v4_cache_specs
from hybridkv.spec import CacheGroupSpec

V4_SPECS = build_v4_cache_specs({"sliding_window": 16}, layer_ratio=[0, 4, 128])
V4_PAGES = {
    "v4.swa_kv": 30,
    "v4.c4a.compressor_state": 120,
    "v4.c4a.compressed_kv": 14,
    "v4.c128a.compressor_state": 160,
    "v4.c128a.compressed_kv": 14,
    "v4.c4a.indexer_compressor_state": 120,
}
ODD_SPECS = [
    CacheGroupSpec("s7", "sliding_window", rows_per_page=3, entry_stride_tokens=1, sliding_window_tokens=7),
    CacheGroupSpec("s6x2", "sliding_window", rows_per_page=2, entry_stride_tokens=2, sliding_window_tokens=6),
    CacheGroupSpec("f10", "full_history", rows_per_page=2, entry_stride_tokens=5),
    CacheGroupSpec("f3", "full_history", rows_per_page=3, entry_stride_tokens=1),
]
ODD_PAGES = {"s7": 30, "s6x2": 30, "f10": 30, "f3": 90}
CONFIGS = {"v4": (V4_SPECS, V4_PAGES, 1500, 64), "odd": (ODD_SPECS, ODD_PAGES, 90, 12)}


def build(config, caching, seed):
    specs, pages, ctx, step = CONFIGS[config]
    # Capture widths one past the ring capacity exercise the padded columns.
    probe = CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step)
    widths = {gid: t.capacity_pages + 1 for gid, t in probe.tables.items()}
    return [
        CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step, table_widths=widths,
                     shuffle_seed=seed, enable_prefix_caching=caching, prefix_granularity=256 if config == "v4" else 60)
        for _ in range(2)
    ]


def same_batch(a, b, mirror=None):
    assert a.request_ids == b.request_ids
    for name in ("num_scheduled_tokens", "query_start_loc", "positions", "request_indices", "table_rows"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    for gid, gb in b.groups.items():
        ga = a.groups[gid]
        assert np.array_equal(ga.write_slots, gb.write_slots), gid
        assert (ga.base_pages is None) == (gb.base_pages is None)
        if gb.base_pages is not None:
            assert np.array_equal(ga.base_pages, gb.base_pages), gid
        table = mirror.block_table(gid) if mirror is not None else ga.block_table
        assert table.dtype == np.int32 and gb.block_table.dtype == np.int32
        assert table.shape == gb.block_table.shape, (gid, table.shape, gb.block_table.shape)
        assert np.array_equal(table, gb.block_table), gid


def both(call, *args, **kwargs):
    """Run the same call on both managers; both succeed or both raise."""
    out, errors = [], []
    for m in call:
        try:
            out.append(m(*args, **kwargs))
            errors.append(None)
        except CacheManagerError as exc:
            out.append(None)
            errors.append(str(exc))
    assert (errors[0] is None) == (errors[1] is None), errors
    return out, errors[0]


@settings(max_examples=100, deadline=None)
@given(
    config=st.sampled_from(sorted(CONFIGS)),
    caching=st.booleans(),
    seed=st.sampled_from([None, 3]),
    data=st.data(),
)
def test_mirror_reproduces_full_tables(config, caching, seed, data):
    inc, full = build(config, caching, seed)
    mirror = BlockTableMirror.for_manager(inc)
    _, _, ctx, step_limit = CONFIGS[config]
    grain = 256 if config == "v4" else 60
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="rng"))
    shared = rng.integers(0, 50, ctx)  # common prefix material, so caching gets hits
    live: dict[str, dict] = {}
    seen: list[np.ndarray] = []  # prompts added so far
    hit_rids: set[str] = set()
    next_id, updates_seen = 0, False
    last_step: dict[str, tuple[int, int]] = {}  # rid -> (first, end) of its last step
    def step(rids, full_chunks):
        """Schedule ``rids`` on both managers and compare; False if refused."""
        nonlocal last_step, updates_seen
        items = []
        for rid in rids:
            req = live[rid]
            done = inc.num_computed_tokens(rid)
            if done < req["prompt"]:
                chunk = step_limit if full_chunks else data.draw(st.integers(1, step_limit), label="chunk")
                n = min(chunk, req["prompt"] - done)
            else:
                left = req["total"] - done
                if left == 0:
                    continue
                n = data.draw(st.integers(1, min(4, left)), label="decode")
                extra = done + n - req["known"]
                if extra > 0:
                    more = rng.integers(0, 100, extra)
                    inc.append_token_ids(rid, more)
                    full.append_token_ids(rid, more)
                    req["known"] += extra
            items.append((rid, n))
        if not items:
            return False
        # The first step starts the log (later hits must then travel as updates).
        mode = data.draw(st.sampled_from(["updates", "updates", "updates", "full"]), label="mode") if updates_seen else "updates"
        fixed = data.draw(st.booleans(), label="fixed_width")
        firsts = {rid: inc.num_computed_tokens(rid) for rid, _ in items}
        (a, b), err = both(
            [lambda: inc.schedule(items, fixed_width=fixed, block_tables=mode),
             lambda: full.schedule(items, fixed_width=fixed)]
        )
        if err is not None:
            event("step refused")
            return False
        last_step = {rid: (firsts[rid], firsts[rid] + n) for rid, n in items}
        event(f"step in {mode} mode")
        if mode == "updates":
            assert b.table_updates is None and a.table_updates is not None
            mirror.apply(a)
            updates_seen = True
            if hit_rids & {rid for rid, _ in items}:
                event("updates step with a request that hit")
            same_batch(a, b, mirror)
        else:
            same_batch(a, b)
        return True

    def add(ids, max_new):
        nonlocal next_id
        rid = f"r{next_id}"
        next_id += 1
        hits, err = both([inc.add_request, full.add_request], rid, ids, max_new_tokens=max_new)
        if err is not None:
            return None
        assert hits[0].hit_tokens == hits[1].hit_tokens
        if hits[0].hit_tokens:
            event("prefix hit")
            hit_rids.add(rid)
        live[rid] = dict(prompt=ids.size, total=ids.size + max_new, known=ids.size)
        return rid

    for _ in range(data.draw(st.integers(8, 40), label="ops")):
        ops = ["add", "add", "step", "step", "step", "prefill", "turn", "rewind", "free", "clear"]
        op = data.draw(st.sampled_from(ops))
        if op == "add" and len(live) < 5:
            long = st.integers(grain + 1, min(ctx - 20, 3 * grain))  # long enough to be hit
            prompt = data.draw(st.one_of(st.integers(1, 40), long), label="prompt")
            max_new = data.draw(st.integers(0, 16), label="max_new")
            source = data.draw(st.sampled_from(["fresh", "shared", "resume", "resume"]), label="source")
            if source == "resume" and seen:  # an earlier prompt plus a new turn
                ids = seen[data.draw(st.integers(0, len(seen) - 1), label="earlier")]
                ids = np.concatenate([ids, rng.integers(50, 100, 1 + prompt // 4)])[: ctx - 20]
                prompt = ids.size
            else:
                keep = prompt if source == "shared" else 0
                ids = np.concatenate([shared[:keep], rng.integers(50, 100, prompt - keep)])
            ids = ids.astype(np.int32)
            seen.append(ids)
            add(ids, max_new)
        elif op == "turn" and caching and len(live) < 4:
            # A whole prompt, one decode step (its blocks commit), then a new turn of the same
            # conversation: the second request hits and borrows pages between two updates steps.
            prompt = data.draw(st.integers(grain + 1, min(ctx - 20, 3 * grain)), label="turn prompt")
            ids = rng.integers(0, 100, prompt).astype(np.int32)
            first = add(ids, 4)
            while first and inc.num_computed_tokens(first) < prompt and step([first], True):
                pass
            if first and step([first], True):
                add(np.concatenate([ids, rng.integers(0, 100, 9)]).astype(np.int32), 4)
        elif op == "step" and live:
            everyone = st.permutations(sorted(live))
            subset = st.lists(st.sampled_from(sorted(live)), min_size=1, unique=True)
            step(data.draw(st.one_of(everyone, subset), label="batch"), data.draw(st.booleans(), label="full chunks"))
        elif op == "prefill" and live:
            for _ in range(12):  # whole prompts, a full chunk per step: long histories, hits later
                todo = [rid for rid in sorted(live) if inc.num_computed_tokens(rid) < live[rid]["prompt"]]
                if not todo or not step(todo, True):
                    break
        elif op == "rewind" and last_step:
            picks = data.draw(st.lists(st.sampled_from(sorted(last_step)), min_size=1, unique=True), label="rw")
            targets = [(rid, data.draw(st.integers(*last_step[rid]), label="keep")) for rid in picks]
            both([inc.rewind_many, full.rewind_many], targets)
            event("rewind")
            for rid, keep in targets:
                last_step[rid] = (last_step[rid][0], keep)
                live[rid]["known"] = min(live[rid]["known"], max(keep, live[rid]["prompt"]))
        elif op == "free" and live:
            rid = data.draw(st.sampled_from(sorted(live)), label="free")
            both([inc.free, full.free], rid)
            del live[rid]
            last_step.pop(rid, None)
        elif op == "clear":
            both([inc.clear_prefix_cache, full.clear_prefix_cache])
    if updates_seen:
        # The mirror's store equals the manager's store once the log is drained (every row:
        # a freed request's cells were cleared by updates too).
        final = [(r, 1) for r in live if inc.num_computed_tokens(r) < live[r]["total"]]
        if final:
            (a, _), err = both([lambda: inc.schedule(final, block_tables="updates"), lambda: full.schedule(final)])
            if err is None:
                mirror.apply(a)
                ts = next(iter(inc.tables.values())).table_set
                view = ts.ring_view()
                rows = min(mirror.store.shape[1], view.shape[1])
                assert np.array_equal(mirror.store[:, :rows, : view.shape[2]], view[:, :rows])
    for rid in list(live):
        inc.free(rid)
        full.free(rid)
    inc.check_invariants()


def test_resync_after_full_mode_and_small_updates_between():
    specs, pages, ctx, step = CONFIGS["v4"]
    m = CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step)
    m.add_request("a", prompt_tokens=200, max_new_tokens=50)
    m.add_request("b", prompt_tokens=40, max_new_tokens=50)
    m.schedule([("a", 64), ("b", 40)])  # full mode: nothing is logged
    assert next(iter(m.tables.values())).table_set.n_logged is None
    mirror = BlockTableMirror.for_manager(m)
    mirror.store[:] = 77  # stale content a resync must clear
    first = m.schedule([("a", 64), ("b", 1)], block_tables="updates")
    assert first.table_updates.reset
    for step_ in first.groups.values():
        assert step_.block_table is None
    store = next(iter(m.tables.values())).table_set.ring_view()
    up = first.table_updates
    held = (up.group * store.shape[1] + up.row) * store.shape[2] + up.column
    assert set(np.flatnonzero(store.reshape(-1) != -1).tolist()) == set(held.tolist())  # the live cells
    mirror.apply(first)
    later = m.schedule([("a", 1), ("b", 1)], block_tables="updates")
    assert not later.table_updates.reset and 0 < later.table_updates.page.size < 50
    mirror.apply(later)
    m.rewind("b", m.num_computed_tokens("b") - 1)
    m.free("a")
    m.add_request("c", prompt_tokens=30, max_new_tokens=5)
    m.schedule([("b", 1), ("c", 30)])  # full mode again: the next updates batch resyncs
    again = m.schedule([("b", 1), ("c", 1)], block_tables="updates")
    assert again.table_updates.reset
    mirror.apply(again)
    ts = next(iter(m.tables.values())).table_set
    view = ts.ring_view()
    seen = min(mirror.store.shape[1], view.shape[1])
    assert np.array_equal(mirror.store[:, :seen], view[:, :seen])
    assert np.all(view[:, seen:] == -1)


def test_bad_mode_is_refused_and_changes_nothing():
    specs, pages, ctx, step = CONFIGS["odd"]
    m = CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step)
    m.add_request("a", prompt_tokens=5)
    with pytest.raises(CacheManagerError, match="block_tables"):
        m.schedule([("a", 5)], block_tables="delta")
    assert m.num_computed_tokens("a") == 0 and next(iter(m.tables.values())).table_set.n_logged is None


def test_apply_needs_an_updates_batch():
    specs, pages, ctx, step = CONFIGS["odd"]
    m = CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step)
    m.add_request("a", prompt_tokens=5)
    with pytest.raises(ValueError, match="updates"):
        BlockTableMirror.for_manager(m).apply(m.schedule([("a", 5)]))


def test_block_table_of_no_group_or_before_any_batch_is_refused_clearly():
    """Was a KeyError (an unknown or unhashable group) or an IndexError (nothing applied yet)."""
    specs, pages, ctx, step = CONFIGS["odd"]
    m = CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step)
    m.add_request("a", prompt_tokens=5)
    mirror = BlockTableMirror.for_manager(m)
    with pytest.raises(ValueError, match="needs a batch applied first"):
        mirror.block_table("s7")
    mirror.apply(m.schedule([("a", 5)], block_tables="updates"))
    for group in ("nope", ["s7"]):
        with pytest.raises(ValueError, match="unknown group"):
            mirror.block_table(group)
    assert mirror.block_table("s7").shape == (1, 2)  # 5 tokens of 3 a page


def test_updates_of_a_chunk_that_evicts_first_match_the_full_tables():
    """A prefill chunk whose free stacks are short (cached pages evicted before it allocates:
    the step kernel stops after its releases and ``finish_step`` ends it) hands out the
    cells it changed as updates; a mirror applying them holds the full-mode tables."""
    inc, full = build("v4", True, None)
    mirror = BlockTableMirror.for_manager(inc)
    rng = np.random.default_rng(5)
    for k in range(4):
        ids = rng.integers(0, 1000, 1024)
        both([inc.add_request, full.add_request], f"r{k}", ids, max_new_tokens=4)
        for _ in range(16):
            (a, b), _ = both([lambda *x, **y: inc.schedule(*x, block_tables="updates", **y), full.schedule],
                             [(f"r{k}", 64)])
            assert not a.table_updates.reset or k == 0
            mirror.apply(a)
            same_batch(a, b, mirror)
        both([inc.free, full.free], f"r{k}")
    assert sum(s.evicted_pages for s in inc.stats().values()) > 0


def _serve(inc, full, steps: int, max_new_tokens: int, leaves, prompt_of, chunk_tokens: int = 12, each=None) -> None:
    """Serving-like steps on ``inc`` (``block_tables="updates"``) and ``full``: before step ``k`` the oldest
    ``leaves(k, live requests)`` requests leave (True: one), and one joins with ``prompt_of(k)`` (a prompt sharing a
    prefix: its hit places cached pages in its table); every request then gets up to ``chunk_tokens`` tokens
    (decoders one). Both managers' hits agree, ``each(k, batch)`` holds for each batch, and its updates,
    applied to a mirror, give the full-mode tables."""
    mirror = BlockTableMirror.for_manager(inc)
    prompts = {}
    for k in range(steps):
        for _ in range(min(int(leaves(k, len(prompts))), len(prompts))):
            gone = next(iter(prompts))
            del prompts[gone]
            both([inc.free, full.free], gone)
        rid = f"r{k}"
        prompts[rid] = prompt_of(k)
        hits, _ = both([inc.add_request, full.add_request], rid, prompts[rid], max_new_tokens=max_new_tokens)
        assert hits[0].hit_tokens == hits[1].hit_tokens
        items = []
        for r, prompt in prompts.items():
            left = prompt.size - inc.num_computed_tokens(r)
            if left <= 0:
                both([inc.append_token_ids, full.append_token_ids], r, [k % 7])
            items.append((r, min(chunk_tokens, left) if left > 0 else 1))
        (a, b), error = both([lambda *x, **y: inc.schedule(*x, block_tables="updates", **y), full.schedule], items)
        assert error is None
        assert each is None or each(k, a)
        mirror.apply(a)
        same_batch(a, b, mirror)


def _sharing(shared_tokens: int):
    """Step ``k``'s prompt: ``shared_tokens`` tokens every prompt shares, then a few of its own."""
    shared = np.arange(shared_tokens, dtype=np.int32) % 7
    return lambda k: np.concatenate([shared, np.full(k % 5 + 1, k, dtype=np.int32)])


def test_cells_a_free_and_a_prefix_hit_change_before_a_committing_step_come_with_its_updates():
    """Rows cross prefix grains (the step commits first, so it runs after admission with the cells a free
    and a prefix hit logged): they come in its updates with its own."""
    inc, full = build("odd", True, None)  # 60-token prefix grains, 12-token steps
    _serve(inc, full, 60, 40, lambda k, n_live: n_live > 3 or k % 3, _sharing(40))  # most steps, one leaves


def test_cells_two_frees_log_before_one_step_come_with_its_updates():
    """Two requests leave before most steps: the second ``free`` writes its cells elsewhere than the first's,
    which the log holds until the step; both come in its updates."""
    inc, full = build("odd", True, None)
    _serve(inc, full, 40, 40, lambda k, n_live: 2 if n_live > 4 else 0, _sharing(40))


def test_cells_of_more_notes_than_the_log_keeps_apart_come_with_the_next_updates():
    """Between two steps a request leaves, 300 join with a prefix hit and leave, and one joins with a hit
    (602 notes: past 512 the table log keeps its cells merged, each once); the next step's updates still
    carry every cell they changed: the mirror shows the leaver's row emptied and the joiner's pages."""
    inc, full = build("odd", True, None)  # 60-token prefix grains, 12-token steps
    mirror, shared = BlockTableMirror.for_manager(inc), np.arange(70, dtype=np.int32) % 7
    prompts = {"a": 70, "b": 70, "x300": 65}
    for rid, prompt in (("a", shared), ("b", np.full(70, 3, dtype=np.int32))):
        both([inc.add_request, full.add_request], rid, prompt, max_new_tokens=9)

    def step(rids):
        items = [(r, min(12, max(prompts[r] - inc.num_computed_tokens(r), 1))) for r in rids]
        (a, b), error = both([lambda *x: inc.schedule(*x, block_tables="updates"), full.schedule], items)
        assert error is None
        mirror.apply(a)
        same_batch(a, b, mirror)

    for _ in range(6):  # "a" computes its prompt, committing the first grain
        step(["a", "b"])
    both([inc.free, full.free], "b")
    for k in range(301):
        hits, _ = both([inc.add_request, full.add_request], f"x{k}", shared[:65], max_new_tokens=4)
        assert hits[0].hit_tokens == hits[1].hit_tokens == 60
        if k < 300:
            both([inc.free, full.free], f"x{k}")
    both([inc.append_token_ids, full.append_token_ids], "a", [1])
    step(["a", "x300"])


def test_cells_logged_before_a_clean_committing_step_come_with_its_updates():
    """As above with pools large enough that every plan is clean: a step whose rows cross prefix
    grains commits and runs without admission, taking the cells a free and a prefix hit logged."""
    specs, _, ctx, step_limit = CONFIGS["odd"]
    inc, full = (CacheManager(specs, dict.fromkeys(ODD_PAGES, 400), max_context_tokens=ctx, max_step_tokens=step_limit,
                              enable_prefix_caching=True, prefix_granularity=60) for _ in range(2))
    _serve(inc, full, 40, 10, lambda k, n_live: n_live > 5, _sharing(70))


@pytest.mark.parametrize("arena", [False, True])
def test_cells_a_free_logged_before_a_step_that_runs_whole_come_with_its_updates(arena):
    """Room for every plan and no prefix caching: each step runs whole in its one compiled call
    (``kernels.step``; on an arena, a batch with a chunk in ``kernels.step_spare``), right after a
    ``free`` whose cleared cells the log holds and a join that reuses the freed row. Its updates carry
    those cells with its own (none resets the tables after the first)."""
    specs, _, ctx, step_limit = CONFIGS["odd"]
    if arena:
        from hybridkv.memory.arena import arena_geometry
        from test_arena_stateful import ANCHOR, PAGE_BYTES
        budget = 4 * sum(400 * n for n in PAGE_BYTES["odd"].values())
        pools, options = None, {"arena": arena_geometry(PAGE_BYTES["odd"], budget, anchor_group=ANCHOR["odd"])}
    else:
        pools, options = dict.fromkeys(ODD_PAGES, 400), {}
    inc, full = (CacheManager(specs, pools, max_context_tokens=ctx, max_step_tokens=step_limit, **options)
                 for _ in range(2))
    _serve(inc, full, 30, 40, lambda k, n_live: n_live > 3, lambda k: np.full(k % 9 + 5, k, dtype=np.int32),
           chunk_tokens=6, each=lambda k, batch: k == 0 or not batch.table_updates.reset)


@pytest.mark.parametrize("shared_tokens", [30, 60])
def test_cells_taken_and_given_back_around_a_committing_step_come_with_its_updates(shared_tokens):
    """Long and short prompts joining and leaving (a free logs as many cells as the request held),
    nine requests live most steps and two every seventh: some committing steps find the touched
    scratch too small for the cells ``_step`` took from the log plus their own, so those go back to
    the log for ``_build_batch`` to drain (these sizes reach that at 60 and 30 shared tokens). The
    updates still give the full-mode tables."""
    specs, _, ctx, step_limit = CONFIGS["odd"]
    inc, full = (CacheManager(specs, dict.fromkeys(ODD_PAGES, 400), max_context_tokens=ctx, max_step_tokens=step_limit,
                              enable_prefix_caching=True, prefix_granularity=60) for _ in range(2))
    shared = np.arange(shared_tokens, dtype=np.int32) % 7
    own_tokens = [min(75 - shared_tokens, (k % 5 + 1) * (12 if k % 2 == 0 else 1)) for k in range(40)]
    _serve(inc, full, 40, 10, lambda k, n_live: n_live > (8 if k % 7 else 2),
           lambda k: np.concatenate([shared, np.full(own_tokens[k], k, dtype=np.int32)]))


@pytest.mark.parametrize("leaving", [3, 12])
def test_cells_of_many_frees_logged_before_a_step_come_with_its_updates(leaving):
    """Requests leave between two steps, each ``free`` logging its cleared cells (twelve: as many notes in the
    table log), and as many join into their rows; the next step's updates carry
    every one of those cells with its own: the mirror shows the joiners' rows as the full-mode tables do."""
    specs, _, ctx, step_limit = CONFIGS["odd"]
    inc, full = (CacheManager(specs, dict.fromkeys(ODD_PAGES, 400), max_context_tokens=ctx, max_step_tokens=step_limit)
                 for _ in range(2))
    mirror = BlockTableMirror.for_manager(inc)
    prompts = {f"r{k}": 30 - k for k in range(16)}  # long ones leave, short ones join into their rows
    for step in range(4):
        if step == 2:
            for rid in list(prompts)[:leaving]:
                both([inc.free, full.free], rid)
                del prompts[rid]
                prompts[f"n{rid}"] = 3
        for rid, prompt in prompts.items():
            if not inc.has_request(rid):
                both([inc.add_request, full.add_request], rid, np.full(prompt, 1, dtype=np.int32), max_new_tokens=9)
        decoding = tuple(rid for rid, prompt in prompts.items() if inc.num_computed_tokens(rid) >= prompt)
        for m in (inc, full):
            m.append_token_ids_many(decoding, np.full((len(decoding), 1), 2, dtype=np.int32))
        items = [(rid, min(max(prompt - inc.num_computed_tokens(rid), 1), step_limit))
                 for rid, prompt in prompts.items()]
        (a, b), error = both([lambda *x: inc.schedule(*x, block_tables="updates"), full.schedule], items)
        assert error is None, error
        mirror.apply(a)
        same_batch(a, b, mirror)
