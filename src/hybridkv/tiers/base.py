"""The tier interface: batched put, get, contains and delete of named byte objects.

A tier never raises out of these four calls for a storage fault (a full
budget, a full disk, a dead server): it answers "not stored" / a miss and
counts the fault in :class:`TierStats`. It raises ``ValueError`` only for a
caller's mistake (a name that is not a non-empty str, a value that is not
bytes). Each tier keeps and evicts on its own; no tier knows the device.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass
class TierStats:
    """Counters since the tier was made (objects unless a name says bytes)."""

    stored: int = 0  # puts that stored an object
    stored_bytes: int = 0
    refused: int = 0  # puts not stored: larger than the budget, disk or store full, or a fault
    lookups: int = 0  # names asked for by get
    hits: int = 0
    misses: int = 0
    errors: int = 0  # faults: I/O errors, a full disk, an unreachable store (each counted once)
    evicted: int = 0  # objects this tier dropped to make room
    evicted_bytes: int = 0
    deleted: int = 0
    held: int = 0  # objects held now (-1: unknown, e.g. a shared store)
    held_bytes: int = 0
    last_error: str = ""


class TierUnavailable(RuntimeError):
    """A tier cannot be set up (a missing package or library, an unreachable server)."""


def check_items(items: Sequence[tuple[str, bytes]], *, views: bool = False) -> list[tuple[str, bytes]]:
    """Items with checked names and values: ``bytes``, or a ``bytearray`` / ``memoryview`` copied
    into ``bytes`` (kept as a byte view when ``views``: the tier copies the value while it puts)."""
    out = []
    for item in items:
        name, value = item
        check_name(name)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ValueError(f"value of {name!r} must be bytes, got {type(value).__name__}")
        if not isinstance(value, bytes):
            value = memoryview(value).cast("B") if views else bytes(value)
        out.append((name, value))
    return out


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"an object name must be a non-empty str, got {name!r}")
    return name


class Tier(ABC):
    """One storage level. Subclasses implement the ``_`` methods; counting happens here."""

    name: str = "tier"
    # How many consecutive fetches' views stay valid together (None: all of them; the views
    # hold their own bytes). A tier that receives into buffers of its own reuses them.
    fetch_views_kept: int | None = None
    # Whether ``put`` copies each value before it returns (then a caller may hand it a view of a
    # buffer it reuses, and no ``bytes`` is made); otherwise values are kept and made ``bytes``.
    put_copies: bool = False
    # A read pins what it read for a while: a delete right after it is refused (Mooncake).
    reads_lease: bool = False
    # Whether ``put(..., given=True)`` keeps the values' views as they are (``_put_given``).
    keeps_given: bool = False

    def __init__(self) -> None:
        self._stats = TierStats()

    def put(self, items: Sequence[tuple[str, bytes]], *, given: bool = False) -> list[bool]:
        """Store ``(name, bytes)`` pairs; per item, whether it is stored now. ``given``: the caller
        hands the tier the buffers its views see and never writes them again (an offload's rows,
        gathered into new buffers): a tier that keeps values (``keeps_given``) keeps such views
        without copying them."""
        items = check_items(items, views=self.put_copies)
        return self._put_given(items) if given and self.keeps_given else self._put(items)

    def _put_given(self, items: list[tuple[str, bytes]]) -> list[bool]:
        """``_put`` of values whose buffers are handed over (tiers with ``keeps_given``)."""
        return self._put(items)

    def get(self, names: Sequence[str]) -> list[bytes | None]:
        """Per name, the stored bytes or ``None`` (a miss, or a fault counted in ``errors``)."""
        names = [check_name(n) for n in names]
        values = self._get(names)
        hits = sum(v is not None for v in values)
        self._stats.lookups += len(names)
        self._stats.hits += hits
        self._stats.misses += len(names) - hits
        return values

    def fetch(self, names: Sequence[str], sizes: Sequence[int]) -> list[memoryview | None]:
        """``get`` of objects whose sizes the caller knows, as read-only views. A tier may
        receive into buffers of its own: the views stay valid until ``fetch_views_kept`` more
        fetches have been made (copy what must outlive them). Counted as ``get``."""
        names = [check_name(n) for n in names]
        if len(sizes) != len(names):
            raise ValueError(f"{len(sizes)} sizes for {len(names)} names")
        values = self._fetch(names, [int(size) for size in sizes])
        hits = sum(v is not None for v in values)
        self._stats.lookups += len(names)
        self._stats.hits += hits
        self._stats.misses += len(names) - hits
        return values

    def _fetch(self, names: list[str], sizes: list[int]) -> list[memoryview | None]:
        return [None if v is None else memoryview(v) for v in self._get(names)]

    @contextlib.contextmanager
    def put_buffer(self, nbytes: int) -> Iterator[np.ndarray | None]:
        """A ``uint8`` buffer of ``nbytes`` to build values in, for the ``with`` block: values put
        as views of it are sent from it without a copy of their own (the Mooncake tier registers
        one with the store). ``None`` when the tier has none, or none that large or free now;
        then build the values anywhere."""
        yield None

    def contains(self, names: Sequence[str]) -> list[bool]:
        names = list(names)
        for name in names:  # checked inline: a tier link asks for a plan's names every step
            if not isinstance(name, str) or not name:
                check_name(name)
        return self._contains(names)

    def delete(self, names: Sequence[str]) -> int:
        """Drop the named objects; how many were held."""
        count = self._delete([check_name(n) for n in names])
        self._stats.deleted += count
        return count

    def delete_each(self, names: Sequence[str]) -> list[bool | None]:
        """``delete``, told per name: True deleted, False not held, None held still (the store
        refused: a Mooncake read lease, or a fault). No ``contains`` is needed to tell a refused
        delete from an absent name (on Mooncake a ``contains`` leases the name it asks about)."""
        out = self._delete_each([check_name(n) for n in names])
        self._stats.deleted += sum(o is True for o in out)
        return out

    def _delete_each(self, names: list[str]) -> list[bool | None]:
        """One ``_delete`` per name (tiers that cannot refuse a delete)."""
        return [self._delete([name]) == 1 for name in names]

    def stats(self) -> TierStats:
        return replace(self._stats)

    def close(self) -> None:
        """Release what the tier holds open (files, connections); stored objects stay where they live."""

    def _count_puts(self, items: Sequence[tuple[str, bytes]], stored: Sequence[bool]) -> None:
        """Count each item's put as stored (with its bytes) or refused."""
        for (_, value), ok in zip(items, stored):
            if ok:
                self._stats.stored += 1
                self._stats.stored_bytes += len(value)
            else:
                self._stats.refused += 1

    def _fault(self, message: str, count: int = 1) -> None:
        self._stats.errors += count
        self._stats.last_error = message

    @abstractmethod
    def _put(self, items: list[tuple[str, bytes]]) -> list[bool]: ...

    @abstractmethod
    def _get(self, names: list[str]) -> list[bytes | None]: ...

    @abstractmethod
    def _contains(self, names: list[str]) -> list[bool]: ...

    @abstractmethod
    def _delete(self, names: list[str]) -> int: ...
