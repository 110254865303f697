"""hybridkv.plan: page counts, exact budget fitting, concurrency, widths, report."""

import dataclasses
import json
import math
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.models.layout import cache_layout
from hybridkv.plan import (
    Limits,
    Plan,
    group_page_counts,
    plan_for_budget,
    plan_for_tokens,
    scheduler_page_tokens,
    table_widths,
)
from hybridkv.spec import CacheGroupSpec

GiB = 2**30
LIMITS = Limits(max_running_requests=128, max_scheduled_tokens=8192, max_context_tokens=2**20)

# V4-Flash page bytes per group, by hand (docs/codecs.md; see test_layout.py).
SWA_PAGE = 43 * 37_440
C4_STATE_PAGE = 21 * 32_768
C4_KV_PAGE = 21 * (37_440 + 4_352)
C128_STATE_PAGE = 20 * 32_768
C128_KV_PAGE = 20 * 1_728
INDEXER_STATE_PAGE = 21 * 8_192


@lru_cache(maxsize=None)
def _layout(name="deepseek-v4-flash", k=1, indexer="mxfp4"):
    return cache_layout(name, speculative_tokens=k, indexer=indexer)


def test_acceptance_flash_40gib():
    # Sliding pages (docs/planning.md), live 128, sched 8192, W 128:
    swa = 128 * math.ceil(127 / 64) + 8192 // 64 + 128 + 1  # 513
    c4_state = 128 * math.ceil(7 / 4) + 8192 // 4 + 128 + 1  # 2,433
    c128_state = 128 * math.ceil(127 / 8) + 8192 // 8 + 128 + 1  # 3,201
    indexer_state = c4_state
    assert (swa, c4_state, c128_state) == (513, 2433, 3201)
    # Once total >= 8192 the sliding groups are fixed and each 256-token scheduler page
    # adds one page to both compressed groups: bytes(N) = fixed + (N + 129) * per_page.
    fixed = (
        swa * SWA_PAGE
        + c4_state * C4_STATE_PAGE
        + c128_state * C128_STATE_PAGE
        + indexer_state * INDEXER_STATE_PAGE
    )
    per_page = C4_KV_PAGE + C128_KV_PAGE
    pages = (40 * GiB - fixed) // per_page - 129
    assert pages == 41_455

    plan = plan_for_budget(_layout(), 40 * GiB, LIMITS)
    assert plan.scheduler_page_tokens == 256
    assert plan.scheduler_pages == 41_455
    assert plan.total_tokens == 10_612_480
    assert plan.group_pages == {
        "v4.swa_kv": 513,
        "v4.c4a.compressor_state": 2_433,
        "v4.c4a.compressed_kv": 41_584,
        "v4.c128a.compressor_state": 3_201,
        "v4.c128a.compressed_kv": 41_584,
        "v4.c4a.indexer_compressor_state": 2_433,
    }
    assert plan.total_bytes == fixed + (pages + 129) * per_page
    assert plan.total_bytes <= 40 * GiB < plan.total_bytes + per_page
    assert plan.budget_bytes == 40 * GiB
    assert plan.page_bytes["v4.c4a.compressed_kv"] == C4_KV_PAGE
    assert plan.group_bytes["v4.swa_kv"] == 513 * SWA_PAGE
    assert plan.bytes_per_token_allocated == plan.total_bytes / 10_612_480
    assert plan.ideal_bytes_per_token == 3_514.25


def test_table_widths_flash():
    plan = plan_for_budget(_layout(), 40 * GiB, LIMITS)
    assert plan.table_widths == {
        "v4.swa_kv": math.ceil((128 + 1) / 64) + 1,  # 4
        "v4.c4a.compressor_state": math.ceil((8 + 1) / 4) + 1,  # 4
        "v4.c4a.compressed_kv": math.ceil((2**20 + 1) / 256),  # 4,097
        "v4.c128a.compressor_state": math.ceil((128 + 1) / 8) + 1,  # 18
        "v4.c128a.compressed_kv": 4_097,
        "v4.c4a.indexer_compressor_state": 4,
    }
    short = Limits(128, 8192, max_context_tokens=100, speculative_tokens=3)
    widths = table_widths(_layout(k=3).specs, short)
    assert widths["v4.swa_kv"] == math.ceil((100 + 3) / 64) + 1  # window clipped by ctx
    assert widths["v4.c4a.compressed_kv"] == math.ceil(103 / 256)


def test_concurrency_counts_every_group():
    plan = plan_for_budget(_layout(), 40 * GiB, LIMITS)
    # 128k: a compressed group needs ceil((131072 + 1) / 256) = 513 pages; 41,583 // 513 = 81.
    # Window groups: swa 512 // 4 = 128, c4 state 2,432 // 4 = 608, c128 state 3,200 // 18 = 177.
    assert plan.concurrency(131_072) == (81, "v4.c4a.compressed_kv")  # ties: spec order
    assert plan.max_concurrent_requests(131_072) == 81
    # 1,000 tokens: compressed groups fit 41,583 // 4 = 10,395. The next query reads the 127
    # tokens before it plus the one it writes: 128 tokens span at most ceil((128 + 63) / 64) = 3
    # swa pages -> 512 // 3 = 170 requests.
    assert plan.concurrency(1_000) == (170, "v4.swa_kv")
    assert plan.request_pages(1_000)["v4.c4a.compressed_kv"] == 4
    assert plan.request_pages(1_000)["v4.swa_kv"] == 3
    # 10 tokens: 11 tokens in all fit one swa page -> 512 requests; c4 state needs
    # min(ceil((7 + 1 + 3) / 4), ceil(11 / 4)) = 3 -> 2,432 // 3 = 810; c128 state
    # min(ceil((10 + 1 + 7) / 8), ceil(11 / 8)) = 2 -> 3,200 // 2 = 1,600.
    assert plan.request_pages(10)["v4.swa_kv"] == 1
    assert plan.request_pages(10)["v4.c4a.compressor_state"] == 3
    assert plan.request_pages(10)["v4.c128a.compressor_state"] == 2
    assert plan.concurrency(10) == (512, "v4.swa_kv")
    assert plan.concurrency(2**20) == (41_583 // 4_097, "v4.c4a.compressed_kv")


@pytest.mark.parametrize("bad", [0, -1, 2**20 + 1, 1.5, True, "128"])
def test_concurrency_rejects_bad_context(bad):
    plan = plan_for_budget(_layout(), 40 * GiB, LIMITS)
    with pytest.raises(ValueError, match="context_tokens"):
        plan.concurrency(bad)


def test_small_pool_below_the_chunk_size():
    limits = Limits(max_running_requests=2, max_scheduled_tokens=8192, max_context_tokens=4096)
    plan = plan_for_tokens(_layout(), 512, limits)
    # total 512 < sched: the scheduled term is ceil(512 / T).
    assert plan.group_pages == {
        "v4.swa_kv": 2 * 2 + 512 // 64 + 2 + 1,  # 15
        "v4.c4a.compressor_state": 2 * 2 + 512 // 4 + 2 + 1,  # 135
        "v4.c4a.compressed_kv": 2 + 2 + 1,
        "v4.c128a.compressor_state": 2 * 16 + 512 // 8 + 2 + 1,  # 99
        "v4.c128a.compressed_kv": 2 + 2 + 1,
        "v4.c4a.indexer_compressor_state": 135,
    }
    assert plan.budget_bytes is None
    assert plan.scheduler_pages == 2


def test_speculative_widening_of_sliding_groups():
    # k = 5: ratio-4 state windows become 9; each request holds W - 1 + k - 1 tokens.
    limits = Limits(128, 8192, 2**20, speculative_tokens=5)
    pages = group_page_counts(_layout(k=5).specs, limits, 256 * 100)
    assert pages["v4.swa_kv"] == 128 * math.ceil(131 / 64) + 128 + 129  # 641
    assert pages["v4.c4a.compressor_state"] == 128 * math.ceil(12 / 4) + 2048 + 129
    assert pages["v4.c128a.compressor_state"] == 128 * math.ceil(131 / 8) + 1024 + 129
    assert pages["v4.c4a.compressed_kv"] == 100 + 129  # full history does not change


def _facts_formula(spec, live, sched, ctx, total):
    T = spec.page_tokens
    if spec.is_sliding:
        W = spec.sliding_window_tokens
        return live * -(-min(max(W - 1, 0), ctx) // T) + -(-min(sched, total) // T) + live + 1
    return -(-total // T) + live + 1


_windows = st.integers(1, 300)
_specs = st.one_of(
    st.builds(
        lambda rows, stride, w: CacheGroupSpec("s", "sliding_window", rows, stride, w, "state"),
        st.integers(1, 64),
        st.integers(1, 4),
        _windows,
    ),
    st.builds(
        lambda rows, stride: CacheGroupSpec("h", "full_history", rows, stride),
        st.integers(1, 64),
        st.integers(1, 128),
    ),
)


@given(
    spec=_specs,
    live=st.integers(1, 512),
    sched=st.integers(1, 20_000),
    ctx=st.integers(1, 2**21),
    total=st.integers(1, 10**7),
)
def test_reduces_to_the_facts_formula_at_k1(spec, live, sched, ctx, total):
    limits = Limits(live, sched, ctx)
    assert group_page_counts([spec], limits, total) == {
        spec.group_id: _facts_formula(spec, live, sched, ctx, total)
    }


def _held_pages(first, n, window, page_tokens):
    """Pages a request holds while writing [first, first + n) under the facts-doc §7
    release rule (pages below (first - W + 1) // T already released)."""
    low = max(0, first - window + 1) // page_tokens
    high = (first + n - 1) // page_tokens
    return high - low + 1


@given(
    window=st.integers(1, 70),
    page_tokens=st.integers(1, 20),
    k=st.integers(1, 9),
    ctx=st.integers(1, 200),
)
def test_sliding_allotment_is_an_upper_bound(window, page_tokens, k, ctx):
    """Exhaustive over positions: a request decoding n <= k tokens never holds more than
    its per-request allotment; one prefilling n tokens needs at most ceil(n / T) more."""
    spec = CacheGroupSpec("s", "sliding_window", page_tokens, 1, window, "state")
    limits = Limits(1, 1, ctx, speculative_tokens=k)
    total = 10**6
    # One running request, sched = 1: pages - 1 (null) - ceil(1/T) = its allotment.
    allotment = group_page_counts([spec], limits, total)["s"] - 2
    first = np.arange(ctx)[:, None]
    n = np.arange(1, ctx + 1)[None, :]
    valid = first + n <= ctx
    low = np.maximum(0, first - window + 1) // page_tokens
    held = (first + n - 1) // page_tokens - low + 1
    decode = valid & (n <= k)
    assert (held[decode] <= allotment).all()
    prefill_bound = allotment + -(-n // page_tokens)
    assert (held <= prefill_bound)[valid].all()
    # Cross-check the vectorized count on a few points.
    assert held[0, 0] == _held_pages(0, 1, window, page_tokens) == 1


def test_scheduler_page_tokens():
    assert scheduler_page_tokens(_layout().specs) == 256
    hist = [CacheGroupSpec("a", "full_history", 16, 1), CacheGroupSpec("b", "full_history", 3, 8)]
    assert scheduler_page_tokens(hist) == 48
    sliding = [CacheGroupSpec("s", "sliding_window", 64, 1, 128, "state")]
    assert scheduler_page_tokens(sliding + [CacheGroupSpec("s4", "sliding_window", 6, 1, 8)]) == 192
    with pytest.raises(ValueError, match="no cache groups"):
        scheduler_page_tokens([])


# --- exactness and monotonicity --------------------------------------------------

def _bytes_for(layout, limits, total):
    pages = group_page_counts(layout.specs, limits, total)
    return sum(pages[g.group_id] * g.page_bytes for g in layout.groups)


_limits = st.builds(
    Limits,
    max_running_requests=st.integers(1, 300),
    max_scheduled_tokens=st.integers(1, 40_000),
    max_context_tokens=st.integers(1, 2**20),
    speculative_tokens=st.integers(1, 6),
)


@given(
    model=st.sampled_from(["deepseek-v4-flash", "deepseek-v4-pro"]),
    indexer=st.sampled_from(["mxfp4", "fp8"]),
    limits=_limits,
    budgets=st.tuples(st.integers(0, 300 * GiB), st.integers(0, 300 * GiB)),
)
def test_planner_is_exact_and_monotone(model, indexer, limits, budgets):
    layout = _layout(model, limits.speculative_tokens, indexer)
    small, large = sorted(budgets)
    minimum = _bytes_for(layout, limits, 256)
    plans = []
    for budget in (small, large):
        if budget < minimum:
            with pytest.raises(ValueError, match=f"at least {minimum:,} B"):
                plan_for_budget(layout, budget, limits, page_space="per-group")
            plans.append(None)
            continue
        plan = plan_for_budget(layout, budget, limits, page_space="per-group")
        assert plan.total_tokens % 256 == 0
        assert plan.total_bytes == _bytes_for(layout, limits, plan.total_tokens)
        assert plan.total_bytes <= budget < _bytes_for(layout, limits, plan.total_tokens + 256)
        plans.append(plan)
    if plans[0] is not None:
        assert plans[0].total_tokens <= plans[1].total_tokens


@given(limits=_limits, extra=st.integers(0, 50 * 912_192))
def test_planner_matches_stepping_from_the_minimum(limits, extra):
    layout = _layout(k=limits.speculative_tokens)
    budget = _bytes_for(layout, limits, 256) + extra
    pages = 1
    while _bytes_for(layout, limits, (pages + 1) * 256) <= budget:
        pages += 1
    assert plan_for_budget(layout, budget, limits, page_space="per-group").scheduler_pages == pages


def test_minimum_budget_is_exactly_one_scheduler_page():
    layout = _layout()
    minimum = _bytes_for(layout, LIMITS, 256)
    assert plan_for_budget(layout, minimum, LIMITS, page_space="per-group").scheduler_pages == 1
    with pytest.raises(ValueError, match=f"too small for per-group pools.*at least {minimum:,} B.*page_space='shared'"):
        plan_for_budget(layout, minimum - 1, LIMITS, page_space="per-group")


def test_shared_page_space_plans_a_budget_too_small_for_per_group_pools():
    """A shared arena reserves no per-request window pages, so it needs no per-group
    minimum: below it the plan keeps the budget and one scheduler page of per-group
    figures, flagged as not fitting; at the minimum both kinds agree."""
    layout = _layout()
    minimum = _bytes_for(layout, LIMITS, 256)
    plan = plan_for_budget(layout, minimum - 1, LIMITS, page_space="shared")
    assert (plan.scheduler_pages, plan.budget_bytes, plan.fits_per_group) == (1, minimum - 1, False)
    assert plan.total_bytes == minimum
    at_minimum = plan_for_budget(layout, minimum, LIMITS, page_space="shared")
    per_group = plan_for_budget(layout, minimum, LIMITS, page_space="per-group")
    assert dataclasses.replace(at_minimum, page_space="per-group") == per_group and at_minimum.fits_per_group
    with pytest.raises(ValueError, match="page_space must be"):
        plan_for_budget(layout, minimum, LIMITS, page_space="arena")


def test_a_plan_records_its_page_space_and_shared_is_the_default():
    """``plan_for_budget`` and ``plan_for_tokens`` make a shared-arena plan unless asked for
    per-group pools; the page space is part of the plan (and of its report), and both kinds
    carry the same per-group figures."""
    layout = _layout()
    shared, per_group = (plan_for_budget(layout, 40 * GiB, LIMITS, **kw) for kw in ({}, {"page_space": "per-group"}))
    assert (shared.page_space, per_group.page_space) == ("shared", "per-group") and shared != per_group
    assert (shared.total_tokens, shared.group_pages) == (per_group.total_tokens, per_group.group_pages)
    assert (shared.report()["page_space"], per_group.report()["page_space"]) == ("shared", "per-group")
    assert plan_for_tokens(layout, 512, LIMITS).page_space == "shared"
    assert plan_for_tokens(layout, 512, LIMITS, page_space="per-group").page_space == "per-group"
    assert Plan(layout, LIMITS, 512).page_space == "shared"
    for bad in ("arena", None, "Shared"):
        with pytest.raises(ValueError, match="page_space must be 'shared' or 'per-group'"):
            plan_for_tokens(layout, 512, LIMITS, page_space=bad)
        with pytest.raises(ValueError, match="page_space must be"):
            Plan(layout, LIMITS, 512, page_space=bad)


def test_a_budget_that_holds_no_arena_slab_is_refused_when_planned():
    """Below one arena slab (plus the head of null pages) a shared plan is refused by
    ``plan_for_budget`` itself, naming the least the arena needs; at that least it plans.
    V4-Flash MXFP4: anchor ``c4a.compressed_kv`` 877,632 B, largest page ``swa_kv``
    1,609,920 B: head 2 x 877,632, slab 16 x 877,632, so 18 x 877,632 = 15,797,376 B."""
    layout = _layout()
    least = 18 * C4_KV_PAGE
    assert least == 15_797_376
    with pytest.raises(ValueError, match=f"holds no slab: a shared arena needs {least:,} B at least"):
        plan_for_budget(layout, least - 1, LIMITS)
    plan = plan_for_budget(layout, least, LIMITS)
    assert (plan.page_space, plan.budget_bytes, plan.fits_per_group) == ("shared", least, False)
    # One running request of one token: per-group pools need less than one slab; only they plan it.
    tiny = Limits(1, 1, 1)
    minimum = _bytes_for(layout, tiny, 256)
    assert minimum < least
    assert plan_for_budget(layout, minimum, tiny, page_space="per-group").scheduler_pages == 1
    with pytest.raises(ValueError, match="holds no slab"):
        plan_for_budget(layout, minimum, tiny)


# --- validation --------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_running_requests=0),
        dict(max_running_requests=-1),
        dict(max_running_requests=True),
        dict(max_scheduled_tokens=1.5),
        dict(max_scheduled_tokens="8192"),
        dict(max_context_tokens=0),
        dict(max_context_tokens=None),
        dict(speculative_tokens=0),
    ],
)
def test_limits_validation(kwargs):
    base = dict(max_running_requests=128, max_scheduled_tokens=8192, max_context_tokens=2**20)
    base.update(kwargs)
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        Limits(**base)


def test_limits_accept_numpy_ints_and_are_frozen():
    limits = Limits(np.int64(4), np.int32(64), np.int64(1024))
    assert limits == Limits(4, 64, 1024)
    assert type(limits.max_running_requests) is int
    with pytest.raises(AttributeError):
        limits.max_running_requests = 5  # type: ignore[misc]


@pytest.mark.parametrize("budget", [-1, True, 1.5, "40GiB", None])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="kv_memory_bytes"):
        plan_for_budget(_layout(), budget, LIMITS)


def test_speculative_tokens_must_match_the_layout():
    with pytest.raises(ValueError, match="speculative_tokens=2.*built for speculative_tokens=1"):
        plan_for_budget(_layout(), 40 * GiB, Limits(128, 8192, 2**20, speculative_tokens=2))
    with pytest.raises(ValueError, match="speculative_tokens"):
        plan_for_tokens(_layout(k=3), 256, LIMITS)
    with pytest.raises(ValueError, match="must be a Limits"):
        plan_for_tokens(_layout(), 256, (128, 8192, 2**20))


@pytest.mark.parametrize("total, match", [(0, "positive"), (-256, "positive"), (300, "scheduler pages")])
def test_plan_for_tokens_validation(total, match):
    with pytest.raises(ValueError, match=match):
        plan_for_tokens(_layout(), total, LIMITS)
    with pytest.raises(ValueError, match="total_tokens"):
        group_page_counts(_layout().specs, LIMITS, 0)


def test_window_only_model_has_no_token_bound():
    config = {
        "num_hidden_layers": 2,
        "compress_ratios": [0, 0],
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "sliding_window": 128,
    }
    layout = cache_layout(config)
    with pytest.raises(ValueError, match="no full-history cache group"):
        plan_for_budget(layout, 40 * GiB, LIMITS)
    assert plan_for_tokens(layout, 64, LIMITS).group_pages == {"v4.swa_kv": 128 * 2 + 1 + 128 + 1}


# --- report ---------------------------------------------------------------------------

def test_report_schema():
    plan = plan_for_budget(_layout(), 40 * GiB, LIMITS)
    report = json.loads(json.dumps(plan.report(131_072)))
    assert report["schema_version"] == 1
    assert report["model"] == "deepseek-v4-flash"
    assert report["limits"] == {
        "max_running_requests": 128,
        "max_scheduled_tokens": 8192,
        "max_context_tokens": 2**20,
        "speculative_tokens": 1,
    }
    assert (report["budget_bytes"], report["scheduler_pages"], report["total_tokens"]) == (
        40 * GiB,
        41_455,
        10_612_480,
    )
    assert report["unused_bytes"] == 40 * GiB - report["total_bytes"]
    assert report["concurrency"] == {
        "context_tokens": 131_072,
        "max_requests": 81,
        "limiting_group": "v4.c4a.compressed_kv",
    }
    groups = {g["group_id"]: g for g in report["groups"]}
    assert list(groups) == [s.group_id for s in plan.specs]
    c4 = groups["v4.c4a.compressed_kv"]
    assert (c4["pages"], c4["page_bytes"], c4["bytes"]) == (41_584, C4_KV_PAGE, 41_584 * C4_KV_PAGE)
    assert c4["layer_plane_bytes"] == {"kv": 37_440, "indexer": 4_352}
    assert (c4["table_width"], c4["request_pages"], c4["max_requests"]) == (4_097, 513, 81)
    assert groups["v4.swa_kv"]["layers"] == list(range(43))
    assert sum(g["bytes"] for g in report["groups"]) == report["total_bytes"]
    assert abs(sum(g["share"] for g in report["groups"]) - 1) < 1e-12
    assert "concurrency" not in plan.report()
    assert "request_pages" not in plan.report()["groups"][0]


def test_plan_is_frozen_and_returns_copies():
    plan = plan_for_budget(_layout(), 40 * GiB, LIMITS)
    assert isinstance(plan, Plan)
    plan.group_pages["v4.swa_kv"] = 0
    assert plan.group_pages["v4.swa_kv"] == 513
    with pytest.raises(AttributeError):
        plan.total_tokens = 1  # type: ignore[misc]
