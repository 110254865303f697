"""Tiers stacked: host first, then disk or a shared store, each keeping what it keeps."""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.tiers.base import Tier, TierStats


class TierStack(Tier):
    """Tiers in order, fastest first, used as one tier.

    * ``put`` writes through to every tier; each tier accepts, evicts or
      refuses by its own budget, so a lower tier keeps objects the host has
      long dropped (retention is per tier). An item counts as stored when any
      tier stored it.
    * ``get`` asks the tiers in order, each only for the names still missing,
      and copies what a lower tier found into the tiers above it.
    * ``contains`` is true when any tier holds the name; ``delete`` deletes
      from every tier.

    ``stats()`` counts the stack's own calls; ``tier_stats()`` each tier's.
    """

    name = "stack"
    put_copies = True  # views go down as they are: each tier's own put copies what it keeps
    keeps_given = True  # ... and go down given when put given (a host tier keeps them)

    def __init__(self, tiers: Sequence[Tier]) -> None:
        super().__init__()
        if not tiers or not all(isinstance(t, Tier) for t in tiers):
            raise ValueError("a stack needs at least one Tier")
        self.tiers = tuple(tiers)
        self.reads_lease = any(t.reads_lease for t in self.tiers)

    def _put(self, items: list[tuple[str, bytes]], given: bool = False) -> list[bool]:
        stored = [False] * len(items)
        for tier in self.tiers:
            stored = [a or b for a, b in zip(stored, tier.put(items, given=given))]
        self._count_puts(items, stored)
        return stored

    def _put_given(self, items: list[tuple[str, bytes]]) -> list[bool]:
        return self._put(items, given=True)

    def _get(self, names: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(names)
        missing = list(range(len(names)))
        for depth, tier in enumerate(self.tiers):
            if not missing:
                break
            found = tier.get([names[i] for i in missing])
            promote = [(names[i], v) for i, v in zip(missing, found) if v is not None]
            for i, value in zip(missing, found):
                if value is not None:
                    out[i] = value
            if promote and depth:
                for upper in self.tiers[:depth]:
                    upper.put(promote)
            missing = [i for i in missing if out[i] is None]
        return out

    def _contains(self, names: list[str]) -> list[bool]:
        held = [False] * len(names)
        for tier in self.tiers:
            ask = [i for i, h in enumerate(held) if not h]
            if not ask:
                break
            for i, h in zip(ask, tier.contains([names[i] for i in ask])):
                held[i] = h
        return held

    def _delete(self, names: list[str]) -> int:
        return max(tier.delete(names) for tier in self.tiers)

    def tier_stats(self) -> dict[str, TierStats]:
        return {f"{i}:{t.name}": t.stats() for i, t in enumerate(self.tiers)}

    def stats(self) -> TierStats:
        out = super().stats()
        out.errors = sum(t.stats().errors for t in self.tiers)
        return out

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


__all__ = ["TierStack"]
