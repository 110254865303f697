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
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from hybridkv.tiers.base import Tier, TierUnavailable

_ABSENT = 0
_PRESENT = 1


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class MooncakeMaster:
    """A ``mooncake_master`` on loopback with free ports; ``start``, ``stop``, ``restart`` (same ports)."""

    log_path: str = os.devnull
    lease_ms: int = 50  # how long a read or write pins an object against removal
    rpc_port: int = 0
    http_port: int = 0
    metrics_port: int = 0

    def __post_init__(self) -> None:
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

    def start(self, timeout_s: float = 20.0) -> MooncakeMaster:
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
            self._process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise TierUnavailable(f"mooncake_master exited with {self._process.returncode} (log {self.log_path})")
            if _accepts(self.rpc_port) and _accepts(self.http_port):
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
        return self.start()

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
    """Objects in a Mooncake Store reached through ``master_address``."""

    name = "mooncake"

    def __init__(
        self,
        master_address: str,
        metadata_url: str,
        *,
        segment_bytes: int = 64 << 20,
        local_buffer_bytes: int = 16 << 20,
        protocol: str = "tcp",
        local_hostname: str = "127.0.0.1",
    ) -> None:
        super().__init__()
        self._store = load_store_class()()
        code = self._store.setup(
            local_hostname, metadata_url, int(segment_bytes), int(local_buffer_bytes), protocol, "", master_address
        )
        if code != 0:
            raise TierUnavailable(f"Mooncake setup with master {master_address} failed with code {code}")
        self._stats.held = -1  # the store decides what it holds

    def _put(self, items: list[tuple[str, bytes]]) -> list[bool]:
        if not items:
            return []
        names = [name for name, _ in items]
        try:
            codes = self._store.put_batch(names, [value for _, value in items])
        except Exception as exc:  # the binding raises on some faults
            codes, message = -1, f"Mooncake put_batch raised {exc!r}"
        else:
            message = f"Mooncake put_batch returned {codes}"
        if isinstance(codes, int):
            # one code for the batch: on a failure, ask the store which items it holds
            stored = [True] * len(items) if codes == 0 else [c == _PRESENT for c in self._exists(names)]
        else:
            stored = [int(c) == 0 for c in codes]
        for (_, value), ok in zip(items, stored):
            if ok:
                self._stats.stored += 1
                self._stats.stored_bytes += len(value)
            else:
                self._stats.refused += 1
        if not all(stored):
            self._fault(message)
        return stored

    def _get(self, names: list[str]) -> list[bytes | None]:
        if not names:
            return []
        try:
            values = list(self._store.get_batch(names))
        except Exception as exc:
            self._fault(f"Mooncake get_batch raised {exc!r}")
            return [None] * len(names)
        out: list[bytes | None] = [bytes(v) if len(v) else None for v in values]
        empty = [i for i, v in enumerate(out) if v is None]
        if empty:  # an empty answer is a miss or a fault: ask which
            codes = self._exists([names[i] for i in empty])
            if any(code < 0 for code in codes):
                self._fault(f"Mooncake store unreachable (exists codes {sorted(set(codes))})")
        return out

    def _exists(self, names: list[str]) -> list[int]:
        try:
            return [int(c) for c in self._store.batch_is_exist(names)]
        except Exception:
            return [-1] * len(names)

    def _contains(self, names: list[str]) -> list[bool]:
        if not names:
            return []
        codes = self._exists(names)
        if any(code < 0 for code in codes):
            self._fault(f"Mooncake store unreachable (exists codes {sorted(set(codes))})")
        return [code == _PRESENT for code in codes]

    def _delete(self, names: list[str]) -> int:
        count = 0
        for name in names:
            try:
                code = self._store.remove(name)
            except Exception as exc:
                self._fault(f"Mooncake remove raised {exc!r}")
                continue
            if code == 0:
                count += 1
        return count

    def raw_get(self, names: list[str]) -> list[bytes]:
        """The store's ``get_batch`` as is (for benchmarks: the floor a tier read is measured against)."""
        return self._store.get_batch(names)

    def close(self) -> None:
        if self._store is not None:
            try:
                self._store.close()
            except Exception:
                pass
            self._store = None
