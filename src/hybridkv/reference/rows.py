"""Cache rows decoded from the pools at a checkpoint, and their comparison with the dense rows.

At a checkpoint a request has computed ``n`` tokens. The rows its next query
(at position ``n``) can read, per layer:

* window KV rows of positions ``max(0, n - W + 1) .. n - 1``;
* compressed KV rows (and, ratio 4, indexer keys) of entries ``0 .. n // m - 1``;
* compressor state rows (and, ratio 4, indexer state rows) of the positions the
  next entry to close pools that are already computed: ``4w - 4 .. n - 1`` for
  ratio 4 and ``128w .. n - 1`` for ratio 128, ``w = n // m``.

They are read through the manager's own page list of the request
(``request_pages``: base page and held ids), independently of any step's block
table, so a row written at a wrong slot, a page given to another request while
still held, or a prefix hit that borrowed the wrong pages shows up here even
when no output is computed from it yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridkv.models.deepseek_v4 import (
    V4_INDEXER_COMPRESSOR_STATE_GROUP_ID,
    V4_SWA_KV_GROUP_ID,
    v4_compressed_kv_group_id,
    v4_compressor_state_group_id,
)


@dataclass(frozen=True)
class RowSnapshot:
    request_id: str
    version: int
    num_tokens: int
    why: str
    # (layer, kind) -> (cache rows [k], decoded values [k, width]); kind as in ROW_KINDS
    rows: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    problems: tuple[str, ...]  # rows whose page the request does not hold


def _state_start(ratio: int, n: int) -> int:
    w = n // ratio
    return max(0, 4 * w - 4) if ratio == 4 else ratio * w


def _read_rows(manager, stack, request_id, group_id, codec, pool, rows, problems, label):
    spec = stack.specs[group_id]
    base, pages = manager.request_pages(request_id, group_id)
    col = rows // spec.rows_per_page - (base if spec.is_sliding else 0)
    held = (col >= 0) & (col < pages.size)
    if not held.all():
        problems.append(f"{label}: request {request_id!r} holds no page for row {int(rows[~held][0])}")
        rows, col = rows[held], col[held]
    page = pages[col]
    if (page < 0).any():
        problems.append(f"{label}: request {request_id!r} has an empty table cell for row {int(rows[page < 0][0])}")
        rows, page = rows[page >= 0], page[page >= 0]
    slots = page * spec.rows_per_page + rows % spec.rows_per_page
    return rows, codec.read_slots(pool, slots, spec.rows_per_page)


def snapshot_rows(model, manager, stack, request_id: str, version: int, n: int, why: str) -> RowSnapshot:
    """Decode every row the request's next query may read (see the module docstring)."""
    config, codecs = model.config, stack.codecs
    out: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    problems: list[str] = []
    window = np.arange(max(0, n - config.window_tokens + 1), n)
    for li, (layer, pools) in enumerate(zip(model.layers, stack.pools)):
        def read(kind, gid, codec, pool, rows):
            out[(li, kind)] = _read_rows(manager, stack, request_id, gid, codec, pool, rows, problems,
                                         f"layer {li} {kind}")
        read("window KV", V4_SWA_KV_GROUP_ID, codecs.kv, pools.window, window)
        if not layer.ratio:
            continue
        entries = np.arange(n // layer.ratio)
        states = np.arange(_state_start(layer.ratio, n), n)
        comp_gid = v4_compressed_kv_group_id(layer.ratio)
        read("compressed KV", comp_gid, codecs.kv, pools.entries, entries)
        state_gid = v4_compressor_state_group_id(layer.ratio)
        read("compressor states", state_gid, stack.state_codec(state_gid), pools.state, states)
        if layer.indexer is not None:
            read("indexer keys", comp_gid, codecs.index_key, pools.index_keys, entries)
            gid = V4_INDEXER_COMPRESSOR_STATE_GROUP_ID
            rows, values = _read_rows(manager, stack, request_id, gid, stack.state_codec(gid), pools.index_state,
                                      states, problems, f"layer {li} indexer states")
            out[(li, "indexer states")] = (rows, values)
    return RowSnapshot(request_id, version, n, why, out, tuple(problems))


_DENSE_FIELD = {
    "window KV": "kv_rows",
    "compressed KV": "entry_rows",
    "indexer keys": "index_keys",
    "compressor states": "state_rows",
    "indexer states": "index_state_rows",
}
_FLOAT32_KINDS = ("compressor states", "indexer states")
_KIND_OF = {"indexer states": "compressor states"}  # reported together


def compare_snapshot(snap: RowSnapshot, dense, tolerance: float) -> dict[str, tuple[int, float, list[str]]]:
    """Per row kind: rows compared, largest |decoded - dense| (NaN counts as infinite) and
    problems (rows not held, the first row off by more than ``tolerance``)."""
    out: dict[str, list] = {}
    for (li, kind), (rows, values) in snap.rows.items():
        want = getattr(dense.layers[li], _DENSE_FIELD[kind])[rows]
        diff = np.abs(values.astype(np.float64) - want.astype(np.float64))
        if kind in _FLOAT32_KINDS:
            # float32 rows: both paths compute them in float64 with different summation
            # orders (~1e-16 apart), so one in ~1e9 values rounds to the neighbouring
            # float32. Up to one float32 ulp of the dense value is no difference.
            diff = np.where(diff <= np.spacing(np.abs(want).astype(np.float32)), 0.0, diff)
        t = out.setdefault(_KIND_OF.get(kind, kind), [0, 0.0, []])
        t[0] += rows.size
        if diff.size:
            worst = float(np.nan_to_num(diff, nan=np.inf).max())
            t[1] = max(t[1], worst)
            if worst > tolerance and not t[2]:
                r = int(rows[np.argmax(np.nan_to_num(diff, nan=np.inf).max(axis=1))])
                t[2].append(f"request {snap.request_id!r} ({snap.why}, {snap.num_tokens} tokens) layer {li} "
                            f"{kind} row {r} differs by {worst:.3g}")
    for problem in snap.problems:
        kind = next((k for k in _DENSE_FIELD if k in problem), "window KV")
        out.setdefault(_KIND_OF.get(kind, kind), [0, 0.0, []])[2].append(problem)
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}
