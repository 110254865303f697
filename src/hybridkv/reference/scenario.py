"""The end-to-end verification scenario: the paged stack under a real manager vs dense.

:class:`ScenarioRunner` drives a :class:`~hybridkv.manager.CacheManager` like an
engine (add, schedule, run the layers, append sampled/draft tokens, rewind,
free) and records every scheduled token's paged output. :meth:`compare`
recomputes each token sequence densely and reports, per tag, the largest
difference and any top-k mismatch. :func:`run_verify_scenario` is the fixed
script behind ``hybridkv verify`` (see ``docs/reference.md``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hybridkv.manager import CacheManager, PrefixHit, StepBatch
from hybridkv.models.deepseek_v4 import v4_compressed_kv_group_id, v4_compressor_state_group_id
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_tokens
from hybridkv.reference.config import ReferenceConfig, ReferenceModel, build_model
from hybridkv.reference.dense import dense_forward
from hybridkv.reference.paged import PagedStack, PagedStepResult

TOLERANCE = 1e-5
FAULTS = ("kv-byte", "state-byte")


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    tokens: int = 0  # scheduled tokens compared (0 for a coverage check)
    max_abs_error: float = 0.0
    topk_mismatches: int = 0  # tokens whose CSA selection differs in any layer
    detail: str = ""


@dataclass(frozen=True)
class VerifyReport:
    checks: tuple[CheckResult, ...]
    tolerance: float
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def max_abs_error(self) -> float:
        return max((c.max_abs_error for c in self.checks), default=0.0)

    def check(self, name: str) -> CheckResult:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)


@dataclass
class _Request:
    request_id: str
    tokens: np.ndarray  # known token ids of the current version
    version: int = 0


@dataclass
class _Record:
    request_id: str
    version: int
    positions: np.ndarray
    hidden: np.ndarray
    layer_outputs: tuple[np.ndarray, ...]
    selected: dict[int, np.ndarray]
    tags: frozenset[str]


@dataclass
class ScenarioRunner:
    """An engine loop over one manager and one paged stack, recording what it computed."""

    model: ReferenceModel
    manager: CacheManager
    stack: PagedStack
    seed: int = 0
    records: list[_Record] = field(default_factory=list)
    steps: int = 0
    noncontiguous_steps: int = 0
    max_hca_entries_read: int = 0
    max_csa_entries_visible: int = 0
    csa_selecting_queries: int = 0  # queries with more than 4 * index_topk visible entries
    rejected_window_closes: dict[int, int] = field(default_factory=dict)  # ratio -> count

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed + 1_000_003)
        self._requests: dict[str, _Request] = {}
        self._versions: dict[tuple[str, int], np.ndarray] = {}

    # --- engine actions ---------------------------------------------------------
    def add(self, request_id: str, prompt_ids: np.ndarray, max_new_tokens: int) -> PrefixHit:
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        hit = self.manager.add_request(request_id, prompt, max_new_tokens=max_new_tokens)
        self._requests[request_id] = _Request(request_id, prompt.copy())
        return hit

    def new_tokens(self, count: int) -> np.ndarray:
        """Fresh token ids (stand-ins for sampled tokens and drafts)."""
        return self._rng.integers(0, self.model.config.vocab_size, size=count)

    def step(
        self, items: Sequence[tuple[str, int]], tags: dict[str, Iterable[str]] | None = None
    ) -> PagedStepResult:
        """Schedule ``items`` (appending fresh tokens where a request has none left), run
        the stack and record every token under its request's ``tags`` (a step with
        three or more requests also tags ``batch of >= 3 requests``)."""
        tags = tags or {}
        for rid, count in items:
            req = self._requests[rid]
            need = self.manager.num_computed_tokens(rid) + count - req.tokens.size
            if need > 0:
                extra = self.new_tokens(need)
                self.manager.append_token_ids(rid, extra)
                req.tokens = np.concatenate([req.tokens, extra])
        batch = self.manager.schedule(list(items))
        ids = np.concatenate([
            self._requests[rid].tokens[batch.positions[lo:hi]]
            for rid, lo, hi in zip(batch.request_ids, batch.query_start_loc[:-1], batch.query_start_loc[1:])
        ])
        result = self.stack.forward(batch, ids)
        self._observe(batch)
        shared = {"batch of >= 3 requests"} if len(items) >= 3 else set()
        for r, rid in enumerate(batch.request_ids):
            lo, hi = int(batch.query_start_loc[r]), int(batch.query_start_loc[r + 1])
            self.records.append(_Record(
                rid, self._requests[rid].version, result.positions[lo:hi], result.hidden[lo:hi],
                tuple(o[lo:hi] for o in result.layer_outputs),
                {li: s[lo:hi] for li, s in result.selected.items()},
                frozenset(tags.get(rid, ())) | shared,
            ))
        self.steps += 1
        return result

    def rewind(self, request_id: str, keep_tokens: int) -> None:
        """Reject speculative tokens past ``keep_tokens``; the old sequence stays comparable."""
        req = self._requests[request_id]
        computed = self.manager.num_computed_tokens(request_id)
        self.manager.rewind(request_id, keep_tokens)
        rejected = np.arange(keep_tokens, computed)
        for ratio in set(self.model.config.layer_ratios) - {0}:
            closes = int(((rejected + 1) % ratio == 0).sum())
            self.rejected_window_closes[ratio] = self.rejected_window_closes.get(ratio, 0) + closes
        self._versions[(request_id, req.version)] = req.tokens.copy()
        req.tokens = req.tokens[:keep_tokens].copy()
        req.version += 1

    def free(self, request_id: str) -> None:
        self.manager.free(request_id)

    def tokens(self, request_id: str) -> np.ndarray:
        return self._requests[request_id].tokens

    def _observe(self, batch: StepBatch) -> None:
        for group in batch.groups.values():
            table = group.block_table
            if table.shape[1] < 2:
                continue
            pairs = (table[:, :-1] >= 0) & (table[:, 1:] >= 0)
            if (pairs & (table[:, 1:] != table[:, :-1] + 1)).any():
                self.noncontiguous_steps += 1
                break
        ratios = self.model.config.layer_ratios
        pos = batch.positions
        if 128 in ratios and pos.size:
            self.max_hca_entries_read = max(self.max_hca_entries_read, int((pos.max() + 1) // 128))
        if 4 in ratios and pos.size:
            visible = (pos + 1) // 4
            self.max_csa_entries_visible = max(self.max_csa_entries_visible, int(visible.max()))
            self.csa_selecting_queries += int((visible > 4 * self.model.config.index_topk).sum())

    # --- comparison -------------------------------------------------------------------
    def compare(self, tolerance: float = TOLERANCE) -> list[CheckResult]:
        """Dense recomputation of every recorded sequence version; one check per tag."""
        by_version: dict[tuple[str, int], list[_Record]] = {}
        for rec in self.records:
            by_version.setdefault((rec.request_id, rec.version), []).append(rec)
        per_tag: dict[str, list[tuple[float, int, int]]] = {}
        for (rid, version), recs in by_version.items():
            seq = self._versions.get((rid, version))
            if seq is None:
                seq = self._requests[rid].tokens
            last = max(int(r.positions.max()) for r in recs)
            dense = dense_forward(self.model, seq[: last + 1])
            for rec in recs:
                p = rec.positions
                err = np.abs(rec.hidden - dense.hidden[p]).max(axis=1)
                for out, layer in zip(rec.layer_outputs, dense.layers):
                    err = np.maximum(err, np.abs(out - layer.outputs[p]).max(axis=1))
                mismatched = np.zeros(p.size, dtype=bool)
                for li, sel in rec.selected.items():
                    mismatched |= (sel != dense.layers[li].selected[p]).any(axis=1)
                for tag in rec.tags | {"all tokens"}:
                    per_tag.setdefault(tag, []).append((float(err.max()), int(mismatched.sum()), p.size))
        checks = []
        for tag in sorted(per_tag, key=lambda t: (t != "all tokens", t)):
            rows = per_tag[tag]
            max_err = max(r[0] for r in rows)
            mism = sum(r[1] for r in rows)
            tokens = sum(r[2] for r in rows)
            checks.append(CheckResult(
                f"paged == dense: {tag}", bool(max_err <= tolerance and mism == 0), tokens, max_err, mism,
            ))
        return checks


def build_runner(
    config: ReferenceConfig | None = None,
    *,
    seed: int = 0,
    shuffle_seed: int | None = 7,
    enable_prefix_caching: bool = True,
    total_tokens: int = 4096,
    max_context_tokens: int = 1024,
    speculative_tokens: int = 3,
) -> ScenarioRunner:
    """A model, a planned manager (shuffled pools, prefix caching) and matching pools."""
    config = config or ReferenceConfig()
    model = build_model(config, seed=seed)
    layout = cache_layout(config.hf_config(), speculative_tokens=speculative_tokens)
    limits = Limits(
        max_running_requests=8,
        max_scheduled_tokens=max_context_tokens,
        max_context_tokens=max_context_tokens,
        speculative_tokens=speculative_tokens,
    )
    plan = plan_for_tokens(layout, total_tokens, limits)
    options = {}
    if enable_prefix_caching:
        grain = plan.scheduler_page_tokens
        options = {"prefix_granularity": grain, "state_checkpoint_interval": grain}
    manager = CacheManager.from_plan(
        plan, shuffle_seed=shuffle_seed, enable_prefix_caching=enable_prefix_caching, **options
    )
    stack = PagedStack(model, manager.specs, plan.group_pages)
    return ScenarioRunner(model, manager, stack, seed=seed)


def corrupt_byte(runner: ScenarioRunner, fault: str, request_id: str) -> str:
    """Flip one bit of one cached row of ``request_id``; says which."""
    mgr, stack = runner.manager, runner.stack
    if fault == "kv-byte":
        layer = runner.model.config.layer_ratios.index(128)
        gid = v4_compressed_kv_group_id(128)
        _, pages = mgr.request_pages(request_id, gid)
        pool = stack.pools[layer].entries
        pool[int(pages[0]), 0] ^= 0x01  # e4m3 mantissa LSB of entry 0's first nope value
        return f"layer {layer} HCA compressed entry 0 (page {int(pages[0])}), byte 0"
    if fault == "state-byte":
        layer = runner.model.config.layer_ratios.index(128)
        gid = v4_compressor_state_group_id(128)
        spec = next(s for s in mgr.specs if s.group_id == gid)
        position = mgr.num_computed_tokens(request_id) - 1
        if (position + 1) % 128 == 0:  # that window is closed already: take a token of an open one
            position -= 1
        base, pages = mgr.request_pages(request_id, gid)
        page = int(pages[position // spec.rows_per_page - base])
        row_bytes = stack.pools[layer].state.shape[1] // spec.rows_per_page
        # the top byte of gate channel 0 (Z starts half way): exponent bit 1 -> gate x4 or /4.
        # A small change to one of 128 pooled slots could vanish in the FP8 rounding.
        offset = (position % spec.rows_per_page) * row_bytes + row_bytes // 2 + 3
        stack.pools[layer].state[page, offset] ^= 0x01
        return f"layer {layer} HCA compressor gate of position {position} (page {page}, byte {offset})"
    raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")


def run_verify_scenario(seed: int = 0, *, fault: str | None = None, tolerance: float = TOLERANCE) -> VerifyReport:
    """The fixed scenario: 5 requests, one shuffled prefix-caching manager, stack [0, 4, 128, 4].

    * ``a``: 517-token one-shot prefill; verify 3 / accept 1 four times (a rejected token
      closes a CSA window); decode to 637; two more verify cycles (a rejected token closes
      HCA window 4); decode on.
    * ``b``: 600-token prefill in chunks 1, 37, 218, 45, 130, 169 (mid-window boundaries).
    * ``c``: 151-token prefill then 330 decode steps (crosses 4- and 128-token boundaries).
    * ``d``: ``b``'s first 512 tokens + 40 new: prefix hit 512, continue.
    * ``e``: ``b``'s first 256 tokens + 150 new: prefix hit 256, continue.

    ``fault`` flips one cached bit mid-run (the report must then FAIL).
    """
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    runner = build_runner(seed=seed)
    rng = np.random.default_rng(seed)
    vocab = runner.model.config.vocab_size
    prompts = {"a": rng.integers(0, vocab, 517), "b": rng.integers(0, vocab, 600),
               "c": rng.integers(0, vocab, 151)}
    prompts["d"] = np.concatenate([prompts["b"][:512], rng.integers(0, vocab, 40)])
    prompts["e"] = np.concatenate([prompts["b"][:256], rng.integers(0, vocab, 150)])
    hits: dict[str, int] = {}
    checks: list[CheckResult] = []
    for rid in ("a", "b", "c"):
        runner.add(rid, prompts[rid], max_new_tokens=400)

    runner.step([("a", 517), ("b", 1), ("c", 151)],
                {"a": {"one-shot prefill"}, "b": {"chunked prefill"}, "c": {"one-shot prefill"}})
    plans = {
        "a": ["verify"] * 4 + [1] * (637 - 521) + ["verify"] * 2 + [1] * 10,
        "b": ["chunk:37", "chunk:218", "chunk:45", "chunk:130", "chunk:169"] + [1] * 34,
        "c": [1] * 330,
        "d": ["chunk:17", "chunk:23"] + [1] * 30,
        "e": ["chunk:150"] + [1] * 20 + ["verify"] * 2 + [1] * 5,
    }
    hit_tags = {"d": "prefix hit 512", "e": "prefix hit 256"}
    faulted = ""
    after_verify: set[str] = set()
    for step in range(330):
        if step == 8:
            for rid in ("d", "e"):
                hits[rid] = runner.add(rid, prompts[rid], max_new_tokens=64).hit_tokens
        items, tags, verifies = [], {}, []
        for rid, plan in plans.items():
            if not plan or not runner.manager.has_request(rid):
                continue
            action = plan.pop(0)
            req_tags = {hit_tags[rid]} if rid in hit_tags else set()
            if action == "verify":
                items.append((rid, 3))
                verifies.append(rid)
                req_tags.add("verify 3, accept 1, continue")
            elif isinstance(action, str):
                items.append((rid, int(action.split(":")[1])))
                req_tags.add("chunked prefill")
            else:
                items.append((rid, action))
                req_tags.add("decode")
                if rid in after_verify:
                    req_tags.add("verify 3, accept 1, continue")
            tags[rid] = req_tags
        runner.step(items, tags)
        after_verify = set(verifies)
        for rid in verifies:
            runner.rewind(rid, runner.manager.num_computed_tokens(rid) - 2)
        if step == 40:
            runner.free("b")
        if fault is not None and step == 150:
            faulted = corrupt_byte(runner, fault, "c")
    checks.extend(runner.compare(tolerance))
    checks.append(CheckResult(
        "prefix hits at 256 and 512", hits == {"d": 512, "e": 256}, detail=f"hit tokens {hits}"))
    checks.append(CheckResult(
        "HCA reads >= 3 entries", runner.max_hca_entries_read >= 3,
        detail=f"up to {runner.max_hca_entries_read} entries"))
    topk = runner.model.config.index_topk
    checks.append(CheckResult(
        f"CSA indexer selects {topk} of > {4 * topk} visible entries", runner.csa_selecting_queries > 0,
        detail=f"{runner.csa_selecting_queries} queries, up to {runner.max_csa_entries_visible} entries visible"))
    closes = runner.rejected_window_closes
    checks.append(CheckResult(
        "rejected draft tokens closed CSA and HCA windows", closes.get(4, 0) > 0 and closes.get(128, 0) > 0,
        detail=f"windows closed by a rejected token, by ratio: {dict(sorted(closes.items()))}"))
    checks.append(CheckResult(
        "shuffled pools give non-contiguous tables", runner.noncontiguous_steps > 0,
        detail=f"{runner.noncontiguous_steps} of {runner.steps} steps"))
    notes = (f"fault injected after step 150: {faulted}",) if faulted else ()
    return VerifyReport(tuple(checks), tolerance, notes)
