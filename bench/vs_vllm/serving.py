"""Serving phase: a steady ``running`` requests, with joins and finishes in every step.

Each side runs its own copy of one small scheduler (:class:`ServingDriver`)
over the same request stream (``workload.serving_requests``). A step:

1. frees the requests that sampled their last output token in the step before;
2. admits new requests from the stream until ``running`` are in (each probes
   its cached prefix: vLLM ``get_computed_blocks``, hybridkv ``add_request``;
   making the request, outside the step's time, hashes its prompt's blocks:
   vLLM's ``Request``, hybridkv's ``prepare_prompt``);
3. schedules one batch: one token for each request that is decoding, then
   prefill chunks of at most ``chunk_tokens`` for the requests still in their
   prompt, in arrival order, within ``step_tokens`` for the whole step
   (vLLM: one ``allocate_slots`` per request; hybridkv: one ``schedule``);
4. appends the token each decoding request and each request that finished its
   prompt sampled (outside the step's time: vLLM hashes blocks there).

The step's time is the manager time of 1-3. Before the timed steps each side
is brought to the same steady state (``workload.steady_start``): ``running``
requests mid-life, of which ``finishes_per_step`` finish on every step, so every
step has that many finishes and as many joins. Prefix hits differ between the
sides (their hit grains differ), so a joining request's chunks may differ too;
each side's counts are reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .sides import CacheSide, advance, advance_settled, step_ns
from .timing import alternate, summarize_rounds
from .workload import ServingRequest, ServingShape, serving_requests, steady_start


def finishes_per_step(running: int, shape: ServingShape) -> int:
    """Requests finishing per step in steady state: ``running`` over the mean output
    length (the steps a request decodes), rounded, and at least one."""
    mean_output = (shape.output_tokens[0] + shape.output_tokens[1]) / 2
    return max(1, round(running / mean_output))


@dataclass
class _Live:
    request: ServingRequest
    handle: Any
    computed_tokens: int
    produced_tokens: int  # output tokens sampled (and appended)


@dataclass
class ServingCounts:
    """What one side's scheduler did over the timed steps."""

    steps: int = 0
    joined: int = 0
    finished: int = 0
    hit_tokens: int = 0
    joined_prompt_tokens: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    prefill_chunks: int = 0
    hash_ns: int = 0  # making requests (prompt hashing) and, vLLM, hashing appended tokens' blocks
    append_ns: int = 0  # hybridkv's append_token_ids_many
    finished_per_step: list[int] = field(default_factory=list)


class ServingDriver:
    """One side's scheduler for the serving phase (see the module docstring)."""

    def __init__(self, side: CacheSide, stream: list[ServingRequest], *, running: int, step_tokens: int,
                 chunk_tokens: int) -> None:
        if step_tokens <= running:
            raise ValueError(f"step_tokens ({step_tokens}) must exceed the running requests ({running})")
        self.side, self.stream = side, stream
        self.target_running, self.step_tokens, self.chunk_tokens = running, step_tokens, chunk_tokens
        self.running: list[_Live] = []
        self.next_arrival = 0
        self.counts = ServingCounts()

    def start(self, produced_tokens: list[int]) -> None:
        """Untimed: bring the first requests of the stream to their steady-state point
        (prompt computed, ``produced`` outputs sampled, all but the last computed)."""
        side = self.side
        for produced in produced_tokens:
            request = self.stream[self.next_arrival]
            self.next_arrival += 1
            handle = side.new_request(request.request_id, request.prompt_ids, max_tokens=request.output_tokens)
            side.probe_hit(handle)
            side.append_tokens(handle, request.output_ids[:produced].tolist())
            fits = advance_settled(side, handle, request.prompt_tokens + produced - 1, self.step_tokens)
            if not fits:
                raise RuntimeError(f"{side.name}: the serving start state does not fit ({request.request_id}); "
                                   "give the phase more memory")
            self.running.append(_Live(request, handle, request.prompt_tokens + produced - 1, produced))
        side.take_timings()

    def _join(self) -> None:
        if self.next_arrival == len(self.stream):
            raise RuntimeError("the serving stream ran out of requests")
        request = self.stream[self.next_arrival]
        self.next_arrival += 1
        handle = self.side.new_request(request.request_id, request.prompt_ids, max_tokens=request.output_tokens)
        hit = self.side.probe_hit(handle)
        self.running.append(_Live(request, handle, hit, 0))
        self.counts.joined += 1
        self.counts.hit_tokens += hit
        self.counts.joined_prompt_tokens += request.prompt_tokens

    def _batch(self) -> tuple[list[tuple[Any, int]], list[_Live], list[_Live]]:
        """The step's items, the live requests they belong to, and those that sample a token."""
        items, scheduled, sampling = [], [], []
        budget = self.step_tokens
        for live in self.running:
            if live.produced_tokens > 0:
                items.append((live.handle, 1))
                scheduled.append(live)
                sampling.append(live)
        budget -= len(items)
        for live in self.running:
            if live.produced_tokens > 0 or budget == 0:
                continue
            tokens = min(self.chunk_tokens, live.request.prompt_tokens - live.computed_tokens, budget)
            items.append((live.handle, tokens))
            scheduled.append(live)
            budget -= tokens
            if live.computed_tokens + tokens == live.request.prompt_tokens:
                sampling.append(live)
        return items, scheduled, sampling

    def step(self, index: int) -> int:
        """One timed step; returns its manager time in ns."""
        side, counts = self.side, self.counts
        self._bookkeeping(side.take_timings())
        done = [live for live in self.running if live.produced_tokens == live.request.output_tokens]
        for live in done:
            side.free(live.handle)
        if done:
            self.running = [live for live in self.running if live.produced_tokens < live.request.output_tokens]
        while len(self.running) < self.target_running:
            self._join()
        items, scheduled, sampling = self._batch()
        side.begin_step()
        if not side.schedule_step(items):
            raise RuntimeError(f"{side.name}: serving step {index} was refused; give the phase more memory")
        timings = side.take_timings()
        self._bookkeeping(timings)
        for live, (_, tokens) in zip(scheduled, items):
            live.computed_tokens += tokens
            if tokens == 1 and live.produced_tokens > 0:
                counts.decode_tokens += 1
            else:
                counts.prefill_tokens += tokens
                counts.prefill_chunks += 1
        side.append_many([live.handle for live in sampling],
                         [int(live.request.output_ids[live.produced_tokens]) for live in sampling])
        for live in sampling:
            live.produced_tokens += 1
        counts.steps += 1
        counts.finished += len(done)
        counts.finished_per_step.append(len(done))
        return step_ns(timings)

    def _bookkeeping(self, timings: dict[str, int]) -> None:
        self.counts.hash_ns += timings.get("hash", 0)
        self.counts.append_ns += timings.get("append", 0)

    def stop(self) -> None:
        """Untimed: free every running request."""
        self._bookkeeping(self.side.take_timings())
        for live in self.running:
            self.side.free(live.handle)
        self.running = []
        self.side.take_timings()


def _reset(side: CacheSide, phase: str) -> None:
    if not side.reset_prefix_cache():
        raise RuntimeError(f"{side.name}: prefix cache could not be reset before {phase}")


FILL_PROMPT_TOKENS = 4096


def fill_prefix_cache(side: CacheSide, tokens: int, *, chunk_tokens: int, seed: int) -> int:
    """Prefill and free distinct ``FILL_PROMPT_TOKENS``-token prompts (ids of a seeded stream no serving
    prompt shares) until ``tokens`` were computed, so the prefix cache holds them (a long-running server's
    state: later allocations evict). Returns the prompts filled; untimed."""
    rng, filled = np.random.default_rng([seed, 0xF111]), 0
    while filled * FILL_PROMPT_TOKENS < tokens:
        ids = rng.integers(0, 100_000, FILL_PROMPT_TOKENS).tolist()
        request = side.new_request(f"fill-{filled:06d}", ids, max_tokens=1)
        side.probe_hit(request)
        fits = advance(side, request, FILL_PROMPT_TOKENS, chunk_tokens)
        side.free(request)
        if not fits:
            raise RuntimeError(f"{side.name}: a {FILL_PROMPT_TOKENS:,}-token fill prompt does not fit")
        filled += 1
    side.take_timings()
    return filled


def measure_serving(sides: dict[str, CacheSide], *, running: int, steps: int, rounds: int, step_tokens: int,
                    chunk_tokens: int, shape: ServingShape, seed: int, fill_tokens: int = 0) -> dict:
    """``rounds`` rounds of ``steps`` alternating serving steps at ``running`` requests.

    Rounds run in segments: each segment sets both sides up afresh in the same
    steady state (prefix caches reset) and then runs as many consecutive rounds
    as its running requests supply finishes for (``steps`` shrinks to that when
    not even one round fits); with ``fill_tokens``, each side's cache is filled after
    each reset (:func:`fill_prefix_cache`). Returns ``timing.summarize_rounds``'s figures plus,
    per side, the counts summed over the segments.
    """
    per_step = finishes_per_step(running, shape)
    steps = max(1, min(steps, running // per_step))
    rounds_ns: list = []
    counts: dict[str, list[ServingCounts]] = {name: [] for name in sides}
    while len(rounds_ns) < rounds:
        segment = min(rounds - len(rounds_ns), max(1, running // (per_step * steps)))
        rounds_ns += _segment(sides, counts, running=running, steps=steps, rounds=segment, per_step=per_step,
                              step_tokens=step_tokens, chunk_tokens=chunk_tokens, shape=shape, seed=seed,
                              fill_tokens=fill_tokens)
    out = summarize_rounds(rounds_ns)
    out.update(running=running, finishes_per_step=per_step)
    for name, parts in counts.items():
        out[name].update(_counts_summary(parts))
    return out


def _segment(sides: dict[str, CacheSide], counts: dict[str, list[ServingCounts]], *, running: int, steps: int,
             rounds: int, per_step: int, step_tokens: int, chunk_tokens: int, shape: ServingShape,
             seed: int, fill_tokens: int) -> list:
    """One set-up and ``rounds`` consecutive rounds; appends each side's counts."""
    horizon = steps * rounds
    # Enough arrivals for every finish: the scheduled ones, short outputs, and joiners that finish.
    stream = serving_requests(running + 4 * per_step * horizon + 64, seed=seed, shape=shape)
    produced = steady_start(stream[:running], finishes_per_step=per_step, horizon_steps=horizon, seed=seed + 1)
    drivers = {}
    for name, side in sides.items():
        _reset(side, "serving")
        if fill_tokens:
            fill_prefix_cache(side, fill_tokens, chunk_tokens=chunk_tokens, seed=seed)
        drivers[name] = ServingDriver(side, stream, running=running, step_tokens=step_tokens,
                                      chunk_tokens=chunk_tokens)
        drivers[name].start(produced)
    out = [alternate({name: (lambda k, d=d, o=r * steps: d.step(o + k)) for name, d in drivers.items()}, steps)
           for r in range(rounds)]
    for name, driver in drivers.items():
        driver.stop()
        counts[name].append(driver.counts)
    return out


def _counts_summary(parts: list[ServingCounts]) -> dict:
    steps = sum(c.steps for c in parts)
    prompt_tokens = sum(c.joined_prompt_tokens for c in parts)
    per_step = [n for c in parts for n in c.finished_per_step]
    return dict(
        joined=sum(c.joined for c in parts), finished=sum(c.finished for c in parts),
        finished_per_step_min=min(per_step), finished_per_step_mean=sum(per_step) / len(per_step),
        hit_rate=sum(c.hit_tokens for c in parts) / prompt_tokens if prompt_tokens else None,
        decode_tokens_per_step=sum(c.decode_tokens for c in parts) / steps,
        prefill_tokens_per_step=sum(c.prefill_tokens for c in parts) / steps,
        prefill_chunks_per_step=sum(c.prefill_chunks for c in parts) / steps,
        hash_us_per_step=sum(c.hash_ns for c in parts) / steps / 1e3,
        append_us_per_step=sum(c.append_ns for c in parts) / steps / 1e3,
    )
