"""What one tier link knows of the blocks in flight: its markers, its waiting requests.

:class:`InFlightState` is the bookkeeping half of ``TierLink``'s in-flight rule
(:mod:`hybridkv.inflight` has the markers' format and their store calls; the
link decides when to mark, wait and resume). It holds:

* the *computing* markers this link put: per request the keys it marked, per key
  the request (:meth:`marked`), and the marked blocks published since the last
  two ``take_offloads`` (:meth:`published`): a marker goes at the second call
  after its block is published, once the engine has put the block
  (:meth:`retire`);
* the requests that wait: per request the key it waits for, whether it waits for
  a checkpoint, and when its wait began (:meth:`start_wait`; a request that goes
  back to ``add_request`` to resume keeps its start, so the bound holds across
  resumes);
* with write-through, the checkpoints published since the last ``take_offloads``
  (``fresh``), the freed requests' last boundaries (``ending``) and the
  checkpoints queued for the wanted board (``served``).

Without an in-flight rule (``markers`` None) the state stays empty: nothing
waits and nothing is marked. It moves no rows and calls no manager.
"""

from __future__ import annotations

from typing import Any

from hybridkv.inflight import Markers


class InFlightState:
    """The markers, waits and write-through queues of one link (see the module's docstring)."""

    def __init__(self, markers: Markers | None):
        self.markers = markers
        self._marked: dict[str, list[int]] = {}  # request -> keys of its computing markers
        self._marker_of: dict[int, str] = {}  # key -> the request that marked it
        self._landed: list[int] = []  # marked keys published since the last take_offloads
        self._landed_before: list[int] = []  # ... before it: their markers go at the next one
        self.fresh: list[tuple[str, int]] = []  # checkpoints published since then (write-through)
        self.ending: list[tuple[Any, int]] = []  # freed requests' hashes and last boundaries
        self.waiting: dict[str, int] = {}  # request -> the key of the block (or checkpoint) it waits for
        self.checkpoint_waits: set[str] = set()  # of those, the requests waiting for a checkpoint
        self.served: set[tuple[str, int]] = set()  # checkpoints queued for the wanted board
        self.loaded_since_add: set[str] = set()  # requests that confirmed a load since added
        self.wait_since: dict[str, float] = {}  # request -> when its wait began
        self.resuming = False  # a waiting request goes back through free and add_request

    @property
    def on(self) -> bool:
        """Whether the link follows an in-flight rule."""
        return self.markers is not None

    # --- computing markers ------------------------------------------------------------
    def marked_by(self, key: int) -> str | None:
        """The request of this link that marked ``key`` (None: none)."""
        return self._marker_of.get(key)

    def marked(self, request_id: str, keys: list[int]) -> None:
        """``request_id`` put computing markers under ``keys`` (none of them its own already)."""
        self._marked.setdefault(request_id, []).extend(keys)
        for key in keys:
            self._marker_of[key] = request_id

    def published(self, key: int) -> None:
        """A block of the first history group was published under ``key``."""
        if key in self._marker_of:
            self._landed.append(key)

    def retire(self) -> None:
        """Delete the markers of blocks published before the last ``take_offloads`` (put by now)."""
        done, self._landed_before, self._landed = self._landed_before, self._landed, []
        gone = []
        for key in done:
            rid = self._marker_of.pop(key, None)
            if rid is not None:
                gone.append(key)
                mine = self._marked.get(rid)
                if mine is not None and key in mine:
                    mine.remove(key)
        if gone:
            self.markers.delete("computing", gone)

    # --- waits ------------------------------------------------------------------------
    def start_wait(self, request_id: str, key: int, now: float, *, checkpoint: bool = False) -> bool:
        """``request_id`` waits for ``key`` (a block, or a checkpoint); whether its wait begins now
        (not a resumed one)."""
        first = request_id not in self.wait_since
        if first:
            self.wait_since[request_id] = now
        self.waiting[request_id] = key
        if checkpoint:
            self.checkpoint_waits.add(request_id)
        return first

    def waited(self, request_id: str, now: float) -> float:
        """Seconds ``request_id`` has waited (0 when it never did)."""
        return now - self.wait_since.get(request_id, now)

    def forget(self, request_id: str) -> None:
        """``request_id`` is freed: its wait ends (its start kept while it resumes) and its
        computing markers go."""
        self.waiting.pop(request_id, None)
        self.checkpoint_waits.discard(request_id)
        self.loaded_since_add.discard(request_id)
        if not self.resuming:
            self.wait_since.pop(request_id, None)
        keys = self._marked.pop(request_id, None)
        if keys:
            for key in keys:
                self._marker_of.pop(key, None)
            self.markers.delete("computing", keys, request_id)  # its own: another's at a key stays
