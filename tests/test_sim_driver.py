import json
from types import SimpleNamespace

import numpy as np
import pytest

from hybridkv.cli import main
from hybridkv.manager import CacheManager
from hybridkv.models.deepseek_v4 import build_v4_cache_specs
from hybridkv.sim.driver import SimulationError, Simulator
from hybridkv.sim.workloads import Request, chat_workload, multiturn_workload


def _manager(pages: int, history_pages: int | None = None, **options) -> CacheManager:
    specs = build_v4_cache_specs(SimpleNamespace(sliding_window=128), layer_ratio=[0, 4, 128])
    counts = {s.group_id: pages if s.is_sliding or history_pages is None else history_pages for s in specs}
    return CacheManager(specs, counts, max_context_tokens=8192, max_step_tokens=1024, **options)


def _check_conservation(result, requests):
    by_id = {r.request_id: r for r in requests}
    assert sorted(r.request_id for r in result.requests) == sorted(by_id)
    for rec in result.requests:
        req = by_id[rec.request_id]
        # Outputs generated to length; the last sampled token is never fed back.
        assert rec.produced_tokens == req.output_tokens
        assert rec.final_hit_tokens + rec.final_scheduled_tokens == req.prompt_tokens + req.output_tokens - 1
        if rec.preemptions == 0:
            assert rec.total_scheduled_tokens == rec.final_scheduled_tokens
        else:
            assert rec.total_scheduled_tokens > rec.final_scheduled_tokens
    assert int(result.scheduled_tokens.sum()) == sum(r.total_scheduled_tokens for r in result.requests)


@pytest.mark.parametrize("caching", [False, True])
def test_tokens_are_conserved_without_pressure(caching):
    requests = multiturn_workload(6, 3, seed=3, system_prompt_tokens=700)
    mgr = _manager(2000, enable_prefix_caching=caching)
    result = Simulator(mgr, requests, max_running=8, step_token_budget=1024).run()
    _check_conservation(result, requests)
    assert result.preemptions.sum() == 0
    summary = result.summary()
    assert (summary["token_hit_rate"] > 0.3) == caching
    mgr.clear_prefix_cache()
    assert all(s.free_pages == s.total_pages for s in mgr.stats().values())


def test_preempted_requests_recompute_and_finish():
    requests = chat_workload(24, seed=5)
    requests = [
        Request(r.request_id, 0, r.prompt_token_ids[:600], 300, np.resize(r.output_token_ids, 300))
        for r in requests
    ]
    # History pages are the squeeze: 24 requests * 4 pages would be needed at the end.
    mgr = _manager(2000, history_pages=40)
    result = Simulator(mgr, requests, max_running=24, step_token_budget=1024).run()
    assert result.preemptions.sum() > 0
    _check_conservation(result, requests)
    mgr.check_invariants()
    assert all(s.free_pages == s.total_pages for s in mgr.stats().values())


def test_request_too_large_for_the_cache_is_reported():
    requests = [Request("big", 0, np.arange(5000, dtype=np.int32), 2, np.array([1, 2], dtype=np.int32))]
    with pytest.raises(SimulationError, match="cannot start.*too small for it \\(group"):
        Simulator(_manager(6), requests, max_running=4, step_token_budget=1024).run()


def test_request_longer_than_max_context_is_refused():
    requests = [Request("long", 0, np.arange(9000, dtype=np.int32), 2, np.array([1, 2], dtype=np.int32))]
    with pytest.raises(ValueError, match="max context"):
        Simulator(_manager(100), requests, max_running=4, step_token_budget=1024)


def test_simulate_cli_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "run.png"
    code = main(["simulate", "--workload", "multiturn", "--requests", "16", "--kv-memory", "8GiB",
                 "--max-context", "64k", "--json", "--plot", str(png)])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests_finished"] == 16
    assert 0 < summary["token_hit_rate"] < 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workload", "nope"], "workload must be one of"),
        (["--requests", "0"], "--requests must be positive"),
        (["--no-prefix-caching", "--state-checkpoint-interval", "512"], "needs --prefix-caching"),
        (["--kv-memory", "1MiB"], "too small"),
    ],
)
def test_simulate_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    code = main(["simulate", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("hybridkv: error:") and message in err and err.count("\n") == 1


def test_simulate_shared_page_space_runs_where_per_group_pools_cannot(capsys):
    """3 GiB, 128 running: per-group pools leave the c4 compressor state too small for
    one chat chunk; the shared arena lends it memory the idle groups do not use."""
    argv = ["simulate", "--workload", "chat", "--requests", "24", "--kv-memory", "3GiB", "--max-context", "32k"]
    code = main(argv)
    assert code == 2 and "cannot start" in capsys.readouterr().err
    code = main([*argv, "--page-space", "shared", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["page_space"] == "shared" and summary["requests_finished"] == 24
    arena = summary["utilization"]["arena (all groups)"]
    assert 0 < arena["mean"] <= arena["peak"] <= 1
