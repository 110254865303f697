"""Random programs give the same outcomes on ``CacheManager`` and on the reference.

``tests/reference_manager.py`` is a plain-Python model of the documented rules
(docs/manager.md, docs/prefix-caching.md), written without reading the runtime's
code. Each program is a random sequence of manager calls, drawn as it runs:

* requests join (prefix hits when caching is on: prompts share stems), prefill in
  chunks, decode, verify several tokens and rewind (one by one or ``rewind_many``),
  sit out steps (pauses) and finish, all in the same steps;
* pools are small, so steps are denied and (with caching) cached entries evicted;
* block tables come in full or ``"updates"`` mode (read back through a
  ``BlockTableMirror``), with ``fixed_width`` now and then.

Compared after every call: every ``StepBatch`` array (block tables, base pages,
write slots, positions, request indices, query start locations, scheduled
counts), table widths, every live request's pages (``request_pages``), the
public ``stats()`` counts, ``check_admission`` and ``max_admissible_tokens``
answers, whether ``schedule`` raises, and each ``add_request``'s hit numbers.

Page ids: per-group pools are compared exactly (docs/manager.md fixes a pool's
reuse order and a step's order of commits, releases and allocations, "Order
within a step"). On a shared arena pools hand out their lowest free ids from the
slabs they own, which the reference does not model, so there ids are compared up
to a renaming per group (a bijection that must hold while the reference's page
stays held or cached), the arena is roomy (nothing denied or evicted), prompt
checkpoints are off (a short group there reuses idle low-priority pages before
it takes a spare slab) and the free and total page counts, which follow the
slabs, are not compared. Eviction: the reference models each pool evicting by its
own LRU, so the manager runs ``eviction_policy="group-lru"`` here; the default value
policy (``hybridkv.prefix.eviction``) is pinned by tests/test_eviction.py. Table rows
are compared the same way (any row, one per live request, kept until free).
"""

from __future__ import annotations

import ast
import os
import re

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from hybridkv.memory.arena import arena_geometry
from hybridkv.runtime.manager import CacheManager, CacheManagerError
from hybridkv.tables.mirror import BlockTableMirror
from hybridkv.spec import CacheGroupSpec
from reference_manager import ReferenceManager, RefError

# Page tokens 4, 8, 4, 4; a strided sliding group; grain 8 = LCM of the history spans = the widest window.
SPECS = [
    CacheGroupSpec("kv", "full_history", rows_per_page=4, entry_stride_tokens=1),
    CacheGroupSpec("c4", "full_history", rows_per_page=2, entry_stride_tokens=4),
    CacheGroupSpec("swa", "sliding_window", 4, 1, sliding_window_tokens=8, family="state"),
    CacheGroupSpec("cst", "sliding_window", 2, 2, sliding_window_tokens=8, family="state"),
]
GIDS = [s.group_id for s in SPECS]
CTX, GRAIN, VOCAB = 64, 8, 3


class Renaming:
    """A bijection per group between the reference's and the manager's ids, learnt as they appear."""

    def __init__(self, strict=False):
        self.strict = strict
        self.fwd = {}
        self.back = {}

    def same(self, key, ref_ids, mgr_ids) -> None:
        fwd, back = self.fwd.setdefault(key, {}), self.back.setdefault(key, {})
        assert len(ref_ids) == len(mgr_ids), (key, ref_ids, mgr_ids)
        for r, m in zip(ref_ids, mgr_ids):
            assert (r == -1) == (m == -1), (key, ref_ids, mgr_ids)
            if r == -1:
                continue
            if self.strict:
                assert r == m, (key, ref_ids, mgr_ids)
            elif r in fwd:
                assert fwd[r] == m, (key, r, fwd[r], m, ref_ids, mgr_ids)
            else:
                assert m not in back, (key, m, back.get(m), ref_ids, mgr_ids)
                fwd[r], back[m] = m, r

    def forget(self, key, ref_ids) -> None:
        for r in ref_ids:
            m = self.fwd.get(key, {}).pop(r, None)
            if m is not None:
                del self.back[key][m]


class Twin:
    """One manager and its reference, driven by the same calls and compared after each."""

    def __init__(self, pages, widths, caching, prompt_checkpoints, shared=False):
        arena = None
        if shared:  # every group's page 64 B, slabs of 4 pages, far more slabs than a program fills
            arena = arena_geometry({g: 64 for g in GIDS}, 64 + 600 * 256, anchor_group="kv", slab_anchor_pages=4)
            pages = {g: 10**6 for g in GIDS}
        self.mgr = CacheManager(
            SPECS, None if shared else pages, max_context_tokens=CTX, max_step_tokens=4 * CTX,
            table_widths=widths, arena=arena, enable_prefix_caching=caching, prefix_granularity=GRAIN,
            prompt_checkpoints=prompt_checkpoints, eviction_policy="group-lru",
            checkpoint_window_tokens={s.group_id: s.sliding_window_tokens for s in SPECS if s.is_sliding},
        )
        self.ref = ReferenceManager(SPECS, pages, table_widths=widths, caching=caching, grain=GRAIN,
                                    prompt_checkpoints=prompt_checkpoints)
        # Shared arena: pools hand out their lowest free ids from the slabs they own, which the
        # reference does not model, so page ids are compared up to a renaming there.
        self.ids, self.rows = Renaming(strict=not shared), Renaming()
        self.shared = shared
        self.mirror = BlockTableMirror.for_manager(self.mgr)
        self.caching = caching
        self.loaded = set()  # requests whose last step was a load step (rewound only to be freed)

    def compare_state(self) -> None:
        for g, pool in self.ref.pools.items():
            self.ids.forget(g, pool.cleaned)
            pool.cleaned.clear()
        want = self.ref.stats()
        got = self.mgr.stats()
        for g in GIDS:
            if self.shared:  # a group's pages there are the slabs it holds now
                del want[g]["free_pages"], want[g]["total_pages"]
            assert {k: getattr(got[g], k) for k in want[g]} == want[g], g
        for rid, r in self.ref.reqs.items():
            assert self.mgr.num_computed_tokens(rid) == r["c"]
            for g in GIDS:
                base, pages = self.mgr.request_pages(rid, g)
                assert base == r["base"][g], (rid, g)
                self.ids.same(g, r["pages"][g], pages.tolist())
        self.mgr.check_invariants()

    def compare_batch(self, items, want, batch, mode, with_slots) -> None:
        assert batch.request_ids == tuple(rid for rid, _ in items)
        assert batch.num_scheduled_tokens.tolist() == [n for _, n in items]
        assert batch.query_start_loc.tolist() == want["qsl"]
        assert batch.positions.tolist() == want["positions"]
        assert batch.request_indices.tolist() == want["request_indices"]
        if mode == "updates":
            self.mirror.apply(batch)
            assert batch.table_updates.widths == tuple(len(want["groups"][g]["table"][0]) for g in GIDS)
        for rid, row in zip(batch.request_ids, batch.table_rows.tolist()):
            self.rows.same("rows", [rid], [row])
        for g in GIDS:
            w, got = want["groups"][g], batch.groups[g]
            table = self.mirror.block_table(g) if mode == "updates" else got.block_table
            assert table.dtype == np.int32 and table.shape == (len(items), len(w["table"][0])), g
            for ref_row, row in zip(w["table"], table.tolist()):
                self.ids.same(g, ref_row, row)
            bases = None if got.base_pages is None else got.base_pages.tolist()
            assert bases == w["base_pages"], g
            if not with_slots:
                assert got.write_slots is None
                continue
            rows = self.ref.pools[g].rows
            slots = got.write_slots.tolist()
            assert [s % rows if s >= 0 else -1 for s in slots] == [s % rows if s >= 0 else -1 for s in w["write_slots"]]
            self.ids.same(g, [s // rows if s >= 0 else -1 for s in w["write_slots"]],
                          [s // rows if s >= 0 else -1 for s in slots])


LOG: list[str] = []


def log(line: str) -> None:
    """The program so far: ``REF_LOG=path`` writes a failing program's calls there."""
    LOG.append(line)


def both(call_mgr, call_ref):
    """Run a call on both sides: the same result, or both refuse."""
    try:
        want = call_ref()
    except RefError:
        with pytest.raises(CacheManagerError):
            call_mgr()
        return None, None
    return want, call_mgr()


def draw_prompt(data, stems):
    """Mostly a whole stem (another turn of a conversation, a shared system prompt) and a tail."""
    stem = data.draw(st.sampled_from(stems))
    keep = data.draw(st.one_of(st.just(len(stem)), st.integers(1, len(stem))))
    tail = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
    return stem[:keep] + tail


def add(twin, data, stems, rid) -> None:
    if twin.caching:
        prompt = draw_prompt(data, stems)
        max_new = data.draw(st.integers(0, min(14, CTX - len(prompt))))
        log(f"add {rid} {prompt} max_new={max_new}")
        want = twin.ref.add_request(rid, ids=prompt, max_new=max_new)
        hit = twin.mgr.add_request(rid, np.asarray(prompt, dtype=np.int32), max_new_tokens=max_new)
        assert hit.hit_tokens == want["hit"]
        assert hit.group_hit_tokens == want["groups"] and hit.history_hit_tokens == want["history"]
    else:
        prompt = data.draw(st.integers(1, 40))
        max_new = data.draw(st.integers(0, 14))
        log(f"add {rid} prompt_tokens={prompt} max_new={max_new}")
        twin.ref.add_request(rid, prompt_tokens=prompt, max_new=max_new)
        assert twin.mgr.add_request(rid, prompt_tokens=prompt, max_new_tokens=max_new).hit_tokens == 0


def draw_items(twin, data):
    live = [rid for rid, r in twin.ref.reqs.items() if r["c"] < r["limit"]]
    chosen = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=4)) if live else []
    items, extras = [], {}
    for rid in chosen:
        r = twin.ref.reqs[rid]
        room = r["limit"] - r["c"]
        if r["c"] < r["prompt"]:  # a prefill chunk, at most the rest of the prompt
            n = data.draw(st.integers(1, min(r["prompt"] - r["c"], 24)))
        else:  # decode, or verify a few draft tokens
            n = data.draw(st.integers(1, min(room, 4)))
        if r["ids"] is not None and len(r["ids"]) < r["c"] + n:
            extra = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=r["c"] + n - len(r["ids"]),
                                       max_size=r["c"] + n - len(r["ids"])))
            log(f"append {rid} {extra}")
            r["ids"].extend(extra)
            extras[rid] = extra
        items.append((rid, n))
    if len(extras) > 1 and len({len(e) for e in extras.values()}) == 1:  # the decode-step form
        twin.mgr.append_token_ids_many(list(extras), np.asarray(list(extras.values()), dtype=np.int64))
    else:
        for rid, extra in extras.items():
            twin.mgr.append_token_ids(rid, np.asarray(extra, dtype=np.int32))
    return items


def step(twin, data) -> None:
    items = draw_items(twin, data)
    if not items:
        return
    fixed_width = data.draw(st.booleans()) and data.draw(st.booleans())
    if twin.caching and data.draw(st.sampled_from([False, False, False, True])):
        return load_step(twin, data, items, fixed_width)
    answers = twin.mgr.check_admission(items, fixed_width=fixed_width)
    assert [a.ok for a in answers] == twin.ref.check_admission(items, fixed_width), items
    assert all(a.ok or a.reason for a in answers)
    rid, n = items[-1]
    ask = n + data.draw(st.integers(0, 3))  # sometimes past the request's tokens: the answer stops at them
    want, got = both(lambda: twin.mgr.max_admissible_tokens(rid, ask, batch=items[:-1]),
                     lambda: twin.ref.max_admissible_tokens(rid, ask, items[:-1]))
    assert got == want, (items, got, want)
    mode = data.draw(st.sampled_from(["full", "updates"]))
    slots = data.draw(st.sampled_from([True, True, True, False]))
    counts = {k for _, k in items}
    if len(counts) == 1 and data.draw(st.booleans()):
        call = lambda: twin.mgr.schedule_uniform(  # noqa: E731
            [r for r, _ in items], n, fixed_width=fixed_width, block_tables=mode, write_slots=slots)
    else:
        call = lambda: twin.mgr.schedule(  # noqa: E731
            items, fixed_width=fixed_width, block_tables=mode, write_slots=slots)
    log(f"schedule {items} fixed_width={fixed_width} {mode} write_slots={slots}")
    want, batch = both(call, lambda: twin.ref.schedule(items, fixed_width))
    if want is not None:
        twin.loaded.difference_update(rid for rid, _ in items)
        twin.compare_state()
        twin.compare_batch(items, want, batch, mode, slots)


def load_step(twin, data, items, fixed_width) -> None:
    """A load step (``load=True``): the items' tokens copied in, sliding groups holding only
    the window at each item's new end."""
    answers = twin.mgr.check_admission(items, fixed_width=fixed_width, load=True)
    assert [a.ok for a in answers] == twin.ref.check_admission(items, fixed_width, load=True), items
    mode = data.draw(st.sampled_from(["full", "updates"]))
    log(f"schedule {items} fixed_width={fixed_width} {mode} load=True")
    want, batch = both(lambda: twin.mgr.schedule(items, fixed_width=fixed_width, block_tables=mode,
                                                 write_slots=False, load=True),
                       lambda: twin.ref.schedule(items, fixed_width, load=True))
    if want is not None:
        twin.loaded.update(rid for rid, _ in items)
        twin.compare_state()
        twin.compare_batch(items, want, batch, mode, False)


def rewind(twin, data) -> None:
    open_ = [rid for rid, r in twin.ref.reqs.items() if r["c"] > r["committed"] and rid not in twin.loaded]
    if not open_:
        return
    picked = data.draw(st.lists(st.sampled_from(open_), unique=True, min_size=1, max_size=3))
    reqs = twin.ref.reqs
    items = [(rid, data.draw(st.integers(reqs[rid]["committed"], reqs[rid]["c"]))) for rid in picked]
    log(f"rewind {items}")
    twin.ref.rewind_many(items)
    if len(items) == 1 and data.draw(st.booleans()):
        twin.mgr.rewind(*items[0])
    else:
        twin.mgr.rewind_many(items)


def free(twin, data) -> None:
    if twin.ref.reqs:
        rid = data.draw(st.sampled_from(sorted(twin.ref.reqs)))
        log(f"free {rid}")
        twin.ref.free(rid)
        twin.mgr.free(rid)
        twin.rows.forget("rows", [rid])
        twin.loaded.discard(rid)


def run_program(data, caching, shared=False):
    # Small pools: denials, and with caching evictions (state pools smaller still: checkpoints pile up there).
    pages = {g: data.draw(st.integers(4, 12 if caching and g in ("swa", "cst") else 24)) for g in GIDS}
    widths = {"kv": data.draw(st.integers(4, 16)), "c4": data.draw(st.integers(2, 8)),
              "swa": data.draw(st.integers(3, 8)), "cst": data.draw(st.integers(3, 8))}
    LOG.clear()
    # On a shared arena a short group reuses its idle low-priority pages (prompt checkpoints) before it
    # takes a spare slab, which only a model of the slabs could follow: no prompt checkpoints there.
    prompt_checkpoints = caching and not shared and data.draw(st.sampled_from([True, True, True, False]))
    twin = Twin(pages, widths, caching, prompt_checkpoints, shared)
    log(f"pages={pages} widths={widths} prompt_checkpoints={twin.ref.prompt_cps} shared={shared}")
    stems = [data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=9, max_size=40)) for _ in range(2)]
    ops = {"add": add, "step": step, "rewind": rewind, "free": free}
    try:
        play(twin, data, stems, ops)
    except BaseException:
        if os.environ.get("REF_LOG"):
            with open(os.environ["REF_LOG"], "w") as f:
                f.write("\n".join(LOG) + "\n")
        raise


def play(twin, data, stems, ops) -> None:
    for i in range(data.draw(st.integers(4, 50))):
        op = data.draw(st.sampled_from(["add", "add", "step", "step", "step", "step", "rewind", "free"]))
        if op == "add":
            if len(twin.ref.reqs) < 5:
                add(twin, data, stems, f"r{i}")
        else:
            ops[op](twin, data)
        twin.compare_state()
    for rid in sorted(twin.ref.reqs):
        log(f"free {rid}")
        twin.ref.free(rid)
        twin.mgr.free(rid)
    twin.compare_state()


# 150 programs per test (2.5x the profile's count: ~400 programs in ~80 s on two busy cores; the
# "thorough" profile gives 2,500). REF_EXAMPLES=n overrides; REF_NOSHRINK=1 reports the first failure
# unshrunk (shrinking these programs can take minutes); REF_LOG=path writes its calls there.
PROGRAM_SETTINGS = settings(
    max_examples=int(os.environ.get("REF_EXAMPLES", max(150, 5 * settings.default.max_examples // 2))),
    deadline=None, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.reuse, Phase.generate) if os.environ.get("REF_NOSHRINK") else tuple(Phase),
)


@PROGRAM_SETTINGS
@given(st.data())
def test_programs_without_prefix_caching_match_the_reference(data):
    run_program(data, caching=False)


@PROGRAM_SETTINGS
@given(st.data())
def test_programs_with_prefix_caching_match_the_reference(data):
    run_program(data, caching=True)


@settings(PROGRAM_SETTINGS, max_examples=max(1, PROGRAM_SETTINGS.max_examples // 2))
@given(st.data(), st.booleans())
def test_programs_on_a_roomy_shared_arena_match_the_reference(data, caching):
    run_program(data, caching, shared=True)


def replay(program: str) -> None:
    """Run a program written as ``REF_LOG`` writes it (one call a line), comparing as above."""
    first, *lines = [line.strip() for line in program.strip().splitlines()]
    head = re.fullmatch(r"pages=(\{.*\}) widths=(\{.*\}) prompt_checkpoints=(\w+) shared=(\w+)", first)
    twin = Twin(ast.literal_eval(head[1]), ast.literal_eval(head[2]), True, head[3] == "True", head[4] == "True")
    for line in lines:
        op, rid, rest = (line + " ").split(" ", 2)
        if op == "add":
            ids, max_new = rest.rsplit(" max_new=", 1)
            want = twin.ref.add_request(rid, ids=ast.literal_eval(ids), max_new=int(max_new))
            hit = twin.mgr.add_request(rid, np.asarray(ast.literal_eval(ids)), max_new_tokens=int(max_new))
            assert hit.hit_tokens == want["hit"] and hit.group_hit_tokens == want["groups"], line
        elif op == "schedule":
            items = ast.literal_eval(line[len("schedule "):])
            want, batch = both(lambda: twin.mgr.schedule(items), lambda: twin.ref.schedule(items))
            if want is not None:
                twin.compare_state()
                twin.compare_batch(items, want, batch, "full", True)
        elif op == "append":
            ids = ast.literal_eval(rest)
            twin.ref.reqs[rid]["ids"].extend(ids)
            twin.mgr.append_token_ids(rid, np.asarray(ids, dtype=np.int32))
        elif op == "free":
            twin.ref.free(rid)
            twin.mgr.free(rid)
            twin.rows.forget("rows", [rid])
        twin.compare_state()


def program_head(pages: dict | None = None, prompt_checkpoints: bool = False) -> str:
    """A replayed program's first line: per-group pools of 30 pages but where ``pages`` sets them."""
    pools = {g: 30 for g in GIDS} | (pages or {})
    return (f"pages={pools} widths={{'kv': 16, 'c4': 8, 'swa': 8, 'cst': 8}}"
            f" prompt_checkpoints={prompt_checkpoints} shared=False")


ROOMY = program_head()  # nothing denied or evicted


def test_paused_requests_commit_before_the_batch_so_the_first_paused_one_publishes():
    """c, a and b compute the same 9 tokens in one step; only b goes on, so c and a settle and
    commit before b, c first: c's pages are the ones published at 8, and d borrows them
    (docs/manager.md "Order within a step"; the random programs rarely reach this case)."""
    same = list(range(12))
    replay(f"""
        {ROOMY}
        add a {same} max_new=3
        add b {same} max_new=3
        add c {same} max_new=3
        schedule [('c', 9), ('a', 9), ('b', 9)]
        schedule [('b', 1)]
        add d {same} max_new=3
    """)


def replay_junction(c_steps: str) -> None:
    """a computes 26 of its 28 tokens (b borrows its checkpoint at 8 on the way, a lets go of the one at 16), then c
    joins, its history reaching 16 (its junction: no checkpoint left there) and its hit 8, and runs ``c_steps``."""
    a = list(range(28))
    replay(f"""
        {ROOMY}
        add a {a} max_new=3
        schedule [('a', 9)]
        schedule [('a', 1)]
        add b {a[:12]} max_new=3
        schedule [('a', 7)]
        schedule [('a', 8)]
        schedule [('a', 1)]
        add c {a[:20] + [99] * 8} max_new=3
        {c_steps.strip()}
    """)


def test_a_hit_owns_its_checkpoint_and_a_junction_stays_pinned():
    """b's hit at 8 makes a's checkpoint there b's own too, so it stays published when a moves on to 16; c's
    history reaches 16, where no checkpoint is left (a let go of it), so c pins the one it publishes there and
    keeps it when it moves on to 24. (Rare in the random programs: mutants dropping either hold often pass them.)"""
    replay_junction("""
        schedule [('c', 9)]
        schedule [('c', 8)]
        schedule [('c', 1)]""")


def test_a_junction_crossed_inside_a_chunk_is_published_pinned():
    """As above, but c crosses its junction (16) and 24 in one chunk: 16 is not c's latest boundary there, so only its
    being the junction publishes it (with prompt checkpoints off nothing else would) and pins it; e then hits it."""
    replay_junction(f"""
        schedule [('c', 17)]
        schedule [('c', 1)]
        add e {list(range(16)) + [55] * 8} max_new=3""")


def test_a_hold_moving_on_lets_go_of_the_last_as_admission_credit():
    """b decodes past its 6-token prompt: the step after it crosses 8 holds each state group's window below 8, the
    step after it crosses 16 holds the one below 16 and lets go of the one below 8. With the cst pool empty, that last
    step fits only because admission counts the page the hold lets go as freed (found by a search for programs that
    tell the rule apart; the random programs seldom are this tight)."""
    pools = {'kv': 13, 'c4': 26, 'swa': 8, 'cst': 7}
    replay(f"""
        {program_head(pools, prompt_checkpoints=True)}
        add a [2, 1, 2, 0, 2, 0, 1, 0, 0, 2, 2] max_new=25
        add b [1, 1, 2, 2, 2, 1] max_new=29
        schedule [('a', 8), ('b', 6)]
        append b [1, 0]
        schedule [('a', 2), ('b', 2)]
        append b [2, 0]
        schedule [('b', 2), ('a', 1)]
        append b [0, 0]
        schedule [('b', 2)]
        append b [0, 1]
        schedule [('b', 2)]
        append a [0]
        append b [2, 1]
        schedule [('a', 1), ('b', 2)]
        append b [2, 0]
        schedule [('b', 2)]
    """)


@pytest.mark.parametrize("state_pages", [25, 26])
def test_low_priority_evictions_stop_16_pages_past_the_need(state_pages):
    """a and b prefill 48-token prompts in 8-token chunks and finish: each leaves its prompt checkpoints at 8-40 low
    priority (5 entries of 2 window pages in swa and in cst), its last normal; 0 or 1 state pages stay clean. c's
    first chunk needs 2 pages: low-priority entries go until 18 pages are free, 9 of the 10 entries either way (a
    slack of 15 would stop at 8 with 1 clean page, one of 17 take all 10 with none)."""
    pools = {'kv': 40, 'c4': 40, 'swa': state_pages, 'cst': state_pages}
    chunks = "\n".join(["schedule [('a', 8)]"] * 6)
    replay(f"""
        {program_head(pools, prompt_checkpoints=True)}
        add a {[1] + [0] * 47} max_new=0
        {chunks}
        free a
        add b {[2] + [0] * 47} max_new=0
        {chunks.replace("'a'", "'b'")}
        free b
        add c {[1, 1] + [0] * 6} max_new=0
        schedule [('c', 8)]
    """)


def test_the_prompt_end_checkpoint_stays_published_low_when_its_request_moves_on():
    """a's prompt ends on a boundary (16); a decodes past 24 and finishes: freeing publishes 24 and lets go of its
    own checkpoint at 16, which, a prompt boundary, stays published at low priority like the one at 8."""
    replay(f"""
        {program_head(prompt_checkpoints=True)}
        add a {list(range(16))} max_new=12
        schedule [('a', 16)]
        append a {[0] * 9}
        schedule [('a', 9)]
        free a
        add b {list(range(16)) + [2] * 8} max_new=3
    """)


def test_free_releases_the_live_pages_then_the_held_checkpoint():
    """a decodes past its 11-token prompt, holding each state group's window at the boundaries it crosses, and
    finishes while b runs: its live pages go back before its held window, and with the swa pool this small b's next
    pages depend on that order (found by a search for programs that tell the two orders apart)."""
    pools = {'kv': 13, 'c4': 10, 'swa': 6, 'cst': 9}
    replay(f"""
        {program_head(pools, prompt_checkpoints=True)}
        add a [0, 0, 1, 2, 0, 0, 0, 2, 2, 2, 1] max_new=13
        schedule [('a', 11)]
        append a [2, 1]
        schedule [('a', 2)]
        append a [0, 1]
        schedule [('a', 2)]
        append a [0, 2]
        schedule [('a', 2)]
        append a [0]
        schedule [('a', 1)]
        append a [1, 0]
        schedule [('a', 2)]
        append a [0, 0]
        schedule [('a', 2)]
        add b [1, 2, 2, 2] max_new=28
        append a [2, 0]
        schedule [('a', 2), ('b', 4)]
        free a
        append b [1]
        schedule [('b', 1)]
    """)


def test_a_held_window_is_published_at_free_after_it_slid_out():
    """a decodes past its 10-token prompt across 16; the next step holds each state group's window below 16, and
    a moves on until that window's first page slid out of its table. Freeing then publishes 16 from the held pages
    (its latest boundary), and b hits there."""
    replay(f"""
        {ROOMY}
        add a {list(range(10))} max_new=20
        schedule [('a', 10)]
        append a {[0] * 7}
        schedule [('a', 7)]
        append a {[0] * 3}
        schedule [('a', 3)]
        append a {[0] * 2}
        schedule [('a', 2)]
        free a
        add b {list(range(10)) + [0] * 6 + [2, 2]} max_new=3
    """)


def test_a_demoted_checkpoint_s_idle_pages_move_to_the_evicting_end():
    """a's prompt checkpoints are demoted as a moves on and finishes: a demoted entry's idle pages move to the
    evicting end of the LRU, and with pools this small the last steps' evictions tell that apart (found by a search
    for programs that do; the random programs catch it only now and then)."""
    pools = {'kv': 26, 'c4': 17, 'swa': 8, 'cst': 10}
    replay(f"""
        {program_head(pools, prompt_checkpoints=True)}
        add a [2, 1, 1, 0, 1, 0, 0, 0, 2] max_new=12
        schedule [('a', 7)]
        schedule [('a', 1)]
        schedule [('a', 1)]
        append a [2, 2]
        schedule [('a', 2)]
        append a [2, 2]
        schedule [('a', 2)]
        add b [2] max_new=27
        add c [1, 1, 2, 2, 0, 2, 0, 0, 2, 2, 0, 1] max_new=18
        append a [1, 1]
        schedule [('c', 11), ('a', 2)]
        add d [0, 1] max_new=25
        append a [0]
        schedule [('a', 1), ('b', 1)]
        add e [1, 1, 2, 0, 0, 0, 1, 0, 1, 0, 2] max_new=26
        free a
        schedule [('e', 2)]
        schedule [('d', 2)]
    """)


def test_a_slid_out_page_still_held_for_a_checkpoint_is_no_admission_credit():
    """a decodes past its 7-token prompt with 3 usable cst pages, holding the window at each boundary it crosses:
    a page that slides out of its table while that hold keeps it is not freed, and admission does not count it as
    freed (found by a search for programs that tell the rule apart)."""
    pools = {'kv': 24, 'c4': 17, 'swa': 8, 'cst': 4}
    replay(f"""
        {program_head(pools)}
        add a [1, 0, 1, 1, 1, 0, 2] max_new=16
        schedule [('a', 3)]
        schedule [('a', 1)]
        schedule [('a', 2)]
        schedule [('a', 1)]
        append a [2, 0]
        schedule [('a', 2)]
        append a [0, 0]
        schedule [('a', 2)]
        append a [1, 1]
        schedule [('a', 2)]
    """)


def test_a_batch_whose_releases_pay_for_its_first_request_is_admitted_whole():
    """y's 16-token chunk needs 4 window pages with 3 free; x's decode step in the same batch frees 2 and takes 1,
    so the batch fits as a whole and both go, though y alone (greedy, in batch order) would not fit."""
    replay(f"""
        {program_head({'swa': 8})}
        add x {list(range(20))} max_new=3
        schedule [('x', 16)]
        add y {list(range(100, 116))} max_new=3
        schedule [('y', 16), ('x', 1)]
    """)


def test_idle_low_priority_checkpoints_are_evicted_before_older_normal_ones():
    """a's own checkpoint at 8 goes idle when a finishes, then b's prompt checkpoints at 8 and 16 (low priority)
    when b slides past them; c's chunk is one window page short and evicts both of b's (low-priority entries go
    up to 16 pages beyond the need), not a's, though a's went idle first."""
    replay(f"""
        {program_head({'swa': 13}, prompt_checkpoints=True)}
        add a {list(range(12))} max_new=3
        schedule [('a', 9)]
        schedule [('a', 1)]
        free a
        add b {list(range(100, 128))} max_new=3
        schedule [('b', 25)]
        schedule [('b', 1)]
        add c {list(range(200, 216))} max_new=3
        schedule [('c', 16)]
    """)
