"""Prefill phase: manager time per ``chunk_tokens``-token chunk of long unique prompts.

Each round, each side gets ``num_requests`` unique prompts of ``prompt_tokens``
(the same ids on both sides and in every round; prefix caches reset first),
probes them (untimed), then schedules their chunks one per step, request after
request; the sides' chunk steps alternate.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridkv.sim.workloads import DEFAULT_VOCAB_SIZE

from .sides import CacheSide, step_ns
from .timing import alternate, summarize_rounds


class PrefillDriver:
    def __init__(self, side: CacheSide, prompts: list[np.ndarray], chunk_tokens: int) -> None:
        self.side, self.prompts, self.chunk_tokens = side, prompts, chunk_tokens
        self.chunks_per_prompt = -(-prompts[0].size // chunk_tokens)
        self.handles: list[Any] = []

    def start(self) -> None:
        for index, prompt in enumerate(self.prompts):
            handle = self.side.new_request(f"prefill-{index}", prompt)
            self.side.probe_hit(handle)
            self.handles.append(handle)
        self.side.take_timings()

    def step(self, index: int) -> int:
        side = self.side
        handle = self.handles[index // self.chunks_per_prompt]
        prompt_tokens = self.prompts[index // self.chunks_per_prompt].size
        done = side.num_computed_tokens(handle)
        side.begin_step()
        if not side.allocate(handle, min(self.chunk_tokens, prompt_tokens - done)):
            raise RuntimeError(f"{side.name}: prefill chunk {index} refused")
        return step_ns(side.take_timings())

    def stop(self) -> None:
        for handle in self.handles:
            self.side.free(handle)
        self.handles = []
        self.side.take_timings()


def measure_prefill(sides: dict[str, CacheSide], *, num_requests: int, prompt_tokens: int, chunk_tokens: int,
                    rounds: int, seed: int) -> dict:
    rng = np.random.default_rng(seed + 2)
    prompts = [rng.integers(0, DEFAULT_VOCAB_SIZE, size=prompt_tokens, dtype=np.int32) for _ in range(num_requests)]
    rounds_ns = []
    for _ in range(rounds):
        drivers = {}
        for name, side in sides.items():
            if not side.reset_prefix_cache():
                raise RuntimeError(f"{name}: prefix cache could not be reset before prefill")
            drivers[name] = PrefillDriver(side, prompts, chunk_tokens)
            drivers[name].start()
        steps = next(iter(drivers.values())).chunks_per_prompt * num_requests
        rounds_ns.append(alternate({name: d.step for name, d in drivers.items()}, steps))
        for driver in drivers.values():
            driver.stop()
    out = summarize_rounds(rounds_ns)
    out.update(chunk_tokens=chunk_tokens, prompt_tokens=prompt_tokens, requests=num_requests)
    return out
