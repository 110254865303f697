"""Argument checks shared by the modules (integer-like values, no bools, no floats)."""

from __future__ import annotations

import operator


def as_int(name: str, value: object, *, minimum: int | None = None, error: type = ValueError) -> int:
    """``value`` as an int (anything with ``__index__``, so numpy ints too), at least ``minimum``.

    Bools, floats and strings raise ``error`` (a ``ValueError`` subclass) naming ``name``.
    """
    if isinstance(value, bool):
        raise error(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise error(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and number < minimum:
        bound = "positive" if minimum == 1 else "non-negative" if minimum == 0 else f">= {minimum}"
        raise error(f"{name} must be {bound}, got {number}")
    return number
