"""Bad calls interleaved with good ones: every bad call raises a CacheManagerError naming
what is wrong and leaves the manager exactly as a twin that never saw it.

Random programs (prefix caching, shared prompts, chunked prefill, decode, speculative
verify and rewind, frees) run on two managers; one of them also gets a bad call between
good ones: unknown, freed or duplicate ids, negative, zero, float, NaN, bool or oversized
counts and token ids, wrong shapes, past a request's declared total, the step limit or the
model's context. After each call both managers agree on everything a caller can see
(stats, each request's computed and known tokens and pages, the pools' pages and counters,
the tables, the prefix cache's events) and, in the end, on the batches of the good steps.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.runtime.manager import CacheManagerError
from test_manager import snapshot
from test_prefix import cat, ids, make_manager

CONTEXT_TOKENS = 8192  # make_manager's max_context_tokens
STEP_TOKENS = 1024
SYSTEM = ids(7, 600)


def two_managers():
    options = dict(pages=600, prompt_checkpoints=None, checkpoint_policy="prompt-boundaries",
                   max_step_tokens=STEP_TOKENS)
    return make_manager(**options), make_manager(**options)


def live_ids(m, names):
    return [rid for rid in names if m.has_request(rid)]


# Each bad call: (name, what the message names, call(m, live, freed)); ``live``: ids of live
# requests (at least one), ``freed``: ids freed earlier (maybe none).
BAD_CALLS = [
    ("add a live id again", "already", lambda m, live, freed: m.add_request(live[0], [1, 2, 3])),
    ("add NaN token ids", "integers", lambda m, live, freed: m.add_request("bad", np.array([1.0, np.nan]))),
    ("add float token ids", "integers", lambda m, live, freed: m.add_request("bad", [1.5, 2.0])),
    ("add bool token ids", "integers", lambda m, live, freed: m.add_request("bad", np.array([True, False]))),
    ("add negative token ids", "token ids", lambda m, live, freed: m.add_request("bad", [3, -1])),
    ("add token ids past 2**31", "token ids", lambda m, live, freed: m.add_request("bad", np.array([2**40]))),
    ("add 2-D token ids", "1-D", lambda m, live, freed: m.add_request("bad", np.ones((2, 3), dtype=np.int64))),
    ("add None among token ids", "token ids", lambda m, live, freed: m.add_request("bad", [1, None, 2])),
    ("add a string prompt", "sequence", lambda m, live, freed: m.add_request("bad", "hello")),
    ("add a generator prompt", "one-shot", lambda m, live, freed: m.add_request("bad", (t for t in range(4)))),
    ("add an empty prompt", "prompt", lambda m, live, freed: m.add_request("bad", [])),
    ("add past the context", "max context", lambda m, live, freed: m.add_request(
        "bad", np.zeros(CONTEXT_TOKENS + 1, dtype=np.int32))),
    ("add prompt + max_new past the context", "max context", lambda m, live, freed: m.add_request(
        "bad", [1, 2], max_new_tokens=CONTEXT_TOKENS)),
    ("add negative max_new_tokens", "max_new_tokens", lambda m, live, freed: m.add_request(
        "bad", [1], max_new_tokens=-1)),
    ("add float max_new_tokens", "max_new_tokens", lambda m, live, freed: m.add_request(
        "bad", [1], max_new_tokens=2.5)),
    ("add a NaN max_new_tokens", "max_new_tokens", lambda m, live, freed: m.add_request(
        "bad", [1], max_new_tokens=float("nan"))),
    ("add a huge max_new_tokens", "max context", lambda m, live, freed: m.add_request(
        "bad", [1], max_new_tokens=10**30)),
    ("add a non-str id", "request", lambda m, live, freed: m.add_request(5, [1, 2])),
    ("add an int salt", "cache_salt", lambda m, live, freed: m.add_request("bad", [1, 2], cache_salt=3)),
    ("append to an unknown id", "unknown request", lambda m, live, freed: m.append_token_ids("nope", [1])),
    ("append to a freed id", "unknown request", lambda m, live, freed: m.append_token_ids(
        (freed or ["nope"])[0], [1])),
    ("append NaN", "integers", lambda m, live, freed: m.append_token_ids(live[0], np.array([np.nan]))),
    ("append negative ids", "token ids", lambda m, live, freed: m.append_token_ids(live[0], [-5])),
    ("append ids past 2**31", "token ids", lambda m, live, freed: m.append_token_ids(live[0], [2**31])),
    ("append 2-D ids", "1-D", lambda m, live, freed: m.append_token_ids(live[0], [[1, 2]])),
    ("append past the declared total", "declared total", lambda m, live, freed: m.append_token_ids(
        live[0], np.zeros(CONTEXT_TOKENS, dtype=np.int32))),
    ("append many: wrong shape", "must be", lambda m, live, freed: m.append_token_ids_many(
        live, np.zeros((len(live) + 1, 1), dtype=np.int32))),
    ("append many: 1-D", "must be", lambda m, live, freed: m.append_token_ids_many(
        live, np.zeros(len(live), dtype=np.int32))),
    ("append many: NaN", "integers", lambda m, live, freed: m.append_token_ids_many(
        live, np.full((len(live), 1), np.nan))),
    ("append many: a request twice", "twice", lambda m, live, freed: m.append_token_ids_many(
        [live[0], live[0]], np.zeros((2, 1), dtype=np.int32))),
    ("append many: an unknown id last", "unknown request", lambda m, live, freed: m.append_token_ids_many(
        [*live, "nope"], np.zeros((len(live) + 1, 1), dtype=np.int32))),
    ("append many: past the total", "declared total", lambda m, live, freed: m.append_token_ids_many(
        live, np.zeros((len(live), CONTEXT_TOKENS), dtype=np.int32))),
    ("schedule an unknown id last", "unknown request", lambda m, live, freed: m.schedule(
        [(rid, 1) for rid in live] + [("nope", 1)])),
    ("schedule a freed id", "unknown request", lambda m, live, freed: m.schedule([((freed or ["nope"])[0], 1)])),
    ("schedule a request twice", "twice", lambda m, live, freed: m.schedule([(live[0], 1), (live[0], 1)])),
    ("schedule zero tokens", "token count must be positive", lambda m, live, freed: m.schedule([(live[0], 0)])),
    ("schedule negative tokens", "token count must be positive", lambda m, live, freed: m.schedule([(live[0], -2)])),
    ("schedule zero tokens among ones", "token count must be positive", lambda m, live, freed: m.schedule(
        [(live[0], 0)] + [(rid, 1) for rid in live[1:]], block_tables="updates")),
    ("schedule past the step limit among twos", "limit", lambda m, live, freed: m.schedule(
        [(live[0], STEP_TOKENS + 1)] + [(rid, 2) for rid in live[1:]])),
    ("schedule a float count", "token count must be an int", lambda m, live, freed: m.schedule([(live[0], 1.0)])),
    ("schedule a NaN count", "token count must be an int", lambda m, live, freed: m.schedule([(live[0], float("nan"))])),
    ("schedule a bool count", "token count must be an int", lambda m, live, freed: m.schedule([(live[0], True)])),
    ("schedule past the step limit", "limit", lambda m, live, freed: m.schedule([(live[0], STEP_TOKENS + 1)])),
    ("schedule past the known ids", "known token ids", lambda m, live, freed: m.schedule(
        [(live[0], m.known_token_ids(live[0]).size - m.num_computed_tokens(live[0]) + 1)])),
    ("schedule nothing", "empty", lambda m, live, freed: m.schedule([])),
    ("schedule a malformed item", "each item must be", lambda m, live, freed: m.schedule([(live[0],)])),
    ("schedule a triple after a pair", "each item must be", lambda m, live, freed: m.schedule(
        [(live[0], 1), (live[-1], 1, 5)])),
    ("schedule a pair after a triple", "each item must be", lambda m, live, freed: m.schedule(
        [(live[0], 1, 5), (live[-1], 1)])),
    ("schedule a string", "pairs", lambda m, live, freed: m.schedule("ab")),
    ("schedule_uniform a bad count", "token count must be positive", lambda m, live, freed: m.schedule_uniform(live, 0)),
    ("schedule_uniform an unknown id", "unknown request", lambda m, live, freed: m.schedule_uniform(
        [*live, "nope"], 1)),
    ("rewind forward", "forward", lambda m, live, freed: m.rewind(live[0], CONTEXT_TOKENS)),
    ("rewind negative", "rewind", lambda m, live, freed: m.rewind(live[0], -1)),
    ("rewind a float", "num_tokens", lambda m, live, freed: m.rewind(live[0], 1.0)),
    ("rewind an unknown id", "unknown request", lambda m, live, freed: m.rewind("nope", 0)),
    ("rewind many: one bad among good", "forward", lambda m, live, freed: m.rewind_many(
        [(rid, m.num_computed_tokens(rid)) for rid in live[:-1]] + [(live[-1], CONTEXT_TOKENS)])),
    ("rewind many: a request twice", "twice", lambda m, live, freed: m.rewind_many(
        [(live[0], m.num_computed_tokens(live[0]))] * 2)),
    ("rewind many: None", "pairs", lambda m, live, freed: m.rewind_many(None)),
    ("rewind many: a generator", "pairs", lambda m, live, freed: m.rewind_many((item for item in [(live[0], 0)]))),
    ("free an unknown id", "unknown request", lambda m, live, freed: m.free("nope")),
    ("free a freed id", "unknown request", lambda m, live, freed: m.free((freed or ["nope"])[0])),
    ("free a non-str id", "unknown request", lambda m, live, freed: m.free(None)),
    ("check_admission an unknown id", "unknown request", lambda m, live, freed: _raise_denied(
        m.check_admission([("nope", 1)]))),
    ("max_admissible_tokens of zero", "max_tokens", lambda m, live, freed: m.max_admissible_tokens(live[0], 0)),
    ("max_admissible_tokens of an unknown id", "unknown request", lambda m, live, freed: m.max_admissible_tokens(
        "nope", 4)),
    ("max_admissible_tokens with batch None", "pairs", lambda m, live, freed: m.max_admissible_tokens(
        live[0], 4, batch=None)),
    ("held_outside_pages of an unknown group", "unknown group", lambda m, live, freed: m.held_outside_pages("nope")),
    ("request_pages of an unknown group", "unknown group", lambda m, live, freed: m.request_pages(live[0], "nope")),
    ("release a page not held", "did not hold", lambda m, live, freed: m.release_held_pages(
        np.array([1], dtype=np.int64), np.eye(1, len(m.pools), dtype=np.int64)[0])),
]


def _raise_denied(answers):
    """check_admission answers; an unknown id is a denial with its reason: raise it as one."""
    for answer in answers:
        if not answer.ok:
            raise CacheManagerError(answer.reason)


class Program:
    """The good calls, on both managers at once; the batches they return, compared."""

    def __init__(self, managers):
        self.managers = managers
        self.names: list[str] = []
        self.freed: list[str] = []
        self.prompt_tokens: dict[str, int] = {}
        self.total_tokens: dict[str, int] = {}
        self.n = 0

    def both(self, call):
        return [call(m) for m in self.managers]

    def add(self, own_tokens: int, decode_tokens: int) -> None:
        rid = f"r{self.n}"
        self.n += 1
        prompt = cat(SYSTEM[: 64 * (self.n % 9)], ids(1000 + self.n, own_tokens))
        self.both(lambda m: m.add_request(rid, prompt, max_new_tokens=decode_tokens + 8))
        self.names.append(rid)
        self.prompt_tokens[rid] = prompt.size
        self.total_tokens[rid] = prompt.size + decode_tokens + 8

    def step(self, drafts: int) -> None:
        m0 = self.managers[0]
        items = []
        for rid in live_ids(m0, self.names):
            done, prompt = m0.num_computed_tokens(rid), self.prompt_tokens[rid]
            if done < prompt:
                items.append((rid, min(300, prompt - done)))
                continue
            room = self.total_tokens[rid] - m0.known_token_ids(rid).size
            k = min(1 + drafts, room)
            if k > 0:
                self.both(lambda m: m.append_token_ids(rid, list(range(k))))
                items.append((rid, k))
        if not items:
            return
        batches = self.both(lambda m: m.schedule(items))
        assert batches[0].positions.tolist() == batches[1].positions.tolist()
        for gid, g in batches[0].groups.items():
            assert np.array_equal(g.block_table, batches[1].groups[gid].block_table)
            assert np.array_equal(g.write_slots, batches[1].groups[gid].write_slots)
        rewinds = [(rid, m0.num_computed_tokens(rid) - n + 1) for rid, n in items if n > 1 and
                   m0.num_computed_tokens(rid) > self.prompt_tokens[rid]]  # verify: one draft kept
        if rewinds:
            self.both(lambda m: m.rewind_many(rewinds))

    def free(self, which: int) -> None:
        live = live_ids(self.managers[0], self.names)
        if live:
            rid = live[which % len(live)]
            self.both(lambda m: m.free(rid))
            self.freed.append(rid)


good_call = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 900), st.integers(1, 40)),
    st.tuples(st.just("step"), st.integers(0, 3)),
    st.tuples(st.just("free"), st.integers(0, 7)),
)
bad_call = st.tuples(st.just("bad"), st.integers(0, len(BAD_CALLS) - 1))


def seen(m, names):
    """Everything a caller can see of the manager (``snapshot``, stats, known ids)."""
    rids = live_ids(m, names)
    known = {rid: m.known_token_ids(rid).tolist() for rid in rids}
    return snapshot(m, rids), m.stats(), known, m.num_requests


@settings(max_examples=40)
@given(calls=st.lists(st.one_of(good_call, good_call, bad_call), min_size=1, max_size=30))
def test_bad_calls_raise_and_change_nothing(calls):
    a, b = two_managers()
    program = Program((a, b))
    for call in calls:
        if call[0] == "bad":
            live = live_ids(a, program.names)
            if not live:
                continue
            name, words, bad = BAD_CALLS[call[1]]
            with pytest.raises(CacheManagerError, match=words) as refused:
                bad(a, live, program.freed)
            assert seen(a, program.names) == seen(b, program.names), (name, str(refused.value))
            continue
        getattr(program, call[0])(*call[1:])
        a.check_invariants()
    assert seen(a, program.names) == seen(b, program.names)
    assert a.prefix.drain_events() == b.prefix.drain_events()


def test_an_id_that_is_not_a_str_is_no_request():
    a, _ = two_managers()
    a.add_request("a", [1, 2, 3])
    assert a.has_request("a") and not a.has_request(["a"]) and not a.has_request(None) and not a.has_request(b"a")


@pytest.mark.parametrize("items", [[("a", 1), ("b", 1, 5)], [("a", 1, 5), ("b", 1)], [("a", 1), ("b",)]])
def test_an_item_of_another_length_among_pairs_is_refused(items):
    """A batch that mixes pairs with longer or shorter items is refused whole, naming the bad item,
    and changes nothing (as a batch of only malformed items is)."""
    a, b = two_managers()
    for m in (a, b):
        m.add_request("a", [1, 2, 3, 4]), m.add_request("b", [5, 6, 7, 8])
    bad = next(item for item in items if len(item) != 2)
    with pytest.raises(CacheManagerError, match=f"each item must be .*got {re.escape(repr(bad))}"):
        a.schedule(items)
    assert seen(a, ("a", "b")) == seen(b, ("a", "b"))


@pytest.mark.parametrize("uniform", [False, True])
def test_an_unknown_id_leads_a_refusal_of_many_reasons(uniform):
    """A batch with more bad items than the message lists (three) names the unknown id first, wherever it lies:
    the call is wrong before any request's own state is (the example hypothesis found: three requests past their
    known token ids, the unknown id last)."""
    a, b = two_managers()
    for m in (a, b):
        for seed, rid in enumerate(("r0", "r1", "r2")):
            m.add_request(rid, ids(seed, 65), max_new_tokens=8)
            m.schedule([(rid, 65)])  # every known token computed: one more is past them
    batch = ["r0", "r1", "r2", "nope"]
    with pytest.raises(CacheManagerError, match=r"4 of 4 requests not admissible: unknown request 'nope'; "
                                                r"request 'r0': 65 \+ 1 tokens exceeds the 65 known token ids"):
        a.schedule_uniform(batch, 1) if uniform else a.schedule([(rid, 1) for rid in batch])
    assert seen(a, batch) == seen(b, batch)
