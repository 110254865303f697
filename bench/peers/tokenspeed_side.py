"""tokenspeed's C++ scheduler (``tokenspeed-scheduler`` 0.1.30) as a line of the hit-rate sweep.

The cache of tokenspeed is reachable only through its bound ``Scheduler``, so
this side drives a whole scheduler, the way tokenspeed's engine loop does
(``tokenspeed/runtime/engine/event_loop.py``): ``submit_requests``, then per
round ``next_execution_plan`` and one ``advance`` with the round's results.
No model runs: a prefill chunk that does not finish the prompt is answered
with an empty ``ExtendResult``; the chunk that finishes it and every decode
step are answered with the next token of the workload's answer (the token a
model would have sampled), and the last one with ``Finish``. So the scheduler
computes the prompt and all but the last answer token, as in the other lines,
and caches them when the request finishes.

Sizing is tokenspeed's own: its DeepSeek-V4 cache recipe (``cache_recipe
("deepseek_v4", ...).setup()``, the ``tokenspeed`` 0.1.1 wheel) on the bundled
DeepSeek-V4-Flash config, FP8 indexer, the sweep's byte budget, context limit,
step token budget and running limit; then its runtime contract, its
``pool_to_cache_groups`` and ``make_config`` turn the plan into the scheduler's
config (no L2 host cache, prefix caching on, no overlap). Nothing is
allocated: the arena's bytes are never touched by the scheduler.

tokenspeed's Python package imports ``tokenspeed_kernel`` (GPU kernels) at
module level; when that package is absent, a stand-in module answers every
name with a function that raises, and ``dsv4_indexer_cache_format`` (the one
kernel-package call the sizing makes) with the format asked for ("mxfp4" when
FP4 is requested, else "fp8"). ``torchvision`` is a stand-in too
(``stand_ins``): transformers imports it when installed, and the wheel's
compiled ops need a CUDA torch.

The hit of a request is ``extend_prefix_lens`` of its first forward: the
prefix tokens the scheduler's admission found cached.
"""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from peers import peer_unavailable, stand_ins

SCHEDULER_VERSION = "0.1.30"
LINE = f"tokenspeed {SCHEDULER_VERSION}"
V4_PREFIX_GRANULARITY_TOKENS = 256  # tokenspeed's default for DeepSeek V4 (DEEPSEEK_V4_PAGE_SIZE)
MAX_ROUNDS_PER_REQUEST = 1 << 22


def _install_stand_ins() -> None:
    if importlib.util.find_spec("tokenspeed_kernel") is None:
        stand_ins.install("tokenspeed_kernel", stand_ins.RaisingModule, {
            "tokenspeed_kernel.ops.attention.dsv4": {
                "dsv4_indexer_cache_format": lambda requested: "mxfp4" if requested else "fp8"}})
    stand_ins.install("torchvision", stand_ins.InertModule)


def load_tokenspeed_side() -> type | str:
    """``TokenspeedSide``, or why tokenspeed cannot be driven in this Python."""
    def load() -> None:
        _install_stand_ins()
        _tokenspeed()

    return peer_unavailable(("tokenspeed_scheduler", "tokenspeed"), "tokenspeed-scheduler", SCHEDULER_VERSION, load,
                            "tokenspeed does") or TokenspeedSide


def _tokenspeed() -> types.SimpleNamespace:
    """The tokenspeed names this side calls (imported on first use)."""
    from tokenspeed.runtime.engine import scheduler_utils
    from tokenspeed.runtime.layers.attention.kv_cache.recipes.cache_runtime import CacheRuntimeContract
    from tokenspeed.runtime.layers.attention.kv_cache.recipes.setup import cache_recipe
    from tokenspeed_scheduler import Scheduler

    return types.SimpleNamespace(utils=scheduler_utils, contract=CacheRuntimeContract,
                                 cache_recipe=cache_recipe, Scheduler=Scheduler)


def v4_flash_config() -> types.SimpleNamespace:
    """The bundled DeepSeek-V4-Flash config (hybridkv's package data) as an attribute object."""
    import hybridkv.models

    path = Path(hybridkv.models.__file__).parent / "configs" / "deepseek-v4-flash.json"
    return types.SimpleNamespace(**json.loads(path.read_text()), attention_config=None)


class TokenspeedSide:
    """tokenspeed's scheduler sized by its own V4 recipe for a byte budget (module docstring)."""

    name = "tokenspeed"

    def __init__(self, *, kv_memory_bytes: int, max_model_len: int, max_num_batched_tokens: int,
                 max_num_seqs: int) -> None:
        self._ts = _tokenspeed()
        setup = self._size(kv_memory_bytes, max_model_len, max_num_batched_tokens, max_num_seqs)
        self.memory_plan = setup.spec.memory_plan
        self.token_capacity = setup.spec.token_capacity
        pool = types.SimpleNamespace(arena=types.SimpleNamespace(runtime_contract=self._contract(setup)))
        geometry = self._ts.utils.scheduler_cache_geometry_from_pool(pool)
        self.group_ids = [spec.group_id for spec in setup.spec.cache_group_specs]
        config = self._ts.utils.make_config(
            num_device_pages=geometry.num_device_pages, max_scheduled_tokens=max_num_batched_tokens,
            max_batch_size=max_num_seqs, prefix_granularity=geometry.prefix_granularity,
            num_host_pages=0, disable_l2_cache=True, enable_l3_storage=False, role="null",
            decode_input_tokens=1, overlap_schedule_depth=0, disable_prefix_cache=False,
            cache_groups=self._ts.utils.pool_to_cache_groups(pool),
        )
        config.num_snapshot_pages = 1  # the null page only: this engine never retracts
        self.scheduler = self._ts.Scheduler(config)

    def _size(self, budget_bytes: int, max_model_len: int, chunk_tokens: int, max_num_seqs: int) -> Any:
        server_args = types.SimpleNamespace(
            disaggregation_mode="null", chunked_prefill_size=chunk_tokens, enable_prefix_caching=True,
            attention_use_fp4_indexer_cache=False, speculative_algorithm=None, max_total_tokens=None)
        model_config = types.SimpleNamespace(hf_config=v4_flash_config(), num_attention_layers=43)
        attn_config = types.SimpleNamespace(
            prefix_granularity=V4_PREFIX_GRANULARITY_TOKENS, max_bs=max_num_seqs, context_len=max_model_len,
            dcp_size=1, pd_disaggregation_enabled=False)
        recipe = self._ts.cache_recipe(
            "deepseek_v4", server_args=server_args, model_config=model_config, attn_config=attn_config,
            draft_model_config=None, draft_attn_config=None, cache_budget_bytes=budget_bytes,
            probe_batch_rows=None, decode_input_tokens=1, overlap_schedule_depth=0)
        return recipe.setup()

    def _contract(self, setup: Any) -> Any:
        """What tokenspeed's cache arena publishes for this plan (the arena itself is not built)."""
        plan = setup.spec.memory_plan
        return self._ts.contract(
            prefix_granularity=plan.prefix_granularity, num_lcm_blocks=plan.num_lcm_blocks,
            token_capacity=setup.spec.token_capacity, group_specs=setup.spec.cache_group_specs,
            group_page_counts={g.group_id: g.page_count for g in plan.groups},
            group_packing={g.group_id: g.cache_blocks_per_lcm_block for g in plan.groups})

    # ------------------------------------------------------------------ serving

    def serve_request(self, request_id: str, prompt_token_ids: Sequence[int],
                      answer_token_ids: Sequence[int]) -> int:
        """Run one request to its finish; its hit tokens (module docstring)."""
        utils = self._ts.utils
        prompt = [int(t) for t in prompt_token_ids]
        answer = [int(t) for t in answer_token_ids]
        self.scheduler.submit_requests([utils.make_spec(
            request_id, prompt, max_cached_prefix_tokens=utils.UNBOUNDED_CACHED_PREFIX_TOKENS,
            max_new_tokens=len(answer))])
        hit, sampled = None, 0
        for _ in range(MAX_ROUNDS_PER_REQUEST):
            op = self._next_forward(request_id)
            if op.num_extends():
                hit = int(op.extend_prefix_lens[0]) if hit is None else hit
                if op.extend_prefix_lens[0] + op.input_lengths[0] < len(prompt):
                    utils.advance_scheduler(self.scheduler, [utils.make_extend_result_event(request_id)])
                    continue
            events = [utils.make_extend_result_event(request_id, [answer[sampled]])]
            sampled += 1
            if sampled == len(answer):
                events.append(utils.make_finish_event(request_id))
            utils.advance_scheduler(self.scheduler, events)
            if sampled == len(answer):
                return int(hit)
        raise RuntimeError(f"tokenspeed: {request_id} did not finish in {MAX_ROUNDS_PER_REQUEST} rounds")

    def _next_forward(self, request_id: str) -> Any:
        plan = self.scheduler.next_execution_plan()
        if len(plan.aborts):
            raise RuntimeError(f"tokenspeed aborted {request_id}: {list(plan.aborts)!r}"[:300])
        if len(plan.forward) == 0 or list(plan.forward[0].request_ids) != [request_id]:
            raise RuntimeError(f"tokenspeed: {request_id} not scheduled (budget too small for it?)")
        return plan.forward[0]

    def serve(self, requests: Sequence[Any]) -> np.ndarray:
        """Hit tokens per request, one request at a time in list order."""
        return np.array([self.serve_request(r.request_id, r.prompt_token_ids, r.output_token_ids)
                         for r in requests], dtype=np.int64)

    def group_pages(self) -> dict[str, dict[str, int]]:
        """Per group: the scheduler's total and available pages now."""
        return {gid: dict(total_pages=self.scheduler.cache_group_total_pages(gid),
                          available_pages=self.scheduler.cache_group_available_pages(gid))
                for gid in self.group_ids}
