"""SGLang 0.5.23's DeepSeek-V4 pool, SWA allocator and radix tree as a line of the hit-rate sweep.

Everything cache-side is SGLang's own code, on CPU torch:

* **Sizing**: its ``KVCacheConfigurator`` (the model runner's) over the
  bundled DeepSeek-V4-Flash config (``ModelConfig`` from a temporary
  directory, ``HF_HUB_OFFLINE=1``), with the sweep's byte budget standing in
  for the profiled free GPU memory: ``config_from_budget`` (its
  ``DSV4PoolConfigurator``: full-token pool, SWA pool at its default
  ``swa_full_tokens_ratio`` of 0.1, c4 / c128 pools, compressor-state rings),
  ``resolve_max_num_reqs``, ``finalize_with_max_running_requests`` -- the
  steps of ``KVCacheConfigurator.configure`` after GPU profiling.
* **Pools**: ``KVCacheConfigurator._init_pools``: ``ReqToTokenPool``,
  ``DeepSeekV4TokenToKVPool`` and ``SWATokenToKVPoolAllocator``. While they
  are built, ``torch.zeros`` of 16 MiB or more returns ``torch.empty``: the KV
  buffers are never read here, and zero-filling 40 GiB would not fit this
  machine's memory; bookkeeping tensors are smaller and stay zeroed.
* **Tree**: ``create_unified_radix_cache`` (``UnifiedRadixCache`` with its
  full and SWA components, the eviction policy of the server default), as
  ``build_kv_cache`` builds it for V4 without HiCache.
* **Serving**: one request at a time, the scheduler's calls in its order: a
  ``Req`` (prompt ids, ``max_new_tokens`` = the answer's length,
  ``ignore_eos``); ``init_next_round_input`` (the prefix match; the hit is
  ``req.prefix_len``, the device hit, no host tier); a ``PrefillAdder``
  (``add_one_req``, then ``add_chunked_req`` for each further 2,048-token
  chunk, the chunk before it stashed with ``checkpoint_kv_cache``);
  ``ScheduleBatch.init_new(...).prepare_for_extend()`` per chunk; after the
  last chunk the first answer token is appended and the request checkpointed;
  then ``prepare_for_decode`` and one answer token per step; at the end
  ``release_kv_cache(req, tree, checkpoint=True)``. No model runs: the
  workload's answer tokens are the sampled tokens, so the cache computes the
  prompt and all but the last answer token, as in the other lines.

Stand-ins (``sglang`` is installed ``--no-deps``; see bench/README.md):
``torchvision`` is served by ``stand_ins.InertModule`` (the PyPI wheel's
compiled ops need a CUDA torch; SGLang imports it only for image processors,
and transformers checks its installed version, so the wheel stays installed
for its metadata). Nothing GPU-only runs: SGLang's allocator takes its CPU
torch path.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import types
from array import array
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from peers import peer_unavailable, stand_ins

SGLANG_VERSION = "0.5.23"
LINE = f"SGLang {SGLANG_VERSION}"
PAGE_TOKENS = 256  # SGLang's V4 page size (its pool configurator needs a multiple of 128)
ZEROS_AS_EMPTY_BYTES = 16 << 20


def load_sglang_side() -> type | str:
    """``SglangSide``, or why SGLang cannot be driven in this Python."""
    def load() -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        stand_ins.install("torchvision", stand_ins.InertModule)
        _sglang()

    return peer_unavailable(("sglang",), "sglang", SGLANG_VERSION, load, "sglang's cache modules do") or SglangSide


def _sglang() -> types.SimpleNamespace:
    """The SGLang names this side calls (imported on first use)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
    from sglang.srt.mem_cache import common
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.registry import create_unified_radix_cache
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import SpecAuxHiddenStateConfig
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_memory, publish
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return types.SimpleNamespace(
        ModelConfig=ModelConfig, Req=Req, ScheduleBatch=ScheduleBatch, PrefillAdder=PrefillAdder,
        NewTokenRatioTracker=NewTokenRatioTracker, common=common, CacheInitParams=CacheInitParams,
        KVCacheConfigurator=KVCacheConfigurator, create_unified_radix_cache=create_unified_radix_cache,
        ModelLayerInfo=ModelLayerInfo, SpecAuxHiddenStateConfig=SpecAuxHiddenStateConfig,
        create_memory_pool_configurator=create_memory_pool_configurator, get_memory=get_memory,
        publish=publish, SamplingParams=SamplingParams, ServerArgs=ServerArgs,
        SpeculativeAlgorithm=SpeculativeAlgorithm)


@functools.cache
def _model_dir() -> str:
    """A directory holding the bundled DeepSeek-V4-Flash config as SGLang reads it (one a process)."""
    import hybridkv.models

    config = json.loads((Path(hybridkv.models.__file__).parent / "configs" / "deepseek-v4-flash.json").read_text())
    config.update(architectures=["DeepseekV4ForCausalLM"], vocab_size=129280, torch_dtype="bfloat16")
    directory = tempfile.mkdtemp(prefix="hybridkv-sglang-v4-")
    Path(directory, "config.json").write_text(json.dumps(config))
    return directory


@contextlib.contextmanager
def _zeros_as_empty() -> Iterator[None]:
    """``torch.zeros`` of ``ZEROS_AS_EMPTY_BYTES`` or more returns ``torch.empty`` (module docstring)."""
    import torch

    zeros = torch.zeros

    def lazy_zeros(*size: Any, dtype: Any = None, **kwargs: Any) -> Any:
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if int(np.prod([int(s) for s in shape])) * itemsize >= ZEROS_AS_EMPTY_BYTES:
            return torch.empty(*size, dtype=dtype, **kwargs)
        return zeros(*size, dtype=dtype, **kwargs)

    torch.zeros = lazy_zeros
    try:
        yield
    finally:
        torch.zeros = zeros


class SglangSide:
    """SGLang's V4 pool, SWA allocator and radix tree sized for a byte budget (module docstring)."""

    name = "sglang"

    def __init__(self, *, kv_memory_bytes: int, max_model_len: int, max_num_batched_tokens: int,
                 max_num_seqs: int) -> None:
        import torch

        self._sg = sg = _sglang()
        self.server_args = sg.ServerArgs(
            model_path=_model_dir(), device="cpu", skip_tokenizer_init=True, page_size=PAGE_TOKENS,
            chunked_prefill_size=max_num_batched_tokens, max_running_requests=max_num_seqs,
            context_length=max_model_len)
        sg.publish(self.server_args, role="scheduler")
        self.model_config = sg.ModelConfig.from_server_args(self.server_args)
        layers = self.model_config.num_hidden_layers
        self.configurator = sg.KVCacheConfigurator(
            device="cpu", gpu_id=0, attn_dp_size=1, pp_size=1, pp_group=None, model=None,
            model_config=self.model_config, server_args=self.server_args, kv_cache_dtype=torch.float8_e4m3fn,
            kv_cache_dtype_str="fp8_e4m3", model_dtype=torch.bfloat16, page_size=PAGE_TOKENS,
            sliding_window_size=self.model_config.sliding_window_size,
            spec_algorithm=sg.SpeculativeAlgorithm.NONE, is_draft_worker=False, post_capture_kv_active=False,
            spec_aux_config=sg.SpecAuxHiddenStateConfig(), is_hybrid_swa=True, is_hybrid_swa_compress=False,
            use_mla_backend=True, layer_info=sg.ModelLayerInfo(start_layer=0, end_layer=layers,
                                                               num_effective_layers=layers),
            forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None,
            memory_pool_config=None)
        self.pool_config = self._pool_config(kv_memory_bytes)
        sizes = self.configurator._derive_pool_sizes(config=self.pool_config)
        with _zeros_as_empty():
            pools = self.configurator._init_pools(sizes=sizes, req_to_token_pool=None,
                                                  token_to_kv_pool_allocator=None)
        self.req_to_token_pool = pools.req_to_token_pool
        self.allocator = pools.token_to_kv_pool_allocator
        self.tree = self._tree(sizes.full_max_total_num_tokens, max_num_batched_tokens)
        self.max_prefill_tokens = int(self.server_args.max_prefill_tokens)
        self.chunk_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs

    def _pool_config(self, budget_bytes: int) -> Any:
        """``configure``'s sizing with ``budget_bytes`` for the profiled free memory."""
        config = self.configurator.config_from_budget(budget_bytes)
        config.max_running_requests = self.configurator.resolve_max_num_reqs(config.max_total_num_tokens)
        return self._sg.create_memory_pool_configurator(self.configurator).finalize_with_max_running_requests(config)

    def _tree(self, full_tokens: int, chunk_tokens: int) -> Any:
        sg, memory = self._sg, self._sg.get_memory()
        params = sg.CacheInitParams(
            disable=False, req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator, page_size=PAGE_TOKENS,
            eviction_policy=memory.radix_eviction_policy, eviction_policy_config=memory.radix_eviction_policy_config,
            chunked_prefill_size=chunk_tokens, sliding_window_size=self.model_config.sliding_window_size,
            swa_gates_prefix_match=True)
        context = types.SimpleNamespace(
            server_args=self.server_args, params=params, is_hybrid_swa=True, is_hybrid_ssm=False,
            full_tokens_per_layer=full_tokens, enable_hierarchical_cache=False, tp_worker=None)
        return sg.create_unified_radix_cache(context)

    # ------------------------------------------------------------------ serving

    def _batch(self, reqs: list, chunked: Any = None) -> Any:
        sg = self._sg
        return sg.ScheduleBatch.init_new(reqs, self.req_to_token_pool, self.allocator, self.tree,
                                         self.model_config, False, sg.SpeculativeAlgorithm.NONE,
                                         chunked_req=chunked)

    def _adder(self, ratio: Any) -> Any:
        return self._sg.PrefillAdder(
            PAGE_TOKENS, self.tree, self.allocator, self._batch([]), ratio.current, self.max_prefill_tokens,
            self.chunk_tokens, 0, 0, max_prefill_bs=0, max_running_requests=self.max_num_seqs)

    def _admitted(self, adder: Any, req: Any, request_id: str) -> None:
        if adder.can_run_list != [req]:
            raise RuntimeError(f"sglang: {request_id} not admitted (budget too small for it?)")

    def _prefill(self, req: Any, request_id: str, ratio: Any) -> Any:
        """Every prefill chunk of ``req``, as ``get_new_batch_prefill`` schedules them; the last batch."""
        common = self._sg.common
        adder = self._adder(ratio)
        adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        self._admitted(adder, req, request_id)
        chunked = adder.new_chunked_req
        batch = self._batch([req], chunked)
        batch.prepare_for_extend()
        while chunked is not None:
            if chunked.extend_end > chunked.prefix_len:
                common.checkpoint_kv_cache(chunked, self.tree)  # stash_chunked_request
            chunked.init_next_round_input()
            adder = self._adder(ratio)
            chunked = adder.add_chunked_req(chunked)
            self._admitted(adder, req, request_id)
            batch = self._batch([req], chunked)
            batch.prepare_for_extend()
        return batch

    def serve_request(self, request_id: str, prompt_token_ids: Sequence[int],
                      answer_token_ids: Sequence[int]) -> int:
        """Run one request to its finish; its hit tokens (module docstring)."""
        sg = self._sg
        answer = [int(t) for t in answer_token_ids]
        params = sg.SamplingParams(max_new_tokens=len(answer), ignore_eos=True)
        params.normalize(None)
        req = sg.Req(request_id, "", array("q", [int(t) for t in prompt_token_ids]), params, vocab_size=129280)
        ratio = sg.NewTokenRatioTracker.from_config()  # reset when the server idles between requests
        req.init_next_round_input(self.tree)
        hit = int(req.prefix_len)
        batch = self._prefill(req, request_id, ratio)
        req.output_ids.append(answer[0])
        req.update_finish_state()
        if not req.finished():
            sg.common.checkpoint_kv_cache(req, self.tree)
        for token in answer[1:]:
            if req.finished():
                break
            batch.prepare_for_decode()
            ratio.decay_step()
            req.output_ids.append(token)
            req.update_finish_state()
        sg.common.release_kv_cache(req, self.tree, checkpoint=True)
        return hit

    def serve(self, requests: Sequence[Any]) -> np.ndarray:
        """Hit tokens per request, one request at a time in list order."""
        return np.array([self.serve_request(r.request_id, r.prompt_token_ids, r.output_token_ids)
                         for r in requests], dtype=np.int64)

    def pool_tokens(self) -> dict[str, int]:
        """SGLang's pool sizes for this budget, in tokens (its ``MemoryPoolConfig``)."""
        c = self.pool_config
        return dict(full_tokens=c.full_max_total_num_tokens, swa_tokens=c.swa_max_total_num_tokens,
                    c4_tokens=c.c4_max_total_num_tokens, c128_tokens=c.c128_max_total_num_tokens,
                    c4_state_rows=c.c4_state_pool_size, c128_state_rows=c.c128_state_pool_size,
                    max_running_requests=c.max_running_requests)
