"""A small continuous-batching engine: transformers' DeepseekV4 over hybridkv's pages.

:class:`PagedEngine` owns a ``DeepseekV4ForCausalLM``, a :class:`~hybridkv.runtime.manager.CacheManager`
planned for the model's cache layout and the :class:`~.pages.PagePools`. A step
schedules several requests at once through the manager (chunks of prompts,
decode tokens, speculative verify widths), runs each request's forward on a
cache materialized from its pages through the step's block table, and writes
the new rows at the step's write slots. :meth:`PagedEngine.generate` is a greedy
generate loop over it: chunked prefill under a token budget, prefix hits from
earlier requests, preemption (free and re-add, which hits the request's own
checkpoints) when a step finds no pages, and eviction of cached prefixes by the
manager under a small budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.runtime.manager import CacheManager, CacheManagerError
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_tokens
from hybridkv.integrations.transformers.pages import LAYER_RATIO, PagePools, materialize


def layout_config(config) -> dict:
    """The DeepSeek-V4 ``config.json`` fields hybridkv's cache layout reads, from a ``DeepseekV4Config``."""
    return {
        "model_type": "deepseek_v4",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": config.head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "sliding_window": config.sliding_window,
        "index_n_heads": config.index_n_heads,
        "index_head_dim": config.index_head_dim,
        "index_topk": config.index_topk,
        "compress_ratios": [LAYER_RATIO[t] for t in config.layer_types] + [0],
        "num_nextn_predict_layers": 1,
        "vocab_size": config.vocab_size,
    }


@dataclass
class _Request:
    request_id: str
    tokens: list[int]
    prompt_tokens: int
    max_new_tokens: int
    hit_tokens: int = 0


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    hit_tokens: list[int] = field(default_factory=list)


class PagedEngine:
    """transformers' DeepseekV4 model whose cache lives in hybridkv's pages."""

    def __init__(self, model, *, total_tokens: int, max_running_requests: int = 4,
                 max_context_tokens: int = 1024, speculative_tokens: int = 3, shuffle_seed: int | None = 0,
                 enable_prefix_caching: bool = True):
        self.model = model.eval()
        self.config = model.config
        layout = cache_layout(layout_config(self.config), speculative_tokens=speculative_tokens)
        limits = Limits(max_running_requests=max_running_requests, max_scheduled_tokens=max_context_tokens,
                        max_context_tokens=max_context_tokens, speculative_tokens=speculative_tokens)
        plan = plan_for_tokens(layout, total_tokens, limits, page_space="per-group")  # pools mirror per-group pools
        options = {}
        if enable_prefix_caching:
            grain = plan.scheduler_page_tokens
            options = {"prefix_granularity": grain, "state_checkpoint_interval": grain}
        self.manager = CacheManager.from_plan(
            plan, shuffle_seed=shuffle_seed, enable_prefix_caching=enable_prefix_caching, **options)
        self.pools = PagePools(self.config, self.manager.specs, plan.group_pages)
        self.stats = EngineStats()

    # --- requests ----------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int) -> int:
        """Admit a request; returns its prefix hit in tokens (rows it borrows instead of computing)."""
        hit = self.manager.add_request(request_id, np.asarray(prompt_ids, dtype=np.int64),
                                       max_new_tokens=max_new_tokens).hit_tokens
        self.stats.hit_tokens.append(hit)
        return hit

    def append(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.manager.append_token_ids(request_id, np.asarray(token_ids, dtype=np.int64))

    def computed(self, request_id: str) -> int:
        return self.manager.num_computed_tokens(request_id)

    def rewind(self, request_id: str, keep_tokens: int) -> None:
        self.manager.rewind(request_id, keep_tokens)

    def free(self, request_id: str) -> None:
        self.manager.free(request_id)

    # --- a step ------------------------------------------------------------------
    def step(self, items: Sequence[tuple[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
        """Compute the given tokens of several requests in one manager step.

        ``items``: (request id, token ids to compute next, starting at its computed
        count). Returns each request's logits ``[len, vocab]`` (float32)."""
        batch = self.manager.schedule([(rid, len(ids)) for rid, ids in items])
        self.stats.steps += 1
        out = {}
        for r, (rid, ids) in enumerate(items):
            lo, hi = int(batch.query_start_loc[r]), int(batch.query_start_loc[r + 1])
            n = int(batch.positions[lo])
            tables = {gid: (g.block_table[r], int(g.base_pages[r]) if g.base_pages is not None else 0)
                      for gid, g in batch.groups.items()}
            out[rid] = self._forward(rid, ids, n, tables, batch.groups, lo, hi)
        return out

    def _forward(self, rid, ids, n, tables, groups, lo, hi) -> torch.Tensor:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        written = materialize(self.pools, self.model, cache, tables, n, rid)
        positions = torch.arange(n, n + len(ids)).unsqueeze(0)
        with torch.no_grad():
            logits = self.model(torch.as_tensor([list(ids)]), position_ids=positions, cache=cache,
                                use_cache=True).logits[0]
        self.pools.commit(written, groups, lo, hi)
        return logits

    # --- the generate loop ------------------------------------------------------------
    def generate(self, prompts: Mapping[str, Sequence[int]], max_new_tokens: int, *,
                 prefill_chunk_tokens: int = 256, max_running: int = 4) -> dict[str, list[int]]:
        """Greedy continuous batching: admit requests while fewer than ``max_running`` run,
        prefill in chunks of at most ``prefill_chunk_tokens``, decode everything running each
        step; a step that finds no pages preempts the newest request (it re-enters later,
        hitting its own checkpoints). Returns each request's generated tokens."""
        waiting = [_Request(rid, [int(t) for t in p], len(p), max_new_tokens) for rid, p in prompts.items()]
        running: list[_Request] = []
        finished: dict[str, list[int]] = {}
        admit = max_running  # lowered by a preemption, so the victim waits until a request ends
        while waiting or running:
            while waiting and (len(running) < admit or not running):
                seq = waiting.pop(0)
                left = seq.prompt_tokens + seq.max_new_tokens - len(seq.tokens)
                seq.hit_tokens = self.add(seq.request_id, seq.tokens, left)
                running.append(seq)
            items = [(s.request_id, self._next_tokens(s, prefill_chunk_tokens)) for s in running]
            try:
                logits = self.step(items)
            except CacheManagerError:
                if len(running) == 1:
                    raise
                victim = running.pop()
                self.free(victim.request_id)
                waiting.insert(0, victim)
                self.stats.preemptions += 1
                admit = len(running)
                continue
            for seq in list(running):
                if self.computed(seq.request_id) < len(seq.tokens):
                    continue  # still prefilling
                token = int(logits[seq.request_id][-1].argmax())
                seq.tokens.append(token)
                if len(seq.tokens) - seq.prompt_tokens >= seq.max_new_tokens:
                    running.remove(seq)
                    self.free(seq.request_id)
                    finished[seq.request_id] = seq.tokens[seq.prompt_tokens:]
                    admit = max_running
                else:
                    self.append(seq.request_id, [token])
        return {rid: finished[rid] for rid in prompts}

    def _next_tokens(self, seq: _Request, chunk: int) -> list[int]:
        n = self.computed(seq.request_id)
        return seq.tokens[n:n + chunk]
