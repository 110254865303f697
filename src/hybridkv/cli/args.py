"""Argument types shared by the subcommands: one number parser, bounds, names.

Every number flag goes through :func:`number`, so ``1k``, ``8_192`` and the
messages read the same everywhere, and every message names its flag. Kept free
of heavy imports: ``hybridkv --help`` loads only this and argparse.
"""

from __future__ import annotations

import argparse
import os

from hybridkv.units import format_bytes, parse_number

# Upper bounds: beyond these a run would only allocate without end or overflow.
MAX_KV_MEMORY_BYTES = 64 * 2**40  # 64 TiB per GPU, far above any accelerator
MAX_RUNNING_REQUESTS = 2**20
MAX_CHUNK_TOKENS = 2**24
MAX_CONTEXT_TOKENS = 2**31 - 1  # positions are int32 in block tables and write slots
MAX_SPECULATIVE_TOKENS = 1024
MAX_WORKLOAD_REQUESTS = 1_000_000
MAX_SEED = 2**64 - 1


def _bound_text(kind: str, value: int) -> str:
    return format_bytes(value) if kind == "bytes" else f"{value:,}"


def number(flag: str, kind: str = "count", *, minimum: int = 1, maximum: int | None = None):
    """An argparse type: ``kind`` is ``bytes``, ``tokens`` or ``count`` (see hybridkv.units)."""

    def convert(text: str) -> int:
        try:
            value = parse_number(text, kind=kind, name=flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value < minimum:
            what = "positive" if minimum == 1 else f"at least {_bound_text(kind, minimum)}"
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(
                f"{flag} must be at most {_bound_text(kind, maximum)}, got {text!r}"
            )
        return value

    convert.__name__ = kind  # argparse names the type in "invalid <name> value"
    return convert


def nonempty(flag: str):
    """An argparse type for a name or path: not empty, not only spaces."""

    def convert(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{flag} must not be empty")
        if "\0" in text:
            raise argparse.ArgumentTypeError(f"{flag} must not contain a NUL byte")
        return text

    convert.__name__ = "name"
    return convert


def check_path_name(flag: str, path: str) -> None:
    """Refuse a path whose file name or whole length the system cannot take."""
    name = os.path.basename(path) or path
    folder = os.path.dirname(path) or "."
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX") if os.path.isdir(folder) else 255
    except (OSError, ValueError):
        name_max = 255
    if len(os.fsencode(name)) > name_max:
        raise ValueError(f"{flag}: file name too long ({len(name):,} characters; at most {name_max})")
    if len(os.fsencode(path)) > 4095:
        raise ValueError(f"{flag}: path too long ({len(path):,} characters)")


def flag_names(message: str) -> str:
    """A library error in the flags' names (the checkpoint options, the page space)."""
    for name in ("state_checkpoint_interval", "checkpoint_interval_tokens"):
        message = message.replace(name, "--" + name.replace("_", "-"))
    return message.replace("checkpoint_policy=", "--checkpoint-policy ").replace("page_space='shared'",
                                                                                "--page-space shared")


__all__ = [
    "MAX_CHUNK_TOKENS",
    "MAX_CONTEXT_TOKENS",
    "MAX_KV_MEMORY_BYTES",
    "MAX_RUNNING_REQUESTS",
    "MAX_SEED",
    "MAX_SPECULATIVE_TOKENS",
    "MAX_WORKLOAD_REQUESTS",
    "check_path_name",
    "flag_names",
    "nonempty",
    "number",
]

