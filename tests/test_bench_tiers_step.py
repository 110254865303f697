"""bench/tiers_step's statistics (the interval around the median round, the step-median ratio,
the verdict on the 1.2x target) on numbers worked out by hand, and a tiny run's report."""

import json
import math
import sys

import pytest

from bench_support import load_bench_script


@pytest.fixture(scope="module")
def ts():
    return load_bench_script("tiers_step.py", "tiers_step_under_test")


def test_nine_rounds_give_the_second_and_eighth_sorted_with_their_coverage(ts):
    # P(Binomial(9, 1/2) < 2) = (1 + 9) / 512 = 0.0195 <= 0.025; P(X < 3) = 46 / 512 = 0.0898 > 0.025.
    low, high, coverage = ts.median_interval([1.5, 1.1, 1.9, 1.0, 1.3, 1.2, 1.4, 1.6, 1.7])
    assert (low, high) == (1.1, 1.7)
    assert coverage == pytest.approx(1 - 2 * 10 / 512)


def test_fifteen_rounds_give_the_fourth_and_twelfth_sorted_with_their_coverage(ts):
    # P(Binomial(15, 1/2) < 4) = (1 + 15 + 105 + 455) / 32768 = 0.0176 <= 0.025; P(X < 5) = 0.0592 > 0.025.
    values = [1.0 + i / 100 for i in (7, 3, 14, 0, 9, 12, 5, 1, 10, 13, 2, 8, 6, 11, 4)]
    low, high, coverage = ts.median_interval(values)
    assert (low, high) == (1.03, 1.11)
    assert coverage == pytest.approx(1 - 2 * 576 / 32768)


def test_too_few_rounds_give_the_whole_range_and_say_so(ts):
    assert ts.median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0, pytest.approx(1 - 2 / 32))
    assert ts.median_interval([2.0]) == (2.0, 2.0, 0.0)


def _reference_interval_rank(n, confidence=0.95):
    """The largest k (1-based, k <= (n + 1) / 2) with P(X < k) <= (1 - confidence) / 2, summed afresh."""
    best = 1
    for k in range(1, (n + 1) // 2 + 1):
        if sum(math.comb(n, i) for i in range(k)) / 2 ** n <= (1 - confidence) / 2:
            best = k
    return best


@pytest.mark.parametrize("n", range(1, 26))
def test_the_interval_rank_matches_a_binomial_sum_worked_afresh(ts, n):
    values = [float(i) for i in range(1, n + 1)]  # sorted: x(k) == k
    low, high, coverage = ts.median_interval(values)
    k = _reference_interval_rank(n)
    assert (low, high) == (k, n + 1 - k)
    assert coverage == pytest.approx(1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n)
    if n >= 6:
        assert coverage >= 0.95


def test_step_median_ratio_takes_each_steps_median_over_rounds(ts):
    # off: step 0 medians of (1, 3, 2) = 2, step 1 of (2, 2, 100) = 2 -> 4; a preempted step counts at 2.
    # v:   step 0 of (2, 4, 3) = 3, step 1 of (2, 3, 2) = 2 -> 5; ratio 5 / 4.
    rounds = [{"off": {"step_us": [1, 2]}, "v": {"step_us": [2, 2]}},
              {"off": {"step_us": [3, 2]}, "v": {"step_us": [4, 3]}},
              {"off": {"step_us": [2, 100]}, "v": {"step_us": [3, 2]}}]
    assert ts.step_median_ratio(rounds, "v") == pytest.approx(1.25)
    rounds[1]["v"]["step_us"] = [4, 3, 1]  # a round with another step count: no per-step median
    assert ts.step_median_ratio(rounds, "v") is None


@pytest.mark.parametrize("interval, expected", [
    ([1.05, 1.20], "holds"), ([1.21, 1.40], "misses"), ([1.10, 1.25], "not shown"),
])
def test_the_verdict_needs_the_whole_interval_on_one_side_of_the_target(ts, interval, expected):
    assert ts.verdict({"ratio_interval": interval}) == expected


def test_a_tiny_run_reports_every_round_and_the_verdict(ts, tmp_path, monkeypatch, capsys):
    out = tmp_path / "tiers_step.json"
    monkeypatch.setattr(sys, "argv", [
        "tiers_step.py", "--rounds", "2", "--variants", "off,host-through", "--conversations", "2", "--turns", "1",
        "--system-tokens", "256", "--kv-tokens", "8192", "--forward-ms", "0", "--no-loads", "--json", str(out)])
    ts.main()
    report = json.loads(out.read_text())
    through = report["summary"]["host-through"]
    assert len(through["ratios"]) == 2 and len(through["cpu_ratios"]) == 2
    assert through["ratio_median"] == pytest.approx(sum(through["ratios"]) / 2)
    assert through["ratio_interval"] == [min(through["ratios"]), max(through["ratios"])]
    assert through["verdict"] in ("holds", "misses", "not shown")
    assert report["summary"]["off"]["ratios"] == [1.0, 1.0]
    text = capsys.readouterr().out
    assert "per-round x off: host-through" in text and "target:" in text
