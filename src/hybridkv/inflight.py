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
lives at most ``ttl`` (:class:`InFlightRule`) on each reader's own clock, so
one left by a dead peer stops mattering; the link that publishes the block
deletes every computing marker of it, a request that ends deletes its own, and
the link that writes a wanted checkpoint through deletes its wanted markers;
one that does not decode counts as absent.

**Write-once slots.** A store may not replace an object (Mooncake keeps the
first value put under a name and refuses a delete while a read lease runs; an
overwrite of a name being read or replicated is not safe), so no marker name
is ever put on while it holds one. Each key has ``MARKER_SLOTS`` names,
``hkv1/<namespace>/marker/<computing|wanted>/<key>/<slot>`` (apart from the
objects'). A put asks ``contains`` of a key's slots, puts the new marker (a new
stamp) under a free one and reads it back: another value there means another
writer put that slot first (a race, counted ``races_lost``), and the next free
slot is tried, at most ``MARKER_ATTEMPTS`` times; a key whose slots are all
held stays unmarked (counted ``markers_refused``). Then the request's older
marker of that key, if any, is deleted. A reader gets every slot (one ``get``)
and takes a key as marked by another when any slot holds a live marker of
another request.

Payload (little-endian): ``HKVM``, version u8 (2), kind u8 (1 computing, 2
wanted), 2 reserved bytes, stamp u64 (random at each put: it tells one put
from another; no clock is written), owner 16 bytes (one per link), request id length u16, the request id (UTF-8).

**Expiry without a shared clock.** Clocks of two machines differ, and a wall
clock jumps. So nothing that crosses processes is compared with a reader's
clock: a reader notes, on its own clock (``InFlightRule.clock``, monotonic by
default), when it first saw each marker (a name with an owner, request id and
stamp) and each board entry (a key with a stamp), and takes it for expired
``ttl`` after that. A writer renews an entry by writing a new stamp. Clock
skew then changes nothing; what a reader cannot know is how long the object
lay there before it first looked, so an entry lives between ``ttl`` and
``ttl`` plus its age at first sight. Its writer saw it first, so the writer's
view expires it first (and renews it while it still needs it).

**The wanted board** (``hkv1/<namespace>/marker/board/<generation>``,
:class:`~hybridkv.tiers.versions.VersionLog`): the checkpoints a waiter wants
from whichever device holds one. A request that finds history blocks in the
store but no checkpoint where its prompt leaves them adds the boundary's key;
every link reads the board once per ``take_offloads`` and writes through the
listed checkpoints its device holds. A store may not replace an object (on
Mooncake, once a client has read the board, its delete is refused for the
read lease and a put under the same name keeps the old value), so the board is
a sequence of write-once generations: a writer reads the newest, puts the next
with its change, and reads it back. When two writers put the same generation,
one loses (a conflict: it reads the winner's and tries again, at most
``BOARD_ATTEMPTS`` times; then its change is lost and its waiter adds it again
at its next poll). Payload: ``HKVB``, version u8 (2), 3 reserved bytes, count
u32, then per entry stamp u64, key length u8, the key; at most
``MAX_BOARD_KEYS`` entries, the ones first seen longest ago dropped.

Deletes a store refuses (a Mooncake read lease) are counted and tried again at
the next call (up to ``DELETE_ATTEMPTS`` times), never raised. A link that deletes
markers it has just read (the wanted markers of the checkpoints it writes through)
puts the delete off to its next ``take_offloads`` (``defer_delete``), past the
read's lease, instead of having it refused once.
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
from hybridkv.tiers.versions import VersionLog, VersionStats

MARKER_MAGIC = b"HKVM"
MARKER_VERSION = 2
MARKER_KINDS = {"computing": 1, "wanted": 2}
_HEADER = struct.Struct("<4sBBHQ16sH")
MAX_REQUEST_ID_BYTES = 1024
BOARD_MAGIC = b"HKVB"
BOARD_VERSION = 2
MAX_BOARD_KEYS = 256
BOARD_ATTEMPTS = 3  # reads and appends of one board change before it is given up
BOARD_KEEP = 8  # generations kept (VersionLog ``keep``)
DELETE_ATTEMPTS = 8  # tries of a delete the store refuses
MAX_SIGHTINGS = 1 << 16  # first sightings remembered (the oldest forgotten first)
MARKER_SLOTS = 4  # names per key and kind: markers of that many requests at once
MARKER_ATTEMPTS = 3  # slots one put tries per key (the others were put first by racing writers)
_BOARD_HEADER = struct.Struct("<4sB3xI")
_BOARD_ENTRY = struct.Struct("<QB")


@dataclass(frozen=True)
class InFlightRule:
    """How long a request waits for a block another request is computing, and how long a
    marker lives. ``wait`` and ``ttl`` are in units of ``clock`` (seconds for the default,
    ``time.monotonic``; a simulation passes its step counter). ``clock`` only ever measures
    this process's own intervals. ``wait`` bounds a request's waiting in all."""

    wait: float = 2.0
    ttl: float = 30.0
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

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
    stamp: int  # random at each put (u64): tells puts apart; no clock crosses processes
    owner: bytes
    request_id: str


@dataclass
class MarkerStats:
    """Counters of one link's markers and board."""

    markers_refused: int = 0  # keys a put left unmarked: every slot held, the tier refused, races lost
    races_lost: int = 0  # slots another writer put first (the next free slot was tried)
    deletes_failed: int = 0  # deletes the store refused (each try)
    deletes_dropped: int = 0  # refused deletes given up after DELETE_ATTEMPTS
    board_changes_lost: int = 0  # board changes given up after BOARD_ATTEMPTS (or a dead store)
    board: VersionStats = field(default_factory=VersionStats)  # its generations: appended, conflicts...


def encode_marker(marker: Marker) -> bytes:
    rid = marker.request_id.encode()
    if len(rid) > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request id of {len(rid)} bytes: at most {MAX_REQUEST_ID_BYTES}")
    if len(marker.owner) != 16:
        raise ValueError("a marker's owner is 16 bytes")
    head = _HEADER.pack(MARKER_MAGIC, MARKER_VERSION, MARKER_KINDS[marker.kind], 0, int(marker.stamp),
                        marker.owner, len(rid))
    return head + rid


def decode_marker(data: bytes | memoryview | None) -> Marker | None:
    """The marker in ``data``, or None for anything that is not a whole version-2 marker."""
    if data is None or len(data) < _HEADER.size:
        return None
    magic, version, kind, _, stamp, owner, size = _HEADER.unpack_from(bytes(data[: _HEADER.size]))
    names = {v: k for k, v in MARKER_KINDS.items()}
    if magic != MARKER_MAGIC or version != MARKER_VERSION or kind not in names or len(data) != _HEADER.size + size:
        return None
    try:
        rid = bytes(data[_HEADER.size:]).decode()
    except UnicodeDecodeError:
        return None
    return Marker(names[kind], stamp, owner, rid)


def encode_board(entries: dict[bytes, int]) -> bytes:
    """A board of ``{key bytes: stamp}`` (at most ``MAX_BOARD_KEYS``, keys of 1 to 255 bytes,
    stamps u64)."""
    if len(entries) > MAX_BOARD_KEYS:
        raise ValueError(f"a board holds at most {MAX_BOARD_KEYS} keys, got {len(entries)}")
    out = [_BOARD_HEADER.pack(BOARD_MAGIC, BOARD_VERSION, len(entries))]
    for key, stamp in entries.items():
        if not 1 <= len(key) <= 255:
            raise ValueError(f"a board key has 1 to 255 bytes, got {len(key)}")
        out.append(_BOARD_ENTRY.pack(stamp, len(key)) + bytes(key))
    return b"".join(out)


def decode_board(data: bytes | memoryview | None) -> dict[bytes, int]:
    """The board in ``data`` as ``{key bytes: stamp}``; empty for anything that is not a whole board."""
    if data is None or len(data) < _BOARD_HEADER.size:
        return {}
    data = bytes(data)
    magic, version, count = _BOARD_HEADER.unpack_from(data)
    if magic != BOARD_MAGIC or version != BOARD_VERSION or count > MAX_BOARD_KEYS:
        return {}
    out, at = {}, _BOARD_HEADER.size
    for _ in range(count):
        if at + _BOARD_ENTRY.size > len(data):
            return {}
        stamp, size = _BOARD_ENTRY.unpack_from(data, at)
        at += _BOARD_ENTRY.size
        if size == 0 or at + size > len(data):
            return {}
        out[data[at:at + size]] = stamp
        at += size
    return out if at == len(data) else {}


def new_stamp() -> int:
    return int.from_bytes(os.urandom(8), "little")


class Sightings:
    """When this reader first saw each version of a thing (``ident -> (version, first seen)``)
    on its own clock; a version is expired ``ttl`` after that."""

    def __init__(self, ttl: float, limit: int = MAX_SIGHTINGS):
        self.ttl = ttl
        self.limit = limit
        self._first: dict[object, tuple[object, float]] = {}

    def first_seen(self, ident: object, version: object, now: float) -> float:
        seen = self._first.get(ident)
        if seen is None or seen[0] != version:
            self._first.pop(ident, None)
            if len(self._first) >= self.limit:
                del self._first[next(iter(self._first))]
            seen = self._first[ident] = (version, now)
        return seen[1]

    def live(self, ident: object, version: object, now: float) -> bool:
        return now - self.first_seen(ident, version, now) < self.ttl

    def __contains__(self, ident: object) -> bool:
        return ident in self._first

    def forget(self, ident: object) -> None:
        self._first.pop(ident, None)

    def keep_only(self, idents: set) -> None:
        for ident in [i for i in self._first if i not in idents]:
            del self._first[ident]


class Markers:
    """One link's view of the markers and the wanted board in ``tier`` under ``namespace``."""

    def __init__(self, tier: Tier, namespace: Namespace, rule: InFlightRule, owner: bytes | None = None):
        self.tier = tier
        self.namespace = namespace
        self.rule = rule
        self.owner = os.urandom(16) if owner is None else bytes(owner)
        if len(self.owner) != 16:
            raise ValueError("owner must be 16 bytes")
        self._seen = Sightings(rule.ttl)  # marker name -> (owner, request id, stamp)
        self._seen_entries = Sightings(rule.ttl)  # board key -> stamp
        self._log = VersionLog(tier, self.board_name(), keep=BOARD_KEEP)
        self._undeleted: dict[str, int] = {}  # names whose delete was refused -> tries
        self._later: list[str] = []  # names read by this link just now: deleted at delete_deferred()
        # (kind, key) -> {request: (its name, the value put there)}
        self._own: dict[tuple[str, bytes], dict[str, tuple[str, bytes]]] = {}
        self._stats = MarkerStats()

    def names(self, kind: str, key: bytes | int) -> list[str]:
        """The ``MARKER_SLOTS`` names a ``kind`` marker of ``key`` may have."""
        if kind not in MARKER_KINDS:
            raise ValueError(f"marker kind must be one of {tuple(MARKER_KINDS)}, got {kind!r}")
        base = f"hkv1/{self.namespace.hex}/marker/{kind}/{as_key_bytes(key).hex()}"
        return [f"{base}/{slot}" for slot in range(MARKER_SLOTS)]

    def now(self) -> float:
        return float(self.rule.clock())

    def stats(self) -> MarkerStats:
        out = MarkerStats(**{k: v for k, v in vars(self._stats).items() if k != "board"})
        out.board = self._log.stats()
        return out

    def put(self, kind: str, keys: Sequence[int], request_id: str) -> list[bool]:
        """Put a new ``kind`` marker of ``request_id`` under each key (it lives ``ttl``), each in
        a slot that holds nothing; then delete this request's older marker there. Per key,
        whether it is stored now (not: every slot held, the tier refused, or every race lost)."""
        if not keys:
            return []
        marker = Marker(kind, new_stamp(), self.owner, request_id)
        value = encode_marker(marker)
        unique = list(dict.fromkeys(as_key_bytes(k) for k in keys))
        placed = self._place(kind, unique, value)
        now = self.now()
        older = []
        for key, name in placed.items():
            self._seen.first_seen(name, (marker.owner, marker.request_id, marker.stamp), now)
            mine = self._own.setdefault((kind, key), {})
            old = mine.pop(request_id, None)
            if old is not None and old[0] != name:
                older.append(old)
            mine[request_id] = (name, value)
        while len(self._own) > MAX_SIGHTINGS:
            del self._own[next(iter(self._own))]
        self._stats.markers_refused += len(unique) - len(placed)
        if older:
            self._delete_own(older)
        return [as_key_bytes(k) in placed for k in keys]

    def _delete_own(self, owned: list[tuple[str, bytes]]) -> int:
        """Delete each (name, value) this link put where the name still holds that value (one
        ``get`` first): another link may have deleted it (every slot, or an expired marker) and
        put their own marker in the slot since. Not on a store whose reads lease (Mooncake): a
        delete right after the ``get`` would be refused, so there the names go unchecked."""
        if not owned or self.tier.reads_lease:
            return self._delete([name for name, _ in owned])
        values = self.tier.get([name for name, _ in owned])
        return self._delete([name for (name, mine), now in zip(owned, values) if now == mine])

    def _place(self, kind: str, keys: list[bytes], value: bytes) -> dict[bytes, str]:
        """Put ``value`` under a free slot of each key: ``{key: its name}`` for those it holds.
        A slot is free when ``contains`` says so; a put there that reads back another value lost
        a race with another writer (counted), and the next free slot is tried, at most
        ``MARKER_ATTEMPTS`` times. No name that holds an object is ever put on knowingly."""
        slots = {key: self.names(kind, key) for key in keys}
        lost: set[str] = set()
        placed: dict[bytes, str] = {}
        todo = keys
        for _ in range(MARKER_ATTEMPTS):
            flat = [name for key in todo for name in slots[key]]
            held = dict(zip(flat, self.tier.contains(flat)))
            picks = {}
            for key in todo:
                free = [n for n in slots[key] if not held[n] and n not in lost]
                if free:
                    picks[key] = free[0]
            if not picks:
                break
            todo = self._put_picks(picks, value, placed, lost)
            if not todo:
                break
        return placed

    def _put_picks(self, picks: dict[bytes, str], value: bytes, placed: dict[bytes, str], lost: set[str]
                   ) -> list[bytes]:
        """Put ``value`` under each key's picked name and read it back: a name that reads back
        ``value`` is the key's (to ``placed``); one that reads back another writer's value lost
        a race (to ``lost``, counted). Returns the keys to try again; a refused put is not."""
        stored = self.tier.put([(name, value) for name in picks.values()])
        backs = iter(self.tier.get([name for name, ok in zip(picks.values(), stored) if ok]))
        todo = []
        for (key, name), ok in zip(picks.items(), stored):
            if not ok:
                continue  # refused (full, or a dead store): not tried again now
            if next(backs) == value:
                placed[key] = name
            else:
                lost.add(name)
                self._stats.races_lost += 1
                todo.append(key)
        return todo

    def delete(self, kind: str, keys: Sequence[int], request_id: str | None = None) -> int:
        """Delete the ``kind`` markers of ``keys``: every one there (``request_id`` None: a delete
        of every slot), or only this link's of ``request_id`` where it still holds it
        (``_delete_own``); how many were there. A refused delete is counted and tried again at
        the next call."""
        if not keys:
            return 0
        if request_id is not None:
            owned = [n for k in keys if (n := self._own.get((kind, as_key_bytes(k)), {}).pop(request_id, None))]
            for name, _ in owned:
                self._seen.forget(name)
            return self._delete_own(owned)
        else:
            names = [name for k in keys for name in self.names(kind, k)]
            for k in keys:
                self._own.pop((kind, as_key_bytes(k)), None)
        for name in names:
            self._seen.forget(name)
        return self._delete(names)

    def defer_delete(self, kind: str, keys: Sequence[int]) -> None:
        """Delete every ``kind`` marker of ``keys`` at the next :meth:`delete_deferred`, not now:
        this link has just read them, and a store with read leases (Mooncake) refuses a delete
        within the lease of a read."""
        for key in keys:
            self._own.pop((kind, as_key_bytes(key)), None)
            for name in self.names(kind, key):
                self._seen.forget(name)
                self._later.append(name)

    def delete_deferred(self) -> int:
        """Run the deletes :meth:`defer_delete` put off (with any refused before); how many
        markers were there."""
        names, self._later = list(dict.fromkeys(self._later)), []
        return self._delete(names) if names or self._undeleted else 0

    def _delete(self, names: list[str]) -> int:
        """Delete ``names`` and those refused before (one ``delete_each``: no ``contains``, which
        on Mooncake would lease them); the refused ones wait for the next call."""
        again = [n for n in self._undeleted if n not in names]
        names = list(dict.fromkeys(names + again))
        if not names:
            return 0
        outcome = self.tier.delete_each(names)
        for name, done in zip(names, outcome):
            tries = self._undeleted.pop(name, 0) + 1
            if done is not None:
                continue
            self._stats.deletes_failed += 1
            if tries < DELETE_ATTEMPTS:
                self._undeleted[name] = tries
            else:
                self._stats.deletes_dropped += 1
        return sum(done is True for done in outcome)

    def read(self, kind: str, keys: Sequence[int]) -> list[list[Marker]]:
        """Per key, the ``kind`` markers there that decode, live or not (one ``get``)."""
        flat = [name for k in keys for name in self.names(kind, k)]
        values = iter(self.tier.get(flat)) if flat else iter(())
        out = []
        for _ in keys:
            found = [decode_marker(next(values)) for _ in range(MARKER_SLOTS)]
            out.append([m for m in found if m is not None and m.kind == kind])
        return out

    def others(self, kind: str, keys: Sequence[int], request_id: str) -> list[bool]:
        """Per key: whether a live ``kind`` marker of another request (of any link) is there (one
        ``get`` of every slot). An expired marker, or one that does not decode, is absent (and
        deleted)."""
        if not keys:
            return []
        if self._undeleted:
            self._delete([])
        flat = [name for k in keys for name in self.names(kind, k)]
        values = self.tier.get(flat)
        now = self.now()
        busy, stale = [False] * len(flat), []
        for i, (name, value) in enumerate(zip(flat, values)):
            marker = decode_marker(value)
            if value is None:
                self._seen.forget(name)
            elif marker is None or marker.kind != kind or not self._seen.live(
                    name, (marker.owner, marker.request_id, marker.stamp), now):
                stale.append(name)
            else:
                busy[i] = (marker.owner, marker.request_id) != (self.owner, request_id)
        if stale:
            self._delete(stale)
            for name in stale:  # deleted: a value put there later is new (one still there stays expired)
                if name not in self._undeleted:
                    self._seen.forget(name)
        return [any(busy[i:i + MARKER_SLOTS]) for i in range(0, len(flat), MARKER_SLOTS)]

    def present(self, kind: str, keys: Sequence[int]) -> list[bool]:
        """Per key: whether a ``kind`` marker is there (by ``contains``, expiry unread)."""
        if not keys:
            return []
        held = self.tier.contains([name for k in keys for name in self.names(kind, k)])
        return [any(held[i:i + MARKER_SLOTS]) for i in range(0, len(held), MARKER_SLOTS)]

    # --- the wanted board ---------------------------------------------------------
    def board_name(self) -> str:
        """The base name of the board's generations (``<board_name>/<generation>``)."""
        return f"hkv1/{self.namespace.hex}/marker/board"

    def board(self) -> dict[bytes, float]:
        """The live entries of the wanted board, ``{key bytes: when it expires on this link's
        clock}`` (one ``contains`` and one ``get``)."""
        if self._undeleted:
            self._delete([])
        return self._live(self._read_board()[1])

    def want(self, keys: Sequence[int]) -> bool:
        """Add ``keys`` to the board (each lives ``ttl``) unless listed; whether it was written."""
        wanted = list(dict.fromkeys(as_key_bytes(k) for k in keys))

        def change(live: dict[bytes, int]) -> dict[bytes, int] | None:
            missing = [key for key in wanted if key not in live]
            if not missing:
                return None
            live.update((key, new_stamp()) for key in missing)
            if len(live) > MAX_BOARD_KEYS:  # the ones seen longest ago go
                live = dict(list(live.items())[-MAX_BOARD_KEYS:])
            return live

        return self._change_board(change)

    def unwant(self, keys: Sequence[int]) -> bool:
        """Take ``keys`` off the board (when listed); whether it was written."""
        gone = {as_key_bytes(k) for k in keys}

        def change(live: dict[bytes, int]) -> dict[bytes, int] | None:
            if not gone & live.keys():
                return None
            return {key: stamp for key, stamp in live.items() if key not in gone}

        return self._change_board(change)

    def _read_board(self) -> tuple[int, dict[bytes, int]]:
        """The newest generation and its entries. Read each time, not kept: a store that lost
        everything (a restarted master) numbers its generations from 1 again."""
        generation, value = self._log.read()
        return generation, decode_board(value)

    def _live(self, entries: dict[bytes, int]) -> dict[bytes, float]:
        """The entries not expired on this link's clock, with their expiry (sightings of keys
        no longer listed are forgotten)."""
        now = self.now()
        self._seen_entries.keep_only(set(entries))
        out = {}
        for key, stamp in entries.items():
            first = self._seen_entries.first_seen(key, stamp, now)
            if now - first < self.rule.ttl:
                out[key] = first + self.rule.ttl
        return out

    def _change_board(self, change: Callable[[dict[bytes, int]], dict[bytes, int] | None]) -> bool:
        """Read the board, apply ``change`` to its live entries (None: nothing to write) and
        append the result as the next generation; on a conflict, read and try again."""
        for _ in range(BOARD_ATTEMPTS):
            generation, entries = self._read_board()
            live = self._live(entries)
            changed = change({key: entries[key] for key in sorted(live, key=live.get)})
            if changed is None:
                return False
            now = self.now()
            if self._log.append(generation + 1, encode_board(changed)):
                for key, stamp in changed.items():
                    self._seen_entries.first_seen(key, stamp, now)
                return True
            if self._log.known <= generation:  # refused or unreadable: a dead store
                break
        self._stats.board_changes_lost += 1
        return False
