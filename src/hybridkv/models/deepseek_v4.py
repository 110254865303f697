"""DeepSeek-V4 cache geometry and cache-group recipe (the engine-facing seed API).

Names, values and error behaviour are the seed's: the engine-facing DeepSeek-V4
cache geometry module this project started from (the ``deepseek_v4`` cache-spec
module of the tokenspeed serving engine, LightSeek Foundation, MIT). Integer-like
arguments are converted with ``int()``; inputs the seed accepts are accepted here
with the same result (``tests/test_seed_compat.py`` checks a grid of them against
an oracle of the seed's rules). hybridkv's own, stricter checks live in
:func:`hybridkv.models.layout.cache_layout`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hybridkv.spec import CacheGroupSpec, PagedCacheGroupSpec

V4_KERNEL_BLOCK_ROWS: int = 64
V4_SWA_KV_GROUP_ID = "v4.swa_kv"
V4_INDEXER_COMPRESSOR_STATE_GROUP_ID = "v4.c4a.indexer_compressor_state"

DEEPSEEK_V4_FP8_MAX = 448.0
DEEPSEEK_V4_FP8_BLOCK_SIZE = 128  # weight quantization block
DEEPSEEK_V4_FP8_QUANT_BLOCK = 64  # KV nope tile sharing one UE8M0 scale
DEEPSEEK_V4_FP8_INDEXER_BLOCK_SIZE = 128
DEEPSEEK_V4_FP8_SCALE_BYTES = 4
DEEPSEEK_V4_MXFP4_BLOCK_SIZE = 32
DEEPSEEK_V4_MXFP4_SCALE_BYTES = 1
DEEPSEEK_V4_SPARSE_PREFILL_TOPK_ALIGNMENT = 128
DEEPSEEK_V4_COMPRESSED_LOGICAL_BLOCK_SIZE = 256

SUPPORTED_COMPRESS_RATIOS = (4, 128)
# ratio -> (state window tokens, state rows per page)
_STATE_WINDOW_TOKENS = {4: 8, 128: 128}
_STATE_ROWS_PER_PAGE = {4: 4, 128: 8}


# --- KV row geometry ------------------------------------------------------

def deepseek_v4_nope_dim(head_dim: int, rope_dim: int) -> int:
    """Dims of the FP8-quantized (non-rotary) part of a KV row."""
    nope = int(head_dim) - int(rope_dim)
    if nope <= 0:
        raise ValueError(f"head_dim={head_dim} must be larger than rope_dim={rope_dim}")
    return nope


def deepseek_v4_swa_token_stride(head_dim: int, rope_dim: int) -> int:
    """Token-data bytes of one KV row: FP8 nope + bf16 rope (576 for 512/64)."""
    return deepseek_v4_nope_dim(head_dim, rope_dim) + 2 * int(rope_dim)


def deepseek_v4_swa_scale_dim(head_dim: int, rope_dim: int) -> int:
    """Scale bytes of one KV row: one UE8M0 byte per 64 nope values plus a pad byte."""
    nope = deepseek_v4_nope_dim(head_dim, rope_dim)
    if nope % DEEPSEEK_V4_FP8_QUANT_BLOCK:
        raise ValueError(
            f"DeepSeek V4 FP8 nope dim must be divisible by {DEEPSEEK_V4_FP8_QUANT_BLOCK}, got {nope}"
        )
    return nope // DEEPSEEK_V4_FP8_QUANT_BLOCK + 1


def deepseek_v4_swa_row_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of one KV row (584 for 512/64)."""
    return deepseek_v4_swa_token_stride(head_dim, rope_dim) + deepseek_v4_swa_scale_dim(
        head_dim, rope_dim
    )


# --- indexer key geometry -------------------------------------------------

def deepseek_v4_indexer_mxfp4_value_bytes(index_head_dim: int) -> int:
    """Packed e2m1 bytes of one MXFP4 indexer key (two values per byte)."""
    dim = int(index_head_dim)
    if dim % 2:
        raise ValueError(f"MXFP4 index head dim must be even, got {dim}")
    return dim // 2


def deepseek_v4_indexer_mxfp4_scale_dim(index_head_dim: int) -> int:
    """UE8M0 scale bytes of one MXFP4 indexer key (one per 32 values)."""
    dim = int(index_head_dim)
    if dim % DEEPSEEK_V4_MXFP4_BLOCK_SIZE:
        raise ValueError(
            f"MXFP4 index head dim must be divisible by {DEEPSEEK_V4_MXFP4_BLOCK_SIZE}, got {dim}"
        )
    return dim // DEEPSEEK_V4_MXFP4_BLOCK_SIZE * DEEPSEEK_V4_MXFP4_SCALE_BYTES


def deepseek_v4_indexer_mxfp4_row_bytes(index_head_dim: int) -> int:
    """Bytes of one MXFP4 indexer key (68 for 128 dims)."""
    return deepseek_v4_indexer_mxfp4_value_bytes(index_head_dim) + deepseek_v4_indexer_mxfp4_scale_dim(
        index_head_dim
    )


def deepseek_v4_indexer_mxfp4_layout_from_row_bytes(row_bytes: int) -> tuple[int, int, int]:
    """Inverse of the MXFP4 row size: ``(index_head_dim, value_bytes, scale_bytes)``.

    ``row_bytes`` must be a whole number of 17-byte blocks (16 value + 1 scale);
    as in the seed, 0 gives ``(0, 0, 0)`` and a negative multiple negative sizes
    (:func:`hybridkv.models.layout.cache_layout` refuses those itself).
    """
    row_bytes = int(row_bytes)
    block_value_bytes = DEEPSEEK_V4_MXFP4_BLOCK_SIZE // 2
    block_bytes = block_value_bytes + DEEPSEEK_V4_MXFP4_SCALE_BYTES
    if row_bytes % block_bytes:
        raise ValueError(
            f"MXFP4 indexer row bytes must be a multiple of {block_bytes} (value + scale), "
            f"got {row_bytes}"
        )
    blocks = row_bytes // block_bytes
    dim = blocks * DEEPSEEK_V4_MXFP4_BLOCK_SIZE
    if deepseek_v4_indexer_mxfp4_scale_dim(dim) != blocks * DEEPSEEK_V4_MXFP4_SCALE_BYTES:
        raise ValueError(f"invalid MXFP4 indexer row bytes {row_bytes} for index_head_dim={dim}")
    return dim, blocks * block_value_bytes, blocks * DEEPSEEK_V4_MXFP4_SCALE_BYTES


def deepseek_v4_indexer_fp8_scale_bytes(index_head_dim: int) -> int:
    """fp32 scale bytes of one FP8 indexer key (4 per 128 values)."""
    dim = int(index_head_dim)
    if dim % DEEPSEEK_V4_FP8_INDEXER_BLOCK_SIZE:
        raise ValueError(
            f"FP8 index head dim must be divisible by {DEEPSEEK_V4_FP8_INDEXER_BLOCK_SIZE}, got {dim}"
        )
    return dim // DEEPSEEK_V4_FP8_INDEXER_BLOCK_SIZE * DEEPSEEK_V4_FP8_SCALE_BYTES


def deepseek_v4_indexer_fp8_row_bytes(index_head_dim: int) -> int:
    """Bytes of one FP8 indexer key (132 for 128 dims)."""
    return int(index_head_dim) + deepseek_v4_indexer_fp8_scale_bytes(index_head_dim)


def deepseek_v4_indexer_fp8_layout_from_row_bytes(row_bytes: int) -> tuple[int, int]:
    """Inverse of the FP8 row size: ``(index_head_dim, scale_bytes)``; a multiple of 132
    (0 gives ``(0, 0)``, as in the seed)."""
    row_bytes = int(row_bytes)
    block_bytes = DEEPSEEK_V4_FP8_INDEXER_BLOCK_SIZE + DEEPSEEK_V4_FP8_SCALE_BYTES
    if row_bytes % block_bytes:
        raise ValueError(
            f"FP8 indexer row bytes must be a multiple of {block_bytes} (value + scale), "
            f"got {row_bytes}"
        )
    dim = row_bytes // block_bytes * DEEPSEEK_V4_FP8_INDEXER_BLOCK_SIZE
    scale_bytes = deepseek_v4_indexer_fp8_scale_bytes(dim)
    if dim + scale_bytes != row_bytes:
        raise ValueError(f"invalid FP8 indexer row bytes {row_bytes} for index_head_dim={dim}")
    return dim, scale_bytes


# --- group ids --------------------------------------------------------------

_PREFIX = "v4.c"
_STATE_SUFFIX = "a.compressor_state"


def v4_compressor_state_group_id(ratio: int) -> str:
    return f"{_PREFIX}{int(ratio)}{_STATE_SUFFIX}"


def v4_compressed_kv_group_id(ratio: int) -> str:
    return f"{_PREFIX}{int(ratio)}a.compressed_kv"


def parse_v4_compressor_state_group_id(group_id: str) -> int | None:
    """The ratio of a ``v4.c{r}a.compressor_state`` id, or ``None`` for any other
    string (a non-string raises, as in the seed)."""
    if not (group_id.startswith(_PREFIX) and group_id.endswith(_STATE_SUFFIX)):
        return None
    text = group_id[len(_PREFIX) : len(group_id) - len(_STATE_SUFFIX)]
    try:
        return int(text)
    except ValueError:
        return None


# --- the recipe -------------------------------------------------------------

def _field(source: Any, name: str) -> tuple[bool, Any]:
    if isinstance(source, Mapping):
        return (name in source, source.get(name))
    return (hasattr(source, name), getattr(source, name, None))


def resolve_sliding_window(hf_config: Any) -> int:
    """``config.sliding_window``, else ``config.text_config.sliding_window``; must be positive."""
    has_text, text_config = _field(hf_config, "text_config")
    for source in (hf_config, text_config if has_text else None):
        if source is None:
            continue
        present, value = _field(source, "sliding_window")
        if not present:
            continue
        if value is None:
            raise ValueError("DeepSeek V4 sliding_window is None")
        window = int(value)
        if window <= 0:
            raise ValueError(f"sliding_window must be positive, got {value!r}")
        return window
    raise ValueError("DeepSeek V4 hf_config is missing sliding_window")


def compressed_rows_per_page(ratio: int) -> int:
    """Compressed rows per page: ``max(1, 256 // ratio)``."""
    ratio = int(ratio)
    if ratio <= 1:
        raise ValueError(f"compress ratio must be > 1, got {ratio}")
    return max(1, DEEPSEEK_V4_COMPRESSED_LOGICAL_BLOCK_SIZE // ratio)


def compressor_state_window_tokens(ratio: int, speculative_tokens: int = 1) -> int:
    """Tokens of ``[C | Z]`` rows a compressor must keep (ratio 4 widens with verify width)."""
    ratio = int(ratio)
    if ratio not in _STATE_WINDOW_TOKENS:
        raise ValueError(f"unsupported DeepSeek V4 compress_ratio={ratio}; expected 4 or 128")
    if ratio == 4:
        return max(_STATE_WINDOW_TOKENS[4], 4 + int(speculative_tokens))
    return _STATE_WINDOW_TOKENS[ratio]


# Tokens before a boundary D (a multiple of the ratio) that compressed entries after
# D still pool: ratio 4 overlaps (entry D/4 takes the first halves of window D/4 - 1),
# ratio 128 pools only its own window.
_CHECKPOINT_STATE_TOKENS = {4: 4, 128: 0}


def v4_checkpoint_window_tokens(specs: Sequence[Any]) -> dict[str, int]:
    """Per sliding group, the trailing tokens a prefix checkpoint at boundary ``D``
    must store for a request to resume at ``D`` (``D`` a multiple of 128, as every
    V4 prefix grain is: the history pages span 256 tokens).

    Window KV: the whole window (token ``D`` attends to ``[D-127, D]``). Compressor
    states: the rows of windows that entries after ``D``
    still pool, 4 tokens at ratio 4 and none at ratio 128, where ``D`` closes a window.
    Groups not recognized keep their whole window.
    """
    out: dict[str, int] = {}
    for spec in specs:
        if not spec.is_sliding:
            continue
        gid, window = spec.group_id, spec.sliding_window_tokens
        ratio = 4 if gid == V4_INDEXER_COMPRESSOR_STATE_GROUP_ID else parse_v4_compressor_state_group_id(gid)
        out[gid] = min(_CHECKPOINT_STATE_TOKENS[ratio], window) if ratio in _CHECKPOINT_STATE_TOKENS else window
    return out


def compress_ratios_in(layer_ratio: Sequence[int]) -> list[int]:
    """Sorted distinct compress ratios (> 1) in ``layer_ratio``; raises on unsupported ones."""
    ratios: set[int] = set()
    for raw in layer_ratio:
        ratio = int(raw)
        if ratio in (0, 1):
            continue
        if ratio not in SUPPORTED_COMPRESS_RATIOS:
            raise ValueError(
                f"unsupported DeepSeek V4 compress_ratio={ratio}; expected one of 0, 1, 4, 128"
            )
        ratios.add(ratio)
    return sorted(ratios)


def build_v4_cache_specs(
    hf_config: Any,
    *,
    layer_ratio: Sequence[int],
    speculative_tokens: int = 1,
) -> list[CacheGroupSpec]:
    """The DeepSeek-V4 cache groups, in order: window KV, then per ratio ascending its
    state and compressed groups, then the indexer state (only when ratio 4 is present).

    ``speculative_tokens`` (verify width k >= 1) widens the ratio-4 state windows to
    ``max(8, 4 + k)``; the default leaves them at 8 (hybridkv's one extension).

    As in the seed: ``hf_config.sliding_window`` is read, else
    ``hf_config.text_config.sliding_window``; ratios of 1 or less (0, 1, negative)
    are skipped; any other ratio than 4 or 128 raises ``ValueError``. Beyond the
    seed, a mapping config (a parsed ``config.json``) is read by key as well.
    :func:`hybridkv.models.layout.cache_layout` is the stricter layer.
    """
    if isinstance(speculative_tokens, bool):
        raise ValueError("speculative_tokens must be a positive integer")
    speculative_tokens = int(speculative_tokens)
    if speculative_tokens <= 0:
        raise ValueError(f"speculative_tokens must be a positive integer, got {speculative_tokens}")
    window = resolve_sliding_window(hf_config)
    ratios = sorted({int(r) for r in layer_ratio if int(r) > 1})
    for ratio in ratios:
        if ratio not in SUPPORTED_COMPRESS_RATIOS:
            raise ValueError(f"unsupported DeepSeek V4 compress_ratio={ratio}; expected 4 or 128")
    specs = [
        PagedCacheGroupSpec(
            group_id=V4_SWA_KV_GROUP_ID,
            retention="sliding_window",
            rows_per_page=V4_KERNEL_BLOCK_ROWS,
            entry_stride_tokens=1,
            sliding_window_tokens=window,
            family="state",
        )
    ]
    for ratio in ratios:
        specs.append(
            PagedCacheGroupSpec(
                group_id=v4_compressor_state_group_id(ratio),
                retention="sliding_window",
                rows_per_page=_STATE_ROWS_PER_PAGE[ratio],
                entry_stride_tokens=1,
                sliding_window_tokens=compressor_state_window_tokens(ratio, speculative_tokens),
                family="state",
                checkpoint_window_tokens=_CHECKPOINT_STATE_TOKENS[ratio],
            )
        )
        specs.append(
            PagedCacheGroupSpec(
                group_id=v4_compressed_kv_group_id(ratio),
                retention="full_history",
                rows_per_page=compressed_rows_per_page(ratio),
                entry_stride_tokens=ratio,
                sliding_window_tokens=None,
                family="history",
            )
        )
    if 4 in ratios:
        specs.append(
            PagedCacheGroupSpec(
                group_id=V4_INDEXER_COMPRESSOR_STATE_GROUP_ID,
                retention="sliding_window",
                rows_per_page=_STATE_ROWS_PER_PAGE[4],
                entry_stride_tokens=1,
                sliding_window_tokens=compressor_state_window_tokens(4, speculative_tokens),
                family="state",
                checkpoint_window_tokens=_CHECKPOINT_STATE_TOKENS[4],
            )
        )
    return specs


__all__ = [
    "DEEPSEEK_V4_COMPRESSED_LOGICAL_BLOCK_SIZE",
    "DEEPSEEK_V4_FP8_BLOCK_SIZE",
    "DEEPSEEK_V4_FP8_INDEXER_BLOCK_SIZE",
    "DEEPSEEK_V4_FP8_MAX",
    "DEEPSEEK_V4_FP8_QUANT_BLOCK",
    "DEEPSEEK_V4_FP8_SCALE_BYTES",
    "DEEPSEEK_V4_MXFP4_BLOCK_SIZE",
    "DEEPSEEK_V4_MXFP4_SCALE_BYTES",
    "DEEPSEEK_V4_SPARSE_PREFILL_TOPK_ALIGNMENT",
    "V4_INDEXER_COMPRESSOR_STATE_GROUP_ID",
    "V4_KERNEL_BLOCK_ROWS",
    "V4_SWA_KV_GROUP_ID",
    "build_v4_cache_specs",
    "compress_ratios_in",
    "compressed_rows_per_page",
    "compressor_state_window_tokens",
    "deepseek_v4_indexer_fp8_layout_from_row_bytes",
    "deepseek_v4_indexer_fp8_row_bytes",
    "deepseek_v4_indexer_fp8_scale_bytes",
    "deepseek_v4_indexer_mxfp4_layout_from_row_bytes",
    "deepseek_v4_indexer_mxfp4_row_bytes",
    "deepseek_v4_indexer_mxfp4_scale_dim",
    "deepseek_v4_indexer_mxfp4_value_bytes",
    "deepseek_v4_nope_dim",
    "deepseek_v4_swa_row_bytes",
    "deepseek_v4_swa_scale_dim",
    "deepseek_v4_swa_token_stride",
    "parse_v4_compressor_state_group_id",
    "resolve_sliding_window",
    "v4_compressed_kv_group_id",
    "v4_compressor_state_group_id",
]
