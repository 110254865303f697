"""Pins the seed module hybridkv.models.deepseek_v4 against the published V4 cache groups and byte sizes (docs/planning.md, docs/codecs.md).

Expected values are worked out by hand here, never by calling the code under test.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.models import deepseek_v4 as v4
from hybridkv.spec import CacheGroupSpec

FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]  # 43 main layers
PRO_RATIOS = [128, 128] + [4, 128] * 29 + [4]  # 61 main layers
WINDOW = SimpleNamespace(sliding_window=128)


def _spec(gid, retention, rows, stride, window, family, checkpoint=None):
    return CacheGroupSpec(gid, retention, rows, stride, window, family, checkpoint)


# The V4 cache-group table, row by row (the last column: what a prefix checkpoint stores).
FLASH_SPECS = [
    _spec("v4.swa_kv", "sliding_window", 64, 1, 128, "state"),
    _spec("v4.c4a.compressor_state", "sliding_window", 4, 1, 8, "state", 4),
    _spec("v4.c4a.compressed_kv", "full_history", 64, 4, None, "history"),
    _spec("v4.c128a.compressor_state", "sliding_window", 8, 1, 128, "state", 0),
    _spec("v4.c128a.compressed_kv", "full_history", 2, 128, None, "history"),
    _spec("v4.c4a.indexer_compressor_state", "sliding_window", 4, 1, 8, "state", 4),
]


# --- KV row geometry ----------------------------------------------------------

def test_kv_row_geometry_512_64():
    # 448 FP8 nope bytes + 64 bf16 rope values (128 B) = 576; 448/64 + 1 = 8 scale bytes.
    assert v4.deepseek_v4_nope_dim(512, 64) == 448
    assert v4.deepseek_v4_swa_token_stride(512, 64) == 576
    assert v4.deepseek_v4_swa_scale_dim(512, 64) == 8
    assert v4.deepseek_v4_swa_row_bytes(512, 64) == 584


def test_kv_row_geometry_128_64():
    # nope 64 -> stride 64 + 128 = 192, scales 64/64 + 1 = 2, row 194.
    assert v4.deepseek_v4_swa_token_stride(128, 64) == 192
    assert v4.deepseek_v4_swa_scale_dim(128, 64) == 2
    assert v4.deepseek_v4_swa_row_bytes(128, 64) == 194


@pytest.mark.parametrize("head_dim, rope_dim", [(64, 64), (32, 64), (0, 0)])
def test_nope_dim_must_be_positive(head_dim, rope_dim):
    with pytest.raises(ValueError, match="must be larger"):
        v4.deepseek_v4_nope_dim(head_dim, rope_dim)
    with pytest.raises(ValueError):
        v4.deepseek_v4_swa_row_bytes(head_dim, rope_dim)


def test_nope_dim_must_be_multiple_of_64():
    with pytest.raises(ValueError, match="divisible by 64"):
        v4.deepseek_v4_swa_scale_dim(512, 32)  # nope 480
    with pytest.raises(ValueError, match="divisible by 64"):
        v4.deepseek_v4_swa_row_bytes(160, 64)  # nope 96


def test_geometry_converts_integer_like_arguments():
    assert v4.deepseek_v4_swa_row_bytes(np.int64(512), np.int32(64)) == 584
    assert v4.deepseek_v4_swa_row_bytes("512", "64") == 584
    assert v4.deepseek_v4_indexer_mxfp4_row_bytes(np.int16(128)) == 68
    assert v4.deepseek_v4_indexer_fp8_row_bytes("128") == 132


# --- indexer geometry -----------------------------------------------------------

def test_indexer_mxfp4_128():
    # 128 e2m1 values packed two per byte = 64 B, one UE8M0 byte per 32 values = 4 B.
    assert v4.deepseek_v4_indexer_mxfp4_value_bytes(128) == 64
    assert v4.deepseek_v4_indexer_mxfp4_scale_dim(128) == 4
    assert v4.deepseek_v4_indexer_mxfp4_row_bytes(128) == 68
    assert v4.deepseek_v4_indexer_mxfp4_layout_from_row_bytes(68) == (128, 64, 4)


def test_indexer_fp8_128():
    # 128 e4m3 bytes + one fp32 scale per 128 values.
    assert v4.deepseek_v4_indexer_fp8_scale_bytes(128) == 4
    assert v4.deepseek_v4_indexer_fp8_row_bytes(128) == 132
    assert v4.deepseek_v4_indexer_fp8_layout_from_row_bytes(132) == (128, 4)
    assert v4.deepseek_v4_indexer_fp8_layout_from_row_bytes(264) == (256, 8)


def test_indexer_errors():
    with pytest.raises(ValueError, match="even"):
        v4.deepseek_v4_indexer_mxfp4_value_bytes(33)
    with pytest.raises(ValueError, match="divisible by 32"):
        v4.deepseek_v4_indexer_mxfp4_scale_dim(48)
    with pytest.raises(ValueError, match="divisible by 32"):
        v4.deepseek_v4_indexer_mxfp4_row_bytes(48)
    with pytest.raises(ValueError, match="divisible by 128"):
        v4.deepseek_v4_indexer_fp8_scale_bytes(64)
    with pytest.raises(ValueError, match="divisible by 128"):
        v4.deepseek_v4_indexer_fp8_row_bytes(192)
    for bad in (16, 18, 67, 69, -16):
        with pytest.raises(ValueError, match="multiple of 17"):
            v4.deepseek_v4_indexer_mxfp4_layout_from_row_bytes(bad)
    for bad in (131, 133, 200, -131):
        with pytest.raises(ValueError, match="multiple of 132"):
            v4.deepseek_v4_indexer_fp8_layout_from_row_bytes(bad)


def test_layout_inverses_take_zero_and_negative_multiples_as_the_seed():
    # The seed only checks the block multiple: 0 bytes is 0 blocks, -17 is -1 block.
    assert v4.deepseek_v4_indexer_mxfp4_layout_from_row_bytes(0) == (0, 0, 0)
    assert v4.deepseek_v4_indexer_mxfp4_layout_from_row_bytes(-17) == (-32, -16, -1)
    assert v4.deepseek_v4_indexer_fp8_layout_from_row_bytes(0) == (0, 0)
    assert v4.deepseek_v4_indexer_fp8_layout_from_row_bytes(-132) == (-128, -4)


@given(blocks=st.integers(min_value=1, max_value=4096))
def test_mxfp4_layout_round_trip(blocks):
    dim = 32 * blocks
    row_bytes = v4.deepseek_v4_indexer_mxfp4_row_bytes(dim)
    assert row_bytes == 17 * blocks
    assert v4.deepseek_v4_indexer_mxfp4_layout_from_row_bytes(row_bytes) == (dim, 16 * blocks, blocks)


@given(blocks=st.integers(min_value=1, max_value=4096))
def test_fp8_layout_round_trip(blocks):
    dim = 128 * blocks
    row_bytes = v4.deepseek_v4_indexer_fp8_row_bytes(dim)
    assert row_bytes == 132 * blocks
    assert v4.deepseek_v4_indexer_fp8_layout_from_row_bytes(row_bytes) == (dim, 4 * blocks)


@given(row_bytes=st.integers(min_value=1, max_value=10**6))
def test_layout_inverses_accept_exactly_the_multiples(row_bytes):
    if row_bytes % 17 == 0:
        dim, _, _ = v4.deepseek_v4_indexer_mxfp4_layout_from_row_bytes(row_bytes)
        assert v4.deepseek_v4_indexer_mxfp4_row_bytes(dim) == row_bytes
    else:
        with pytest.raises(ValueError):
            v4.deepseek_v4_indexer_mxfp4_layout_from_row_bytes(row_bytes)
    if row_bytes % 132 == 0:
        dim, _ = v4.deepseek_v4_indexer_fp8_layout_from_row_bytes(row_bytes)
        assert v4.deepseek_v4_indexer_fp8_row_bytes(dim) == row_bytes
    else:
        with pytest.raises(ValueError):
            v4.deepseek_v4_indexer_fp8_layout_from_row_bytes(row_bytes)


# --- constants and group ids ------------------------------------------------------

def test_constants():
    assert v4.V4_KERNEL_BLOCK_ROWS == 64
    assert v4.V4_SWA_KV_GROUP_ID == "v4.swa_kv"
    assert v4.V4_INDEXER_COMPRESSOR_STATE_GROUP_ID == "v4.c4a.indexer_compressor_state"
    assert v4.DEEPSEEK_V4_COMPRESSED_LOGICAL_BLOCK_SIZE == 256
    assert v4.DEEPSEEK_V4_FP8_MAX == 448.0
    assert v4.DEEPSEEK_V4_FP8_QUANT_BLOCK == 64
    assert v4.DEEPSEEK_V4_FP8_BLOCK_SIZE == 128
    assert v4.DEEPSEEK_V4_FP8_INDEXER_BLOCK_SIZE == 128
    assert v4.DEEPSEEK_V4_FP8_SCALE_BYTES == 4
    assert v4.DEEPSEEK_V4_MXFP4_BLOCK_SIZE == 32
    assert v4.DEEPSEEK_V4_MXFP4_SCALE_BYTES == 1
    assert v4.DEEPSEEK_V4_SPARSE_PREFILL_TOPK_ALIGNMENT == 128


def test_group_ids():
    assert v4.v4_compressor_state_group_id(4) == "v4.c4a.compressor_state"
    assert v4.v4_compressed_kv_group_id(128) == "v4.c128a.compressed_kv"
    assert v4.v4_compressor_state_group_id(np.int64(128)) == "v4.c128a.compressor_state"


@pytest.mark.parametrize(
    "group_id, ratio",
    [
        ("v4.c4a.compressor_state", 4),
        ("v4.c128a.compressor_state", 128),
        ("v4.c4a.compressed_kv", None),
        ("v4.c4a.indexer_compressor_state", None),
        ("v4.swa_kv", None),
        ("v4.ca.compressor_state", None),
        ("v4.c4.5a.compressor_state", None),
        ("v4.cxa.compressor_state", None),
        ("v4.c4a.compressor_state_", None),
        ("", None),
    ],
)
def test_parse_state_group_id(group_id, ratio):
    assert v4.parse_v4_compressor_state_group_id(group_id) == ratio


@pytest.mark.parametrize("group_id", [None, 4])
def test_parse_state_group_id_non_string_raises_as_the_seed(group_id):
    # The seed calls str methods on the id: anything else raises AttributeError.
    with pytest.raises(AttributeError):
        v4.parse_v4_compressor_state_group_id(group_id)


@given(ratio=st.integers(min_value=0, max_value=10**9))
def test_state_group_id_round_trip(ratio):
    assert v4.parse_v4_compressor_state_group_id(v4.v4_compressor_state_group_id(ratio)) == ratio


# --- build_v4_cache_specs ---------------------------------------------------------

def test_flash_specs_match_the_facts_table():
    specs = v4.build_v4_cache_specs(WINDOW, layer_ratio=FLASH_RATIOS)
    assert specs == FLASH_SPECS
    assert [s.page_tokens for s in specs] == [64, 4, 256, 8, 256, 4]


def test_pro_specs_same_groups_as_flash():
    # V4-Pro has both ratios (30 x 4, 31 x 128) and no window-only main layer.
    assert PRO_RATIOS.count(4) == 30 and PRO_RATIOS.count(128) == 31
    config = {"sliding_window": 128, "num_hidden_layers": 61}
    assert v4.build_v4_cache_specs(config, layer_ratio=PRO_RATIOS) == FLASH_SPECS


def test_group_order_follows_ratios_ascending_regardless_of_layer_order():
    specs = v4.build_v4_cache_specs(WINDOW, layer_ratio=[128, 4, 128, 0])
    assert [s.group_id for s in specs] == [s.group_id for s in FLASH_SPECS]


def test_only_ratio_128():
    specs = v4.build_v4_cache_specs(WINDOW, layer_ratio=[0, 128, 128])
    assert [s.group_id for s in specs] == [
        "v4.swa_kv",
        "v4.c128a.compressor_state",
        "v4.c128a.compressed_kv",
    ]


def test_only_ratio_4_adds_indexer_state_last():
    specs = v4.build_v4_cache_specs(WINDOW, layer_ratio=[4])
    assert [s.group_id for s in specs] == [
        "v4.swa_kv",
        "v4.c4a.compressor_state",
        "v4.c4a.compressed_kv",
        "v4.c4a.indexer_compressor_state",
    ]


@pytest.mark.parametrize("ratios", [[], [0], [1], [0, 1, 0, 1]])
def test_ratios_0_and_1_add_no_groups(ratios):
    specs = v4.build_v4_cache_specs(WINDOW, layer_ratio=ratios)
    assert specs == [FLASH_SPECS[0]]


@pytest.mark.parametrize("ratios", [[-1], [-4, 0], [-128, 1, -7]])
def test_ratios_below_2_add_no_groups_even_negative(ratios):
    # The seed keeps only ratios > 1; a negative ratio is skipped like 0 and 1.
    assert v4.build_v4_cache_specs(WINDOW, layer_ratio=ratios) == [FLASH_SPECS[0]]


@pytest.mark.parametrize("bad", [2, 8, 3, 64, 256])
def test_unsupported_ratio_raises(bad):
    with pytest.raises(ValueError, match="compress_ratio"):
        v4.build_v4_cache_specs(WINDOW, layer_ratio=[0, 4, bad])


def test_window_from_text_config():
    config = SimpleNamespace(text_config=SimpleNamespace(sliding_window=96))
    specs = v4.build_v4_cache_specs(config, layer_ratio=[4])
    assert specs[0].sliding_window_tokens == 96
    nested = {"text_config": {"sliding_window": 64}}
    assert v4.build_v4_cache_specs(nested, layer_ratio=[])[0].sliding_window_tokens == 64


def test_top_level_window_wins_over_text_config():
    config = {"sliding_window": 128, "text_config": {"sliding_window": 64}}
    assert v4.build_v4_cache_specs(config, layer_ratio=[])[0].sliding_window_tokens == 128


def test_window_converted_with_int():
    assert v4.build_v4_cache_specs({"sliding_window": "256"}, layer_ratio=[])[0].sliding_window_tokens == 256
    assert (
        v4.build_v4_cache_specs({"sliding_window": np.int64(32)}, layer_ratio=[])[0].sliding_window_tokens
        == 32
    )


@pytest.mark.parametrize(
    "config, match",
    [
        ({}, "missing sliding_window"),
        (SimpleNamespace(), "missing sliding_window"),
        ({"text_config": {}}, "missing sliding_window"),
        ({"sliding_window": None}, "None"),
        ({"text_config": {"sliding_window": None}}, "None"),
        (SimpleNamespace(sliding_window=None), "None"),
        ({"sliding_window": 0}, "positive"),
        ({"sliding_window": -128}, "positive"),
        ({"text_config": {"sliding_window": -1}}, "positive"),
    ],
)
def test_bad_window_raises(config, match):
    with pytest.raises(ValueError, match=match):
        v4.build_v4_cache_specs(config, layer_ratio=FLASH_RATIOS)


def test_integer_like_ratios_are_converted():
    as_numpy = np.array(FLASH_RATIOS, dtype=np.int64)
    assert v4.build_v4_cache_specs(WINDOW, layer_ratio=as_numpy) == FLASH_SPECS
    as_text = [str(r) for r in FLASH_RATIOS]
    assert v4.build_v4_cache_specs(WINDOW, layer_ratio=as_text) == FLASH_SPECS
    assert v4.build_v4_cache_specs(WINDOW, layer_ratio=FLASH_RATIOS, speculative_tokens="1") == FLASH_SPECS


def _c4_windows(specs):
    return {s.group_id: s.sliding_window_tokens for s in specs if s.group_id.startswith("v4.c4a.") and s.is_sliding}


@pytest.mark.parametrize(
    "k, window",
    [(1, 8), (2, 8), (3, 8), (4, 8), (5, 9), (7, 11), (np.int64(6), 10), ("5", 9)],
)
def test_speculative_tokens_widen_ratio4_state_windows(k, window):
    specs = v4.build_v4_cache_specs(WINDOW, layer_ratio=FLASH_RATIOS, speculative_tokens=k)
    assert _c4_windows(specs) == {
        "v4.c4a.compressor_state": window,
        "v4.c4a.indexer_compressor_state": window,
    }
    # Nothing else changes: window KV and the ratio-128 state stay at 128.
    others = [s for s in specs if s.group_id not in _c4_windows(specs)]
    assert others == [s for s in FLASH_SPECS if s.group_id not in _c4_windows(FLASH_SPECS)]


def test_default_speculative_output_unchanged():
    assert v4.build_v4_cache_specs(WINDOW, layer_ratio=FLASH_RATIOS) == v4.build_v4_cache_specs(
        WINDOW, layer_ratio=FLASH_RATIOS, speculative_tokens=1
    )


@pytest.mark.parametrize("k", [0, -1, True, "0"])
def test_bad_speculative_tokens(k):
    with pytest.raises(ValueError, match="speculative_tokens"):
        v4.build_v4_cache_specs(WINDOW, layer_ratio=FLASH_RATIOS, speculative_tokens=k)


def test_compressed_rows_per_page():
    assert v4.compressed_rows_per_page(4) == 64
    assert v4.compressed_rows_per_page(128) == 2
    assert v4.compressed_rows_per_page(512) == 1
    with pytest.raises(ValueError):
        v4.compressed_rows_per_page(1)
