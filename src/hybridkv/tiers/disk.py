"""Local disk tier: one file per object in a directory that several processes may share.

**The directory is the truth.** ``get`` and ``delete`` look at the files
themselves, so an object another process (or another ``DiskTier`` on the same
directory) wrote or deleted a moment ago is seen at once. ``contains`` (which an
engine's step thread calls) answers from an *index* of the files this tier
knows, with no ``stat`` per name, while the index is exact: the shared state's
change count (below) is the one the index was made at. Every change through any
``DiskTier`` moves that count, so after another process's put or delete the
index is stale and ``contains`` looks at each file again, until this tier's next
put (on an offload worker, off the step thread) lists the directory's names
under the lock and makes the index exact once more. A file removed by hand, not
through a ``DiskTier``, may still be answered as held until a ``get`` misses it
(the get is a miss, never wrong bytes). File names are the SHA-256 of the
object name (any name maps to a safe path).

**Write-once, whole or absent.** A value is written to a temporary file
(``.<id>.<pid>.<n>.tmp``) and *linked* to its name: ``link`` fails when the
name exists, so the first value put under a name is kept (as in the other
tiers) and a reader sees a whole object or none. A crash leaves at most a
temporary file; a tier opening the directory removes those of processes that
are no longer running. A value of ``DIRECT_MIN_BYTES`` or more is written to
its temporary file with ``O_DIRECT`` (whole blocks from an aligned buffer,
then cut to its length), so no page-cache page is filled for it.

**One byte budget for all.** ``.hkv-state`` (24 bytes: held bytes, held
files, a change count, u64 little-endian) holds what the directory holds. Every
change (a link, an eviction, a delete) is made under an exclusive ``flock`` of
that file and updates it, so every process checks its budget against the
bytes all of them hold. A tier opening the directory re-counts it from its
files (a crash between a change and its update is repaired then). With
``budget_bytes`` a put evicts to stay within it: first the least recently used
objects this tier knows (put, read or found by a scan here), then, when it
knows none that are still there, the oldest files of a fresh scan (a read
touches a file's modification time, so the scan's order is least recently
used across processes). Without a budget the tier fills the disk.

A full disk (``ENOSPC``, ``EDQUOT``, ``EFBIG``) or any other ``OSError``
refuses the put and counts an error; a read error is a miss and an error.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import itertools
import mmap
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from hybridkv.tiers.base import Tier, TierStats

_SUFFIX = ".hkv"
STATE_FILE = ".hkv-state"
_STATE = struct.Struct("<QQQ")  # held bytes, held files, changes
DIRECT_ALIGN_BYTES = 4096  # O_DIRECT writes: buffer address, offset and length multiples of this
DIRECT_MIN_BYTES = 128 << 10  # smaller values go through the page cache (a direct write waits for the device)
_temp_ids = itertools.count()  # one sequence per process: two tiers in it never share a temporary name


@functools.lru_cache(maxsize=1 << 16)
def _file_id(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


def _aligned(nbytes: int) -> np.ndarray:
    """A new ``uint8`` buffer of ``nbytes`` whose address is a multiple of ``DIRECT_ALIGN_BYTES``."""
    raw = np.empty(nbytes + DIRECT_ALIGN_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % DIRECT_ALIGN_BYTES
    return raw[start:start + nbytes]


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process: it runs
        return True
    return True


def _stale_temp(name: str) -> bool:
    """Whether ``name`` is a temporary file of a process that no longer runs (or not one of ours)."""
    parts = name.split(".")  # "", id, pid, n, "tmp"
    if len(parts) != 5 or not parts[2].isdigit():
        return True
    return not _pid_running(int(parts[2]))


class DiskTier(Tier):
    """Objects as files under ``root`` (made if missing), shared by every tier opened on it."""

    name = "disk"
    put_copies = True  # a put writes the value to its file before it returns

    def __init__(self, root: str | os.PathLike[str], budget_bytes: int | None = None, *, fsync: bool = False) -> None:
        super().__init__()
        if budget_bytes is not None and (
            isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0
        ):
            raise ValueError(f"budget_bytes must be a non-negative int or None, got {budget_bytes!r}")
        self.root = os.fspath(root)
        self.budget_bytes = budget_bytes
        self.fsync = bool(fsync)
        os.makedirs(self.root, exist_ok=True)
        self._recent: OrderedDict[str, None] = OrderedDict()  # file ids this tier knows, least recent first
        self._index: set[str] = set()  # file ids in the directory, exact at the change count below
        self._index_changes: int | None = None  # the state's change count the index is exact at (None: stale)
        self._mutex = threading.RLock()  # threads of this process; flock orders the processes
        self._state_fd: int | None = None  # open only within a call (no descriptor held between calls)
        self._state_map: mmap.mmap | None = None  # the state file mapped read-only, for the change count
        self._direct = hasattr(os, "O_DIRECT")  # large values written past the page cache (see _write_direct)
        self._bounce_lock = threading.Lock()
        self._bounce_buf: np.ndarray | None = None  # the aligned buffer direct writes copy into, reused
        with self._locked():
            self._remove_stale_temps()
            self._scan()

    # --- the shared state -----------------------------------------------------------
    @contextlib.contextmanager
    def _opened(self, lock: bool) -> Iterator[None]:
        """The state file open for the block (locked when ``lock``), closed after it."""
        with self._mutex:
            if self._state_fd is not None:  # re-entered: already open (and locked)
                yield
                return
            self._state_fd = os.open(os.path.join(self.root, STATE_FILE), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if lock:
                    fcntl.flock(self._state_fd, fcntl.LOCK_EX)  # released by the close
                yield
            finally:
                os.close(self._state_fd)
                self._state_fd = None

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return self._opened(lock=True)

    def _state(self) -> int:
        assert self._state_fd is not None, "the state file is used only within _opened"
        return self._state_fd

    def _read_state(self) -> tuple[int, int, int]:
        data = os.pread(self._state(), _STATE.size, 0)
        return _STATE.unpack(data) if len(data) == _STATE.size else (0, 0, 0)

    def _add_held(self, nbytes: int, files: int) -> int:
        """Add to the held bytes and files (under the lock, after the change to the files and to
        the index); the held bytes now. The index stays exact when it was exact before this change."""
        held, count, changes = self._read_state()
        held, count = max(0, held + nbytes), max(0, count + files)
        os.pwrite(self._state(), _STATE.pack(held, count, changes + 1), 0)
        self._index_changes = changes + 1 if self._index_changes == changes else None
        return held

    def _list_index(self) -> None:
        """Make the index exact (under the lock): the directory's object names, no ``stat``."""
        self._index = {name[: -len(_SUFFIX)] for name in os.listdir(self.root)
                       if name.endswith(_SUFFIX) and not name.startswith(".")}
        self._index_changes = self._read_state()[2]

    def _scan(self) -> None:
        """Re-count the directory from its files (under the lock); known objects, oldest first."""
        found = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(_SUFFIX) and not entry.name.startswith("."):
                try:
                    stat = entry.stat()
                except OSError:
                    continue
                found.append((stat.st_mtime_ns, entry.name[: -len(_SUFFIX)], stat.st_size))
        found.sort()
        self._recent = OrderedDict((file_id, None) for _, file_id, _ in found)
        self._index = {file_id for _, file_id, _ in found}
        changes = self._read_state()[2]
        os.pwrite(self._state(), _STATE.pack(sum(size for *_, size in found), len(found), changes + 1), 0)
        self._index_changes = changes + 1

    def _remove_stale_temps(self) -> None:
        for entry in os.scandir(self.root):
            if entry.name.endswith(".tmp") and _stale_temp(entry.name):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)

    def stats(self) -> TierStats:
        out = super().stats()
        try:
            with self._opened(lock=False):
                out.held_bytes, out.held = self._read_state()[:2]
        except OSError:  # the directory is gone or unreadable: unknown
            out.held_bytes, out.held = 0, -1
        return out

    # --- the files ------------------------------------------------------------------
    def _path(self, file_id: str) -> str:
        return os.path.join(self.root, file_id + _SUFFIX)

    def _known(self, file_id: str) -> None:
        with self._mutex:
            self._recent[file_id] = None
            self._recent.move_to_end(file_id)

    def _remove(self, file_id: str, what: str) -> int:
        """Remove an object's file (under the lock): its bytes; -1 when it was not there, -2 when
        removing it failed (counted)."""
        self._recent.pop(file_id, None)
        path = self._path(file_id)
        self._index.discard(file_id)  # before the change count moves (see _contains)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return -1
        except OSError as exc:
            self._index.add(file_id)  # still there
            self._fault(f"disk {what} failed: {exc}")
            return -2
        self._add_held(-size, -1)
        return size

    # --- put ------------------------------------------------------------------------
    def _put(self, items: list[tuple[str, bytes]]) -> list[bool]:
        out = [False] * len(items)
        written = []  # (index, file id, temporary path, bytes)
        for i, (name, value) in enumerate(items):
            file_id = _file_id(name)
            if os.path.exists(self._path(file_id)):
                out[i] = True  # held already: the first value stays
                self._known(file_id)
            elif self.budget_bytes is not None and len(value) > self.budget_bytes:
                self._stats.refused += 1
                self._stats.last_error = f"object of {len(value)} B exceeds the disk budget of {self.budget_bytes} B"
            else:
                temp = self._write_temp(file_id, value)
                if temp is not None:
                    written.append((i, file_id, temp, len(value)))
        if written:
            try:
                with self._locked():
                    for i, file_id, temp, size in written:
                        out[i] = self._link(file_id, temp, size)
                    if self._index_changes is None:  # another process changed the directory
                        self._list_index()
            except OSError as exc:  # the state file cannot be opened: nothing more is linked
                self._fault(f"disk state failed: {exc}")
                for i, _, temp, _ in written:
                    with contextlib.suppress(OSError):
                        os.unlink(temp)
                self._stats.refused += sum(not out[i] for i, *_ in written)
        return out

    def _write_temp(self, file_id: str, value: bytes) -> str | None:
        """``value`` in a new temporary file (its path), or None: refused and counted. From
        ``DIRECT_MIN_BYTES`` on, written past the page cache (:meth:`_write_direct`) where the
        file system takes it; else, or when that fails, through the page cache."""
        temp = os.path.join(self.root, f".{file_id}.{os.getpid()}.{next(_temp_ids)}.tmp")
        try:
            if not (self._direct and len(value) >= DIRECT_MIN_BYTES and self._write_direct(temp, value)):
                with open(temp, "xb") as handle:
                    handle.write(value)
                    if self.fsync:
                        handle.flush()
                        os.fsync(handle.fileno())
        except OSError as exc:
            self._stats.refused += 1
            self._fault(f"disk write failed: {exc}")
            with contextlib.suppress(OSError):
                os.unlink(temp)
            return None
        return temp

    def _write_direct(self, temp: str, value: bytes) -> bool:
        """Write ``value`` to a new file ``temp`` with ``O_DIRECT``: copied into an aligned buffer
        the tier reuses, written in whole blocks (the last one padded), then cut to its length.
        The device reads the buffer: no page-cache page is filled (on a machine whose page cache
        grows into memory never touched, that copy cost 3-7 ms of CPU a MB; this one about 0.3).
        False, and no file left, when it fails: the caller writes through the page cache (a file
        system without ``O_DIRECT`` is not asked again; a full disk fails there too, and counts)."""
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # no O_DIRECT on this file system
                self._direct = False
            return False
        size = len(value)
        blocks = -(-size // DIRECT_ALIGN_BYTES) * DIRECT_ALIGN_BYTES
        ok, done = False, 0
        try:
            with self._bounce(blocks) as buf:
                buf[:size] = np.frombuffer(value, dtype=np.uint8)
                while done < blocks:
                    wrote = os.pwrite(fd, buf[done:blocks], done)
                    if wrote <= 0:
                        raise OSError(errno.EIO, "a direct write wrote nothing")
                    done += wrote
            os.ftruncate(fd, size)
            if self.fsync:
                os.fsync(fd)
            ok = True
        except OSError as exc:
            if exc.errno == errno.EINVAL and done == 0:  # the first block refused: e.g. a larger block size
                self._direct = False
        finally:
            os.close(fd)
            if not ok:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
        return ok

    @contextlib.contextmanager
    def _bounce(self, nbytes: int) -> Iterator[np.ndarray]:
        """An aligned buffer of at least ``nbytes``: the tier's own, grown as needed, or a new one
        while another thread writes from it."""
        if not self._bounce_lock.acquire(blocking=False):
            yield _aligned(nbytes)
            return
        try:
            if self._bounce_buf is None or self._bounce_buf.size < nbytes:
                self._bounce_buf = _aligned(nbytes)
            yield self._bounce_buf
        finally:
            self._bounce_lock.release()

    def _link(self, file_id: str, temp: str, size: int) -> bool:
        """Make room, then give the temporary file its name unless one is there (under the lock)."""
        try:
            if self.budget_bytes is not None:
                self._make_room(size)
            os.link(temp, self._path(file_id))
        except FileExistsError:  # another process put it first: its value stays
            self._known(file_id)
            return True
        except OSError as exc:
            self._stats.refused += 1
            self._fault(f"disk write failed: {exc}")
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        self._index.add(file_id)  # before the change count moves (see _contains)
        self._add_held(size, 1)
        self._known(file_id)
        self._stats.stored += 1
        self._stats.stored_bytes += size
        return True

    def _make_room(self, size: int) -> None:
        """Evict until ``size`` more bytes fit the budget (under the lock): the least recent objects
        this tier knows, then, when none of those is left, a fresh scan's oldest."""
        scanned = False
        while self._read_state()[0] + size > self.budget_bytes:
            if not self._recent:
                if scanned:
                    return  # nothing left to evict: the held count is the scan's, and it fits
                self._scan()
                scanned = True
                continue
            file_id = next(iter(self._recent))
            freed = self._remove(file_id, "eviction")
            if freed >= 0:
                self._stats.evicted += 1
                self._stats.evicted_bytes += freed

    # --- get, contains, delete ----------------------------------------------------------
    def _get(self, names: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for name in names:
            file_id = _file_id(name)
            try:
                with open(self._path(file_id), "rb") as handle:
                    value = handle.read()
                    with contextlib.suppress(OSError):
                        os.utime(handle.fileno())  # recently used, for every process's scan
            except FileNotFoundError:
                with self._mutex:
                    self._recent.pop(file_id, None)
                self._index.discard(file_id)  # e.g. removed by hand: not answered as held again
                value = None
            except OSError as exc:
                self._fault(f"disk read failed: {exc}")
                value = None
            else:
                self._known(file_id)
            out.append(value)
        return out

    def _contains(self, names: list[str]) -> list[bool]:
        """From the index while it is exact (the mapped state file's change count), else a ``stat`` per name.
        This tier changes the index before it moves the change count, so an index found exact
        at the count read is at least as new as that count."""
        ids = [_file_id(name) for name in names]
        exact = self._index_changes
        if exact is not None and self._changes_now() == exact:
            index = self._index
            return [file_id in index for file_id in ids]
        return [os.path.exists(self._path(file_id)) for file_id in ids]

    def _changes_now(self) -> int | None:
        """The state's change count, read without the lock or the mutex (a put on another thread
        may hold them) from a read-only map of the state file, made at the first call: no system
        call, so an engine's step thread asking ``contains`` keeps the GIL (an offload worker
        would take it meanwhile). None when the file cannot be mapped."""
        view = self._state_map
        if view is None:
            try:
                fd = os.open(os.path.join(self.root, STATE_FILE), os.O_RDONLY)
            except OSError:
                return None
            try:
                view = self._state_map = mmap.mmap(fd, _STATE.size, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # e.g. a file shorter than the state
                return None
            finally:
                os.close(fd)
        try:
            return _STATE.unpack_from(view, 0)[2]
        except ValueError:  # unmapped by close() on another thread
            return None

    def _delete(self, names: list[str]) -> int:
        return sum(out is True for out in self._delete_each(names))

    def _delete_each(self, names: list[str]) -> list[bool | None]:
        try:
            with self._locked():
                sizes = [self._remove(_file_id(name), "delete") for name in names]
        except OSError as exc:
            self._fault(f"disk state failed: {exc}")
            return [None] * len(names)
        return [True if size >= 0 else False if size == -1 else None for size in sizes]

    def close(self) -> None:
        """Unmap the state file (no descriptor stays open between calls); the objects stay in the
        directory."""
        view, self._state_map = self._state_map, None
        if view is not None:
            view.close()
