"""Paged path: the reference layers reading and writing only through cache pages.

Every row a layer uses comes from a codec pool at a slot computed from the
manager's ``StepBatch`` (block table, base page, write slots), exactly as a
kernel would address it. Nothing is carried between steps on the Python side
except the pools themselves. Per layer and step:

1. project the scheduled tokens (queries, window KV rows, compressor state rows);
2. write window rows (``v4.swa_kv``) and state rows (``v4.c{m}a.compressor_state``,
   ``v4.c4a.indexer_compressor_state``) at the groups' write slots;
3. for every token that closes a window (compressed write slot != -1), read the
   window's state rows back from the state pool, pool them, and write the entry
   (and, for ratio 4, the indexer key on the same page ids) at that slot;
4. read the window keys, the indexer keys (ratio 4) and the chosen compressed
   entries from the pools, and attend.

A position whose page is not in the table raises :class:`PagedReadError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.runtime.batch import GroupStep
from hybridkv.codecs import StateRowCodec
from hybridkv.models.deepseek_v4 import (
    V4_INDEXER_COMPRESSOR_STATE_GROUP_ID,
    V4_SWA_KV_GROUP_ID,
    v4_compressed_kv_group_id,
    v4_compressor_state_group_id,
)
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
from hybridkv.spec import CacheGroupSpec


class PagedReadError(ValueError):
    """A layer needs a row whose page is not in the request's table (released or never held)."""


@dataclass
class LayerPools:
    """The byte pools one layer owns, indexed by the page ids of their groups."""

    window: np.ndarray  # v4.swa_kv, KV rows
    state: np.ndarray | None = None  # v4.c{m}a.compressor_state, [C | Z] rows
    entries: np.ndarray | None = None  # v4.c{m}a.compressed_kv, KV rows
    index_state: np.ndarray | None = None  # v4.c4a.indexer_compressor_state
    index_keys: np.ndarray | None = None  # MXFP4 keys on the v4.c4a.compressed_kv page ids


@dataclass(frozen=True)
class PagedStepResult:
    """Per scheduled token (batch order): the stack's output and each layer's choices."""

    request_ids: tuple[str, ...]
    request_indices: np.ndarray  # [N]
    positions: np.ndarray  # [N]
    hidden: np.ndarray  # [N, hidden] residual stream after the last layer
    layer_outputs: tuple[np.ndarray, ...]  # per layer [N, hidden]
    selected: dict[int, np.ndarray]  # CSA layer index -> [N, topk]


def table_slots(
    spec: CacheGroupSpec, group, request_rows: np.ndarray, cache_rows: np.ndarray, request_ids=()
) -> np.ndarray:
    """Slots of cache rows (``position // entry_stride_tokens``; -1 = none) through a table.

    ``slot = table[r, row // rows_per_page - base[r]] * rows_per_page + row % rows_per_page``.
    ``request_rows`` broadcasts against ``cache_rows``.
    """
    cache_rows = np.asarray(cache_rows, dtype=np.int64)
    request_rows = np.broadcast_to(np.asarray(request_rows, dtype=np.int64), cache_rows.shape)
    valid = cache_rows >= 0
    logical = np.where(valid, cache_rows, 0) // spec.rows_per_page
    if spec.is_sliding:
        logical = logical - group.base_pages.astype(np.int64)[request_rows]
    table = group.block_table
    inside = (logical >= 0) & (logical < table.shape[1])
    pages = table[request_rows, np.clip(logical, 0, max(table.shape[1] - 1, 0))] if table.shape[1] else (
        np.full(cache_rows.shape, -1)
    )
    missing = valid & (~inside | (pages < 0))
    if missing.any():
        where = tuple(int(i[0]) for i in np.nonzero(missing))
        r = int(request_rows[where])
        name = request_ids[r] if r < len(request_ids) else r
        raise PagedReadError(
            f"group {spec.group_id}: request {name!r} reads cache row {int(cache_rows[where])} "
            f"whose page is not in its table"
        )
    slots = pages.astype(np.int64) * spec.rows_per_page + np.where(valid, cache_rows, 0) % spec.rows_per_page
    return np.where(valid, slots, -1)


def _read(codec, pool: np.ndarray, slots: np.ndarray, rows_per_page: int) -> np.ndarray:
    flat = codec.read_slots(pool, slots.reshape(-1), rows_per_page)
    return flat.reshape(slots.shape + flat.shape[-1:])


class PagedStack:
    """The reference stack over codec pools sized like the manager's groups."""

    def __init__(self, model: ReferenceModel, specs: Sequence[CacheGroupSpec], group_pages: Mapping[str, int]):
        self.model = model
        config = model.config
        self.codecs = LayerCodecs.for_config(config)
        self.specs = {s.group_id: s for s in specs}
        needed = {V4_SWA_KV_GROUP_ID}
        for ratio in set(config.layer_ratios) - {0}:
            needed |= {v4_compressor_state_group_id(ratio), v4_compressed_kv_group_id(ratio)}
        if 4 in config.layer_ratios:
            needed.add(V4_INDEXER_COMPRESSOR_STATE_GROUP_ID)
        missing = sorted(needed - set(self.specs))
        if missing:
            raise ValueError(f"the cache groups {missing} are missing from the specs")
        missing_pages = sorted(needed - set(group_pages))
        if missing_pages:
            raise ValueError(f"no page count for the groups {missing_pages}")
        swa = self.specs[V4_SWA_KV_GROUP_ID]
        if swa.sliding_window_tokens < config.window_tokens or swa.entry_stride_tokens != 1:
            raise ValueError(f"{V4_SWA_KV_GROUP_ID} keeps fewer than {config.window_tokens} tokens")
        self._state_codecs: dict[str, StateRowCodec] = {}
        pools = []
        for layer in model.layers:
            kv = self.codecs.kv
            lp = LayerPools(window=self._new_pool(kv, V4_SWA_KV_GROUP_ID, group_pages))
            if layer.ratio:
                state_gid = v4_compressor_state_group_id(layer.ratio)
                lp.state = self._new_pool(
                    self._state_codec(state_gid, layer.compressor.state_width), state_gid, group_pages
                )
                lp.entries = self._new_pool(kv, v4_compressed_kv_group_id(layer.ratio), group_pages)
            if layer.indexer is not None:
                gid = V4_INDEXER_COMPRESSOR_STATE_GROUP_ID
                width = layer.indexer.compressor.state_width
                lp.index_state = self._new_pool(self._state_codec(gid, width), gid, group_pages)
                lp.index_keys = self._new_pool(self.codecs.index_key, v4_compressed_kv_group_id(4), group_pages)
            pools.append(lp)
        self.pools: tuple[LayerPools, ...] = tuple(pools)

    def state_codec(self, group_id: str) -> StateRowCodec:
        """The codec of a state group's pools (every layer's rows of that group share it)."""
        return self._state_codecs[group_id]

    def _state_codec(self, group_id: str, width: int) -> StateRowCodec:
        codec = self._state_codecs.get(group_id)
        if codec is None:
            codec = self._state_codecs[group_id] = StateRowCodec(width)
        return codec

    def _new_pool(self, codec, group_id: str, group_pages: Mapping[str, int]) -> np.ndarray:
        return codec.new_pool(int(group_pages[group_id]), self.specs[group_id].rows_per_page)

    def forward(self, batch, token_ids: np.ndarray, block_tables: Mapping[str, np.ndarray] | None = None
                ) -> PagedStepResult:
        """Run every layer for the tokens of ``batch``; ``token_ids`` in batch order.

        ``block_tables`` (group id -> table, e.g. from a ``BlockTableMirror``) replaces the
        batch's own tables (an updates-mode batch has none). A group whose
        ``write_slots`` is None gets them computed from its table, as an engine that
        schedules with ``write_slots=False`` does."""
        model, config, codecs = self.model, self.model.config, self.codecs
        ids = np.asarray(token_ids, dtype=np.int64)
        positions = np.asarray(batch.positions, dtype=np.int64)
        req = np.asarray(batch.request_indices, dtype=np.int64)
        if ids.shape != positions.shape:
            raise ValueError(f"got {ids.shape} token ids for {positions.shape} scheduled tokens")
        if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {config.vocab_size})")
        groups = self._kernel_groups(batch, block_tables, positions, req)
        swa_spec, swa = self.specs[V4_SWA_KV_GROUP_ID], groups[V4_SWA_KV_GROUP_ID]
        hidden = model.embedding[ids].astype(np.float64)
        outputs, selected = [], {}
        for li, (layer, pools) in enumerate(zip(model.layers, self.pools)):
            proj = project_tokens(config, codecs, layer, layer_input(config, layer, hidden), positions)
            codecs.kv.write_slots(pools.window, swa.write_slots, proj.kv_rows, swa_spec.rows_per_page)
            chosen = np.zeros((positions.size, 0), dtype=np.int64)
            entry_keys = np.zeros((positions.size, 0, config.head_dim), dtype=np.float32)
            if layer.ratio:
                comp_gid = v4_compressed_kv_group_id(layer.ratio)
                comp_spec, comp = self.specs[comp_gid], groups[comp_gid]
                state_gid = v4_compressor_state_group_id(layer.ratio)
                self._compress(
                    batch, layer.compressor, state_gid, groups[state_gid], pools.state,
                    proj.state_rows, comp, comp_spec, pools.entries, lambda p: main_entry_rows(codecs, p),
                    codecs.kv,
                )
                if layer.indexer is not None:
                    gid = V4_INDEXER_COMPRESSOR_STATE_GROUP_ID
                    self._compress(
                        batch, layer.indexer.compressor, gid, groups[gid], pools.index_state,
                        proj.index_state_rows, comp, comp_spec, pools.index_keys,
                        lambda p: index_key_rows(codecs, p), codecs.index_key,
                    )
                    chosen = self._select(batch, proj, comp_spec, comp, pools.index_keys)
                    selected[li] = chosen
                else:
                    chosen = all_visible_entries(positions, layer.ratio)
                entry_slots = table_slots(comp_spec, comp, req[:, None], chosen, batch.request_ids)
                entry_keys = _read(codecs.kv, pools.entries, entry_slots, comp_spec.rows_per_page)
            o = self._attend(batch, layer, proj.q, positions, swa_spec, swa, pools.window, entry_keys, chosen)
            out = output_projection(config, layer, o, positions)
            hidden = hidden + out
            outputs.append(out)
        return PagedStepResult(
            request_ids=tuple(batch.request_ids),
            request_indices=req,
            positions=positions,
            hidden=hidden,
            layer_outputs=tuple(outputs),
            selected=selected,
        )

    def _kernel_groups(self, batch, block_tables, positions, req) -> dict[str, GroupStep]:
        """Per group: the table and base pages a kernel reads, and the write slots."""
        out = {}
        for gid, step in batch.groups.items():
            table = step.block_table if block_tables is None else block_tables[gid]
            if table is None:
                raise ValueError(f"group {gid}: the batch has no block table (pass block_tables)")
            group = GroupStep(block_table=table, base_pages=step.base_pages, write_slots=step.write_slots)
            if group.write_slots is None:
                group = GroupStep(table, step.base_pages, self._write_slots(gid, group, positions, req, batch))
            out[gid] = group
        return out

    def _write_slots(self, gid, group, positions, req, batch) -> np.ndarray:
        """Slot of each token's row: stride-1 groups every token, compressed groups the closing ones."""
        stride = self.specs[gid].entry_stride_tokens
        rows = np.where((positions + 1) % stride == 0, positions // stride, -1)
        return table_slots(self.specs[gid], group, req, rows, batch.request_ids)

    def _attend(self, batch, layer, q, positions, swa_spec, swa, window_pool, entry_keys, chosen) -> np.ndarray:
        """Per request: read its window rows once as a block through the table, then attend."""
        window = self.model.config.window_tokens
        starts = np.asarray(batch.query_start_loc, dtype=np.int64)
        o = np.empty(q.shape, dtype=np.float64)
        for r in range(len(batch.request_ids)):
            lo, hi = int(starts[r]), int(starts[r + 1])
            if hi == lo:
                continue
            pos = positions[lo:hi]
            first = max(0, int(pos.min()) - window + 1)
            block = np.arange(first, int(pos.max()) + 1)
            slots = table_slots(swa_spec, swa, r, block, batch.request_ids)
            rows = _read(self.codecs.kv, window_pool, slots, swa_spec.rows_per_page)
            o[lo:hi] = sparse_attention(
                layer, q[lo:hi], pos, rows, first, window, entry_keys[lo:hi], chosen[lo:hi] >= 0
            )
        return o

    def _compress(
        self, batch, comp_weights, state_gid, state, state_pool, state_rows, comp, comp_spec, out_pool, finish,
        out_codec,
    ) -> None:
        """Write this step's state rows; for each closing token pool its window from the pool."""
        state_spec = self.specs[state_gid]
        codec = self._state_codecs[state_gid]
        codec.write_slots(state_pool, state.write_slots, state_rows, state_spec.rows_per_page)
        closing = np.flatnonzero(comp.write_slots >= 0)
        if closing.size == 0:
            return
        positions = np.asarray(batch.positions, dtype=np.int64)[closing]
        req = np.asarray(batch.request_indices, dtype=np.int64)[closing]
        entries = positions // comp_weights.ratio
        slot_pos = compressor_slot_positions(entries, comp_weights.ratio)
        slots = table_slots(state_spec, state, req[:, None], slot_pos, batch.request_ids)
        rows = _read(codec, state_pool, slots, state_spec.rows_per_page)
        pooled = compress_entries(self.model.config, comp_weights, rows, slot_pos >= 0, entries)
        out_codec.write_slots(out_pool, comp.write_slots[closing], finish(pooled), comp_spec.rows_per_page)

    def _select(self, batch, proj, comp_spec, comp, key_pool) -> np.ndarray:
        """CSA top-k per query from the indexer keys read out of the pool (per request)."""
        config = self.model.config
        positions = np.asarray(batch.positions, dtype=np.int64)
        visible = visible_entries(positions, 4)
        chosen = np.full((positions.size, config.index_topk), -1, dtype=np.int64)
        starts = np.asarray(batch.query_start_loc, dtype=np.int64)
        for r in range(len(batch.request_ids)):
            lo, hi = int(starts[r]), int(starts[r + 1])
            if hi == lo:
                continue
            num_keys = int(visible[lo:hi].max())
            slots = table_slots(comp_spec, comp, r, np.arange(num_keys), batch.request_ids)
            keys = _read(self.codecs.index_key, key_pool, slots, comp_spec.rows_per_page)
            scores = index_scores(proj.index_q[lo:hi], proj.index_weights[lo:hi], keys)
            chosen[lo:hi] = select_topk(scores, visible[lo:hi], config.index_topk)
        return chosen
