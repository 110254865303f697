"""Cache-group specifications: pure data, counted in tokens only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridkv._checks import as_int

Retention = Literal["full_history", "sliding_window"]
Family = Literal["history", "state"]

_RETENTIONS = ("full_history", "sliding_window")
_FAMILIES = ("history", "state")


@dataclass(frozen=True)
class CacheGroupSpec:
    """One page-id namespace shared by every layer of the group.

    A page holds ``rows_per_page`` rows; each row covers ``entry_stride_tokens``
    consecutive tokens, so a page spans ``page_tokens`` tokens. Sliding groups
    keep only the trailing ``sliding_window_tokens`` tokens per request.

    ``checkpoint_window_tokens`` (sliding groups only): the trailing tokens a
    prefix checkpoint at a boundary stores, what a request resumed there still
    reads; ``None`` stores the whole window. A model recipe fills it in.
    """

    group_id: str
    retention: Retention
    rows_per_page: int
    entry_stride_tokens: int
    sliding_window_tokens: int | None = None
    family: Family = "history"
    checkpoint_window_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.group_id, str) or not self.group_id:
            raise ValueError(f"group_id must be a non-empty str, got {self.group_id!r}")
        if self.retention not in _RETENTIONS:
            raise ValueError(f"retention must be one of {_RETENTIONS}, got {self.retention!r}")
        if self.family not in _FAMILIES:
            raise ValueError(f"family must be one of {_FAMILIES}, got {self.family!r}")
        for name in ("rows_per_page", "entry_stride_tokens"):
            object.__setattr__(self, name, as_int(name, getattr(self, name), minimum=1))
        if self.retention == "sliding_window":
            if self.sliding_window_tokens is None:
                raise ValueError(
                    f"group {self.group_id!r}: sliding_window_tokens is required for a sliding group"
                )
            window = as_int("sliding_window_tokens", self.sliding_window_tokens, minimum=1)
            object.__setattr__(self, "sliding_window_tokens", window)
        elif self.sliding_window_tokens is not None:
            raise ValueError(
                f"group {self.group_id!r}: sliding_window_tokens must be None for full_history, "
                f"got {self.sliding_window_tokens!r}"
            )
        if self.checkpoint_window_tokens is not None:
            if not self.is_sliding:
                raise ValueError(f"group {self.group_id!r}: checkpoint_window_tokens applies to sliding groups only")
            n = as_int("checkpoint_window_tokens", self.checkpoint_window_tokens, minimum=0)
            if n > self.sliding_window_tokens:
                raise ValueError(
                    f"group {self.group_id!r}: checkpoint_window_tokens {n} exceeds the window "
                    f"({self.sliding_window_tokens} tokens)"
                )
            object.__setattr__(self, "checkpoint_window_tokens", n)

    @property
    def page_tokens(self) -> int:
        """Tokens one page spans (rows * stride)."""
        return self.rows_per_page * self.entry_stride_tokens

    @property
    def is_sliding(self) -> bool:
        return self.retention == "sliding_window"


PagedCacheGroupSpec = CacheGroupSpec
"""The same class under the engine's name."""
