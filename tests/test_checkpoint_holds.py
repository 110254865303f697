"""Holds on checkpoints over a long run (``PrefixCache.check_holds``, run by
``CacheManager.check_invariants``): every hold is on a cached entry and counts at least the
live requests keeping it; what freed requests leave (their terminals' holds) goes with the
entry, so nothing outlives the cache.

Random programs, every checkpoint policy: requests sharing a few system prompts (hits at
their checkpoints), prefilled in chunks, decoded (superseding their checkpoints), some freed
early, over pools small enough to evict; the invariants after every step. When every request
is freed no page is used; after ``clear_prefix_cache`` every page is free and the holds are
gone with the entries.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from test_checkpoint_policies import POLICY_OPTIONS
from test_prefix import C4KV, C128KV, SWA, cat, ids, make_manager

# Small enough for the window and compressed-KV groups to evict cached entries.
GROUP_PAGES = {SWA: 40, C4KV: 24, C128KV: 24}
SYSTEM_PROMPTS = [ids(100 + i, n) for i, n in enumerate((260, 530, 800))]

request = st.tuples(
    st.integers(0, len(SYSTEM_PROMPTS) - 1),  # its system prompt
    st.integers(1, 300),  # its own tokens after it
    st.integers(0, 300),  # tokens decoded (fed back) before its free
)


def run_program(policy: str, requests: list, most_live: int, chunk_tokens: int):
    mgr = make_manager(pages=800, group_pages=GROUP_PAGES, prompt_checkpoints=None, checkpoint_policy=policy, **POLICY_OPTIONS[policy])
    waiting, live = list(enumerate(requests)), {}
    while waiting or live:
        while waiting and len(live) < most_live:
            n, (system, own_tokens, decoded_tokens) = waiting.pop(0)
            prompt = cat(SYSTEM_PROMPTS[system], ids(10_000 + n, own_tokens))
            mgr.add_request(f"r{n}", prompt, max_new_tokens=decoded_tokens + 1)
            live[f"r{n}"] = [prompt.size, decoded_tokens]
        items = []
        for rid, (prompt_tokens, _) in live.items():
            done = mgr.num_computed_tokens(rid)
            if done < prompt_tokens:
                items.append((rid, min(chunk_tokens, prompt_tokens - done)))
            else:
                mgr.append_token_ids(rid, [done % 1000])
                items.append((rid, 1))
        mgr.schedule(items)
        mgr.check_invariants()
        for rid, left in list(live.items()):
            if mgr.num_computed_tokens(rid) >= left[0]:
                left[1] -= 1
                if left[1] <= 0:
                    mgr.free(rid)
                    del live[rid]
                    mgr.check_invariants()
    return mgr


@settings(max_examples=25)
@given(policy=st.sampled_from(sorted(POLICY_OPTIONS)), requests=st.lists(request, min_size=1, max_size=12),
       most_live=st.integers(1, 4), chunk_tokens=st.sampled_from([256, 300, 512]))
def test_no_hold_outlives_its_entry_or_its_requests(policy, requests, most_live, chunk_tokens):
    mgr = run_program(policy, requests, most_live, chunk_tokens)
    assert mgr.num_requests == 0
    assert all(s.used_pages == 0 for s in mgr.stats().values())
    mgr.clear_prefix_cache()
    mgr.check_invariants()  # no hold left: none is on a cached entry
    assert all(s.free_pages == s.total_pages and s.cached_pages == 0 for s in mgr.stats().values())


def test_a_long_run_evicts_in_every_small_group():
    """What the property's programs do at their longest: evicting keeps the holds right."""
    mgr = run_program("terminal-and-junctions", [(n % 3, 1 + 37 * n % 300, 7 * n % 200) for n in range(40)], 4, 300)
    assert {gid for gid, s in mgr.stats().items() if s.evicted_pages} >= {SWA, C4KV, C128KV}
