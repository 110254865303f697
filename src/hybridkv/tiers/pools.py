"""A group's byte pools: one ``hybridkv.codecs`` page array per (layer, plane) of the group.

Kernels (and the reference layer) keep one pool per layer and plane, all
indexed by the group's page ids. :class:`GroupPools` names them in the
layout's order: layers ascending, then planes as ``GroupLayout.plane_bytes``
lists them (``kv`` before ``indexer``). That order is the order of an object's
parts.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.codecs import FP8IndexerCodec, KVRowCodec, MXFP4IndexerCodec, PagedRowCodec, StateRowCodec
from hybridkv.models.deepseek_v4 import (
    V4_INDEXER_COMPRESSOR_STATE_GROUP_ID,
    V4_SWA_KV_GROUP_ID,
    parse_v4_compressor_state_group_id,
)
from hybridkv.models.layout import ModelCacheLayout
from hybridkv.spec import CacheGroupSpec
from hybridkv.tiers.namespace import plane_row_bytes
from hybridkv.tiers.objects import Part
from hybridkv.tiers.rowcopy import gather_planes, gather_planes_holding_gil


@dataclass(frozen=True)
class PlanePool:
    layer: int
    plane: str
    codec: PagedRowCodec
    pool: np.ndarray  # uint8 [num_pages, page_stride_bytes]


@dataclass(frozen=True)
class GroupPools:
    """Every (layer, plane) pool of one group, in object-part order."""

    spec: CacheGroupSpec
    planes: tuple[PlanePool, ...]

    @functools.cached_property
    def parts(self) -> tuple[Part, ...]:
        return tuple((p.layer, p.plane, p.codec.row_bytes) for p in self.planes)

    @functools.cached_property
    def capacity_slots(self) -> int:
        """Rows every pool of the group has room for (pages of the smallest pool, times rows a
        page): a slot at or past it lies outside some pool. (A pool's shape never changes.)"""
        return min((p.pool.shape[0] for p in self.planes), default=0) * self.spec.rows_per_page

    @functools.cached_property
    def copy_tables(self) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, np.ndarray]:
        """What ``rowcopy.gather_planes`` reads, per plane in part order: the pools, their value
        and scale bytes, and where the part starts in an object's row (bytes of the parts before
        it). Made once; ``ValueError`` when a pool is not a C-contiguous ``uint8[pages, stride]``
        (an array's shape, type and layout never change, so once checked they hold)."""
        rows_per_page, pools = self.spec.rows_per_page, []
        for plane in self.planes:
            pool, stride = plane.pool, plane.codec.page_stride_bytes(rows_per_page)
            if (not isinstance(pool, np.ndarray) or pool.dtype != np.uint8 or pool.ndim != 2 or pool.shape[1] != stride
                    or not pool.flags.c_contiguous):
                raise ValueError(f"group {self.spec.group_id} layer {plane.layer} plane {plane.plane}: "
                                 f"the pool must be a C-contiguous uint8 [pages, {stride}] array")
            pools.append(pool)
        sizes = np.array([p.codec.row_bytes for p in self.planes], dtype=np.int64)
        tables = (tuple(pools), np.array([p.codec.value_bytes for p in self.planes], dtype=np.int64),
                  np.array([p.codec.scale_bytes for p in self.planes], dtype=np.int64), np.cumsum(sizes) - sizes)
        none = np.zeros(0, dtype=np.int64)
        for kernel in (gather_planes, gather_planes_holding_gil):  # compiled (or loaded) for this many planes now,
            kernel(tables[0], np.zeros(0, dtype=np.uint8), np.zeros((len(pools), 0), dtype=np.int64), none, none,
                   tables[1], tables[2], rows_per_page)  # not at a step thread's first rescue
        return tables

    @property
    def num_pages(self) -> int:
        return int(self.planes[0].pool.shape[0]) if self.planes else 0


def plane_codec(layout: ModelCacheLayout, group_id: str, plane: str) -> PagedRowCodec:
    """The codec whose rows and pages a group's plane holds."""
    if plane == "kv":
        return KVRowCodec(layout.head_dim, layout.rope_dim)
    if plane == "indexer":
        if layout.indexer == "fp8":
            return FP8IndexerCodec(layout.index_head_dim)
        return MXFP4IndexerCodec(layout.index_head_dim)
    if plane == "state":
        return StateRowCodec(layout.group(group_id).row_bytes // 4)
    raise ValueError(f"unknown plane {plane!r}")


def layout_parts(layout: ModelCacheLayout, group_id: str) -> tuple[Part, ...]:
    """``(layer, plane, row bytes)`` of a group's objects, in order."""
    group = layout.group(group_id)
    planes = plane_row_bytes(layout, group_id)
    return tuple((layer, plane, size) for layer in group.layers for plane, size in planes)


def _codecs(layout: ModelCacheLayout, group_id: str) -> dict[str, PagedRowCodec]:
    codecs = {}
    for plane, size in plane_row_bytes(layout, group_id):
        codec = plane_codec(layout, group_id, plane)
        if codec.row_bytes != size:
            raise ValueError(f"group {group_id} plane {plane}: codec rows {codec.row_bytes} B, layout {size} B")
        codecs[plane] = codec
    return codecs


def new_group_pools(layout: ModelCacheLayout, group_pages: Mapping[str, int]) -> dict[str, GroupPools]:
    """Zero-filled pools for every group of ``layout`` with ``group_pages[group]`` pages each."""
    out = {}
    for group in layout.groups:
        gid, rows = group.group_id, group.spec.rows_per_page
        codecs = _codecs(layout, gid)
        planes = tuple(
            PlanePool(layer, plane, codec, codec.new_pool(int(group_pages[gid]), rows))
            for layer in group.layers for plane, codec in codecs.items()
        )
        out[gid] = GroupPools(group.spec, planes)
    return out


def _layer_pool_field(group_id: str, plane: str) -> str:
    if group_id == V4_SWA_KV_GROUP_ID:
        return "window"
    if group_id == V4_INDEXER_COMPRESSOR_STATE_GROUP_ID:
        return "index_state"
    if parse_v4_compressor_state_group_id(group_id) is not None:
        return "state"
    return "index_keys" if plane == "indexer" else "entries"


def group_pools_from_layers(layout: ModelCacheLayout, layer_pools: Sequence[object]) -> dict[str, GroupPools]:
    """Group views of per-layer pools shaped like ``hybridkv.reference.paged.LayerPools``
    (attributes ``window``, ``state``, ``entries``, ``index_state``, ``index_keys``)."""
    if len(layer_pools) != layout.num_layers:
        raise ValueError(f"got {len(layer_pools)} layers' pools for a layout of {layout.num_layers} layers")
    out = {}
    for group in layout.groups:
        gid = group.group_id
        codecs = _codecs(layout, gid)
        planes = []
        for layer in group.layers:
            for plane, codec in codecs.items():
                pool = getattr(layer_pools[layer], _layer_pool_field(gid, plane))
                if pool is None:
                    raise ValueError(f"layer {layer} has no pool for group {gid} plane {plane}")
                planes.append(PlanePool(layer, plane, codec, pool))
        out[gid] = GroupPools(group.spec, tuple(planes))
    return out
