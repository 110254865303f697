"""Content keys: chained block keys over token ids, and the names objects are stored under.

A prefix's key at boundary ``D`` is a chain of XXH3-128 digests over blocks of
``block_tokens`` token ids (int32 little-endian): ``k_0 = H(salt)``,
``k_{i+1} = H(k_i || tokens of block i)``, where the last block may be partial
(``D`` not a multiple of ``block_tokens``). One digest identifies the whole
prefix, so a block's object and a checkpoint at its end are found by the key
alone. The chain is hybridkv's own; the manager's prefix cache may use another
and hand its keys over as bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import xxhash

from hybridkv.tiers.namespace import Namespace

ObjectKind = Literal["block", "checkpoint"]
OBJECT_KINDS: tuple[str, ...] = ("block", "checkpoint")
MAX_KEY_BYTES = 64
_SIXTEEN_BYTES = 1 << 128


def _token_bytes(token_ids: object) -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"token ids must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**31):
        raise ValueError("token ids must lie in [0, 2**31)")
    return arr.astype("<i4", copy=False)


def chained_keys(token_ids: object, block_tokens: int, *, salt: bytes = b"") -> list[bytes]:
    """Keys at every boundary ``block_tokens, 2 * block_tokens, ...`` and at the end.

    Entry ``i`` is the key of the prefix ``token_ids[: min((i + 1) * block_tokens, n)]``;
    a partial last block gets its own key (a different one from any full block's).
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    tokens = _token_bytes(token_ids)
    key = xxhash.xxh3_128_digest(b"hybridkv-prefix\x00" + bytes(salt))
    keys = []
    for start in range(0, tokens.size, block_tokens):
        key = xxhash.xxh3_128_digest(key + tokens[start : start + block_tokens].tobytes())
        keys.append(key)
    return keys


def boundary_key(token_ids: object, boundary_tokens: int, block_tokens: int, *, salt: bytes = b"") -> bytes:
    """The key of the prefix ``token_ids[:boundary_tokens]`` (its last chained key)."""
    if not 1 <= boundary_tokens <= len(token_ids):
        raise ValueError(f"boundary {boundary_tokens} outside [1, {len(token_ids)}]")
    return chained_keys(np.asarray(token_ids)[:boundary_tokens], block_tokens, salt=salt)[-1]


def as_key_bytes(key: bytes | int) -> bytes:
    """A content key as bytes: ``bytes`` as is, a non-negative ``int`` (a manager's hash) big-endian."""
    if isinstance(key, (bytes, bytearray)):
        out = bytes(key)
    elif isinstance(key, (int, np.integer)) and not isinstance(key, bool) and key >= 0:
        out = int(key).to_bytes(max(16, (int(key).bit_length() + 7) // 8), "big")
    else:
        raise ValueError(f"a content key must be bytes or a non-negative int, got {key!r}")
    if not 1 <= len(out) <= MAX_KEY_BYTES:
        raise ValueError(f"a content key must have 1 to {MAX_KEY_BYTES} bytes, got {len(out)}")
    return out


@dataclass(frozen=True)
class ObjectKey:
    """What an object holds: a history block's rows or a checkpoint's trailing rows of one group."""

    kind: ObjectKind
    group_id: str
    key: bytes

    def __post_init__(self) -> None:
        if self.kind not in OBJECT_KINDS:
            raise ValueError(f"kind must be one of {OBJECT_KINDS}, got {self.kind!r}")
        if not isinstance(self.group_id, str) or not self.group_id or "/" in self.group_id:
            raise ValueError(f"group_id must be a non-empty str without '/', got {self.group_id!r}")
        object.__setattr__(self, "key", as_key_bytes(self.key))

    @classmethod
    def of_checked(cls, kind: ObjectKind, group_id: str, key: int) -> ObjectKey:
        """A key of a kind and group the caller has checked already (a tier link checks its
        manager's groups once) and a manager's hash (a non-negative ``int``): as
        ``ObjectKey(kind, group_id, key)`` without checking the kind and group again (a plan
        makes hundreds per step)."""
        out = object.__new__(cls)
        # a 128-bit hash (or less) is 16 bytes big-endian, as as_key_bytes makes it
        raw = key.to_bytes(16, "big") if type(key) is int and 0 <= key < _SIXTEEN_BYTES else as_key_bytes(key)
        out.__dict__.update(kind=kind, group_id=group_id, key=raw)
        return out

    def name(self, namespace: Namespace) -> str:
        """The store name: ``hkv1/<namespace>/<group>/<kind>/<key>`` (ASCII, no rank)."""
        return f"{name_prefix(namespace, self.group_id, self.kind)}{self.key.hex()}"


def store_names(prefixes: Mapping[str, str], entries: Iterable[tuple[str, int]]) -> list[str]:
    """The store names of ``(group, key)`` entries, a manager hash ``key`` each:
    ``prefixes[group]`` (the group's :func:`name_prefix`) and the hex of ``ObjectKey.of_checked``'s
    key bytes, as ``ObjectStore.name`` names their ``ObjectKey``s (one loop, no key made)."""
    out = []
    for gid, key in entries:
        raw = key.to_bytes(16, "big") if type(key) is int and 0 <= key < _SIXTEEN_BYTES else as_key_bytes(key)
        out.append(prefixes[gid] + raw.hex())
    return out


def name_prefix(namespace: Namespace, group_id: str, kind: str) -> str:
    """What every store name of ``group_id``'s objects of ``kind`` starts with (before the key's hex)."""
    return f"hkv1/{namespace.hex}/{group_id}/{kind}/"
