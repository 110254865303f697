"""``plan --compare vllm`` against vLLM 0.33.0's own planning.

GOLDEN holds what vLLM's functions returned for each case (model, budget GiB,
max_model_len, max_num_batched_tokens): its groups as (layers, block tokens,
window) sorted, ``num_blocks``, the block stride in bytes and
``get_max_concurrency_for_kv_cache_config``. They were recorded on the CPU with
``tests/golden/record_vllm_plans.py`` (vLLM 0.33.0, CPU torch 2.13.0; the
environment of bench/README.md). When vLLM is importable (that environment, with
``bench`` on the path) the same cases are also planned live.

ADMITTED holds how many 128k requests vLLM's own ``KVCacheManager`` admitted at
40 GiB, measured by ``tests/golden/record_vllm_admission.py`` (bench's
``measure_capacity``: prefill in chunks, one decode step, next request, until
the manager refuses one).
"""

import importlib.util
import json

import pytest

from hybridkv.cli import main
from hybridkv.compare_vllm import compare_with_vllm, least_padding_repeats
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits

GOLDEN = [
    (('deepseek-v4-flash', 40, 131072, 2048), [(20, 8, 128), (21, 64, 128), (22, 64, 128), (42, 4, 8), (62, 256, None)], 42853, 1002240, 19.46094459582198),
    (('deepseek-v4-flash', 40, 131072, 8192), [(20, 8, 128), (21, 64, 128), (22, 64, 128), (42, 4, 8), (62, 256, None)], 42853, 1002240, 5.956769530164026),
    (('deepseek-v4-flash', 40, 1048576, 8192), [(20, 8, 128), (21, 64, 128), (22, 64, 128), (42, 4, 8), (62, 256, None)], 42853, 1002240, 3.975969567637781),
    (('deepseek-v4-flash', 8, 65536, 2048), [(20, 8, 128), (21, 64, 128), (22, 64, 128), (42, 4, 8), (62, 256, None)], 8570, 1002240, 4.4039054470709145),
    (('deepseek-v4-pro', 80, 131072, 8192), [(30, 64, 128), (31, 8, 128), (31, 64, 128), (60, 4, 8), (91, 256, None)], 59819, 1435968, 8.315123714206283),
    (('deepseek-v4-pro', 40, 262144, 4096), [(30, 64, 128), (31, 8, 128), (31, 64, 128), (60, 4, 8), (91, 256, None)], 29909, 1435968, 6.831658291457287),
]


ADMITTED = [
    # (model, budget GiB, context, batched tokens) -> requests vLLM's manager admitted
    (("deepseek-v4-flash", 40, 131072, 2048), 77),
    (("deepseek-v4-flash", 40, 131072, 8192), 67),
]


def _compare(model, gib, context, batched):
    layout = cache_layout(model, indexer="fp8")
    limits = Limits(128, batched, 2**20, 1)
    return compare_with_vllm(layout, limits, gib * 2**30, context)


@pytest.mark.parametrize("case, groups, num_blocks, block_bytes, concurrency", GOLDEN)
def test_matches_vllm_recorded_outputs(case, groups, num_blocks, block_bytes, concurrency):
    ours = _compare(*case)
    assert sorted((g.num_layers, g.block_tokens, g.window_tokens) for g in ours.groups) == groups
    assert ours.num_blocks == num_blocks
    assert ours.block_bytes == block_bytes
    assert ours.logged_concurrency == pytest.approx(concurrency, rel=1e-12)


@pytest.mark.parametrize("case, admitted", ADMITTED)
def test_admitted_requests_match_vllms_manager(case, admitted):
    assert _compare(*case).admitted_requests == admitted


def test_the_issue_figures_and_the_admitted_count():
    flash_2048 = _compare("deepseek-v4-flash", 40, 131072, 2048)
    assert round(flash_2048.logged_concurrency, 2) == 19.46
    assert flash_2048.request_blocks == 2202 and flash_2048.held_blocks == 534
    assert flash_2048.admitted_requests == 77  # measured in vLLM's manager by bench
    assert round(_compare("deepseek-v4-flash", 40, 131072, 8192).logged_concurrency, 2) == 5.96


def test_held_and_admission_blocks_by_hand():
    ours = _compare("deepseek-v4-flash", 40, 131072, 2048)
    # in flight 2 x 2048: window ceil((127 + 4096) / 64) + 1 = 67 (two groups), history
    # 131072 / 256 = 512, c4 states ceil((7 + 4096) / 4) + 1 = 1027, c128 ceil(4223 / 8) + 1 = 529.
    assert ours.request_blocks == 67 + 67 + 512 + 1027 + 529
    # Running at 131,072 tokens: the last 128 window tokens span 2 blocks of 64 (x2 groups),
    # 8 c4-state tokens 2 blocks of 4, 128 c128-state tokens 16 blocks of 8.
    assert ours.held_blocks == 2 + 2 + 512 + 2 + 16
    # 77 = 1 + (42,852 - 2,202) // 534
    assert ours.admitted_requests == 1 + (42_853 - 1 - 2202) // 534


def test_least_padding_repeats():
    assert least_padding_repeats([43, 21, 20], 21) == 22  # V4-Flash: window layers split 22 + 21
    assert least_padding_repeats([61, 30, 31], 30) == 31  # V4-Pro: 31 + 30


def test_cli_compare_says_what_to_trust(capsys):
    code = main(["plan", "--compare", "vllm", "--chunk-tokens", "2048"])
    out = capsys.readouterr().out
    assert code == 0
    flat = " ".join(out.split())
    assert "vLLM 0.33.0 admits 77 requests, logs 19.46x" in flat
    assert "maximum concurrency 19.46x at 131,072 tokens" in flat
    assert "trust 77: the requests vLLM's manager really admits" in flat
    code = main(["plan", "--compare", "vllm", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert round(report["vllm"]["logged_max_concurrency"], 2) == 5.96
    assert report["vllm"]["num_blocks"] == 42_853


@pytest.mark.parametrize("page_space, line", [
    (None, "hybridkv fits 75 requests at 128k (one shared arena)"),
    ("per-group", "hybridkv fits 74 requests at 128k (per-group pools, 9,695,232-token budget)"),
])
def test_cli_compare_counts_hybridkv_in_the_page_space_asked_for(capsys, page_space, line):
    """hybridkv's figure is the plan's own page space (shared by default): the count `plan` itself prints for
    the same budget and limits (FP8 indexer keys, as vLLM caches them), not the per-group one it printed before."""
    extra = [] if page_space is None else ["--page-space", page_space]
    assert main(["plan", "--compare", "vllm", *extra]) == 0
    assert line in " ".join(capsys.readouterr().out.split())
    assert main(["plan", "--indexer", "fp8", *extra]) == 0
    headline = capsys.readouterr().out.splitlines()[0]
    assert (" 75 requests at 128k" if page_space is None else " 74 requests at 128k") in headline
    assert main(["plan", "--compare", "vllm", "--json", *extra]) == 0
    assert json.loads(capsys.readouterr().out)["hybridkv"]["page_space"] == (page_space or "shared")


def _vllm_side():
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        import vllm_side  # bench/ on the path, in the vLLM environment
    except ImportError:
        return None
    return vllm_side


@pytest.mark.parametrize("case", [row[0] for row in GOLDEN])
def test_matches_vllm_live(case):
    side = _vllm_side()
    if side is None:
        pytest.skip("vLLM 0.33.0 not importable (bench/README.md's environment, PYTHONPATH=src:bench)")
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    model, gib, context, batched = case
    plan = side.plan_kv_cache(
        side.bundled_v4_config(model), kv_memory_bytes=gib * 2**30, max_model_len=context,
        max_num_batched_tokens=batched, max_num_seqs=256,
    )
    ours = _compare(*case)
    assert ours.num_blocks == plan.kv_cache_config.num_blocks
    live = get_max_concurrency_for_kv_cache_config(plan.vllm_config, plan.kv_cache_config)
    assert ours.logged_concurrency == pytest.approx(live, rel=1e-12)
