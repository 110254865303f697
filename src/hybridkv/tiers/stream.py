"""Loading many objects into pools with the next batch in flight.

``stream_load`` receives and verifies the objects in batches on one worker thread
(``ObjectStore.receive``: the tier's fetch; ``ObjectStore.verify``: checksum, key, parts) while
the calling thread scatters the batch before into the pools (``scatter_objects``: compiled
copies, with the slots found once for every object before the first fetch). The worker spends
its time in the tier's call and in the checksum, the calling thread in the copies; all three
release the GIL, so on a machine with a free core the receive and checksum of one batch overlap
the scatter of the one before. Objects that fail verification are deleted from the tier at the
end, on the calling thread. A tier's receive buffers take turns (``Tier.fetch_views_kept``), so
the batch being scattered is never the one being received; a tier with a single buffer (or
``overlap=False``) is loaded one batch after the other.

Every target is checked before the first byte is written (``check_scatter``: groups,
pools, held pages, no row written twice). A missing, corrupted or refused object, or one
that holds other tokens than planned, is not written; every other object is. A caller
that needs all of a set or nothing (a load plan's boundary) verifies everything first and
scatters what it chose (``hybridkv.transfer.load_objects``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from hybridkv.tiers.keys import ObjectKey
from hybridkv.tiers.pools import GroupPools
from hybridkv.tiers.rows import GroupPages, check_scatter, rows_for_tokens, scatter_objects
from hybridkv.tiers.store import ObjectStore

Range = tuple[ObjectKey, int, int]  # (key, first token, end token)


def stream_load(
    store: ObjectStore,
    ranges: Sequence[Range],
    pools: Mapping[str, GroupPools],
    pages: Mapping[str, GroupPages],
    *,
    batch_objects: int = 16,
    overlap: bool = True,
) -> list[bool]:
    """Load each ``(key, first_token, end_token)`` object's rows into ``pools`` at the page view
    ``pages``; per object, whether its rows were written. ``overlap=False`` receives, verifies
    and scatters batch after batch on the calling thread."""
    if isinstance(batch_objects, bool) or not isinstance(batch_objects, int) or batch_objects < 1:
        raise ValueError(f"batch_objects must be a positive int, got {batch_objects!r}")
    ranges, pools, pages = list(ranges), dict(pools), dict(pages)
    slots = check_scatter(pools, pages, ranges)
    starts = list(range(0, len(ranges), batch_objects))
    batches = [ranges[i : i + batch_objects] for i in starts]
    kept = store.tier.fetch_views_kept
    written: list[bool] = []
    bad: list[ObjectKey] = []
    if not overlap or len(batches) < 2 or (kept is not None and kept < 2):
        for at, batch in zip(starts, batches):
            objects, failed = _receive_and_verify(store, batch)
            written += _scatter(batch, objects, slots[at : at + len(batch)], pools, pages)
            bad += failed
    else:
        with ThreadPoolExecutor(1, thread_name_prefix="hybridkv-fetch") as worker:
            pending = worker.submit(_receive_and_verify, store, batches[0])
            for i, (at, batch) in enumerate(zip(starts, batches)):
                objects, failed = pending.result()
                if i + 1 < len(batches):
                    pending = worker.submit(_receive_and_verify, store, batches[i + 1])
                written += _scatter(batch, objects, slots[at : at + len(batch)], pools, pages)
                bad += failed
    store.discard(bad)  # on this thread, once no receive is running
    return written


def _receive_and_verify(store: ObjectStore, batch: list[Range]) -> tuple[list, list[ObjectKey]]:
    """The batch's objects, verified (or ``None``), and the keys that failed verification (the
    worker thread's part: waiting in the tier's receive and in the checksum, both without the GIL)."""
    keys = [key for key, _, _ in batch]
    rows = [rows_for_tokens(store.layout.group(key.group_id).spec, a, b)[1] for key, a, b in batch]
    return store.verify(keys, store.receive(keys, rows))


def _scatter(batch: list[Range], objects, slots, pools, pages) -> list[bool]:
    """Scatter the verified objects that hold the planned tokens; per object whether it was written."""
    chosen = [
        i for i, ((_, a, b), obj) in enumerate(zip(batch, objects))
        if obj is not None and (obj.first_token, obj.first_token + obj.num_tokens) == (a, b)
    ]
    scatter_objects(pools, pages, [objects[i] for i in chosen], slots=[slots[i] for i in chosen])
    written = [False] * len(batch)
    for i in chosen:
        written[i] = True
    return written
