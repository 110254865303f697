"""An engine loop over one manager and one paged stack, recording what it computed.

:class:`ScenarioRunner` drives a :class:`~hybridkv.runtime.manager.CacheManager` like an
engine (add, schedule, run the layers, append sampled/draft tokens, rewind,
free). Steps take either the general path (``schedule``, full block tables) or
the benchmarked decode path (``schedule_uniform`` with fixed widths and
``block_tables="updates"`` applied to a :class:`~hybridkv.tables.mirror.BlockTableMirror`,
write slots from the manager or computed from the mirrored tables). It records
every scheduled token's output and, at checkpoints, the cache rows a kernel
would read next (decoded from the pools through the manager's page lists).
:meth:`ScenarioRunner.compare` recomputes each token sequence densely and
compares both (see ``docs/reference.md``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hybridkv.runtime.manager import CacheManager, PrefixHit
from hybridkv.tables.mirror import BlockTableMirror
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_tokens
from hybridkv.reference.config import ReferenceConfig, ReferenceModel, build_model
from hybridkv.reference.paged import PagedStack, PagedStepResult
from hybridkv.reference.rows import RowSnapshot, compare_snapshot, snapshot_rows
from hybridkv.reference.versions import dense_traces

# Largest accepted difference between the paged and dense outputs. Both compute in
# float64 and agree to ~1e-15 (summation order only); 1e-9 leaves room for that and
# nothing else: a wrong cache row moves an output by 1e-4 or more.
TOLERANCE = 1e-9
ROW_KINDS = ("window KV", "compressed KV", "indexer keys", "compressor states")


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    tokens: int = 0  # scheduled tokens (or cache rows) compared; 0 for a coverage check
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
    snapshots: list[RowSnapshot] = field(default_factory=list)
    steps: int = 0
    uniform_steps: int = 0  # steps through schedule_uniform + table updates + mirror
    fixed_width_steps: int = 0
    computed_write_slot_steps: int = 0  # write slots computed from the mirrored tables
    noncontiguous_steps: int = 0
    max_hca_entries_read: int = 0
    max_csa_entries_visible: int = 0
    csa_selecting_queries: int = 0  # queries with more than 4 * index_topk visible entries
    rejected_window_closes: dict[int, int] = field(default_factory=dict)  # ratio -> count
    invariant_checks: int = 0  # manager.check_invariants() calls (one per checkpoint)
    invariant_failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed + 1_000_003)
        self._requests: dict[str, _Request] = {}
        self._versions: dict[tuple[str, int], np.ndarray] = {}
        self.mirror = BlockTableMirror.for_manager(self.manager)

    # --- engine actions ---------------------------------------------------------
    def add(self, request_id: str, prompt_ids: np.ndarray, max_new_tokens: int) -> PrefixHit:
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        hit = self.manager.add_request(request_id, prompt, max_new_tokens=max_new_tokens)
        self._requests[request_id] = _Request(request_id, prompt.copy())
        if hit.hit_tokens:
            self.snapshot(request_id, "prefix hit")
        return hit

    def new_tokens(self, count: int) -> np.ndarray:
        """Fresh token ids (stand-ins for sampled tokens and drafts)."""
        return self._rng.integers(0, self.model.config.vocab_size, size=count)

    def _provide_tokens(self, items: Sequence[tuple[str, int]]) -> None:
        for rid, count in items:
            req = self._requests[rid]
            need = self.manager.num_computed_tokens(rid) + count - req.tokens.size
            if need > 0:
                extra = self.new_tokens(need)
                self.manager.append_token_ids(rid, extra)
                req.tokens = np.concatenate([req.tokens, extra])

    def step(
        self, items: Sequence[tuple[str, int]], tags: dict[str, Iterable[str]] | None = None, *,
        fixed_width: bool = False,
    ) -> PagedStepResult:
        """Schedule ``items`` on the general path (appending fresh tokens where a request
        has none left), run the stack and record every token under its request's ``tags``."""
        self._provide_tokens(items)
        batch = self.manager.schedule(list(items), fixed_width=fixed_width)
        self.fixed_width_steps += int(fixed_width)
        return self._run(batch, None, tags, len(items))

    def step_uniform(
        self, request_ids: Sequence[str], count: int, tags: dict[str, Iterable[str]] | None = None, *,
        write_slots: bool = True,
    ) -> PagedStepResult:
        """The benchmarked path: ``schedule_uniform`` at fixed widths, tables through the mirror."""
        self._provide_tokens([(rid, count) for rid in request_ids])
        batch = self.manager.schedule_uniform(
            list(request_ids), count, fixed_width=True, block_tables="updates", write_slots=write_slots
        )
        self.mirror.apply(batch)
        self.uniform_steps += 1
        self.fixed_width_steps += 1
        self.computed_write_slot_steps += int(not write_slots)
        return self._run(batch, self.mirror.block_tables(), tags, len(request_ids))

    def _run(self, batch, block_tables, tags, num_requests: int) -> PagedStepResult:
        tags = tags or {}
        ids = np.concatenate([
            self._requests[rid].tokens[batch.positions[lo:hi]]
            for rid, lo, hi in zip(batch.request_ids, batch.query_start_loc[:-1], batch.query_start_loc[1:])
        ])
        result = self.stack.forward(batch, ids, block_tables)
        self._observe(batch, block_tables)
        shared = {"batch of >= 3 requests"} if num_requests >= 3 else set()
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
        self.snapshot(request_id, "before free")
        self.manager.free(request_id)

    def tokens(self, request_id: str) -> np.ndarray:
        return self._requests[request_id].tokens

    def snapshot(self, request_id: str, why: str = "checkpoint") -> None:
        """Decode the rows the request's next query would read (every layer, every group)."""
        req = self._requests[request_id]
        n = self.manager.num_computed_tokens(request_id)
        self.invariant_checks += 1
        try:
            self.manager.check_invariants()
        except AssertionError as exc:
            self.invariant_failures.append(f"{why} of {request_id!r} at {n} tokens: {exc}")
        if n:
            self.snapshots.append(snapshot_rows(self.model, self.manager, self.stack, request_id, req.version, n, why))

    def _observe(self, batch, block_tables) -> None:
        for gid, group in batch.groups.items():
            table = group.block_table if block_tables is None else block_tables[gid]
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
    def sequences(self) -> dict[tuple[str, int], np.ndarray]:
        """Every token sequence version that was computed (rejected drafts included)."""
        out = dict(self._versions)
        for rid, req in self._requests.items():
            out.setdefault((rid, req.version), req.tokens)
        return out

    def compare(self, tolerance: float = TOLERANCE) -> list[CheckResult]:
        """Dense recomputation of every recorded sequence version: one check per tag for
        the outputs, one per row kind for the cache rows."""
        need: dict[tuple[str, int], int] = {}
        for rec in self.records:
            key = (rec.request_id, rec.version)
            need[key] = max(need.get(key, 0), int(rec.positions.max()) + 1)
        for snap in self.snapshots:
            key = (snap.request_id, snap.version)
            need[key] = max(need.get(key, 0), snap.num_tokens)
        traces = dense_traces(self.model, self.sequences(), need)
        checks = self._compare_outputs(traces, tolerance)
        checks.extend(self._compare_rows(traces, tolerance))
        failures = self.invariant_failures
        checks.append(CheckResult(
            "manager invariants (ref counts == table holdings) at every checkpoint", not failures,
            detail=f"{self.invariant_checks} checks" + (f"; {failures[0]}" if failures else ""),
        ))
        return checks

    def _compare_outputs(self, traces, tolerance: float) -> list[CheckResult]:
        per_tag: dict[str, list[tuple[float, int, int]]] = {}
        for rec in self.records:
            dense = traces[(rec.request_id, rec.version)]
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

    def _compare_rows(self, traces, tolerance: float) -> list[CheckResult]:
        totals = {kind: [0, 0.0, []] for kind in ROW_KINDS}  # rows, max error, problems
        for snap in self.snapshots:
            dense = traces[(snap.request_id, snap.version)]
            for kind, (rows, err, problems) in compare_snapshot(snap, dense, tolerance).items():
                t = totals[kind]
                t[0] += rows
                t[1] = max(t[1], err)
                t[2].extend(problems)
        checks = []
        for kind in ROW_KINDS:
            rows, err, problems = totals[kind]
            if not rows and not problems:
                continue
            detail = f"{len(self.snapshots)} checkpoints" + (f"; {problems[0]}" if problems else "")
            checks.append(CheckResult(
                f"cache rows == dense rows: {kind}", bool(err <= tolerance and not problems), rows, err,
                detail=detail,
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
    max_running_requests: int = 8,
) -> ScenarioRunner:
    """A model, a planned manager (shuffled pools, prefix caching) and matching pools."""
    config = config or ReferenceConfig()
    model = build_model(config, seed=seed)
    layout = cache_layout(config.hf_config(), speculative_tokens=speculative_tokens)
    limits = Limits(
        max_running_requests=max_running_requests,
        max_scheduled_tokens=max_context_tokens,
        max_context_tokens=max_context_tokens,
        speculative_tokens=speculative_tokens,
    )
    plan = plan_for_tokens(layout, total_tokens, limits, page_space="per-group")  # the stack mirrors per-group pools
    options = {}
    if enable_prefix_caching:
        grain = plan.scheduler_page_tokens
        options = {"prefix_granularity": grain, "state_checkpoint_interval": grain}
    manager = CacheManager.from_plan(
        plan, shuffle_seed=shuffle_seed, enable_prefix_caching=enable_prefix_caching, **options
    )
    stack = PagedStack(model, manager.specs, plan.group_pages)
    return ScenarioRunner(model, manager, stack, seed=seed)
