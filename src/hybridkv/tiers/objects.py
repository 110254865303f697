"""The stored object: one group's rows of one block or one checkpoint, compact, checksummed.

Binary format, version 1 (all integers little-endian)::

    offset  size  field
         0     4  magic b"HKVO"
         4     2  format version (1)
         6     1  kind: 1 history block, 2 checkpoint
         7     1  reserved, 0
         8    16  layout namespace (hybridkv.tiers.namespace)
        24     4  header bytes (this table, the variable part and the checksum)
        28     4  parts: (layer, plane) row arrays in the payload
        32     8  first token covered
        40     8  tokens covered
        48     8  first cache row (token // entry_stride_tokens)
        56     8  cache rows
        64     8  payload bytes (rows * sum of the parts' row bytes)
        72     2  content key bytes (k)
        74     2  group id bytes (g)
        76     k  content key
      76+k     g  group id, UTF-8
         …  8*P  per part: layer u16, plane code u8 (1 kv, 2 indexer, 3 state), 0 u8, row bytes u32
         …     8  checksum: XXH3-64 of every header byte before it and the payload
    header  ...   payload: part after part, each ``rows * row_bytes`` bytes, rows in order

Rows are stored whole and unpadded (no page padding, no other rows of the
page). Decoding checks magic, version, namespace, key and group (when the
caller says what it expects), lengths, parts and checksum, and raises
:class:`ObjectError` (or its subclass :class:`NamespaceMismatch`) naming what
is wrong; nothing half-decoded is returned.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from hybridkv.tiers.keys import ObjectKey
from hybridkv.tiers.namespace import NAMESPACE_BYTES, Namespace

MAGIC = b"HKVO"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHBB16sIIQQQQQHH")
_PART = struct.Struct("<HBBI")
_CHECKSUM = struct.Struct("<Q")
_KIND_CODES = {"block": 1, "checkpoint": 2}
_KINDS = {code: kind for kind, code in _KIND_CODES.items()}
PLANE_CODES = {"kv": 1, "indexer": 2, "state": 3}
_PLANES = {code: plane for plane, code in PLANE_CODES.items()}

Part = tuple[int, str, int]  # (layer, plane, row bytes)


class ObjectError(ValueError):
    """An object's bytes cannot be trusted (truncated, corrupted, or not what was asked for)."""


class NamespaceMismatch(ObjectError):
    """An object (or a peer) of a different cache layout: refused, never mixed."""


@dataclass(frozen=True)
class RowsObject:
    """One group's rows ``[first_row, first_row + num_rows)`` for tokens ``[first_token, +num_tokens)``.

    ``payload`` is ``uint8`` with the parts one after the other (see module doc);
    ``part_rows(i)`` views part ``i`` as ``[num_rows, row_bytes]``.
    """

    key: ObjectKey
    first_token: int
    num_tokens: int
    first_row: int
    num_rows: int
    parts: tuple[Part, ...]
    payload: np.ndarray

    @property
    def row_bytes(self) -> int:
        """Bytes of one cache row over all parts (every layer and plane of the group)."""
        return parts_row_bytes(self.parts)

    def part_rows(self, index: int) -> np.ndarray:
        start = self.num_rows * part_offsets(self.parts)[index]
        size = self.parts[index][2]
        return self.payload[start : start + self.num_rows * size].reshape(self.num_rows, size)


@functools.lru_cache(maxsize=256)
def part_offsets(parts: tuple[Part, ...]) -> tuple[int, ...]:
    """Bytes of one row of every part before part ``i`` (a part starts at ``rows * offset``)."""
    out, at = [], 0
    for _, _, size in parts:
        out.append(at)
        at += size
    return tuple(out)


@functools.lru_cache(maxsize=256)
def parts_row_bytes(parts: tuple[Part, ...]) -> int:
    """Bytes of one row over every part."""
    return sum(size for _, _, size in parts)


def _check_shape(obj: RowsObject) -> None:
    for name in ("first_token", "num_tokens", "first_row", "num_rows"):
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    payload = obj.payload
    if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 or payload.ndim != 1:
        raise ValueError("payload must be a 1-D uint8 array")
    if payload.size != obj.num_rows * obj.row_bytes:
        raise ValueError(f"payload has {payload.size} bytes; {obj.num_rows} rows need {obj.num_rows * obj.row_bytes}")


def encoded_size(key: ObjectKey, parts: tuple[Part, ...], num_rows: int) -> int:
    """Bytes of the stored object of ``key`` with ``num_rows`` rows of ``parts`` (known before a fetch)."""
    header = _FIXED.size + len(key.key) + len(key.group_id.encode("utf-8")) + len(parts) * _PART.size + _CHECKSUM.size
    return header + num_rows * parts_row_bytes(parts)


def header_size(key: ObjectKey, parts: tuple[Part, ...]) -> int:
    """Bytes of the header of ``key``'s object with ``parts`` (checksum included)."""
    return encoded_size(key, parts, 0)


def encode_object(obj: RowsObject, namespace: Namespace, *, in_place: bool = False) -> bytes | memoryview:
    """The stored bytes of ``obj`` (header, payload) under ``namespace``: new ``bytes`` (one copy
    of the payload). ``in_place``: the payload is a view of a writable 1-D ``uint8`` buffer with
    room for the header right before it (``gather_objects(..., room_bytes=)`` leaves it); the
    header is written there and the stored bytes come back as a read-only view of that buffer,
    the payload not copied (an empty payload: new ``bytes``)."""
    _check_shape(obj)
    head = _header_fields(obj, namespace)
    payload = obj.payload if obj.payload.flags.c_contiguous else np.ascontiguousarray(obj.payload)
    digest = xxhash.xxh3_64()
    digest.update(head)
    digest.update(payload)
    checksum = _CHECKSUM.pack(digest.intdigest())
    if not in_place or payload.size == 0:  # (an empty payload has no place in a buffer to find)
        return b"".join((head, checksum, payload))  # one copy of the payload
    buffer, at = _room_before(obj.payload, len(head) + len(checksum))
    buffer[at : at + len(head)] = np.frombuffer(head, dtype=np.uint8)
    buffer[at + len(head) : at + len(head) + len(checksum)] = np.frombuffer(checksum, dtype=np.uint8)
    end = at + len(head) + len(checksum) + payload.size
    return memoryview(buffer)[at:end].toreadonly()


def _header_fields(obj: RowsObject, namespace: Namespace) -> bytes:
    """The header's bytes before the checksum."""
    key, group = obj.key.key, obj.key.group_id.encode("utf-8")
    parts = _part_table(obj.parts)
    header_bytes = _FIXED.size + len(key) + len(group) + len(parts) + _CHECKSUM.size
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, _KIND_CODES[obj.key.kind], 0, namespace.digest, header_bytes,
        len(obj.parts), obj.first_token, obj.num_tokens, obj.first_row, obj.num_rows,
        obj.payload.size, len(key), len(group),
    )
    return fixed + key + group + parts


def _room_before(payload: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """``(buffer, at)``: the writable 1-D uint8 buffer ``payload`` is a view of, and where the
    ``size`` bytes right before the payload start in it."""
    buffer = payload.base
    if not (isinstance(buffer, np.ndarray) and buffer.dtype == np.uint8 and buffer.ndim == 1
            and buffer.flags.c_contiguous and buffer.flags.writeable and payload.flags.c_contiguous):
        raise ValueError("an in-place encode needs a payload that is a view of a writable 1-D uint8 buffer")
    at = payload.ctypes.data - buffer.ctypes.data - size
    if at < 0 or at + size + payload.size > buffer.size:
        raise ValueError(f"no room for a {size}-byte header before the payload")
    return buffer, at


@functools.lru_cache(maxsize=256)
def _part_table(parts: tuple[Part, ...]) -> bytes:
    return b"".join(_PART.pack(layer, PLANE_CODES[plane], 0, size) for layer, plane, size in parts)


def _fixed_fields(data: memoryview, namespace: Namespace) -> tuple:
    if len(data) < _FIXED.size + _CHECKSUM.size:
        raise ObjectError(f"object of {len(data)} bytes is shorter than a header")
    fields = _FIXED.unpack_from(data)
    magic, version, kind, _, space = fields[:5]
    if magic != MAGIC:
        raise ObjectError(f"not a hybridkv object (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise ObjectError(f"object format version {version}; this reader knows {FORMAT_VERSION}")
    if kind not in _KINDS:
        raise ObjectError(f"unknown object kind code {kind}")
    if space != namespace.digest:
        raise NamespaceMismatch(
            f"object of layout namespace {space.hex()} refused: this cache's namespace is {namespace.hex}"
        )
    return fields


def _parse_variable(data: memoryview, fields: tuple) -> tuple[ObjectKey, tuple[Part, ...]]:
    kind, header_bytes, num_parts, key_len, group_len = fields[2], fields[5], fields[6], fields[12], fields[13]
    expected = _FIXED.size + key_len + group_len + num_parts * _PART.size + _CHECKSUM.size
    if header_bytes != expected or len(data) < header_bytes:
        raise ObjectError(f"header length {header_bytes} disagrees with its fields ({expected}) or the object")
    at = _FIXED.size
    key = bytes(data[at : at + key_len])
    try:
        group = bytes(data[at + key_len : at + key_len + group_len]).decode("utf-8")
        object_key = ObjectKey(_KINDS[kind], group, key)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ObjectError(f"bad key or group in header: {exc}") from None
    at += key_len + group_len
    return object_key, _parse_parts(bytes(data[at : at + num_parts * _PART.size]))


@functools.lru_cache(maxsize=256)
def _parse_parts(raw: bytes) -> tuple[Part, ...]:
    """The part table (the same bytes for every object of a group, so parsed once)."""
    parts = []
    for i, (layer, code, _, size) in enumerate(_PART.iter_unpack(raw)):
        if code not in _PLANES:
            raise ObjectError(f"part {i}: unknown plane code {code}")
        parts.append((layer, _PLANES[code], size))
    return tuple(parts)


def decode_object(
    data: bytes | bytearray | memoryview,
    namespace: Namespace,
    *,
    expect_key: ObjectKey | None = None,
    expect_parts: tuple[Part, ...] | None = None,
) -> RowsObject:
    """Verify and decode stored bytes; ``ObjectError`` / ``NamespaceMismatch`` if anything is off."""
    view = memoryview(data).cast("B")
    fields = _fixed_fields(view, namespace)
    object_key, parts = _parse_variable(view, fields)
    header_bytes = fields[5]
    first_token, num_tokens, first_row, num_rows, payload_bytes = fields[7:12]
    if payload_bytes != num_rows * parts_row_bytes(parts):
        raise ObjectError(f"payload of {payload_bytes} bytes does not hold {num_rows} rows of the parts")
    if len(view) != header_bytes + payload_bytes:
        raise ObjectError(f"object has {len(view)} bytes; its header says {header_bytes + payload_bytes}")
    digest = xxhash.xxh3_64()
    digest.update(view[: header_bytes - _CHECKSUM.size])
    digest.update(view[header_bytes:])
    (stored,) = _CHECKSUM.unpack_from(view, header_bytes - _CHECKSUM.size)
    if digest.intdigest() != stored:
        raise ObjectError(f"checksum mismatch in {object_key.kind} object of group {object_key.group_id}")
    if expect_key is not None and object_key != expect_key:
        raise ObjectError(f"object holds {object_key}, expected {expect_key}")
    if expect_parts is not None and parts != tuple(expect_parts):
        raise ObjectError(f"object parts {parts} differ from the layout's {tuple(expect_parts)}")
    payload = np.frombuffer(view[header_bytes:], dtype=np.uint8)
    return RowsObject(object_key, first_token, num_tokens, first_row, num_rows, parts, payload)


__all__ = [
    "FORMAT_VERSION", "MAGIC", "NAMESPACE_BYTES", "NamespaceMismatch", "ObjectError", "PLANE_CODES",
    "Part", "RowsObject", "decode_object", "encode_object", "encoded_size", "header_size",
]
