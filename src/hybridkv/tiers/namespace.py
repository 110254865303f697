"""The layout namespace: one key per cache layout, so objects of different layouts never mix.

The key is the first 16 bytes of the SHA-256 of a canonical JSON description of
what decides an object's bytes: the model identity, the row formats (dtypes and
dimensions), row bytes, and every group's geometry (rows per page, tokens per
row, window, layers). Tensor-parallel rank and size are not part of it: an
object holds whole rows of every layer of its group, whichever rank wrote it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from hybridkv.models.layout import ModelCacheLayout

NAMESPACE_BYTES = 16
NAMESPACE_FORMAT = 1  # bump when the description below changes meaning


@dataclass(frozen=True)
class Namespace:
    """A layout's namespace key (``digest``, 16 bytes) and the description it hashes."""

    digest: bytes
    description: str

    @property
    def hex(self) -> str:
        return self.digest.hex()


def plane_format(layout: ModelCacheLayout, plane: str, row_bytes: int) -> str:
    """The dtype description of one plane's rows (what a reader must decode them as)."""
    if plane == "kv":
        return f"kv:e4m3-nope+bf16-rope+ue8m0/{layout.head_dim}/{layout.rope_dim}"
    if plane == "indexer":
        return f"indexer:{layout.indexer}/{layout.index_head_dim}"
    if plane == "state":
        return f"state:fp32/{row_bytes // 4}"
    raise ValueError(f"unknown plane {plane!r}")


def plane_row_bytes(layout: ModelCacheLayout, group_id: str) -> tuple[tuple[str, int], ...]:
    """``(plane, row bytes)`` of one group's planes, in the layout's plane order."""
    group = layout.group(group_id)
    out = []
    for plane, _ in group.plane_bytes:
        if plane == "kv":
            out.append((plane, layout.kv_row_bytes))
        elif plane == "indexer":
            out.append((plane, int(layout.indexer_row_bytes or 0)))
        else:
            out.append((plane, group.row_bytes))
    if sum(size for _, size in out) != group.row_bytes:
        raise ValueError(f"group {group_id}: plane rows {out} do not add up to {group.row_bytes} bytes")
    return tuple(out)


def _describe(layout: ModelCacheLayout, model_id: str) -> dict:
    groups = []
    for group in layout.groups:
        spec = group.spec
        groups.append({
            "id": spec.group_id,
            "retention": spec.retention,
            "rows_per_page": spec.rows_per_page,
            "entry_stride_tokens": spec.entry_stride_tokens,
            "sliding_window_tokens": spec.sliding_window_tokens,
            "layers": list(group.layers),
            "planes": [
                [plane, size, plane_format(layout, plane, size)]
                for plane, size in plane_row_bytes(layout, spec.group_id)
            ],
        })
    return {
        "format": NAMESPACE_FORMAT,
        "model": model_id,
        "layer_ratios": list(layout.layer_ratios),
        "groups": groups,
    }


def layout_namespace(layout: ModelCacheLayout, model_id: str | None = None) -> Namespace:
    """The namespace of ``layout``.

    ``model_id`` names the weights (e.g. a repository and revision); two models
    with the same geometry but different weights must pass different ids, since
    their rows differ for the same tokens. Default: ``layout.name``.
    """
    model = layout.name if model_id is None else model_id
    if not isinstance(model, str) or not model:
        raise ValueError(f"model_id must be a non-empty str, got {model_id!r}")
    text = json.dumps(_describe(layout, model), sort_keys=True, separators=(",", ":"))
    return Namespace(hashlib.sha256(text.encode("utf-8")).digest()[:NAMESPACE_BYTES], text)
