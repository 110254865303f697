"""Side by side: vLLM 0.33's ``KVCacheManager`` and hybridkv's ``CacheManager``.

Run with the vLLM environment (bench/README.md), hybridkv from ``src``:

    PYTHONPATH=src /work/venv-vllm/bin/python bench/vs_vllm            # full run, ~5 min on 2 cores
    PYTHONPATH=src /work/venv-vllm/bin/python bench/vs_vllm --quick    # smoke test, ~1 min

Both managers plan DeepSeek-V4-Flash (FP8 indexer, as vLLM uses) in the same
byte budget and get the same requests (the same token ids) in one process.
Timed phases alternate the two sides' steps (``timing``) over ``--rounds``
rounds and report the median round's ratio of totals (vLLM time / hybridkv
time) and p50 / p99 step times:

* ``serving``: a steady number of running requests with joins, chunked
  prefills and finishes in every step (``serving``), at each ``--sizes``; its
  prefix caches start empty, or with ``--fill-tokens N`` full of N tokens of
  freed prompts, as on a server that has run a while (every allocation evicts);
* ``decode``: steady decode at the same sizes (``decode``); for both, a fit of
  step time = fixed + per request x running over the sizes;
* ``prefill``: ``--chunk``-token chunks of long unique prompts (``prefill``);
* ``multiturn``: token hit rate of conversations sharing a system prompt
  (``hitrate``);
* ``capacity``: requests of ``--context`` tokens that fit (``capacity``).

Modules: ``sides`` (the adapters; ``vllm_side`` holds every vLLM import),
``workload`` (the serving requests), the phases above, ``timing``
(alternation, rounds, fits), ``report`` (tables) and ``cli``.
"""
