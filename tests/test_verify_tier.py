"""``hybridkv verify --tier``: a prefix offloaded by instance A (another process for disk and
mooncake), hit from the tier by instance B; B's outputs equal the dense reference, and the
faults (a missing object, a corrupted object, a dead Mooncake master) are clean misses."""

import os

import pytest

from hybridkv.cli import main
from hybridkv.reference.tier_check import run_tier_check
from hybridkv.tiers import TierUnavailable
from hybridkv.tiers.mooncake import load_store_class

try:
    load_store_class()
    MOONCAKE_MISSING = None
except TierUnavailable as exc:
    MOONCAKE_MISSING = str(exc)
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError(f"CI must run the Mooncake tier check: {MOONCAKE_MISSING}") from None

FAULTS = ["missing object -> shorter hit", "corrupted object -> clean miss"]


def assert_report(report, extra=()):
    assert report.passed, [c for c in report.checks if not c.passed]
    names = [c.name for c in report.checks]
    assert names == ["A offloads to the tier", "B hits from the tier, paged == dense", *FAULTS, *extra]
    hit = report.check("B hits from the tier, paged == dense")
    assert "loaded 512" in hit.detail and hit.max_abs_error <= report.tolerance == 1e-9
    # B computes only past the hit: 650 prompt tokens - 512 + 4 decode tokens
    assert hit.tokens == 142
    assert "loaded 256" in report.check(FAULTS[0]).detail
    corrupt = report.check(FAULTS[1])
    assert "loaded 0" in corrupt.detail and "1 corrupt counted" in corrupt.detail and corrupt.tokens == 654


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_tier_check_passes(tier):
    report = run_tier_check(tier, seed=0)
    assert_report(report)
    assert ("cannot cross processes" in report.notes[0]) == (tier == "host")


@pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=str(MOONCAKE_MISSING))
def test_tier_check_on_mooncake_with_its_own_master():
    report = run_tier_check("mooncake", seed=1)
    assert_report(report, extra=["dead master -> clean miss"])
    dead = report.check("dead master -> clean miss")
    assert "loaded 0" in dead.detail and "0 tier errors" not in dead.detail


def test_cli_prints_each_check_and_pass(capsys):
    assert main(["verify", "--tier", "host"]) == 0
    out = capsys.readouterr().out
    assert "PASS  B hits from the tier, paged == dense" in out and "loaded 512" in out
    assert out.rstrip().endswith("PASS")


def test_cli_refuses_tier_with_another_mode(capsys):
    assert main(["verify", "--tier", "disk", "--inject-fault", "kv-byte"]) != 0
    assert "--tier does not combine" in capsys.readouterr().err
