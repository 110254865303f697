"""Argument checks shared by the modules (integer-like values, no bools, no floats;
the shapes of what the manager's public methods take)."""

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


# --- library-boundary checks for the manager's public methods ---------------------
# Each takes the error class to raise (the manager passes CacheManagerError), so this
# module imports nothing of the package.


def check_token_ids(name: str, value: object, error: type = ValueError) -> None:
    """Token ids must be a list, tuple, range or array of ints: not a string or bytes
    (a ``str`` would read as characters) and not a one-shot iterator (a generator
    would be consumed by the first look)."""
    if isinstance(value, (str, bytes, bytearray)):
        raise error(f"{name} must be a sequence of int token ids, got a {type(value).__name__}")
    if hasattr(value, "__next__"):
        raise error(
            f"{name} must be a sequence or array of int token ids, got a one-shot "
            f"{type(value).__name__} (pass list(...) of it)"
        )
    if not hasattr(value, "__len__") and not hasattr(value, "__array__"):
        raise error(f"{name} must be a sequence or array of int token ids, got {type(value).__name__}")


def check_request_ids(name: str, value: object, error: type = ValueError) -> None:
    """Request ids must be a sequence (list, tuple) of ids, not one string."""
    if isinstance(value, (str, bytes, bytearray)):
        raise error(f"{name} must be a sequence of request ids, got the {type(value).__name__} {value!r}")
    if value is None or not hasattr(value, "__len__"):
        raise error(f"{name} must be a sequence of request ids, got {type(value).__name__}")


def check_items(value: object, error: type = ValueError) -> None:
    """A step's items: a sequence of ``(request_id, num_tokens)`` pairs."""
    if isinstance(value, (str, bytes, bytearray)) or value is None or not hasattr(value, "__len__"):
        raise error(
            f"items must be a sequence of (request_id, num_tokens) pairs, got {type(value).__name__}"
        )


def check_cache_salt(value: object, error: type = ValueError) -> None:
    """A cache salt is ``None``, a ``str`` or ``bytes``."""
    if value is not None and not isinstance(value, (str, bytes)):
        raise error(f"cache_salt must be a str, bytes or None, got {type(value).__name__}")


def check_empty_token_batch(token_ids: object, error: type = ValueError) -> None:
    """``token_ids`` for no requests: shape ``(0, k)`` (or empty), else a clear error."""
    shape = getattr(token_ids, "shape", None)
    if shape is None:
        try:
            shape = (len(token_ids),)  # type: ignore[arg-type]
        except TypeError:
            raise error(f"token_ids must be an array [0, k] for no requests, got {type(token_ids).__name__}") from None
    if len(shape) not in (1, 2) or shape[0] != 0:
        raise error(f"token_ids must be [0, k] for no requests, got shape {tuple(shape)}")
