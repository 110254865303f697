"""The seed's rules, restated as a frozen test oracle (not imported by hybridkv).

The seed is the engine-facing DeepSeek-V4 cache module hybridkv's
``hybridkv.models.deepseek_v4`` keeps the names of: the ``deepseek_v4`` cache-spec
module of the tokenspeed serving engine (LightSeek Foundation, MIT licence; read
at github.com/lightseek/tokenspeed, ``tokenspeed/runtime/configs/``). Each rule
below was read from that source and is written here as plain arithmetic, so the
comparison test does not depend on the code under test. An outcome is either a
value or the exception class the seed raises.

What the seed does that a stricter library might not:
* the inverse layouts check only the block multiple: row bytes 0 give
  ``(0, 0, 0)`` / ``(0, 0)``, a negative multiple gives negative sizes;
* ``build_v4_cache_specs`` keeps only compress ratios > 1, so 0, 1 and negative
  ratios add no group; 4 and 128 are the only others accepted;
* the sliding window comes from ``sliding_window`` or ``text_config.sliding_window``
  (attributes), converted with ``int()``; ``None``, missing or <= 0 raise.
* ``parse_v4_compressor_state_group_id`` calls ``str`` methods on its argument.
"""

from __future__ import annotations

from typing import Any

STATE_WINDOW = {4: 8, 128: 128}
STATE_ROWS = {4: 4, 128: 8}


def outcome(function, *args, **kwargs) -> Any:
    """``("ok", value)`` or ``("raises", exception class name)``."""
    try:
        return ("ok", function(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - the class is the outcome
        return ("raises", type(exc).__name__)


def nope_dim(head_dim, rope_dim):
    nope = int(head_dim) - int(rope_dim)
    if nope <= 0:
        raise ValueError
    return nope


def swa_token_stride(head_dim, rope_dim):
    return nope_dim(head_dim, rope_dim) + 2 * int(rope_dim)


def swa_scale_dim(head_dim, rope_dim):
    nope = nope_dim(head_dim, rope_dim)
    if nope % 64:
        raise ValueError
    return nope // 64 + 1


def swa_row_bytes(head_dim, rope_dim):
    return swa_token_stride(head_dim, rope_dim) + swa_scale_dim(head_dim, rope_dim)


def mxfp4_value_bytes(dim):
    if int(dim) % 2:
        raise ValueError
    return int(dim) // 2


def mxfp4_scale_dim(dim):
    if int(dim) % 32:
        raise ValueError
    return int(dim) // 32


def mxfp4_row_bytes(dim):
    return mxfp4_value_bytes(dim) + mxfp4_scale_dim(dim)


def mxfp4_layout_from_row_bytes(row_bytes):
    blocks, rest = divmod(int(row_bytes), 17)
    if rest:
        raise ValueError
    return (32 * blocks, 16 * blocks, blocks)


def fp8_scale_bytes(dim):
    if int(dim) % 128:
        raise ValueError
    return int(dim) // 128 * 4


def fp8_row_bytes(dim):
    return int(dim) + fp8_scale_bytes(dim)


def fp8_layout_from_row_bytes(row_bytes):
    blocks, rest = divmod(int(row_bytes), 132)
    if rest:
        raise ValueError
    return (128 * blocks, 4 * blocks)


def state_group_id(ratio):
    return "v4.c%da.compressor_state" % int(ratio)


def compressed_kv_group_id(ratio):
    return "v4.c%da.compressed_kv" % int(ratio)


def parse_state_group_id(group_id):
    head, tail = "v4.c", "a.compressor_state"
    if not (group_id.startswith(head) and group_id.endswith(tail)):
        return None
    try:
        return int(group_id[len(head) : len(group_id) - len(tail)])
    except ValueError:
        return None


def _window(config):
    for source in (config, getattr(config, "text_config", None)):
        if source is not None and hasattr(source, "sliding_window"):
            if source.sliding_window is None:
                raise ValueError
            window = int(source.sliding_window)
            if window <= 0:
                raise ValueError
            return window
    raise ValueError


def cache_specs(config, layer_ratio):
    """The seed's groups as ``(id, retention, rows, stride, window, family)`` tuples."""
    window = _window(config)
    ratios = sorted({int(r) for r in layer_ratio if int(r) > 1})
    groups = [("v4.swa_kv", "sliding_window", 64, 1, window, "state")]
    for ratio in ratios:
        if ratio not in STATE_WINDOW:
            raise ValueError
        groups.append(
            (state_group_id(ratio), "sliding_window", STATE_ROWS[ratio], 1, STATE_WINDOW[ratio], "state")
        )
        groups.append((compressed_kv_group_id(ratio), "full_history", max(1, 256 // ratio), ratio, None, "history"))
    if 4 in ratios:
        groups.append(("v4.c4a.indexer_compressor_state", "sliding_window", 4, 1, 8, "state"))
    return groups
