"""Steady decode phase: ``running`` requests each get one token per step, no joins or finishes.

The requests are the serving workload's (``workload.serving_requests``: shared
prefixes, prompts of 512-4,096 tokens), prefilled and given their first
output token before the timed steps. A step is ``decode_step`` of the whole
batch (vLLM: one ``allocate_slots`` per request, as its scheduler does;
hybridkv: one ``schedule_uniform``), then each request's sampled token is
appended (outside the step's time). The rounds are consecutive stretches of
``steps`` steps over one set-up, so the contexts grow through them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridkv.sim.workloads import DEFAULT_VOCAB_SIZE

from .sides import CacheSide, advance_settled, step_ns
from .timing import alternate, summarize_rounds
from .workload import ServingShape, serving_requests


class DecodeDriver:
    """One side's running batch for the decode phase."""

    def __init__(self, side: CacheSide, *, running: int, total_steps: int, chunk_tokens: int,
                 shape: ServingShape, seed: int) -> None:
        self.side = side
        self.requests = serving_requests(running, seed=seed, shape=shape, prefix="dec")
        self.total_steps, self.chunk_tokens = total_steps, chunk_tokens
        rng = np.random.default_rng(seed + 2)
        self.tokens = rng.integers(0, DEFAULT_VOCAB_SIZE, size=(total_steps, running), dtype=np.int32)
        self.handles: list[Any] = []
        self.hash_ns = self.append_ns = 0

    def start(self) -> None:
        """Untimed: prefill every request and compute its first output token (one step
        of its own), then append its second."""
        side = self.side
        for request in self.requests:
            handle = side.new_request(request.request_id, request.prompt_ids, max_tokens=self.total_steps + 3)
            side.probe_hit(handle)
            side.append_tokens(handle, request.output_ids[:2].tolist())
            if not advance_settled(side, handle, request.prompt_tokens + 1, self.chunk_tokens):
                raise RuntimeError(f"{side.name}: decode set-up does not fit ({request.request_id})")
            self.handles.append(handle)
        side.take_timings()

    def step(self, index: int) -> int:
        side = self.side
        self._bookkeeping(side.take_timings())
        side.begin_step()
        if not side.decode_step(self.handles):
            raise RuntimeError(f"{side.name}: decode step {index} refused a slot")
        timings = side.take_timings()
        self._bookkeeping(timings)
        side.append_many(self.handles, self.tokens[index % self.total_steps])
        return step_ns(timings)

    def _bookkeeping(self, timings: dict[str, int]) -> None:
        self.hash_ns += timings.get("hash", 0)
        self.append_ns += timings.get("append", 0)

    def stop(self) -> None:
        self._bookkeeping(self.side.take_timings())
        for handle in self.handles:
            self.side.free(handle)
        self.handles = []
        self.side.take_timings()


def measure_decode(sides: dict[str, CacheSide], *, running: int, steps: int, rounds: int, chunk_tokens: int,
                   shape: ServingShape, seed: int) -> dict:
    """``rounds`` consecutive stretches of ``steps`` alternating decode steps."""
    drivers = {}
    for name, side in sides.items():
        if not side.reset_prefix_cache():
            raise RuntimeError(f"{name}: prefix cache could not be reset before decode")
        drivers[name] = DecodeDriver(side, running=running, total_steps=steps * rounds, chunk_tokens=chunk_tokens,
                                     shape=shape, seed=seed)
        drivers[name].start()
    rounds_ns = []
    for r in range(rounds):
        offset = r * steps
        rounds_ns.append(alternate({name: (lambda k, d=d, o=offset: d.step(o + k)) for name, d in drivers.items()},
                                   steps))
    for driver in drivers.values():
        driver.stop()
    out = summarize_rounds(rounds_ns)
    out.update(running=running)
    for name, driver in drivers.items():
        total_steps = steps * rounds
        out[name].update(
            us_per_request_step=out[name]["us_per_step_mean"] / running,
            hash_us_per_step=driver.hash_ns / total_steps / 1e3,
            append_us_per_step=driver.append_ns / total_steps / 1e3,
        )
    return out
