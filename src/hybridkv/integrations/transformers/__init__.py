"""Hugging Face transformers' DeepseekV4 running on hybridkv's pages (the ``[hf]`` extra).

* :class:`PagedEngine` (``engine.py``): the model, a planned manager and the page
  pools; ``step`` runs several requests in one manager step, ``generate`` is a
  greedy continuous-batching loop (chunked prefill, prefix hits, preemption,
  eviction under a small budget).
* :class:`PagePools`, :func:`materialize` (``pages.py``): where each cache row lives
  and how a step's cache is read through block tables and written at write slots.
* ``check.py``: the paged path against transformers' own cache (``hybridkv verify
  --against transformers``).
"""

from hybridkv.integrations.transformers.engine import PagedEngine, layout_config
from hybridkv.integrations.transformers.pages import PagedReadError, PagePools, materialize

__all__ = ["PagePools", "PagedEngine", "PagedReadError", "layout_config", "materialize"]
