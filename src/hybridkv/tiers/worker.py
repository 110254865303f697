"""Puts to a tier off the engine's step thread: one worker thread, a bounded queue.

:class:`OffloadWorker` runs *jobs*: a job makes its objects (a callable run on
the worker, e.g. rows gathered from pages the manager keeps for it, or
objects gathered before) and puts them through an
:class:`~hybridkv.tiers.store.ObjectStore`. :meth:`OffloadWorker.submit` never
waits: a job that would take the queue past ``max_queued_objects`` is dropped
and counted. Every job submitted, run or dropped, comes back exactly once from
:meth:`OffloadWorker.finished` with its ticket and, per object, whether a tier
stored it (``True``), refused it (``False``) or never got it (``None``: the job
was dropped or failed), so the caller can let go of whatever it kept for the job. A job that raises is counted as failed and stores
nothing more; the worker goes on. The worker runs a job's callable (its gather) as soon as it
can, before the next put of any earlier job: what it gathers from pages not held for it is
safe once gathered, while puts only wait for the tier.

The worker touches nothing but the job's callable and the store; the caller
(the engine's thread) keeps the pages the callable reads unchanged until the
ticket comes back. The worker is a Python thread, so what it runs must let go
of the GIL while it moves bytes, or the step thread waits for it: the row
gather (a compiled kernel), the XXH3 checksum (``xxhash``) and numpy's copies
release it; a copy into a new ``bytes`` (``bytes(view)``, ``b"".join``) does
not. Jobs submitted ``in_place`` (an :class:`~hybridkv.transfer.OffloadPlan`'s)
encode without copying the payload and hand their new buffers to the tier
(``given``: the host tier keeps them, no copy). An engine may still :meth:`OffloadWorker.pause` it
while its step thread schedules and :meth:`OffloadWorker.resume` it while the
device computes (its Python between copies takes the GIL too).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

from hybridkv._checks import as_int
from hybridkv.tiers.objects import RowsObject
from hybridkv.tiers.store import ObjectStore


@dataclass
class OffloadWorkerStats:
    submitted_jobs: int = 0
    submitted_objects: int = 0
    dropped_jobs: int = 0  # the queue was full: nothing of the job was put
    dropped_objects: int = 0
    failed_jobs: int = 0  # the job's callable or the put raised
    stored_objects: int = 0
    refused_objects: int = 0  # put, and no tier stored them
    queued_objects: int = 0  # waiting or running now
    last_error: str | None = None


_STOP = object()


class OffloadWorker:
    """One thread putting the objects of submitted jobs, at most ``max_queued_objects`` queued,
    ``put_batch_objects`` to a ``put`` (Mooncake's batch puts plateau near 16) and no more
    payload than ``put_batch_bytes`` (one object at least): a job submitted meanwhile is
    gathered after at most one such put. 1 MiB keeps that wait short (a V4-Flash block object
    of a compressed group, about 0.9 MB, goes alone; small ones still go 16 to a put): a
    deferred entry the worker has not gathered when it leaves the cache is gathered on the
    step thread instead (``transfer.DeferredCopies``)."""

    def __init__(self, store: ObjectStore, *, max_queued_objects: int = 1024, put_batch_objects: int = 16,
                 put_batch_bytes: int = 1 << 20, name: str = "hybridkv-offload"):
        if not isinstance(store, ObjectStore):
            raise TypeError(f"store must be an ObjectStore, got {type(store).__name__}")
        self.store = store
        self.max_queued_objects = as_int("max_queued_objects", max_queued_objects, minimum=1)
        self.put_batch_objects = as_int("put_batch_objects", put_batch_objects, minimum=1)
        self.put_batch_bytes = as_int("put_batch_bytes", put_batch_bytes, minimum=1)
        self._stats = OffloadWorkerStats()  # the callers' fields under _caller_lock, the worker's by the worker
        # The caller's side takes no lock the worker holds: a caller blocked on one would wait for
        # the worker to hand back the GIL (up to a switch interval). Jobs and results go through
        # SimpleQueues (their put never waits for the other thread); counts have one writer each.
        self._caller_lock = threading.Lock()  # callers only (submit, close)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # submitted jobs, objects not made yet
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # (ticket, results) of jobs done or dropped
        self._made: deque = deque()  # the worker's: [ticket, object count, (in_place, given), objects, stored so far]
        self._accepted = [0, 0]  # jobs and objects queued by submit (callers write)
        self._settled = [0, 0]  # of those, jobs and objects done (the worker writes)
        self._cond = threading.Condition()  # drain and close wait on it; the worker notifies it
        self._closed = False
        self._running = threading.Event()  # cleared by pause(): the worker waits between puts
        self._running.set()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # --- the caller's side ----------------------------------------------------------
    def submit(self, ticket: Hashable, make_objects: Callable[[], Sequence[RowsObject | None]], num_objects: int,
               *, in_place: bool = False, given: bool = False) -> bool:
        """Queue a job of ``num_objects`` objects; False when it does not fit (dropped, counted,
        and reported by :meth:`finished` like any other). Never waits for the tier, nor for a
        lock the worker takes.
        ``make_objects`` may answer ``None`` for an object the store holds already: it is not
        put and comes back stored (``True``).
        ``in_place``: every object's payload has room for its header right before it
        (``gather_objects(..., room_bytes=)``), so the encode writes the header there and copies
        no payload (``ObjectStore.put(..., in_place=True)``). ``given`` (with ``in_place``): the
        objects' buffers are new and handed to the tier (``ObjectStore.put(..., given=True)``:
        the host tier keeps them, no copy)."""
        with self._caller_lock:
            if self._closed:
                raise RuntimeError("the offload worker is closed")
            stats = self._stats
            stats.submitted_jobs += 1
            stats.submitted_objects += num_objects
            if self._accepted[1] - self._settled[1] + num_objects > self.max_queued_objects:
                stats.dropped_jobs += 1
                stats.dropped_objects += num_objects
                self._outbox.put((ticket, [None] * num_objects))
                return False
            self._accepted[0] += 1
            self._accepted[1] += num_objects
            self._inbox.put((ticket, make_objects, num_objects, (in_place, given)))
            return True

    def finished(self) -> list[tuple[Hashable, list[bool | None]]]:
        """Jobs done (or dropped) since the last call: ``(ticket, per object True stored,
        False refused by the tier, None dropped or failed)``. Takes no lock."""
        out, outbox = [], self._outbox
        while not outbox.empty():  # (most steps: empty, and no exception raised to say so)
            try:
                out.append(outbox.get_nowait())
            except queue.Empty:  # another caller took it
                break
        return out

    def pause(self) -> None:
        """Hold the worker at its next job or put (what it is doing finishes): the step thread
        calls this when it leaves its device wait, so the worker does not take the GIL from
        it while it schedules. :meth:`resume` lets it go on."""
        self._running.clear()

    def resume(self) -> None:
        """Let a paused worker go on (the step thread calls this before it waits for its device)."""
        self._running.set()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Resume the worker and wait until every queued job has run; False if ``timeout_s``
        passed first."""
        self._running.set()
        accepted = self._accepted[0]
        with self._cond:
            return self._cond.wait_for(lambda: self._settled[0] >= accepted, timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Run what is queued, then stop the thread; False if it did not stop within ``timeout_s``.
        Call :meth:`finished` afterwards for the last tickets."""
        self._running.set()
        with self._caller_lock:
            if not self._closed:
                self._closed = True
                self._inbox.put(_STOP)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stats(self) -> OffloadWorkerStats:
        return replace(self._stats, queued_objects=self._accepted[1] - self._settled[1])

    def __enter__(self) -> OffloadWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the worker thread ------------------------------------------------------------
    def _loop(self) -> None:
        """Gathers first: a submitted job's objects are made before any earlier job's next put
        (the rows of an entry not held for it may be rewritten once it leaves the cache; a
        made job waits only for the tier). Puts go in submission order, ``put_batch_objects``
        at a time, the worker paused (:meth:`pause`) between any two. Stops at the stop mark
        once every job made is put."""
        stopping = False
        while True:
            job = None
            if not stopping:
                try:
                    job = self._inbox.get(block=not self._made)
                except queue.Empty:
                    pass
                if job is _STOP:
                    stopping, job = True, None
            if job is None and not self._made:
                if stopping:
                    return
                continue
            self._running.wait()
            finished = self._make(job) if job is not None else self._put_next(self._made[0])
            if finished is not None:
                self._finish(*finished)

    def _make(self, job: tuple) -> tuple | None:
        """Run a job's callable; the job joins the made ones, or comes back failed."""
        ticket, make_objects, num_objects, how = job
        try:
            objects = list(make_objects())
        except Exception as exc:  # a job's fault is counted, never raised into the worker's loop
            return ticket, num_objects, None, f"{type(exc).__name__}: {exc}"
        self._made.append([ticket, num_objects, how, objects, []])
        return None

    def _put_next(self, made: list) -> tuple | None:
        """Put the next batch of the oldest made job; the job once all of it is put (or failed)."""
        ticket, num_objects, (in_place, given), objects, stored = made
        at = end = len(stored)
        nbytes, last = 0, min(len(objects), at + self.put_batch_objects)
        while end < last and (end == at or nbytes + _payload_bytes(objects[end]) <= self.put_batch_bytes):
            nbytes += _payload_bytes(objects[end])
            end += 1
        try:
            if end > at:  # (a job of no objects puts nothing)
                stored += self._put(objects[at:end], in_place, given)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            if len(stored) < len(objects):
                return None
            error = None
        self._made.popleft()
        return ticket, num_objects, (None if error else stored), error

    def _put(self, objects: list[RowsObject | None], in_place: bool, given: bool) -> list[bool]:
        """Put the objects; ``None`` (held by the store already) is not put and counts as stored."""
        if all(obj is not None for obj in objects):
            return self.store.put(objects, in_place=in_place, given=given)
        rest = [obj for obj in objects if obj is not None]
        put = iter(self.store.put(rest, in_place=in_place, given=given) if rest else ())
        return [True if obj is None else next(put) for obj in objects]

    def _finish(self, ticket: Hashable, num_objects: int, stored: list[bool] | None, error: str | None) -> None:
        """A job is done: counted, its ticket reported, drain and close told."""
        stats = self._stats
        if stored is None:
            stats.failed_jobs += 1
            stats.last_error = error
            stored = [None] * num_objects
        else:
            stats.stored_objects += sum(stored)
            stats.refused_objects += len(stored) - sum(stored)
        self._outbox.put((ticket, stored))
        self._settled[1] += num_objects
        with self._cond:
            self._settled[0] += 1
            self._cond.notify_all()

def _payload_bytes(obj: RowsObject | None) -> int:
    return 0 if obj is None else obj.payload.size
