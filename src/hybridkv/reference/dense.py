"""Dense path: one request's whole sequence at once, every row kept in arrays, no cache.

It applies the same roundings the cache stores (FP8 nope + bf16 rope for KV
rows, MXFP4 indexer keys, float32 state rows), as the real model does, so the
paged path must reproduce it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridkv.reference.config import ReferenceModel
from hybridkv.reference.layer import (
    LayerCodecs,
    all_visible_entries,
    compress_entries,
    compressor_slot_positions,
    index_key_rows,
    index_scores,
    layer_input,
    main_entry_rows,
    output_projection,
    project_tokens,
    select_topk,
    sparse_attention,
    visible_entries,
)


@dataclass(frozen=True)
class DenseLayerTrace:
    """One layer over the sequence: what it produced and which entries it chose."""

    outputs: np.ndarray  # [T, hidden] attention output (before the residual add)
    kv_rows: np.ndarray  # [T, head_dim] window rows as cached
    state_rows: np.ndarray | None  # [T, state_width]
    entry_rows: np.ndarray | None  # [T // ratio, head_dim] compressed rows as cached
    index_keys: np.ndarray | None  # [T // 4, index_head_dim]
    selected: np.ndarray | None  # [T, topk] CSA selections (ascending, -1 padded)
    index_state_rows: np.ndarray | None = None  # [T, indexer state_width] (ratio 4)


@dataclass(frozen=True)
class DenseTrace:
    hidden: np.ndarray  # [T, hidden] residual stream after the last layer
    layers: tuple[DenseLayerTrace, ...]


def _pool_all_windows(config, comp, state_rows: np.ndarray, num_entries: int) -> np.ndarray:
    entries = np.arange(num_entries)
    slot_pos = compressor_slot_positions(entries, comp.ratio)
    gathered = state_rows[np.maximum(slot_pos, 0)]
    return compress_entries(config, comp, gathered, slot_pos >= 0, entries)


def _joined(prefix: np.ndarray | None, new: np.ndarray | None, keep: int) -> np.ndarray | None:
    if new is None:
        return None
    return new if prefix is None else np.concatenate([prefix[:keep], new])


def _checked(config, token_ids, prefix: DenseTrace | None, prefix_tokens: int) -> tuple[np.ndarray, int]:
    """(token ids as int64, prefix tokens kept), or ValueError."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"token_ids must be a non-empty 1-d array, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(f"token ids must lie in [0, {config.vocab_size})")
    keep = int(prefix_tokens) if prefix is not None else 0
    if not 0 <= keep < ids.size or (prefix is not None and prefix.hidden.shape[0] < keep):
        raise ValueError(f"prefix_tokens={prefix_tokens} must lie in [0, {ids.size}) and in the prefix trace")
    return ids, keep


def _compressed(config, codecs, layer, proj, state_rows, index_state_rows, positions, num_tokens):
    """A compressed layer's entries from its state rows: (entry rows, indexer keys or
    None, the entries each position reads (-1: none), their keys)."""
    num_entries = num_tokens // layer.ratio
    entry_rows = main_entry_rows(codecs, _pool_all_windows(config, layer.compressor, state_rows, num_entries))
    index_keys = None
    if layer.indexer is not None:
        index_keys = index_key_rows(
            codecs, _pool_all_windows(config, layer.indexer.compressor, index_state_rows, num_entries)
        )
        scores = index_scores(proj.index_q, proj.index_weights, index_keys)
        chosen = select_topk(scores, visible_entries(positions, layer.ratio), config.index_topk)
    else:
        chosen = all_visible_entries(positions, layer.ratio)
    if entry_rows.shape[0]:
        entry_keys = entry_rows[np.maximum(chosen, 0)]
    else:
        entry_keys = np.zeros(chosen.shape + (config.head_dim,), dtype=np.float32)
    return entry_rows, index_keys, chosen, entry_keys


def dense_forward(model: ReferenceModel, token_ids: np.ndarray, prefix: DenseTrace | None = None,
                  prefix_tokens: int = 0) -> DenseTrace:
    """Run every layer of ``model`` over ``token_ids`` (positions ``0..T-1``).

    With ``prefix`` (the trace of a sequence whose first ``prefix_tokens`` tokens
    equal these), positions below ``prefix_tokens`` are taken from it instead of
    being recomputed: every row and output at ``p`` depends only on tokens
    ``0..p``. Compressed entries and indexer keys are always pooled afresh from
    the state rows."""
    config = model.config
    ids, keep = _checked(config, token_ids, prefix, prefix_tokens)
    codecs = LayerCodecs.for_config(config)
    num_tokens = ids.size
    positions = np.arange(keep, num_tokens)
    hidden = model.embedding[ids[keep:]].astype(np.float64)
    first = max(0, keep - config.window_tokens + 1)
    traces = []
    for li, layer in enumerate(model.layers):
        old = prefix.layers[li] if prefix is not None else None
        proj = project_tokens(config, codecs, layer, layer_input(config, layer, hidden), positions)
        kv_rows = _joined(old and old.kv_rows, proj.kv_rows, keep)
        state_rows = _joined(old and old.state_rows, proj.state_rows, keep)
        index_state_rows = _joined(old and old.index_state_rows, proj.index_state_rows, keep)
        entry_rows = index_keys = selected = None
        chosen = np.zeros((positions.size, 0), dtype=np.int64)
        entry_keys = np.zeros((positions.size, 0, config.head_dim), dtype=np.float32)
        if layer.ratio:
            entry_rows, index_keys, chosen, entry_keys = _compressed(
                config, codecs, layer, proj, state_rows, index_state_rows, positions, num_tokens)
            if layer.indexer is not None:
                selected = _joined(old and old.selected, chosen, keep)
        o = sparse_attention(
            layer, proj.q, positions, kv_rows[first:], first, config.window_tokens, entry_keys, chosen >= 0
        )
        out = output_projection(config, layer, o, positions)
        hidden = hidden + out
        traces.append(DenseLayerTrace(
            _joined(old and old.outputs, out, keep), kv_rows, state_rows, entry_rows, index_keys, selected,
            index_state_rows,
        ))
    return DenseTrace(hidden=_joined(prefix and prefix.hidden, hidden, keep), layers=tuple(traces))
