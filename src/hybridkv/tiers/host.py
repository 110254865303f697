"""Host memory tier: a byte budget and its own least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from hybridkv.tiers.base import Tier

# A view at least this large is copied with numpy, which releases the GIL while it copies
# (``bytes(view)`` holds it: another thread, an engine's step, would wait for the copy).
GIL_FREE_COPY_BYTES = 64 << 10


def owned_value(value: bytes | memoryview) -> bytes | memoryview:
    """``value`` as the tier may keep it: ``bytes`` as they are; a view copied, into ``bytes`` when
    small, else into a buffer of its own (copied without the GIL) seen as a read-only view."""
    if isinstance(value, bytes):
        return value
    if len(value) < GIL_FREE_COPY_BYTES:
        return bytes(value)
    buffer = np.empty(len(value), dtype=np.uint8)
    buffer[...] = np.frombuffer(value, dtype=np.uint8)
    return memoryview(buffer).toreadonly()


class HostTier(Tier):
    """Objects in process memory, at most ``budget_bytes`` of values in all.

    A put that does not fit evicts the least recently used objects (a get or
    a put of a held name counts as a use); an object larger than the whole
    budget is refused and counted, and evicts nothing. A value put as ``bytes`` is kept as it
    is; one put as a view is copied (a large one into a buffer of its own, without holding the
    GIL) and ``get`` answers it as a read-only ``memoryview``.
    """

    name = "host"
    put_copies = True  # views are copied in ``_put`` (``owned_value``), large ones off the GIL

    def __init__(self, budget_bytes: int) -> None:
        super().__init__()
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._objects: OrderedDict[str, bytes | memoryview] = OrderedDict()
        self._held_bytes = 0

    def _put(self, items: list[tuple[str, bytes]]) -> list[bool]:
        out = []
        for name, value in items:
            if name in self._objects:
                self._objects.move_to_end(name)
                out.append(True)
                continue
            if len(value) > self.budget_bytes:
                self._stats.refused += 1
                self._stats.last_error = f"object of {len(value)} B exceeds the host budget of {self.budget_bytes} B"
                out.append(False)
                continue
            while self._held_bytes + len(value) > self.budget_bytes:
                _, old = self._objects.popitem(last=False)
                self._held_bytes -= len(old)
                self._stats.evicted += 1
                self._stats.evicted_bytes += len(old)
            self._objects[name] = value = owned_value(value)
            self._held_bytes += len(value)
            self._stats.stored += 1
            self._stats.stored_bytes += len(value)
            out.append(True)
        self._sync_held()
        return out

    def _get(self, names: list[str]) -> list[bytes | memoryview | None]:
        out = []
        for name in names:
            value = self._objects.get(name)
            if value is not None:
                self._objects.move_to_end(name)
            out.append(value)
        return out

    def _contains(self, names: list[str]) -> list[bool]:
        return [name in self._objects for name in names]

    def _delete(self, names: list[str]) -> int:
        count = 0
        for name in names:
            value = self._objects.pop(name, None)
            if value is not None:
                self._held_bytes -= len(value)
                count += 1
        self._sync_held()
        return count

    def _sync_held(self) -> None:
        self._stats.held = len(self._objects)
        self._stats.held_bytes = self._held_bytes
