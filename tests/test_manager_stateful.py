"""Random add / admit / schedule / rewind / free sequences against a small model.

The model knows only the rules, per request: computed tokens, its committed
tokens (a rewind may not go below them) and, per sliding group, its base page.
A step from ``first`` sets committed to ``first`` and the base to
``max(base, max(0, first - W + 1) // T)``. The requests of the previous step that
are not in the next one settle when it is scheduled: the same rule with
``first = computed``. A group then holds the logical pages
``[base, ceil(computed / T))`` (base 0 for full-history groups). Pools are small
so that denials happen; without prefix caching no page is shared.
"""

from dataclasses import dataclass, field

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv.runtime.manager import CacheManager, CacheManagerError
from hybridkv.models.deepseek_v4 import build_v4_cache_specs
from hybridkv.spec import CacheGroupSpec


def cdiv(a, b):
    return -(-a // b)


V4_SPECS = build_v4_cache_specs({"sliding_window": 16}, layer_ratio=[0, 4, 128])
V4_PAGES = {
    "v4.swa_kv": 9,
    "v4.c4a.compressor_state": 30,
    "v4.c4a.compressed_kv": 7,
    "v4.c128a.compressor_state": 50,
    "v4.c128a.compressed_kv": 7,
    "v4.c4a.indexer_compressor_state": 30,
}
# Odd numbers: windows that are not a multiple of the page span, a strided sliding group.
ODD_SPECS = [
    CacheGroupSpec("s7", "sliding_window", rows_per_page=3, entry_stride_tokens=1, sliding_window_tokens=7),
    CacheGroupSpec("s6x2", "sliding_window", rows_per_page=2, entry_stride_tokens=2, sliding_window_tokens=6),
    CacheGroupSpec("f10", "full_history", rows_per_page=2, entry_stride_tokens=5),
    CacheGroupSpec("f3", "full_history", rows_per_page=3, entry_stride_tokens=1),
]
ODD_PAGES = {"s7": 14, "s6x2": 12, "f10": 12, "f3": 30}

CONFIGS = {
    # name: (specs, pages, max context, max step tokens)
    "v4": (V4_SPECS, V4_PAGES, 1500, 64),
    "odd": (ODD_SPECS, ODD_PAGES, 90, 12),
}
MAX_VERIFY_TOKENS = 4
MAX_LIVE_REQUESTS = 5


@dataclass
class ModelRequest:
    prompt: int
    total: int
    computed: int = 0
    committed: int = 0
    base: dict = field(default_factory=dict)


def snapshot(m):
    pools = {g: (p.ref_counts.tolist(), p.num_free_pages, p.counters.as_dict()) for g, p in m.pools.items()}
    tables = {g: (t.pages.tolist(), t.base.tolist(), t.hi.tolist()) for g, t in m.tables.items()}
    return pools, tables


class ManagerMachine(RuleBasedStateMachine):
    @initialize(config=st.sampled_from(sorted(CONFIGS)), shuffle_seed=st.sampled_from([None, 0, 1]))
    def setup(self, config, shuffle_seed):
        specs, pages, ctx, step = CONFIGS[config]
        self.specs = list(specs)
        self.pages = dict(pages)
        self.ctx, self.step_limit = ctx, step
        self.m = CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step, shuffle_seed=shuffle_seed)
        self.model: dict[str, ModelRequest] = {}
        self.last_batch: list[str] = []
        self.next_id = 0

    # --- model rules -----------------------------------------------------------------
    def held_range(self, req, spec):
        base = req.base.get(spec.group_id, 0)
        return base, cdiv(req.computed, spec.page_tokens)

    def model_free(self, spec):
        used = 0
        for req in self.model.values():
            lo, hi = self.held_range(req, spec)
            used += hi - lo
        return self.pages[spec.group_id] - 1 - used

    def step_plan(self, rid, n, spec):
        """(new base, pages held after, pages to allocate, pages released first)."""
        req = self.model[rid]
        t = spec.page_tokens
        base, hi = self.held_range(req, spec)
        new_base = base
        if spec.is_sliding:
            new_base = max(base, max(0, req.computed - spec.sliding_window_tokens + 1) // t)
        need = cdiv(req.computed + n, t)
        return new_base, need, max(need - max(hi, new_base), 0), new_base - base

    def settling(self, batch_rids):
        """Requests of the previous step, not in this one, with uncommitted tokens."""
        return [
            r for r in self.last_batch
            if r in self.model and r not in batch_rids and self.model[r].computed > self.model[r].committed
        ]

    def net_pages(self, items, spec):
        """Pages the step needs beyond what it releases, settling requests included."""
        settle = self.settling({rid for rid, _ in items})
        released = sum(self.step_plan(r, 0, spec)[3] for r in settle)
        return sum(p[2] - p[3] for p in (self.step_plan(rid, n, spec) for rid, n in items)) - released

    def fits_alone(self, rid, n):
        return all(self.net_pages([(rid, n)], s) <= self.model_free(s) for s in self.specs)

    # --- admission checks (the arena machine overrides these) -------------------------
    def state(self):
        return snapshot(self.m)

    def check_single_answer(self, rid, n, adm):
        assert adm.ok == self.fits_alone(rid, n), adm.reason

    def check_refusal_reason(self, reason):
        assert reason

    def check_batch_answers(self, items, answers):
        # Releases precede allocations: a batch whose net total fits is admitted whole.
        if all(self.net_pages(items, s) <= self.model_free(s) for s in self.specs):
            assert all(a.ok for a in answers), [a.reason for a in answers]

    def step_tokens(self, data, rid):
        req = self.model[rid]
        if req.computed < req.prompt:
            chunk = data.draw(st.integers(1, self.step_limit), label=f"chunk {rid}")
            return min(chunk, req.prompt - req.computed)
        left = req.total - req.computed
        if left == 0:
            return 0
        return data.draw(st.integers(1, min(MAX_VERIFY_TOKENS, left)), label=f"decode {rid}")

    # --- rules -------------------------------------------------------------------------
    @precondition(lambda self: len(self.model) < MAX_LIVE_REQUESTS)
    @rule(data=st.data())
    def add(self, data):
        prompt = data.draw(st.integers(1, self.ctx), label="prompt")
        max_new = data.draw(st.integers(0, 12), label="max_new")
        rid = f"r{self.next_id}"
        self.next_id += 1
        if prompt + max_new > self.ctx:
            before = snapshot(self.m)
            with pytest.raises(CacheManagerError, match="max context"):
                self.m.add_request(rid, prompt_tokens=prompt, max_new_tokens=max_new)
            assert snapshot(self.m) == before and not self.m.has_request(rid)
            return
        hit = self.m.add_request(rid, prompt_tokens=prompt, max_new_tokens=max_new)
        assert hit.hit_tokens == 0
        self.model[rid] = ModelRequest(prompt, prompt + max_new)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def schedule_one(self, data):
        """A single request: admitted exactly when the model says it fits."""
        rid = data.draw(st.sampled_from(sorted(self.model)), label="rid")
        n = self.step_tokens(data, rid)
        if n == 0:
            return
        before = self.state()
        [adm] = self.m.check_admission([(rid, n)])
        assert self.state() == before
        self.check_single_answer(rid, n, adm)
        event("single request denied" if not adm.ok else "single request admitted")
        if adm.ok:
            self.run_step([(rid, n)])
        else:
            self.check_refusal_reason(adm.reason)
            with pytest.raises(CacheManagerError, match="not admissible"):
                self.m.schedule([(rid, n)])
            assert self.state() == before

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def schedule_batch(self, data):
        """Several requests, mixed prefill chunks and decode: schedule the admitted ones."""
        rids = data.draw(
            st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True), label="batch"
        )
        items = [(rid, n) for rid in rids for n in [self.step_tokens(data, rid)] if n > 0]
        if not items:
            return
        before = self.state()
        answers = self.m.check_admission(items)
        assert self.state() == before
        assert len(answers) == len(items)
        self.check_batch_answers(items, answers)
        admitted = [item for item, a in zip(items, answers) if a.ok]
        event(f"batch: {len(admitted)} of {len(items)} admitted")
        if len(admitted) < len(items):
            assert all(a.reason for a in answers if not a.ok)
            with pytest.raises(CacheManagerError, match="not admissible"):
                self.m.schedule(items)
            assert self.state() == before
        if admitted:
            self.run_step(admitted)  # "yes" is never followed by a failed schedule

    def run_step(self, items):
        settle = self.settling({rid for rid, _ in items})
        moves = [(rid, n) for rid, n in items] + [(rid, 0) for rid in settle]
        plans = {rid: {s.group_id: self.step_plan(rid, n, s) for s in self.specs} for rid, n in moves}
        firsts = np.array([self.model[rid].computed for rid, _ in items], dtype=np.int64)
        batch = self.m.schedule(items)
        for rid, n in moves:
            req = self.model[rid]
            req.committed = req.computed
            req.computed += n
            for s in self.specs:
                if s.is_sliding:
                    req.base[s.group_id] = plans[rid][s.group_id][0]
        self.last_batch = [rid for rid, _ in items]
        if settle:
            event("previous-step requests settled")
        self.check_batch(batch, items, firsts, plans)

    def check_batch(self, batch, items, firsts, plans):
        rids = [rid for rid, _ in items]
        counts = np.array([n for _, n in items], dtype=np.int64)
        n_req = len(items)
        assert batch.request_ids == tuple(rids)
        assert batch.num_scheduled_tokens.dtype == np.int32
        assert batch.num_scheduled_tokens.tolist() == counts.tolist()
        assert batch.query_start_loc.dtype == np.int32
        assert batch.query_start_loc.tolist() == [0] + np.cumsum(counts).tolist()
        positions = np.concatenate([np.arange(f, f + n) for f, n in zip(firsts, counts)])
        tok_req = np.repeat(np.arange(n_req), counts)
        assert batch.positions.dtype == np.int64 and batch.positions.tolist() == positions.tolist()
        assert batch.request_indices.dtype == np.int32
        assert batch.request_indices.tolist() == tok_req.tolist()
        for s in self.specs:
            gid = s.group_id
            g = batch.groups[gid]
            bt = g.block_table
            base = np.array([plans[rid][gid][0] for rid in rids], dtype=np.int64)
            hi = np.array([plans[rid][gid][1] for rid in rids], dtype=np.int64)
            live = hi - base
            assert bt.dtype == np.int32 and bt.shape == (n_req, int(live.max()))
            cols = np.arange(bt.shape[1])
            assert np.all(bt[cols[None, :] < live[:, None]] > 0), gid
            assert np.all(bt[cols[None, :] >= live[:, None]] == -1), gid
            if s.is_sliding:
                assert g.base_pages.dtype == np.int32 and g.base_pages.tolist() == base.tolist()
            else:
                assert g.base_pages is None
            for i, rid in enumerate(rids):
                b, pages = self.m.request_pages(rid, gid)
                assert b == base[i] and bt[i, : live[i]].tolist() == pages.tolist()
            # The slot of every scheduled token, recomputed from the kernel's view.
            rows, stride = s.rows_per_page, s.entry_stride_tokens
            entry = positions // stride
            col = entry // rows - base[tok_req]
            assert np.all((col >= 0) & (col < live[tok_req])), gid
            slots = bt[tok_req, col].astype(np.int64) * rows + entry % rows
            expected = np.where((positions + 1) % stride == 0, slots, -1)
            assert g.write_slots.dtype == np.int64
            assert g.write_slots.tolist() == expected.tolist(), gid
            # Every page a query reads is in its table: window tokens [p-W+1, p]
            # (sliding) or every entry so far (full history).
            first_read = np.maximum(positions - s.sliding_window_tokens + 1, 0) if s.is_sliding else 0 * positions
            first_page = first_read // stride // rows
            assert np.all(first_page >= base[tok_req]), gid
            assert np.all(positions // stride // rows < hi[tok_req]), gid

    @precondition(lambda self: any(r.computed > r.committed for r in self.model.values()))
    @rule(data=st.data())
    def rewind(self, data):
        rid = data.draw(
            st.sampled_from(sorted(r for r, q in self.model.items() if q.computed > q.committed)), label="rid"
        )
        req = self.model[rid]
        before = snapshot(self.m)
        with pytest.raises(CacheManagerError, match="forward"):
            self.m.rewind(rid, req.computed + 1)
        assert snapshot(self.m) == before
        if req.committed > 0:
            with pytest.raises(CacheManagerError, match="below"):
                self.m.rewind(rid, req.committed - 1)
            assert snapshot(self.m) == before
        keep = data.draw(st.integers(req.committed, req.computed), label="keep")
        self.m.rewind(rid, keep)
        event("rewind below the chunk end" if keep < req.computed else "rewind in place")
        req.computed = keep
        assert self.m.num_computed_tokens(rid) == keep

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)), label="rid")
        self.m.free(rid)
        del self.model[rid]
        assert not self.m.has_request(rid)

    # --- invariants ----------------------------------------------------------------------
    @invariant()
    def tables_match_the_model(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()  # ref counts equal the tables' holdings
        for s in self.specs:
            gid = s.group_id
            owned = []
            for rid, req in self.model.items():
                assert self.m.num_computed_tokens(rid) == req.computed
                lo, hi = self.held_range(req, s)
                assert lo <= hi
                base, pages = self.m.request_pages(rid, gid)
                assert base == lo and pages.size == hi - lo, (gid, rid)
                owned.extend(pages.tolist())
            assert len(owned) == len(set(owned)), f"{gid}: a page held by two requests"
            assert 0 not in owned
            pool = self.m.pools[gid]
            assert pool.ref_counts.max() <= 1
            assert pool.num_free_pages == self.model_free(s)

    def free_everything(self) -> bool:
        """Free every request and check the manager's invariants; False if none was built."""
        if not hasattr(self, "m"):
            return False
        for rid in list(self.model):
            self.m.free(rid)
        self.m.check_invariants()
        return True

    def teardown(self):
        if not self.free_everything():
            return
        for gid, s in self.m.stats().items():
            assert s.free_pages == s.total_pages == self.pages[gid] - 1 and s.used_pages == 0


TestManagerStateful = ManagerMachine.TestCase
TestManagerStateful.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@pytest.mark.slow
def test_manager_stateful_long():
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        ManagerMachine, settings=settings(max_examples=1500, stateful_step_count=60, deadline=None)
    )
