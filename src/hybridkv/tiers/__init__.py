"""KV tiers: compact, checksummed objects of cache rows in host memory, on disk or in Mooncake Store.

* :mod:`~hybridkv.tiers.namespace` - the layout namespace key.
* :mod:`~hybridkv.tiers.keys` - chained content keys and object names.
* :mod:`~hybridkv.tiers.objects` - the object format (encode, verify, decode).
* :mod:`~hybridkv.tiers.pools`, :mod:`~hybridkv.tiers.rows` - rows between page pools and objects
  (:mod:`~hybridkv.tiers.rowcopy` - the compiled row copies).
* :mod:`~hybridkv.tiers.stream` - many objects into pools with the next batch in flight.
* :mod:`~hybridkv.tiers.worker` - puts off the engine's thread (a bounded queue, dropped when full).
* :mod:`~hybridkv.tiers.versions` - a value that changes, as write-once generations (the wanted board).
* :mod:`~hybridkv.tiers.host`, :mod:`~hybridkv.tiers.disk`, :mod:`~hybridkv.tiers.mooncake`,
  :mod:`~hybridkv.tiers.stack` - the tiers; :mod:`~hybridkv.tiers.store` - objects through a tier.

See ``docs/tiers.md``.
"""

from hybridkv.tiers.base import Tier, TierStats, TierUnavailable
from hybridkv.tiers.disk import DiskTier
from hybridkv.tiers.host import HostTier
from hybridkv.tiers.keys import ObjectKey, boundary_key, chained_keys
from hybridkv.tiers.namespace import Namespace, layout_namespace
from hybridkv.tiers.objects import (
    NamespaceMismatch,
    ObjectError,
    RowsObject,
    decode_object,
    encode_object,
    header_size,
)
from hybridkv.tiers.pools import GroupPools, group_pools_from_layers, layout_parts, new_group_pools
from hybridkv.tiers.rows import (
    GroupPages,
    MissingRows,
    check_scatter,
    gather_object,
    gather_objects,
    rows_for_tokens,
    scatter_object,
    scatter_objects,
)
from hybridkv.tiers.stack import TierStack
from hybridkv.tiers.store import ObjectStore, StoreStats
from hybridkv.tiers.stream import stream_load
from hybridkv.tiers.worker import OffloadWorker, OffloadWorkerStats

__all__ = [
    "DiskTier", "GroupPages", "OffloadWorker", "OffloadWorkerStats", "GroupPools", "HostTier", "MissingRows", "Namespace", "NamespaceMismatch",
    "ObjectError", "ObjectKey", "ObjectStore", "RowsObject", "StoreStats", "Tier", "TierStack", "TierStats",
    "TierUnavailable", "boundary_key", "chained_keys", "decode_object", "encode_object", "gather_object",
    "group_pools_from_layers", "header_size", "layout_namespace", "layout_parts", "new_group_pools", "rows_for_tokens",
    "scatter_object", "gather_objects", "scatter_objects", "check_scatter", "stream_load",
]
