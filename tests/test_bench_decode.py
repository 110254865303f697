"""bench/vs_vllm's decode and serving phases, driven on the hybridkv side alone (no vLLM)."""

import numpy as np
import pytest


class _Recording:
    """A side that records what the phases ask of it, and checks after every step that
    the manager's computed tokens (public ``num_computed_tokens``) match the handles'."""

    def __init__(self, side):
        self._side = side
        self.steps = []  # per step: dict(frees, joins, items, appended)
        self.appended = {}  # request id -> token ids appended so far
        self._pending = dict(frees=[], joins=[])

    def __getattr__(self, name):
        return getattr(self._side, name)

    def free(self, request):
        self._pending["frees"].append(request.request_id)
        return self._side.free(request)

    def probe_hit(self, request):
        self._pending["joins"].append(request.request_id)
        return self._side.probe_hit(request)

    def allocate(self, request, num_new_tokens):
        self._pending = dict(frees=[], joins=[])  # a set-up step (one request), not a timed one
        return self._side.allocate(request, num_new_tokens)

    def _record(self, items):
        self.steps.append(dict(self._pending, items=items, appended=[]))
        self._pending = dict(frees=[], joins=[])
        for request, _ in items:
            assert self._side.manager.num_computed_tokens(request.request_id) == request.computed_tokens

    def schedule_step(self, items):
        ok = self._side.schedule_step(items)
        self._record([(r, n) for r, n in items])
        return ok

    def decode_step(self, requests):
        ok = self._side.decode_step(requests)
        self._record([(r, 1) for r in requests])
        return ok

    def append_tokens(self, request, token_ids):
        self.appended.setdefault(request.request_id, []).extend(int(t) for t in token_ids)
        return self._side.append_tokens(request, token_ids)

    def append_many(self, requests, token_ids):
        for request, token in zip(requests, token_ids):
            self.appended.setdefault(request.request_id, []).append(int(token))
        if self.steps:
            self.steps[-1]["appended"] = [r.request_id for r in requests]
        return self._side.append_many(requests, token_ids)


def _side(vs, running):
    return vs.sides.HybridkvSide(kv_memory_bytes=4 * 2**30, max_model_len=131072, max_num_batched_tokens=1024,
                                 max_num_seqs=running)


SMALL = dict(prompt_tokens=(64, 512), output_tokens=(12, 40), prefix_tokens=32, num_prefixes=2)


def test_decode_phase_schedules_the_whole_batch_each_step(vs):
    """Every timed step schedules every request once, in workload order, and only
    those get a token appended after it; two rounds run on one set-up."""
    shape = vs.workload.ServingShape(**SMALL)
    side = _Recording(_side(vs, 8))
    out = vs.decode.measure_decode({"hybridkv": side}, running=8, steps=5, rounds=2, chunk_tokens=1024,
                                   shape=shape, seed=0)
    ids = [r.request_id for r in vs.workload.serving_requests(8, seed=0, shape=shape, prefix="dec")]
    timed = side.steps[-10:]
    for step in timed:
        assert [r.request_id for r, _ in step["items"]] == ids
        assert all(n == 1 for _, n in step["items"])
        assert step["appended"] == ids
    result = out["hybridkv"]
    assert out["rounds"] == 2 and out["steps_per_round"] == 5 and "ratio" not in out
    assert len(result["rounds_us_per_step_mean"]) == 2
    assert 0 < result["us_per_step_p50"] <= result["us_per_step_p99"]
    assert result["us_per_request_step"] == pytest.approx(result["us_per_step_mean"] / 8)
    assert side.manager.num_requests == 0  # every request freed after the phase


def test_serving_phase_keeps_running_with_a_finish_and_a_join_every_step(vs):
    shape = vs.workload.ServingShape(**SMALL)
    side = _Recording(_side(vs, 6))
    out = vs.serving.measure_serving({"hybridkv": side}, running=6, steps=4, rounds=1, step_tokens=300,
                                     chunk_tokens=128, shape=shape, seed=1)
    stream = {r.request_id: r for r in vs.workload.serving_requests(6 + 4, seed=1, shape=shape)}
    timed = side.steps[-4:]
    joined = [rid for step in timed for rid in step["joins"]]
    assert joined == [f"srv-{i:06d}" for i in range(6, 10)]  # arrivals in stream order
    running = set(list(stream)[:6])
    for step in timed:
        assert len(step["frees"]) == 1 and len(step["joins"]) == 1
        for rid in step["frees"]:  # a request leaves once it sampled its whole output
            assert side.appended[rid] == stream[rid].output_ids.tolist()
        running = (running - set(step["frees"])) | set(step["joins"])
        assert {r.request_id for r, _ in step["items"]} <= running and len(running) == 6
        counts = [n for _, n in step["items"]]
        decoding = [n for n in counts if n == 1]
        assert counts[: len(decoding)] == decoding  # decodes first, then prefill chunks
        assert all(n <= 128 for n in counts) and sum(counts) <= 300
    result = out["hybridkv"]
    assert out["finishes_per_step"] == 1 and result["finished"] == 4 and result["joined"] == 4
    assert result["finished_per_step_min"] == 1
    assert side.manager.num_requests == 0


def test_serving_phase_caps_its_steps_at_the_finishes_the_running_requests_supply(vs):
    shape = vs.workload.ServingShape(**SMALL)
    out = vs.serving.measure_serving({"hybridkv": _side(vs, 3)}, running=3, steps=10, rounds=1, step_tokens=300,
                                     chunk_tokens=128, shape=shape, seed=2)
    assert out["steps_per_round"] == 3


def test_serving_driver_refuses_a_step_budget_below_the_running_requests(vs):
    with pytest.raises(ValueError, match="step_tokens"):
        vs.serving.ServingDriver(_side(vs, 8), [], running=8, step_tokens=8, chunk_tokens=4)


def test_appended_tokens_are_the_stream_outputs(vs):
    """Both sides "sample" the stream's output ids, in order."""
    shape = vs.workload.ServingShape(**SMALL)
    side = _Recording(_side(vs, 4))
    vs.serving.measure_serving({"hybridkv": side}, running=4, steps=3, rounds=1, step_tokens=300,
                               chunk_tokens=128, shape=shape, seed=3)
    stream = {r.request_id: r for r in vs.workload.serving_requests(4 + 3, seed=3, shape=shape)}
    for rid, tokens in side.appended.items():
        assert tokens == stream[rid].output_ids[: len(tokens)].tolist()
        assert np.asarray(tokens).size <= stream[rid].output_tokens


def test_hybridkv_side_plans_its_own_page_space(vs):
    """A budget too small for per-group pools at this many running requests still builds the side on the
    shared arena (its default), as ``plan_for_budget(page_space="shared")`` allows; per-group refuses it."""
    options = dict(kv_memory_bytes=2 * 2**30, max_model_len=131072, max_num_batched_tokens=1024, max_num_seqs=512)
    side = vs.sides.HybridkvSide(**options)
    assert side.manager.arena is not None and not side.plan.fits_per_group
    with pytest.raises(ValueError, match="too small"):
        vs.sides.HybridkvSide(**options, page_space="per-group")


def test_serving_phase_with_a_filled_cache_evicts_in_its_steps(vs):
    """``fill_tokens`` leaves the cache holding distinct freed prompts after each reset, so the timed
    steps' allocations evict cached pages; without it the same steps evict nothing."""
    shape = vs.workload.ServingShape(**SMALL)
    options = dict(running=6, steps=4, rounds=1, step_tokens=300, chunk_tokens=128, shape=shape, seed=1)
    evicted = {}
    for fill in (0, 1_200_000):
        side = _side(vs, 6)
        filled = vs.serving.fill_prefix_cache(side, fill, chunk_tokens=1024, seed=1) if fill else 0
        assert filled == -(-fill // vs.serving.FILL_PROMPT_TOKENS) and side.manager.num_requests == 0
        cached = sum(s.cached_pages for s in side.manager.stats().values())
        assert (cached > 0) == bool(fill)
        before = sum(s.evicted_pages for s in side.manager.stats().values())
        vs.serving.measure_serving({"hybridkv": side}, fill_tokens=fill, **options)
        evicted[fill] = sum(s.evicted_pages for s in side.manager.stats().values()) - before
    assert evicted[0] == 0 < evicted[1_200_000]


def test_decode_call_pairs_schedules_each_step_through_schedule(vs):
    """``decode_call="pairs"`` (``--decode-call pairs``): each timed step is one ``schedule`` of (id, 1) pairs,
    not ``schedule_uniform``, and the requests end where the uniform calls leave them."""
    shape = vs.workload.ServingShape(**SMALL)
    ends = {}
    for call in ("uniform", "pairs"):
        side = _side(vs, 6)
        side.decode_call = call
        calls = {"schedule": 0, "schedule_uniform": 0}
        for name in calls:
            method = getattr(side.manager, name)

            def counted(*args, _method=method, _name=name, **kwargs):
                calls[_name] += 1
                return _method(*args, **kwargs)
            setattr(side.manager, name, counted)
        vs.decode.measure_decode({"hybridkv": side}, running=6, steps=4, rounds=2, chunk_tokens=1024,
                                 shape=shape, seed=0)
        ends[call] = side.manager.stats(), calls
    (uniform_stats, uniform_calls), (pairs_stats, pairs_calls) = ends["uniform"], ends["pairs"]
    assert uniform_calls["schedule_uniform"] == 8 and pairs_calls["schedule_uniform"] == 0  # 2 rounds of 4 steps
    assert pairs_calls["schedule"] == uniform_calls["schedule"] + 8  # the set-up's prefill steps, then the 8
    assert pairs_stats == uniform_stats
