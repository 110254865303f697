"""Measure how many 128k requests vLLM 0.33.0's KVCacheManager admits at 40 GiB.

Run with the vLLM environment of bench/README.md:

    PYTHONPATH=src:bench /path/to/venv-vllm/bin/python tests/golden/record_vllm_admission.py

Each request is a 131,071-token prompt prefilled in chunks of the batch size,
then one decode step (bench/vs_vllm.py's ``measure_capacity``), admitted one
after another until vLLM's manager refuses one. Recorded on 2026-12-03:
77 with 2,048 batched tokens, 67 with 8,192 (refused at admission both times).
"""

import json

import vllm_side as vs
import vs_vllm as vv

for batched in (2048, 8192):
    side = vs.VllmSide(kv_memory_bytes=40 * 2**30, max_model_len=131072, max_num_batched_tokens=batched,
                       max_num_seqs=256, enable_prefix_caching=False)
    result = vv.measure_capacity(side, context_tokens=131072, chunk_tokens=batched, seed=0, limit=200)
    print(json.dumps({"batched": batched, "admitted": result["measured_requests"],
                      "refused_at": result["refused_at"], "logged": result["computed_requests"]}))
