"""The seed-named module agrees with the seed on a broad grid of inputs.

``seed_oracle`` restates the seed's rules; every function of
``hybridkv.models.deepseek_v4`` that carries a seed name must give the same
value, or raise the same exception class, on every input below (about 8,000).
"""

import itertools
from types import SimpleNamespace

import numpy as np

import seed_oracle as seed
from hybridkv.models import deepseek_v4 as v4

DIMS = list(range(-70, 70)) + [96, 127, 128, 129, 192, 255, 256, 448, 512, 513, 576, 1024, "128", np.int64(64)]
PAIRS = [-64, -1, 0, 1, 32, 63, 64, 65, 128, 192, 448, 512, 576, "512", np.int32(64)]
ROW_BYTES = list(range(-300, 700)) + [8448, 8449, "68", np.int64(132)]
RATIOS = [-129, -128, -5, -4, -1, 0, 1, 2, 3, 4, 5, 8, 127, 128, 129, 256, "4", "128", np.int64(4)]
GROUP_IDS = [
    "v4.c4a.compressor_state", "v4.c128a.compressor_state", "v4.c-4a.compressor_state",
    "v4.c+8a.compressor_state", "v4.c 4a.compressor_state", "v4.ca.compressor_state",
    "v4.c4.5a.compressor_state", "v4.cxa.compressor_state", "v4.c4a.compressor_state_",
    "v4.c4a.compressed_kv", "v4.swa_kv", "v4.c4a.indexer_compressor_state", "", "v4.c",
    None, 4, b"v4.c4a.compressor_state",
]
WINDOWS = [None, -1, 0, 1, 64, 128, "96", 2.9, "x"]


def _agree(ours, theirs, *args):
    a, b = seed.outcome(ours, *args), seed.outcome(theirs, *args)
    return a == b, (ours.__name__, args, a, b)


def _check(pairs):
    differing = [detail for same, detail in pairs if not same]
    assert not differing, f"{len(differing)} inputs differ, first: {differing[:5]}"
    return len(pairs)


def test_kv_row_geometry_agrees():
    functions = [
        (v4.deepseek_v4_nope_dim, seed.nope_dim),
        (v4.deepseek_v4_swa_token_stride, seed.swa_token_stride),
        (v4.deepseek_v4_swa_scale_dim, seed.swa_scale_dim),
        (v4.deepseek_v4_swa_row_bytes, seed.swa_row_bytes),
    ]
    checked = _check(
        [_agree(ours, theirs, h, r) for ours, theirs in functions for h, r in itertools.product(PAIRS, PAIRS)]
    )
    assert checked == 4 * len(PAIRS) ** 2


def test_indexer_geometry_agrees():
    functions = [
        (v4.deepseek_v4_indexer_mxfp4_value_bytes, seed.mxfp4_value_bytes),
        (v4.deepseek_v4_indexer_mxfp4_scale_dim, seed.mxfp4_scale_dim),
        (v4.deepseek_v4_indexer_mxfp4_row_bytes, seed.mxfp4_row_bytes),
        (v4.deepseek_v4_indexer_fp8_scale_bytes, seed.fp8_scale_bytes),
        (v4.deepseek_v4_indexer_fp8_row_bytes, seed.fp8_row_bytes),
    ]
    _check([_agree(ours, theirs, d) for ours, theirs in functions for d in DIMS])


def test_inverse_layouts_agree_including_zero_and_negative():
    functions = [
        (v4.deepseek_v4_indexer_mxfp4_layout_from_row_bytes, seed.mxfp4_layout_from_row_bytes),
        (v4.deepseek_v4_indexer_fp8_layout_from_row_bytes, seed.fp8_layout_from_row_bytes),
    ]
    _check([_agree(ours, theirs, r) for ours, theirs in functions for r in ROW_BYTES])
    assert v4.deepseek_v4_indexer_mxfp4_layout_from_row_bytes(0) == (0, 0, 0)
    assert v4.deepseek_v4_indexer_fp8_layout_from_row_bytes(0) == (0, 0)


def test_group_ids_agree():
    pairs = [_agree(v4.v4_compressor_state_group_id, seed.state_group_id, r) for r in RATIOS]
    pairs += [_agree(v4.v4_compressed_kv_group_id, seed.compressed_kv_group_id, r) for r in RATIOS]
    pairs += [_agree(v4.parse_v4_compressor_state_group_id, seed.parse_state_group_id, g) for g in GROUP_IDS]
    pairs += [
        _agree(v4.parse_v4_compressor_state_group_id, seed.parse_state_group_id, seed.state_group_id(r))
        for r in range(-50, 300)
    ]
    _check(pairs)


def _specs_as_tuples(config, ratios):
    specs = v4.build_v4_cache_specs(config, layer_ratio=ratios)
    return [
        (s.group_id, s.retention, s.rows_per_page, s.entry_stride_tokens, s.sliding_window_tokens, s.family)
        for s in specs
    ]


def _configs():
    for window in WINDOWS:
        yield SimpleNamespace(sliding_window=window)
        yield SimpleNamespace(text_config=SimpleNamespace(sliding_window=window))
        yield SimpleNamespace(sliding_window=window, text_config=SimpleNamespace(sliding_window=64))
    yield SimpleNamespace()
    yield SimpleNamespace(text_config=None)


def test_cache_specs_agree_over_ratio_lists_and_windows():
    ratio_lists = [[]] + [[r] for r in RATIOS] + [list(p) for p in itertools.combinations(RATIOS[:12], 2)]
    ratio_lists += [[0, 0] + [4, 128] * 20 + [4], [128, 128] + [4, 128] * 29 + [4], [-4, 4, -128, 128]]
    pairs = []
    for config in _configs():
        for ratios in ratio_lists:
            a = seed.outcome(_specs_as_tuples, config, ratios)
            b = seed.outcome(seed.cache_specs, config, ratios)
            pairs.append((a == b, (getattr(config, "sliding_window", "-"), ratios, a, b)))
    assert _check(pairs) > 2000


def test_mapping_configs_are_the_one_extension():
    # The seed reads attributes only; hybridkv also reads a parsed config.json.
    assert seed.outcome(seed.cache_specs, {"sliding_window": 128}, [4])[0] == "raises"
    assert _specs_as_tuples({"sliding_window": 128}, [4]) == seed.cache_specs(SimpleNamespace(sliding_window=128), [4])
