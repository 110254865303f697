"""What vLLM 0.33 allocates and logs for a DeepSeek-V4 KV budget, from its published
arithmetic (reimplemented here; nothing of vLLM is imported).

vLLM (FlashMLA path, ``fp8_ds_mla`` cache, FP8 indexer keys) gives every V4 layer
one cache per role, each page padded to a multiple of 576 B:

* window KV: 64 tokens a block, window 128, one per layer;
* compressed KV and indexer keys: 256 tokens a block (ratio 4: 64 rows; ratio
  128: 2 rows; indexer: 64 FP8 keys);
* compressor states (fp32 ``[C | Z]`` rows): ratio 4 and the indexer's 4 tokens a
  block (window 8), ratio 128 8 tokens a block (window 128).

Planning (``vllm/v1/core/kv_cache_planning.py``): layers of one spec type form a
bucket; buckets holding one layer of each page size per repeat are "balanced"
and are cut into groups of ``R`` repeats, ``R`` the divisor-like number that
pads the balanced layer counts least (at least the layers per page size of the
largest mixed balanced bucket); others stay whole. All groups draw block ids
from one pool; a block is as many bytes as the widest group's pages summed, and
``num_blocks = budget // block_bytes`` (block 0 is the null block).

Logged "maximum concurrency" (``get_max_concurrency_for_kv_cache_config``):
``num_blocks / sum over groups of the blocks one request at max_model_len may
take``: a full group ``ceil(L / 256)``, a sliding group
``ceil(min(W - 1 + in_flight, L) / T) + 1`` with ``in_flight`` = 2 batches of
``max_num_batched_tokens`` (vLLM 0.33 schedules asynchronously, two in flight).

What its manager really admits: a new request needs that same sum of blocks free
(``full_sequence_must_fit``), but once running holds only its window and state
blocks plus its history, so ``N`` requests fit while
``(N - 1) * held + need <= num_blocks - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridkv.memory.geometry import shared_concurrency
from hybridkv.models.layout import ModelCacheLayout
from hybridkv.plan import Limits, plan_for_budget
from hybridkv.units import format_bytes, format_tokens, plural

VLLM_VERSION = "0.33.0"
PAGE_ALIGNMENT_BYTES = 576
HISTORY_BLOCK_TOKENS = 256
WINDOW_BLOCK_TOKENS = 64
STATE_BLOCK_TOKENS = {4: 4, 128: 8}
STATE_WINDOW_TOKENS = {4: 8, 128: 128}
BATCHES_IN_FLIGHT = 2
FP32_BYTES = 4


@dataclass(frozen=True)
class VllmBucket:
    """Layers vLLM can put in one group: same kind, block tokens and window."""

    kind: str  # "window", "history" or "state"
    block_tokens: int
    window_tokens: int | None
    layers_by_page: tuple[tuple[int, int], ...]  # (padded page bytes, layers)

    @property
    def balanced(self) -> bool:
        return len({count for _, count in self.layers_by_page}) == 1

    @property
    def max_layers_per_page(self) -> int:
        return max(count for _, count in self.layers_by_page)


@dataclass(frozen=True)
class VllmGroup:
    kind: str
    block_tokens: int
    window_tokens: int | None
    num_layers: int
    page_bytes_sum: int  # bytes of one block id in this group's layers

    def request_blocks(self, context_tokens: int, in_flight_tokens: int) -> int:
        """Blocks vLLM reserves for one request at ``context_tokens`` (its admission cap)."""
        if self.window_tokens is None:
            return -(-context_tokens // self.block_tokens)
        tokens = min(self.window_tokens - 1 + in_flight_tokens, context_tokens)
        return -(-tokens // self.block_tokens) + 1

    def held_blocks(self, context_tokens: int) -> int:
        """Blocks a running request of ``context_tokens`` keeps between steps."""
        if self.window_tokens is None:
            return -(-context_tokens // self.block_tokens)
        first = max(context_tokens - self.window_tokens, 0) // self.block_tokens
        return (context_tokens - 1) // self.block_tokens - first + 1


def _padded(real_bytes: int) -> int:
    return -(-real_bytes // PAGE_ALIGNMENT_BYTES) * PAGE_ALIGNMENT_BYTES


def vllm_buckets(layout: ModelCacheLayout) -> list[VllmBucket]:
    """vLLM's per-layer caches of ``layout``'s main layers, bucketed by spec type."""
    if layout.indexer != "fp8":
        raise ValueError("vLLM 0.33 caches DeepSeek-V4 indexer keys in FP8: plan with indexer='fp8'")
    ratios = layout.layer_ratios[: layout.num_main_layers]
    count = {r: sum(1 for x in ratios if x == r) for r in (4, 128)}
    if count[4] == 0:
        raise ValueError("--compare vllm covers layouts with ratio-4 layers (DeepSeek-V4 Flash and Pro)")
    row, head = layout.kv_row_bytes, layout.head_dim
    kv_page = _padded(WINDOW_BLOCK_TOKENS * row)
    history = [(_padded(HISTORY_BLOCK_TOKENS // r * row), count[r]) for r in (4, 128) if count[r]]
    history.append((_padded(HISTORY_BLOCK_TOKENS // 4 * layout.indexer_row_bytes), count[4]))
    state4 = _padded(STATE_BLOCK_TOKENS[4] * 2 * 2 * head * FP32_BYTES)
    index_state = _padded(STATE_BLOCK_TOKENS[4] * 2 * 2 * layout.index_head_dim * FP32_BYTES)
    buckets = [
        VllmBucket("window", WINDOW_BLOCK_TOKENS, layout.sliding_window_tokens, ((kv_page, len(ratios)),)),
        VllmBucket("history", HISTORY_BLOCK_TOKENS, None, _merge(history)),
        VllmBucket("state", 4, STATE_WINDOW_TOKENS[4], _merge([(state4, count[4]), (index_state, count[4])])),
    ]
    if count[128]:
        state128 = _padded(STATE_BLOCK_TOKENS[128] * 2 * head * FP32_BYTES)
        buckets.append(VllmBucket("state", 8, STATE_WINDOW_TOKENS[128], ((state128, count[128]),)))
    return buckets


def _merge(pairs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: dict[int, int] = {}
    for page, layers in pairs:
        merged[page] = merged.get(page, 0) + layers
    return tuple(merged.items())


def least_padding_repeats(values: list[int], lower_bound: int) -> int:
    """The ``d >= lower_bound`` (up to ``max(values)``) that pads ``values`` up to
    multiples of ``d`` least; ties go to the larger ``d``."""
    best, best_pad = lower_bound, None
    for d in range(max(lower_bound, 1), max(values) + 1):
        pad = sum(-x % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def vllm_groups(buckets: list[VllmBucket]) -> list[VllmGroup]:
    """Buckets cut into groups as vLLM's block-outermost packing does (see module doc)."""
    floor = max(
        (b.max_layers_per_page for b in buckets if b.balanced and len(b.layers_by_page) > 1),
        default=0,
    )
    if not floor:
        raise ValueError("no balanced mixed bucket: this layout is outside what --compare vllm models")
    repeats = least_padding_repeats([b.max_layers_per_page for b in buckets if b.balanced], floor)
    groups = []
    for b in buckets:
        parts = -(-b.max_layers_per_page // repeats) if b.balanced else 1
        for index in range(parts):
            layers = sum(len(range(index, count, parts)) for _, count in b.layers_by_page)
            page_sum = sum(len(range(index, count, parts)) * page for page, count in b.layers_by_page)
            groups.append(VllmGroup(b.kind, b.block_tokens, b.window_tokens, layers, page_sum))
    return groups


@dataclass(frozen=True)
class VllmComparison:
    """hybridkv's plan next to vLLM's figures for the same budget (module doc)."""

    model: str
    budget_bytes: int
    context_tokens: int
    max_num_batched_tokens: int
    groups: tuple[VllmGroup, ...]
    block_bytes: int
    num_blocks: int
    request_blocks: int  # what one request must find free to be admitted
    held_blocks: int  # what it keeps once running
    hybridkv_requests: int
    hybridkv_total_tokens: int
    hybridkv_max_running: int
    hybridkv_page_space: str = "shared"  # the page space ``hybridkv_requests`` counts in (``compare_with_vllm``'s)

    @property
    def logged_concurrency(self) -> float:
        """vLLM's startup "Maximum concurrency for L tokens per request"."""
        return self.num_blocks / self.request_blocks

    @property
    def logged_tokens(self) -> int:
        """vLLM's startup "KV cache size: N tokens" (concurrency x L)."""
        return int(self.logged_concurrency * self.context_tokens)

    @property
    def admitted_requests(self) -> int:
        """Requests at L its manager really admits at once (memory only)."""
        free = self.num_blocks - 1  # block 0 is the null block
        if free < self.request_blocks:
            return 0
        return 1 + (free - self.request_blocks) // self.held_blocks

    def report(self) -> dict[str, Any]:
        return {
            "engine": f"vllm {VLLM_VERSION}",
            "model": self.model,
            "budget_bytes": self.budget_bytes,
            "context_tokens": self.context_tokens,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "vllm": {
                "groups": [
                    {
                        "kind": g.kind, "layers": g.num_layers, "block_tokens": g.block_tokens,
                        "window_tokens": g.window_tokens, "block_bytes_in_group": g.page_bytes_sum,
                    }
                    for g in self.groups
                ],
                "block_bytes": self.block_bytes,
                "num_blocks": self.num_blocks,
                "request_blocks": self.request_blocks,
                "held_blocks": self.held_blocks,
                "logged_kv_cache_tokens": self.logged_tokens,
                "logged_max_concurrency": self.logged_concurrency,
                "admitted_requests": self.admitted_requests,
            },
            "hybridkv": {
                "total_tokens": self.hybridkv_total_tokens,
                "max_requests": self.hybridkv_requests,
                "max_running_requests": self.hybridkv_max_running,
                "page_space": self.hybridkv_page_space,
            },
        }

    def lines(self) -> list[str]:
        at, admitted, logged = format_tokens(self.context_tokens), self.admitted_requests, self.logged_concurrency
        need = ", ".join(
            f"{kind} {' + '.join(f'{n:,}' for n in blocks)}" for kind, blocks in self._need_by_kind().items()
        )
        ratio = f"{admitted / logged:.1f}x" if logged else "-"
        return [
            f"{format_bytes(self.budget_bytes)} per GPU, {self.model} at {at}: vLLM {VLLM_VERSION} "
            f"admits {plural(admitted, 'request')}, logs {logged:.2f}x",
            f"hybridkv     fits {plural(self.hybridkv_requests, 'request')} at {at} "
            + ("(one shared arena)" if self.hybridkv_page_space == "shared"
               else f"(per-group pools, {self.hybridkv_total_tokens:,}-token budget)"),
            f"vLLM pool    {len(self.groups)} groups share {self.num_blocks:,} blocks x {self.block_bytes:,} B",
            f"vLLM logs    KV cache size {self.logged_tokens:,} tokens; maximum concurrency "
            f"{logged:.2f}x at {self.context_tokens:,} tokens",
            f"             (--max-model-len {self.context_tokens} --max-num-batched-tokens "
            f"{self.max_num_batched_tokens})",
            f"why lower    it divides {self.num_blocks:,} blocks by {self.request_blocks:,}, what a new "
            "request must find free",
            f"             ({need}); a running one holds {self.held_blocks:,}",
            f"trust        {admitted:,}: the requests vLLM's manager really admits "
            f"(hybridkv: {self.hybridkv_requests:,}); the logged",
            f"             {logged:.2f}x counts every request at its admission reserve: {ratio} too low",
        ]

    def _need_by_kind(self) -> dict[str, list[int]]:
        in_flight = BATCHES_IN_FLIGHT * self.max_num_batched_tokens
        out: dict[str, list[int]] = {}
        for g in self.groups:
            out.setdefault(g.kind, []).append(g.request_blocks(self.context_tokens, in_flight))
        return out


def compare_with_vllm(
    layout: ModelCacheLayout, limits: Limits, budget_bytes: int, context_tokens: int, *,
    page_space: str = "shared",
) -> VllmComparison:
    """vLLM's allocation for ``budget_bytes`` with ``--max-model-len context_tokens`` and
    ``--max-num-batched-tokens limits.max_scheduled_tokens``, next to hybridkv's plan in
    ``page_space`` (``plan_for_budget``'s; the requests it fits counted there)."""
    groups = vllm_groups(vllm_buckets(layout))
    block_bytes = max(g.page_bytes_sum for g in groups)
    num_blocks = budget_bytes // block_bytes
    in_flight = BATCHES_IN_FLIGHT * limits.max_scheduled_tokens
    plan = plan_for_budget(layout, budget_bytes, limits, page_space=page_space)
    fits = (shared_concurrency(plan, context_tokens) if page_space == "shared"
            else plan.max_concurrent_requests(context_tokens))
    return VllmComparison(
        model=layout.name,
        budget_bytes=budget_bytes,
        context_tokens=context_tokens,
        max_num_batched_tokens=limits.max_scheduled_tokens,
        groups=tuple(groups),
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        request_blocks=sum(g.request_blocks(context_tokens, in_flight) for g in groups),
        held_blocks=sum(g.held_blocks(context_tokens) for g in groups),
        hybridkv_requests=fits,
        hybridkv_total_tokens=plan.total_tokens,
        hybridkv_max_running=limits.max_running_requests,
        hybridkv_page_space=page_space,
    )


__all__ = ["VllmComparison", "VllmGroup", "compare_with_vllm", "least_padding_repeats", "vllm_groups"]
