"""The pressure and random scenarios of ``hybridkv verify`` at the production geometry."""

import numpy as np
import pytest

from hybridkv.reference.pressure import run_pressure_scenario, run_random_scenario
from hybridkv.reference.runner import TOLERANCE
from hybridkv.reference.suite import PRODUCTION_GEOMETRY


@pytest.fixture(scope="module")
def pressure():
    return run_pressure_scenario(0, config=PRODUCTION_GEOMETRY)


def test_pressure_scenario_passes_and_covers_what_it_claims(pressure):
    assert pressure.passed, [c for c in pressure.checks if not c.passed]
    for name in ("hit at a rewound request's checkpoint (512)", "evictions under pressure",
                 "a preempted request re-added hits its own checkpoint", "hit shortened by eviction"):
        check = next(c for c in pressure.checks if c.name == name)
        assert check.passed, check
    assert pressure.max_abs_error <= TOLERANCE


def test_pressure_scenario_compares_rows_of_borrowed_pages(pressure):
    names = {c.name: c for c in pressure.checks}
    for kind in ("window KV", "compressed KV", "indexer keys", "compressor states"):
        assert names[f"cache rows == dense rows: {kind}"].tokens > 0
    assert names["paged == dense: prefix hit at a rewound request's checkpoint"].tokens > 0
    assert names["paged == dense: prefix hit after evictions"].tokens > 0


def test_a_random_scenario_passes_and_reports_its_coverage():
    report = run_random_scenario(2, config=PRODUCTION_GEOMETRY, steps=30)
    assert report.passed, [c for c in report.checks if not c.passed]
    assert "rewinds" in report.notes[0] and "benchmarked-path" in report.notes[0]


def test_a_page_reused_while_still_held_is_caught(monkeypatch):
    """A pool that hands out a held page again (the classic one-line refcount bug) must FAIL."""
    from hybridkv.reference import pressure as mod

    runner = mod.pressure_runner(PRODUCTION_GEOMETRY, 0)
    real = runner.manager.schedule

    def schedule_then_scribble(items, **kw):
        batch = real(items, **kw)
        # emulate another request writing into a page this one holds: zero one window row
        rid = batch.request_ids[0]
        base, pages = runner.manager.request_pages(rid, "v4.swa_kv")
        if runner.manager.num_computed_tokens(rid) > 300:
            runner.stack.pools[0].window[pages[-1]] = 0
        return batch

    monkeypatch.setattr(mod, "pressure_runner", lambda config, seed: runner)
    monkeypatch.setattr(runner.manager, "schedule", schedule_then_scribble)
    report = mod.run_pressure_scenario(0, config=PRODUCTION_GEOMETRY)
    assert not report.passed
    assert np.isfinite(report.max_abs_error) and report.max_abs_error > 1e-6
