"""bench/vs_vllm.py's decode phases, driven on the hybridkv side alone (no vLLM)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from hybridkv.sim.workloads import chat_workload

BENCH = Path(__file__).resolve().parent.parent / "bench" / "vs_vllm.py"


@pytest.fixture(scope="module")
def vs_vllm():
    spec = importlib.util.spec_from_file_location("vs_vllm_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


class _Recording:
    """A side that records each decode step's batch and the requests that got a
    token appended after it (request ids)."""

    def __init__(self, side):
        self._side, self.batches, self.appended = side, [], []

    def __getattr__(self, name):
        return getattr(self._side, name)

    def decode_step(self, requests):
        self.batches.append([r.request_id for r in requests])
        self.appended.append([])
        return self._side.decode_step(requests)

    def append_tokens(self, request, token_ids):
        if self.appended:
            self.appended[-1].append(request.request_id)
        return self._side.append_tokens(request, token_ids)


@pytest.mark.parametrize("churn", [False, True])
def test_decode_phase_batches(vs_vllm, churn):
    """Every step schedules all running requests, or with churn all but request
    k mod 8 at step k, in workload order; figures are per request of the batch."""
    side = _Recording(vs_vllm.HybridkvSide(kv_memory_bytes=40 * 2**30, max_model_len=131072,
                                           max_num_batched_tokens=2048, max_num_seqs=8))
    out = vs_vllm.measure_decode({"hybridkv": side}, num_requests=8, steps=10, chunk_tokens=2048, seed=0,
                                 paired=True, churn=churn)
    ids = [item.request_id for item in chat_workload(8, seed=0)]
    assert len(side.batches) == 10
    for k, batch in enumerate(side.batches):
        assert batch == [rid for i, rid in enumerate(ids) if not (churn and i == k % 8)], k
        assert side.appended[k] == batch, k  # only what the step computed gets its next token
    result = out["hybridkv"]
    assert result["batch_requests"] == (7 if churn else 8) and result["churn"] is churn
    assert result["steps"] == 10 and result["us_per_request_step_mean"] > 0
    assert side.manager.num_requests == 0  # every request freed after the phase
