"""bench/peers: the peer cache managers as lines of bench/hit_sweep.py (issue 21).

The peers run only in their own environment (bench/README.md, "Peers"); under
any other Python the tests that drive a peer are skipped, and the line is
reported as skipped with its reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from hybridkv.models.layout import cache_layout
from hybridkv.sim.offline_bound import UnitBytes, offline_hit_bound
from hybridkv.sim.workloads import Request, in_waves, multiturn_workload

GIB = 2**30
BENCH = str(Path(__file__).resolve().parents[1] / "bench")
TOKENSPEED = "tokenspeed 0.1.30"
SGLANG = "SGLang 0.5.23"
PEERS = (TOKENSPEED, SGLANG)
# tokenspeed's V4 recipe: the window KV, per ratio its compressed KV and compressor
# state, and the indexer's keys and compressor state as groups of their own.
TOKENSPEED_V4_GROUPS = ("v4.swa_kv", "v4.c4a.compressed_kv", "v4.c4a.compressor_state", "v4.c4a.indexer_kv",
                        "v4.c4a.indexer_compressor_state", "v4.c128a.compressed_kv", "v4.c128a.compressor_state")


@pytest.fixture(scope="module")
def sweep():
    """bench/hit_sweep.py and bench/peers, imported from bench/."""
    sys.path.insert(0, BENCH)
    try:
        import hit_sweep
        import peers

        yield hit_sweep, peers
    finally:
        sys.path.remove(BENCH)


def _peer(peers, line):
    side = peers.load_peer_side(line)
    if isinstance(side, str):
        pytest.skip(f"{line} not drivable here: {side}")
    return side


def _tokenspeed(peers):
    return _peer(peers, TOKENSPEED)


def _request(rid, prompt, answer):
    return Request(rid, 0, np.asarray(prompt), len(answer), np.asarray(answer))


@pytest.mark.parametrize("line, side_class", [(TOKENSPEED, "TokenspeedSide"), (SGLANG, "SglangSide")])
def test_a_peer_line_is_listed_and_skipped_with_its_reason_when_absent(sweep, line, side_class):
    hit_sweep, peers = sweep
    assert line in hit_sweep.LINES
    assert hit_sweep.LINES[-1] == "offline bound"
    skipped = peers.peer_lines_skipped([line, "hybridkv shared"])
    side = peers.load_peer_side(line)
    if isinstance(side, str):
        assert skipped == {line: side}
        assert "not installed" in side or "speaks" in side or "do not import" in side or "does not import" in side
    else:
        assert skipped == {}
        assert side.__name__ == side_class


@pytest.mark.parametrize("line", PEERS)
def test_a_peer_hits_a_worked_case(sweep, line):
    """Hits on a 256-token grain (both peers' V4 page), only where window KV was kept.

    Both peers keep a sequence's window KV (and compressor states) at the end
    of each prefill chunk (2,048 tokens here) and at the end of what a finished
    request computed (tokenspeed: its scheduler's checkpoints; SGLang: the
    radix tree's SWA component, published by ``checkpoint_kv_cache`` after
    each chunk and ``release_kv_cache`` at the end); below those points the
    window has slid on and been freed. A request always computes its last
    prompt token.

    a: 5,000-token prompt, 10-token answer: hit 0. It computes 5,009 tokens
       in chunks ending at 2,048, 4,096 and 5,000, then 9 answer tokens.
    b: a's prompt + answer + 50 new tokens: hit at a's end, 19 x 256 = 4,864.
    c: a's first 1,000 prompt tokens: no kept point below 1,000, hit 0; c
       computes 1,000 tokens and ends there (3 whole blocks, 768).
    d: a's first 2,300 tokens: the end of a's first chunk, 2,048.
    e: c's prompt again: c's end, 768.
    f: an unrelated prompt: 0.
    """
    hit_sweep, peers = sweep
    _peer(peers, line)
    rng = np.random.default_rng(7)
    prompt, answer = rng.integers(1, 100_000, 5000), rng.integers(1, 100_000, 10)
    requests = [
        _request("a", prompt, answer),
        _request("b", np.concatenate([prompt, answer, rng.integers(1, 100_000, 50)]), answer[:4]),
        _request("c", prompt[:1000], answer[:1]),
        _request("d", prompt[:2300], answer[:3]),
        _request("e", prompt[:1000], answer[:2]),
        _request("f", rng.integers(1, 100_000, 600), answer[:2]),
    ]
    side = hit_sweep.make_side(line, 2 * GIB, 8192, None)
    assert side.serve(requests).tolist() == [0, 4864, 0, 2048, 768, 0]


def test_tokenspeed_holds_the_cached_pages_in_its_seven_v4_groups(sweep):
    hit_sweep, peers = sweep
    _tokenspeed(peers)
    rng = np.random.default_rng(3)
    side = hit_sweep.make_side(TOKENSPEED, 2 * GIB, 8192, None)
    side.serve([_request("a", rng.integers(1, 100_000, 3000), rng.integers(1, 100_000, 5))])
    pages = side.group_pages()
    assert sorted(pages) == sorted(TOKENSPEED_V4_GROUPS)
    assert all(0 < p["available_pages"] < p["total_pages"] for p in pages.values())  # cached, not running


@pytest.mark.parametrize("line", PEERS)
def test_a_peer_line_through_the_sweep_is_not_above_the_offline_bound(sweep, line):
    hit_sweep, peers = sweep
    _peer(peers, line)
    requests = in_waves(multiturn_workload(12, 4, seed=2, system_prompt_tokens=1000), 12)
    sizes = UnitBytes.from_layout(cache_layout("deepseek-v4-flash", indexer="fp8"))
    result = hit_sweep.run_line(line, requests, 2 * GIB, None, sizes)
    bound = offline_hit_bound(requests, sizes, 2 * GIB)
    assert result["hit_rate"] is not None, result.get("error")
    assert 0 < result["hit_rate"] <= bound.hit_rate


def test_tokenspeed_refuses_a_budget_its_sizing_cannot_serve(sweep):
    """At 1 GiB tokenspeed's recipe, sized for 16 running requests at this context
    limit, admits fewer tokens than one request needs: the line is refused, not run."""
    hit_sweep, peers = sweep
    _tokenspeed(peers)
    requests = in_waves(multiturn_workload(12, 4, seed=2, system_prompt_tokens=1000), 12)
    sizes = UnitBytes.from_layout(cache_layout("deepseek-v4-flash", indexer="fp8"))
    result = hit_sweep.run_line(TOKENSPEED, requests, GIB, None, sizes)
    assert result["hit_rate"] is None
    assert "exceeds cache capacity" in result["error"]


def test_sglang_sizes_its_pools_by_its_own_v4_rule(sweep):
    """SGLang's DSV4 configurator: the SWA pool is 10% of the full-token pool (its
    default ``swa_full_tokens_ratio``), floored to its 256-token page; the c4 and
    c128 pools hold a quarter and a 128th of the full tokens; 16 running requests."""
    hit_sweep, peers = sweep
    _peer(peers, SGLANG)
    pools = hit_sweep.make_side(SGLANG, 2 * GIB, 8192, None).pool_tokens()
    full = pools["full_tokens"]
    assert full % 256 == 0 and 100_000 < full < 2 * GIB // 2048  # > 2 KiB a token across 43 layers
    assert pools["swa_tokens"] == int(full * 0.1) // 256 * 256
    assert pools["c4_tokens"] == full // 4
    assert pools["c128_tokens"] == full // 128
    assert pools["max_running_requests"] == 16
