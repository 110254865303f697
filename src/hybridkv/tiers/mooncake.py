"""Mooncake Store tier, and a loopback ``mooncake_master`` for tests and benchmarks.

Needs the ``[mooncake]`` extra (PyPI ``mooncake-transfer-engine-non-cuda``)
and the Debian libraries ``libibverbs1``, ``libnl-3-200`` and
``libnl-route-3-200`` (``scripts/install-test-deps.sh``). The client mounts a
segment of its own memory into the store (``segment_bytes``); the master
places and evicts objects across every mounted segment, so what this tier
holds is decided by the store, not by this process.

Faults are answers, not exceptions: a put the store refuses (full, or the
master unreachable) is "not stored" and counted; a get of a name that is
absent is a miss, and when the master cannot be reached, a miss and an error.
With the master gone each client call blocks for seconds (about 4 s here) before
it fails, so after such a failure the tier answers at once, without calling the
store, for ``retry_after_s``; then one call tries again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hybridkv.tiers.base import Tier, TierUnavailable

_PRESENT = 1
RPC_FAIL = -900  # the client's code when the master cannot be reached
_NOT_FOUND = -704  # remove of a name the store does not hold


def load_store_class():
    """``mooncake.store.MooncakeDistributedStore``, or ``TierUnavailable`` saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise TierUnavailable(
            "the Mooncake tier needs `pip install 'hybridkv[mooncake]'` and the Debian packages "
            f"libibverbs1 libnl-3-200 libnl-route-3-200 (scripts/install-test-deps.sh): {exc}"
        ) from None
    return MooncakeDistributedStore


def master_binary() -> str:
    """Path of ``mooncake_master`` (next to this Python, else on ``PATH``)."""
    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mooncake_master")
    if not found:
        raise TierUnavailable("mooncake_master not found: install the [mooncake] extra")
    return found


def _die_with_parent() -> list[str]:
    """A command prefix that has the master killed when the process that started it dies
    (a crashed or killed test or benchmark leaves no master behind): util-linux ``setpriv
    --pdeathsig`` where it exists, else nothing."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv and sys.platform == "linux" else []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class MooncakeMaster:
    """A ``mooncake_master`` on loopback with free ports; ``start``, ``stop``, ``restart`` (same ports)."""

    log_path: str = os.devnull
    # How long a read pins an object against removal. The client refuses a value whose transfer
    # outlasts it (a miss), so it must exceed a read's worst time under load: 50 ms lost gets of
    # 0.3-0.9 MB objects on a loaded 2-core machine. A longer lease only delays deletes (a refused
    # delete is retried at a later call). Mooncake's own master defaults to 5 s.
    lease_ms: int = 500
    rpc_port: int = 0
    http_port: int = 0
    metrics_port: int = 0

    def __post_init__(self) -> None:
        self._chosen_ports = not (self.rpc_port or self.http_port or self.metrics_port)
        self.rpc_port = self.rpc_port or free_port()
        self.http_port = self.http_port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        self._process: subprocess.Popen | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout_s: float = 20.0, retries: int = 2) -> MooncakeMaster:
        """Start the master and wait until it listens; where this object chose the ports and the
        master exits before listening (another process took one), try again on new ones."""
        if self.running:
            return self
        args = [
            master_binary(), "-rpc_address=127.0.0.1", f"-rpc_port={self.rpc_port}",
            "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={self.http_port}", f"-metrics_port={self.metrics_port}",
            f"-default_kv_lease_ttl={self.lease_ms}",
        ]
        log = open(self.log_path, "ab")
        try:
            self._process = subprocess.Popen(_die_with_parent() + args, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code, self._process = self._process.returncode, None
                if self._chosen_ports and retries:  # a port chosen free was taken before the master bound it
                    self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
                    return self.start(max(deadline - time.monotonic(), 1.0), retries - 1)
                raise TierUnavailable(f"mooncake_master exited with {code} (log {self.log_path})")
            if _accepts(self.rpc_port) and _accepts(self.http_port) and self._process.poll() is None:
                return self
            time.sleep(0.05)
        self.stop()
        raise TierUnavailable(f"mooncake_master did not listen within {timeout_s} s")

    def stop(self) -> None:
        """Kill the master (as a crash would) and wait for it."""
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
            self._process = None

    def restart(self) -> MooncakeMaster:
        self.stop()
        return self.start(retries=0)  # the same ports: its clients know them

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


class MooncakeTier(Tier):
    """Objects in a Mooncake Store reached through ``master_address``.

    ``remove_calls`` (a debug view) counts the store calls ``delete`` made: ``batch_remove``
    (one per delete) and ``remove`` (one per name, where the client refused the batch)."""

    name = "mooncake"
    put_copies = True  # put_batch copies the values into the store's segments before it returns
    reads_lease = True  # a get or contains pins the object for lease_ms

    def __init__(
        self,
        master_address: str,
        metadata_url: str,
        *,
        segment_bytes: int = 64 << 20,
        local_buffer_bytes: int = 16 << 20,
        protocol: str = "tcp",
        local_hostname: str = "127.0.0.1",
        retry_after_s: float = 2.0,
        receive_bytes: int = 64 << 20,
        receive_buffers: int = 2,
        send_bytes: int = 64 << 20,
    ) -> None:
        super().__init__()
        self.retry_after_s = float(retry_after_s)
        self._down_until = 0.0
        self._arenas: list[np.ndarray] = []
        self._turn = 0
        self._store = load_store_class()()
        code = self._store.setup(
            local_hostname, metadata_url, int(segment_bytes), int(local_buffer_bytes), protocol, "", master_address
        )
        if code != 0:
            raise TierUnavailable(f"Mooncake setup with master {master_address} failed with code {code}")
        self._stats.held = -1  # the store decides what it holds
        self.remove_calls = {"batch_remove": 0, "remove": 0}
        for _ in range(int(receive_buffers) if receive_bytes > 0 else 0):
            arena = np.empty(int(receive_bytes), dtype=np.uint8)
            if self._store.register_buffer(arena.ctypes.data, arena.nbytes) != 0:
                break
            self._arenas.append(arena)  # fetch receives here without a new bytes object per value
        if self._arenas:
            self.fetch_views_kept = len(self._arenas)
        self._send: np.ndarray | None = None
        self._send_lock = threading.Lock()
        if send_bytes > 0:
            send = np.empty(int(send_bytes), dtype=np.uint8)
            if self._store.register_buffer(send.ctypes.data, send.nbytes) == 0:
                self._send = send  # put_buffer lends it; puts of views into it use batch_put_from

    @contextlib.contextmanager
    def put_buffer(self, nbytes: int) -> Iterator[np.ndarray | None]:
        """The registered send buffer's first ``nbytes`` (``None`` when it is smaller, or lent to
        another thread now): values put as views of it go by ``batch_put_from``, no copy here."""
        send = self._send
        if send is None or nbytes > send.nbytes or not self._send_lock.acquire(blocking=False):
            yield None
            return
        try:
            yield send[:nbytes]
        finally:
            self._send_lock.release()

    def _put(self, items: list[tuple[str, bytes]]) -> list[bool]:
        if not items:
            return []
        if self._down():
            self._stats.refused += len(items)
            return [False] * len(items)
        message, stored = self._put_batch(items)
        # one bad item can fail the whole batch: put the others one by one
        for i, (name, value) in enumerate(items):
            if stored[i] or self._paused():
                continue
            code = self._call("put", name, value)
            stored[i] = code == 0
            if not stored[i]:
                message = self._stats.last_error if code == -1 else f"Mooncake put of {name} ({len(value)} B) returned {code}"
        self._count_puts(items, stored)
        if not all(stored):
            self._fault(self._stats.last_error if self._paused() else message)
        return stored

    def _put_batch(self, items: list[tuple[str, bytes]]) -> tuple[str, list[bool]]:
        """One batched put: views of the send buffer by ``batch_put_from`` (sent from where they
        lie), the other values by ``put_batch``; per item whether it is stored."""
        at = [self._send_offset(value) for _, value in items]
        stored, messages = [False] * len(items), []
        for method, members in (("batch_put_from", [i for i, a in enumerate(at) if a is not None]),
                                ("put_batch", [i for i, a in enumerate(at) if a is None])):
            if members:
                done, message = self._put_members(method, items, at, members)
                for i, ok in zip(members, done):
                    stored[i] = ok
                messages.append(message)
        return "; ".join(messages), stored

    def _put_members(self, method: str, items: list[tuple[str, bytes]], at: list[int | None],
                     members: list[int]) -> tuple[list[bool], str]:
        """``items[i]`` for ``i`` in ``members`` in one ``method`` call (``batch_put_from``: from
        their offsets ``at`` in the send buffer); per member whether it is stored, and the message."""
        names = [items[i][0] for i in members]
        if method == "put_batch":
            codes = self._call(method, names, [items[i][1] for i in members])
        else:
            base = self._send.ctypes.data
            codes = self._call(method, names, [base + at[i] for i in members], [len(items[i][1]) for i in members])
        if isinstance(codes, int):
            # one code for the batch: on a failure, ask the store which items it holds
            done = [True] * len(names) if codes == 0 else [c == _PRESENT for c in self._exists(names)]
        else:
            done = [int(c) == 0 for c in codes]
        return done, f"Mooncake {method} returned {codes}"

    def _send_offset(self, value) -> int | None:
        """Where ``value`` starts in the send buffer when it is a view that lies inside it, else ``None``."""
        if self._send is None or isinstance(value, bytes):
            return None
        at = np.frombuffer(value, dtype=np.uint8).ctypes.data - self._send.ctypes.data
        return at if 0 <= at and at + len(value) <= self._send.nbytes else None

    def _call(self, method: str, *args):
        """A store call; an exception from the binding becomes code -1 (counted by the caller).
        An unreachable master (code -900 anywhere in the answer) starts the retry pause."""
        try:
            answer = getattr(self._store, method)(*args)
        except Exception as exc:
            self._stats.last_error = f"Mooncake {method} raised {exc!r}"
            return -1
        coded = ("put_batch", "batch_put_from", "batch_is_exist", "batch_get_into", "batch_remove")  # answers: lists of codes
        codes = [answer] if isinstance(answer, int) else answer if method in coded else []
        if any(int(code) == RPC_FAIL for code in codes):
            self._down_until = time.monotonic() + self.retry_after_s
            self._stats.last_error = f"Mooncake master unreachable ({method} returned {RPC_FAIL})"
        return answer

    def _paused(self) -> bool:
        """Whether the master was found unreachable less than ``retry_after_s`` ago."""
        return time.monotonic() < self._down_until

    def _down(self) -> bool:
        """In the pause: count a fault and call nothing."""
        if not self._paused():
            return False
        self._fault(f"Mooncake master unreachable: not asked again for {self.retry_after_s} s")
        return True

    def _get(self, names: list[str]) -> list[bytes | None]:
        if not names or self._down():
            return [None] * len(names)
        values = self._call("get_batch", names)
        if isinstance(values, int):
            self._fault(self._stats.last_error)
            return [None] * len(names)
        out: list[bytes | None] = [bytes(v) if len(v) else None for v in values]
        empty = [names[i] for i, v in enumerate(out) if v is None]
        if empty:  # an empty answer is a miss or a fault: ask which
            codes = self._exists(empty)
            if any(code < 0 for code in codes):
                self._fault(f"Mooncake store unreachable (exists codes {sorted(set(codes))})")
        return out

    def _fetch(self, names: list[str], sizes: list[int]) -> list[memoryview | None]:
        """Into the next registered receive buffer when the batch fits (one ``batch_get_into``;
        the buffers take turns, so a fetch's views stay valid through the next
        ``receive_buffers - 1`` fetches); names it could not fetch so (absent, another size,
        a fault) go through ``get``."""
        if not self._arenas or not names or sum(sizes) > self._arenas[0].nbytes or min(sizes) <= 0:
            return super()._fetch(names, sizes)
        if self._down():
            return [None] * len(names)
        out = self._get_into_arena(names, sizes)
        again = [i for i, v in enumerate(out) if v is None]
        if again and not self._paused():
            for i, value in zip(again, self._get([names[i] for i in again])):
                out[i] = None if value is None else memoryview(value)
        return out

    def _get_into_arena(self, names: list[str], sizes: list[int]) -> list[memoryview | None]:
        """One ``batch_get_into`` of ``names`` into the next receive buffer, back to back; per
        name a read-only view of its bytes, or None where the answer was not its size."""
        arena = self._arenas[self._turn]
        self._turn = (self._turn + 1) % len(self._arenas)
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
        base = arena.ctypes.data
        codes = self._call("batch_get_into", names, [base + start for start in starts], sizes)
        if isinstance(codes, int):
            codes = [codes] * len(names)
        view = memoryview(arena).toreadonly()
        return [view[start : start + size] if int(code) == size else None
                for start, size, code in zip(starts, sizes, codes)]

    def _exists(self, names: list[str]) -> list[int]:
        codes = self._call("batch_is_exist", names)
        return [-1] * len(names) if isinstance(codes, int) else [int(c) for c in codes]

    def _contains(self, names: list[str]) -> list[bool]:
        if not names or self._down():
            return [False] * len(names)
        codes = self._exists(names)
        if any(code < 0 for code in codes):
            self._fault(f"Mooncake store unreachable (exists codes {sorted(set(codes))})")
        return [code == _PRESENT for code in codes]

    def _delete(self, names: list[str]) -> int:
        return sum(out is True for out in self._delete_each(names))

    def _delete_each(self, names: list[str]) -> list[bool | None]:
        """One ``batch_remove`` of all ``names``; when the client refuses it (raises, lacks it, or
        answers other than a code per name), ``remove`` one name at a time. Per name: removed
        (0), not held (-704, OBJECT_NOT_FOUND), or held still (None: -706, a read lease, which a
        ``get`` or a ``contains`` of the name takes; or any fault)."""
        if not names or self._down():
            return [None] * len(names)
        codes = self._call("batch_remove", names)
        if isinstance(codes, (list, tuple)) and len(codes) == len(names):
            self.remove_calls["batch_remove"] += 1
        else:
            codes = []
            for name in names:
                if self._down():
                    break
                codes.append(self._call("remove", name))
                self.remove_calls["remove"] += 1
        if any(int(code) == RPC_FAIL for code in codes):
            self._fault(self._stats.last_error)
        out: list[bool | None] = [True if int(c) == 0 else False if int(c) == _NOT_FOUND else None for c in codes]
        return out + [None] * (len(names) - len(out))

    def raw_get_into(self, names: list[str], sizes: list[int]) -> list[int]:
        """The store's ``batch_get_into`` the first receive buffer as is (a benchmark floor)."""
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
        base = self._arenas[0].ctypes.data
        return self._store.batch_get_into(names, [base + start for start in starts], sizes)

    def raw_get(self, names: list[str]) -> list[bytes]:
        """The store's ``get_batch`` as is (for benchmarks: the floor a tier read is measured against)."""
        return self._store.get_batch(names)

    def raw_put(self, names: list[str], values: list[bytes]) -> int:
        """The store's ``put_batch`` as is (a benchmark floor for offload)."""
        return self._store.put_batch(names, values)

    def raw_put_from(self, names: list[str], starts: list[int], sizes: list[int], buffer: int = 0) -> list[int]:
        """The store's ``batch_put_from`` receive buffer ``buffer``: value ``i`` is the ``sizes[i]``
        bytes at ``starts[i]`` (a benchmark floor for offload: no copy on the Python side)."""
        base = self._arenas[buffer].ctypes.data
        return self._store.batch_put_from(names, [base + start for start in starts], sizes)

    def receive_buffer(self, index: int = 0) -> np.ndarray:
        """Registered receive buffer ``index`` (for benchmarks that stage values to put from)."""
        return self._arenas[index]

    def raw_remove_matching(self, pattern: str) -> int:
        """The store's ``remove_by_regex(pattern, force=True)`` (benchmarks clear what they put)."""
        return self._store.remove_by_regex(pattern, True)

    def close(self) -> None:
        if self._store is not None:
            try:
                for arena in self._arenas + ([] if self._send is None else [self._send]):
                    self._store.unregister_buffer(arena.ctypes.data)
                self._store.close()
            except Exception:
                pass
            self._store = None
