"""Token hit rate of the prefix cache on the multi-turn workload, against the ideal.

Run: ``.venv/bin/python bench/prefix_study.py`` (about 25 s). The
numbers are quoted in ``docs/prefix-caching.md``.

Workload: ``multiturn_workload(32, 4, seed=0)``: 32 conversations x 4 turns
sharing one 2,000-token system prompt; turn k+1's prompt is turn k's prompt,
answer and a new user message. Requests run one after another in list order
(turn-major): each is prefilled in 2,048-token steps, then decodes its answer
one token per step (``append_token_ids`` + a 1-token step; the last answer
token is never fed), then is freed. Pools are large enough that nothing is
evicted, so the gap to the ideal is the matching rule alone.

The ideal is ``ideal_hit_tokens``: every token shared with an earlier request
(prompt + all but the last answer token) is hit, capped at prompt - 1, at a
1-token grain and rounded down to the 256-token grain.
"""

from __future__ import annotations

import time

import numpy as np

from hybridkv.runtime.manager import CacheManager
from hybridkv.models.layout import cache_layout
from hybridkv.sim.workloads import ideal_hit_tokens, multiturn_workload

CHUNK_TOKENS = 2048
GRAIN_TOKENS = 256


def run(requests, **options) -> tuple[np.ndarray, dict[str, int]]:
    """Hit tokens per request, and cached pages per group at the end."""
    specs = cache_layout("deepseek-v4-flash").specs
    longest = max(r.prompt_tokens + r.output_tokens for r in requests)
    mgr = CacheManager(
        specs,
        {s.group_id: 8192 if s.is_sliding is False else 65536 for s in specs},
        max_context_tokens=longest,
        max_step_tokens=CHUNK_TOKENS,
        enable_prefix_caching=True,
        **options,
    )
    hits = np.zeros(len(requests), dtype=np.int64)
    for i, req in enumerate(requests):
        rid = req.request_id
        hits[i] = mgr.add_request(rid, req.prompt_token_ids, max_new_tokens=req.output_tokens).hit_tokens
        while (done := mgr.num_computed_tokens(rid)) < req.prompt_tokens:
            mgr.schedule([(rid, min(CHUNK_TOKENS, req.prompt_tokens - done))])
        for token in req.output_token_ids[:-1].tolist():
            mgr.append_token_ids(rid, [token])
            mgr.schedule([(rid, 1)])
        mgr.free(rid)
    stats = mgr.stats()
    assert sum(s.evicted_pages for s in stats.values()) == 0
    return hits, {gid: s.cached_pages for gid, s in stats.items()}


def main() -> None:
    requests = multiturn_workload(32, 4, seed=0)
    prompt_tokens = sum(r.prompt_tokens for r in requests)
    first_turns = np.array([r.turn == 0 for r in requests])
    rows = [
        ("ideal, 1-token grain", ideal_hit_tokens(requests, grain_tokens=1)),
        ("ideal, 256-token grain", ideal_hit_tokens(requests, grain_tokens=GRAIN_TOKENS)),
    ]
    cached = {}
    for label, options in [
        ("hybridkv, default (prompt checkpoints on)", {}),
        ("hybridkv, prompt_checkpoints=False", {"prompt_checkpoints": False}),
        ("hybridkv, prompt_checkpoints=False, state_checkpoint_interval=256",
         {"prompt_checkpoints": False, "state_checkpoint_interval": 256}),
    ]:
        start = time.perf_counter()
        hits, cached[label] = run(requests, **options)
        rows.append((label, hits))
        print(f"# {label}: {time.perf_counter() - start:.1f} s")
    print(f"{len(requests)} requests, {prompt_tokens:,} prompt tokens\n")
    print("| configuration | hit tokens | token hit rate | turn-0 hit tokens | later-turn hit tokens |")
    print("|---|---|---|---|---|")
    for label, hits in rows:
        print(
            f"| {label} | {int(hits.sum()):,} | {hits.sum() / prompt_tokens:.1%} | "
            f"{int(hits[first_turns].sum()):,} | {int(hits[~first_turns].sum()):,} |"
        )
    print("\ncached pages per group at the end:")
    for label, pages in cached.items():
        print(f"  {label}: {pages}")


if __name__ == "__main__":
    main()
