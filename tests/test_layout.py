"""hybridkv.models.layout: config reading and exact page bytes per group.

Byte values are worked out by hand from the byte formats of docs/codecs.md:
KV row 584 B = 576 token data + 8 scale; a page of R rows is padded to a
multiple of 576. MXFP4 indexer row 68 B, FP8 132 B. fp32 [C|Z] state rows.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from hybridkv.models.layout import (
    BUNDLED_MODELS,
    GroupLayout,
    ModelCacheLayout,
    cache_layout,
    load_model_config,
)

FLASH_MAIN = [0, 0] + [4, 128] * 20 + [4]
PRO_MAIN = [128, 128] + [4, 128] * 29 + [4]

# Per-layer page bytes, by hand.
SWA_LAYER = 37_440  # 64 rows * 584 = 37,376 -> next multiple of 576 = 65 * 576
C4_KV_LAYER = 37_440  # 64 rows, same padding
C128_KV_LAYER = 1_728  # 2 rows * 584 = 1,168 -> 3 * 576
MXFP4_PLANE = 64 * 68  # 4,352, unpadded
FP8_PLANE = 64 * 132  # 8,448
C4_STATE_LAYER = 4 * (2 * 2 * 512 * 4)  # 4 rows of 8 KiB
C128_STATE_LAYER = 8 * (2 * 512 * 4)  # 8 rows of 4 KiB
INDEXER_STATE_LAYER = 4 * (2 * 2 * 128 * 4)  # 4 rows of 2 KiB


def _minimal_config(**overrides):
    config = {
        "num_hidden_layers": 43,
        "compress_ratios": FLASH_MAIN + [0],
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "index_head_dim": 128,
        "sliding_window": 128,
        "max_position_embeddings": 1 << 20,
    }
    config.update(overrides)
    return config


def test_flash_layout_groups_layers_and_page_bytes():
    layout = cache_layout("deepseek-v4-flash")
    assert isinstance(layout, ModelCacheLayout)
    assert layout.name == "deepseek-v4-flash"
    assert layout.layer_ratios == tuple(FLASH_MAIN)
    assert (layout.head_dim, layout.rope_dim, layout.index_head_dim) == (512, 64, 128)
    assert (layout.indexer, layout.sliding_window_tokens) == ("mxfp4", 128)
    assert (layout.kv_row_bytes, layout.kv_token_stride_bytes, layout.indexer_row_bytes) == (584, 576, 68)
    assert layout.max_position_embeddings == 1_048_576
    c4_layers = tuple(range(2, 43, 2))
    c128_layers = tuple(range(3, 42, 2))
    assert len(c4_layers) == 21 and len(c128_layers) == 20
    expected = [
        ("v4.swa_kv", tuple(range(43)), 43 * SWA_LAYER),
        ("v4.c4a.compressor_state", c4_layers, 21 * C4_STATE_LAYER),
        ("v4.c4a.compressed_kv", c4_layers, 21 * (C4_KV_LAYER + MXFP4_PLANE)),
        ("v4.c128a.compressor_state", c128_layers, 20 * C128_STATE_LAYER),
        ("v4.c128a.compressed_kv", c128_layers, 20 * C128_KV_LAYER),
        ("v4.c4a.indexer_compressor_state", c4_layers, 21 * INDEXER_STATE_LAYER),
    ]
    got = [(g.group_id, g.layers, g.page_bytes) for g in layout.groups]
    assert got == expected
    assert [g.spec for g in layout.groups] == list(layout.specs)
    assert layout.group("v4.c4a.compressed_kv").plane_bytes == (("kv", 37_440), ("indexer", 4_352))
    assert layout.group("v4.c128a.compressed_kv").plane_bytes == (("kv", 1_728),)
    assert layout.group("v4.c4a.compressor_state").plane_bytes == (("state", 32_768),)
    assert layout.group("v4.c4a.compressed_kv").layer_page_bytes == 41_792


def test_flash_ideal_bytes_per_token_is_3514_25():
    layout = cache_layout("deepseek-v4-flash")
    # 21 CSA layers * (584 + 68) / 4 + 20 HCA layers * 584 / 128.
    assert layout.group("v4.c4a.compressed_kv").ideal_bytes_per_token == 21 * 163
    assert layout.group("v4.c128a.compressed_kv").ideal_bytes_per_token == 20 * 4.5625
    assert layout.ideal_bytes_per_token == 3_514.25
    for gid in ("v4.swa_kv", "v4.c4a.compressor_state", "v4.c128a.compressor_state"):
        assert layout.group(gid).ideal_bytes_per_token == 0


def test_flash_fixed_bytes_per_request():
    layout = cache_layout("deepseek-v4-flash", include_mtp=True)
    # Window KV: 44 layers * 128 tokens * 584 B = 3.3 MB (docs/planning.md).
    assert layout.group("v4.swa_kv").ideal_bytes_per_request == 44 * 128 * 584 == 3_289_088
    state = sum(
        layout.group(gid).ideal_bytes_per_request
        for gid in ("v4.c4a.compressor_state", "v4.c128a.compressor_state", "v4.c4a.indexer_compressor_state")
    )
    # 21*8*8 KiB + 20*128*4 KiB + 21*8*2 KiB = 12.2 MB.
    assert state == 21 * 8 * 8192 + 20 * 128 * 4096 + 21 * 8 * 2048 == 12_206_080


def test_fp8_indexer_plane():
    layout = cache_layout("deepseek-v4-flash", indexer="fp8")
    assert layout.indexer_row_bytes == 132
    assert layout.group("v4.c4a.compressed_kv").page_bytes == 21 * (37_440 + FP8_PLANE)
    # 584/4 + 132/4 = 179 B per token per CSA layer.
    assert layout.ideal_bytes_per_token == 21 * 179 + 20 * 4.5625


def test_pro_layout():
    layout = cache_layout("deepseek-v4-pro")
    assert layout.layer_ratios == tuple(PRO_MAIN)
    sizes = {g.group_id: len(g.layers) for g in layout.groups}
    assert sizes == {
        "v4.swa_kv": 61,
        "v4.c4a.compressor_state": 30,
        "v4.c4a.compressed_kv": 30,
        "v4.c128a.compressor_state": 31,
        "v4.c128a.compressed_kv": 31,
        "v4.c4a.indexer_compressor_state": 30,
    }
    assert layout.group("v4.c128a.compressed_kv").layers[:3] == (0, 1, 3)
    assert layout.ideal_bytes_per_token == 30 * 163 + 31 * 4.5625  # 5,031.44
    assert layout.group("v4.c128a.compressed_kv").page_bytes == 31 * 1_728


def test_include_mtp_adds_the_window_only_mtp_layer():
    layout = cache_layout("deepseek-v4-flash", include_mtp=True)
    assert layout.num_layers == 44 and layout.num_main_layers == 43
    assert layout.layer_ratios[-1] == 0
    assert layout.group("v4.swa_kv").layers == tuple(range(44))
    assert layout.group("v4.swa_kv").page_bytes == 44 * SWA_LAYER
    assert layout.group("v4.c4a.compressed_kv").page_bytes == 21 * (37_440 + 4_352)


def test_mtp_layer_with_a_ratio_joins_that_group():
    config = _minimal_config(compress_ratios=FLASH_MAIN + [4])
    with_mtp = cache_layout(config, include_mtp=True)
    assert with_mtp.group("v4.c4a.compressed_kv").layers[-1] == 43
    assert len(cache_layout(config).group("v4.c4a.compressed_kv").layers) == 21


def test_speculative_tokens_widen_state_windows():
    layout = cache_layout("deepseek-v4-flash", speculative_tokens=6)
    assert layout.speculative_tokens == 6
    assert layout.group("v4.c4a.compressor_state").spec.sliding_window_tokens == 10
    assert layout.group("v4.c4a.indexer_compressor_state").spec.sliding_window_tokens == 10
    # Page bytes do not depend on the window.
    assert layout.group("v4.c4a.compressor_state").page_bytes == 21 * C4_STATE_LAYER


def test_smaller_geometry():
    # head_dim 128 / rope 64: row 194 B, token stride 192. 64 rows = 12,416 -> 65 * 192 = 12,480.
    config = _minimal_config(head_dim=128, index_head_dim=64, compress_ratios=[4, 128])
    config["num_hidden_layers"] = 2
    layout = cache_layout(config)
    assert layout.group("v4.swa_kv").page_bytes == 2 * 12_480
    # 2 rows = 388 B -> 2 * 192 = 384 is too small -> 576.
    assert layout.group("v4.c128a.compressed_kv").page_bytes == 576
    # MXFP4 64-d key: 32 + 2 = 34 B per row.
    assert layout.group("v4.c4a.compressed_kv").plane_bytes == (("kv", 12_480), ("indexer", 64 * 34))
    assert layout.group("v4.c4a.compressor_state").page_bytes == 4 * 2 * 2 * 128 * 4
    assert layout.group("v4.c4a.indexer_compressor_state").page_bytes == 4 * 2 * 2 * 64 * 4


def test_model_without_ratio_4_needs_no_indexer():
    config = _minimal_config(compress_ratios=[0, 128, 128], num_hidden_layers=3, index_head_dim=None)
    layout = cache_layout(config)
    assert [g.group_id for g in layout.groups] == [
        "v4.swa_kv",
        "v4.c128a.compressor_state",
        "v4.c128a.compressed_kv",
    ]
    assert (layout.index_head_dim, layout.indexer_row_bytes) == (None, None)
    assert layout.ideal_bytes_per_token == 2 * 584 / 128


def test_sources_agree(tmp_path):
    from_name = cache_layout("deepseek-v4-flash")
    config = load_model_config("deepseek-v4-flash")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    for source in (config, path, str(path), tmp_path, SimpleNamespace(**config)):
        layout = cache_layout(source)
        assert layout.groups == from_name.groups
        assert layout.layer_ratios == from_name.layer_ratios


def test_config_object_with_to_dict_and_text_config():
    class HFConfig:
        def __init__(self, data):
            self._data = data

        def to_dict(self):
            return dict(self._data)

    inner = _minimal_config()
    wrapped = HFConfig({"model_type": "wrapper", "text_config": inner})
    layout = cache_layout(wrapped)
    assert layout.sliding_window_tokens == 128
    assert layout.layer_ratios == tuple(FLASH_MAIN)
    nested_objects = SimpleNamespace(text_config=SimpleNamespace(**inner))
    assert cache_layout(nested_objects).groups == layout.groups


def test_integer_like_config_values():
    config = _minimal_config(
        compress_ratios=np.array(FLASH_MAIN + [0]), head_dim=np.int64(512), sliding_window="128"
    )
    assert cache_layout(config).groups == cache_layout("deepseek-v4-flash").groups


def test_bundled_configs_hold_the_facts_table():
    flash = load_model_config("deepseek-v4-flash")
    pro = load_model_config("deepseek-v4-pro")
    assert BUNDLED_MODELS == ("deepseek-v4-flash", "deepseek-v4-pro")
    assert flash["compress_ratios"] == [0, 0] + [4, 128] * 20 + [4, 0]
    assert pro["compress_ratios"] == [128, 128] + [4, 128] * 29 + [4, 0]
    for key, f, p in [
        ("num_hidden_layers", 43, 61),
        ("hidden_size", 4096, 7168),
        ("num_attention_heads", 64, 128),
        ("num_key_value_heads", 1, 1),
        ("head_dim", 512, 512),
        ("qk_rope_head_dim", 64, 64),
        ("q_lora_rank", 1024, 1536),
        ("o_groups", 8, 16),
        ("o_lora_rank", 1024, 1024),
        ("sliding_window", 128, 128),
        ("index_n_heads", 64, 64),
        ("index_head_dim", 128, 128),
        ("index_topk", 512, 1024),
        ("rope_theta", 10000, 10000),
        ("compress_rope_theta", 160000, 160000),
        ("max_position_embeddings", 1_048_576, 1_048_576),
        ("num_nextn_predict_layers", 1, 1),
        ("model_type", "deepseek_v4", "deepseek_v4"),
    ]:
        assert (flash[key], pro[key]) == (f, p), key
    for config in (flash, pro):
        scaling = config["rope_scaling"]
        assert (scaling["type"], scaling["factor"], scaling["original_max_position_embeddings"]) == (
            "yarn",
            16,
            65536,
        )
        assert (scaling["beta_fast"], scaling["beta_slow"]) == (32, 1)


def test_load_returns_a_fresh_copy():
    a = load_model_config("deepseek-v4-flash")
    a["num_hidden_layers"] = 1
    assert load_model_config("deepseek-v4-flash")["num_hidden_layers"] == 43
    source = {"a": 1}
    assert load_model_config(source) is not source


def test_layout_is_frozen():
    layout = cache_layout("deepseek-v4-flash")
    with pytest.raises(AttributeError):
        layout.head_dim = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        layout.groups[0].layers = ()  # type: ignore[misc]
    assert isinstance(layout.groups[0], GroupLayout)
    with pytest.raises(KeyError, match="no group"):
        layout.group("v4.nope")


# --- errors -------------------------------------------------------------------

def test_not_a_v4_config():
    with pytest.raises(ValueError, match="not a DeepSeek-V4 config.*llama"):
        cache_layout({"model_type": "llama", "num_hidden_layers": 32, "sliding_window": 4096})


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"compress_ratios": [4] * 42}, "fewer than num_hidden_layers"),
        ({"compress_ratios": "4,128"}, "list of integers"),
        ({"compress_ratios": [4, "x"] * 22}, "list of integers"),
        ({"compress_ratios": [4.5] * 44}, "list of integers"),
        ({"compress_ratios": {"0": 4}}, "list of integers"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"compress_ratios": [4, 8] + [4] * 42}, "compress_ratio=8"),
        ({"num_hidden_layers": None}, "missing num_hidden_layers"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_hidden_layers": 4.5}, "num_hidden_layers"),
        ({"head_dim": None}, "missing head_dim"),
        ({"head_dim": 64}, "larger than rope_dim"),
        ({"qk_rope_head_dim": "sixty"}, "qk_rope_head_dim"),
        ({"index_head_dim": None}, "missing index_head_dim"),
        ({"index_head_dim": 48}, "divisible by 32"),
        ({"sliding_window": 0}, "positive"),
        ({"sliding_window": None}, "sliding_window"),
        ({"sliding_window": [128]}, "invalid DeepSeek-V4 config"),
        ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers=2"),
    ],
)
def test_invalid_configs(overrides, match):
    with pytest.raises(ValueError, match=match):
        cache_layout(_minimal_config(**overrides))


def test_bad_indexer_and_speculative_tokens():
    with pytest.raises(ValueError, match="indexer must be one of"):
        cache_layout("deepseek-v4-flash", indexer="fp4")
    with pytest.raises(ValueError, match="speculative_tokens"):
        cache_layout("deepseek-v4-flash", speculative_tokens=0)
    for width in (1.5, 2.0, "2", True):  # 1.5 was taken as a width of 1
        with pytest.raises(ValueError, match="speculative_tokens must be an integer"):
            cache_layout("deepseek-v4-flash", speculative_tokens=width)


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="no such model config 'deepseek-v5'.*bundled models"):
        cache_layout("deepseek-v5")
    with pytest.raises(ValueError, match="no such model config"):
        cache_layout(tmp_path)  # a folder without config.json
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        cache_layout(broken)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        cache_layout(listing)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="cannot read|not valid JSON|not UTF-8 text"):
        cache_layout(binary)
    with pytest.raises(ValueError, match="cannot read a model config"):
        cache_layout(42)
