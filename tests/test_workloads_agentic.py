"""The agentic workload generator and the wave reordering."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.sim.workloads import (
    AgenticShape,
    LengthDistribution,
    agentic_workload,
    build_workload,
    ideal_hit_tokens,
    in_waves,
    multiturn_workload,
)

SMALL = AgenticShape(
    num_prefixes=2, steps=(2, 4), branch_probability=0.6, branches=(1, 3),
    prefix_lengths=LengthDistribution(600, 0.3, 300, 1200),
)


def _same(a, b):
    return [(r.request_id, r.prompt_token_ids.tolist(), r.output_token_ids.tolist(), r.after_request_id)
            for r in a] == [(r.request_id, r.prompt_token_ids.tolist(), r.output_token_ids.tolist(),
                             r.after_request_id) for r in b]


def test_same_seed_same_requests_other_seed_differs():
    first, again, other = (agentic_workload(6, seed=s, shape=SMALL) for s in (3, 3, 4))
    assert _same(first, again)
    assert not _same(first, other)


def test_sessions_chain_turns_and_branches_leave_the_context():
    requests = agentic_workload(10, seed=1, shape=SMALL)
    by_id = {r.request_id: r for r in requests}
    position = {r.request_id: i for i, r in enumerate(requests)}
    assert len(by_id) == len(requests)
    prefixes = set()
    continued = {r.after_request_id for r in requests if r.after_request_id}
    turns = branches = 0
    for r in requests:
        session, _, tail = r.request_id.partition("-")
        assert r.conversation_id == session
        parent = by_id.get(r.after_request_id) if r.after_request_id else None
        if parent is not None:
            assert position[parent.request_id] < position[r.request_id]  # dispatch order
            context = np.concatenate([parent.prompt_token_ids, parent.output_token_ids])
            assert np.array_equal(r.prompt_token_ids[: context.size], context)
            assert r.prompt_token_ids.size > context.size
        if "branch" in tail:
            branches += 1
            assert r.request_id not in continued  # nobody continues a branch
            turn_id = r.request_id.rsplit("-", 1)[0]
            assert by_id[turn_id].after_request_id == r.after_request_id
        else:
            turns += 1
            assert r.turn == int(tail.removeprefix("step"))
            assert (r.turn == 0) == (parent is None)
        if r.turn == 0:
            prefixes.add(tuple(r.prompt_token_ids[:300].tolist()))
    assert turns >= 2 * 10 and branches > 0
    assert len(prefixes) <= SMALL.num_prefixes  # every session starts with a shared prefix


def test_round_major_order():
    requests = agentic_workload(5, seed=2, shape=SMALL)
    steps = [r.turn for r in requests]
    assert steps == sorted(steps)


def test_a_later_turn_reuses_everything_before_its_new_message():
    requests = agentic_workload(8, seed=5, shape=SMALL)
    by_id = {r.request_id: r for r in requests}
    ideal = dict(zip((r.request_id for r in requests), ideal_hit_tokens(requests)))
    for r in requests:
        if r.after_request_id:
            parent = by_id[r.after_request_id]
            # The parent's prompt and all but its last output token were computed.
            assert ideal[r.request_id] >= parent.prompt_tokens + parent.output_tokens - 1


def test_defaults_and_build_workload_counts():
    assert len(build_workload("agentic", num_requests=37, seed=1)) == 37
    assert len(build_workload("agentic", num_requests=1, seed=1)) == 1
    default = agentic_workload(4, seed=0)
    assert all(1_024 <= r.prompt_tokens for r in default)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_prefixes=0), "num_prefixes"),
        (dict(steps=(0, 2)), r"steps\[0\]"),
        (dict(steps=(3, 2)), r"steps\[1\]"),
        (dict(branches=(2, 1)), r"branches\[1\]"),
        (dict(branch_probability=1.5), "branch_probability"),
        (dict(branch_probability=True), "branch_probability"),
    ],
)
def test_bad_shapes_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AgenticShape(**kwargs)


def test_bad_arguments_refused():
    with pytest.raises(ValueError, match="num_sessions"):
        agentic_workload(0)
    with pytest.raises(ValueError, match="shape"):
        agentic_workload(2, shape={"steps": (1, 2)})


def test_in_waves_interleaves_at_most_that_many_conversations():
    requests = multiturn_workload(5, 3, seed=0, system_prompt_tokens=50)
    waved = in_waves(requests, 2)
    assert sorted(r.request_id for r in waved) == sorted(r.request_id for r in requests)
    order = [r.conversation_id for r in waved]
    # conv0000, conv0001 turn-major, then conv0002, conv0003, then conv0004.
    assert order == ["conv0000", "conv0001"] * 3 + ["conv0002", "conv0003"] * 3 + ["conv0004"] * 3
    assert [r.turn for r in waved[:6]] == [0, 0, 1, 1, 2, 2]
    assert in_waves(requests, 5) == requests
    with pytest.raises(ValueError, match="conversations_per_wave"):
        in_waves(requests, 0)


def test_documented_default_figures():
    # docs/workloads.md quotes these for agentic_workload() on seed 0.
    requests = agentic_workload(seed=0)
    assert len(requests) == 780
    assert sum(r.prompt_tokens for r in requests) == 7_008_630


def test_simulate_runs_the_agentic_workload(capsys):
    import json

    from hybridkv.cli import main

    code = main(["simulate", "--workload", "agentic", "--requests", "12", "--kv-memory", "8GiB",
                 "--max-context", "64k", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests_finished"] == 12 and summary["workload"] == "agentic"
    # Sessions share long prefixes, so some prompt tokens are hits.
    assert 0 < summary["token_hit_rate"] < 1
