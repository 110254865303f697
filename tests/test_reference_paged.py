"""The paged reference stack under a real manager must reproduce the dense path."""

import argparse
from dataclasses import replace

import numpy as np
import pytest

from hybridkv.cli import verify_cmd
from hybridkv.models.deepseek_v4 import V4_SWA_KV_GROUP_ID
from hybridkv.reference.paged import PagedReadError, PagedStack, table_slots
from hybridkv.reference.scenario import (
    TOLERANCE,
    build_runner,
    corrupt_byte,
    run_verify_scenario,
)
from hybridkv.spec import CacheGroupSpec


@pytest.fixture(scope="module")
def report():
    return run_verify_scenario(seed=0)


EXPECTED_CASES = (
    "all tokens",
    "batch of >= 3 requests",
    "one-shot prefill",
    "chunked prefill",
    "decode",
    "verify 3, accept 1, continue",
    "prefix hit 512",
    "prefix hit 256",
)


@pytest.mark.parametrize("case", EXPECTED_CASES)
def test_paged_matches_dense(report, case):
    check = report.check(f"paged == dense: {case}")
    assert check.tokens > 0
    assert check.max_abs_error <= TOLERANCE
    assert check.topk_mismatches == 0
    assert check.passed


def test_cache_rows_are_compared_at_checkpoints(report):
    for kind in ("window KV", "compressed KV", "indexer keys", "compressor states"):
        check = report.check(f"cache rows == dense rows: {kind}")
        assert check.passed and check.tokens > 1000 and check.max_abs_error <= TOLERANCE


def test_scenario_runs_the_benchmarked_decode_path(report):
    check = report.check("benchmarked decode path ran (schedule_uniform, table updates, mirror, fixed widths)")
    assert check.passed and "with write slots from the mirrored tables" in check.detail


def test_scenario_covers_what_it_claims(report):
    assert report.check("prefix hits at 256 and 512").detail == "hit tokens {'d': 512, 'e': 256}"
    assert report.check("HCA reads >= 3 entries").passed
    assert report.check("CSA indexer selects 8 of > 32 visible entries").passed
    assert report.check("rejected draft tokens closed CSA and HCA windows").passed
    assert report.check("shuffled pools give non-contiguous tables").passed
    assert report.check("paged == dense: decode").tokens >= 300
    assert report.passed and report.max_abs_error <= TOLERANCE


def _prefilled_runner(prompt_tokens=300, decode_steps=4):
    runner = build_runner(seed=3, enable_prefix_caching=False)
    prompt = np.random.default_rng(11).integers(0, 1024, prompt_tokens)
    runner.add("r", prompt, max_new_tokens=200)
    runner.step([("r", prompt_tokens)])
    for _ in range(decode_steps):
        runner.step([("r", 1)])
    return runner


def _worst(checks):
    everything = next(c for c in checks if c.name == "paged == dense: all tokens")
    return everything.max_abs_error, everything.topk_mismatches


@pytest.mark.parametrize("fault", ["kv-byte", "state-byte"])
def test_one_flipped_bit_in_a_cached_page_is_detected(fault):
    clean = _prefilled_runner()
    for _ in range(90):  # crosses 383: the HCA window holding the corrupted state row closes
        clean.step([("r", 1)])
    err, mismatches = _worst(clean.compare())
    assert err <= TOLERANCE and mismatches == 0

    runner = _prefilled_runner()
    where = corrupt_byte(runner, fault, "r")
    assert "HCA" in where
    if fault == "state-byte":
        assert "position 303" in where  # window [256, 384) is still open: read when 383 closes it
    for _ in range(90):
        runner.step([("r", 1)])
    err, _ = _worst(runner.compare())
    assert err > 1e-3, (fault, err)


def _verify_cli(argv):
    parser = argparse.ArgumentParser()
    verify_cmd.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.run(args)


def test_verify_command_prints_checks_and_pass(report, monkeypatch, capsys):
    from hybridkv.reference import suite

    fake = [("scripted scenario", suite.SMALL_GEOMETRY, report), ("pressure scenario", suite.PRODUCTION_GEOMETRY, report)]
    monkeypatch.setattr(suite, "run_verify_suite", lambda seed, scenarios, fault=None, progress=None: fake)
    assert _verify_cli(["verify"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.rstrip().endswith("PASS") and "FAIL" not in out
    assert "PASS  paged == dense: prefix hit 512" in out
    assert "PASS  cache rows == dense rows: indexer keys" in out
    assert "pressure scenario: window 128, head_dim 512" in out
    assert "max abs error" in out and "tolerance 1e-09" in out


def test_verify_command_reports_progress_and_a_fault_fails_with_exit_1(capsys):
    assert _verify_cli(["verify", "--inject-fault", "kv-byte"]) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert out.rstrip().endswith("FAIL")
    assert "FAIL  paged == dense: all tokens" in out
    assert "FAIL  cache rows == dense rows: compressed KV" in out  # the flipped row itself is seen
    assert "note: fault injected after step 150: layer 2 HCA compressed entry 0" in out
    assert "[1/2] scripted scenario" in captured.err and "[2/2] pressure scenario" in captured.err


def test_unknown_fault_is_rejected():
    with pytest.raises(ValueError):
        run_verify_scenario(fault="nope")


def test_reading_a_released_window_page_raises():
    runner = build_runner(seed=0, enable_prefix_caching=False)
    prompt = np.random.default_rng(2).integers(0, 1024, 201)
    runner.add("r", prompt, max_new_tokens=0)
    runner.step([("r", 200)])
    batch = runner.manager.schedule([("r", 1)])
    swa = batch.groups[V4_SWA_KV_GROUP_ID]
    # pretend the window page was released one page early: the base moves past live rows
    early = replace(swa, base_pages=swa.base_pages + 1, block_table=swa.block_table[:, 1:])
    broken = replace(batch, groups={**batch.groups, V4_SWA_KV_GROUP_ID: early})
    with pytest.raises(PagedReadError, match="v4.swa_kv"):
        runner.stack.forward(broken, prompt[200:])
    result = runner.stack.forward(batch, prompt[200:])  # the real tables read fine
    assert result.positions.tolist() == [200]


def test_table_slots_by_hand():
    class Step:  # the GroupStep fields a read uses
        def __init__(self, table, base):
            self.block_table = np.asarray(table, dtype=np.int32)
            self.base_pages = None if base is None else np.asarray(base, dtype=np.int32)

    sliding = CacheGroupSpec("s", "sliding_window", 4, 1, sliding_window_tokens=8, family="state")
    step = Step([[5, 9, -1], [7, 3, 2]], [2, 0])
    # request 0: position 9 -> logical page 2 -> column 0 -> page 5, row 1 -> slot 21
    # request 1: position 9 -> logical page 2 -> column 2 -> page 2 -> slot 9
    got = table_slots(sliding, step, np.array([0, 1, 0]), np.array([9, 9, -1]))
    np.testing.assert_array_equal(got, [21, 9, -1])
    with pytest.raises(PagedReadError):
        table_slots(sliding, step, np.array([0]), np.array([7]))  # logical page 1 < base 2
    with pytest.raises(PagedReadError):
        table_slots(sliding, step, np.array([0]), np.array([16]))  # column 2 holds -1
    history = CacheGroupSpec("h", "full_history", 64, 4)
    # compressed entry 70 (tokens 280..283) -> logical page 1 -> row 6
    got = table_slots(history, Step([[4, 8]], None), np.array([0]), np.array([70]))
    np.testing.assert_array_equal(got, [8 * 64 + 6])


def test_stack_rejects_bad_input():
    runner = build_runner(seed=0, enable_prefix_caching=False)
    specs = [s for s in runner.manager.specs if s.group_id != V4_SWA_KV_GROUP_ID]
    with pytest.raises(ValueError, match="missing"):
        PagedStack(runner.model, specs, {s.group_id: 8 for s in specs})
    runner.add("r", np.arange(10), max_new_tokens=0)
    batch = runner.manager.schedule([("r", 10)])
    with pytest.raises(ValueError):
        runner.stack.forward(batch, np.arange(9))
    with pytest.raises(ValueError):
        runner.stack.forward(batch, np.full(10, 5000))


def test_verify_command_reports_a_crashed_run_as_fail(monkeypatch, capsys):
    from hybridkv.reference import suite
    from hybridkv.reference.paged import PagedReadError

    def broken(*args, **kwargs):
        raise PagedReadError("group v4.swa_kv: request 'a' reads cache row 7 whose page is not in its table")

    monkeypatch.setattr(suite, "run_verify_suite", broken)
    assert _verify_cli(["verify"]) == 1
    out = capsys.readouterr().out
    assert "the run stopped: PagedReadError" in out and out.rstrip().endswith("FAIL")
