"""Host memory tier: a byte budget and its own least-recently-used eviction."""

from __future__ import annotations

import threading
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


def given_buffer(value: bytes | memoryview) -> np.ndarray | None:
    """The whole numpy buffer a view sees (the array no other array is a view of), or None when
    ``value`` is not a view of one."""
    buffer = value.obj if isinstance(value, memoryview) else None
    while isinstance(buffer, np.ndarray) and isinstance(buffer.base, np.ndarray):
        buffer = buffer.base
    return buffer if isinstance(buffer, np.ndarray) and buffer.base is None else None


class HostTier(Tier):
    """Objects in process memory, at most ``budget_bytes`` of values in all.

    A put that does not fit evicts the least recently used objects (a get or
    a put of a held name counts as a use); an object larger than the whole
    budget is refused and counted, and evicts nothing. A value put as ``bytes`` is kept as it
    is; one put as a view is copied (a large one into a buffer of its own, without holding the
    GIL) and ``get`` answers it as a read-only ``memoryview``. A view put ``given`` (its buffer
    handed over: an offload's rows) is kept as it is, no copy; its buffer counts against the
    budget whole, once, while any value in it is held (``held_bytes`` is the memory held).
    """

    name = "host"
    put_copies = True  # views are copied in ``_put`` (``owned_value``), large ones off the GIL
    keeps_given = True  # ... unless given: then kept, their buffers counted whole

    def __init__(self, budget_bytes: int) -> None:
        super().__init__()
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._objects: OrderedDict[str, bytes | memoryview] = OrderedDict()
        self._held_bytes = 0
        self._buffers: dict[int, list] = {}  # id of a given buffer -> [the buffer, values held in it]
        self._buffer_of: dict[str, int] = {}  # name of a value kept given -> id of its buffer
        self._lock = threading.Lock()

    def _put(self, items: list[tuple[str, bytes]]) -> list[bool]:
        return self._put_values(items, given=False)

    def _put_given(self, items: list[tuple[str, bytes]]) -> list[bool]:
        return self._put_values(items, given=True)

    def _put_values(self, items: list[tuple[str, bytes]], given: bool) -> list[bool]:
        out = [self._put_one(name, value, given) for name, value in items]
        with self._lock:
            self._sync_held()
        return out

    def _put_one(self, name: str, value: bytes | memoryview, given: bool) -> bool:
        """Keep one value (evicting the least recently used to fit); False when it is refused."""
        if self._touch(name):
            return True
        if len(value) > self.budget_bytes:
            self._stats.refused += 1
            self._stats.last_error = f"object of {len(value)} B exceeds the host budget of {self.budget_bytes} B"
            return False
        buffer = given_buffer(value) if given else None
        if buffer is None or buffer.nbytes > self.budget_bytes:
            buffer, value = None, owned_value(value)  # copied outside the lock
        else:
            value = value.toreadonly()  # what ``get`` answers cannot be written through
        with self._lock:
            if name in self._objects:  # another thread put it meanwhile
                self._objects.move_to_end(name)
                return True
            while self._held_bytes + self._cost(value, buffer) > self.budget_bytes:
                old = self._forget(next(iter(self._objects)))
                self._stats.evicted += 1
                self._stats.evicted_bytes += len(old)
            self._keep(name, value, buffer)
        self._stats.stored += 1
        self._stats.stored_bytes += len(value)
        return True

    def _touch(self, name: str) -> bool:
        """Whether ``name`` is held (then it becomes the most recently used)."""
        with self._lock:
            if name not in self._objects:
                return False
            self._objects.move_to_end(name)
            return True

    def _cost(self, value: bytes | memoryview, buffer: np.ndarray | None) -> int:
        """The bytes keeping ``value`` adds: its own, or its buffer's when none of it is held yet."""
        if buffer is None:
            return len(value)
        return 0 if id(buffer) in self._buffers else buffer.nbytes

    def _keep(self, name: str, value: bytes | memoryview, buffer: np.ndarray | None) -> None:
        self._held_bytes += self._cost(value, buffer)
        self._objects[name] = value
        if buffer is not None:
            self._buffers.setdefault(id(buffer), [buffer, 0])[1] += 1
            self._buffer_of[name] = id(buffer)

    def _forget(self, name: str) -> bytes | memoryview:
        """Drop a held value (its bytes, or its buffer's once no value in it is held); the value."""
        value = self._objects.pop(name)
        ident = self._buffer_of.pop(name, None)
        if ident is None:
            self._held_bytes -= len(value)
            return value
        entry = self._buffers[ident]
        entry[1] -= 1
        if not entry[1]:
            del self._buffers[ident]
            self._held_bytes -= entry[0].nbytes
        return value

    def _get(self, names: list[str]) -> list[bytes | memoryview | None]:
        out = []
        with self._lock:
            for name in names:
                value = self._objects.get(name)
                if value is not None:
                    self._objects.move_to_end(name)
                out.append(value)
        return out

    def _contains(self, names: list[str]) -> list[bool]:
        with self._lock:
            return [name in self._objects for name in names]

    def _delete(self, names: list[str]) -> int:
        count = 0
        with self._lock:
            for name in names:
                if name in self._objects:
                    self._forget(name)
                    count += 1
            self._sync_held()
        return count

    def _sync_held(self) -> None:
        self._stats.held = len(self._objects)
        self._stats.held_bytes = self._held_bytes
