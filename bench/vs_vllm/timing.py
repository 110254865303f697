"""Alternating timed steps, and what a phase reports from its rounds.

A phase runs its sides' steps alternating: step k of every side, then step
k + 1, the order of the sides rotating each step. Both sides are measured over
the same stretch of time, so a slow stretch of a shared machine hits both, and
each side's step starts with the CPU caches the other side's step filled, as
in an engine whose scheduler runs between other work. A phase repeats that in
``rounds``; the figure is the round whose ratio of totals (first side's time
over the second's) is the median, and p50 / p99 step times are taken over
every step of every round.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator, Sequence

import numpy as np


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Collect first, then keep the collector out of the timed region."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def alternate(steppers: dict[str, Callable[[int], int]], steps: int) -> dict[str, np.ndarray]:
    """Step ``k`` of every side, for ``k`` in ``range(steps)``, the sides' order rotating
    each step. A stepper runs one step and returns its manager time in ns."""
    names = list(steppers)
    step_ns = {name: np.zeros(steps, dtype=np.int64) for name in names}
    with quiet_gc():
        for step in range(steps):
            for i in range(len(names)):
                name = names[(step + i) % len(names)]
                step_ns[name][step] = steppers[name](step)
    return step_ns


def percentile_us(step_ns: np.ndarray, q: float) -> float:
    return float(np.percentile(step_ns, q) / 1e3)


def summarize_rounds(rounds: Sequence[dict[str, np.ndarray]]) -> dict:
    """The median round's figures, every round's ratio, and p50 / p99 over all steps.

    ``rounds``: per round, each side's step times in ns (the same sides in every
    round, the first side's total over the second's is the round's ratio; with one
    side, rounds are ordered by its total). Per side: ``us_per_step_mean`` of the
    median round, ``us_per_step_p50`` / ``_p99`` over every step of every round,
    their quotient, and every round's mean.
    """
    if not rounds:
        raise ValueError("no rounds to summarize")
    names = list(rounds[0])
    totals = [{name: float(r[name].sum()) for name in names} for r in rounds]
    if len(names) >= 2:
        first, second = names[:2]
        ratios = [t[first] / t[second] if t[second] > 0 else float("inf") for t in totals]
        key = ratios
    else:
        first = second = names[0]
        ratios = []
        key = [t[first] for t in totals]
    median_index = int(np.argsort(key, kind="stable")[len(key) // 2])
    out: dict = dict(rounds=len(rounds), steps_per_round=int(rounds[0][names[0]].size), median_round=median_index)
    for name in names:
        every = np.concatenate([r[name] for r in rounds])
        p50, p99 = percentile_us(every, 50), percentile_us(every, 99)
        out[name] = dict(
            us_per_step_mean=float(rounds[median_index][name].mean() / 1e3),
            us_per_step_p50=p50,
            us_per_step_p99=p99,
            p99_over_p50=p99 / p50 if p50 > 0 else None,
            rounds_us_per_step_mean=[float(r[name].mean() / 1e3) for r in rounds],
        )
    if ratios:
        out["ratio"] = dict(first=first, second=second, of_totals=ratios[median_index], rounds=ratios)
    return out


def linear_fit(sizes: Sequence[float], values: Sequence[float]) -> dict | None:
    """Least-squares ``value = fixed + per_unit * size`` (None with fewer than two sizes)."""
    if len(sizes) < 2 or len(set(sizes)) < 2:
        return None
    per_unit, fixed = np.polyfit(np.asarray(sizes, dtype=np.float64), np.asarray(values, dtype=np.float64), 1)
    return dict(fixed=float(fixed), per_unit=float(per_unit))
