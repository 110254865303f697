"""A step's commits in one ``PrefixCache.commit_requests`` call equal one commit at a time.

Two managers get the same calls; on ``one``, ``prefix.commit_requests`` is wrapped to
commit one request per call (the reference: each request's commit done and its events
emitted before the next starts), each alone (``PrefixCache._commit_one``: ``build``). Random programs join requests whose prompts share
prefixes (hits, keys some group already has), prefill them in chunks beside decoding
rows (many rows cross a block at the same step: decode commits, one after a prompt
chunk of several blocks), append the same tokens to requests with the same content (two
rows committing one key at one step), rewind and free them. After every call: the same
batches (block tables), events (same order), ``stats()`` and prefix statistics; at the
end the same cached entries, holds and free pages.
"""

import hypothesis.strategies as st
import numpy as np
from hypothesis import event, given, settings

from hybridkv.runtime.manager import CacheManager
from test_decode_fast_path import on_both
from test_table_updates import CONFIGS

GRAIN = {"v4": 256, "odd": 60}
NEVER = 1 << 20  # grains: a pinning interval beyond every request's tokens


def build(config, seed, policy, eviction, scale=1, step_tokens=None):
    """The batched manager and the one-at-a-time one (``scale`` times the config's pages);
    a list of the requests per batched call. The one-at-a-time one pins checkpoints every
    ``NEVER`` grains (a boundary no request reaches: it pins none), which keeps its commits
    off the units claimed whole (``PrefixCache._commit_alone``): each commits alone, the
    reference for them."""
    specs, pages, ctx, step = CONFIGS[config]
    pages = {gid: n * scale for gid, n in pages.items()}
    managers = [CacheManager(specs, pages, max_context_tokens=max(ctx, 1600), max_step_tokens=step_tokens or step,
                             shuffle_seed=seed, enable_prefix_caching=True, prefix_granularity=GRAIN[config],
                             checkpoint_policy=policy, eviction_policy=eviction,
                             state_checkpoint_interval=interval)
                for interval in (None, NEVER * GRAIN[config])]
    one, calls = managers[1].prefix, []
    batched = managers[0].prefix.commit_requests

    def counted(reqs, old_tokens, new_tokens):
        calls.append(len(reqs))
        batched(reqs, old_tokens, new_tokens)

    def one_at_a_time(reqs, old_tokens, new_tokens, inner=one.commit_requests):
        for req, old, new in zip(reqs, old_tokens, new_tokens):
            inner([req], [old], [new])

    managers[0].prefix.commit_requests = counted
    one.commit_requests = one_at_a_time
    return managers, calls


def same_state(a, b):
    """Same events (in order), statistics and cached entries on both managers."""
    assert a.prefix.drain_events() == b.prefix.drain_events()
    assert a.stats() == b.stats()
    assert a.prefix.stats == b.prefix.stats
    assert a.prefix.value_report() == b.prefix.value_report()


def same_batch(a, b):
    assert (a is None) == (b is None)
    if a is None:
        return
    assert a.request_ids == b.request_ids
    for gid, gb in b.groups.items():
        assert np.array_equal(a.groups[gid].block_table, gb.block_table), gid
        assert np.array_equal(a.groups[gid].write_slots, gb.write_slots), gid


def step_items(managers, data, live, grain):
    """Every live request's next tokens (or a drawn subset's): its prompt's rest in chunks of
    up to two blocks, else 1-2 new ones, the same ids for every request of the step when
    drawn so (appended), listed."""
    m, items = managers[0], []
    rids = sorted(live)
    if data.draw(st.integers(0, 3), label="subset") == 0:
        rids = data.draw(st.lists(st.sampled_from(rids), min_size=1, unique=True), label="rows")
    shared = data.draw(st.booleans(), label="same tokens")
    new_ids = data.draw(st.lists(st.integers(0, 3), min_size=2, max_size=2), label="ids")
    for rid in rids:
        left = live[rid] - m.num_computed_tokens(rid)
        if left > 0:
            items.append((rid, min(left, data.draw(st.integers(1, 2 * grain), label="chunk"))))
            continue
        n = data.draw(st.integers(1, 2), label="n")
        ids = new_ids[:n] if shared else data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="own")
        on_both(managers, "append_token_ids", rid, np.array(ids, dtype=np.int32))
        items.append((rid, n))
    return items


@settings(max_examples=150, deadline=None)
@given(config=st.sampled_from(sorted(CONFIGS)), seed=st.sampled_from([None, 5]),
       policy=st.sampled_from([None, "prefill-per-byte", "terminal-and-junctions"]),
       eviction=st.sampled_from(["value", "group-lru"]), data=st.data())
def test_commits_in_one_call_equal_one_at_a_time(config, seed, policy, eviction, data):
    grain = GRAIN[config]
    managers, calls = build(config, seed, policy, eviction, scale=3, step_tokens=12 * grain)
    specs = CONFIGS[config][0]
    material = [np.arange(4000, dtype=np.int32) % 7, (np.arange(4000, dtype=np.int32) * 3) % 5]
    lengths = [1, 7, grain - 1, grain + 1, 2 * grain - 2, 2 * grain + 3, 3 * grain - 1]
    live, next_id = {}, 0
    for _ in range(data.draw(st.integers(4, 40), label="ops")):
        op = data.draw(st.sampled_from(["join", "step", "step", "step", "step", "rewind", "free"]), label="op")
        if op == "join" or not live:
            start = data.draw(st.integers(0, 2), label="start")
            prompt = data.draw(st.sampled_from(lengths), label="prompt")
            base = material[data.draw(st.integers(0, 1), label="material")][start:start + prompt]
            rid, next_id = f"r{next_id}", next_id + 1
            _, err = on_both(managers, "add_request", rid, base, max_new_tokens=3 * grain)
            if err is None:
                live[rid] = prompt
        elif op == "step":
            batches, err = on_both(managers, "schedule", step_items(managers, data, live, grain))
            if err is None:
                same_batch(*batches)
        elif op == "rewind":
            rid = data.draw(st.sampled_from(sorted(live)), label="rewound")
            keep = managers[0].num_computed_tokens(rid) - data.draw(st.integers(0, 2), label="back")
            on_both(managers, "rewind", rid, max(keep, 0))
        else:
            rid = data.draw(st.sampled_from(sorted(live)), label="freed")
            on_both(managers, "free", rid)
            del live[rid]
        same_state(*managers)
    event(f"most requests committed in one call: {min(max(calls, default=0), 4)}")
    for m in managers:
        m.check_invariants()
    a, b = managers
    for s in specs:
        pa, pb = a.pools[s.group_id], b.pools[s.group_id]
        assert pa.entry_keys() == pb.entry_keys(), s.group_id
        assert [pa.lookup(k) for k in pa.entry_keys()] == [pb.lookup(k) for k in pb.entry_keys()], s.group_id
        assert np.array_equal(pa.ref_counts, pb.ref_counts), s.group_id


def test_decode_rows_crossing_together_commit_in_one_call():
    """Eight requests, four pairs with the same prompt and tokens, decode across block
    ends at the same steps (two rows per key: the second commits after the first's keys
    are known) until the pools evict: every step's commits in one call, all equal."""
    managers, calls = build("v4", 5, None, "value", scale=4)
    for i in range(8):
        prompt = (np.arange(250 + 40 * (i // 2), dtype=np.int32) + i // 2) % 9
        on_both(managers, "add_request", f"r{i}", prompt, max_new_tokens=900)
    rids = [f"r{i}" for i in range(8)]
    while any(managers[0].num_computed_tokens(r) < 250 + 40 * (i // 2) for i, r in enumerate(rids)):
        items = [(r, min(8, 250 + 40 * (i // 2) - managers[0].num_computed_tokens(r))) for i, r in enumerate(rids)]
        batches, err = on_both(managers, "schedule", [(r, n) for r, n in items if n > 0])
        assert err is None
        same_batch(*batches)
        same_state(*managers)
    for step in range(300):
        for r in rids:
            on_both(managers, "append_token_ids", r, [step % 5])
        batches, err = on_both(managers, "schedule", [(r, 1) for r in rids])
        if err is not None:
            break
        same_batch(*batches)
        same_state(*managers)
    assert step > 250 and max(calls) >= 4
    a, b = managers
    assert a.stats() == b.stats()
