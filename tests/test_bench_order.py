"""The A/B tools of bench/ (step_profile, commit_cost, clean_step) swap which side runs first every step.

The workloads are stand-ins that log which side's manager stepped; no library is built.
"""

import pytest

from bench_support import load_bench_script


@pytest.fixture(scope="module")
def tools():
    clean = load_bench_script("clean_step.py", "clean_step_under_test")  # puts bench/ on sys.path
    commit = load_bench_script("commit_cost.py", "commit_cost_under_test")
    assert commit.step_profile is clean.sp  # one step_profile, whose PHASES both read
    return clean.sp, commit, clean


class _Manager:
    def __init__(self, log, side):
        self.log, self.side = log, side
        self.prefix = self
        self.granularity_tokens = 256

    def drain_events(self):
        return []

    def _commit_rows(self, crossing):
        pass

    def num_computed_tokens(self, rid):
        return 1  # below the grain: every step is clean

    def schedule_uniform(self, ids, tokens, block_tables):
        self.log.append(self.side)


def _stand_ins(log):
    class Work:
        def __init__(self, n, package):
            self.manager, self.live = _Manager(log, package), ["r0"]

        def sample(self, rids):
            pass

    def steps(work, n, profiler=None):
        for _ in range(n):
            work.manager.schedule_uniform(tuple(work.live), 1, "updates")
        return [0] * n

    return Work, steps


def _firsts(log, per_round, rounds):
    """The side stepping first in each round of ``per_round`` logged steps (after the warm-up)."""
    timed = log[-per_round * rounds:]
    return [timed[k * per_round] for k in range(rounds)]


EXPECTED = ["base", "hybridkv", "base", "hybridkv"]


@pytest.mark.parametrize("tool", ["step_profile", "commit_cost"])
def test_the_first_side_swaps_every_step(tools, tool, monkeypatch):
    sp, commit, _ = tools
    log = []
    monkeypatch.setitem(sp.PHASES, "decode", _stand_ins(log))
    if tool == "step_profile":
        sp.run([4], 4, ("decode",), "none", against="base")
    else:
        commit.measure(4, "decode", 4, ("base", "hybridkv"))
    assert _firsts(log, 2, 4) == EXPECTED
    assert sorted(log[-8:]) == ["base"] * 4 + ["hybridkv"] * 4


def test_clean_step_swaps_the_first_side_every_round(tools, monkeypatch):
    sp, _, clean = tools
    log = []
    work, steps = _stand_ins(log)
    monkeypatch.setattr(sp, "Workload", work)
    monkeypatch.setattr(sp, "decode_steps", steps)
    clean.run(4, 4, ("base", "hybridkv"), walk=lambda: None)
    # A round: warm (each side an untimed and a timed step), then cold (one timed step each).
    assert _firsts(log, 6, 4) == EXPECTED
    assert [log[-24 + 6 * k + 4] for k in range(4)] == EXPECTED  # the cold half keeps the round's order
