"""Dense traces of every sequence version a scenario computed, sharing common prefixes.

A rejected speculative draft is its own version: the accepted prefix plus the
rejected tokens. Rows and outputs at position ``p`` depend only on tokens
``0..p``, so a version that shares its first ``k`` tokens with a longer one
already traced takes positions below ``k`` from that trace and computes only
the rest (``dense_forward(..., prefix=...)``): each draft costs its few tokens,
not a whole sequence.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hybridkv.reference.config import ReferenceModel
from hybridkv.reference.dense import DenseTrace, dense_forward


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def dense_traces(
    model: ReferenceModel, sequences: Mapping[tuple, np.ndarray], need_tokens: Mapping[tuple, int]
) -> dict[tuple, DenseTrace]:
    """A dense trace covering the first ``need_tokens[key]`` tokens of ``sequences[key]``,
    for every key of ``need_tokens`` (longest first; a shorter one reuses the longest
    shared prefix of a trace already computed for the same request)."""
    order = sorted(need_tokens, key=lambda k: -need_tokens[k])
    done: dict[tuple, tuple[np.ndarray, DenseTrace]] = {}
    out: dict[tuple, DenseTrace] = {}
    for key in order:
        seq = np.asarray(sequences[key][: need_tokens[key]])
        best, best_len = None, 0
        for other_seq, trace in done.values():
            shared = min(_common_prefix(seq, other_seq), seq.size - 1)
            if shared > best_len:
                best, best_len = trace, shared
        trace = dense_forward(model, seq, prefix=best, prefix_tokens=best_len)
        done[key] = (seq, trace)
        out[key] = trace
    return out
