"""transformers' DeepseekV4 on hybridkv's pages against its own cache (the [hf] extra).

Under CI (``CI=true``) the extra must be installed: a missing torch or
transformers fails these tests instead of skipping them."""

import os

import numpy as np
import pytest

if os.environ.get("CI", "").lower() == "true":
    import torch  # noqa: F401  (fail loudly: CI installs .[test,hf])
    import transformers  # noqa: F401
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

from hybridkv.integrations.transformers import PagedEngine, PagedReadError  # noqa: E402
from hybridkv.integrations.transformers.check import (  # noqa: E402
    LOGIT_TOLERANCE,
    own_cache_logits,
    run_transformers_check,
    tiny_model,
)
from hybridkv.models.deepseek_v4 import V4_SWA_KV_GROUP_ID, v4_compressed_kv_group_id  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model(seed=3)


def _tokens(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def test_verify_against_transformers_passes_every_case(monkeypatch, capsys):
    from hybridkv.cli import main
    from hybridkv.integrations.transformers import check

    reports = []
    monkeypatch.setattr(check, "run_transformers_check",
                        lambda **kw: reports.append(run_transformers_check(**kw)) or reports[-1])
    assert main(["verify", "--against", "transformers"]) == 0
    captured = capsys.readouterr()
    assert captured.out.rstrip().endswith("PASS") and "selecting sub-case" in captured.err
    report = reports[0]
    assert report.passed, [c for c in report.checks if not c.passed]
    names = {c.name for c in report.checks}
    for case in ("chunked prefill", "decode", "prefix hit 512", "prefix hit 256", "prefix hit after evictions",
                 "verify 3, accept 1, continue", "batch of >= 3 requests"):
        assert f"paged == own cache: {case}" in names
    everything = next(c for c in report.checks if c.name == "paged == own cache: all tokens")
    assert everything.tokens >= 1500 and everything.max_abs_error <= LOGIT_TOLERANCE
    decode = next(c for c in report.checks if c.name == "paged == own cache: decode")
    assert decode.tokens >= 300


def test_chunked_paged_steps_equal_one_forward_with_the_own_cache(model):
    ids = _tokens(300, seed=1)
    engine = PagedEngine(model, total_tokens=2048, shuffle_seed=4)
    engine.add("r", ids, 4)
    got = []
    for chunk in (3, 125, 130, 42):  # boundaries inside CSA and HCA windows and the 128-token window
        n = engine.computed("r")
        got.append(engine.step([("r", ids[n:n + chunk])])["r"])
    ref = own_cache_logits(model, ids)
    assert float((torch.cat(got) - ref).abs().max()) <= LOGIT_TOLERANCE


def test_a_corrupted_window_page_changes_the_logits(model):
    """The pages really are the cache: flip a stored window row and the next token moves."""
    ids = _tokens(140, seed=2)
    engine = PagedEngine(model, total_tokens=2048, shuffle_seed=4)
    engine.add("r", ids, 4)
    engine.step([("r", ids[:139])])
    base, pages = engine.manager.request_pages("r", V4_SWA_KV_GROUP_ID)
    pool = engine.pools.layers[0].window
    rows_per_page = engine.pools.specs[V4_SWA_KV_GROUP_ID].rows_per_page
    row = 138 % rows_per_page  # the newest row, read by the next token
    view = pool.view(np.float32).reshape(pool.shape[0], rows_per_page, -1)
    view[pages[138 // rows_per_page - base], row, :64] += 1.0
    got = engine.step([("r", ids[139:140])])["r"]
    ref = own_cache_logits(model, ids)[139:140]
    assert float((got - ref).abs().max()) > 1e-3


def test_reading_a_page_the_table_does_not_hold_raises(model):
    ids = _tokens(20, seed=3)
    engine = PagedEngine(model, total_tokens=2048)
    engine.add("r", ids, 4)
    engine.step([("r", ids[:10])])
    batch = engine.manager.schedule([("r", 1)])
    groups = batch.groups
    tables = {gid: (np.full_like(g.block_table[0], -1), 0) for gid, g in groups.items()}
    from transformers import DynamicCache

    from hybridkv.integrations.transformers import materialize
    with pytest.raises(PagedReadError, match=V4_SWA_KV_GROUP_ID):
        materialize(engine.pools, model, DynamicCache(config=model.config), tables, 10, "r")


def test_generate_batches_requests_shares_prefixes_and_matches_the_own_cache(model):
    shared = _tokens(300, seed=5)
    prompts = {"x": shared + _tokens(20, seed=6), "z": _tokens(90, seed=8), "y": shared + _tokens(30, seed=7)}
    engine = PagedEngine(model, total_tokens=2048, shuffle_seed=9)
    out = engine.generate(prompts, max_new_tokens=6, prefill_chunk_tokens=128, max_running=2)
    assert set(out) == set(prompts) and all(len(v) == 6 for v in out.values())
    assert max(engine.stats.hit_tokens) >= 256  # y (admitted when x or z ends) hits x's first 256
    for rid, prompt in prompts.items():  # greedy tokens agree with a plain own-cache greedy loop
        seq = list(prompt)
        for _ in range(6):
            seq.append(int(own_cache_logits(model, seq)[-1].argmax()))
        assert seq[len(prompt):] == out[rid]


def test_generate_preempts_when_a_step_finds_no_pages(model):
    prompts = {f"r{k}": _tokens(200, seed=20 + k) for k in range(4)}
    engine = PagedEngine(model, total_tokens=256, max_running_requests=4, shuffle_seed=1)
    out = engine.generate(prompts, max_new_tokens=3, prefill_chunk_tokens=200, max_running=4)
    assert all(len(v) == 3 for v in out.values())
    assert engine.stats.preemptions > 0
    seq = list(prompts["r3"])
    for _ in range(3):
        seq.append(int(own_cache_logits(model, seq)[-1].argmax()))
    assert seq[200:] == out["r3"]


def test_indexer_keys_live_on_the_compressed_group_pages(model):
    ids = _tokens(64, seed=4)
    engine = PagedEngine(model, total_tokens=2048)
    engine.add("r", ids, 0)
    engine.step([("r", ids)])
    _, pages = engine.manager.request_pages("r", v4_compressed_kv_group_id(4))
    keys = engine.pools.layers[1].index_keys
    assert keys.shape[0] == engine.pools.layers[1].entries.shape[0]
    assert keys[pages[0]].any() and not np.delete(keys, pages, axis=0).any()


def test_verify_against_transformers_without_the_extra_is_a_usage_error(monkeypatch, capsys):
    import sys

    from hybridkv.cli import main

    monkeypatch.setitem(sys.modules, "hybridkv.integrations.transformers.check", None)
    assert main(["verify", "--against", "transformers"]) == 2
    assert "needs the [hf] extra" in capsys.readouterr().err
