"""Markers in a shared store: prefix blocks being computed now, and checkpoints a waiter wants.

Instances sharing a KV store see each other's work only once it lands. When
several requests with the same new prefix start at once (a cold start: every
first turn of a shared system prompt), each computes it. A *computing* marker
is a small object put in the store under a block's key when a request starts
to compute that block; another request (on any instance, or the same one)
whose next block carries a live marker of another request waits a bounded time
(:class:`InFlightRule` ``wait``) and then loads what landed instead of
computing it again. A *wanted* marker, put by such a waiter under the key of
the boundary where its prompt leaves the marked blocks, asks the computing
instance to write its checkpoint there through to the store (a boundary no
single request would keep: the end of the shared system prompt).

A marker is never trusted for rows: it only delays a request. Every marker
carries an expiry (``ttl``), so one left by a dead peer stops mattering; its
owner deletes it when the block is published, or when the request ends; one
that does not decode counts as absent. Names:
``hkv1/<namespace>/marker/<computing|wanted>/<key>``, apart from the objects'.

Payload (little-endian): ``HKVM``, version u8 (1), kind u8 (1 computing, 2
wanted), 2 reserved bytes, expiry f64 (the rule's clock), owner 16 bytes (one
per link), request id length u16, the request id (UTF-8).

The *wanted board* (``hkv1/<namespace>/marker/board``) is one small object
listing the checkpoints a waiter wants from whichever device holds one, each
with an expiry: a request that finds history blocks in the store but no
checkpoint where its prompt leaves them adds the boundary's key; every link
reads the board once per ``take_offloads`` and writes through the listed
checkpoints its device holds. Payload: ``HKVB``, version u8 (1), 3 reserved
bytes, count u32, then per entry expiry f64, key length u8, the key. Writers
read, change and put it whole (delete, then put): a write another writer overwrote loses an
entry, which its waiter adds again at its next poll (or it waits out its
bound); at most ``MAX_BOARD_KEYS`` entries, the ones expiring first dropped.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hybridkv.tiers.base import Tier
from hybridkv.tiers.keys import as_key_bytes
from hybridkv.tiers.namespace import Namespace

MARKER_MAGIC = b"HKVM"
MARKER_VERSION = 1
MARKER_KINDS = {"computing": 1, "wanted": 2}
_HEADER = struct.Struct("<4sBBHd16sH")
MAX_REQUEST_ID_BYTES = 1024
BOARD_MAGIC = b"HKVB"
MAX_BOARD_KEYS = 256
_BOARD_HEADER = struct.Struct("<4sB3xI")
_BOARD_ENTRY = struct.Struct("<dB")


@dataclass(frozen=True)
class InFlightRule:
    """How long a request waits for a block another request is computing, and how long a
    marker lives. ``wait`` and ``ttl`` are in units of ``clock`` (seconds for ``time.time``;
    a simulation passes its step counter). ``wait`` bounds a request's waiting in all."""

    wait: float = 2.0
    ttl: float = 30.0
    clock: Callable[[], float] = field(default=time.time, compare=False)

    def __post_init__(self) -> None:
        for name in ("wait", "ttl"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        if not self.ttl > 0:
            raise ValueError(f"ttl must be positive, got {self.ttl!r}")
        if not callable(self.clock):
            raise ValueError("clock must be callable")


@dataclass(frozen=True)
class Marker:
    kind: str
    expires_at: float
    owner: bytes
    request_id: str


def encode_marker(marker: Marker) -> bytes:
    rid = marker.request_id.encode()
    if len(rid) > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request id of {len(rid)} bytes: at most {MAX_REQUEST_ID_BYTES}")
    if len(marker.owner) != 16:
        raise ValueError("a marker's owner is 16 bytes")
    head = _HEADER.pack(MARKER_MAGIC, MARKER_VERSION, MARKER_KINDS[marker.kind], 0, float(marker.expires_at),
                        marker.owner, len(rid))
    return head + rid


def decode_marker(data: bytes | memoryview | None) -> Marker | None:
    """The marker in ``data``, or None for anything that is not a whole version-1 marker."""
    if data is None or len(data) < _HEADER.size:
        return None
    magic, version, kind, _, expires, owner, size = _HEADER.unpack_from(bytes(data[: _HEADER.size]))
    names = {v: k for k, v in MARKER_KINDS.items()}
    if magic != MARKER_MAGIC or version != MARKER_VERSION or kind not in names or len(data) != _HEADER.size + size:
        return None
    try:
        rid = bytes(data[_HEADER.size:]).decode()
    except UnicodeDecodeError:
        return None
    return Marker(names[kind], expires, owner, rid)


def encode_board(entries: dict[bytes, float]) -> bytes:
    """A board of ``{key bytes: expiry}`` (at most ``MAX_BOARD_KEYS``, keys of 1 to 255 bytes)."""
    if len(entries) > MAX_BOARD_KEYS:
        raise ValueError(f"a board holds at most {MAX_BOARD_KEYS} keys, got {len(entries)}")
    out = [_BOARD_HEADER.pack(BOARD_MAGIC, MARKER_VERSION, len(entries))]
    for key, expires in entries.items():
        if not 1 <= len(key) <= 255:
            raise ValueError(f"a board key has 1 to 255 bytes, got {len(key)}")
        out.append(_BOARD_ENTRY.pack(float(expires), len(key)) + bytes(key))
    return b"".join(out)


def decode_board(data: bytes | memoryview | None) -> dict[bytes, float]:
    """The board in ``data`` as ``{key bytes: expiry}``; empty for anything that is not a whole board."""
    if data is None or len(data) < _BOARD_HEADER.size:
        return {}
    data = bytes(data)
    magic, version, count = _BOARD_HEADER.unpack_from(data)
    if magic != BOARD_MAGIC or version != MARKER_VERSION or count > MAX_BOARD_KEYS:
        return {}
    out, at = {}, _BOARD_HEADER.size
    for _ in range(count):
        if at + _BOARD_ENTRY.size > len(data):
            return {}
        expires, size = _BOARD_ENTRY.unpack_from(data, at)
        at += _BOARD_ENTRY.size
        if size == 0 or at + size > len(data):
            return {}
        out[data[at:at + size]] = expires
        at += size
    return out if at == len(data) else {}


class Markers:
    """One link's view of the markers in ``tier`` under ``namespace``."""

    def __init__(self, tier: Tier, namespace: Namespace, rule: InFlightRule, owner: bytes | None = None):
        self.tier = tier
        self.namespace = namespace
        self.rule = rule
        self.owner = os.urandom(16) if owner is None else bytes(owner)
        if len(self.owner) != 16:
            raise ValueError("owner must be 16 bytes")

    def name(self, kind: str, key: bytes | int) -> str:
        if kind not in MARKER_KINDS:
            raise ValueError(f"marker kind must be one of {tuple(MARKER_KINDS)}, got {kind!r}")
        return f"hkv1/{self.namespace.hex}/marker/{kind}/{as_key_bytes(key).hex()}"

    def now(self) -> float:
        return float(self.rule.clock())

    def put(self, kind: str, keys: Sequence[int], request_id: str) -> list[bool]:
        """Put a ``kind`` marker of ``request_id`` under each key (expiring ``ttl`` from now)."""
        if not keys:
            return []
        data = encode_marker(Marker(kind, self.now() + self.rule.ttl, self.owner, request_id))
        return self.tier.put([(self.name(kind, k), data) for k in keys])

    def delete(self, kind: str, keys: Sequence[int]) -> int:
        return self.tier.delete([self.name(kind, k) for k in keys]) if keys else 0

    def others(self, kind: str, keys: Sequence[int], request_id: str) -> list[bool]:
        """Per key: whether a live ``kind`` marker of another request (of any link) is there.
        An expired marker, or one that does not decode, is absent (and deleted)."""
        if not keys:
            return []
        names = [self.name(kind, k) for k in keys]
        values = self.tier.get(names)
        now = self.now()
        out, stale = [], []
        for name, value in zip(names, values):
            marker = decode_marker(value)
            if value is not None and (marker is None or marker.kind != kind or marker.expires_at <= now):
                stale.append(name)
                marker = None
            out.append(marker is not None and (marker.owner, marker.request_id) != (self.owner, request_id))
        if stale:
            self.tier.delete(stale)
        return out

    def present(self, kind: str, keys: Sequence[int]) -> list[bool]:
        """Per key: whether a ``kind`` marker is there (by ``contains``, expiry unread)."""
        return self.tier.contains([self.name(kind, k) for k in keys]) if keys else []

    # --- the wanted board ---------------------------------------------------------
    def board_name(self) -> str:
        return f"hkv1/{self.namespace.hex}/marker/board"

    def board(self) -> dict[bytes, float]:
        """The live entries of the wanted board (``{key bytes: expiry}``; one ``get``)."""
        now = self.now()
        entries = decode_board(self.tier.get([self.board_name()])[0])
        return {key: expires for key, expires in entries.items() if expires > now}

    def want(self, keys: Sequence[int]) -> bool:
        """Add ``keys`` to the board (expiring ``ttl`` from now) unless listed; whether it was written."""
        entries = self.board()
        missing = [as_key_bytes(k) for k in keys if as_key_bytes(k) not in entries]
        if not missing:
            return False
        expires = self.now() + self.rule.ttl
        entries.update((key, expires) for key in missing)
        if len(entries) > MAX_BOARD_KEYS:  # the ones expiring first go
            entries = dict(sorted(entries.items(), key=lambda kv: kv[1])[-MAX_BOARD_KEYS:])
        return self._write_board(entries)

    def unwant(self, keys: Sequence[int]) -> None:
        """Take ``keys`` off the board (when listed)."""
        entries = self.board()
        gone = [as_key_bytes(k) for k in keys if as_key_bytes(k) in entries]
        if gone:
            for key in gone:
                del entries[key]
            self._write_board(entries)

    def _write_board(self, entries: dict[bytes, float]) -> bool:
        """Replace the board (a tier keeps the first value put under a name: delete, then put)."""
        self.tier.delete([self.board_name()])
        return bool(self.tier.put([(self.board_name(), encode_board(entries))])[0]) if entries else True
