"""What the commands say is true: the inverse plan, the headline's limits, the MTP
label, the plot's title and lines, and verify's exit status."""

import json

import pytest

from hybridkv.cli import main
from hybridkv.models.layout import cache_layout, load_model_config
from hybridkv.plan import Limits, plan_for_tokens, scheduler_page_tokens
from hybridkv.sizing import memory_for_requests


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- the inverse plan ----------------------------------------------------------------

@pytest.mark.parametrize("requests, context", [(1, 4096), (16, 131072), (64, 131072), (5, 1_000_000)])
def test_memory_for_requests_is_the_smallest_plan_that_fits(requests, context):
    layout = cache_layout("deepseek-v4-flash")
    limits = Limits(requests, 8192, 2**20)
    need = memory_for_requests(layout, limits, requests, context)
    grain = scheduler_page_tokens(layout.specs)
    plan = need.per_group_plan
    assert plan.max_concurrent_requests(context) >= requests
    if plan.total_tokens > grain:  # one scheduler page less does not fit them
        smaller = plan_for_tokens(layout, plan.total_tokens - grain, limits)
        assert smaller.max_concurrent_requests(context) < requests
    assert need.per_group_total_bytes == sum(need.per_group_bytes.values())
    # The shared arena's slabs hold every group's pages for them.
    assert need.shared_total_bytes >= sum(need.shared_group_bytes.values())


def test_memory_for_64_at_128k_by_hand():
    # 64 requests at 128k: 513 pages of each compressed group each (ceil(131,073 / 256)),
    # so 64 * 513 + 1 = 32,833 pages = ceil(total / 256) + 64 + 1 -> total 32,768 pages.
    need = memory_for_requests(cache_layout("deepseek-v4-flash"), Limits(64, 8192, 2**20), 64, 131072)
    assert need.per_group_plan.group_pages["v4.c4a.compressed_kv"] == 64 * 513 + 1
    assert need.per_group_plan.total_tokens == 32_768 * 256


def test_plan_requests_prints_both_page_spaces_per_group(capsys):
    code, out, _ = _run(capsys, "plan", "--requests", "64", "--context-len", "128k")
    assert code == 0
    first = out.splitlines()[0]
    assert first.startswith("64 requests at 128k need, per GPU, 31.46 GiB in per-group pools or ")
    assert "as a shared arena" in first
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("v4.")}
    assert len(rows) == 6
    assert rows["v4.c4a.compressed_kv"][2:4] == ["513", "32,833"]
    assert max(len(line) for line in out.splitlines()) <= 100
    code, out, _ = _run(capsys, "plan", "--requests", "64", "--context-len", "128k", "--json")
    memory = json.loads(out)["requests_memory"]
    assert memory["requests"] == 64 and set(memory["per_group"]["group_bytes"]) == set(rows)
    assert memory["shared"]["total_bytes"] > 0


# --- the headline ----------------------------------------------------------------------

def test_headline_says_when_the_running_limit_and_not_memory_decides(capsys):
    for page_space, head in (("per-group", "40.00 GiB per GPU: "), ("shared", "40.00 GiB per GPU as one shared arena: ")):
        code, out, _ = _run(capsys, "plan", "--max-running", "16", "--page-space", page_space)
        assert code == 0
        first = out.splitlines()[0]
        assert first.startswith(head + "16 requests at 128k run at once (--max-running; memory fits ")


def test_headline_names_the_fp8_indexer(capsys):
    _, out, _ = _run(capsys, "plan", "--indexer", "fp8")
    assert out.splitlines()[1] == "deepseek-v4-flash: 43 layers, FP8 indexer keys (132 B/row)"


def test_mtp_label_counts_the_layers_cached(capsys, tmp_path):
    _, out, _ = _run(capsys, "plan", "--include-mtp")
    assert out.splitlines()[1].startswith("deepseek-v4-flash: 43 layers + 1 MTP layer,")
    config = dict(load_model_config("deepseek-v4-flash"), num_nextn_predict_layers=0)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = _run(capsys, "plan", "--config", str(path), "--include-mtp")
    assert code == 2 and "no MTP layer" in err and out == ""
    code, out, _ = _run(capsys, "plan", "--config", str(path))
    assert code == 0 and "MTP" not in out


# --- the plot --------------------------------------------------------------------------

def test_plot_title_and_lines_describe_the_run():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybridkv.cli.simulate_render import plot_usage, plot_title
    from hybridkv.cli.plan_cmd import build_plan
    from hybridkv.runtime.manager import CacheManager
    from hybridkv.sim.driver import Simulator
    from hybridkv.sim.workloads import build_workload

    class Args:
        model, config, kv_memory, max_running, chunk_tokens = None, None, 8 * 2**30, None, 8192
        max_context, context_len, indexer, speculative_tokens = 65536, None, None, 1
        include_mtp, page_space, compare = False, "shared", None

    plan = build_plan(Args)
    manager = CacheManager.from_plan(plan, page_space="shared")
    result = Simulator(manager, build_workload("chat", num_requests=6), max_running=8, step_token_budget=8192).run()
    summary = dict(model=plan.layout.name, kv_memory_bytes=plan.budget_bytes, page_space="shared",
                   workload="chat", requests=6, prefix_caching=True)
    title = plot_title(summary)
    for part in ("deepseek-v4-flash", "8.00 GiB", "shared page space", "workload chat (6 requests)"):
        assert part in title
    fig, axis = plt.subplots()
    plot_usage(axis, result, range(result.steps))
    lines = axis.get_lines()
    labels = [line.get_label() for line in lines]
    assert labels[-1] == "arena (all groups)" and len(labels) == 7
    # The two ratio-4 state groups move together: different styles and widths keep both visible.
    styles = {(line.get_linestyle(), line.get_linewidth()) for line in lines[:-1]}
    assert len(styles) == 6
    plt.close(fig)


# --- verify's status -----------------------------------------------------------------

def test_a_failed_verify_exits_1_and_bad_input_2(capsys, monkeypatch):
    from hybridkv.reference import suite
    from hybridkv.reference.runner import CheckResult, VerifyReport

    failing = VerifyReport((CheckResult("paged vs dense", False, 8, 1.0, 0),), 1e-3)
    monkeypatch.setattr(suite, "run_verify_suite",
                        lambda seed, scenarios, fault=None, progress=None:
                        [("scripted scenario", suite.SMALL_GEOMETRY, failing)])
    code, out, _ = _run(capsys, "verify")
    assert code == 1 and out.rstrip().endswith("FAIL")
    code, _, err = _run(capsys, "verify", "--seed", "x")
    assert code == 2 and err.count("\n") == 1
