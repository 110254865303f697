"""Human-readable sizes: parse ``40GiB`` / ``128k`` and format bytes and counts.

Bytes take an explicit unit: binary ``KiB MiB GiB TiB`` (powers of 1024) or
decimal ``kB KB MB GB TB`` (powers of 1000), or ``B``/none for plain bytes. A bare
``G``/``M``/``K`` is refused as ambiguous. Token counts take ``k``, ``M``, ``G``
as binary multipliers: ``128k`` = 131,072 and ``1M`` = 1,048,576 (context lengths
are quoted that way). Fractions are allowed with a unit (``1.5GiB``); byte
counts round down to a whole byte, token counts must come out whole.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_TOKEN_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}
_NUMBER = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _split(text: str, what: str) -> tuple[Fraction, str]:
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string like '40GiB', got {text!r}")
    if text.strip().startswith("-"):
        raise ValueError(f"{what} must not be negative, got {text!r}")
    match = _NUMBER.match(text)
    if match is None:
        raise ValueError(f"cannot read {text!r} as {what}")
    digits, unit = match.groups()
    if digits.endswith((",", "_")):
        raise ValueError(f"cannot read {text!r} as {what}")
    return Fraction(digits.replace("_", "").replace(",", "")), unit


def parse_bytes(text: str) -> int:
    """Bytes from ``'40GiB'``, ``'512MiB'``, ``'1.5GiB'``, ``'40GB'`` (10**9), ``'4096'``."""
    value, unit = _split(text, "a byte size")
    key = unit.lower()
    if key not in _BYTE_UNITS:
        hint = ""
        if key in ("k", "m", "g", "t"):
            hint = f": write {unit.upper()}iB (powers of 1024) or {unit.upper()}B (powers of 1000)"
        raise ValueError(f"unknown byte unit {unit!r} in {text!r}{hint}")
    if key in ("", "b") and value.denominator != 1:
        raise ValueError(f"a plain byte count must be whole, got {text!r}")
    return int(value * _BYTE_UNITS[key])


def parse_tokens(text: str) -> int:
    """Tokens from ``'128k'`` (131,072), ``'1M'`` (1,048,576), ``'8192'``; k = 1024."""
    value, unit = _split(text, "a token count")
    key = unit.lower()
    if key not in _TOKEN_UNITS:
        raise ValueError(f"unknown token unit {unit!r} in {text!r} (use k = 1024, M = 1024**2)")
    tokens = value * _TOKEN_UNITS[key]
    if tokens.denominator != 1:
        raise ValueError(f"token count {text!r} is not a whole number of tokens")
    return int(tokens)


def format_bytes(num_bytes: int | float) -> str:
    """``'40.00 GiB'``, ``'37.00 KiB'``, ``'512 B'`` (binary units, two decimals)."""
    size = float(num_bytes)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(num_bytes):,} B"


def format_tokens(tokens: int) -> str:
    """``'128k'``, ``'1M'`` when exact, else ``'100,000'``."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("k", 2**10)):
        if tokens >= scale and tokens % scale == 0:
            return f"{tokens // scale}{unit}"
    return f"{tokens:,}"


__all__ = ["format_bytes", "format_tokens", "parse_bytes", "parse_tokens"]
