"""The struct-of-arrays state the step kernels own, and one step as one call.

``StepState`` holds, for every cache group, the free stack, the ref counts, the
key flags and the table store, and per table row the computed tokens; see
``hybridkv.runtime.kernels`` for the layout. ``step`` runs one admitted step
(settling rows first, with zero new tokens) and returns its arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.runtime import kernels as k
from hybridkv.spec import CacheGroupSpec


@dataclass(frozen=True)
class StepArrays:
    """What one step hands out (every array fresh, the caller may keep it)."""

    positions: np.ndarray  # int64 [N]
    request_indices: np.ndarray  # int32 [N]
    query_start_loc: np.ndarray  # int32 [R + 1]
    write_slots: np.ndarray  # int64 [G, N], -1 where a token closes no entry
    base_pages: np.ndarray  # int64 [G, R]
    touched_cells: np.ndarray  # int64 [K] flat cells of ``pages`` the step changed
    idle_keyed_pages: np.ndarray  # int64 page-space ids whose last holder left (keyed ones)


def capacity_pages(spec: CacheGroupSpec, max_context_tokens: int, max_step_tokens: int) -> int:
    """Table columns of a group: every page of the context (full history), or a
    power-of-two ring holding a window plus a step's pages (sliding)."""
    tokens = spec.page_tokens
    if not spec.is_sliding:
        return -(-max_context_tokens // tokens)
    need = -(-(spec.sliding_window_tokens - 1 + max_step_tokens) // tokens) + 2
    return 1 << (need - 1).bit_length()


def _log2(n: int) -> int:
    """log2 of a power of two, -1 otherwise."""
    return n.bit_length() - 1 if n & (n - 1) == 0 else -1


class StepState:
    """Pages, tables and token counters of every group and table row."""

    def __init__(self, specs: Sequence[CacheGroupSpec], group_pages: Mapping[str, int], *,
                 max_context_tokens: int, max_step_tokens: int, table_rows: int = 64):
        self.specs = tuple(specs)
        caps = [capacity_pages(s, max_context_tokens, max_step_tokens) for s in self.specs]
        sizes = [int(group_pages[s.group_id]) for s in self.specs]
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.geometry = np.array(
            [[s.page_tokens, s.sliding_window_tokens or 0, c - 1 if s.is_sliding else -1, s.rows_per_page,
              s.entry_stride_tokens, o, _log2(s.page_tokens), _log2(s.rows_per_page), _log2(s.entry_stride_tokens)]
             for s, c, o in zip(self.specs, caps, offsets.tolist())], dtype=np.int64)
        self.num_pages = np.asarray(sizes, dtype=np.int64)
        total = int(sum(sizes))
        self.ref = np.zeros(total, dtype=np.int32)
        self.keyed = np.zeros(total, dtype=bool)
        self.stack = np.zeros(total, dtype=np.int32)
        # Page 0 is the null page; pages 1 .. n-1 start free, page 1 on top.
        self.top = np.asarray([n - 1 for n in sizes], dtype=np.int64)
        for o, n in zip(offsets.tolist(), sizes):
            self.stack[o : o + n - 1] = np.arange(n - 1, 0, -1, dtype=np.int32)
        self.pages = np.full((len(self.specs), table_rows, max(caps)), -1, dtype=np.int32)
        self.bounds = np.zeros((2, len(self.specs), table_rows), dtype=np.int64)
        self.computed = np.zeros(table_rows, dtype=np.int64)
        self._touched = np.zeros(1024, dtype=np.int64)
        self._idle_keyed = np.zeros(1024, dtype=np.int64)

    def ensure_rows(self, table_rows: int) -> None:
        have = self.computed.size
        if table_rows <= have:
            return
        new = max(table_rows, 2 * have)
        pages = np.full((self.pages.shape[0], new, self.pages.shape[2]), -1, dtype=np.int32)
        pages[:, :have] = self.pages
        bounds = np.zeros((2, self.pages.shape[0], new), dtype=np.int64)
        bounds[:, :, :have] = self.bounds
        self.pages, self.bounds = pages, bounds
        self.computed = np.concatenate([self.computed, np.zeros(new - have, dtype=np.int64)])

    def step(self, rows: np.ndarray, counts: np.ndarray, settle: int = 0,
             make_room: Callable[[np.ndarray], None] | None = None) -> StepArrays:
        """Run one admitted step of ``rows`` (int64 table rows) with ``counts`` new
        tokens each (the first ``settle`` rows: 0, they only release). ``make_room``
        (pages short per group) is called when a free stack is short after the
        releases and must push enough pages (evictions, lent slabs)."""
        n_rows, n_tokens = rows.size - settle, int(counts.sum())
        groups = self.geometry.shape[0]
        after = np.empty((2, groups, rows.size), dtype=np.int64)
        positions = np.empty(n_tokens, dtype=np.int64)
        indices = np.empty(n_tokens, dtype=np.int32)
        qsl = np.empty(n_rows + 1, dtype=np.int32)
        slots = np.empty((groups, n_tokens), dtype=np.int64)
        bases = np.empty((groups, n_rows), dtype=np.int64)
        state = (self.geometry, self.pages, self.bounds, self.computed, self.ref)
        while True:
            status, n_touched, n_keyed = k.run_step(
                *state, self.keyed, self.stack, self.top, rows, counts, settle, after, self._touched,
                self._idle_keyed, positions, indices, qsl, slots, bases)
            if status != k.STEP_NEEDS_ROOM:
                break
            self._touched = np.zeros(2 * n_touched, dtype=np.int64)
            self._idle_keyed = np.zeros(2 * n_touched, dtype=np.int64)
        if status == k.STEP_NEEDS_PAGES:
            short = np.maximum((after[1] - self.bounds[1, :, rows]).sum(axis=1) - self.top, 0)
            if make_room is None:
                raise RuntimeError(f"free pages short by {short.tolist()} per group after the releases")
            make_room(short)
            n_touched = k.finish_step(*state, self.stack, self.top, rows, counts, settle, after, self._touched,
                                      n_touched, positions, indices, qsl, slots, bases)
        return StepArrays(positions, indices, qsl, slots, bases, self._touched[:n_touched].copy(),
                          self._idle_keyed[:n_keyed].copy())
