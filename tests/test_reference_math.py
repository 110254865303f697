"""The reference layer's math pieces and the dense path, checked against hand-worked numbers."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.codecs import KVRowCodec, MXFP4IndexerCodec
from hybridkv.reference.config import (
    CompressorWeights,
    ReferenceConfig,
    YarnScaling,
    build_model,
)
from hybridkv.reference.dense import dense_forward
from hybridkv.reference.layer import (
    all_visible_entries,
    attend,
    compress_entries,
    compressor_slot_positions,
    hadamard,
    hadamard_matrix,
    index_scores,
    rms_norm,
    select_topk,
    visible_entries,
    window_key_positions,
)
from hybridkv.reference.rope import apply_rope, rope_frequencies, yarn_correction_range

CONFIG = ReferenceConfig()


# --- RoPE -----------------------------------------------------------------------

def test_rope_rotates_interleaved_pairs_by_position_times_frequency():
    freqs = np.array([0.5, 0.25])
    x = np.array([[1.0, 0.0, 0.0, 2.0]])  # pairs (1, 0) and (0, 2)
    out = apply_rope(x, np.array([2]), freqs)
    # pair 0 turns by 1 rad, pair 1 by 0.5 rad (GPT-J: (a, b) -> (a cos - b sin, a sin + b cos))
    expected = [math.cos(1.0), math.sin(1.0), -2 * math.sin(0.5), 2 * math.cos(0.5)]
    np.testing.assert_allclose(out[0], expected, rtol=0, atol=1e-15)
    np.testing.assert_allclose(apply_rope(out, np.array([2]), freqs, inverse=True), x, atol=1e-15)


def test_plain_rope_frequencies_are_theta_powers():
    freqs = rope_frequencies(8, 10000.0)
    np.testing.assert_allclose(freqs, [1.0, 10000 ** -0.25, 10000 ** -0.5, 10000 ** -0.75], rtol=1e-15)


def test_yarn_ramp_for_the_small_config():
    # pair index with r rotations: 64 * ln(65536 / (2 pi r)) / (2 ln 160000)
    # r = 32 -> 15.45 (floor 15), r = 1 -> 24.71 (ceil 25)
    yarn = YarnScaling()
    assert yarn_correction_range(64, 160000.0, yarn) == (15, 25)
    plain = rope_frequencies(64, 160000.0)
    scaled = rope_frequencies(64, 160000.0, yarn)
    np.testing.assert_array_equal(scaled[:16], plain[:16])  # fast pairs untouched
    np.testing.assert_allclose(scaled[25:], plain[25:] / 16, rtol=1e-15)  # slow pairs / factor
    ramp = (20 - 15) / (25 - 15)  # pair 20 is half way
    np.testing.assert_allclose(scaled[20], plain[20] / 16 * ramp + plain[20] * (1 - ramp), rtol=1e-15)


def test_rope_rejects_bad_shapes():
    with pytest.raises(ValueError):
        rope_frequencies(7, 10000.0)
    with pytest.raises(ValueError):
        apply_rope(np.zeros((2, 6)), np.arange(2), np.ones(2))
    with pytest.raises(ValueError):
        apply_rope(np.zeros((2, 4)), np.arange(3), np.ones(2))


# --- small pieces ------------------------------------------------------------------

def test_hadamard_is_orthonormal_sylvester():
    h = hadamard_matrix(4)
    np.testing.assert_array_equal(
        h * 2, [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    )
    np.testing.assert_allclose(hadamard(hadamard(np.arange(128.0)[None])), np.arange(128.0)[None], atol=1e-12)
    with pytest.raises(ValueError):
        hadamard_matrix(6)


def test_rms_norm_unweighted_and_weighted():
    x = np.array([[3.0, 4.0]])  # rms = sqrt(12.5)
    np.testing.assert_allclose(rms_norm(x, None, 0.0), x / math.sqrt(12.5))
    np.testing.assert_allclose(rms_norm(x, np.array([2.0, 0.5]), 0.0), x * [2.0, 0.5] / math.sqrt(12.5))


def test_read_positions():
    np.testing.assert_array_equal(window_key_positions(np.array([1, 20]), 4), [[-1, -1, 0, 1], [17, 18, 19, 20]])
    # entry w visible iff w < (t + 1) // m: t = 3 closes window 0 and sees it
    np.testing.assert_array_equal(visible_entries(np.array([0, 2, 3, 6, 7]), 4), [0, 0, 1, 1, 2])
    np.testing.assert_array_equal(
        all_visible_entries(np.array([126, 127, 300]), 128), [[-1, -1], [0, -1], [0, 1]]
    )
    np.testing.assert_array_equal(compressor_slot_positions(np.array([0, 2]), 4),
                                  [[-1, -1, -1, -1, 0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]])
    np.testing.assert_array_equal(compressor_slot_positions(np.array([1]), 128)[0], np.arange(128, 256))


def test_select_topk_ties_go_to_the_lower_index_and_only_visible_entries_count():
    scores = np.array([
        [1.0, 5.0, 5.0, 2.0, 9.0],  # 4 visible: top-2 = 1 and 2 (tie at 5 both in), 9 invisible
        [3.0, 3.0, 3.0, 3.0, 3.0],  # all tied: lowest two indices
        [0.0, 7.0, 0.0, 0.0, 0.0],  # 1 visible: just entry 0, padded
        [0.0, 0.0, 0.0, 0.0, 0.0],  # none visible
    ])
    got = select_topk(scores, np.array([4, 5, 1, 0]), 2)
    np.testing.assert_array_equal(got, [[1, 2], [0, 1], [0, -1], [-1, -1]])
    got3 = select_topk(np.array([[4.0, 8.0, 4.0, 4.0]]), np.array([4]), 3)
    np.testing.assert_array_equal(got3, [[0, 1, 2]])


@given(st.integers(0, 2**31 - 1), st.integers(1, 12), st.integers(1, 6))
def test_select_topk_matches_a_plain_sort(seed, num_entries, topk):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 4, size=(5, num_entries)).astype(float)  # many ties
    visible = rng.integers(0, num_entries + 1, size=5)
    got = select_topk(scores, visible, topk)
    for n in range(5):
        ranked = sorted(range(visible[n]), key=lambda e: (-scores[n, e], e))[:topk]
        expect = sorted(ranked) + [-1] * (topk - len(ranked))
        assert got[n].tolist() == expect


def test_attend_sink_only_enlarges_the_denominator():
    k = np.array([[[1.0, 2.0, 3.0, 4.0]]])
    q = np.zeros((1, 1, 4))  # logit 0 for the one key
    out = attend(q, k, np.array([[True]]), np.array([0.0]))
    np.testing.assert_allclose(out[0, 0], k[0, 0] / 2)  # e^0 / (e^0 + e^0)
    out = attend(q, k, np.array([[True]]), np.array([math.log(3.0)]))
    np.testing.assert_allclose(out[0, 0], k[0, 0] / 4)
    # two keys, logits 0 and 1 (q . k2 * 4 ** -0.5 = 1), sink -inf -> plain softmax, V = K
    k2 = np.array([[[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]]])
    q2 = np.array([[[1.0, 0.0, 0.0, 0.0]]])
    out = attend(q2, k2, np.array([[True, True, False]]), np.array([-np.inf]))
    w = math.e / (1 + math.e)
    np.testing.assert_allclose(out[0, 0], [2.0 * w, 0, 0, 0])


def test_index_scores_weighted_relu_sum():
    q = np.array([[[1.0, 0.0], [0.0, 1.0]]])  # 2 heads
    keys = np.array([[2.0, -1.0], [-3.0, 4.0]])
    w = np.array([[0.5, 2.0]])
    # entry 0: 0.5 * relu(2) + 2 * relu(-1) = 1; entry 1: 0.5 * 0 + 2 * 4 = 8
    np.testing.assert_allclose(index_scores(q, w, keys), [[1.0, 8.0]])


# --- the compressor -------------------------------------------------------------------

def _identity_compressor(ratio: int, d: int) -> CompressorWeights:
    coff = 2 if ratio == 4 else 1
    z = np.zeros((1, coff * d))
    return CompressorWeights(ratio, d, z, z, np.zeros((ratio, coff * d)), np.ones(d))


def test_ratio4_entry_pools_first_halves_of_the_previous_window_and_second_halves_of_its_own():
    d = 128  # rope on the last 64 dims
    comp = _identity_compressor(4, d)
    rng = np.random.default_rng(0)
    values = rng.standard_normal((12, 2 * d))  # 12 tokens = windows 0..2
    gates = np.zeros((12, 2 * d))
    gates[5, :d] = math.log(3.0)  # token 5 (window 1) weighs 3 for entry 2's first-half channels
    state = np.concatenate([values, gates], axis=1).astype(np.float32)
    v32 = state[:, : 2 * d].astype(np.float64)
    entries = np.array([0, 2])
    slot_pos = compressor_slot_positions(entries, 4)
    got = compress_entries(CONFIG, comp, state[np.maximum(slot_pos, 0)], slot_pos >= 0, entries)
    # entry 0: window 0's second halves only (missing slots weigh 0)
    pooled0 = v32[0:4, d:].mean(axis=0)
    # entry 2: first halves of tokens 4..7 (token 5 counts 3x) + second halves of tokens 8..11
    w5 = math.exp(float(np.float32(math.log(3.0))))  # the gate is stored as float32
    pooled2 = (v32[4:8, :d].sum(axis=0) + (w5 - 1) * v32[5, :d] + v32[8:12, d:].sum(axis=0)) / (7 + w5)
    freqs = rope_frequencies(64, 160000.0, YarnScaling())
    for row, pooled, first_pos in ((0, pooled0, 0), (1, pooled2, 8)):
        normed = pooled / np.sqrt(np.mean(pooled**2) + CONFIG.norm_eps)
        expect = normed.copy()
        expect[64:] = apply_rope(normed[None, 64:], np.array([first_pos]), freqs)[0]
        np.testing.assert_allclose(got[row], expect, rtol=1e-12, atol=1e-12)


def test_ratio128_entry_is_a_per_channel_softmax_over_128_slots():
    d = 128
    comp = _identity_compressor(128, d)
    rng = np.random.default_rng(1)
    values = rng.standard_normal((256, d))
    gates = rng.standard_normal((256, d))
    state = np.concatenate([values, gates], axis=1).astype(np.float32)
    v, g = state[128:, :d].astype(np.float64), state[128:, d:].astype(np.float64)
    weights = np.exp(g) / np.exp(g).sum(axis=0)
    pooled = (weights * v).sum(axis=0)
    got = compress_entries(CONFIG, comp, state[None, 128:], np.ones((1, 128), bool), np.array([1]))
    normed = pooled / np.sqrt(np.mean(pooled**2) + CONFIG.norm_eps)
    freqs = rope_frequencies(64, 160000.0, YarnScaling())
    np.testing.assert_allclose(got[0, :64], normed[:64], rtol=1e-12)
    np.testing.assert_allclose(got[0, 64:], apply_rope(normed[None, 64:], np.array([128]), freqs)[0], rtol=1e-12)


# --- config --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"head_dim": 100}, {"rope_dim": 128}, {"num_heads": 3}, {"layer_ratios": (0, 8)},
    {"layer_ratios": ()}, {"index_head_dim": 96}, {"hidden_size": 0}, {"index_topk": True},
])
def test_bad_config_raises(kwargs):
    with pytest.raises(ValueError):
        ReferenceConfig(**kwargs)


def test_hf_config_feeds_the_cache_recipe():
    from hybridkv.models.deepseek_v4 import build_v4_cache_specs

    hf = CONFIG.hf_config()
    assert hf["compress_ratios"] == [0, 4, 128, 4, 0] and hf["sliding_window"] == 16
    ids = [s.group_id for s in build_v4_cache_specs(hf, layer_ratio=hf["compress_ratios"])]
    assert ids[0] == "v4.swa_kv" and "v4.c4a.indexer_compressor_state" in ids


def test_weights_are_seeded():
    a, b, c = build_model(seed=1), build_model(seed=1), build_model(seed=2)
    np.testing.assert_array_equal(a.layers[2].compressor.wkv, b.layers[2].compressor.wkv)
    assert not np.array_equal(a.embedding, c.embedding)
    assert a.layers[0].compressor is None and a.layers[2].indexer is None
    assert a.layers[1].compressor.wkv.shape == (64, 256) and a.layers[2].compressor.wkv.shape == (64, 128)


# --- the dense path ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense_run():
    model = build_model(seed=0)
    ids = np.random.default_rng(5).integers(0, CONFIG.vocab_size, 300)
    return model, ids, dense_forward(model, ids)


def test_dense_rows_are_on_the_cache_grid(dense_run):
    _, _, trace = dense_run
    kv, mx = KVRowCodec(128, 64), MXFP4IndexerCodec(128)
    for layer in trace.layers:
        np.testing.assert_array_equal(kv.fake_quantize(layer.kv_rows), layer.kv_rows)
        assert layer.state_rows is None or layer.state_rows.dtype == np.float32
    hca, csa = trace.layers[2], trace.layers[1]
    assert hca.entry_rows.shape == (2, 128) and csa.entry_rows.shape == (75, 128)
    np.testing.assert_array_equal(kv.fake_quantize(hca.entry_rows), hca.entry_rows)
    np.testing.assert_array_equal(mx.fake_quantize(csa.index_keys), csa.index_keys)
    # FP8 is coarse: the nope part really was rounded (only 16 e4m3 magnitudes per binade)
    assert len(np.unique(np.abs(trace.layers[0].kv_rows[:, :64]) / 2.0 ** np.floor(
        np.log2(np.abs(trace.layers[0].kv_rows[:, :64]) + 1e-30)))) <= 16


def test_dense_selections_respect_causality_and_topk(dense_run):
    _, _, trace = dense_run
    positions = np.arange(300)
    for li in (1, 3):
        sel = trace.layers[li].selected
        visible = (positions + 1) // 4
        assert ((sel < visible[:, None]) | (sel == -1)).all()
        counts = (sel >= 0).sum(axis=1)
        np.testing.assert_array_equal(counts, np.minimum(visible, 8))
        assert (counts == 8).sum() > 200  # the indexer really selects for most tokens


def test_dense_is_causal_and_prefix_stable(dense_run):
    model, ids, trace = dense_run
    other = ids.copy()
    other[200:] = (other[200:] + 1) % CONFIG.vocab_size
    short = dense_forward(model, other[:203])
    np.testing.assert_allclose(short.hidden[:200], trace.hidden[:200], rtol=0, atol=1e-12)
    for li in (1, 3):
        np.testing.assert_array_equal(short.layers[li].selected[:200], trace.layers[li].selected[:200])
    assert np.abs(short.hidden[200:] - trace.hidden[200:203]).max() > 1e-3


def test_window_only_layer_sees_exactly_the_last_16_tokens(dense_run):
    model, ids, trace = dense_run
    other = ids.copy()
    other[100] = (other[100] + 7) % CONFIG.vocab_size
    changed = dense_forward(model, other[:140])
    diff = np.abs(changed.layers[0].outputs - trace.layers[0].outputs[:140]).max(axis=1)
    # W = 16: tokens 100..115 see token 100; the others differ only by summation order
    # (a sequence of 140 rows is one block product of another shape than one of 300)
    assert (diff[:100] < 1e-12).all() and (diff[116:] < 1e-12).all()
    assert (diff[100:116] > 1e-6).all()


def test_dense_rejects_bad_token_ids():
    model = build_model()
    for bad in (np.array([], dtype=np.int64), np.array([0, 1024]), np.array([-1]), np.zeros((2, 2), int)):
        with pytest.raises(ValueError):
            dense_forward(model, bad)
