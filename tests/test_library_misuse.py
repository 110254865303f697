"""Library misuse through the public API: a clear CacheManagerError / ValueError of the
library's own, and the manager's state left as it was (checked through stats and
the request list)."""

import numpy as np
import pytest

from hybridkv.runtime.manager import CacheManager, CacheManagerError
from hybridkv.models.layout import cache_layout
from hybridkv.plan import Limits, plan_for_budget
from hybridkv.spec import CacheGroupSpec

SWA = CacheGroupSpec("swa", "sliding_window", 4, 1, sliding_window_tokens=8, family="state")
KV = CacheGroupSpec("kv", "full_history", rows_per_page=16, entry_stride_tokens=1)


def _manager(**options):
    return CacheManager([SWA, KV], {"swa": 64, "kv": 64}, max_context_tokens=256, **options)


def _state(m):
    return {gid: (s.used_pages, s.free_pages) for gid, s in m.stats().items()}, m.num_requests


@pytest.mark.parametrize("salt", [123, 1.5, ["a"], object()])
def test_cache_salt_of_the_wrong_type_is_a_cache_manager_error(salt):
    m = _manager(enable_prefix_caching=True)
    before = _state(m)
    with pytest.raises(CacheManagerError, match="cache_salt must be a str, bytes or None"):
        m.add_request("r", [1, 2, 3], cache_salt=salt)
    assert _state(m) == before and not m.has_request("r")


def test_cache_salt_str_and_bytes_are_fine():
    m = _manager(enable_prefix_caching=True)
    m.add_request("a", [1, 2, 3], cache_salt="tenant")
    m.add_request("b", [1, 2, 3], cache_salt=b"tenant")
    assert m.num_requests == 2


@pytest.mark.parametrize(
    "ids, match",
    [
        ((t for t in [1, 2, 3]), "one-shot generator"),
        (iter([1, 2, 3]), "one-shot list_iterator"),
        ("abc", "got a str"),
        (b"\x01\x02", "got a bytes"),
        (7, "got int"),
    ],
)
def test_token_ids_that_are_not_a_sequence_are_refused_clearly(ids, match):
    m = _manager()
    with pytest.raises(CacheManagerError, match=match):
        m.add_request("r", ids)
    m.add_request("r", [1, 2], max_new_tokens=4)
    before = _state(m)
    with pytest.raises(CacheManagerError, match=match):
        m.append_token_ids("r", ids)
    assert _state(m) == before and m.num_requests == 1


def test_append_token_ids_many_with_no_requests():
    m = _manager()
    m.append_token_ids_many([], np.zeros((0, 1), dtype=np.int32))  # nothing to do
    m.append_token_ids_many((), np.zeros((0, 3), dtype=np.int64))
    with pytest.raises(CacheManagerError, match=r"\[0, k\] for no requests, got shape \(2, 1\)"):
        m.append_token_ids_many([], np.zeros((2, 1), dtype=np.int32))


@pytest.mark.parametrize("call", ["check_admission", "schedule"])
@pytest.mark.parametrize("items", [None, "r", 5])
def test_items_that_are_not_a_sequence_get_the_librarys_message(call, items):
    m = _manager()
    m.add_request("r", [1, 2, 3])
    before = _state(m)
    with pytest.raises(CacheManagerError, match=r"items must be a sequence of \(request_id, num_tokens\) pairs"):
        getattr(m, call)(items)
    assert _state(m) == before


@pytest.mark.parametrize("rids", ["ab", b"ab", None])
def test_schedule_uniform_refuses_a_string_of_request_ids(rids):
    m = _manager()
    m.add_request("a", [1, 2, 3])
    m.add_request("b", [1, 2, 3])
    before = _state(m)
    with pytest.raises(CacheManagerError, match="request_ids must be a sequence of request ids"):
        m.schedule_uniform(rids, 1)
    assert _state(m) == before
    m.schedule_uniform(["a", "b"], 1)  # the list form still schedules both


@pytest.mark.parametrize(
    "field, value",
    [("max_context_tokens", 2**70), ("max_context_tokens", 2**31), ("max_running_requests", 2**21),
     ("max_scheduled_tokens", 2**40), ("speculative_tokens", 2**17)],
)
def test_limits_beyond_what_can_be_planned_are_refused_at_construction(field, value):
    values = dict(max_running_requests=8, max_scheduled_tokens=256, max_context_tokens=4096)
    values[field] = value
    with pytest.raises(ValueError, match=f"{field}=.* is beyond"):
        Limits(**values)


def test_limits_at_the_maxima_still_plan():
    layout = cache_layout("deepseek-v4-flash")
    limits = Limits(max_running_requests=1, max_scheduled_tokens=256, max_context_tokens=2**31 - 1)
    plan = plan_for_budget(layout, 40 * 2**30, limits)
    assert plan.table_widths["v4.c4a.compressed_kv"] == -(-(2**31) // 256)


@pytest.mark.parametrize("ragged", [[[1, 2], [3]], [1, [2, 3]]])
def test_a_ragged_nesting_of_token_ids_is_refused_clearly(ragged):
    """numpy refuses to make an array of a ragged nesting with a ValueError of its own; the manager words it."""
    m = _manager(enable_prefix_caching=True)
    m.add_request("r", [1, 2], max_new_tokens=8)
    before = _state(m), m.known_token_ids("r").tolist()
    for call in (lambda: m.add_request("s", ragged), lambda: m.prepare_prompt(ragged),
                 lambda: m.append_token_ids("r", ragged)):
        with pytest.raises(CacheManagerError, match="token ids must be 1-D, got a ragged nesting"):
            call()
    with pytest.raises(CacheManagerError, match=r"token_ids must be \[1, k\] for 1 requests, got a ragged"):
        m.append_token_ids_many(["r"], [ragged])
    assert (_state(m), m.known_token_ids("r").tolist()) == before and not m.has_request("s")


@pytest.mark.parametrize("group", [["swa"], {"swa": 1}])
def test_request_pages_of_a_group_that_is_no_group_id(group):
    m = _manager()
    m.add_request("r", [1, 2, 3])
    with pytest.raises(CacheManagerError, match="unknown group"):
        m.request_pages("r", group)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(table_widths={"swa": 4}), r"table_widths keys \['swa'\] do not match the groups \['swa', 'kv'\]"),
        (dict(table_widths={"swa": 4, "kv": 4, "x": 1}), "do not match the groups"),
        (dict(table_widths={"swa": 4, "kv": 0}), r"table_widths\['kv'\] must be positive, got 0"),
        (dict(table_widths={"swa": 4, "kv": 2.5}), r"table_widths\['kv'\] must be an integer, got 2.5"),
        (dict(shuffle_seed=1.5), "shuffle_seed must be an integer, got 1.5"),
        (dict(shuffle_seed="7"), "shuffle_seed must be an integer, got '7'"),
        (dict(enable_prefix_caching=True, on_event=5), "on_event must be callable"),
        (dict(group_pages={"swa": 64.0, "kv": 64}), "'swa': num_pages must be an integer, got 64.0"),
        (dict(group_pages={"swa": "64", "kv": 64}), "'swa': num_pages must be an integer, got '64'"),
    ],
)
def test_construction_options_of_the_wrong_kind_are_refused_clearly(options, match):
    """Each was taken as is (a width of 0 or 2.5, a float page count) or failed later with a KeyError, a
    TypeError from numpy's seeding, or, for a non-callable on_event, a TypeError inside a step's commit."""
    pages = options.pop("group_pages", {"swa": 64, "kv": 64})
    with pytest.raises(ValueError, match=match):
        CacheManager([SWA, KV], pages, max_context_tokens=256, **options)


def test_a_max_context_whose_block_tables_cannot_be_allocated_says_so():
    """It raised numpy's bare "Unable to allocate 1.3 PiB" before: now the error names what sized the tables.
    A 2**50-token context of 16-token pages is 2**46 cells a row, beyond any machine."""
    with pytest.raises(MemoryError, match=r"block tables for 64 request rows .* set by the max context of "
                                          r"1,125,899,906,842,624 tokens\): lower max_context_tokens"):
        CacheManager([SWA, KV], {"swa": 64, "kv": 64}, max_context_tokens=2**50)


@pytest.mark.parametrize("context_tokens", [2**56, 2**58])
def test_a_max_context_past_what_numpy_can_size_says_so_too(context_tokens):
    """Past about 2**55 tokens numpy refuses the store with a bare ValueError ("array is too big", "Maximum allowed
    dimension exceeded") before it tries to allocate: the error names what sized the tables all the same."""
    with pytest.raises(MemoryError, match=rf"block tables for 64 request rows .* set by the max context of "
                                          rf"{context_tokens:,} tokens\): lower max_context_tokens"):
        CacheManager([SWA, KV], {"swa": 64, "kv": 64}, max_context_tokens=context_tokens)
