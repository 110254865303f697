"""Capacity phase: requests of ``context_tokens`` that fit, measured and computed.

Unique requests of ``context_tokens - 1`` prompt tokens are admitted one by one,
prefilled in chunks, then given one decode step (so each holds its
steady-state pages), until the pool refuses one. ``min_chunk_tokens``: a
refused chunk after the first is retried at half size down to that many
tokens (``sides.advance``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hybridkv.models.layout import cache_layout
from hybridkv.sim.workloads import DEFAULT_VOCAB_SIZE

from .sides import CacheSide, advance


def measure_capacity(side: CacheSide, *, context_tokens: int, chunk_tokens: int, seed: int, limit: int,
                     min_chunk_tokens: int | None = None) -> dict[str, Any]:
    """Admit unique requests one by one until the pool refuses one."""
    if not side.reset_prefix_cache():
        raise RuntimeError(f"{side.name}: prefix cache could not be reset before capacity")
    rng = np.random.default_rng(seed + 3)
    prompt_tokens = context_tokens - 1
    admitted = []
    refused_at = "none (limit reached)"
    for index in range(limit):
        prompt = rng.integers(0, DEFAULT_VOCAB_SIZE, size=prompt_tokens, dtype=np.int32)
        request = side.new_request(f"cap-{index}", prompt, max_tokens=2)
        side.probe_hit(request)
        if not side.allocate(request, min(chunk_tokens, prompt_tokens)):
            refused_at = "admission"
            break
        if advance(side, request, prompt_tokens, chunk_tokens, min_chunk_tokens):
            side.append_tokens(request, [int(rng.integers(0, DEFAULT_VOCAB_SIZE))])
            side.begin_step()
            if side.allocate(request, 1):
                admitted.append(request)
                continue
            refused_at = "first decode step"
        else:
            refused_at = f"prefill chunk at token {side.num_computed_tokens(request)}"
        side.free(request)
        break
    used_blocks = side.num_total_blocks() - side.num_free_blocks()
    first_request_pages = side.pages_per_group(admitted[0]) if admitted else []
    for request in admitted:
        side.free(request)
    side.take_timings()
    return dict(
        context_tokens=context_tokens,
        chunk_tokens=chunk_tokens,
        min_chunk_tokens=min_chunk_tokens or chunk_tokens,
        measured_requests=len(admitted),
        refused_at=refused_at,
        blocks_used_when_refused=int(used_blocks),
        blocks_per_request=float(used_blocks / max(len(admitted), 1)),
        first_request_pages_per_group=first_request_pages,
        computed_requests=float(side.computed_capacity(context_tokens)),
    )


def byte_ideal_capacity(kv_memory_bytes: int, context_tokens: int) -> dict[str, Any]:
    """Requests of ``context_tokens`` that fit if every byte held live cache (no padding)."""
    layout = cache_layout("deepseek-v4-flash", indexer="fp8")
    request_bytes = context_tokens * layout.ideal_bytes_per_token + layout.ideal_bytes_per_request
    return dict(
        ideal_bytes_per_token=layout.ideal_bytes_per_token,
        fixed_bytes_per_request=layout.ideal_bytes_per_request,
        requests=kv_memory_bytes / request_bytes,
    )


def layout_capacity_bound(kv_memory_bytes: int, held_pages: Sequence[int], chunk_tokens: int) -> dict[str, Any]:
    """The most requests any manager fits with hybridkv's kernel page sizes if no byte
    were lost: each request holds what the first one held after its first decode step,
    and the last one's final prefill chunk (``chunk_tokens``) also needs its sliding
    groups' chunk pages: ``N = floor((budget - chunk_bytes) / request_bytes)``."""
    layout = cache_layout("deepseek-v4-flash", indexer="fp8")
    request_bytes = sum(pages * g.page_bytes for pages, g in zip(held_pages, layout.groups))
    chunk_bytes = 0
    for pages, g in zip(held_pages, layout.groups):
        spec = g.spec
        if spec.is_sliding:
            span = -(-(spec.sliding_window_tokens - 1 + chunk_tokens) // spec.page_tokens) + 1
            chunk_bytes += max(span - pages, 0) * g.page_bytes
    return dict(
        chunk_tokens=chunk_tokens,
        request_bytes=request_bytes,
        last_chunk_extra_bytes=chunk_bytes,
        requests=(kv_memory_bytes - chunk_bytes) // request_bytes,
    )
