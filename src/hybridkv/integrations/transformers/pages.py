"""transformers' DeepseekV4 cache state kept in hybridkv's pages.

One byte pool per layer per cache group, sized and addressed like the
manager's groups (page ids from the manager, ``rows_per_page`` from the specs):

| pool | group | row (float32) | written when |
|---|---|---|---|
| window | ``v4.swa_kv`` | K = V row, ``head_dim`` | every token (``update``) |
| state | ``v4.c{m}a.compressor_state`` | ``[kv | gate]`` as projected, ``2 * coff * head_dim`` | every token (``store_compression_weights``) |
| entries | ``v4.c{m}a.compressed_kv`` | compressed entry, ``head_dim`` | a token closes a window (``update_compressor_states``) |
| index_state | ``v4.c4a.indexer_compressor_state`` | indexer ``[kv | gate]``, ``4 * index_head_dim`` | every token |
| index_keys | ``v4.c4a.compressed_kv`` page ids | indexer key, ``index_head_dim`` | with the entry |

**Which bytes.** Rows are stored as little-endian float32 (``StateRowCodec``
pools), not in the serving formats (FP8 KV, MXFP4 indexer keys): transformers'
model attends over unquantized keys and its indexer runs without Hadamard or
FP4, so any rounding the cache applied would change its numbers. What is
hybridkv's is where every row lives: the page geometry, the page ids the manager
hands out, the write slots, the block tables the reads go through, window
release, prefix sharing, eviction and rewind.

**A step**, per request: :func:`materialize` reads the rows the next forward
needs through the request's block-table row into a fresh ``DynamicCache`` (the
window's last ``W - 1`` rows, every entry, the open window's state rows, and for
ratio 4 the previous window's first-half state rows: the "overlap"); the layer
methods are wrapped so every row the forward produces is recorded; then
:meth:`PagePools.commit` writes them at the step's write slots. Between steps
nothing but the pools holds the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.codecs import StateRowCodec
from hybridkv.models.deepseek_v4 import (
    V4_INDEXER_COMPRESSOR_STATE_GROUP_ID,
    V4_SWA_KV_GROUP_ID,
    v4_compressed_kv_group_id,
    v4_compressor_state_group_id,
)

LAYER_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


class PagedReadError(ValueError):
    """A row a forward needs lies on a page the request's table does not hold."""


@dataclass
class LayerPools:
    ratio: int
    window: np.ndarray
    state: np.ndarray | None = None
    entries: np.ndarray | None = None
    index_state: np.ndarray | None = None
    index_keys: np.ndarray | None = None


@dataclass
class Written:
    """Rows one request's forward produced, per layer (float32 numpy)."""

    window: dict[int, np.ndarray] = field(default_factory=dict)
    state: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)  # (layer, name) -> [k, width]
    entries: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)  # (layer, name) -> [e, dim]


def _slots(spec, table_row: np.ndarray, base_page: int, cache_rows: np.ndarray, request_id: str) -> np.ndarray:
    """``table[col] * R + row % R`` with ``col = row // R - base`` (base 0 for full-history groups)."""
    cache_rows = np.asarray(cache_rows, dtype=np.int64)
    col = cache_rows // spec.rows_per_page - (base_page if spec.is_sliding else 0)
    inside = (col >= 0) & (col < table_row.size)
    pages = np.where(inside, table_row[np.clip(col, 0, max(table_row.size - 1, 0))], -1) if table_row.size else (
        np.full(cache_rows.shape, -1))
    if (pages < 0).any():
        bad = int(cache_rows[np.argmax(pages < 0)])
        raise PagedReadError(f"group {spec.group_id}: request {request_id!r} reads cache row {bad} "
                             "whose page is not in its table")
    return pages.astype(np.int64) * spec.rows_per_page + cache_rows % spec.rows_per_page


class PagePools:
    """The byte pools of every layer, for one model config and one manager's groups."""

    def __init__(self, config, specs, group_pages):
        self.config = config
        self.specs = {s.group_id: s for s in specs}
        self.ratios = [LAYER_RATIO[t] for t in config.layer_types]
        d, di = config.head_dim, config.index_head_dim
        layers = []
        for ratio in self.ratios:
            lp = LayerPools(ratio, self._pool(V4_SWA_KV_GROUP_ID, d, group_pages))
            if ratio:
                coff = 2 if ratio == 4 else 1
                lp.state = self._pool(v4_compressor_state_group_id(ratio), 2 * coff * d, group_pages)
                lp.entries = self._pool(v4_compressed_kv_group_id(ratio), d, group_pages)
            if ratio == 4:
                lp.index_state = self._pool(V4_INDEXER_COMPRESSOR_STATE_GROUP_ID, 4 * di, group_pages)
                lp.index_keys = self._pool(v4_compressed_kv_group_id(4), di, group_pages)
            layers.append(lp)
        self.layers = layers

    def _pool(self, gid: str, width: int, group_pages) -> np.ndarray:
        return StateRowCodec(width).new_pool(int(group_pages[gid]), self.specs[gid].rows_per_page)

    def codec(self, pool: np.ndarray, gid: str) -> StateRowCodec:
        """The float32 row codec of ``pool`` (its width follows from the page stride)."""
        return StateRowCodec(pool.shape[1] // (4 * self.specs[gid].rows_per_page))

    def read(self, pool, gid, table_row, base_page, cache_rows, request_id) -> np.ndarray:
        spec = self.specs[gid]
        slots = _slots(spec, table_row, base_page, cache_rows, request_id)
        return self.codec(pool, gid).read_slots(pool, slots, spec.rows_per_page)

    def write(self, pool, gid, slots: np.ndarray, rows: np.ndarray) -> None:
        spec = self.specs[gid]
        self.codec(pool, gid).write_slots(pool, slots, rows, spec.rows_per_page)

    def commit(self, written: Written, groups, lo: int, hi: int) -> None:
        """Write one request's recorded rows at its write slots (tokens ``lo:hi`` of the batch)."""
        for li, rows in written.window.items():
            self.write(self.layers[li].window, V4_SWA_KV_GROUP_ID, groups[V4_SWA_KV_GROUP_ID].write_slots[lo:hi], rows)
        for (li, name), rows in written.state.items():
            lp = self.layers[li]
            gid = v4_compressor_state_group_id(lp.ratio) if name == "compressor" else V4_INDEXER_COMPRESSOR_STATE_GROUP_ID
            self.write(lp.state if name == "compressor" else lp.index_state, gid, groups[gid].write_slots[lo:hi], rows)
        for (li, name), rows in written.entries.items():
            lp = self.layers[li]
            gid = v4_compressed_kv_group_id(lp.ratio)
            slots = groups[gid].write_slots[lo:hi]
            slots = slots[slots >= 0]
            if slots.size != rows.shape[0]:
                raise ValueError(f"layer {li} {name}: the model closed {rows.shape[0]} windows, the manager "
                                 f"gave {slots.size} compressed write slots")
            self.write(lp.entries if name == "compressor" else lp.index_keys, gid, slots, rows)


def _tensor(rows: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).unsqueeze(0)


def materialize(pools: PagePools, model, cache, tables, n: int, request_id: str) -> Written:
    """Fill ``cache`` (a fresh ``DynamicCache(config=...)``) with the rows a forward from
    position ``n`` reads, through ``tables`` (group id -> (table row, base page)); wrap its
    layers so the forward's new rows are recorded in the returned :class:`Written`."""
    config = pools.config
    written = Written()
    window_rows = np.arange(max(0, n - config.sliding_window + 1), n)
    for li, (layer, lp) in enumerate(zip(cache.layers, pools.layers)):
        def read(pool, gid, rows):
            row, base = tables[gid]
            return pools.read(pool, gid, row, base, rows, request_id)
        if n:
            keys = _tensor(read(lp.window, V4_SWA_KV_GROUP_ID, window_rows)).unsqueeze(0)
            layer.lazy_initialization(keys, keys)
            layer.keys = layer.values = keys
            layer.cumulative_length = n
        if lp.ratio:
            attention = model.model.layers[li].self_attn
            _fill_compressor(layer, "compressor", lp.ratio, n, lambda rows: read(
                lp.state, v4_compressor_state_group_id(lp.ratio), rows), lambda rows: read(
                lp.entries, v4_compressed_kv_group_id(lp.ratio), rows), attention.compressor)
            if lp.ratio == 4:
                _fill_compressor(layer, "indexer", 4, n, lambda rows: read(
                    lp.index_state, V4_INDEXER_COMPRESSOR_STATE_GROUP_ID, rows), lambda rows: read(
                    lp.index_keys, v4_compressed_kv_group_id(4), rows), attention.compressor.indexer)
        _record(layer, li, written)
    return written


def _fill_compressor(layer, name: str, ratio: int, n: int, read_state, read_entries, module) -> None:
    """Entries, the open window's buffer and (ratio 4) the overlap of one compressor."""
    width = module.head_dim
    half = (2 if ratio == 4 else 1) * width  # kv channels of a state row; the gate follows
    closed = n // ratio
    layer.compressed_kv[name] = _tensor(read_entries(np.arange(closed)))
    layer.entry_count[name] = closed
    open_rows = read_state(np.arange(closed * ratio, n))
    layer.buffer_kv[name] = _tensor(open_rows[:, :half])
    layer.buffer_gate[name] = _tensor(open_rows[:, half:])
    if ratio == 4 and closed:
        prev = read_state(np.arange(closed * ratio - ratio, closed * ratio))
        layer.overlap_kv[name] = _tensor(prev[:, :width])
        # transformers keeps the gate with the position bias already added
        gate = _tensor(prev[:, half:half + width]) + module.position_bias[:, :width]
        layer.overlap_gate[name] = gate.detach()


def _record(layer, li: int, written: Written) -> None:
    """Wrap the layer's writing methods so the rows they receive are recorded."""
    update = layer.update

    def recording_update(key_states, value_states, *args, **kwargs):
        written.window[li] = key_states[0, 0].detach().numpy().copy()
        return update(key_states, value_states, *args, **kwargs)

    layer.update = recording_update
    if not hasattr(layer, "store_compression_weights"):
        return
    store, emit = layer.store_compression_weights, layer.update_compressor_states

    def recording_store(name, kv, gate):
        written.state[(li, name)] = torch.cat([kv, gate], dim=-1)[0].detach().numpy().copy()
        return store(name, kv, gate)

    def recording_emit(name, compressed):
        written.entries[(li, name)] = compressed[0].detach().numpy().copy()
        return emit(name, compressed)

    layer.store_compression_weights = recording_store
    layer.update_compressor_states = recording_emit
