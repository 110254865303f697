"""bench/ckpt_order_cost.py runs end to end on a small trace under memory pressure: both checkpoint orders
serve it with the same hits and per-group diagnostics, and the timers around frees and evictions see calls."""

import json

from bench_support import load_bench_script


def test_both_orders_serve_a_small_trace_alike_and_evictions_are_timed(tmp_path, capsys):
    script = load_bench_script("ckpt_order_cost.py", "ckpt_order_cost_under_test")
    out = tmp_path / "order.json"
    assert script.main(["--budgets", "2GiB", "--trace-requests", "80", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["order"] for r in rows] == ["full sort", "incremental"]
    full, fast = rows
    assert fast["same_as_full_sort"] is True
    assert full["hit_rate"] == fast["hit_rate"] and 0 < fast["hit_rate"] < 1
    for r in rows:
        assert r["per_free"]["n"] == 80  # one ranking a freed request
        assert r["per_eviction"]["n"] > 0  # 2 GiB evicts: make_room's timer saw the calls that did
    assert "same hits and per-group diagnostics" in capsys.readouterr().out
