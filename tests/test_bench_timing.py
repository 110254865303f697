"""bench/vs_vllm's workload, rounds and fits, on numbers worked out by hand."""

import json

import numpy as np
import pytest


def test_alternate_rotates_the_sides_each_step(vs):
    calls = []

    def stepper(name):
        def step(k):
            calls.append((name, k))
            return 10 * k + (1 if name == "a" else 2)
        return step

    out = vs.timing.alternate({"a": stepper("a"), "b": stepper("b")}, 3)
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert out["a"].tolist() == [1, 11, 21] and out["b"].tolist() == [2, 12, 22]


def test_summary_takes_the_median_round_and_percentiles_over_all_steps(vs):
    # Round ratios (a total / b total): 6000/2000 = 3, 12000/2000 = 6, 3000/3000 = 1 -> median 3 (round 0).
    rounds = [
        {"a": np.array([1000, 2000, 3000]), "b": np.array([500, 500, 1000])},
        {"a": np.array([4000, 4000, 4000]), "b": np.array([1000, 500, 500])},
        {"a": np.array([1000, 1000, 1000]), "b": np.array([1000, 1000, 1000])},
    ]
    out = vs.timing.summarize_rounds(rounds)
    assert out["median_round"] == 0 and out["rounds"] == 3 and out["steps_per_round"] == 3
    assert out["ratio"]["of_totals"] == pytest.approx(3.0)
    assert out["ratio"]["rounds"] == pytest.approx([3.0, 6.0, 1.0])
    assert out["a"]["us_per_step_mean"] == pytest.approx(2.0)  # round 0: 6000 ns / 3 steps
    # b's nine steps sorted: 500 x4, 1000 x5 -> median 1000 ns; p99 1000 ns.
    assert out["b"]["us_per_step_p50"] == pytest.approx(1.0)
    assert out["b"]["us_per_step_p99"] == pytest.approx(1.0)
    # a's nine steps sorted: 1000 x4, 2000, 3000, 4000 x3 -> median 2000; p99 4000.
    assert out["a"]["us_per_step_p50"] == pytest.approx(2.0) and out["a"]["p99_over_p50"] == pytest.approx(2.0)


def test_one_side_orders_rounds_by_its_own_total(vs):
    rounds = [{"a": np.array([3000])}, {"a": np.array([1000])}, {"a": np.array([2000])}]
    out = vs.timing.summarize_rounds(rounds)
    assert out["median_round"] == 2 and "ratio" not in out


def test_linear_fit_recovers_fixed_and_per_request_cost(vs):
    sizes = [32, 128, 512, 1024]
    fit = vs.timing.linear_fit(sizes, [30 + 2.5 * n for n in sizes])
    assert fit["fixed"] == pytest.approx(30) and fit["per_unit"] == pytest.approx(2.5)
    assert vs.timing.linear_fit([32], [1.0]) is None


def test_serving_requests_have_their_ranges_and_shared_prefixes(vs):
    shape = vs.workload.ServingShape(prompt_tokens=(512, 4096), output_tokens=(64, 1024), prefix_tokens=1024,
                                     num_prefixes=3)
    requests = vs.workload.serving_requests(200, seed=5, shape=shape)
    assert all(512 <= r.prompt_tokens <= 4096 and 64 <= r.output_tokens <= 1024 for r in requests)
    heads = {tuple(r.prompt_ids[:256].tolist()) for r in requests}  # every prompt shares >= 256 tokens
    assert len(heads) == 3
    again = vs.workload.serving_requests(200, seed=5, shape=shape)
    assert all(np.array_equal(a.prompt_ids, b.prompt_ids) and np.array_equal(a.output_ids, b.output_ids)
               for a, b in zip(requests, again))
    fewer = vs.workload.serving_requests(50, seed=5, shape=shape)  # a prefix of the longer stream
    assert all(np.array_equal(a.prompt_ids, b.prompt_ids) for a, b in zip(requests, fewer))
    other = vs.workload.serving_requests(200, seed=6, shape=shape)
    assert not np.array_equal(requests[0].prompt_ids, other[0].prompt_ids)


def test_steady_start_spreads_the_finishes_over_the_horizon(vs):
    requests = vs.workload.serving_requests(20, seed=0)
    produced = vs.workload.steady_start(requests, finishes_per_step=2, horizon_steps=5, seed=1)
    left = [r.output_tokens - p for r, p in zip(requests, produced)]
    assert sorted(left[:10]) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # two finish in each of the 5 steps
    by_output = sorted(range(10), key=lambda j: requests[j].output_tokens)
    assert [left[j] for j in by_output] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # shortest outputs first
    assert all(5 < x < r.output_tokens for x, r in zip(left[10:], requests[10:]))
    assert all(p >= 1 for p in produced)
    with pytest.raises(ValueError, match="need that many"):
        vs.workload.steady_start(requests, finishes_per_step=3, horizon_steps=7, seed=1)


def test_steady_start_fits_a_horizon_longer_than_the_shortest_output(vs):
    """128 finishers over 128 steps with outputs from 64 tokens: the shortest get the
    earliest finishes, and every request still has produced at least one token."""
    requests = vs.workload.serving_requests(128, seed=0)
    produced = vs.workload.steady_start(requests, finishes_per_step=1, horizon_steps=128, seed=1)
    left = sorted(r.output_tokens - p for r, p in zip(requests, produced))
    assert left == list(range(128)) and min(produced) >= 1
    short = vs.workload.ServingShape(output_tokens=(4, 8))
    with pytest.raises(ValueError, match="cannot leave"):
        vs.workload.steady_start(vs.workload.serving_requests(20, seed=0, shape=short), finishes_per_step=1,
                                 horizon_steps=20, seed=1)


def test_finishes_per_step_is_running_over_mean_output_at_least_one(vs):
    shape = vs.workload.ServingShape()  # outputs 64-1,024: mean 544
    assert [vs.serving.finishes_per_step(n, shape) for n in (32, 128, 512, 1024, 2048)] == [1, 1, 1, 2, 4]


def test_a_tiny_run_without_vllm_reports_every_phase(vs, tmp_path, capsys):
    config = vs.cli.BenchConfig(
        sizes=(4, 8), rounds=1, serving_steps=3, decode_steps=3, step_tokens=1024, chunk_tokens=512,
        shape=vs.workload.ServingShape(prompt_tokens=(64, 512), output_tokens=(12, 40), prefix_tokens=32),
        kv_memory_bytes=2 * 2**30, max_model_len=8192, prefill_requests=1, prefill_tokens=2048, conversations=2,
        turns=2, system_prompt_tokens=200, context_tokens=8192, capacity_limit=3, capacity_max_running=None,
        capacity_variants=True, other_max_num_seqs=8)
    report = vs.cli.run(config, "no vLLM here", log=lambda line: None)
    json.dumps(report)  # what the CLI writes
    results = report["results"]
    assert set(results["serving"]) == set(results["decode"]) == {"4", "8"}
    assert set(results["fits"]["decode"]["hybridkv"]) == {"fixed_us_per_step", "us_per_request", "sizes"}
    capacity = results["capacity"]["hybridkv"]
    assert capacity["shrinking_chunks"]["measured_requests"] == 3  # the limit
    assert capacity["fixed_chunks"]["measured_requests"] == capacity["per_group_pools_8"]["measured_requests"] == 3
    assert 0 < results["multiturn"]["hybridkv"]["hit_rate"] < 1
    vs.report.print_report(report)
    printed = capsys.readouterr().out
    assert "vLLM side unavailable" in printed and "Steady decode" in printed and "n/a" in printed
    vs.report.print_report(report, markdown=True)
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("| running | vLLM | hybridkv | hybridkv per request | ratio | rounds | vLLM p50 / p99 | "
                         "hybridkv p50 / p99 | p99/p50 | target |")
    assert lines[header + 2].startswith("| 4 | n/a | ") and lines[header + 3].startswith("| 8 | n/a | ")
