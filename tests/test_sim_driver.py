import json
from types import SimpleNamespace

import numpy as np
import pytest

from hybridkv.cli import main
from hybridkv.runtime.manager import CacheManager, PreparedPrompt
from hybridkv.models.deepseek_v4 import build_v4_cache_specs
from hybridkv.sim.driver import SimulationError, Simulator
from hybridkv.sim.workloads import Request, chat_workload, multiturn_workload


def _manager(pages: int, history_pages: int | None = None, cls: type = CacheManager, **options) -> CacheManager:
    specs = build_v4_cache_specs(SimpleNamespace(sliding_window=128), layer_ratio=[0, 4, 128])
    counts = {s.group_id: pages if s.is_sliding or history_pages is None else history_pages for s in specs}
    return cls(specs, counts, max_context_tokens=8192, max_step_tokens=1024, **options)


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


class _CountingManager(CacheManager):
    """Counts the prompts the simulator prepares and the requests it adds (every one from a prepared prompt)."""

    prepared = adds = 0

    def prepare_prompt(self, *args, **kwargs):
        self.prepared += 1
        return super().prepare_prompt(*args, **kwargs)

    def add_request(self, request_id, prompt_token_ids=None, **kwargs):
        assert type(prompt_token_ids) is PreparedPrompt and not kwargs
        self.adds += 1
        return super().add_request(request_id, prompt_token_ids, **kwargs)


def test_a_request_refused_again_and_again_is_prepared_once_an_incarnation():
    """Under pressure a waiting request is added, refused and freed at step after step: its ids are prepared
    (hashed) once, and again only after a preemption (a longer sequence), the same prepared prompt added each time."""
    requests = [Request(r.request_id, 0, r.prompt_token_ids[:600], 300, np.resize(r.output_token_ids, 300))
                for r in chat_workload(24, seed=5)]
    mgr = _manager(2000, history_pages=40, cls=_CountingManager)
    result = Simulator(mgr, requests, max_running=24, step_token_budget=1024).run()
    _check_conservation(result, requests)
    assert mgr.prepared == len(requests) + int(result.preemptions.sum())
    assert mgr.adds > 2 * mgr.prepared  # refused, freed and added again many times


def test_a_prefill_chunk_shrinks_to_fit_before_anyone_is_preempted():
    """Two long prompts prefill beside two decoding chats on 20 history pages: with
    shrinking off a chunk that does not fit preempts a request (twice in this run);
    with it the chunk shrinks once and only one preemption is left. Tokens are
    conserved either way."""
    rng = np.random.default_rng(0)

    def request(rid, prompt, output, arrival):
        return Request(rid, arrival, rng.integers(0, 1000, prompt).astype(np.int32), output,
                       rng.integers(0, 1000, output).astype(np.int32))

    requests = [request("a", 300, 400, 0), request("b", 3000, 4, 0), request("c", 2500, 4, 1),
                request("d", 600, 300, 2)]
    runs = {}
    for floor in (0, 256):
        mgr = _manager(2000, history_pages=20)
        result = Simulator(mgr, requests, max_running=4, step_token_budget=1024, min_chunk_tokens=floor).run()
        _check_conservation(result, requests)
        mgr.check_invariants()
        runs[floor] = result.summary()
    assert (runs[0]["shrunk_chunks"], runs[0]["preemptions"]) == (0, 2)
    assert (runs[256]["shrunk_chunks"], runs[256]["preemptions"]) == (1, 1)


def test_a_request_that_cannot_grow_alone_is_reported_not_retried_forever():
    # 600 prompt + 300 output tokens need more than the 2 usable history pages per
    # compressed group (3 with the null page); its 600-token first chunk fits in them,
    # so it starts, then cannot grow: before, it was preempted and restarted forever.
    req = chat_workload(1, seed=5)[0]
    requests = [Request("alone", 0, req.prompt_token_ids[:600], 300, np.resize(req.output_token_ids, 300))]
    sim = Simulator(_manager(2000, history_pages=3), requests, max_running=4, step_token_budget=1024,
                    max_steps=5000)
    with pytest.raises(SimulationError, match="'alone' cannot grow even with no other request running"):
        sim.run()


def test_request_too_large_for_the_cache_is_reported():
    requests = [Request("big", 0, np.arange(5000, dtype=np.int32), 2, np.array([1, 2], dtype=np.int32))]
    with pytest.raises(SimulationError, match="cannot start.*too small for it \\(group"):
        Simulator(_manager(6), requests, max_running=4, step_token_budget=1024).run()


def test_request_longer_than_max_context_is_refused():
    requests = [Request("long", 0, np.arange(9000, dtype=np.int32), 2, np.array([1, 2], dtype=np.int32))]
    with pytest.raises(ValueError, match=r"^1 request exceeds the max context of 8,192 tokens \(first: .long.\)"):
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
        (["--no-prefix-caching", "--no-thrash-guard"], "--thrash-guard / --no-thrash-guard needs --prefix-caching"),
        (["--no-prefix-caching", "--moved-past-demotion"],
         "--moved-past-demotion / --no-moved-past-demotion needs --prefix-caching"),
        (["--kv-memory", "1MiB"], "holds no slab"),
        (["--kv-memory", "1MiB", "--page-space", "per-group"], "too small"),
        (["--min-chunk-tokens=-1"], "--min-chunk-tokens must not be negative"),
    ],
)
def test_simulate_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    code = main(["simulate", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("hybridkv: error:") and message in err and err.count("\n") == 1


def _simulate_on_and_off(capsys, argv: list[str], flag: str) -> tuple[dict, dict]:
    """``simulate`` with ``argv`` and ``--json``, once with ``--<flag>``, once with ``--no-<flag>``: both summaries."""
    runs = []
    for switch in (f"--{flag}", f"--no-{flag}"):
        assert main(["simulate", *argv, "--json", switch]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    return runs[0], runs[1]


def test_simulate_thrash_guard_flag_reaches_the_manager(capsys):
    """Under pressure (200 multiturn requests, 16 running, 1.5 GiB) the guard puts some requests' pages next in line;
    with --no-thrash-guard none, and the summary says how many."""
    on, off = _simulate_on_and_off(capsys, ["--workload", "multiturn", "--requests", "200", "--kv-memory", "1.5GiB",
                                            "--max-running", "16"], "thrash-guard")
    assert on["thrash_guarded_requests"] > 0
    assert off["thrash_guarded_requests"] == 0
    assert on["requests_finished"] == off["requests_finished"] == 200


def test_simulate_moved_past_demotion_flag_reaches_the_manager(capsys):
    """One-at-a-time multiturn conversations (16 running, 40 GiB: no pressure) move past their checkpoints: with the
    demotion on some are demoted, with --no-moved-past-demotion none, the hits the same (nothing is evicted)."""
    on, off = _simulate_on_and_off(capsys, ["--workload", "multiturn", "--requests", "120", "--max-running", "16"],
                                   "moved-past-demotion")
    assert on["moved_past_demoted"] > 0
    assert off["moved_past_demoted"] == 0
    assert on["token_hit_rate"] == off["token_hit_rate"]


def test_simulate_shared_page_space_needs_no_per_group_minimum(capsys):
    """2 GiB is below the per-group minimum for 128 running (2.40 GiB): refused with
    per-group pools, run on the shared arena (the default); a budget without one slab is refused."""
    argv = ["simulate", "--workload", "chat", "--requests", "8", "--kv-memory", "2GiB", "--max-context", "32k"]
    assert main([*argv, "--page-space", "per-group"]) == 2 and "too small" in capsys.readouterr().err
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests_finished"] == 8 and summary["kv_memory_bytes"] == 2 * 2**30
    assert summary["page_space"] == "shared"
    code = main(["simulate", "--page-space", "shared", "--kv-memory", "1MiB"])
    err = capsys.readouterr().err
    assert code == 2 and "holds no slab" in err and err.count("\n") == 1


def test_simulate_shared_page_space_runs_where_per_group_pools_cannot(capsys):
    """3 GiB, 128 running: per-group pools leave the c4 compressor state too small for
    one chat chunk; the shared arena lends it memory the idle groups do not use."""
    argv = ["simulate", "--workload", "chat", "--requests", "24", "--kv-memory", "3GiB", "--max-context", "32k",
            "--page-space", "per-group"]
    code = main([*argv, "--min-chunk-tokens", "0"])
    assert code == 2 and "cannot start" in capsys.readouterr().err
    # Shrinking lets a request that is alone start with a shorter first chunk: the
    # per-group pools then get through, one request at a time or so.
    code = main([*argv, "--json"])
    assert code == 0
    per_group = json.loads(capsys.readouterr().out)
    assert per_group["requests_finished"] == 24 and per_group["shrunk_chunks"] > 0
    code = main([*argv[:-2], "--page-space", "shared", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["page_space"] == "shared" and summary["requests_finished"] == 24
    assert summary["shrunk_chunks"] == 0 and summary["steps"] < per_group["steps"]
    arena = summary["utilization"]["arena (all groups)"]
    assert 0 < arena["mean"] <= arena["peak"] <= 1


class _BorrowingManager(CacheManager):
    """A manager on which admitting ``victim`` beside other requests denies the batch's
    first item, as when the victim's prefix hit borrows cached pages an earlier chunk
    was going to evict: only the other item's answer says so."""

    def check_admission(self, items, **kw):
        from hybridkv.runtime.manager import Admission

        answers = super().check_admission(items, **kw)
        if len(items) > 1 and items[-1][0] == "victim":
            answers[0] = Admission(False, "its pages were borrowed by the victim's prefix hit")
        return answers


def test_a_request_starts_only_if_every_item_of_the_batch_still_fits():
    """The driver checks every answer when it adds a request to the step, not only the
    new request's: here the victim can start only once it runs alone."""
    specs = build_v4_cache_specs(SimpleNamespace(sliding_window=128), layer_ratio=[0, 4, 128])
    mgr = _BorrowingManager(specs, {s.group_id: 2000 for s in specs}, max_context_tokens=8192,
                            max_step_tokens=1024)
    base = chat_workload(4, seed=2)
    requests = [Request(rid, 0, r.prompt_token_ids[:300], 20, r.output_token_ids[:20])
                for rid, r in zip(["a", "b", "c", "victim"], base)]
    result = Simulator(mgr, requests, max_running=8, step_token_budget=1024).run()
    _check_conservation(result, requests)
    by_id = {r.request_id: r for r in result.requests}
    others_done = max(by_id[rid].finish_step for rid in "abc")
    assert by_id["victim"].start_step > others_done
    mgr.check_invariants()


def test_simulate_shared_arena_2gib_multiturn_completes(capsys):
    """The command that failed from commit 1d2e64e on ("1 of 20 requests not admissible"):
    a new request's prefix hit borrowed cached pages an admitted chunk needed, and the
    driver looked only at the new request's answer."""
    code = main(["simulate", "--model", "deepseek-v4-flash", "--page-space", "shared", "--kv-memory", "2GiB",
                 "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = json.loads(out.out)
    assert summary["requests_finished"] == 128 and summary["preemptions"] == 0


def _two(arrival_far: int):
    ids = np.arange(1, 65, dtype=np.int32)
    return [
        Request("near", 0, ids, 4, np.array([1, 2, 3, 4], dtype=np.int32)),
        Request("far", arrival_far, ids + 100, 4, np.array([5, 6, 7, 8], dtype=np.int32)),
    ]


def test_a_far_arrival_is_reached_by_skipping_idle_steps():
    # Before: idle steps counted against a hidden 1,000,000-step cap and the run
    # stopped quietly with 1 of 2 requests finished.
    requests = _two(1_500_000)
    result = Simulator(_manager(2000), requests, max_running=4, step_token_budget=1024).run()
    assert sorted(r.request_id for r in result.requests) == ["far", "near"]
    far = next(r for r in result.requests if r.request_id == "far")
    assert far.start_step == 1_500_000
    assert result.steps == 8  # 4 scheduled steps each: 64-token prefill + 3 decodes, twice
    _check_conservation(result, requests)


def test_reaching_max_steps_raises_instead_of_stopping_quietly():
    requests = _two(10)
    sim = Simulator(_manager(2000), requests, max_running=4, step_token_budget=1024, max_steps=5)
    with pytest.raises(SimulationError, match="reached max_steps=5 scheduled steps with 1 of 2 requests"):
        sim.run()


def test_simulate_cli_far_arrival_trace_finishes_every_request(tmp_path, capsys):
    trace = tmp_path / "far.jsonl"
    trace.write_text(
        '{"arrival": 0, "prompt_tokens": 300, "output_tokens": 3}\n'
        '{"arrival": 1500000, "prompt_tokens": 300, "output_tokens": 3}\n'
    )
    code = main(["simulate", "--workload", str(trace), "--kv-memory", "8GiB", "--max-context", "64k", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["requests_finished"] == 2
