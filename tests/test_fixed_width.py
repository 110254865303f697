"""``fixed_width`` changes only the block tables' width: on a shared arena, with capture widths that
no step outgrows, a random program scheduled with ``fixed_width=True`` gives the same batches (in
"updates" mode: the same cells), the same stats, slabs and prefix events as without it."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from hybridkv.memory.arena import arena_geometry
from hybridkv.runtime.manager import CacheManager
from test_arena_stateful import ANCHOR, PAGE_BYTES
from test_slab_steps import serve
from test_table_updates import CONFIGS


def build(config, caching, budget_share, slab_pages, fixed_width):
    specs, pages, ctx, step = CONFIGS[config]
    probe = CacheManager(specs, pages, max_context_tokens=ctx, max_step_tokens=step)
    widths = {gid: t.capacity_pages + 1 for gid, t in probe.tables.items()}  # no step is denied for width
    budget = int(budget_share * sum(n * PAGE_BYTES[config][g] for g, n in pages.items()) / 2)
    geometry = arena_geometry(PAGE_BYTES[config], budget, anchor_group=ANCHOR[config], slab_anchor_pages=slab_pages)
    m = CacheManager(specs, None, max_context_tokens=ctx, max_step_tokens=step, enable_prefix_caching=caching,
                     arena=geometry, prefix_granularity=256 if config == "v4" else 60, table_widths=widths)
    schedule = m.schedule
    m.schedule = lambda items, **options: schedule(items, fixed_width=fixed_width, **options)
    return m


@settings(max_examples=100, deadline=None)
@given(config=st.sampled_from(sorted(CONFIGS)), caching=st.booleans(), slab_pages=st.sampled_from([1, 2, 3]),
       budget_share=st.sampled_from([1.0, 1.5, 3.0]), seed=st.integers(0, 999), data=st.data())
def test_fixed_width_changes_nothing_but_the_table_width(config, caching, slab_pages, budget_share, seed, data):
    ctx = CONFIGS[config][2]
    op = st.one_of(st.tuples(st.just("join"), st.integers(1, ctx // 3)), st.tuples(st.just("leave"), st.integers(0, 4)),
                   st.tuples(st.just("step"), st.just(True)), st.tuples(st.just("step"), st.just(True)))
    program = data.draw(st.lists(op, min_size=20, max_size=150), label="program")
    fixed = serve(build(config, caching, budget_share, slab_pages, True), program, seed)
    plain = serve(build(config, caching, budget_share, slab_pages, False), program, seed)
    assert len(fixed) == len(plain)
    for k, (a, b) in enumerate(zip(fixed, plain)):
        assert a == b, k
