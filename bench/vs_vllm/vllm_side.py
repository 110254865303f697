"""vLLM's KV-cache manager for DeepSeek-V4, driven on the CPU without a model.

Every vLLM import of the project lives here; only the ``vs_vllm`` benchmark
package and ``bench/decode_ab.py`` import this module (it needs the vLLM
environment of bench/README.md).

It builds the per-layer cache specs that vLLM 0.33.0's DeepSeek-V4 layers
return from ``get_kv_cache_spec`` (FlashMLA path, ``fp8_ds_mla`` KV cache, FP8
indexer), plans them for a byte budget the way ``EngineCore`` does
(``get_global_kv_cache_groups`` -> ``get_kv_cache_configs`` ->
``generate_scheduler_kv_cache_config`` -> ``resolve_kv_cache_block_sizes``),
and wraps the ``KVCacheManager`` in :class:`VllmSide`, whose methods make the
calls vLLM's scheduler makes for one request.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from typing import Any, Sequence

import numpy as np

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

try:
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_max_concurrency_for_kv_cache_config,
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        get_kv_quant_mode,
    )
    from vllm.v1.request import Request, RequestStatus
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "vLLM 0.33.0 is not importable here; build the vLLM environment as "
        f"bench/README.md describes and run the benchmark with its python ({exc})"
    ) from exc

VLLM_VERSION = __import__("vllm").__version__

FP8_DS_MLA = "fp8_ds_mla"
PAGE_ALIGNMENT_BYTES = 576  # FlashMLA packing of fp8_ds_mla pages
COMPRESSED_BLOCK_TOKENS = 256  # the V4 backends' only kernel block size
SWA_BLOCK_TOKENS = 64  # DeepseekV4SWACache default
STATE_BLOCK_TOKENS = {4: 4, 128: 8}  # CompressorStateCache
INDEXER_FP8_QUANT_BLOCK = 128
# The only layout list a V4 worker reports: DeepseekV4IndexerBackend's (the
# other V4 backends declare none), so the engine resolves to BLHNC.
V4_SUPPORTED_LAYOUTS = [["BLHNC", "BLNHC"]]


def bundled_v4_config(name: str = "deepseek-v4-flash") -> dict[str, Any]:
    """The HF config hybridkv bundles for ``name``."""
    text = resources.files("hybridkv.models").joinpath("configs", f"{name}.json").read_text("utf-8")
    return json.loads(text)


def build_v4_layer_specs(hf_config: dict[str, Any]) -> dict[str, KVCacheSpec]:
    """Per-layer specs, exactly as the V4 layers' ``get_kv_cache_spec`` return them.

    Main layers only (no MTP draft: speculative decoding is off). Layer names
    follow the model's module prefixes.
    """
    head_dim = hf_config["head_dim"]
    rope_dim = hf_config["qk_rope_head_dim"]
    nope_dim = head_dim - rope_dim
    # 448 fp8 nope + 64 bf16 rope + one UE8M0 byte per 64 nope values + 1 pad.
    kv_row_bytes = nope_dim + 2 * rope_dim + nope_dim // 64 + 1
    index_head_dim = hf_config["index_head_dim"]
    indexer_row_bytes = index_head_dim + index_head_dim // INDEXER_FP8_QUANT_BLOCK * 4
    window = hf_config["sliding_window"]
    quant_mode = get_kv_quant_mode(FP8_DS_MLA)
    ratios = hf_config["compress_ratios"][: hf_config["num_hidden_layers"]]

    specs: dict[str, KVCacheSpec] = {}
    for layer, ratio in enumerate(ratios):
        prefix = f"model.layers.{layer}.attn"
        specs[f"{prefix}.swa_cache"] = SlidingWindowMLASpec(  # DeepseekV4SWACache
            block_size=SWA_BLOCK_TOKENS,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=head_dim,
            dtype=torch.uint8,
            sliding_window=window,
            cache_dtype_str=FP8_DS_MLA,
            state_content_bytes=kv_row_bytes,
            alignment=PAGE_ALIGNMENT_BYTES,
            model_version="deepseek_v4",
            kv_quant_mode=quant_mode,
        )
        if ratio <= 1:
            continue
        specs[prefix] = MLAAttentionSpec(  # DeepseekV4Attention (compressed KV)
            block_size=COMPRESSED_BLOCK_TOKENS,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=head_dim,
            dtype=torch.uint8,
            tokens_per_state=ratio,
            cache_dtype_str=FP8_DS_MLA,
            alignment=PAGE_ALIGNMENT_BYTES,
            model_version="deepseek_v4",
            kv_quant_mode=quant_mode,
            state_content_bytes=kv_row_bytes,
        )
        overlap = 2 if ratio == 4 else 1
        specs[f"{prefix}.compressor.state_cache"] = SlidingWindowMLASpec(  # CompressorStateCache
            block_size=STATE_BLOCK_TOKENS[ratio],
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=2 * overlap * head_dim,  # kv state + score state, fp32
            dtype=torch.float32,
            sliding_window=overlap * ratio,
            alignment=PAGE_ALIGNMENT_BYTES,
        )
        if ratio != 4:
            continue
        specs[f"{prefix}.indexer.k_cache"] = MLAAttentionSpec(  # DeepseekV4IndexerCache, FP8
            block_size=COMPRESSED_BLOCK_TOKENS,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=indexer_row_bytes,
            dtype=torch.uint8,
            tokens_per_state=ratio,
            alignment=PAGE_ALIGNMENT_BYTES,
        )
        specs[f"{prefix}.indexer.compressor.state_cache"] = SlidingWindowMLASpec(
            block_size=STATE_BLOCK_TOKENS[4],
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=2 * 2 * index_head_dim,
            dtype=torch.float32,
            sliding_window=8,
            alignment=PAGE_ALIGNMENT_BYTES,
        )
    return specs


def make_vllm_config(
    hf_config: dict[str, Any],
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    enable_prefix_caching: bool,
    prefix_cache_retention_interval: int | None = 0,
) -> VllmConfig:
    """A ``VllmConfig`` for V4 as a GPU engine would hold it, built on the CPU.

    The config directory only needs ``config.json``; no tokenizer, no weights.
    With no GPU, vLLM's platform is "unspecified" and would turn the hybrid
    allocator off, so it is switched back on as a CUDA engine has it.
    """
    config = dict(hf_config)
    config.setdefault("architectures", ["DeepseekV4ForCausalLM"])
    config.setdefault("vocab_size", 129_280)
    config.setdefault("torch_dtype", "bfloat16")
    with tempfile.TemporaryDirectory(prefix="v4cfg-") as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(config, handle)
        model_config = ModelConfig(
            model=model_dir, skip_tokenizer_init=True, max_model_len=max_model_len
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            cache_dtype=FP8_DS_MLA,
            block_size=COMPRESSED_BLOCK_TOKENS,
            enable_prefix_caching=enable_prefix_caching,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
        ),
        scheduler_config=SchedulerConfig(
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return vllm_config


@dataclass(frozen=True)
class PlannedCache:
    vllm_config: VllmConfig
    layer_specs: dict[str, KVCacheSpec]
    kv_cache_config: KVCacheConfig  # the scheduler's copy
    scheduler_block_tokens: int
    hash_block_tokens: int


def plan_kv_cache(
    hf_config: dict[str, Any],
    *,
    kv_memory_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    enable_prefix_caching: bool = True,
    prefix_cache_retention_interval: int | None = 0,
) -> PlannedCache:
    """Plan ``kv_memory_bytes`` the way ``EngineCore._initialize_kv_caches`` does."""
    vllm_config = make_vllm_config(
        hf_config,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
        prefix_cache_retention_interval=prefix_cache_retention_interval,
    )
    specs = build_v4_layer_specs(hf_config)
    resolve_kv_cache_layout(vllm_config, V4_SUPPORTED_LAYOUTS, specs.values())
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    configs = get_kv_cache_configs(vllm_config, [specs], [kv_memory_bytes], groups)
    scheduler_config = generate_scheduler_kv_cache_config(configs)
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(scheduler_config, vllm_config)
    return PlannedCache(vllm_config, specs, scheduler_config, scheduler_block, hash_block)


def _window(spec: KVCacheSpec) -> int | None:
    return getattr(spec, "sliding_window", None)


def describe_plan(plan: PlannedCache) -> dict[str, Any]:
    """Specs by kind, groups, block bytes and counts: plain data for printing and JSON."""
    kinds: dict[tuple, int] = defaultdict(int)
    for spec in plan.layer_specs.values():
        key = (
            type(spec).__name__,
            spec.block_size,
            _window(spec),
            int(spec.tokens_per_state),
            spec.real_page_size_bytes,
            spec.page_size_bytes,
            str(spec.dtype).removeprefix("torch."),
        )
        kinds[key] += 1
    spec_rows = [
        dict(
            spec_class=k[0],
            layers=n,
            block_tokens=k[1],
            window_tokens=k[2],
            tokens_per_state=k[3],
            page_bytes_real=k[4],
            page_bytes_padded=k[5],
            dtype=k[6],
        )
        for k, n in kinds.items()
    ]
    config = plan.kv_cache_config
    tensors = config.kv_cache_tensors
    block_stride_bytes = max((t.block_stride for t in tensors), default=0)
    group_rows = []
    for index, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        group_rows.append(
            dict(
                group=index,
                spec_class=type(spec).__name__,
                layers=len(group.layer_names),
                block_tokens=spec.block_size,
                window_tokens=_window(spec),
                page_bytes=spec.page_size_bytes,
                first_layers=group.layer_names[:2],
            )
        )
    return dict(
        vllm_version=VLLM_VERSION,
        layout=plan.vllm_config.cache_config.kv_cache_layout,
        specs=spec_rows,
        groups=group_rows,
        num_blocks=config.num_blocks,
        block_stride_bytes=block_stride_bytes,
        pool_bytes=config.num_blocks * block_stride_bytes,
        scheduler_block_tokens=plan.scheduler_block_tokens,
        hash_block_tokens=plan.hash_block_tokens,
        max_model_len=plan.vllm_config.model_config.max_model_len,
        max_in_flight_tokens=plan.vllm_config.max_in_flight_tokens,
    )


class VllmSide:
    """vLLM's ``KVCacheManager`` behind the side-by-side adapter API.

    A request handle is vLLM's own ``Request``. The calls mirror the
    scheduler: ``probe_hit`` = ``get_computed_blocks`` (and, as the scheduler
    does, stores the returned shared-prefix junction on the request); the first
    ``allocate`` of a request adopts the probed hit with
    ``full_sequence_must_fit=True`` (vLLM's default admission gate); every
    successful ``allocate`` advances ``num_computed_tokens`` as
    ``_update_after_schedule`` does, and its time includes turning the
    result into the block ids the scheduler sends the worker; ``append_tokens`` is
    ``append_output_token_ids`` (which hashes new full blocks); ``free`` is
    ``free``. Scheduling is synchronous (nothing in flight between steps).

    Each manager call's wall time is added to ``manager_ns[method]``
    (``perf_counter_ns``); hashing the prompt in ``new_request`` and the
    outputs in ``append_tokens`` goes to ``hash_ns`` instead.
    """

    name = "vLLM"

    def __init__(
        self,
        hf_config: dict[str, Any] | None = None,
        *,
        kv_memory_bytes: int = 40 * 2**30,
        max_model_len: int = 131_072,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        enable_prefix_caching: bool = True,
        prefix_cache_retention_interval: int | None = 0,
    ) -> None:
        # prefix_cache_retention_interval: vLLM's CacheConfig field (0, its default: only
        # semantic checkpoints; None: a sliding-window checkpoint at every boundary).
        self.hf_config = hf_config if hf_config is not None else bundled_v4_config()
        self.plan = plan_kv_cache(
            self.hf_config,
            kv_memory_bytes=kv_memory_bytes,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
        )
        vllm_config = self.plan.vllm_config
        self.manager = KVCacheManager(
            kv_cache_config=self.plan.kv_cache_config,
            max_model_len=max_model_len,
            scheduler_block_size=self.plan.scheduler_block_tokens,
            hash_block_size=self.plan.hash_block_tokens,
            max_in_flight_tokens=vllm_config.max_in_flight_tokens,
            enable_caching=enable_prefix_caching,
        )
        self._block_hasher = None
        if enable_prefix_caching:
            hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self._block_hasher = get_request_block_hasher(
                self.plan.hash_block_tokens, hash_fn, vllm_config.num_hash_lookahead_tokens
            )
        self._pending_hits: dict[str, tuple[Any, int]] = {}
        self.last_block_ids: tuple[list[int], ...] | None = None
        self.manager_ns: dict[str, int] = defaultdict(int)
        self.hash_ns = 0

    # ------------------------------------------------------------------ layout facts

    def describe(self) -> dict[str, Any]:
        return describe_plan(self.plan)

    def computed_capacity(self, context_tokens: int) -> float:
        """Requests of ``context_tokens`` that fit, by vLLM's own formula (the
        "maximum concurrency" it logs at startup, evaluated at that length)."""
        model_config = self.plan.vllm_config.model_config
        saved = model_config.max_model_len
        model_config.max_model_len = context_tokens
        try:
            return get_max_concurrency_for_kv_cache_config(
                self.plan.vllm_config, self.plan.kv_cache_config
            )
        finally:
            model_config.max_model_len = saved

    @property
    def hit_grain_tokens(self) -> int:
        return self.plan.scheduler_block_tokens

    # ------------------------------------------------------------------ requests

    def new_request(
        self, request_id: str, token_ids: Sequence[int], max_tokens: int = 1
    ) -> Request:
        """A waiting request whose prompt is ``token_ids`` (block hashes computed now)."""
        prompt = np.asarray(token_ids, dtype=np.int64).tolist()
        start = time.perf_counter_ns()
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=max_tokens),
            pooling_params=None,
            block_hasher=self._block_hasher,
        )
        self.hash_ns += time.perf_counter_ns() - start
        return request

    def probe_hit(self, request: Request) -> int:
        """Prompt tokens served from the prefix cache; remembered for the first ``allocate``."""
        start = time.perf_counter_ns()
        blocks, hit_tokens, junction = self.manager.get_computed_blocks(request)
        self.manager_ns["probe_hit"] += time.perf_counter_ns() - start
        # The scheduler stores the shared-prefix junction on the request; the
        # manager then retains sliding-window state there for later siblings.
        request.shared_prefix_boundary = junction
        self._pending_hits[request.request_id] = (blocks, hit_tokens)
        return hit_tokens

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Slots for ``num_new_tokens`` more tokens; False (nothing changed) if the pool refuses.

        A refused first allocation forgets the probed hit: probe again before retrying.
        """
        pending = self._pending_hits.pop(request.request_id, None)
        start = time.perf_counter_ns()
        if pending is None:
            blocks = self.manager.allocate_slots(request, num_new_tokens)
        else:
            hit_blocks, hit_tokens = pending
            blocks = self.manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens=hit_tokens,
                new_computed_blocks=hit_blocks,
                full_sequence_must_fit=True,
            )
        if blocks is not None:
            # What the scheduler hands the worker: a new request's whole block
            # table, a running request's newly added block ids.
            if pending is None:
                self.last_block_ids = blocks.get_block_ids(allow_none=True)
            else:
                self.last_block_ids = self.manager.get_blocks(request.request_id).get_block_ids()
        self.manager_ns["allocate"] += time.perf_counter_ns() - start
        if blocks is None:
            return False
        if pending is not None:
            request.num_computed_tokens += pending[1]
            request.status = RequestStatus.RUNNING
        request.num_computed_tokens += num_new_tokens
        return True

    def append_tokens(self, request: Request, token_ids: Sequence[int]) -> None:
        """Record generated tokens (vLLM hashes newly completed blocks here)."""
        start = time.perf_counter_ns()
        request.append_output_token_ids(np.asarray(token_ids, dtype=np.int64).tolist())
        self.hash_ns += time.perf_counter_ns() - start

    def free(self, request: Request) -> None:
        self._pending_hits.pop(request.request_id, None)
        start = time.perf_counter_ns()
        self.manager.free(request)
        self.manager_ns["free"] += time.perf_counter_ns() - start
        request.status = RequestStatus.FINISHED_STOPPED

    def decode_step(self, requests: Sequence[Request]) -> bool:
        """One token for every request, as vLLM's scheduler does it: one
        ``allocate_slots`` call per running request."""
        return all(self.allocate(request, 1) for request in requests)

    def schedule_step(self, items: Sequence[tuple[Request, int]]) -> bool:
        """A mixed step (decodes and prefill chunks, in batch order), as vLLM's
        scheduler makes it: one ``allocate_slots`` per request; False at the
        first refusal (the requests before it keep their slots)."""
        return all(self.allocate(request, num_new_tokens) for request, num_new_tokens in items)

    def append_many(self, requests: Sequence[Request], token_ids: Sequence[int]) -> None:
        """One sampled token for each request (``append_tokens`` for each)."""
        for request, token in zip(requests, token_ids):
            self.append_tokens(request, [int(token)])

    def begin_step(self) -> None:
        """The scheduler's per-step calls: ``new_step_starts`` and draining the
        new-block-id list (done every step whether or not blocks get zeroed)."""
        start = time.perf_counter_ns()
        self.manager.new_step_starts()
        self.manager.take_new_block_ids()
        self.manager_ns["begin_step"] += time.perf_counter_ns() - start

    def num_computed_tokens(self, request: Request) -> int:
        """Computed tokens, counting a probed hit that the first ``allocate`` will adopt."""
        pending = self._pending_hits.get(request.request_id)
        return request.num_computed_tokens + (pending[1] if pending is not None else 0)

    def pages_per_group(self, request: Request) -> list[int]:
        """Blocks the request holds now in each group (null placeholders left out)."""
        groups = self.manager.get_blocks(request.request_id).blocks
        return [sum(1 for block in group if not block.is_null) for group in groups]

    def num_free_blocks(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()

    def num_total_blocks(self) -> int:
        return self.plan.kv_cache_config.num_blocks

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def take_timings(self) -> dict[str, int]:
        """Manager ns per method (plus ``hash``) since the last call; resets them."""
        timings = dict(self.manager_ns)
        timings["hash"] = self.hash_ns
        self.manager_ns = defaultdict(int)
        self.hash_ns = 0
        return timings
