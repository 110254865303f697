"""The serving and decode phases' requests: seeded, the same token ids for both sides.

A request's prompt is one of ``num_prefixes`` shared system prompts, cut to
``prefix_tokens`` or half the prompt, whichever is shorter, followed by unique
tokens; its whole length is uniform in ``prompt_tokens`` (both ends included),
its output length uniform in ``output_tokens``. Output token ids are drawn with the prompt, so both sides
"sample" the same tokens.

:func:`steady_start` puts the first ``running`` requests of the stream in the
middle of their lives, as a server in steady state has them: a few are about
to finish (``finishes_per_step`` on each of the next ``horizon_steps`` steps),
the rest have produced part of their output and will not finish within the
horizon.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridkv.sim.workloads import DEFAULT_VOCAB_SIZE


@dataclass(frozen=True)
class ServingShape:
    """Lengths of the serving workload (token counts, both ends included)."""

    prompt_tokens: tuple[int, int] = (512, 4096)
    output_tokens: tuple[int, int] = (64, 1024)
    prefix_tokens: int = 1024
    num_prefixes: int = 8

    def __post_init__(self) -> None:
        low, high = self.prompt_tokens
        if not (0 <= self.prefix_tokens and 2 <= low <= high):
            raise ValueError(f"need prefix_tokens >= 0 and 2 <= shortest prompt <= longest prompt, got "
                             f"{self.prefix_tokens}, {self.prompt_tokens}")
        if not 0 < self.output_tokens[0] <= self.output_tokens[1]:
            raise ValueError(f"output_tokens must be a range of positive counts, got {self.output_tokens}")
        if self.num_prefixes < 1:
            raise ValueError(f"num_prefixes must be at least 1, got {self.num_prefixes}")


@dataclass(frozen=True)
class ServingRequest:
    request_id: str
    prompt_ids: np.ndarray  # int32 [prompt tokens]
    output_ids: np.ndarray  # int32 [output tokens]: what the request "samples", in order

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt_ids.size)

    @property
    def output_tokens(self) -> int:
        return int(self.output_ids.size)


def serving_requests(count: int, *, seed: int, shape: ServingShape = ServingShape(),
                     prefix: str = "srv") -> list[ServingRequest]:
    """``count`` requests in arrival order (deterministic for a seed; the first ``n``
    are the same whatever ``count``)."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, DEFAULT_VOCAB_SIZE, size=(shape.num_prefixes, shape.prefix_tokens), dtype=np.int32)
    out = []
    for i in range(count):
        prompt_tokens = int(rng.integers(shape.prompt_tokens[0], shape.prompt_tokens[1] + 1))
        output_tokens = int(rng.integers(shape.output_tokens[0], shape.output_tokens[1] + 1))
        shared = min(shape.prefix_tokens, prompt_tokens // 2)
        head = prefixes[int(rng.integers(0, shape.num_prefixes)), :shared]
        body = rng.integers(0, DEFAULT_VOCAB_SIZE, size=prompt_tokens - shared, dtype=np.int32)
        outputs = rng.integers(0, DEFAULT_VOCAB_SIZE, size=output_tokens, dtype=np.int32)
        out.append(ServingRequest(f"{prefix}-{i:06d}", np.concatenate([head, body]), outputs))
    return out


def steady_start(requests: list[ServingRequest], *, finishes_per_step: int, horizon_steps: int,
                 seed: int) -> list[int]:
    """Output tokens each request has produced when the timed steps begin.

    The first ``finishes_per_step * horizon_steps`` requests finish inside the
    horizon: ``finishes_per_step`` of them have no token left (they are freed in
    step 0), as many have one left (they get their last token in step 0 and are
    freed in step 1), and so on, so every step of the horizon frees at least that
    many; the shortest outputs get the fewest tokens left, so each fits its
    share. Every other request has at least ``horizon_steps`` tokens left
    (uniform from there to all but one) where its output allows, else all but
    one (it then finishes inside the horizon too, as a short request would).
    Every request has produced at least one token (its prefill sampled it).
    """
    if finishes_per_step < 1 or horizon_steps < 1:
        raise ValueError("finishes_per_step and horizon_steps must be at least 1")
    finishing = finishes_per_step * horizon_steps
    if finishing > len(requests):
        raise ValueError(f"{finishing} finishes need that many running requests, got {len(requests)}")
    by_output = sorted(range(finishing), key=lambda j: requests[j].output_tokens)
    left = {j: rank // finishes_per_step for rank, j in enumerate(by_output)}
    rng = np.random.default_rng(seed)
    for j in range(finishing, len(requests)):
        total = requests[j].output_tokens
        left[j] = int(rng.integers(horizon_steps, total)) if total - 1 > horizon_steps else total - 1
    produced = []
    for j, request in enumerate(requests):
        if left[j] >= request.output_tokens:
            raise ValueError(f"{request.request_id}: {request.output_tokens} output tokens cannot leave {left[j]}")
        produced.append(request.output_tokens - left[j])
    return produced
