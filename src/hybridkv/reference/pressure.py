"""Scenarios under memory pressure: evictions, preemption, hits at checkpoints of
rewound and evicted requests, and seeded random workloads.

Both run the paged stack under a manager planned for a small budget (1,024
tokens, 4 running requests), so published prefixes are evicted to make room and
a request may be preempted (freed when a step finds no pages, then re-added:
its own checkpoints are its prefix hit).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hybridkv.runtime.manager import CacheManagerError

from hybridkv.reference.config import ReferenceConfig
from hybridkv.reference.runner import TOLERANCE, CheckResult, ScenarioRunner, VerifyReport, build_runner
from hybridkv.reference.scenario import path_checks, run_step

PRESSURE_TOTAL_TOKENS = 1024
PRESSURE_RUNNING = 4
Progress = Callable[[str], None]


def pressure_runner(config: ReferenceConfig | None, seed: int) -> ScenarioRunner:
    return build_runner(config, seed=seed, shuffle_seed=seed + 11, total_tokens=PRESSURE_TOTAL_TOKENS,
                        max_running_requests=PRESSURE_RUNNING)


def evicted_pages(runner: ScenarioRunner) -> int:
    return sum(s.evicted_pages for s in runner.manager.stats().values())


def _verify_cycles(runner: ScenarioRunner, rid: str, cycles: int, step0: int) -> None:
    """Verify 3 drafts and accept 1, ``cycles`` times (rows past the kept token go stale)."""
    for k in range(cycles):
        run_step(runner, [(rid, 3)], {rid: {"verify 3, accept 1, continue"}}, step0 + k)
        runner.rewind(rid, runner.manager.num_computed_tokens(rid) - 2)
        runner.snapshot(rid, "after rewind")


def run_pressure_scenario(
    seed: int = 0, *, config: ReferenceConfig | None = None, tolerance: float = TOLERANCE,
    progress: Progress | None = None,
) -> VerifyReport:
    """The scripted pressure scenario (``docs/reference.md`` section 5).

    * ``p``: 500-token prompt, then 12 verify cycles across position 512 (each rejects two
      drafts), 40 more tokens, freed: its 512-token checkpoint was written by recomputed tokens.
    * ``q``: ``p``'s first 512 tokens + 30 new: must hit 512 (a rewound request's checkpoint).
    * ``r``, ``s``: 800-token prompts that do not fit beside the cached prefixes: pages of
      ``p`` and ``q`` are evicted; ``s`` is preempted (freed mid-decode) and re-added
      (as ``s2``) with its computed tokens: it hits its own checkpoint.
    * ``t``: ``p``'s first 540 tokens again: after the evictions it hits less than 512 and
      computes the rest.
    """
    say = progress or (lambda _msg: None)
    runner = pressure_runner(config, seed)
    rng = np.random.default_rng(seed + 5)
    go = _Steps(runner)
    hits: dict[str, int] = {}
    p_tokens = _rewound_checkpoint(runner, rng, go, hits)
    say(f"pressure: p rewound 12 times across 512 and freed, q hit {hits['q']} ({runner.steps} steps)")

    before = evicted_pages(runner)
    preempted = _fill_and_preempt(runner, rng, go, hits)
    evictions = evicted_pages(runner) - before
    say(f"pressure: r and s filled the pool ({evictions} pages evicted, preempted: {preempted})")

    hits["t"] = runner.add("t", p_tokens[:540], 20).hit_tokens
    go([("t", 540 - hits["t"])], {"t": {"prefix hit after evictions"}})
    for _ in range(6):
        go([("t", 1)], {"t": {"decode", "prefix hit after evictions"}})
    say(f"pressure: t hit {hits['t']} of p's 540 tokens; comparing with dense")

    checks = runner.compare(tolerance)
    checks.extend(path_checks(runner))
    checks.extend([
        CheckResult("hit at a rewound request's checkpoint (512)", hits["q"] == 512, detail=f"q hit {hits['q']}"),
        CheckResult("evictions under pressure", evictions > 0, detail=f"{evictions} pages evicted"),
        CheckResult("a preempted request re-added hits its own checkpoint", preempted >= 512,
                    detail=f"s re-added as s2 with a hit of {preempted} tokens"),
        CheckResult("hit shortened by eviction", hits["t"] < 512 and evictions > 0,
                    detail=f"t hit {hits['t']} of 540 shared tokens"),
    ])
    return VerifyReport(tuple(checks), tolerance, ())


class _Steps:
    """Runs the scenario's steps in order (``go(items, tags)``), counting them."""

    def __init__(self, runner: ScenarioRunner):
        self.runner, self.step = runner, 0

    def __call__(self, items: list[tuple[str, int]], tags: dict[str, set[str]]) -> None:
        run_step(self.runner, items, tags, self.step)
        self.step += 1

    def verify_cycles(self, rid: str, cycles: int) -> None:
        _verify_cycles(self.runner, rid, cycles, self.step)
        self.step += cycles


def _rewound_checkpoint(runner: ScenarioRunner, rng, go: _Steps, hits: dict[str, int]) -> np.ndarray:
    """``p`` (500-token prompt, 11 decodes, 12 verify cycles across 512, 40 more tokens) is
    freed; ``q`` (``p``'s first 512 tokens + 30) hits the checkpoint rewound tokens wrote.
    Returns ``p``'s tokens."""
    vocab = runner.model.config.vocab_size
    runner.add("p", rng.integers(0, vocab, 500), max_new_tokens=100)
    go([("p", 500)], {"p": {"one-shot prefill"}})
    for _ in range(11):
        go([("p", 1)], {"p": {"decode"}})
    go.verify_cycles("p", 12)
    go([("p", 40)], {"p": {"chunked prefill"}})
    p_tokens = runner.tokens("p").copy()
    runner.free("p")
    hits["q"] = runner.add("q", np.concatenate([p_tokens[:512], rng.integers(0, vocab, 30)]), 40).hit_tokens
    go([("q", 30)], {"q": {"prefix hit at a rewound request's checkpoint"}})
    for _ in range(6):
        go([("q", 1)], {"q": {"decode", "prefix hit at a rewound request's checkpoint"}})
    runner.free("q")
    return p_tokens


def _fill_and_preempt(runner: ScenarioRunner, rng, go, hits) -> int:
    """``r`` and ``s`` prefill 800 tokens each in chunks (evicting cached prefixes) and
    decode; ``s`` is preempted (freed mid-decode, as an engine does when a step finds no
    pages) and re-added as ``s2`` with its computed tokens. Returns ``s2``'s hit tokens."""
    vocab = runner.model.config.vocab_size
    runner.add("r", rng.integers(0, vocab, 800), 200)
    runner.add("s", rng.integers(0, vocab, 800), 200)
    for chunk in (400, 400):
        go([("r", chunk), ("s", chunk)], {"r": {"chunked prefill"}, "s": {"chunked prefill"}})
    for _ in range(8):
        go([("r", 1), ("s", 1)], {"r": {"decode"}, "s": {"decode"}})
    tokens = runner.tokens("s")[: runner.manager.num_computed_tokens("s")].copy()
    runner.free("s")
    hits["s2"] = hit = runner.add("s2", tokens, 20).hit_tokens
    go([("r", 1), ("s2", tokens.size - hit)], {"r": {"decode"}, "s2": {"re-added after preemption"}})
    for _ in range(4):
        go([("r", 1), ("s2", 1)], {"r": {"decode"}, "s2": {"decode", "re-added after preemption"}})
    runner.free("r")
    runner.free("s2")
    return hit


def _new_prompt(rng, vocab: int, seen: list[np.ndarray]) -> np.ndarray:
    """A fresh prompt, or (60%) a prefix of an earlier sequence (at 256, 512 or anywhere) plus new tokens."""
    if seen and rng.random() < 0.6:
        base = seen[int(rng.integers(len(seen)))]
        share = min(base.size, int(rng.choice([256, 512, int(rng.integers(1, base.size + 1))])))
        prompt = np.concatenate([base[:share], rng.integers(0, vocab, int(rng.integers(1, 120)))])
    else:
        prompt = rng.integers(0, vocab, int(rng.integers(1, 600)))
    return prompt[:900]


def run_random_scenario(
    seed: int, *, config: ReferenceConfig | None = None, steps: int = 60, tolerance: float = TOLERANCE,
    progress: Progress | None = None,
) -> VerifyReport:
    """A seeded random workload under the pressure budget: up to 3 requests at a time,
    prompts that share prefixes with earlier sequences (rewound ones included), chunked
    prefill of random sizes, decode, verify 3 / accept 1-3, preemption of the newest
    request when a step finds no pages. Coverage is reported as notes."""
    say = progress or (lambda _msg: None)
    run = _RandomRun(pressure_runner(config, seed), np.random.default_rng(seed + 17))
    for step in range(steps):
        run.step(step)
        if step % 20 == 19:
            say(f"random seed {seed}: step {step + 1}/{steps}, {len(run.live)} running, {run.made} admitted")
    runner = run.runner
    checks = runner.compare(tolerance)
    notes = (f"{run.made} requests, {runner.steps} steps ({runner.uniform_steps} benchmarked-path), prefix hits "
             f"{sorted(h for h in run.hits if h)}, {run.rewinds} rewinds, {run.preempted} preemptions, "
             f"{evicted_pages(runner)} pages evicted",)
    return VerifyReport(tuple(checks), tolerance, notes)


class _RandomRun:
    """The random scenario's state: running requests, the sequences seen, what happened."""

    def __init__(self, runner: ScenarioRunner, rng: np.random.Generator):
        self.runner, self.rng = runner, rng
        self.vocab = runner.model.config.vocab_size
        self.live: dict[str, list[int]] = {}  # request id -> [prompt tokens left, new tokens left]
        self.seen: list[np.ndarray] = []
        self.hits: list[int] = []
        self.preempted = self.rewinds = self.made = 0

    def step(self, step: int) -> None:
        """Maybe admit a request, then one step: prefill chunks, verifies and decodes; the
        newest request is preempted when the step finds no pages."""
        rng = self.rng
        if len(self.live) < 3 and (not self.live or rng.random() < 0.25):
            self._admit()
        items, verifies = [], []
        for rid, (left, new_left) in self.live.items():
            if left > 0:
                items.append((rid, min(left, int(rng.integers(1, 400)))))
            elif new_left >= 3 and rng.random() < 0.2:
                items.append((rid, 3))
                verifies.append(rid)
            else:
                items.append((rid, 1))
        try:
            run_step(self.runner, items, {rid: {"random"} for rid, _ in items}, step)
        except CacheManagerError:
            self._finish(list(self.live)[-1], computed_only=True)
            self.preempted += 1
            return
        self._count(items, verifies)

    def _admit(self) -> None:
        rid, self.made = f"x{self.made}", self.made + 1
        prompt = _new_prompt(self.rng, self.vocab, self.seen)
        hit = self.runner.add(rid, prompt, 64).hit_tokens
        self.hits.append(hit)
        self.live[rid] = [prompt.size - hit, 64]

    def _count(self, items: list[tuple[str, int]], verifies: list[str]) -> None:
        """Book a step's tokens, rewind the verifies (accepting 1-3 of 3), free the finished."""
        manager = self.runner.manager
        for rid, count in items:
            state = self.live[rid]
            if state[0] > 0:
                state[0] -= count
            else:
                state[1] -= count
        for rid in verifies:
            keep = manager.num_computed_tokens(rid) - 2 + int(self.rng.integers(0, 3))
            self.live[rid][1] += manager.num_computed_tokens(rid) - keep
            self.runner.rewind(rid, keep)
            self.rewinds += 1
        for rid in [r for r, (left, new_left) in self.live.items() if left <= 0 and new_left <= 0]:
            self._finish(rid, computed_only=False)

    def _finish(self, rid: str, *, computed_only: bool) -> None:
        """Free ``rid``; its tokens (only the computed ones when preempted) join those seen."""
        tokens = self.runner.tokens(rid)
        self.seen.append((tokens[: self.runner.manager.num_computed_tokens(rid)] if computed_only else tokens).copy())
        self.runner.free(rid)
        del self.live[rid]
