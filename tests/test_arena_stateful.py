"""The stateful manager machine of test_manager_stateful, on a shared arena.

The page-count model of the base machine still says which pages every request
holds. What changes is how much a step may allocate: a group's free pages grow
when the arena lends it a slab. So admission is checked against bounds:

* a step whose per-group deficits fit in the spare slabs alone must be admitted;
* an admitted step never fails to schedule;
* a refused step changes nothing.

After every rule: live pages of different groups never share a byte (from page
ids and page sizes alone), the arena's ownership matches the pools, and after
freeing everything every slab can go back to the spare list.
"""

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import initialize, invariant

from hybridkv.memory.arena import arena_geometry
from hybridkv.runtime.manager import CacheManager
from test_arena import live_byte_ranges_disjoint
from test_manager_stateful import CONFIGS, ManagerMachine, snapshot

# Invented page sizes in bytes (distinct, mostly coprime), and budgets near the
# per-group configs' bytes, so denials happen.
PAGE_BYTES = {
    "v4": {
        "v4.swa_kv": 37,
        "v4.c4a.compressor_state": 23,
        "v4.c4a.compressed_kv": 50,
        "v4.c128a.compressor_state": 19,
        "v4.c128a.compressed_kv": 7,
        "v4.c4a.indexer_compressor_state": 11,
    },
    "odd": {"s7": 13, "s6x2": 17, "f10": 29, "f3": 5},
}
ANCHOR = {"v4": "v4.c4a.compressed_kv", "odd": "f10"}
BUDGET = {"v4": 1_400, "odd": 450}


def cdiv(a, b):
    return -(-a // b)


class ArenaMachine(ManagerMachine):
    @initialize(config=st.sampled_from(sorted(CONFIGS)), slab_pages=st.sampled_from([1, 2, 3]))
    def setup(self, config, slab_pages):
        specs, _, ctx, step = CONFIGS[config]
        self.specs = list(specs)
        self.ctx, self.step_limit = ctx, step
        geometry = arena_geometry(
            PAGE_BYTES[config], BUDGET[config], anchor_group=ANCHOR[config], slab_anchor_pages=slab_pages
        )
        self.m = CacheManager(specs, None, max_context_tokens=ctx, max_step_tokens=step, arena=geometry)
        self.geometry = geometry
        self.min_slab_pages = {
            gid: int((lambda r: (r[1] - r[0]).min())(geometry.slab_page_ranges(gid))) for gid in PAGE_BYTES[config]
        }
        self.model = {}
        self.last_batch = []
        self.next_id = 0

    def model_free(self, spec):
        return self.m.pools[spec.group_id].num_free_pages

    def surely_fits(self, items):
        """Deficits the spare slabs alone cover (each slab counted at its group's minimum)."""
        slabs = 0
        for s in self.specs:
            short = self.net_pages(items, s) - self.model_free(s)
            if short > 0:
                slabs += cdiv(short, self.min_slab_pages[s.group_id])
        return slabs <= self.m.arena.num_spare_slabs

    def state(self):
        return snapshot(self.m), self.m.arena.owner.tolist()

    def check_single_answer(self, rid, n, adm):
        if self.surely_fits([(rid, n)]):
            assert adm.ok, adm.reason

    def check_refusal_reason(self, reason):
        assert "shared arena" in reason

    def check_batch_answers(self, items, answers):
        if self.surely_fits(items):
            assert all(a.ok for a in answers), [a.reason for a in answers]

    def run_step(self, items):
        moved = self.m.arena.slab_moves
        super().run_step(items)
        if self.m.arena.slab_moves > moved:
            event("a slab moved between groups")

    @invariant()
    def tables_match_the_model(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()  # includes the arena's ownership check
        for s in self.specs:
            for rid, req in self.model.items():
                lo, hi = self.held_range(req, s)
                base, pages = self.m.request_pages(rid, s.group_id)
                assert base == lo and pages.size == hi - lo, (s.group_id, rid)
        live_byte_ranges_disjoint(self.m)

    def teardown(self):
        if not self.free_everything():
            return
        assert all(s.used_pages == 0 for s in self.m.stats().values())
        assert all(p.num_free_pages == p.usable_pages for p in self.m.pools.values())  # every slab could go back


TestArenaStateful = ArenaMachine.TestCase
TestArenaStateful.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
