"""Human-readable numbers: one parser for every command-line number, and formatters.

Every number has the same grammar: digits (``_`` may group them), an optional
fraction, an optional unit; no sign, no exponent, no commas (``1,5`` is refused:
in many locales it means one and a half). What the unit means depends on the kind:

* bytes: binary ``KiB MiB GiB TiB`` (powers of 1024), decimal ``kB KB MB GB TB``
  (powers of 1000), ``B`` or none for plain bytes; a bare ``G``/``M``/``K`` is
  refused as ambiguous. Fractions round down to a whole byte.
* tokens: ``k``, ``M``, ``G`` are binary, as context lengths are quoted:
  ``128k`` = 131,072, ``1M`` = 1,048,576. The result must be a whole number.
* counts (requests, seeds, running requests): ``k``, ``M``, ``G`` are decimal:
  ``1k`` = 1,000. The result must be a whole number.

:func:`parse_number` takes the kind and the name of what is parsed (a flag such
as ``--kv-memory``), and every message names it. Numbers of more than
:data:`MAX_DIGITS` digits are refused before Python converts them.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_DIGITS = 30

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
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_UNITS = {"bytes": _BYTE_UNITS, "tokens": _TOKEN_UNITS, "count": _COUNT_UNITS}
_UNIT_HELP = {
    "bytes": "e.g. 40GiB, 512MiB, 1.5GiB, 40GB",
    "tokens": "e.g. 8192, 128k (= 131072), 1M (= 1048576)",
    "count": "e.g. 100, 1k (= 1000), 1M (= 1000000)",
}
_NUMBER = re.compile(r"([0-9](?:_?[0-9])*)(?:\.([0-9]+))?\s*([A-Za-z]*)")
_WHAT = {"bytes": "a byte size", "tokens": "a token count", "count": "a whole number"}


def parse_number(text: str, *, kind: str = "count", name: str | None = None) -> int:
    """``text`` as a non-negative int of ``kind`` (``bytes``, ``tokens`` or ``count``).

    Raises ``ValueError`` naming ``name`` (default: what the kind is) and the text.
    """
    if kind not in _UNITS:
        raise ValueError(f"kind must be one of {sorted(_UNITS)}, got {kind!r}")
    label = name or _WHAT[kind]
    if not isinstance(text, str):
        raise ValueError(f"{label} must be a string ({_UNIT_HELP[kind]}), got {text!r}")
    shown = text if len(text) <= 40 else text[:37] + "..."
    stripped = text.strip()
    if len(re.sub(r"[^0-9]", "", stripped)) > MAX_DIGITS:
        raise ValueError(f"{label}: {shown!r} has more than {MAX_DIGITS} digits")
    if stripped.startswith("-"):
        raise ValueError(f"{label} must not be negative, got {shown!r}")
    if "," in stripped:
        raise ValueError(
            f"{label}: cannot read {shown!r}: no commas (write 1.5GiB or 1536MiB, 8192 or 8_192)"
        )
    match = _NUMBER.fullmatch(stripped)
    if match is None:
        raise ValueError(f"{label}: cannot read {shown!r} ({_UNIT_HELP[kind]})")
    whole, fraction, unit = match.groups()
    value = Fraction(int(whole.replace("_", "")))
    if fraction:
        value += Fraction(int(fraction), 10 ** len(fraction))
    return _apply_unit(value, unit, kind, label, shown)


def _apply_unit(value: Fraction, unit: str, kind: str, label: str, shown: str) -> int:
    key = unit.lower()
    units = _UNITS[kind]
    if key not in units:
        hint = f" ({_UNIT_HELP[kind]})"
        if kind == "bytes" and key in ("k", "m", "g", "t"):
            hint = f": write {unit.upper()}iB (powers of 1024) or {unit.upper()}B (powers of 1000)"
        raise ValueError(f"{label}: unknown unit {unit!r} in {shown!r}{hint}")
    if kind == "bytes":
        if key in ("", "b") and value.denominator != 1:
            raise ValueError(f"{label}: a plain byte count must be whole, got {shown!r}")
        return int(value * units[key])
    scaled = value * units[key]
    if scaled.denominator != 1:
        raise ValueError(f"{label}: {shown!r} is not a whole number")
    return int(scaled)


def parse_bytes(text: str, name: str | None = None) -> int:
    """Bytes from ``'40GiB'``, ``'512MiB'``, ``'1.5GiB'``, ``'40GB'`` (10**9), ``'4096'``."""
    return parse_number(text, kind="bytes", name=name)


def parse_tokens(text: str, name: str | None = None) -> int:
    """Tokens from ``'128k'`` (131,072), ``'1M'`` (1,048,576), ``'8192'``; k = 1024."""
    return parse_number(text, kind="tokens", name=name)


def parse_count(text: str, name: str | None = None) -> int:
    """A count from ``'100'``, ``'1k'`` (1,000), ``'2M'`` (2,000,000); k = 1000."""
    return parse_number(text, kind="count", name=name)


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


def plural(count: int, singular: str, plural_form: str | None = None) -> str:
    """``'1 request'``, ``'2 requests'`` (the count with thousands separators)."""
    word = singular if count == 1 else (plural_form or singular + "s")
    return f"{count:,} {word}"


__all__ = [
    "MAX_DIGITS",
    "format_bytes",
    "format_tokens",
    "parse_bytes",
    "parse_count",
    "parse_number",
    "parse_tokens",
    "plural",
]
