"""A continuous-batching driver: workloads -> CacheManager -> per-step metrics.

Each step: running requests first (decode 1 token, or their next prefill
chunk), then waiting requests in arrival order while the step token budget
and ``max_running`` allow. A new request is probed against the prefix cache
(``add_request`` of its prompt, prepared once however often it is refused and
added again: ``CacheManager.prepare_prompt``) and starts prefilling after its
hit. When a running request cannot grow, the last prefill chunk of the step
first shrinks to what fits
(``CacheManager.max_admissible_tokens``, not below ``min_chunk_tokens``);
failing that, the most recently started running request is preempted
(recompute: freed, and later re-added with its prompt plus the outputs it had
produced) until the rest fits. New requests start only with a full first
chunk (starting them with less only makes room for more thrashing), except
when nothing is running: then a first chunk larger than the memory (a
per-group pool smaller than one chunk's state pages) shrinks to fit. Only
manager calls are timed.

Token accounting per request: ``prompt + outputs - 1`` tokens are computed in
its final incarnation (the last sampled token is never fed back); each of
them is either a prefix hit or scheduled exactly once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridkv.runtime.manager import CacheManager, PreparedPrompt
from hybridkv.sim.workloads import Request


@dataclass
class _Live:
    request: Request
    produced: int = 0  # output tokens sampled so far
    incarnation: int = 0
    hit_tokens: int = 0  # hit of the current incarnation
    scheduled_tokens: int = 0  # scheduled in the current incarnation
    context_tokens: int = 0  # tokens to compute in the current incarnation before decode
    started_step: int = -1
    added: bool = False  # in the manager already: it waited for another request's blocks
    denied_at: int = -1  # the run's frees when its tier load last got no pages (-1: it did not)
    prepared: PreparedPrompt | None = None  # its sequence of this incarnation, hashed once for every add

    @property
    def rid(self) -> str:
        return self.request.request_id

    def sequence(self) -> np.ndarray:
        """Prompt plus the outputs produced so far (what a recompute re-adds): the prompt itself before any."""
        r = self.request
        if not self.produced:
            return r.prompt_token_ids
        return np.concatenate([r.prompt_token_ids, r.output_token_ids[: self.produced]])


@dataclass
class RequestRecord:
    request_id: str
    prompt_tokens: int
    output_tokens: int
    first_hit_tokens: int
    final_hit_tokens: int
    final_scheduled_tokens: int
    total_scheduled_tokens: int
    preemptions: int
    produced_tokens: int
    start_step: int
    finish_step: int
    first_tier_hit_tokens: int = 0  # of first_hit_tokens, loaded from a tier


@dataclass
class SimResult:
    steps: int
    group_ids: tuple[str, ...]
    group_total_pages: dict[str, float]  # utilization denominators (arena bytes / page bytes when shared)
    used_pages: dict[str, np.ndarray]  # per step
    running: np.ndarray
    scheduled_tokens: np.ndarray
    hit_tokens: np.ndarray  # hit tokens of requests started in the step
    prompt_tokens_started: np.ndarray
    preemptions: np.ndarray
    manager_us: np.ndarray
    requests: list[RequestRecord] = field(default_factory=list)
    shrunk_chunks: np.ndarray | None = None  # prefill chunks shrunk to fit, per step
    shared_arena: bool = False  # utilization is then each group's share of the arena's bytes

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        prompt = int(sum(r.prompt_tokens for r in self.requests))
        first_hits = int(sum(r.first_hit_tokens for r in self.requests))
        return {
            "steps": self.steps,
            "requests_finished": len(self.requests),
            "scheduled_tokens": int(self.scheduled_tokens.sum()),
            "scheduled_tokens_per_step": float(self.scheduled_tokens.sum() / steps),
            "max_running_reached": int(self.running.max()) if self.steps else 0,
            "mean_running": float(self.running.mean()) if self.steps else 0.0,
            "prompt_tokens": prompt,
            "hit_tokens": first_hits,
            "tier_hit_tokens": int(sum(r.first_tier_hit_tokens for r in self.requests)),
            "token_hit_rate": first_hits / prompt if prompt else 0.0,
            "preemptions": int(self.preemptions.sum()),
            "shrunk_chunks": int(self.shrunk_chunks.sum()) if self.shrunk_chunks is not None else 0,
            "manager_us_per_step_p50": float(np.percentile(self.manager_us, 50)) if self.steps else 0.0,
            "manager_us_per_step_p99": float(np.percentile(self.manager_us, 99)) if self.steps else 0.0,
            "utilization": self.utilization(),
        }

    def utilization(self) -> dict[str, dict[str, float]]:
        """Per group (and, on a shared arena, the arena), mean and peak used share."""
        util = {
            g: {
                "mean": float(self.used_pages[g].mean() / self.group_total_pages[g]) if self.steps else 0.0,
                "peak": float(self.used_pages[g].max() / self.group_total_pages[g]) if self.steps else 0.0,
            }
            for g in self.group_ids
        }
        if self.shared_arena and self.steps:
            share = sum(self.used_pages[g] / self.group_total_pages[g] for g in self.group_ids)
            util["arena (all groups)"] = {"mean": float(share.mean()), "peak": float(share.max())}
        return util


class SimulationError(ValueError):
    """The workload cannot run on this cache at all (a request never fits)."""


class _Run:
    """A run's state across steps: the request lines, the records and the per-step series."""

    def __init__(self, requests: Sequence[Request], finished_ids: set[str] | None, group_ids: tuple[str, ...]):
        self.group_ids = group_ids
        self.pending = deque(sorted(requests, key=lambda r: r.arrival_step))
        self.shared = finished_ids is not None
        self.finished_ids = set() if finished_ids is None else finished_ids
        self.blocked: list[Request] = []  # arrived, after a request that has not finished
        self.waiting: deque[_Live] = deque()  # arrived, not started (or preempted)
        self.held: list[_Live] = []  # added, waiting for blocks another request computes (tier markers)
        self.running: list[_Live] = []
        self.records: list[RequestRecord] = []
        self.first_hit: dict[str, int] = {}
        self.first_tier_hit: dict[str, int] = {}
        self.total_sched: dict[str, int] = {}
        self.preempt_count: dict[str, int] = {}
        self.series: dict[str, list] = {k: [] for k in ("running", "sched", "hit", "prompt", "preempt", "shrunk", "us")}
        self.used: dict[str, list[int]] = {g: [] for g in group_ids}
        self.step = 0
        self.frees = 0  # requests freed finished or preempted: pages a denied tier load waits for

    def has_work(self) -> bool:
        return bool(self.pending or self.waiting or self.running or self.blocked or self.held)

    def note(self, work: _StepWork, manager: CacheManager) -> None:
        """Append a scheduled step's figures to the series."""
        s = self.series
        s["running"].append(len(work.items))
        s["sched"].append(sum(n for _, n in work.items))
        s["hit"].append(work.hit_tokens)
        s["prompt"].append(work.prompt_tokens)
        s["preempt"].append(work.preempted)
        s["shrunk"].append(int(work.memory_short))
        s["us"].append(work.us)
        for gid, st in manager.stats().items():
            self.used[gid].append(st.used_pages)


class _StepWork:
    """One step's batch as it is built: (request, tokens) pairs, the budget left, and
    what the step counts (manager time, preemptions, hits of the requests started)."""

    def __init__(self, budget_tokens: int):
        self.batch: list[tuple[_Live, int]] = []
        self.items: list[tuple[str, int]] = []
        self.budget = budget_tokens
        self.us = 0.0
        self.preempted = 0
        self.memory_short = False  # a chunk was shrunk to fit: no room to start others
        self.refusal = "not tried"
        self.parked = False  # a request started this step was held for a peer's blocks
        self.hit_tokens = 0
        self.prompt_tokens = 0

    def add(self, live: _Live, n_tokens: int) -> None:
        self.batch.append((live, n_tokens))
        self.items.append((live.rid, n_tokens))
        self.budget -= n_tokens

    def drop(self, live: _Live) -> None:
        self.batch = [(lv, n) for lv, n in self.batch if lv is not live]
        self.items = [(lv.rid, n) for lv, n in self.batch]

    def timed(self, call: Callable, *args):
        """``call(*args)``, its wall time added to the step's manager time."""
        t0 = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.us += (time.perf_counter() - t0) * 1e6


class Simulator:
    """Drive ``manager`` with ``requests`` under a per-step token budget.

    Steps are a clock: a request arrives at its ``arrival_step``. Idle stretches
    (nothing running or waiting) are skipped to the next arrival, so far arrivals
    cost nothing. ``max_steps`` bounds the steps that schedule work; reaching it
    raises :class:`SimulationError` (a run is never cut short silently).
    """

    def __init__(
        self,
        manager: CacheManager,
        requests: Sequence[Request],
        *,
        max_running: int,
        step_token_budget: int,
        max_steps: int = 1_000_000,
        min_chunk_tokens: int = 256,
        tier: Any = None,
    ):
        if max_running < 1 or step_token_budget < 1:
            raise ValueError("max_running and step_token_budget must be positive")
        if isinstance(min_chunk_tokens, bool) or int(min_chunk_tokens) != min_chunk_tokens or min_chunk_tokens < 0:
            raise ValueError(f"min_chunk_tokens must be a non-negative int (0: never shrink), got {min_chunk_tokens!r}")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        self.manager = manager
        self.requests = list(requests)
        self.max_running = int(max_running)
        self.budget = int(step_token_budget)
        self.max_steps = int(max_steps)
        self.min_chunk_tokens = int(min_chunk_tokens)
        # The engine's side of a tier link (hybridkv.sim.cluster.TierEngine): loads a new
        # request's tier hit, runs each step's offloads. None: no tier.
        self.tier = tier
        total = [r.prompt_tokens + r.output_tokens for r in self.requests]
        too_long = [r.request_id for r, t in zip(self.requests, total) if t > manager.max_context_tokens]
        if too_long:
            count = "1 request exceeds" if len(too_long) == 1 else f"{len(too_long):,} requests exceed"
            raise ValueError(
                f"{count} the max context of {manager.max_context_tokens:,} tokens "
                f"(first: {too_long[0]!r})"
            )

    def run(self, on_step: Callable[[int, int], None] | None = None) -> SimResult:
        steps = self.steps(on_step)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def steps(self, on_step: Callable[[int, int], None] | None = None, finished_ids: set[str] | None = None,
              ) -> Generator[bool, None, SimResult]:
        """``run`` one step at a time: yields whether the step scheduled work; returns the result.

        ``finished_ids`` shared by several simulators (a cluster) lets a request wait for one
        that another runs: an instance with only such requests then idles a step at a time
        (instead of skipping ahead or giving up) until its driver stops calling it."""
        run = _Run(self.requests, finished_ids, tuple(s.group_id for s in self.manager.specs))
        while run.has_work():
            self._check_max_steps(run)
            self._arrive(run)
            if not (run.waiting or run.running):
                if self._idle(run):
                    run.step += 1
                    yield False
                continue
            work = _StepWork(self.budget)
            self._batch_running(run, work)
            self._preempt_until_fits(run, work)
            self._start_waiting(run, work)
            if work.parked:  # a request held for a peer's blocks kept pages: the batch fits again
                self._preempt_until_fits(run, work)
            if not work.items:
                if not self._stalled(run, work):
                    break
                run.step += 1
                yield False
                continue
            self._run_step(run, work)
            run.note(work, self.manager)
            run.step += 1
            if on_step is not None:
                on_step(run.step, len(run.records))
            yield True
        return self._result(run)

    def _check_max_steps(self, run: _Run) -> None:
        if len(run.series["running"]) >= self.max_steps:
            raise SimulationError(
                f"the run reached max_steps={self.max_steps:,} scheduled steps with "
                f"{len(run.records):,} of {len(self.requests):,} requests finished; "
                "raise max_steps or run fewer requests"
            )

    @staticmethod
    def _stalled(run: _Run, work: _StepWork) -> bool:
        """A step that scheduled nothing: whether requests remain (the run idles a step);
        a waiting request that cannot start with nothing running is an error."""
        if not (run.running or run.waiting or run.blocked or run.pending or run.held):
            return False
        if not run.running and run.waiting:
            raise SimulationError(
                f"request {run.waiting[0].rid!r} cannot start even with no request running: "
                f"the cache is too small for it ({work.refusal})"
            )
        return True

    # --- the stages of a step --------------------------------------------------
    def _arrive(self, run: _Run) -> None:
        """Arrivals up to this step join the line once the request they follow finished;
        requests waiting for a peer's blocks move on when the tier says so."""
        while run.pending and run.pending[0].arrival_step <= run.step:
            run.blocked.append(run.pending.popleft())
        still = []
        for r in run.blocked:
            if r.after_request_id is None or r.after_request_id in run.finished_ids:
                run.waiting.append(_Live(r))
            else:
                still.append(r)
        run.blocked = still
        if run.held:
            run.held = self._resume_held(run.held, run.waiting)

    def _idle(self, run: _Run) -> bool:
        """Nothing to schedule: whether to idle one step (a cluster, or requests held);
        else skip ahead to the next arrival (False), or fail when none will come."""
        if run.shared or run.held:
            return True
        if run.pending:
            run.step = max(run.step + 1, run.pending[0].arrival_step)
            return False
        blocked = run.blocked[0]
        raise SimulationError(
            f"request {blocked.request_id!r} waits for {blocked.after_request_id!r}, which never runs"
        )

    def _batch_running(self, run: _Run, work: _StepWork) -> None:
        """Running requests: decodes (1 token each) first, then prefill chunks."""
        for live in run.running:
            if self._prefill_left(live) == 0:
                work.add(live, 1)
        for live in run.running:
            left = self._prefill_left(live)
            if left > 0 and work.budget > 0:
                work.add(live, min(left, work.budget))

    def _preempt_until_fits(self, run: _Run, work: _StepWork) -> None:
        """Until the batch fits: shrink its last chunk, else preempt the most recently
        started request (freed, back to the front of the line)."""
        mgr = self.manager
        while work.items:
            answers = work.timed(mgr.check_admission, work.items)
            if all(a.ok for a in answers):
                return
            if work.timed(self._shrink_last_chunk, work.batch, work.items):
                work.memory_short = True
                return
            victim = run.running.pop()  # the most recently started
            if not run.running:
                reason = next(a.reason for a in answers if not a.ok)
                raise SimulationError(
                    f"request {victim.rid!r} cannot grow even with no other request running: "
                    f"the cache is too small for it ({reason})"
                )
            work.drop(victim)
            work.timed(mgr.free, victim.rid)
            run.frees += 1
            work.preempted += 1
            run.preempt_count[victim.rid] = run.preempt_count.get(victim.rid, 0) + 1
            victim.incarnation += 1
            victim.prepared = None  # recomputed from a longer sequence: prepared again
            run.waiting.appendleft(victim)

    def _refuse(self, live: _Live, work: _StepWork, answer) -> None:
        """``live`` does not start this step: freed again, the reason noted."""
        work.refusal = answer.reason if not answer.ok else "its tier load got no pages"
        self.manager.free(live.rid)

    def _start_waiting(self, run: _Run, work: _StepWork) -> None:
        """Start waiting requests in line while room remains (none after a preemption or a
        shrunk chunk)."""
        while (run.waiting and len(run.running) < self.max_running and work.budget > 0
               and not work.preempted and not work.memory_short):
            live = run.waiting[0]
            if live.denied_at == run.frees and run.running:
                work.refusal = "its tier load got no pages, and no request was freed since"
                return  # asked again (add, store, load) once pages may have come back
            started = self._try_start(run, work, live)
            if started is None:  # held for a peer's blocks: others may start
                continue
            if not started:
                return
            run.waiting.popleft()
            if live.incarnation == 0:
                run.first_hit[live.rid] = live.hit_tokens
                run.first_tier_hit[live.rid] = self.tier.loaded_tokens(live.rid) if self.tier is not None else 0
                work.hit_tokens += live.hit_tokens
                work.prompt_tokens += live.request.prompt_tokens
            live.started_step = run.step if live.started_step < 0 else live.started_step
            run.running.append(live)

    def _try_start(self, run: _Run, work: _StepWork, live: _Live) -> bool | None:
        """Add ``live`` to the manager (its prefix hit, and a tier's load) and its first chunk
        to the batch if everything still fits: True; False (freed again) when it does not;
        None when it waits for blocks another request computes."""
        mgr = self.manager
        t0, denied = time.perf_counter(), False
        if not live.added:  # (added: resumed from waiting for another request's blocks)
            self._add(live)
            if self.tier is not None:
                self.tier.forget(live.rid)
        live.added = False
        if self.tier is not None:
            work.us += (time.perf_counter() - t0) * 1e6
            # the device hit and what the store adds; a load that got no pages waits
            # for them (as a chunk that does not fit) while others run: tried again once one is freed
            live.hit_tokens, denied, parked = self.tier.load(live.rid)
            live.denied_at = run.frees if denied else -1
            t0 = time.perf_counter()
            if parked:
                work.parked = True  # it keeps its hit's pages, which the batch may have counted on
                live.added = True
                run.held.append(run.waiting.popleft())
                return None
        live.scheduled_tokens = 0
        live.context_tokens = live.prepared.prompt_tokens
        n = max(1, min(self._prefill_left(live), work.budget))
        # Every item must still fit, not only the new one: its prefix hit borrowed
        # cached pages that the batch admitted so far may have been counting on.
        answers = mgr.check_admission(work.items + [(live.rid, n)])
        answer = next((a for a in answers if not a.ok), answers[-1])
        ok = answer.ok and not (denied and run.running)
        if not ok and not run.running:
            # Alone, a first chunk larger than a pool would otherwise never start.
            fit = self._fitting_tokens(live.rid, n, n, work.items)
            ok = work.memory_short = fit > 0
            n = fit or n
        if not ok:
            self._refuse(live, work, answer)
        work.us += (time.perf_counter() - t0) * 1e6
        if ok:
            work.add(live, n)
        return ok

    def _add(self, live: _Live) -> None:
        """Add ``live`` to the manager, its hit noted, from its sequence prepared (hashed) once an incarnation,
        however often it is refused (freed) and added again."""
        if live.prepared is None:
            remaining = live.request.output_tokens - live.produced
            live.prepared = self.manager.prepare_prompt(live.sequence(), max_new_tokens=remaining)
        live.hit_tokens = self.manager.add_request(live.rid, live.prepared).hit_tokens

    def _run_step(self, run: _Run, work: _StepWork) -> None:
        """Schedule the batch, then "sample": requests whose context is complete produce a
        token; those done are freed and recorded."""
        mgr = self.manager
        work.timed(mgr.schedule, work.items)
        if self.tier is not None:
            self.tier.offload()  # before the step writes a page
        still_running = []
        for live, n in work.batch:
            live.scheduled_tokens += n
            run.total_sched[live.rid] = run.total_sched.get(live.rid, 0) + n
            if live.hit_tokens + live.scheduled_tokens < live.context_tokens:
                still_running.append(live)
                continue
            live.produced += 1
            if live.produced >= live.request.output_tokens:
                work.timed(mgr.free, live.rid)
                run.frees += 1
                run.finished_ids.add(live.rid)
                record = self._record(live, run.step, run.first_hit, run.total_sched, run.preempt_count)
                record.first_tier_hit_tokens = run.first_tier_hit.get(live.rid, 0)
                run.records.append(record)
                continue
            work.timed(mgr.append_token_ids, live.rid,
                       live.request.output_token_ids[live.produced - 1 : live.produced])
            still_running.append(live)
        scheduled = {id(lv) for lv, _ in work.batch}
        run.running = [lv for lv in run.running if id(lv) not in scheduled] + still_running
        if self.tier is not None:
            self.tier.offload()  # what the finished requests published, out before others look

    def _result(self, run: _Run) -> SimResult:
        mgr, gids = self.manager, run.group_ids
        if mgr.arena is not None:
            g = mgr.arena.geometry
            totals = {gid: g.total_bytes / g.page_bytes[gid] for gid in gids}
        else:
            stats = mgr.stats()
            totals = {gid: stats[gid].total_pages for gid in gids}
        series = {k: np.asarray(v, dtype=np.float64 if k == "us" else np.int64) for k, v in run.series.items()}
        return SimResult(
            steps=len(run.series["running"]),
            group_ids=gids,
            group_total_pages=totals,
            shared_arena=mgr.arena is not None,
            used_pages={g: np.asarray(v, dtype=np.int64) for g, v in run.used.items()},
            running=series["running"],
            scheduled_tokens=series["sched"],
            hit_tokens=series["hit"],
            prompt_tokens_started=series["prompt"],
            preemptions=series["preempt"],
            manager_us=series["us"],
            requests=run.records,
            shrunk_chunks=series["shrunk"],
        )

    def _resume_held(self, held: list[_Live], waiting: deque) -> list[_Live]:
        """Let the tier move waiting requests on; those no longer waiting go first in line."""
        self.tier.resume()
        resumed = [live for live in held if not self.tier.waiting(live.rid)]
        for live in reversed(resumed):
            waiting.appendleft(live)
        return [live for live in held if self.tier.waiting(live.rid)]

    @staticmethod
    def _prefill_left(live: _Live) -> int:
        return max(live.context_tokens - live.hit_tokens - live.scheduled_tokens, 0)

    def _fitting_tokens(self, rid: str, chunk: int, upto: int, rest: list) -> int:
        """Tokens, up to ``upto``, that a ``chunk``-token chunk of ``rid`` can shrink to
        beside ``rest``; 0 below ``min(min_chunk_tokens, chunk)`` (or when shrinking is
        off, or ``rest`` does not fit)."""
        if not self.min_chunk_tokens or chunk <= 1:
            return 0
        try:
            fit = self.manager.max_admissible_tokens(rid, upto, batch=rest)
        except ValueError:
            return 0  # the rest does not fit either
        return fit if fit >= min(self.min_chunk_tokens, chunk) else 0

    def _shrink_last_chunk(self, batch: list, items: list) -> bool:
        """Shrink the step's last item, if it is a prefill chunk, to what fits with the
        rest (in place); False if that is not possible or below ``min_chunk_tokens``."""
        if not items or items[-1][1] <= 1:
            return False
        live, n = batch[-1]
        fit = self._fitting_tokens(live.rid, n, n - 1, items[:-1])
        if not fit:
            return False
        batch[-1] = (live, fit)
        items[-1] = (live.rid, fit)
        return True

    @staticmethod
    def _record(live, step, first_hit, total_sched, preempt_count) -> RequestRecord:
        r = live.request
        return RequestRecord(
            request_id=r.request_id,
            prompt_tokens=r.prompt_tokens,
            output_tokens=r.output_tokens,
            first_hit_tokens=first_hit.get(r.request_id, 0),
            final_hit_tokens=live.hit_tokens,
            final_scheduled_tokens=live.scheduled_tokens,
            total_scheduled_tokens=total_sched.get(r.request_id, 0),
            preemptions=preempt_count.get(r.request_id, 0),
            produced_tokens=live.produced,
            start_step=live.started_step,
            finish_step=step,
        )
