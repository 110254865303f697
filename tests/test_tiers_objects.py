"""The object format: namespace keys, header fields, round trips, and refusal of bad bytes."""

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.models.layout import cache_layout
from hybridkv.tiers import (
    HostTier,
    NamespaceMismatch,
    ObjectStore,
    ObjectError,
    ObjectKey,
    RowsObject,
    decode_object,
    encode_object,
    header_size,
    layout_namespace,
    layout_parts,
)
from hybridkv.tiers.keys import boundary_key, chained_keys, name_prefix, store_names

FLASH = cache_layout("deepseek-v4-flash")
NS = layout_namespace(FLASH)
C4 = "v4.c4a.compressed_kv"


def make_object(num_rows=3, kind="block", group=C4, key=b"\x01" * 16, seed=0):
    parts = layout_parts(FLASH, group)
    rng = np.random.default_rng(seed)
    payload = rng.integers(0, 256, num_rows * sum(p[2] for p in parts), dtype=np.uint8)
    stride = FLASH.group(group).spec.entry_stride_tokens
    return RowsObject(ObjectKey(kind, group, key), 256, num_rows * stride, 256 // stride, num_rows, parts, payload)


# --- namespace ------------------------------------------------------------------

def test_namespace_is_stable_for_equal_layouts_and_differs_for_any_change():
    assert layout_namespace(cache_layout("deepseek-v4-flash")).digest == NS.digest
    assert len(NS.digest) == 16
    others = [
        layout_namespace(cache_layout("deepseek-v4-pro")),
        layout_namespace(cache_layout("deepseek-v4-flash", indexer="fp8")),  # another dtype
        layout_namespace(cache_layout("deepseek-v4-flash", include_mtp=True)),  # more layers
        layout_namespace(cache_layout("deepseek-v4-flash", speculative_tokens=8)),  # wider state window
        layout_namespace(FLASH, model_id="deepseek-v4-flash@finetune"),  # same geometry, other weights
    ]
    digests = {NS.digest, *(o.digest for o in others)}
    assert len(digests) == 6


def test_namespace_describes_tp_free_whole_rows():
    # the description names no rank or parallel size, and the row bytes of the c4 group
    assert "rank" not in NS.description and "tp" not in NS.description.lower()
    assert '["kv",584,' in NS.description and '["indexer",68,' in NS.description


# --- keys -----------------------------------------------------------------------

def test_chained_keys_identify_whole_prefixes():
    tokens = np.arange(600) % 97
    keys = chained_keys(tokens, 256)
    assert len(keys) == 3  # 256, 512, 600 (partial)
    assert chained_keys(tokens[:512], 256) == keys[:2]
    changed = tokens.copy()
    changed[3] += 1  # a change in the first block changes every later key
    assert all(a != b for a, b in zip(chained_keys(changed, 256), keys))
    assert boundary_key(tokens, 600, 256) == keys[2]
    assert chained_keys(tokens, 256, salt=b"user-1")[0] != keys[0]
    assert chained_keys(tokens[:300], 256)[1] != keys[1]  # a partial block has its own key


def test_object_names_carry_namespace_group_kind_and_key():
    key = ObjectKey("checkpoint", "v4.swa_kv", 5)  # an int key (a manager's hash) becomes 16 bytes
    assert key.key == (5).to_bytes(16, "big")
    assert key.name(NS) == f"hkv1/{NS.hex}/v4.swa_kv/checkpoint/{'00' * 15}05"
    with pytest.raises(ValueError, match="kind"):
        ObjectKey("page", C4, b"k")
    with pytest.raises(ValueError, match="content key"):
        ObjectKey("block", C4, b"")


@given(st.sampled_from(["block", "checkpoint"]), st.sampled_from(["v4.swa_kv", C4]),
       st.one_of(st.integers(0, 2**130), st.sampled_from([0, 2**64, 2**128 - 1, 2**128, 2**200])))
def test_a_key_made_for_checked_groups_equals_the_checked_one(kind, group, key):
    fast, checked = ObjectKey.of_checked(kind, group, key), ObjectKey(kind, group, key)
    assert fast == checked and hash(fast) == hash(checked) and fast.key == checked.key
    assert ObjectStore(HostTier(1), FLASH).name(fast) == checked.name(NS)
    with pytest.raises(ValueError, match="content key"):
        ObjectKey.of_checked(kind, group, -1)



@given(st.lists(st.tuples(st.sampled_from(["block", "checkpoint"]), st.sampled_from(["v4.swa_kv", C4]),
                          st.one_of(st.integers(0, 2**130), st.sampled_from([0, 2**128 - 1, 2**128, 2**200]))),
                max_size=6))
def test_store_names_are_the_names_the_store_gives_the_keys(entries):
    """A tier link asks the tier by ``store_names`` (no ``ObjectKey`` made): the same names as
    ``ObjectStore.name`` of each key, in order."""
    store = ObjectStore(HostTier(1), FLASH)
    kinds = {group: kind for kind, group, _ in entries}  # a link's group has one kind
    prefixes = {group: name_prefix(NS, group, kind) for group, kind in kinds.items()}
    names = store_names(prefixes, [(group, key) for _, group, key in entries])
    assert names == [store.name(ObjectKey(kinds[group], group, key)) for _, group, key in entries]
    with pytest.raises(ValueError, match="content key"):
        store_names(prefixes or {C4: ""}, [(next(iter(prefixes or {C4: ""})), -1)])


# --- the format -----------------------------------------------------------------

def test_header_fields_sit_at_their_documented_offsets():
    obj = make_object(num_rows=2)
    data = encode_object(obj, NS)
    assert data[:4] == b"HKVO"
    assert struct.unpack_from("<HBB", data, 4) == (1, 1, 0)
    assert data[8:24] == NS.digest
    header_bytes, num_parts = struct.unpack_from("<II", data, 24)
    assert num_parts == 2 * 21  # 21 ratio-4 layers, kv and indexer planes
    assert struct.unpack_from("<QQQQQ", data, 32) == (256, 8, 64, 2, 2 * 21 * 652)
    assert header_bytes == 76 + 16 + len(C4) + 8 * num_parts + 8
    assert len(data) == header_bytes + 2 * 21 * 652
    (checksum,) = struct.unpack_from("<Q", data, header_bytes - 8)
    assert checksum == xxhash.xxh3_64_intdigest(data[: header_bytes - 8] + data[header_bytes:])
    assert data[header_bytes:] == obj.payload.tobytes()


@given(st.integers(0, 70), st.sampled_from(["block", "checkpoint"]), st.binary(min_size=1, max_size=64))
def test_round_trip(num_rows, kind, key):
    obj = make_object(num_rows, kind, key=key, seed=num_rows)
    back = decode_object(encode_object(obj, NS), NS, expect_key=obj.key, expect_parts=obj.parts)
    assert back.key == obj.key and back.parts == obj.parts
    assert (back.first_token, back.num_tokens, back.first_row, back.num_rows) == (
        obj.first_token, obj.num_tokens, obj.first_row, obj.num_rows)
    assert np.array_equal(back.payload, obj.payload)
    assert np.array_equal(back.part_rows(1), obj.payload[num_rows * 584 : num_rows * 652].reshape(num_rows, 68))


@given(st.integers(1, 5), st.integers(0, 64))
def test_an_in_place_encode_writes_the_same_bytes_into_the_room_before_the_payload(num_rows, slack):
    obj = make_object(num_rows=num_rows, seed=num_rows)
    head = header_size(obj.key, obj.parts)
    buffer = np.full(slack + head + obj.payload.size + 7, 0xEE, dtype=np.uint8)
    payload = buffer[slack + head : slack + head + obj.payload.size]
    payload[...] = obj.payload
    placed = RowsObject(obj.key, obj.first_token, obj.num_tokens, obj.first_row, obj.num_rows, obj.parts, payload)
    stored = encode_object(placed, NS, in_place=True)
    assert bytes(stored) == encode_object(obj, NS)
    assert np.all(buffer[:slack] == 0xEE) and np.all(buffer[-7:] == 0xEE)  # nothing outside the object
    assert stored.readonly and np.shares_memory(np.frombuffer(stored, np.uint8), buffer)
    with pytest.raises(ValueError, match="no room"):  # one byte short of a header before the payload
        encode_object(RowsObject(obj.key, obj.first_token, obj.num_tokens, obj.first_row, obj.num_rows,
                                 obj.parts, buffer[head - 1 : head - 1 + obj.payload.size]), NS, in_place=True)
    with pytest.raises(ValueError, match="writable 1-D uint8"):
        encode_object(obj, NS, in_place=True)  # a payload that owns its bytes
    empty = make_object(num_rows=0)
    assert encode_object(empty, NS, in_place=True) == encode_object(empty, NS)


@given(st.data())
def test_any_flipped_bit_is_refused(data):
    raw = bytearray(encode_object(make_object(num_rows=2), NS))
    index = data.draw(st.integers(0, len(raw) - 1))
    raw[index] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(ObjectError):
        decode_object(bytes(raw), NS)


@given(st.data())
def test_truncated_or_extended_objects_are_refused(data):
    raw = encode_object(make_object(num_rows=2), NS)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(ObjectError):
        decode_object(raw[:cut], NS)
    with pytest.raises(ObjectError, match="bytes"):
        decode_object(raw + b"\x00", NS)


def test_namespace_mismatch_is_refused_with_both_namespaces_named():
    other = layout_namespace(FLASH, model_id="another-model")
    raw = encode_object(make_object(), other)
    with pytest.raises(NamespaceMismatch, match=f"{other.hex}.*{NS.hex}"):
        decode_object(raw, NS)


def test_expected_key_and_parts_are_checked():
    obj = make_object()
    raw = encode_object(obj, NS)
    with pytest.raises(ObjectError, match="expected"):
        decode_object(raw, NS, expect_key=ObjectKey("block", C4, b"\x02" * 16))
    with pytest.raises(ObjectError, match="parts"):
        decode_object(raw, NS, expect_parts=layout_parts(FLASH, "v4.c128a.compressed_kv"))


def test_a_future_version_is_refused_by_name():
    raw = bytearray(encode_object(make_object(), NS))
    raw[4] = 2
    with pytest.raises(ObjectError, match="version 2"):
        decode_object(bytes(raw), NS)


def test_object_bytes_per_token_are_within_two_percent_of_the_ideal():
    # one 256-token block of each history group: 21 layers x 64 rows x (584 + 68) B, 20 x 2 x 584 B
    for group, rows, row_bytes in ((C4, 64, 21 * 652), ("v4.c128a.compressed_kv", 2, 20 * 584)):
        obj = make_object(num_rows=rows, group=group)
        assert obj.payload.size == rows * row_bytes
        stored = len(encode_object(obj, NS))
        ideal = FLASH.group(group).ideal_bytes_per_token * 256
        assert obj.payload.size == ideal
        assert stored / ideal <= 1.02
