"""Prefill -> decode handoff through objects: two managers with different page ids, the
reference layers on both, and the decode instance's next token computed from loaded rows only."""

import numpy as np
import pytest

from hybridkv.models.layout import cache_layout
from hybridkv.reference.config import ReferenceConfig
from hybridkv.reference.scenario import build_runner
from hybridkv.tiers import HostTier, NamespaceMismatch, ObjectStore, group_pools_from_layers, layout_namespace
from hybridkv.transfer import (
    aligned_grain_tokens,
    checkpoint_tokens,
    load_objects,
    pages_from_manager,
    pages_from_step,
    plan_handoff,
)

LAYOUT = cache_layout(ReferenceConfig().hf_config(), speculative_tokens=3)


@pytest.fixture(scope="module")
def pair():
    # different shuffles: the two instances hold the same rows on different page ids
    return build_runner(shuffle_seed=3), build_runner(shuffle_seed=11)


def prefill(runner, rid, prompt, *, compute):
    runner.manager.add_request(rid, prompt, max_new_tokens=4)
    batch = runner.manager.schedule([(rid, prompt.size)])
    if compute:
        runner.stack.forward(batch, prompt)
    return batch


def decode(pair, rid, steps):
    """``steps`` decode steps on both instances with the same tokens; each side's outputs stacked."""
    outs = ([], [])
    for _ in range(steps):
        token = pair[0].new_tokens(1)
        for runner, out in zip(pair, outs):
            runner.manager.append_token_ids(rid, token)
            batch = runner.manager.schedule([(rid, 1)])
            out.append(runner.stack.forward(batch, token).hidden)
    return np.concatenate(outs[0]), np.concatenate(outs[1])


def handoff(pair, rid, boundary, *, drop=None, store=None):
    """A computes the prompt and exports; B schedules the prompt without computing and loads."""
    a, b = pair
    prompt = a.new_tokens(boundary)
    batch_a = prefill(a, rid, prompt, compute=True)
    store = store or ObjectStore(HostTier(1 << 30), LAYOUT)
    plan = plan_handoff(store, prompt, boundary, peer_namespace=layout_namespace(LAYOUT))
    objects = plan.export(group_pools_from_layers(LAYOUT, a.stack.pools), pages_from_step(batch_a, rid))
    store.put([o for o in objects if drop is None or not drop(o)])
    batch_b = prefill(b, rid, prompt, compute=False)
    pools_b = group_pools_from_layers(LAYOUT, b.stack.pools)
    before = [p.pool.copy() for g in pools_b.values() for p in g.planes]
    result = plan.load(store, pools_b, pages_from_manager(b.manager, rid))
    assert pages_from_manager(b.manager, rid).keys() == pages_from_step(batch_b, rid).keys()
    return plan, objects, result, before, pools_b


def finish(pair, rid):
    for runner in pair:
        runner.manager.free(rid)


@pytest.mark.parametrize("boundary", [256, 300, 131, 5, 254])
def test_decode_after_handoff_equals_decode_on_the_prefill_instance(pair, boundary):
    rid = f"h{boundary}"
    plan, objects, result, _, _ = handoff(pair, rid, boundary)
    assert result.boundary_tokens == boundary and result.missing == ()
    assert result.loaded_objects == len(plan.objects) == len(objects)
    # 4 steps close a ratio-4 window (reading the loaded states); from 254 a ratio-128 one too
    out_a, out_b = decode(pair, rid, 4)
    assert np.array_equal(out_a, out_b)  # bit for bit: same rows, other pages
    finish(pair, rid)


def test_plan_holds_history_below_and_only_the_checkpoint_at_the_boundary():
    store = ObjectStore(HostTier(1 << 20), LAYOUT)
    tokens = np.arange(600) % 50
    assert aligned_grain_tokens(LAYOUT) == 128
    plan = plan_handoff(store, tokens, 512)
    got = sorted((o.key.kind, o.key.group_id, o.first_token, o.end_token) for o in plan.objects)
    assert got == sorted([
        ("block", "v4.c4a.compressed_kv", 0, 256), ("block", "v4.c4a.compressed_kv", 256, 512),
        ("block", "v4.c128a.compressed_kv", 0, 256), ("block", "v4.c128a.compressed_kv", 256, 512),
        ("checkpoint", "v4.swa_kv", 512 - 16, 512),  # the reference model's 16-token window
        ("checkpoint", "v4.c4a.compressor_state", 508, 512),
        ("checkpoint", "v4.c4a.indexer_compressor_state", 508, 512),
        # the ratio-128 state needs nothing at a boundary that closes its window
    ])
    # off the grain: the window less one token, every sliding group
    assert [checkpoint_tokens(LAYOUT, g, 300) for g in ("v4.swa_kv", "v4.c4a.compressor_state",
                                                       "v4.c128a.compressor_state")] == [15, 7, 127]
    assert checkpoint_tokens(LAYOUT, "v4.swa_kv", 5) == 5


def test_a_peer_of_another_layout_is_refused_by_name():
    store = ObjectStore(HostTier(1 << 20), LAYOUT)
    peer = layout_namespace(cache_layout(ReferenceConfig(window_tokens=32).hf_config(), speculative_tokens=3))
    with pytest.raises(NamespaceMismatch, match=f"peer layout namespace {peer.hex}"):
        plan_handoff(store, np.arange(300), 300, peer_namespace=peer)


@pytest.mark.parametrize("lost", ["checkpoint", "block"])
def test_a_missing_object_loads_nothing_and_says_so(pair, lost):
    rid = f"lost-{lost}"
    dropped = []

    def drop(o):
        if o.key.kind == lost and not dropped:
            dropped.append(o.key)
            return True
        return False

    _, _, result, before, pools_b = handoff(pair, rid, 300, drop=drop)
    assert result.boundary_tokens == 0 and result.loaded_objects == 0
    assert result.missing == tuple(dropped)
    after = [p.pool for g in pools_b.values() for p in g.planes]
    assert all(np.array_equal(x, y) for x, y in zip(before, after))  # not one row written
    finish(pair, rid)


def test_a_corrupted_object_falls_back_and_a_skipped_group_would_be_caught(pair):
    host = HostTier(1 << 30)
    store = ObjectStore(host, LAYOUT)
    rid, boundary = "corrupt", 300
    a, b = pair
    prompt = a.new_tokens(boundary)
    batch_a = prefill(a, rid, prompt, compute=True)
    plan = plan_handoff(store, prompt, boundary)
    exported = plan.export(group_pools_from_layers(LAYOUT, a.stack.pools), pages_from_step(batch_a, rid))
    store.put(exported)
    window = next(i for i, o in enumerate(plan.objects) if o.key.group_id == "v4.swa_kv")
    name = store.name(plan.objects[window].key)
    raw = bytearray(host.get([name])[0])
    raw[len(raw) // 2] ^= 1  # one bit of the window checkpoint's rows
    assert host.delete([name]) == 1 and host.put([(name, bytes(raw))]) == [True]
    prefill(b, rid, prompt, compute=False)
    result = plan.load(store, group_pools_from_layers(LAYOUT, b.stack.pools), pages_from_manager(b.manager, rid))
    assert result.boundary_tokens == 0 and result.missing == (plan.objects[window].key,)
    assert store.stats().corrupt == 1
    # control: loading every other object and decoding anyway gives other outputs
    rest = [o for i, o in enumerate(plan.objects) if i != window]
    partial = load_objects(store, rest, [boundary], group_pools_from_layers(LAYOUT, b.stack.pools),
                           pages_from_manager(b.manager, rid))
    assert partial.boundary_tokens == boundary
    out_a, out_b = decode(pair, rid, 1)
    assert not np.array_equal(out_a, out_b)
    finish(pair, rid)
