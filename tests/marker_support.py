"""What the marker and board tests share: the namespace, a settable clock, a link's markers, and
two Mooncake clients on a loopback master (the tests start and stop it; CI must run them)."""

import os

import pytest

from hybridkv.inflight import InFlightRule, Markers
from hybridkv.models.layout import cache_layout
from hybridkv.tiers import Tier, TierUnavailable, layout_namespace

NAMESPACE = layout_namespace(cache_layout("deepseek-v4-flash"))
TTL = 10.0


class Clock:
    """A clock the test sets by hand."""

    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


def markers(tier, clock=None, ttl=TTL):
    return Markers(tier, NAMESPACE, InFlightRule(wait=1.0, ttl=ttl, clock=clock or Clock()))


try:
    from hybridkv.tiers.mooncake import MooncakeMaster, MooncakeTier, load_store_class

    load_store_class()
    MOONCAKE = None
except TierUnavailable as exc:
    MOONCAKE = str(exc)
    MooncakeMaster = MooncakeTier = None

needs_mooncake = pytest.mark.skipif(MOONCAKE is not None and os.environ.get("CI", "").lower() != "true",
                                    reason=str(MOONCAKE))


def start_master(log_dir):
    """A loopback master with a short read lease (refused where the client is missing: CI must run these)."""
    if MOONCAKE is not None:
        raise RuntimeError(f"CI must run the Mooncake tests: {MOONCAKE}")
    return MooncakeMaster(log_path=str(log_dir / "master.log"), lease_ms=500)


def client(master, **options):
    return MooncakeTier(master.master_address, master.metadata_url, segment_bytes=16 << 20, receive_bytes=0,
                        send_bytes=0, **options)


def close_pair(clients):
    """Remove the markers the pair put, then close both clients."""
    clients[0].raw_remove_matching(f"hkv1/{NAMESPACE.hex}/marker/.*")
    for one in clients:
        one.close()


class WatchedTier(Tier):
    """Passes every call to ``inner``; counts the puts on a name ``inner`` holds (``overwrites``),
    and runs ``before_put`` (once) just before the next put of a name containing ``watch``:
    another writer's put lands between this writer's read and its put."""

    def __init__(self, inner, watch="/marker/"):
        super().__init__()
        self.inner, self.watch = inner, watch
        self.reads_lease = inner.reads_lease
        self.overwrites = 0
        self.before_put = None

    def _put(self, items):
        hook, self.before_put = self.before_put, None
        if hook is not None and any(self.watch in name for name, _ in items):
            hook()
        self.overwrites += sum(self.inner.contains([name for name, _ in items]))
        return self.inner.put(items)

    def _get(self, names):
        return self.inner.get(names)

    def _contains(self, names):
        return self.inner.contains(names)

    def _delete(self, names):
        return self.inner.delete(names)
