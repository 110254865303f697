"""Local disk tier: one file per object in a directory, written atomically.

A file is written under a temporary name in the same directory and renamed
into place, so a reader sees a whole object or none (a crash leaves at most a
``.tmp`` file, removed on the next start). File names are the SHA-256 of the
object name, so any name maps to a safe path. With ``budget_bytes`` the tier
evicts its least recently used files to stay within it; without, it fills the
disk. A full disk (``ENOSPC``, ``EDQUOT``) or any other ``OSError`` refuses the
put and counts an error; a read error is a miss and an error.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import OrderedDict

from hybridkv.tiers.base import Tier

_SUFFIX = ".hkv"


def _file_id(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


class DiskTier(Tier):
    """Objects as files under ``root`` (made if missing)."""

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
        self._files: OrderedDict[str, int] = OrderedDict()  # file id -> bytes, least recent first
        self._held_bytes = 0
        self._temp_ids = itertools.count()
        self._scan()

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(".tmp"):
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass
            elif entry.name.endswith(_SUFFIX) and entry.is_file():
                stat = entry.stat()
                found.append((stat.st_mtime_ns, entry.name[: -len(_SUFFIX)], stat.st_size))
        for _, file_id, size in sorted(found):
            self._files[file_id] = size
            self._held_bytes += size
        self._sync_held()

    def _unlink(self, file_id: str, what: str) -> None:
        """Remove an object's file; one already gone is fine, any other failure is a counted fault."""
        try:
            os.unlink(self._path(file_id))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._fault(f"disk {what} failed: {exc}")

    def _path(self, file_id: str) -> str:
        return os.path.join(self.root, file_id + _SUFFIX)

    def _put(self, items: list[tuple[str, bytes]]) -> list[bool]:
        out = [self._put_one(_file_id(name), value) for name, value in items]
        self._sync_held()
        return out

    def _put_one(self, file_id: str, value: bytes) -> bool:
        if file_id in self._files:
            self._files.move_to_end(file_id)
            return True
        if self.budget_bytes is not None:
            if len(value) > self.budget_bytes:
                self._stats.refused += 1
                self._stats.last_error = f"object of {len(value)} B exceeds the disk budget of {self.budget_bytes} B"
                return False
            while self._held_bytes + len(value) > self.budget_bytes:
                self._evict_oldest()
        temp = os.path.join(self.root, f".{file_id}.{os.getpid()}.{next(self._temp_ids)}.tmp")
        try:
            with open(temp, "xb") as handle:
                handle.write(value)
                if self.fsync:
                    handle.flush()
                    os.fsync(handle.fileno())
            os.replace(temp, self._path(file_id))
        except OSError as exc:
            self._stats.refused += 1
            self._fault(f"disk write failed: {exc}")
            try:
                os.unlink(temp)
            except OSError:
                pass
            return False
        self._files[file_id] = len(value)
        self._held_bytes += len(value)
        self._stats.stored += 1
        self._stats.stored_bytes += len(value)
        return True

    def _evict_oldest(self) -> None:
        file_id, size = self._files.popitem(last=False)
        self._held_bytes -= size
        self._stats.evicted += 1
        self._stats.evicted_bytes += size
        self._unlink(file_id, "eviction")

    def _get(self, names: list[str]) -> list[bytes | None]:
        out = []
        for name in names:
            file_id = _file_id(name)
            if file_id not in self._files:
                out.append(None)
                continue
            try:
                with open(self._path(file_id), "rb") as handle:
                    value = handle.read()
            except FileNotFoundError:  # removed behind our back
                self._forget(file_id)
                value = None
            except OSError as exc:
                self._fault(f"disk read failed: {exc}")
                value = None
            else:
                self._files.move_to_end(file_id)
            out.append(value)
        self._sync_held()
        return out

    def _contains(self, names: list[str]) -> list[bool]:
        return [_file_id(name) in self._files for name in names]

    def _delete(self, names: list[str]) -> int:
        count = 0
        for name in names:
            file_id = _file_id(name)
            if file_id not in self._files:
                continue
            self._forget(file_id)
            count += 1
            self._unlink(file_id, "delete")
        self._sync_held()
        return count

    def _forget(self, file_id: str) -> None:
        self._held_bytes -= self._files.pop(file_id)

    def _sync_held(self) -> None:
        self._stats.held = len(self._files)
        self._stats.held_bytes = self._held_bytes
