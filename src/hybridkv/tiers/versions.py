"""One small value that changes, kept in a tier as a sequence of write-once objects.

A tier may not replace a value: Mooncake Store keeps the first value put under
a name (a second ``put`` answers success and changes nothing) and refuses to
remove an object while a client's read lease on it runs; the host and disk
tiers keep the first value too. So a value that changes (the wanted board of
:mod:`hybridkv.inflight`) is written as *versions*, objects named
``<base>/<g>`` for generations ``g = 1, 2, 3, ...``, each written once and
never changed: the newest generation present is the value.

**Writing.** A writer reads the newest generation ``h`` and puts ``h + 1``,
then reads it back and looks above it: when another writer put ``h + 1``
first, the read-back shows the other value; when more than ``keep`` others
were written between the read and the put, ``h + 1`` had been deleted and this
put made it again, and newer ones are there. Either way
:meth:`VersionLog.append` answers False (counted ``conflicts``) and the caller
reads again and retries. A generation made again so is deleted at once when
the newest generation found says it is out of the kept set: left there, it
could fill a hole below the newest and stop a reader's scan short of it. A put the tier
refuses, or a read-back that misses, is a failed append (counted), never an
exception.

**Keeping and finding.** Generation ``g`` with ``t`` trailing zero bits is
kept while the newest generation is below ``g + keep * 2**t``: the writer of
``g + keep * 2**t`` deletes it (one delete an append when ``keep`` is a
power of two). So the last ``keep``
generations are kept, and every ``2**t``-th one for ``keep * 2**t``
generations: about ``keep / 2`` per bit of ``h``, a few dozen small objects.
That makes the newest generation findable from nothing by ``contains`` alone:
the largest power of two present is the highest bit of ``h``, and each lower
bit ``t`` is set exactly when ``lo + 2**t`` is present (it is written when
``h`` reaches it and kept while ``h < lo + 2**(t + 1)``). A reader that knows
a recent generation ``k`` asks one ``contains`` of the ``2 * keep`` names
around it instead (:meth:`VersionLog._scan_from` says when that answer is
sure), and searches from nothing when it is not.

A delete the tier refuses (a Mooncake read lease) is counted in
``deletes_failed`` and tried again at the next append (at most
``MAX_RETRIED_DELETES`` waiting; beyond that the oldest are left to the
store's eviction, counted ``deletes_dropped``). What the store evicts on its
own is a hole: a reader then finds an older generation (the value goes back)
and the next append conflicts with what is above it until the known
generation passes it; no wrong value is ever read as the newest one written
by this reader, and nothing raises.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridkv.tiers.base import Tier

MAX_GENERATION_BITS = 62
MAX_RETRIED_DELETES = 64


@dataclass
class VersionStats:
    appended: int = 0  # generations this writer put and read back as its own
    conflicts: int = 0  # appends another writer's value won
    failed: int = 0  # appends the tier refused or could not read back
    deleted: int = 0  # old generations deleted
    deletes_failed: int = 0  # deletes the tier refused (tried again later)
    deletes_dropped: int = 0  # refused deletes given up (left to the store's eviction)
    searches: int = 0  # searches for the newest generation from nothing


class VersionLog:
    """The versions of one value under ``<base>/<g>`` in ``tier``."""

    def __init__(self, tier: Tier, base: str, *, keep: int = 8):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 3:
            raise ValueError(f"keep must be an int of at least 3, got {keep!r}")
        self.tier = tier
        self.base = base.rstrip("/")
        self.keep = keep
        self.known = 0  # the newest generation this reader has seen (0: none)
        self._undeleted: list[int] = []
        self._stats = VersionStats()

    def name(self, generation: int) -> str:
        return f"{self.base}/{generation}"

    def stats(self) -> VersionStats:
        return replace(self._stats)

    # --- reading ------------------------------------------------------------------
    def newest(self) -> int:
        """The newest generation present (0: none), by ``contains`` only."""
        if self.known > 0:
            found = self._scan_from(self.known)
            if found:
                self.known = found
                return found
        found = self._search()
        self.known = found
        return found

    def read(self) -> tuple[int, bytes | None]:
        """The newest generation and its value (``(0, None)`` when there is none; ``None`` when it
        cannot be read: a dead store is an empty value, counted by the tier)."""
        generation = self.newest()
        value = self.value(generation)
        if value is None and generation > 0:  # deleted between finding and reading: once more
            generation = self.newest()
            value = self.value(generation)
        return generation, value

    def value(self, generation: int) -> bytes | None:
        """Generation ``generation``'s value (None: absent, or the tier failed)."""
        if generation < 1:
            return None
        value = self.tier.get([self.name(generation)])[0]
        return None if value is None else bytes(value)

    def _scan_from(self, start: int) -> int:
        """The newest generation when it is ``start`` or at most ``keep`` above it (one ``contains``
        of ``start - keep + 1 .. start + keep`` a window), else 0 (search from nothing).

        The largest ``m`` present in ``start .. start + keep`` is the newest when ``start + keep``
        is absent and so is none of ``m - keep + 1 .. m`` (the last ``keep`` generations are
        always kept; were the newest above ``m``, one of them, or ``start + keep``, would be
        gone). When ``start + keep`` is present, the next window starts there."""
        while True:
            low = max(1, start - self.keep + 1)
            window = list(range(low, start + self.keep + 1))
            present = dict(zip(window, self.tier.contains([self.name(g) for g in window])))
            above = [g for g in window if g >= start and present[g]]
            if not above:
                return 0
            top = above[-1]
            if top == window[-1]:
                start = top
                continue
            tail = range(max(1, top - self.keep + 1), top + 1)
            return top if all(present[g] for g in tail) else 0

    def _search(self) -> int:
        """The newest generation from nothing: its highest bit, then each lower bit."""
        self._stats.searches += 1
        powers = [1 << bit for bit in range(MAX_GENERATION_BITS + 1)]
        present = self.tier.contains([self.name(p) for p in powers])
        high = [bit for bit, ok in enumerate(present) if ok]
        if not high:
            return 0
        low = 1 << high[-1]
        for bit in range(high[-1] - 1, -1, -1):
            if self.tier.contains([self.name(low + (1 << bit))])[0]:
                low += 1 << bit
        return low

    # --- writing ------------------------------------------------------------------
    def append(self, generation: int, value: bytes) -> bool:
        """Put ``value`` as ``generation`` (the newest read plus one) and read it back: whether
        it is this writer's value now. Then delete the generation that leaves the kept set."""
        name = self.name(generation)
        if generation < 1 or generation >= 1 << (MAX_GENERATION_BITS + 1):
            raise ValueError(f"a generation is 1 to 2**{MAX_GENERATION_BITS + 1} - 1, got {generation}")
        stored = self.tier.put([(name, bytes(value))])[0]
        back = self.tier.get([name])[0] if stored else None
        if back is None:
            self._stats.failed += 1
            return False
        self.known = max(self.known, generation)
        if bytes(back) != bytes(value) or self._scan_from(generation) != generation:
            # another writer's value, or newer generations (this one was made again after its
            # delete, by a writer that read long ago): not the newest
            self._stats.conflicts += 1
            self._delete_if_expired(generation)
            return False
        self._stats.appended += 1
        self._delete_expired(generation)
        return True

    def _delete_if_expired(self, generation: int) -> None:
        """After a conflict: ``generation`` may have been made again by a writer that read long
        ago (this one, or another), after the writer that pushed it out of the kept set deleted
        it. Left there it would fill a hole that a reader's scan takes for the end of the kept
        run, and the reader would stop below the newest; so it is deleted when the newest
        generation found says it is out of the kept set (a newest found is never above the true
        one, so a kept generation is never deleted). What this writer knows stays as it was."""
        known = self.known
        newest, self.known = self.newest(), known
        if newest - generation < self.keep * (generation & -generation):
            return  # still kept (or nothing newer found)
        if self.tier.delete_each([self.name(generation)])[0] is None:  # refused: tried again later
            self._stats.deletes_failed += 1
            self._undeleted = (self._undeleted + [generation])[-MAX_RETRIED_DELETES:]
        else:
            self._stats.deleted += 1

    def _delete_expired(self, generation: int) -> None:
        """Delete the generation that ``generation`` pushes out of the kept set, and any whose
        delete was refused before."""
        old = [g for bit in range(generation.bit_length())
               if (g := generation - (self.keep << bit)) >= 1 and (g & -g) == 1 << bit]
        targets = self._undeleted + old
        if not targets:
            return
        self._undeleted = []
        outcome = self.tier.delete_each([self.name(g) for g in targets])
        still = [g for g, done in zip(targets, outcome) if done is None]  # refused (no contains: it leases)
        self._stats.deleted += len(targets) - len(still)
        self._stats.deletes_failed += len(still)
        self._undeleted = still[-MAX_RETRIED_DELETES:]
        self._stats.deletes_dropped += max(0, len(still) - MAX_RETRIED_DELETES)
