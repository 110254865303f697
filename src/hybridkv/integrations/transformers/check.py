"""``hybridkv verify --against transformers``: the paged engine vs transformers' own cache.

A tiny random-weight ``DeepseekV4ForCausalLM`` with DeepSeek-V4's production cache
geometry (window 128, head_dim 512 with rope 64, ratios 4 and 128, index_head_dim
128; one sliding, one CSA and one HCA layer) runs every token twice: through
:class:`~.engine.PagedEngine` (hybridkv's manager, block tables, write slots and
pools) and through transformers' own ``DynamicCache``. Logits must agree within
:data:`LOGIT_TOLERANCE` (float32).

Two sub-cases, because with random weights the indexer's ReLU scores tie at
exactly 0 and ``topk`` breaks ties differently for different shapes:

* **all entries** (``index_topk`` 512, DeepSeek-V4's own value, >= every entry
  count here, so the indexer selects every visible entry and ties cannot matter):
  several requests batched per step, chunked prefill, 300+ decode steps, prefix
  hits at 256 and 512 from another request, speculative verify with rewind (a
  rejected token closes CSA and HCA windows), shuffled pools and a small budget
  (cached prefixes evicted, a later hit shortened). The reference for each token
  sequence (rejected drafts included) is one forward over the whole sequence with
  transformers' own cache.
* **selecting** (``index_topk`` 8 of up to 100 entries): one request in the same
  chunks through both paths, so both make the same computation in the same
  shapes; the indexer's chosen entries (recorded by a forward hook on both) must
  be identical and the logits equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.integrations.transformers.engine import PagedEngine
from hybridkv.reference.runner import CheckResult as Check
from hybridkv.reference.runner import VerifyReport

LOGIT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class TransformersReport(VerifyReport):
    """verify's report (checks, tolerance, notes), plus the model it ran."""

    model_label: str = ""


def tiny_config(index_topk: int = 512):
    """3 layers (sliding, CSA, HCA) at DeepSeek-V4's cache geometry; everything else tiny."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=512, partial_rotary_factor=64 / 512,
        q_lora_rank=32, o_groups=2, o_lora_rank=16, num_experts_per_tok=1, n_routed_experts=2,
        n_shared_experts=1, mlp_layer_types=["moe"] * 3,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        sliding_window=128, index_n_heads=2, index_head_dim=128, index_topk=index_topk,
        hc_mult=1, hc_sinkhorn_iters=3, num_nextn_predict_layers=0, attn_implementation="eager",
    )


def tiny_model(seed: int, index_topk: int = 512):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    return DeepseekV4ForCausalLM(tiny_config(index_topk)).float().eval()


def own_cache_logits(model, token_ids, chunks=None) -> torch.Tensor:
    """Logits of every position through transformers' own ``DynamicCache`` (one forward
    over the whole sequence, or the given chunk sizes)."""
    from transformers import DynamicCache

    ids = list(token_ids)
    chunks = chunks or [len(ids)]
    cache, out, n = DynamicCache(config=model.config), [], 0
    with torch.no_grad():
        for size in chunks:
            piece = torch.as_tensor([ids[n:n + size]])
            positions = torch.arange(n, n + size).unsqueeze(0)
            out.append(model(piece, position_ids=positions, cache=cache, use_cache=True).logits[0])
            n += size
    return torch.cat(out)


class _Recorder:
    """Everything the paged path computed, per (request, sequence version)."""

    def __init__(self):
        self.logits: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        self.tags: dict[tuple[str, int], dict[int, set[str]]] = {}
        self.sequences: dict[tuple[str, int], list[int]] = {}

    def record(self, key, start: int, logits: torch.Tensor, tags: set[str]) -> None:
        rows = self.logits.setdefault(key, {})
        tag_rows = self.tags.setdefault(key, {})
        for k in range(logits.shape[0]):
            rows[start + k] = logits[k]
            tag_rows[start + k] = set(tags)


class _Driver:
    """Runs scripted steps on a :class:`PagedEngine` and records logits per token."""

    def __init__(self, engine: PagedEngine, seed: int):
        self.engine = engine
        self.rng = np.random.default_rng(seed + 101)
        self.tokens: dict[str, list[int]] = {}
        self.version: dict[str, int] = {}
        self.rec = _Recorder()
        self.steps = 0

    def add(self, rid: str, prompt, max_new: int = 400) -> int:
        self.tokens[rid] = [int(t) for t in prompt]
        self.version[rid] = 0
        return self.engine.add(rid, self.tokens[rid], max_new)

    def step(self, plan: dict[str, tuple[int, set[str]]]) -> None:
        """``plan``: request -> (tokens to compute, tags); fresh tokens are drawn as needed."""
        items = []
        for rid, (count, _) in plan.items():
            n = self.engine.computed(rid)
            need = n + count - len(self.tokens[rid])
            if need > 0:
                extra = [int(t) for t in self.rng.integers(0, self.engine.config.vocab_size, need)]
                self.engine.append(rid, extra)
                self.tokens[rid] += extra
            items.append((rid, self.tokens[rid][n:n + count]))
        starts = {rid: self.engine.computed(rid) for rid in plan}
        logits = self.engine.step(items)
        tag_all = {"batch of >= 3 requests"} if len(plan) >= 3 else set()
        for rid, (_, tags) in plan.items():
            key = (rid, self.version[rid])
            self.rec.sequences[key] = self.tokens[rid]
            self.rec.record(key, starts[rid], logits[rid], tags | tag_all)
        self.steps += 1

    def rewind(self, rid: str, keep: int) -> None:
        key = (rid, self.version[rid])
        self.rec.sequences[key] = list(self.tokens[rid])
        self.engine.rewind(rid, keep)
        self.tokens[rid] = self.tokens[rid][:keep]
        self.version[rid] += 1

    def free(self, rid: str) -> None:
        self.rec.sequences[(rid, self.version[rid])] = list(self.tokens[rid])
        self.engine.free(rid)


def _all_entries_scenario(model, seed: int, say: Callable[[str], None]):
    """The all-entries sub-case's script; returns the driver and coverage facts."""
    engine = PagedEngine(model, total_tokens=1024, max_running_requests=4, shuffle_seed=seed + 7)
    d = _Driver(engine, seed)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    a_prompt = rng.integers(0, vocab, 520)
    facts = {"hits": {}}
    d.add("a", a_prompt)
    d.add("c", rng.integers(0, vocab, 100))
    for k, chunk in enumerate((1, 37, 218, 45, 130, 89)):
        plan = {"a": (chunk, {"chunked prefill"})}
        if k == 0:
            plan["c"] = (100, {"one-shot prefill"})
        else:
            plan["c"] = (1, {"decode"})
        d.step(plan)
    d.free("a")
    facts["hits"]["b"] = d.add("b", np.concatenate([a_prompt[:512], rng.integers(0, vocab, 20)]), 40)
    facts["hits"]["e"] = d.add("e", np.concatenate([a_prompt[:256], rng.integers(0, vocab, 30)]), 40)
    d.step({"b": (20, {"prefix hit 512"}), "e": (30, {"prefix hit 256"}), "c": (1, {"decode"})})
    for _ in range(8):
        d.step({"b": (1, {"decode", "prefix hit 512"}), "e": (1, {"decode", "prefix hit 256"}),
                "c": (1, {"decode"})})
    d.free("b")
    d.free("e")
    say(f"transformers: hits {facts['hits']}; c decoding ({engine.computed('c')} tokens)")
    facts["rejected_closes"] = _decode_with_verifies(d)
    say(f"transformers: c at {engine.computed('c')} tokens; filling the pool")
    d.add("g", rng.integers(0, vocab, 700), 10)
    d.add("h", rng.integers(0, vocab, 700), 10)
    for _ in range(2):
        d.step({"g": (350, {"chunked prefill"}), "h": (350, {"chunked prefill"}), "c": (1, {"decode"})})
    d.free("g")
    d.free("h")
    facts["hits"]["f"] = d.add("f", a_prompt[:520], 10)
    d.step({"f": (520 - facts["hits"]["f"], {"prefix hit after evictions"}), "c": (1, {"decode"})})
    d.step({"f": (1, {"decode", "prefix hit after evictions"}), "c": (1, {"decode"})})
    facts["evicted_pages"] = sum(s.evicted_pages for s in engine.manager.stats().values())
    return d, facts


def _decode_with_verifies(d: _Driver) -> dict[int, int]:
    """``c`` decodes to past 400 tokens; at 251, 381 and 385 it verifies 3 drafts and accepts
    1 (the rejected tokens 252/253 close a CSA window, 382/383 the HCA window 2)."""
    closes = {4: 0, 128: 0}
    while d.engine.computed("c") < 410:
        n = d.engine.computed("c")
        if n in (251, 381, 385):
            d.step({"c": (3, {"verify 3, accept 1, continue"})})
            for p in (n + 1, n + 2):
                for ratio in closes:
                    closes[ratio] += (p + 1) % ratio == 0
            d.rewind("c", n + 1)
        else:
            d.step({"c": (1, {"decode"})})
    return closes


def _compare(model, rec: _Recorder, tolerance: float) -> list[Check]:
    per_tag: dict[str, list[float]] = {}
    for key, rows in rec.logits.items():
        seq = rec.sequences[key]
        last = max(rows) + 1
        ref = own_cache_logits(model, seq[:last])
        for pos, got in rows.items():
            err = float((got - ref[pos]).abs().max())
            for tag in rec.tags[key][pos] | {"all tokens"}:
                per_tag.setdefault(tag, []).append(err)
    return [
        Check(f"paged == own cache: {tag}", max(errs) <= tolerance, len(errs), max(errs))
        for tag, errs in sorted(per_tag.items(), key=lambda kv: (kv[0] != "all tokens", kv[0]))
    ]


def _selecting_case(seed: int, tolerance: float) -> list[Check]:
    model = tiny_model(seed + 1, index_topk=8)
    chunks = [1, 64, 135, 200] + [1] * 40
    tokens = [int(t) for t in np.random.default_rng(seed + 3).integers(0, model.config.vocab_size, sum(chunks))]
    indexer = model.model.layers[1].self_attn.compressor.indexer
    picks: list[torch.Tensor] = []
    hook = indexer.register_forward_hook(lambda _m, _i, out: picks.append(out[0].clone()))
    try:
        ref = own_cache_logits(model, tokens, chunks)
        ref_picks, picks[:] = list(picks), []
        engine = PagedEngine(model, total_tokens=2048, shuffle_seed=seed + 5)
        engine.add("s", tokens, 0)
        got = torch.cat([engine.step([("s", tokens[n:n + c])])["s"]
                         for n, c in zip(np.cumsum([0] + chunks[:-1]), chunks)])
    finally:
        hook.remove()
    mismatched = sum(int((a != b).any(dim=-1).sum()) for a, b in zip(picks, ref_picks))
    err = float((got - ref).abs().max())
    entries = len(tokens) // 4
    return [Check("selecting (index_topk 8): paged == own cache, same chunks", err <= tolerance and mismatched == 0,
                  len(tokens), err, mismatched, detail=f"up to {entries} entries visible")]


def run_transformers_check(seed: int = 0, *, progress: Callable[[str], None] | None = None,
                           tolerance: float = LOGIT_TOLERANCE) -> TransformersReport:
    say = progress or (lambda _msg: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead and contention
    try:
        model = tiny_model(seed)
        say("transformers: all-entries sub-case (index_topk 512) ...")
        driver, facts = _all_entries_scenario(model, seed, say)
        say(f"transformers: {driver.steps} paged steps done; running the own-cache reference")
        checks = _compare(model, driver.rec, tolerance)
        hits = facts["hits"]
        checks += [
            Check("prefix hits at 512 and 256 from another request", hits["b"] == 512 and hits["e"] == 256,
                  detail=f"b {hits['b']}, e {hits['e']}"),
            Check("evictions under a small budget shorten a later hit", facts["evicted_pages"] > 0 and hits["f"] < 512,
                  detail=f"{facts['evicted_pages']} pages evicted; f hit {hits['f']} of 520 shared tokens"),
            Check("rejected draft tokens closed CSA and HCA windows",
                  facts["rejected_closes"][4] > 0 and facts["rejected_closes"][128] > 0,
                  detail=f"by ratio: {facts['rejected_closes']}"),
        ]
        say("transformers: selecting sub-case (index_topk 8) ...")
        checks += _selecting_case(seed, tolerance)
    finally:
        torch.set_num_threads(threads)
    c = model.config
    label = (f"DeepseekV4ForCausalLM, random weights seed {seed}: layers {c.layer_types}, window {c.sliding_window}, "
             f"head_dim {c.head_dim} (rope {c.qk_rope_head_dim}), index_head_dim {c.index_head_dim}, hidden "
             f"{c.hidden_size}, float32, eager attention")
    return TransformersReport(tuple(checks), tolerance, model_label=label)
