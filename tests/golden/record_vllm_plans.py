"""Record vLLM 0.33.0's own planning outputs for tests/test_compare_vllm.py.

Run with the vLLM environment of bench/README.md (vLLM 0.33.0 on CPU torch):

    PYTHONPATH=src:bench /path/to/venv-vllm/bin/python tests/golden/record_vllm_plans.py

It plans each case through vLLM's own functions (bench/vllm_side.py:
``get_global_kv_cache_groups`` -> ``get_kv_cache_configs`` ->
``generate_scheduler_kv_cache_config``, then
``get_max_concurrency_for_kv_cache_config`` with ``max_model_len`` = the
context) and prints the figures as a Python literal to paste into the test.
"""

import json

import vllm_side as vs
from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

CASES = [
    # (model, budget GiB, max_model_len, max_num_batched_tokens)
    ("deepseek-v4-flash", 40, 131072, 2048),
    ("deepseek-v4-flash", 40, 131072, 8192),
    ("deepseek-v4-flash", 40, 1048576, 8192),
    ("deepseek-v4-flash", 8, 65536, 2048),
    ("deepseek-v4-pro", 80, 131072, 8192),
    ("deepseek-v4-pro", 40, 262144, 4096),
]


def record(model, gib, max_model_len, batched):
    plan = vs.plan_kv_cache(
        vs.bundled_v4_config(model), kv_memory_bytes=gib * 2**30, max_model_len=max_model_len,
        max_num_batched_tokens=batched, max_num_seqs=256,
    )
    described = vs.describe_plan(plan)
    groups = [
        (g["layers"], g["block_tokens"], g["window_tokens"]) for g in described["groups"]
    ]
    return {
        "case": (model, gib, max_model_len, batched),
        "groups": groups,
        "num_blocks": described["num_blocks"],
        "block_bytes": described["block_stride_bytes"],
        "max_in_flight_tokens": described["max_in_flight_tokens"],
        "logged_concurrency": get_max_concurrency_for_kv_cache_config(plan.vllm_config, plan.kv_cache_config),
    }


if __name__ == "__main__":
    for case in CASES:
        print(json.dumps(record(*case)))
