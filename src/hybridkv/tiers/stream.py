"""Loading many objects into pools with the next batch in flight.

``stream_load`` fetches the objects in batches through ``ObjectStore.fetch`` (receive,
verify) on one worker thread while the calling thread scatters the batch before into the
pools (``scatter_objects``: compiled copies that release the GIL). A tier's receive buffers
take turns (``Tier.fetch_views_kept``), so the batch being scattered is never the one being
received; a tier with a single buffer (or ``overlap=False``) is loaded one batch after the other.

Every target is checked before the first byte is written (``check_scatter``: groups,
pools, held pages, no row written twice). A missing, corrupted or refused object, or one
that holds other tokens than planned, is not written; every other object is. A caller
that needs all of a set or nothing (a load plan's boundary) fetches first and scatters
what it chose (``hybridkv.transfer.load_objects``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from hybridkv.tiers.keys import ObjectKey
from hybridkv.tiers.objects import RowsObject
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
    ``pages``; per object, whether its rows were written. ``overlap=False`` fetches and scatters
    batch after batch on the calling thread (each hand-over between the threads waits for a
    thread to be scheduled, which costs more than it saves on a machine without a free core)."""
    if isinstance(batch_objects, bool) or not isinstance(batch_objects, int) or batch_objects < 1:
        raise ValueError(f"batch_objects must be a positive int, got {batch_objects!r}")
    ranges, pools, pages = list(ranges), dict(pools), dict(pages)
    check_scatter(pools, pages, ranges)
    batches = [ranges[i : i + batch_objects] for i in range(0, len(ranges), batch_objects)]
    kept = store.tier.fetch_views_kept
    if not overlap or len(batches) < 2 or (kept is not None and kept < 2):
        return [ok for batch in batches for ok in _scatter(pools, pages, _fetch(store, batch))]
    written: list[bool] = []
    with ThreadPoolExecutor(1, thread_name_prefix="hybridkv-fetch") as worker:
        pending = worker.submit(_fetch, store, batches[0])
        for i in range(len(batches)):
            got = pending.result()
            if i + 1 < len(batches):
                pending = worker.submit(_fetch, store, batches[i + 1])
            written += _scatter(pools, pages, got)
    return written


def _fetch(store: ObjectStore, batch: list[Range]) -> list[RowsObject | None]:
    """The batch's verified objects; ``None`` where one is missing, refused, or of other tokens."""
    rows = [rows_for_tokens(store.layout.group(key.group_id).spec, a, b)[1] for key, a, b in batch]
    got = store.fetch([key for key, _, _ in batch], rows)
    return [
        obj if obj is not None and (obj.first_token, obj.first_token + obj.num_tokens) == (a, b) else None
        for (_, a, b), obj in zip(batch, got)
    ]


def _scatter(pools, pages, got: list[RowsObject | None]) -> list[bool]:
    scatter_objects(pools, pages, [obj for obj in got if obj is not None])
    return [obj is not None for obj in got]
