"""Model cache layouts: which layers feed which cache group, and the bytes a page holds.

``cache_layout`` reads a Hugging Face ``config.json`` (a path, a dict, a config
object, or a bundled name) into a frozen :class:`ModelCacheLayout`. Page bytes
follow the exact DeepSeek-V4 page formats (docs/planning.md has the byte sums):

* KV pages (window and compressed groups) are structure-of-arrays: ``rows``
  token-data blocks then ``rows`` scale blocks, the page stride padded up to a
  multiple of the token stride (576 B for head_dim 512 / rope 64).
* Ratio-4 compressed pages also carry the indexer keys of the same rows, on the
  same page ids, unpadded (MXFP4 68 B or FP8 132 B per row).
* Compressor state pages hold fp32 ``[C | Z]`` rows, unpadded.
"""

from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from hybridkv._checks import as_int
from hybridkv.models import deepseek_v4 as v4
from hybridkv.spec import CacheGroupSpec

BUNDLED_MODELS: tuple[str, ...] = ("deepseek-v4-flash", "deepseek-v4-pro")
INDEXER_FORMATS: tuple[str, ...] = ("mxfp4", "fp8")
FP32_BYTES = 4


# --- reading configs ----------------------------------------------------------

def _bundled_config(name: str) -> dict[str, Any]:
    # Read beside this file (package data), not through importlib.resources: that
    # import alone costs more than the rest of `hybridkv plan`'s start.
    path = os.path.join(os.path.dirname(__file__), "configs", f"{name}.json")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8-sig") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise ValueError(
            f"no such model config {path!r} (bundled models: {', '.join(BUNDLED_MODELS)})"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"config {path!r} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"config {path!r}: JSON nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"config {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"cannot read config {path!r}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config {path!r} must hold a JSON object, got {type(data).__name__}")
    return data


def _object_to_dict(obj: Any) -> dict[str, Any]:
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        data = to_dict()
        if isinstance(data, Mapping):
            return dict(data)
    if hasattr(obj, "__dict__"):
        data = {k: v for k, v in vars(obj).items() if not k.startswith("__")}
        text_config = data.get("text_config")
        if text_config is not None and not isinstance(text_config, Mapping):
            data["text_config"] = _object_to_dict(text_config)
        return data
    raise ValueError(f"cannot read a model config from a {type(obj).__name__}")


def load_model_config(source: Any) -> dict[str, Any]:
    """The raw config as a dict: from a bundled name, a ``config.json`` path (or a
    directory holding one), a mapping, or a config object (``to_dict()`` or attributes).

    Raises ``ValueError`` for an unknown name, a missing or unreadable file, or
    anything that is not a JSON object.
    """
    if isinstance(source, str) and source in BUNDLED_MODELS:
        return _bundled_config(source)
    if isinstance(source, (str, os.PathLike)):
        return _read_config_file(source)
    if isinstance(source, Mapping):
        return dict(source)
    return _object_to_dict(source)


def _lookup(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``, else ``config["text_config"][key]``, else ``None``."""
    if config.get(key) is not None:
        return config[key]
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping):
        return text_config.get(key)
    return None


def _as_int(value: Any) -> int:
    """An int from an int, a numpy integer or a decimal string; floats and bools refused."""
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is not an integer")
    if isinstance(value, str):
        return int(value)
    return operator.index(value)


def _config_int(config: Mapping[str, Any], key: str, *, minimum: int = 1) -> int:
    value = _lookup(config, key)
    if value is None:
        raise ValueError(f"DeepSeek-V4 config is missing {key}")
    try:
        number = _as_int(value)
    except (TypeError, ValueError):
        raise ValueError(f"config {key} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"config {key} must be an integer >= {minimum}, got {value!r}")
    return number


# --- the layout ---------------------------------------------------------------

@dataclass(frozen=True)
class GroupLayout:
    """One cache group of one model.

    ``layers``: layer indices whose buffers share this group's page ids.
    ``plane_bytes``: ``(plane, bytes)`` pairs of one page in one layer
    (``kv``, ``indexer``, ``state``); ``layer_page_bytes`` is their sum and
    ``page_bytes`` = ``layer_page_bytes * len(layers)``.
    ``ideal_bytes_per_token``: unpadded bytes per context token (history groups;
    0 for state groups). ``ideal_bytes_per_request``: unpadded bytes of one
    request's full window (sliding groups; 0 for history groups).
    """

    spec: CacheGroupSpec
    layers: tuple[int, ...]
    plane_bytes: tuple[tuple[str, int], ...]
    row_bytes: int
    ideal_bytes_per_token: float
    ideal_bytes_per_request: int

    @property
    def group_id(self) -> str:
        return self.spec.group_id

    @property
    def layer_page_bytes(self) -> int:
        return sum(size for _, size in self.plane_bytes)

    @property
    def page_bytes(self) -> int:
        return self.layer_page_bytes * len(self.layers)


@dataclass(frozen=True)
class ModelCacheLayout:
    """A model's cache groups with their layers and exact page bytes (see module doc)."""

    name: str
    layer_ratios: tuple[int, ...]
    num_main_layers: int
    include_mtp: bool
    head_dim: int
    rope_dim: int
    index_head_dim: int | None
    indexer: str
    sliding_window_tokens: int
    speculative_tokens: int
    max_position_embeddings: int | None
    kv_row_bytes: int
    kv_token_stride_bytes: int
    indexer_row_bytes: int | None
    specs: tuple[CacheGroupSpec, ...]
    groups: tuple[GroupLayout, ...]

    def group(self, group_id: str) -> GroupLayout:
        for group in self.groups:
            if group.spec.group_id == group_id:
                return group
        known = ", ".join(g.spec.group_id for g in self.groups)
        raise KeyError(f"no group {group_id!r} in {self.name} (groups: {known})")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ratios)

    @property
    def ideal_bytes_per_token(self) -> float:
        return sum(group.ideal_bytes_per_token for group in self.groups)

    @property
    def ideal_bytes_per_request(self) -> int:
        return sum(group.ideal_bytes_per_request for group in self.groups)


def _kv_page_stride(rows: int, row_bytes: int, token_stride_bytes: int) -> int:
    """Bytes of a structure-of-arrays KV page, padded to a multiple of the token stride."""
    return math.ceil(rows * row_bytes / token_stride_bytes) * token_stride_bytes


def _layer_ratios(config: Mapping[str, Any], include_mtp: bool) -> tuple[int, int, tuple[int, ...]]:
    raw = _lookup(config, "compress_ratios")
    if raw is None:
        model_type = _lookup(config, "model_type")
        raise ValueError(
            "not a DeepSeek-V4 config (no compress_ratios"
            + (f"; model_type={model_type!r}" if model_type is not None else "")
            + "): only DeepSeek-V4 cache layouts are supported so far"
        )
    try:
        if isinstance(raw, (str, bytes, Mapping)):
            raise TypeError
        ratios = [_as_int(r) for r in raw]
    except (TypeError, ValueError):
        raise ValueError(f"compress_ratios must be a list of integers, got {raw!r}") from None
    num_main = _config_int(config, "num_hidden_layers")
    if len(ratios) < num_main:
        raise ValueError(
            f"compress_ratios has {len(ratios)} entries, fewer than num_hidden_layers={num_main}"
        )
    extra = len(ratios) - num_main
    nextn = _lookup(config, "num_nextn_predict_layers")
    num_mtp = extra if nextn is None else _config_int(config, "num_nextn_predict_layers", minimum=0)
    if num_mtp > extra:
        raise ValueError(
            f"num_nextn_predict_layers={num_mtp} but compress_ratios has only {extra} "
            f"entries after the {num_main} main layers"
        )
    if include_mtp and num_mtp == 0:
        raise ValueError(
            "include_mtp: the config has no MTP layer (num_nextn_predict_layers is 0 or "
            "compress_ratios has no entry after the main layers)"
        )
    selected = ratios[: num_main + (num_mtp if include_mtp else 0)]
    return num_main, num_mtp, tuple(selected)


def _indexer_row_bytes(indexer: str, index_head_dim: int) -> int:
    if indexer == "mxfp4":
        return v4.deepseek_v4_indexer_mxfp4_row_bytes(index_head_dim)
    return v4.deepseek_v4_indexer_fp8_row_bytes(index_head_dim)


def _v4_specs(config: Any, ratios: tuple[int, ...], speculative_tokens: int) -> tuple[int, tuple]:
    """The sliding window and the seed's cache group specs for these layer ratios."""
    try:
        window = v4.resolve_sliding_window(config)
        specs = tuple(
            v4.build_v4_cache_specs(
                SimpleNamespace(sliding_window=window),
                layer_ratio=ratios,
                speculative_tokens=speculative_tokens,
            )
        )
    except TypeError as exc:  # e.g. a list where the seed expects an integer
        raise ValueError(f"invalid DeepSeek-V4 config or arguments: {exc}") from None
    return window, specs


@dataclass(frozen=True)
class _RowBytes:
    """The row sizes a group's layout is built from."""

    head_dim: int
    kv_row_bytes: int
    kv_token_stride_bytes: int
    index_head_dim: int | None
    indexer_row_bytes: int | None


def _group_layout(spec: Any, ratios: tuple[int, ...], sizes: _RowBytes) -> GroupLayout:
    """One group's layers, planes (name, page stride bytes), row bytes and ideal bytes."""
    gid, rows = spec.group_id, spec.rows_per_page
    state_ratio = v4.parse_v4_compressor_state_group_id(gid)
    kv_plane = ("kv", _kv_page_stride(rows, sizes.kv_row_bytes, sizes.kv_token_stride_bytes))

    def layers_with(ratio: int) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(ratios) if r == ratio)

    if gid == v4.V4_SWA_KV_GROUP_ID:
        layers, planes, row_bytes = tuple(range(len(ratios))), (kv_plane,), sizes.kv_row_bytes
    elif gid == v4.V4_INDEXER_COMPRESSOR_STATE_GROUP_ID:
        layers, row_bytes = layers_with(4), 2 * 2 * sizes.index_head_dim * FP32_BYTES
        planes = (("state", rows * row_bytes),)
    elif state_ratio is not None:
        overlap = 2 if state_ratio == 4 else 1  # ratio 4 pools two half-windows
        layers, row_bytes = layers_with(state_ratio), overlap * 2 * sizes.head_dim * FP32_BYTES
        planes = (("state", rows * row_bytes),)
    else:
        layers, planes, row_bytes = layers_with(spec.entry_stride_tokens), (kv_plane,), sizes.kv_row_bytes
        if spec.entry_stride_tokens == 4:
            planes += (("indexer", rows * sizes.indexer_row_bytes),)
            row_bytes += sizes.indexer_row_bytes
    if spec.retention == "full_history":
        ideal_token, ideal_request = len(layers) * row_bytes / spec.entry_stride_tokens, 0
    else:
        ideal_token, ideal_request = 0.0, len(layers) * spec.sliding_window_tokens * row_bytes
    return GroupLayout(spec, layers, planes, row_bytes, ideal_token, ideal_request)


def _layout_name(source: Any, config: Any) -> str:
    """A bundled model's name, a config file's path, or the config's own name."""
    if isinstance(source, str) and source in BUNDLED_MODELS:
        return source
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    return str(config.get("_name_or_path") or _lookup(config, "model_type") or "custom")


def cache_layout(
    source: Any,
    *,
    indexer: str = "mxfp4",
    include_mtp: bool = False,
    speculative_tokens: int = 1,
) -> ModelCacheLayout:
    """The cache layout of a DeepSeek-V4 model.

    ``source``: a bundled name (``deepseek-v4-flash``, ``deepseek-v4-pro``), a
    ``config.json`` path, a dict, or a config object. ``include_mtp`` adds the
    MTP layer(s) (the ``compress_ratios`` entries after the main layers).
    ``speculative_tokens`` (verify width k) widens the ratio-4 state windows.
    """
    if indexer not in INDEXER_FORMATS:
        raise ValueError(f"indexer must be one of {INDEXER_FORMATS}, got {indexer!r}")
    speculative_tokens = as_int("speculative_tokens", speculative_tokens, minimum=1)  # 1.5 is no width
    config = load_model_config(source)
    num_main, _, ratios = _layer_ratios(config, bool(include_mtp))
    head_dim = _config_int(config, "head_dim")
    rope_dim = _config_int(config, "qk_rope_head_dim")
    kv_row_bytes = v4.deepseek_v4_swa_row_bytes(head_dim, rope_dim)
    token_stride_bytes = v4.deepseek_v4_swa_token_stride(head_dim, rope_dim)
    uses_indexer = 4 in v4.compress_ratios_in(ratios)  # refuses ratios other than 0, 1, 4, 128
    window, specs = _v4_specs(config, ratios, speculative_tokens)
    index_head_dim = None
    indexer_row_bytes = None
    if uses_indexer or _lookup(config, "index_head_dim") is not None:
        index_head_dim = _config_int(config, "index_head_dim")
    if uses_indexer:
        indexer_row_bytes = _indexer_row_bytes(indexer, index_head_dim)
    max_positions = _lookup(config, "max_position_embeddings")
    if max_positions is not None:
        max_positions = _config_int(config, "max_position_embeddings")
    sizes = _RowBytes(head_dim, kv_row_bytes, token_stride_bytes, index_head_dim, indexer_row_bytes)
    groups = [_group_layout(spec, ratios, sizes) for spec in specs]
    name = _layout_name(source, config)
    return ModelCacheLayout(
        name=name,
        layer_ratios=ratios,
        num_main_layers=num_main,
        include_mtp=bool(include_mtp),
        head_dim=head_dim,
        rope_dim=rope_dim,
        index_head_dim=index_head_dim,
        indexer=indexer,
        sliding_window_tokens=window,
        speculative_tokens=int(speculative_tokens),
        max_position_embeddings=max_positions,
        kv_row_bytes=kv_row_bytes,
        kv_token_stride_bytes=token_stride_bytes,
        indexer_row_bytes=indexer_row_bytes,
        specs=specs,
        groups=tuple(groups),
    )


__all__ = [
    "BUNDLED_MODELS",
    "INDEXER_FORMATS",
    "GroupLayout",
    "ModelCacheLayout",
    "cache_layout",
    "load_model_config",
]
