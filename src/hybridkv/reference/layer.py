"""The math of one DeepSeek-V4 attention layer, shared by the dense and paged paths.

The two paths differ only in where rows come from: the dense path keeps every
row of a sequence in arrays; the paged path writes rows into codec pools at the
manager's slots and reads them back. Everything here is a function of rows and
positions, vectorized over tokens and heads. Arithmetic is float64; a value is
rounded to float32 and then to its cache format exactly where it becomes a cache
row (``round_*`` helpers), in both paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hybridkv.codecs import KVRowCodec, MXFP4IndexerCodec
from hybridkv.reference.config import CompressorWeights, LayerWeights, ReferenceConfig
from hybridkv.reference.rope import apply_rope, rope_frequencies


# --- small pieces ------------------------------------------------------------

def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """``x / rms(x)`` over the last axis, times ``weight`` (None: unweighted)."""
    x = np.asarray(x, dtype=np.float64)
    out = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return out if weight is None else out * weight


@lru_cache(maxsize=4)
def hadamard_matrix(dim: int) -> np.ndarray:
    """Orthonormal Sylvester Hadamard matrix (symmetric; ``H @ H = I``)."""
    if dim <= 0 or dim & (dim - 1):
        raise ValueError(f"Hadamard dim must be a power of two, got {dim}")
    h = np.ones((1, 1))
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    out = h / np.sqrt(dim)
    out.setflags(write=False)
    return out


def hadamard(x: np.ndarray) -> np.ndarray:
    """Hadamard rotation of the last axis."""
    return np.asarray(x, dtype=np.float64) @ hadamard_matrix(x.shape[-1])


@dataclass(frozen=True)
class LayerCodecs:
    """The row codecs whose rounding a layer applies (and whose pools the paged path uses)."""

    kv: KVRowCodec
    index_key: MXFP4IndexerCodec

    @classmethod
    def for_config(cls, config: ReferenceConfig) -> "LayerCodecs":
        return cls(KVRowCodec(config.head_dim, config.rope_dim), MXFP4IndexerCodec(config.index_head_dim))


def round_kv_rows(codecs: LayerCodecs, rows: np.ndarray) -> np.ndarray:
    """Window / compressed KV rows as the cache holds them: FP8 nope, bf16 rope (float32)."""
    return np.asarray(codecs.kv.fake_quantize(np.asarray(rows, dtype=np.float32)), dtype=np.float32)


def round_index_rows(codecs: LayerCodecs, rows: np.ndarray) -> np.ndarray:
    """Indexer keys (and queries) as MXFP4 holds them (float32)."""
    return np.asarray(codecs.index_key.fake_quantize(np.asarray(rows, dtype=np.float32)), dtype=np.float32)


def layer_rope_frequencies(config: ReferenceConfig, ratio: int) -> np.ndarray:
    """Window-only layers: plain RoPE at ``rope_theta``; compressed layers: YaRN at ``compress_rope_theta``."""
    if ratio == 0:
        return rope_frequencies(config.rope_dim, config.rope_theta)
    return rope_frequencies(config.rope_dim, config.compress_rope_theta, config.yarn)


def rope_tail(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray, *, inverse: bool = False) -> np.ndarray:
    """Apply RoPE to the last ``2 * len(freqs)`` dims of ``x`` (a new array)."""
    rope_dim = 2 * freqs.shape[0]
    out = np.array(x, dtype=np.float64)
    out[..., -rope_dim:] = apply_rope(out[..., -rope_dim:], positions, freqs, inverse=inverse)
    return out


# --- per-token projections ----------------------------------------------------

@dataclass(frozen=True)
class TokenProjections:
    """What one layer derives from each token on its own (no context needed)."""

    q: np.ndarray  # [N, heads, head_dim] float64: normed, RoPE'd query
    kv_rows: np.ndarray  # [N, head_dim] float32: the window KV row as cached
    state_rows: np.ndarray | None  # [N, state_width] float32: compressor [C | Z]
    index_q: np.ndarray | None  # [N, index_heads, index_head_dim] float32 (MXFP4-rounded)
    index_weights: np.ndarray | None  # [N, index_heads] float64
    index_state_rows: np.ndarray | None  # [N, indexer state_width] float32


def compressor_state_rows(comp: CompressorWeights, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``[C_t | Z_t]`` per token: value row and gate row (gate + ``ape[t mod m]``), float32."""
    values = x @ comp.wkv
    gates = x @ comp.wgate + comp.ape[np.asarray(positions) % comp.ratio]
    return np.concatenate([values, gates], axis=-1).astype(np.float32)


def project_tokens(
    config: ReferenceConfig,
    codecs: LayerCodecs,
    layer: LayerWeights,
    x: np.ndarray,
    positions: np.ndarray,
) -> TokenProjections:
    """Queries, window KV rows, compressor state rows and indexer queries of tokens ``x``."""
    c = config
    freqs = layer_rope_frequencies(c, layer.ratio)
    n = x.shape[0]
    qr = rms_norm(x @ layer.wq_a, layer.q_norm, c.norm_eps)
    q = rms_norm((qr @ layer.wq_b).reshape(n, c.num_heads, c.head_dim), None, c.norm_eps)
    q = rope_tail(q, positions, freqs)
    kv = rope_tail(rms_norm(x @ layer.wkv, layer.kv_norm, c.norm_eps), positions, freqs)
    kv_rows = round_kv_rows(codecs, kv)
    state_rows = index_q = index_weights = index_state_rows = None
    if layer.compressor is not None:
        state_rows = compressor_state_rows(layer.compressor, x, positions)
    if layer.indexer is not None:
        idx = layer.indexer
        iq = (qr @ idx.wq_b).reshape(n, c.index_heads, c.index_head_dim)
        iq = hadamard(rope_tail(iq, positions, freqs))
        index_q = round_index_rows(codecs, iq)
        index_weights = (x @ idx.weights_proj) * (c.index_head_dim**-0.5 * c.index_heads**-0.5)
        index_state_rows = compressor_state_rows(idx.compressor, x, positions)
    return TokenProjections(q, kv_rows, state_rows, index_q, index_weights, index_state_rows)


# --- the compressor -------------------------------------------------------------

def compressor_slot_positions(entries: np.ndarray, ratio: int) -> np.ndarray:
    """Token positions of the slots entry ``w`` pools, ``[E, slots]``; -1 for a missing slot.

    Ratio 4 (overlapping): ``[4w-4, 4w+4)``; the first 4 slots use the first half of
    their state row (window ``w-1``), the last 4 the second half (window ``w``).
    Ratio 128: ``[128w, 128w+128)``.
    """
    entries = np.asarray(entries, dtype=np.int64)
    if ratio == 4:
        pos = 4 * entries[:, None] - 4 + np.arange(8)
        return np.where(pos >= 0, pos, -1)
    return ratio * entries[:, None] + np.arange(ratio)


def compress_entries(
    config: ReferenceConfig,
    comp: CompressorWeights,
    state_rows: np.ndarray,
    slot_valid: np.ndarray,
    entries: np.ndarray,
) -> np.ndarray:
    """Pool closed windows into entries: per-channel softmax over slot gates, RMSNorm,
    RoPE at the window's first position ``w * m``. Returns float64 ``[E, head_dim]``
    (not yet rounded to the cache format).

    ``state_rows`` is ``[E, slots, state_width]`` in :func:`compressor_slot_positions`
    order; a slot with ``slot_valid`` False gets weight 0.
    """
    d, coff = comp.head_dim, comp.coff
    rows = np.asarray(state_rows, dtype=np.float64)
    values, gates = rows[..., : coff * d], rows[..., coff * d :]
    if comp.overlap:
        half = comp.ratio
        values = np.concatenate([values[:, :half, :d], values[:, half:, d:]], axis=1)
        gates = np.concatenate([gates[:, :half, :d], gates[:, half:, d:]], axis=1)
    gates = np.where(slot_valid[..., None], gates, -np.inf)
    values = np.where(slot_valid[..., None], values, 0.0)
    gates = gates - gates.max(axis=1, keepdims=True)
    weights = np.exp(gates)
    pooled = (weights * values).sum(axis=1) / weights.sum(axis=1)
    normed = rms_norm(pooled, comp.norm, config.norm_eps)
    freqs = layer_rope_frequencies(config, comp.ratio)
    return rope_tail(normed, np.asarray(entries, dtype=np.int64) * comp.ratio, freqs)


def main_entry_rows(codecs: LayerCodecs, pooled: np.ndarray) -> np.ndarray:
    """Compressed KV rows as cached (FP8 nope, bf16 rope)."""
    return round_kv_rows(codecs, pooled)


def index_key_rows(codecs: LayerCodecs, pooled: np.ndarray) -> np.ndarray:
    """Indexer keys as cached: Hadamard rotation, then MXFP4."""
    return round_index_rows(codecs, hadamard(pooled))


# --- which rows a query reads ------------------------------------------------------

def visible_entries(positions: np.ndarray, ratio: int) -> np.ndarray:
    """Compressed entries a query at ``t`` may read: ``w < (t + 1) // ratio``."""
    return (np.asarray(positions, dtype=np.int64) + 1) // ratio


def window_key_positions(positions: np.ndarray, window_tokens: int) -> np.ndarray:
    """``[N, window]`` positions ``t-W+1 .. t`` (oldest first); -1 before position 0."""
    pos = np.asarray(positions, dtype=np.int64)[:, None] - window_tokens + 1 + np.arange(window_tokens)
    return np.where(pos >= 0, pos, -1)


def all_visible_entries(positions: np.ndarray, ratio: int) -> np.ndarray:
    """``[N, max visible]`` entry indices ``0..v-1`` per query (HCA reads all), -1 padded."""
    visible = visible_entries(positions, ratio)
    width = int(visible.max(initial=0))
    idx = np.broadcast_to(np.arange(width), (visible.shape[0], width))
    return np.where(idx < visible[:, None], idx, -1)


def index_scores(index_q: np.ndarray, index_weights: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``sum_h w_h * relu(q_h . k_e)`` for keys ``[E, dim]`` shared by all queries -> ``[N, E]``."""
    dots = np.einsum("nhd,ed->nhe", np.asarray(index_q, np.float64), np.asarray(keys, np.float64))
    return np.einsum("nhe,nh->ne", np.maximum(dots, 0.0), index_weights)


def select_topk(scores: np.ndarray, visible: np.ndarray, topk: int) -> np.ndarray:
    """Top-``topk`` visible entries per query, ``[N, topk]``: ascending entry order, -1 padded.

    Entry ``w`` is visible to row ``n`` iff ``w < visible[n]``; all of them are taken
    while there are at most ``topk``. Ties: the higher score wins, and among equal
    scores the lower entry index wins.
    """
    n, e = scores.shape
    masked = np.where(np.arange(e)[None, :] < np.asarray(visible)[:, None], scores, -np.inf)
    order = np.argsort(-masked, axis=1, kind="stable")[:, :topk]
    taken = np.take_along_axis(masked, order, axis=1) > -np.inf
    chosen = np.where(taken, order, np.iinfo(np.int64).max)
    chosen = np.sort(chosen, axis=1)
    chosen = np.where(chosen == np.iinfo(np.int64).max, -1, chosen)
    if chosen.shape[1] < topk:
        chosen = np.concatenate([chosen, np.full((n, topk - chosen.shape[1]), -1)], axis=1)
    return chosen.astype(np.int64)


# --- attention core and output ---------------------------------------------------------

def attend(q: np.ndarray, keys: np.ndarray, key_valid: np.ndarray, sink: np.ndarray) -> np.ndarray:
    """One softmax per query and head over its keys plus a sink logit; V = K.

    ``q`` ``[N, H, D]``, ``keys`` ``[N, K, D]``, ``key_valid`` ``[N, K]``, ``sink`` ``[H]``.
    The sink only enlarges the denominator. Scale ``D ** -0.5``.
    """
    keys = np.asarray(keys, dtype=np.float64)
    logits = np.matmul(q, keys.transpose(0, 2, 1)) * q.shape[-1] ** -0.5
    logits = np.where(key_valid[:, None, :], logits, -np.inf)
    peak = np.maximum(logits.max(axis=-1), sink[None, :])
    weights = np.exp(logits - peak[..., None])
    denom = weights.sum(axis=-1) + np.exp(sink[None, :] - peak)
    return np.matmul(weights, keys) / denom[..., None]


def output_projection(
    config: ReferenceConfig, layer: LayerWeights, o: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """Inverse RoPE on the output's rope dims, grouped low-rank projection, then to hidden."""
    freqs = layer_rope_frequencies(config, layer.ratio)
    o = rope_tail(o, positions, freqs, inverse=True)
    n = o.shape[0]
    grouped = o.reshape(n, config.o_groups, -1)
    low_rank = np.einsum("ngd,grd->ngr", grouped, layer.wo_a)
    return low_rank.reshape(n, -1) @ layer.wo_b


def layer_input(config: ReferenceConfig, layer: LayerWeights, hidden: np.ndarray) -> np.ndarray:
    """Pre-attention RMSNorm of the residual stream."""
    return rms_norm(hidden, layer.attn_norm, config.norm_eps)


def sparse_attention(
    layer: LayerWeights,
    q: np.ndarray,
    positions: np.ndarray,
    window_rows: np.ndarray,
    first_position: int,
    window_tokens: int,
    entry_keys: np.ndarray,
    entry_valid: np.ndarray,
) -> np.ndarray:
    """Attention of one request's queries over its window rows, then compressed entries.

    ``window_rows`` ``[M, D]`` are the rows of positions ``first_position ..
    first_position + M - 1`` read once as a block (as a kernel streams them); a
    query at ``p`` uses those in ``(p - window_tokens, p]``. ``entry_keys``
    ``[N, E, D]`` per query (ascending entries), ``entry_valid`` ``[N, E]``. One
    softmax per query and head over both plus the sink logit; V = K.
    """
    n, h, d = q.shape
    rows = np.asarray(window_rows, dtype=np.float64)
    entries = np.asarray(entry_keys, dtype=np.float64)
    key_pos = first_position + np.arange(rows.shape[0])
    pos = np.asarray(positions, dtype=np.int64)[:, None]
    band = (key_pos[None, :] <= pos) & (key_pos[None, :] > pos - window_tokens)
    scale = d**-0.5
    window_logits = (q.reshape(n * h, d) @ rows.T).reshape(n, h, -1) * scale
    entry_logits = np.matmul(q, entries.transpose(0, 2, 1)) * scale
    logits = np.concatenate([window_logits, entry_logits], axis=-1)
    valid = np.concatenate([band, np.asarray(entry_valid, dtype=bool)], axis=1)
    logits = np.where(valid[:, None, :], logits, -np.inf)
    sink = layer.attn_sink
    peak = np.maximum(logits.max(axis=-1, initial=-np.inf), sink[None, :])
    weights = np.exp(logits - peak[..., None])
    denom = weights.sum(axis=-1) + np.exp(sink[None, :] - peak)
    m = rows.shape[0]
    out = (weights[..., :m].reshape(n * h, m) @ rows).reshape(n, h, d)
    out = out + np.matmul(weights[..., m:], entries)
    return out / denom[..., None]
