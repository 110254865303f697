"""``CacheManager.prepare_prompt``: a prompt checked, copied and hashed when the request arrives, then added.

A request added from a prepared prompt must be the same request as one added from its ids: the same hit,
the same step batches, events and free counts afterwards, and so is each request added from it again after the
one before was freed (whatever that one appended, rewound or committed). A prepared prompt makes one live request
at a time, only in the manager that made it, and a refused one changes nothing.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv import manager as public
from hybridkv.models.deepseek_v4 import build_v4_cache_specs
from hybridkv.prefix.cache import PrefixHit
from hybridkv.runtime.manager import CacheManager, CacheManagerError, PreparedPrompt

SPECS = tuple(build_v4_cache_specs(SimpleNamespace(sliding_window=128), layer_ratio=[0, 4, 128]))
VOCAB = 129_280


def make(pages: int = 600, **options) -> CacheManager:
    return CacheManager(SPECS, {s.group_id: pages for s in SPECS}, max_context_tokens=4096,
                        enable_prefix_caching=options.pop("caching", True), **options)


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n, dtype=np.int32)


def run_out(mgr: CacheManager, rid: str, tokens: int) -> None:
    while (done := mgr.num_computed_tokens(rid)) < tokens:
        mgr.schedule([(rid, min(512, tokens - done))])


def batch_arrays(batch) -> list:
    out = [batch.num_scheduled_tokens, batch.query_start_loc, batch.positions, batch.request_indices]
    for step in batch.groups.values():
        out += [step.block_table, step.base_pages, step.write_slots]
    return [None if a is None else a.tolist() for a in out]


def test_the_public_module_names_it():
    assert public.PreparedPrompt is PreparedPrompt


def test_a_prepared_prompt_hits_what_its_ids_hit():
    ids = prompt(1, 1000)
    for use_prepared in (False, True):
        mgr = make()
        mgr.add_request("a", ids, max_new_tokens=8)
        run_out(mgr, "a", 1000)
        mgr.free("a")
        again = np.concatenate([ids[:700], prompt(2, 50)])
        if use_prepared:
            ready = mgr.prepare_prompt(again, max_new_tokens=4)
            assert (ready.prompt_tokens, ready.total_tokens) == (750, 754)
            hit = mgr.add_request("b", ready)
        else:
            hit = mgr.add_request("b", again, max_new_tokens=4)
        assert hit.hit_tokens == 512  # the 256-token grain below 700 tokens
        np.testing.assert_array_equal(mgr.known_token_ids("b"), again)
        mgr.check_invariants()


def test_a_prepared_prompt_makes_one_live_request_of_its_own_manager_and_a_refusal_changes_nothing():
    mgr, other = make(), make()
    ready = mgr.prepare_prompt(prompt(3, 300), max_new_tokens=2)
    with pytest.raises(CacheManagerError, match="another CacheManager"):
        other.add_request("x", ready)
    for kwargs in (dict(max_new_tokens=1), dict(prompt_tokens=300), dict(cache_salt="s")):
        with pytest.raises(CacheManagerError, match="give them to prepare_prompt"):
            mgr.add_request("x", ready, **kwargs)
    mgr.add_request("taken", prompt(4, 10))
    with pytest.raises(CacheManagerError, match="already exists"):
        mgr.add_request("taken", ready)
    assert not mgr.has_request("x") and mgr.num_requests == 1
    mgr.add_request("x", ready)  # still usable after the refusals above
    with pytest.raises(CacheManagerError, match="request 'x' is live: free it before"):
        mgr.add_request("y", ready)
    assert not mgr.has_request("y") and mgr.num_requests == 2
    mgr.free("x")
    with pytest.raises(CacheManagerError, match="another CacheManager"):
        other.add_request("x", ready)  # freed or not
    assert other.num_requests == 0
    mgr.add_request("y", ready)  # freed: added again, under any id
    np.testing.assert_array_equal(mgr.known_token_ids("y"), prompt(3, 300))
    mgr.check_invariants()


def pools(mgr: CacheManager) -> dict:
    return {g: (s.free_pages, s.used_pages, s.cached_pages) for g, s in mgr.stats().items()}


def test_a_refused_add_of_a_prepared_prompt_changes_nothing():
    """Each refusal (live, another manager's, arguments given, a taken id) leaves the manager as it was: the
    same pools, requests and events, and the next step's batch the same as a twin manager's that was never asked."""
    ids = prompt(11, 700)
    mgrs = make(), make()
    for mgr in mgrs:
        mgr.add_request("a", mgr.prepare_prompt(ids, max_new_tokens=40))
        run_out(mgr, "a", 700)
    mgr, twin = mgrs
    ready = mgr.prepare_prompt(np.concatenate([ids[:600], prompt(12, 30)]), max_new_tokens=8)
    mgr.add_request("b", ready)
    twin.add_request("b", twin.prepare_prompt(np.concatenate([ids[:600], prompt(12, 30)]), max_new_tokens=8))
    refusals = [(lambda: mgr.add_request("c", ready), "is live"),
                (lambda: mgr.add_request("a", ready), "already exists"),
                (lambda: mgr.add_request("c", ready, max_new_tokens=2), "give them to prepare_prompt"),
                (lambda: mgr.add_request("c", twin.prepare_prompt(ids)), "another CacheManager")]
    for call, words in refusals:
        with pytest.raises(CacheManagerError, match=words):
            call()
        assert [mgr.has_request(r) for r in "abc"] == [True, True, False] and mgr.num_requests == 2
        assert pools(mgr) == pools(twin)
        assert [mgr.num_computed_tokens(r) for r in "ab"] == [twin.num_computed_tokens(r) for r in "ab"]
    for m in mgrs:
        m.append_token_ids("a", [5])
    assert batch_arrays(mgr.schedule([("a", 1), ("b", 30)])) == batch_arrays(twin.schedule([("a", 1), ("b", 30)]))
    assert [e.to_json() for e in mgr.prefix.drain_events()] == [e.to_json() for e in twin.prefix.drain_events()]
    mgr.check_invariants()


def test_prepare_prompt_checks_what_add_request_checks():
    mgr = make()
    with pytest.raises(CacheManagerError, match="needs prompt_token_ids"):
        mgr.prepare_prompt(None)
    with pytest.raises(CacheManagerError, match="at least one token"):
        mgr.prepare_prompt(np.zeros(0, dtype=np.int32))
    with pytest.raises(CacheManagerError, match="max context"):
        mgr.prepare_prompt(prompt(5, 4000), max_new_tokens=100)
    with pytest.raises(CacheManagerError):
        mgr.prepare_prompt([1, -2, 3])
    with pytest.raises(CacheManagerError):
        mgr.prepare_prompt([1, 2], cache_salt=5)
    assert mgr.num_requests == 0


def test_without_prefix_caching_a_prepared_prompt_only_carries_the_ids():
    mgr = make(caching=False)
    ids = prompt(6, 40)
    hit = mgr.add_request("a", mgr.prepare_prompt(ids, max_new_tokens=3))
    assert hit.hit_tokens == 0
    np.testing.assert_array_equal(mgr.known_token_ids("a"), ids)
    mgr.schedule([("a", 40)])
    mgr.check_invariants()


STEMS = [prompt(10 + i, 900) for i in range(3)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_prepared_and_plain_adds_give_the_same_programs(data):
    """Two managers run one random program; one adds every request from a prepared prompt."""
    plain, prepared = make(pages=300), make(pages=300)
    live: list[str] = []
    for n in range(data.draw(st.integers(4, 12))):
        rid = f"r{n}"
        stem = STEMS[data.draw(st.integers(0, 2))]
        ids = np.concatenate([stem[: data.draw(st.integers(1, 900))], prompt(100 + n, data.draw(st.integers(1, 40)))])
        salt = data.draw(st.sampled_from([None, "tenant"]))
        want = plain.add_request(rid, ids, max_new_tokens=4, cache_salt=salt)
        got = prepared.add_request(rid, prepared.prepare_prompt(ids, max_new_tokens=4, cache_salt=salt))
        assert (got.hit_tokens, got.group_hit_tokens) == (want.hit_tokens, want.group_hit_tokens)
        live.append(rid)
        while True:
            items = [(r, min(300, len(plain.known_token_ids(r)) - plain.num_computed_tokens(r)) or 1) for r in live]
            try:
                a = plain.schedule(items)
            except CacheManagerError:
                with pytest.raises(CacheManagerError):
                    prepared.schedule(items)
                break
            assert batch_arrays(prepared.schedule(items)) == batch_arrays(a)
            if all(plain.num_computed_tokens(r) >= len(plain.known_token_ids(r)) for r in live):
                break
        if len(live) > 2 or data.draw(st.booleans()):
            gone = live.pop(data.draw(st.integers(0, len(live) - 1)))
            plain.free(gone)
            prepared.free(gone)
        assert {g: s.free_pages for g, s in plain.stats().items()} == \
            {g: s.free_pages for g, s in prepared.stats().items()}
        events = [[e.to_json() for e in m.prefix.drain_events()] for m in (plain, prepared)]
        assert events[0] == events[1]
    prepared.check_invariants()


def test_the_hit_is_a_frozen_prefix_hit_like_one_its_constructor_builds():
    """``match_and_borrow`` fills its PrefixHit's fields without ``__init__``: it must still be the hit that
    ``PrefixCache.match`` (which builds it) finds, frozen."""
    mgr = make()
    stem = prompt(7, 900)
    mgr.add_request("a", stem, max_new_tokens=8)
    run_out(mgr, "a", 900)
    for rid, ids in (("b", np.concatenate([stem[:600], prompt(8, 30)])), ("c", prompt(9, 300))):
        built = mgr.prefix.match(mgr.prefix.prompt_hashes(ids, None), ids)
        hit = mgr.add_request(rid, mgr.prepare_prompt(ids))
        assert type(hit) is PrefixHit and hit == built and repr(hit) == repr(built)
        assert (hit.junction_tokens, hit.limiting_groups) == (built.junction_tokens, built.limiting_groups)
        with pytest.raises(FrozenInstanceError):
            hit.hit_tokens = 1


def check_same(plain: CacheManager, prepared: CacheManager, live: list[str]) -> None:
    assert pools(plain) == pools(prepared)
    for rid in live:
        np.testing.assert_array_equal(prepared.known_token_ids(rid), plain.known_token_ids(rid))
        assert prepared.num_computed_tokens(rid) == plain.num_computed_tokens(rid)
    events = [[e.to_json() for e in m.prefix.drain_events()] for m in (plain, prepared)]
    assert events[0] == events[1]


def same_outcome(plain_call, prepared_call):
    """Both calls return equal results, or both raise CacheManagerError."""
    try:
        want = plain_call()
    except CacheManagerError:
        with pytest.raises(CacheManagerError):
            prepared_call()
        return None
    return want, prepared_call()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_prepared_prompt_added_again_after_free_is_the_request_its_ids_make(data):
    """Two managers run one random program over a few prompts (random stems, salts, output room); one adds each
    prompt's request from its one prepared prompt every time. Between an add and its free a request computes,
    appends ids (completing blocks past the prompt), is rewound: the next add of its prompt must match, schedule,
    publish and free exactly as an add of the ids."""
    plain, prepared = make(pages=300), make(pages=300)
    prompts = []
    for n in range(data.draw(st.integers(2, 4))):
        stem = STEMS[data.draw(st.integers(0, 2))]
        ids = np.concatenate([stem[: data.draw(st.integers(1, 900))], prompt(200 + n, data.draw(st.integers(1, 300)))])
        salt, room = data.draw(st.sampled_from([None, "tenant", b"x"])), data.draw(st.integers(0, 600))
        prompts.append((ids, room, salt, prepared.prepare_prompt(ids, max_new_tokens=room, cache_salt=salt)))
    live: dict[str, int] = {}  # request id -> its prompt
    adds = 0
    for _ in range(data.draw(st.integers(10, 40))):
        action = data.draw(st.sampled_from(["add", "step", "step", "append", "append", "rewind", "free"]))
        if action == "add" or not live:
            p = data.draw(st.integers(0, len(prompts) - 1))
            if p in live.values():
                with pytest.raises(CacheManagerError, match="is live"):
                    prepared.add_request(f"x{adds}", prompts[p][3])
                continue
            ids, room, salt, ready = prompts[p]
            rid, adds = f"r{adds}", adds + 1
            got = same_outcome(lambda: plain.add_request(rid, ids, max_new_tokens=room, cache_salt=salt),
                               lambda: prepared.add_request(rid, ready))
            assert got is not None
            assert got[1] == got[0]
            live[rid] = p
        elif action == "step":
            for _ in range(data.draw(st.integers(1, 4))):
                items = [(r, min(300, len(plain.known_token_ids(r)) - plain.num_computed_tokens(r))) for r in live]
                items = [item for item in items if item[1]]
                got = same_outcome(lambda: plain.schedule(items), lambda: prepared.schedule(items)) if items else None
                if got is None:
                    break
                assert batch_arrays(got[1]) == batch_arrays(got[0])
        else:
            rid = data.draw(st.sampled_from(sorted(live)))
            if action == "append":
                new = prompt(adds * 31 + len(plain.known_token_ids(rid)), data.draw(st.integers(1, 300)))
                same_outcome(lambda: plain.append_token_ids(rid, new), lambda: prepared.append_token_ids(rid, new))
            elif action == "rewind":
                keep = max(0, plain.num_computed_tokens(rid) - data.draw(st.integers(0, 300)))
                same_outcome(lambda: plain.rewind(rid, keep), lambda: prepared.rewind(rid, keep))
            else:
                plain.free(rid)
                prepared.free(rid)
                del live[rid]
        check_same(plain, prepared, list(live))
    prepared.check_invariants()


def test_ids_appended_before_a_free_leave_the_prompt_s_next_request_alone():
    """A request appends ids that complete a block past its prompt (hashed by the append), is rewound into that
    block and freed; the prompt's next request appends other ids there: it publishes their block, not the first's."""
    ids = prompt(13, 300)
    plain, prepared = make(), make()
    ready = prepared.prepare_prompt(ids, max_new_tokens=600)
    for life in range(3):
        rid = f"r{life}"
        hits = plain.add_request(rid, ids, max_new_tokens=600), prepared.add_request(rid, ready)
        assert hits[0] == hits[1]
        for m in (plain, prepared):
            m.append_token_ids(rid, prompt(20 + life, 400))  # ids past the prompt complete the block at 512
            run_out(m, rid, 520)
            m.rewind(rid, 520 - life)
            m.free(rid)
        check_same(plain, prepared, [])
    prepared.check_invariants()
