"""Objects in a tier: encode and name on the way in, verify on the way out.

:class:`ObjectStore` binds a tier (or a stack) to one layout namespace. A
loaded object is checked against the key and parts asked for; an object that
fails (corrupted, truncated, another layout) is a miss, counted, and deleted
from the tier so it cannot fail again. Nothing unverified reaches a pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace

import numpy as np

from hybridkv.models.layout import ModelCacheLayout
from hybridkv.tiers.base import Tier
from hybridkv.tiers.keys import OBJECT_KINDS, ObjectKey, name_prefix
from hybridkv.tiers.namespace import Namespace, layout_namespace
from hybridkv.tiers.objects import (
    NamespaceMismatch,
    ObjectError,
    RowsObject,
    decode_object,
    encode_object,
    encoded_size,
)
from hybridkv.tiers.pools import layout_parts


@dataclass
class StoreStats:
    offered: int = 0  # objects offered to put
    stored: int = 0
    requested: int = 0  # objects asked for by get
    loaded: int = 0  # verified and returned
    missing: int = 0  # not in any tier (or a tier fault)
    corrupt: int = 0  # failed verification: checksum, lengths, key or parts
    refused: int = 0  # another layout's namespace
    last_error: str = ""


class ObjectStore:
    """``put`` / ``get`` / ``contains`` / ``delete`` of :class:`RowsObject` through ``tier``."""

    def __init__(self, tier: Tier, layout: ModelCacheLayout, *, model_id: str | None = None) -> None:
        self.tier = tier
        self.layout = layout
        self.namespace: Namespace = layout_namespace(layout, model_id)
        self._parts = {g.group_id: layout_parts(layout, g.group_id) for g in layout.groups}
        self._prefixes = {(g.group_id, kind): name_prefix(self.namespace, g.group_id, kind)
                          for g in layout.groups for kind in OBJECT_KINDS}
        self._stats = StoreStats()

    def name(self, key: ObjectKey) -> str:
        """``key.name(self.namespace)``, from a prefix made once per group and kind."""
        prefix = self._prefixes.get((key.group_id, key.kind))
        if prefix is None:
            raise ValueError(f"no group {key.group_id!r} in layout {self.layout.name}")
        return prefix + key.key.hex()

    def put(self, objects: Sequence[RowsObject], *, in_place: bool = False, given: bool = False) -> list[bool]:
        """Encode and put the objects; per object, whether a tier stored it. ``in_place``: each
        payload has room for its header right before it (``gather_objects(..., room_bytes=)``),
        and the header is written there rather than the payload copied (``encode_object``).
        ``given`` (with ``in_place``): the payloads' buffers are handed to the tier, which may keep
        them rather than copy (``Tier.put(..., given=True)``: the host tier does)."""
        items = []
        for obj in objects:
            if obj.parts != self._parts.get(obj.key.group_id):
                raise ValueError(f"object of group {obj.key.group_id} has parts that are not this layout's")
            items.append((self.name(obj.key), encode_object(obj, self.namespace, in_place=in_place)))
        stored = self.tier.put(items, given=given and in_place)
        self._stats.offered += len(items)
        self._stats.stored += sum(stored)
        return stored

    def get(self, keys: Sequence[ObjectKey]) -> list[RowsObject | None]:
        """Per key, the verified object or ``None`` (absent, a tier fault, or refused by verification)."""
        objects, bad = self.verify(keys, self.tier.get([self.name(key) for key in keys]))
        self.discard(bad)
        return objects

    def fetch(self, keys: Sequence[ObjectKey], num_rows: Sequence[int]) -> list[RowsObject | None]:
        """``get`` of objects whose row counts are known (a plan knows them), through the tier's
        ``fetch``: the payloads may be views of the tier's receive buffers, valid until
        ``tier.fetch_views_kept`` more fetches, so use them (scatter them) before that."""
        objects, bad = self.verify(keys, self.receive(keys, num_rows))
        self.discard(bad)
        return objects

    def receive(self, keys: Sequence[ObjectKey], num_rows: Sequence[int]) -> list[memoryview | None]:
        """The first half of ``fetch``: the tier's ``fetch`` of the keys' stored bytes, not yet
        verified (``verify`` them; nothing unverified may reach a pool)."""
        sizes = [encoded_size(key, self._parts[key.group_id], rows) for key, rows in zip(keys, num_rows)]
        return self.tier.fetch([self.name(key) for key in keys], sizes)

    def verify(
        self, keys: Sequence[ObjectKey], values, *, helper: Executor | None = None
    ) -> tuple[list[RowsObject | None], list[ObjectKey]]:
        """The second half: per key the verified object or ``None`` (counted), and the keys whose
        bytes failed verification, for ``discard`` (kept apart so that a caller receiving on
        another thread deletes from the tier on one thread only). ``helper``: an executor that
        decodes (checksums) about half the bytes while this thread decodes the rest; the counting
        stays on this thread."""
        keys, values = list(keys), list(values)
        decoded = self._decode_split(keys, values, helper) if helper is not None else self._decode(keys, values)
        out: list[RowsObject | None] = []
        bad = []
        for key, value, obj in zip(keys, values, decoded):
            if value is None:
                self._stats.missing += 1
            elif isinstance(obj, ObjectError):
                if isinstance(obj, NamespaceMismatch):
                    self._stats.refused += 1
                else:
                    self._stats.corrupt += 1
                self._stats.last_error = str(obj)
                bad.append(key)
            out.append(obj if isinstance(obj, RowsObject) else None)
        self._stats.requested += len(keys)
        self._stats.loaded += sum(o is not None for o in out)
        return out, bad

    def _decode(self, keys: list[ObjectKey], values: list) -> list[RowsObject | ObjectError | None]:
        """Per key the decoded object, the ``ObjectError`` that refused it, or ``None`` (no value)."""
        out: list[RowsObject | ObjectError | None] = []
        for key, value in zip(keys, values):
            if value is None:
                out.append(None)
                continue
            try:
                out.append(decode_object(value, self.namespace, expect_key=key, expect_parts=self._parts[key.group_id]))
            except ObjectError as exc:
                out.append(exc)
        return out

    def _decode_split(self, keys: list[ObjectKey], values: list, helper: Executor) -> list:
        """``_decode`` with the values cut in two of about equal bytes, the first half on ``helper``."""
        sizes = np.cumsum([0 if v is None else len(v) for v in values])
        cut = int(np.searchsorted(sizes, sizes[-1] / 2)) if len(values) > 1 else 0
        first = helper.submit(self._decode, keys[:cut], values[:cut])
        rest = self._decode(keys[cut:], values[cut:])
        return first.result() + rest

    def discard(self, keys: Sequence[ObjectKey]) -> None:
        """Delete objects that failed verification from the tier, so they cannot fail again."""
        if keys:
            self.tier.delete([self.name(key) for key in keys])

    def contains(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return self.tier.contains([self.name(key) for key in keys])

    def delete(self, keys: Sequence[ObjectKey]) -> int:
        return self.tier.delete([self.name(key) for key in keys])

    def stats(self) -> StoreStats:
        return replace(self._stats)
