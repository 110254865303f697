"""A prefix offloaded by one instance and hit from the tier by another: the hit's rows are
loaded, the rest of the prompt is computed on top of them, and every output equals an
instance that computed everything (the reference layers, bit for bit)."""

import numpy as np

from hybridkv.models.layout import cache_layout
from hybridkv.reference.config import ReferenceConfig
from hybridkv.reference.scenario import build_runner
from hybridkv.tiers import DiskTier, HostTier, ObjectStore, TierStack, group_pools_from_layers
from hybridkv.transfer import pages_from_manager, pages_from_step, plan_prefix_load, plan_prefix_offload

LAYOUT = cache_layout(ReferenceConfig().hf_config(), speculative_tokens=3)
ATOL = 1e-9


def run_tokens(runner, rid, tokens, chunk):
    """Schedule ``tokens`` more of ``rid`` and compute them; the outputs by position."""
    batch = runner.manager.schedule([(rid, chunk)])
    return runner.stack.forward(batch, tokens).hidden


def decode(runner, rid, tokens):
    outs = []
    for token in tokens:
        runner.manager.append_token_ids(rid, [token])
        outs.append(run_tokens(runner, rid, np.array([token]), 1))
    return np.concatenate(outs)


def offload_prompt(store, prompt, checkpoints_at):
    a = build_runner(shuffle_seed=3)
    a.manager.add_request("p", prompt, max_new_tokens=8)
    batch = a.manager.schedule([("p", prompt.size)])
    a.stack.forward(batch, prompt)
    plan = plan_prefix_offload(store, prompt, prompt.size, pages_from_step(batch, "p"), checkpoints_at=checkpoints_at)
    assert all(plan.run(store, group_pools_from_layers(LAYOUT, a.stack.pools)))
    return a


def hit_from_tier(store, prompt, tail):
    """B loads what the tier serves, computes the rest and decodes ``tail``; C computes all."""
    b, c = build_runner(shuffle_seed=11), build_runner(shuffle_seed=5, enable_prefix_caching=False)
    plan = plan_prefix_load(store, prompt)
    b.manager.add_request("q", prompt, max_new_tokens=8)
    got = 0
    if plan.boundary_tokens:
        b.manager.schedule([("q", plan.boundary_tokens)])  # pages for the hit; nothing computed
        result = plan.run(store, group_pools_from_layers(LAYOUT, b.stack.pools), pages_from_manager(b.manager, "q"))
        got = result.boundary_tokens
        assert got == plan.boundary_tokens  # (a load that fell back further would recompute from there)
    rest = run_tokens(b, "q", prompt[got:], prompt.size - got)
    c.manager.add_request("q", prompt, max_new_tokens=8)
    full = run_tokens(c, "q", prompt, prompt.size)
    # B computes in two chunks, C in one: float64 sums round differently (about 1e-15 here);
    # a wrong or missing row moves outputs by far more than ATOL (see the handoff tests' control)
    np.testing.assert_allclose(rest, full[got:], rtol=0, atol=ATOL)
    np.testing.assert_allclose(decode(b, "q", tail), decode(c, "q", tail), rtol=0, atol=ATOL)
    return plan, got


def test_a_prefix_hit_from_the_tier_computes_the_same_as_no_hit(tmp_path):
    store = ObjectStore(TierStack([HostTier(1 << 20), DiskTier(tmp_path)]), LAYOUT)  # host too small for all
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1024, 700)
    offload_prompt(store, prompt, checkpoints_at=[256, 512])
    other = np.concatenate([prompt[:600], rng.integers(0, 1024, 50)])  # shares 600 tokens
    plan, got = hit_from_tier(store, other, rng.integers(0, 1024, 5))
    assert plan.boundaries == (256, 512) and got == 512
    kinds = sorted((o.key.kind, o.key.group_id, o.first_token) for o in plan.objects)
    assert ("checkpoint", "v4.swa_kv", 512 - 16) in kinds and ("block", "v4.c4a.compressed_kv", 256) in kinds


def test_no_checkpoint_no_hit_and_a_lost_block_falls_back_to_the_shorter_boundary():
    host = HostTier(1 << 30)
    store = ObjectStore(host, LAYOUT)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 1024, 600)
    offload_prompt(store, prompt, checkpoints_at=[512])
    # a prompt whose only stored checkpoint is beyond what it shares: history alone is no hit
    short = np.concatenate([prompt[:400], rng.integers(0, 1024, 20)])
    assert plan_prefix_load(store, short).boundaries == ()
    # checkpoints at 256 and 512, then the c4 block [256, 512) goes missing after planning
    store2 = ObjectStore(HostTier(1 << 30), LAYOUT)
    offload_prompt(store2, prompt, checkpoints_at=[256, 512])
    plan = plan_prefix_load(store2, prompt)
    assert plan.boundaries == (256, 512)
    lost = next(o.key for o in plan.objects if o.key.kind == "block" and o.first_token == 256)
    assert store2.delete([lost]) == 1
    b = build_runner(shuffle_seed=11)
    b.manager.add_request("q", prompt, max_new_tokens=8)
    b.manager.schedule([("q", 512)])
    result = plan.run(store2, group_pools_from_layers(LAYOUT, b.stack.pools), pages_from_manager(b.manager, "q"))
    assert result.boundary_tokens == 256 and result.missing == (lost,)


def test_offload_leaves_out_checkpoints_whose_window_is_released():
    a = build_runner(shuffle_seed=3)
    prompt = np.random.default_rng(2).integers(0, 1024, 600)
    a.manager.add_request("p", prompt, max_new_tokens=8)
    a.manager.schedule([("p", 300)])
    a.manager.schedule([("p", 300)])  # the first chunk's window pages are released now
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    plan = plan_prefix_offload(store, prompt, 600, pages_from_manager(a.manager, "p"), checkpoints_at=[256, 512])
    boundaries = {o.boundary_tokens for o in plan.objects if o.key.kind == "checkpoint"}
    assert boundaries == {512}
    assert sum(o.key.kind == "block" for o in plan.objects) == 4  # 2 blocks x 2 history groups


def test_an_offload_plan_stores_what_gather_and_encode_make_one_object_at_a_time():
    """Objects of two requests (two page views) in one group and of several groups: the batched
    gather with headers written in place stores the bytes the one-object reference encodes."""
    from hybridkv.tiers import GroupPages, encode_object, gather_object, new_group_pools
    from hybridkv.transfer import OffloadPlan, prefix_objects

    rng = np.random.default_rng(4)
    pools = new_group_pools(LAYOUT, {g.group_id: 200 for g in LAYOUT.groups})
    for group in pools.values():
        for plane in group.planes:
            plane.pool[...] = rng.integers(0, 256, plane.pool.shape, dtype=np.uint8)
    prompt = np.arange(700) % 97
    objects, _ = prefix_objects(LAYOUT, prompt, 700, checkpoints_at=[256, 512])
    views = [{g.group_id: GroupPages(0, rng.permutation(np.arange(1, 200))) for g in LAYOUT.groups} for _ in range(2)]
    sources = [views[i % 2][o.key.group_id] for i, o in enumerate(objects)]  # two requests' views, interleaved
    store = ObjectStore(HostTier(1 << 30), LAYOUT)
    assert all(OffloadPlan(tuple(objects), tuple(sources)).run(store, pools))
    for o, view in zip(objects, sources):
        expected = encode_object(gather_object(pools[o.key.group_id], view, o.key, o.first_token, o.end_token),
                                 store.namespace)
        assert store.tier.get([store.name(o.key)]) == [expected]
