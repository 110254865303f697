"""Workload generators, the JSONL trace format and the ideal-hit bound."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.sim.workloads import (
    DEFAULT_VOCAB_SIZE,
    LengthDistribution,
    Request,
    TraceFormatError,
    build_workload,
    chat_workload,
    dump_jsonl_trace,
    ideal_hit_tokens,
    load_jsonl_trace,
    longctx_workload,
    multiturn_workload,
    parse_jsonl_trace,
    trace_lines,
)


def _req(request_id, prompt, outputs, **kw):
    return Request(
        request_id=request_id,
        arrival_step=kw.pop("arrival_step", 0),
        prompt_token_ids=np.asarray(prompt),
        output_tokens=len(outputs),
        output_token_ids=np.asarray(outputs),
        **kw,
    )


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: chat_workload(40, seed=seed, arrival_rate_per_step=0.5),
        lambda seed: multiturn_workload(4, 3, seed=seed, system_prompt_tokens=100),
        lambda seed: longctx_workload(3, seed=seed, max_prompt_tokens=65_536),
    ],
    ids=["chat", "multiturn", "longctx"],
)
def test_same_seed_same_requests_other_seed_differs(make):
    first, again, other = make(7), make(7), make(8)
    assert first == again
    assert all(a is not b for a, b in zip(first, again))
    assert len(first) == len(other)
    assert not any(
        np.array_equal(a.prompt_token_ids, b.prompt_token_ids) for a, b in zip(first, other)
    )
    assert not any(
        np.array_equal(a.output_token_ids, b.output_token_ids) for a, b in zip(first, other)
    )


def test_chat_requests_are_well_formed():
    requests = chat_workload(300, seed=1)
    assert [r.request_id for r in requests] == [f"chat-{i:05d}" for i in range(300)]
    assert all(r.arrival_step == 0 and r.after_request_id is None for r in requests)
    for r in requests:
        assert r.prompt_token_ids.dtype == np.int32
        assert 32 <= r.prompt_tokens <= 32_768
        assert 8 <= r.output_tokens <= 4_096 and r.output_token_ids.size == r.output_tokens
        assert r.prompt_token_ids.min() >= 0 and r.prompt_token_ids.max() < DEFAULT_VOCAB_SIZE
    # Lengths really vary (lognormal, not constant) and ids are not all alike.
    assert len({r.prompt_tokens for r in requests}) > 100
    assert len(np.unique(requests[0].prompt_token_ids)) > requests[0].prompt_tokens // 2


def test_poisson_arrivals_are_sorted_and_match_rate():
    requests = chat_workload(2_000, seed=3, arrival_rate_per_step=0.25)
    steps = np.array([r.arrival_step for r in requests])
    assert np.all(np.diff(steps) >= 0)
    # 2,000 arrivals at 0.25/step span about 8,000 steps (Poisson: sd ~ 180).
    assert 7_200 < steps[-1] < 8_800


# --------------------------------------------------------------------------- lengths


def test_lognormal_lengths_are_clipped_to_both_bounds():
    wide = LengthDistribution(median_tokens=100, sigma=5.0, min_tokens=10, max_tokens=50)
    lengths = wide.sample(np.random.default_rng(0), 2_000)
    assert lengths.min() == 10 and lengths.max() == 50
    assert lengths.dtype == np.int64


def test_lognormal_without_spread_gives_the_rounded_median():
    fixed = LengthDistribution(median_tokens=100.4, sigma=0.0, min_tokens=1, max_tokens=1_000)
    assert fixed.sample(np.random.default_rng(0), 5).tolist() == [100] * 5


def test_lognormal_median_and_spread():
    dist = LengthDistribution(median_tokens=1_000, sigma=0.5, min_tokens=1, max_tokens=10**9)
    lengths = dist.sample(np.random.default_rng(0), 20_000)
    assert 960 < np.median(lengths) < 1_040
    # sd of log-length is sigma.
    assert 0.48 < np.log(lengths).std() < 0.52


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(median_tokens=0, sigma=1.0, min_tokens=1, max_tokens=2), "median_tokens"),
        (dict(median_tokens=5, sigma=-1.0, min_tokens=1, max_tokens=2), "sigma"),
        (dict(median_tokens=5, sigma=1.0, min_tokens=0, max_tokens=2), "min_tokens"),
        (dict(median_tokens=5, sigma=1.0, min_tokens=3, max_tokens=2), "max_tokens"),
    ],
)
def test_length_distribution_rejects_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LengthDistribution(**kwargs)


# --------------------------------------------------------------------------- multiturn


def test_multiturn_default_shape_and_prefix_property():
    requests = multiturn_workload(seed=0)
    assert len(requests) == 128
    by_id = {r.request_id: r for r in requests}
    position = {r.request_id: i for i, r in enumerate(requests)}
    system = requests[0].prompt_token_ids[:2_000]
    # Turn-major order.
    assert [r.turn for r in requests] == [t for t in range(4) for _ in range(32)]
    for r in requests:
        assert np.array_equal(r.prompt_token_ids[:2_000], system)
        assert r.conversation_id == r.request_id.split("-")[0]
        if r.turn == 0:
            assert r.after_request_id is None
            assert r.prompt_tokens > 2_000
            continue
        prev = by_id[r.after_request_id]
        assert position[prev.request_id] < position[r.request_id]
        assert (prev.conversation_id, prev.turn) == (r.conversation_id, r.turn - 1)
        context = prev.prompt_tokens + prev.output_tokens
        assert np.array_equal(r.prompt_token_ids[: prev.prompt_tokens], prev.prompt_token_ids)
        assert np.array_equal(
            r.prompt_token_ids[prev.prompt_tokens : context], prev.output_token_ids
        )
        assert r.prompt_tokens - context >= 32  # a new user message follows
    # Conversations diverge right after the system prompt.
    firsts = [r.prompt_token_ids[2_000] for r in requests[:32]]
    assert len(set(firsts)) > 28


@given(
    conversations=st.integers(1, 4),
    turns=st.integers(1, 4),
    system_tokens=st.integers(0, 40),
    seed=st.integers(0, 2**32),
)
def test_multiturn_ideal_hits_are_prompt_plus_answer(conversations, turns, system_tokens, seed):
    short = LengthDistribution(median_tokens=6, sigma=0.5, min_tokens=2, max_tokens=12)
    requests = multiturn_workload(
        conversations,
        turns,
        seed=seed,
        system_prompt_tokens=system_tokens,
        user_message_lengths=short,
        answer_lengths=short,
        vocab_size=1_000_000,  # distinct ids: no accidental longer matches
    )
    by_id = {r.request_id: r for r in requests}
    hits = ideal_hit_tokens(requests)
    for hit, r in zip(hits, requests):
        if r.turn == 0:
            # Conversation 0 finds nothing; the others find the system prompt.
            expected = 0 if r.conversation_id == "conv0000" else system_tokens
        else:
            prev = by_id[r.after_request_id]
            expected = prev.prompt_tokens + prev.output_tokens - 1  # last answer id has no KV
            assert np.array_equal(
                r.prompt_token_ids[: prev.prompt_tokens + prev.output_tokens],
                np.concatenate([prev.prompt_token_ids, prev.output_token_ids]),
            )
        assert hit == expected


# --------------------------------------------------------------------------- long context


def test_longctx_lengths_and_context_cap():
    requests = longctx_workload(seed=0)
    assert len(requests) == 8
    for r in requests:
        assert 32_768 <= r.prompt_tokens <= 1_048_576
        assert r.prompt_tokens + r.output_tokens <= 1_048_576
    capped = longctx_workload(
        30,
        seed=0,
        min_prompt_tokens=100,
        max_prompt_tokens=1_000,
        output_lengths=LengthDistribution(50, 0.0, 1, 50),
        max_context_tokens=600,
    )
    lengths = [r.prompt_tokens for r in capped]
    assert min(lengths) >= 100 and max(lengths) == 550
    assert all(r.output_tokens == 50 for r in capped)


def test_generators_reject_bad_arguments():
    with pytest.raises(ValueError, match="num_requests"):
        chat_workload(0)
    with pytest.raises(ValueError, match="arrival_rate_per_step"):
        chat_workload(3, arrival_rate_per_step=0.0)
    with pytest.raises(ValueError, match="turns"):
        multiturn_workload(2, 0)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        longctx_workload(2, min_prompt_tokens=10, max_prompt_tokens=5)
    with pytest.raises(ValueError, match="vocab_size"):
        chat_workload(3, vocab_size=1)


# --------------------------------------------------------------------------- Request


def test_request_stores_read_only_int32_copies():
    prompt = np.array([5, 6, 7], dtype=np.int64)
    r = _req("a", prompt, [1, 2])
    prompt[0] = 99
    assert r.prompt_token_ids.tolist() == [5, 6, 7]
    assert r.prompt_token_ids.dtype == np.int32 and r.output_token_ids.dtype == np.int32
    with pytest.raises(ValueError):
        r.prompt_token_ids[0] = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.request_id = "b"  # type: ignore[misc]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(request_id=""), "request_id"),
        (dict(arrival_step=-1), "arrival_step"),
        (dict(arrival_step=1.5), "arrival_step"),
        (dict(prompt_token_ids=np.array([], dtype=np.int32)), "empty"),
        (dict(prompt_token_ids=np.array([1.0, 2.0])), "integers"),
        (dict(prompt_token_ids=np.array([1, -2])), r"\[0, "),
        (dict(prompt_token_ids=np.array([[1, 2]])), "1-D"),
        (dict(output_tokens=0), "output_tokens"),
        (dict(output_tokens=3), "has 2 ids"),
        (dict(turn=-1), "turn"),
        (dict(conversation_id=""), "conversation_id"),
        (dict(after_request_id="a"), "itself"),
    ],
)
def test_request_rejects_bad_fields(change, message):
    fields = dict(
        request_id="a",
        arrival_step=0,
        prompt_token_ids=np.array([1, 2, 3]),
        output_tokens=2,
        output_token_ids=np.array([4, 5]),
    )
    fields.update(change)
    with pytest.raises(ValueError, match=message):
        Request(**fields)


# --------------------------------------------------------------------------- ideal hits


def test_ideal_hit_tokens_by_hand():
    requests = [
        _req("a", [1, 2, 3, 4], [5, 6]),  # cached afterwards: 1 2 3 4 5
        _req("b", [1, 2, 3, 4, 5, 6, 7], [8]),  # shares 1..5 with a (6 has no KV)
        _req("c", [1, 2], [3]),  # shares 2, capped at prompt - 1 = 1
        _req("d", [9, 9, 9], [1]),
        _req("e", [1, 2, 3, 9], [1]),  # best is 3 (a, b or c's cached 1 2)
    ]
    assert ideal_hit_tokens(requests).tolist() == [0, 5, 1, 0, 3]
    assert ideal_hit_tokens(requests, grain_tokens=2).tolist() == [0, 4, 0, 0, 2]
    with pytest.raises(ValueError, match="grain_tokens"):
        ideal_hit_tokens(requests, grain_tokens=0)


# --------------------------------------------------------------------------- JSONL traces


def test_trace_round_trip_through_a_file(tmp_path):
    requests = multiturn_workload(3, 3, seed=5, system_prompt_tokens=50)
    path = tmp_path / "trace.jsonl"
    dump_jsonl_trace(requests, path)
    assert len(path.read_text().splitlines()) == 9
    loaded = load_jsonl_trace(path)
    assert loaded == requests


def test_trace_round_trip_keeps_arrivals_and_chat_fields():
    requests = chat_workload(20, seed=2, arrival_rate_per_step=0.1)
    assert parse_jsonl_trace(trace_lines(requests), seed=99) == requests


def test_trace_generated_ids_shared_prefixes_and_defaults():
    lines = [
        json.dumps({"arrival": 0, "prompt_tokens": 30, "prefix_id": "sys", "prefix_tokens": 10, "output_tokens": 4}),
        "",
        json.dumps({"arrival": 1.5, "prompt_tokens": 25, "prefix_id": "sys", "prefix_tokens": 20, "output_tokens": 2, "request_id": "x", "after": "line-1"}),
        json.dumps({"arrival": 2, "prompt_tokens": 20, "prefix_id": 7, "prefix_tokens": 20, "output_tokens": 1}),
        json.dumps({"arrival": 2, "prompt_tokens": 20, "prefix_id": "7", "prefix_tokens": 20, "output_tokens": 1}),
        json.dumps({"arrival": 3, "prompt_token_ids": [1, 2, 3], "output_tokens": 1}),
    ]
    a, x, int7, str7, explicit = parse_jsonl_trace(lines, seed=4, arrival_steps_per_unit=10)
    assert [r.request_id for r in (a, x, int7, str7, explicit)] == [
        "line-1", "x", "line-4", "line-5", "line-6"
    ]
    assert [r.arrival_step for r in (a, x, int7, str7, explicit)] == [0, 15, 20, 20, 30]
    assert x.after_request_id == "line-1"
    assert a.prompt_tokens == 30 and x.prompt_tokens == 25 and a.output_tokens == 4
    # Same prefix id: the first 10 ids agree; the suffix does not.
    assert np.array_equal(a.prompt_token_ids[:10], x.prompt_token_ids[:10])
    assert not np.array_equal(a.prompt_token_ids[10:20], x.prompt_token_ids[10:20])
    # 7 and "7" are different prefix ids.
    assert not np.array_equal(int7.prompt_token_ids, str7.prompt_token_ids)
    assert explicit.prompt_token_ids.tolist() == [1, 2, 3]
    # Prefix ids depend on (seed, prefix_id) only, not on the other lines.
    alone_obj = {k: v for k, v in json.loads(lines[2]).items() if k != "after"}
    alone = parse_jsonl_trace([json.dumps(alone_obj)], seed=4)[0]
    assert np.array_equal(alone.prompt_token_ids[:20], x.prompt_token_ids[:20])
    again = parse_jsonl_trace(lines, seed=4, arrival_steps_per_unit=10)
    assert again == [a, x, int7, str7, explicit]
    other = parse_jsonl_trace(lines, seed=5, arrival_steps_per_unit=10)
    assert not np.array_equal(other[0].prompt_token_ids, a.prompt_token_ids)


GOOD = {"arrival": 0, "prompt_tokens": 8, "output_tokens": 2, "request_id": "r1"}


def _with(**change):
    obj = {**GOOD, "request_id": "r2"}
    for key, value in change.items():
        if value is _DROP:
            obj.pop(key, None)
        else:
            obj[key] = value
    return json.dumps(obj)


_DROP = object()


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (_with(prompt_len=3), "unknown key"),
        (_with(arrival=_DROP), "missing required key 'arrival'"),
        (_with(output_tokens=_DROP), "missing required key 'output_tokens'"),
        (_with(arrival="0"), "'arrival' must be a number"),
        (_with(arrival=True), "'arrival' must be a number"),
        (_with(arrival=-1), "'arrival' must be finite and >= 0"),
        ('{"arrival": NaN, "prompt_tokens": 8, "output_tokens": 2}', "finite"),
        (_with(prompt_tokens=_DROP), "exactly one of"),
        (_with(prompt_token_ids=[1, 2]), "exactly one of"),
        (_with(prompt_tokens=0), "'prompt_tokens' must be a positive int"),
        (_with(prompt_tokens=2.0), "'prompt_tokens' must be a positive int"),
        (_with(prompt_tokens=_DROP, prompt_token_ids=[]), "non-empty list"),
        (_with(prompt_tokens=_DROP, prompt_token_ids=[1, -1]), "ints in"),
        (_with(prompt_tokens=_DROP, prompt_token_ids=[1, DEFAULT_VOCAB_SIZE]), "ints in"),
        (_with(prompt_tokens=_DROP, prompt_token_ids=[1, True]), "ints in"),
        (_with(prefix_id="s"), "go together"),
        (_with(prefix_tokens=3), "go together"),
        (_with(prompt_tokens=_DROP, prompt_token_ids=[1], prefix_id="s", prefix_tokens=1), "applies to"),
        (_with(prefix_id=1.5, prefix_tokens=3), "'prefix_id' must be"),
        (_with(prefix_id="", prefix_tokens=3), "'prefix_id' must be"),
        (_with(prefix_id="s", prefix_tokens=0), "'prefix_tokens' must be a positive int"),
        (_with(prefix_id="s", prefix_tokens=9), "exceeds 'prompt_tokens'"),
        (_with(output_tokens=0), "'output_tokens' must be a positive int"),
        (_with(output_token_ids=[1, 2, 3]), "has 3 ids"),
        (_with(output_token_ids=[1, "2"]), "ints in"),
        (_with(request_id=""), "'request_id' must be a non-empty string"),
        (_with(request_id="r1"), "duplicate request_id 'r1' \\(first on line 1\\)"),
        (_with(after="r2"), "cannot wait for itself"),
        (_with(after="r9"), "no earlier line defines"),
        (_with(after=3), "'after' must be a non-empty string"),
        (_with(turn=-1), "'turn' must be an int >= 0"),
        (_with(conversation_id=5), "'conversation_id' must be a non-empty string"),
    ],
)
def test_trace_bad_line_names_its_line(line, message):
    with pytest.raises(TraceFormatError, match=message) as info:
        parse_jsonl_trace([json.dumps(GOOD), line])
    assert str(info.value).startswith("line 2: ")


def test_trace_after_must_point_backwards():
    later = {**GOOD, "after": "r2"}
    with pytest.raises(TraceFormatError, match="line 1: 'after' names 'r2'"):
        parse_jsonl_trace([json.dumps(later), json.dumps({**GOOD, "request_id": "r2"})])


def test_trace_file_errors_name_the_path(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + '{"arrival": 0}\n')
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl: line 3: missing required key"):
        load_jsonl_trace(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_jsonl_trace(empty)
    with pytest.raises(ValueError, match="arrival_steps_per_unit"):
        parse_jsonl_trace([json.dumps(GOOD)], arrival_steps_per_unit=0)


# --------------------------------------------------------------------------- build_workload


def test_build_workload_by_name_and_path(tmp_path):
    assert len(build_workload("chat", num_requests=5)) == 5
    assert build_workload("chat", num_requests=5, seed=1) == chat_workload(5, seed=1)
    assert len(build_workload("longctx", num_requests=2)) == 2
    assert len(build_workload("multiturn")) == 128
    cut = build_workload("multiturn", num_requests=10)
    assert len(cut) == 10
    assert {r.conversation_id for r in cut} == {"conv0000", "conv0001", "conv0002"}
    known = set()
    for r in cut:  # every dependency survives the cut and comes first
        assert r.after_request_id is None or r.after_request_id in known
        known.add(r.request_id)
    path = tmp_path / "t.jsonl"
    dump_jsonl_trace(cut, path)
    assert build_workload(str(path)) == cut
    assert build_workload(str(path), num_requests=4) == cut[:4]
    with pytest.raises(ValueError, match="chat"):
        build_workload("nope")
    with pytest.raises(ValueError, match="num_requests"):
        build_workload("chat", num_requests=0)
