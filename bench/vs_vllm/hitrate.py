"""Multi-turn phase: token hit rate of conversations sharing a system prompt.

``multiturn_workload``'s requests are served one after another in list order
(the order ``ideal_hit_tokens`` assumes): probe, prefill in chunks, decode the
answer token by token, free.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridkv.sim.workloads import ideal_hit_tokens, multiturn_workload

from .sides import CacheSide, advance, step_ns


def multiturn_requests(conversations: int, turns: int, *, system_prompt_tokens: int, seed: int) -> list:
    return multiturn_workload(conversations, turns, seed=seed, system_prompt_tokens=system_prompt_tokens)


def hit_bounds(workload: list) -> dict[str, Any]:
    """The best hit rates any manager can reach on ``workload`` (1-token and 256-token grain)."""
    prompt_total = sum(r.prompt_tokens for r in workload)
    return dict(
        ideal_hit_rate=float(ideal_hit_tokens(workload).sum() / prompt_total),
        grain_256_hit_rate=float(ideal_hit_tokens(workload, grain_tokens=256).sum() / prompt_total),
        prompt_tokens=int(prompt_total),
    )


def measure_multiturn(side: CacheSide, workload: list, *, chunk_tokens: int) -> dict[str, Any]:
    """Token hit rate with requests served one after another in workload order."""
    if not side.reset_prefix_cache():
        raise RuntimeError(f"{side.name}: prefix cache could not be reset before multiturn")
    hits = np.zeros(len(workload), dtype=np.int64)
    side.take_timings()
    manager_ns = 0
    for index, item in enumerate(workload):
        request = side.new_request(item.request_id, item.prompt_token_ids, max_tokens=item.output_tokens)
        hits[index] = side.probe_hit(request)
        if not advance(side, request, item.prompt_tokens, chunk_tokens):
            raise RuntimeError(f"{side.name}: multiturn request {item.request_id} refused")
        side.append_tokens(request, [int(item.output_token_ids[0])])
        for token in item.output_token_ids[1:]:
            side.begin_step()
            if not side.allocate(request, 1):
                raise RuntimeError(f"{side.name}: multiturn decode refused")
            side.append_tokens(request, [int(token)])
        side.free(request)
        manager_ns += step_ns(side.take_timings())
    prompt_tokens = int(sum(r.prompt_tokens for r in workload))
    return dict(
        requests=len(workload),
        prompt_tokens=prompt_tokens,
        hit_tokens=int(hits.sum()),
        hit_rate=float(hits.sum() / prompt_tokens),
        manager_ms_total=float(manager_ns / 1e6),
    )
