"""Checkpoint policies: which boundaries keep a state checkpoint, and which goes first.

A hit at boundary ``D`` needs a state checkpoint at exactly ``D``
(docs/prefix-caching.md). Every policy keeps a request's **latest** checkpoint
(held: its terminal once it is freed) and its **junction** (pinned); they differ
in the *speculative* checkpoints, published unheld and low priority (evicted
before anything usable) at other boundaries the request crosses:

* ``"prompt-boundaries"`` (default): every boundary inside the prompt;
* ``"terminal-and-junctions"``: none (vLLM's retention interval 0);
* ``"interval"``: every multiple of ``checkpoint_interval_tokens``, in the prompt
  or while decoding (vLLM's positive retention interval, but low priority);
* ``"prefill-per-byte"``: the prompt boundaries, as the default, and every cached
  checkpoint ranked by the prefill it saves per byte it pins, times its expected
  reuse (learned online per class), blended with recency (in the spirit of
  Marconi, MLSys 2025): speculative and reused checkpoints of a class rated
  below ``REUSE_FLOOR`` are low priority (speculative ones are published so),
  the rest sit in the state pools' LRU in the order of
  :meth:`CheckpointValues.score`, the lowest at the front.

``state_checkpoint_interval`` (pinned, normal priority checkpoints) adds to any policy.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from hybridkv._checks import as_int

CHECKPOINT_POLICIES = ("prompt-boundaries", "terminal-and-junctions", "interval", "prefill-per-byte")
DEFAULT_CHECKPOINT_POLICY = "prompt-boundaries"
# Depth (tokens) at which a token's depth-dependent prefill work equals its fixed work:
# on V4-Flash a token at depth t scores t/4 indexer keys (21 layers x 64 heads x 128 dims)
# and reads t/128 ratio-128 entries (20 layers x 64 heads x 512 dims), ~1.3e5 x t FLOP,
# against ~1e10 FLOP per token of projections and experts: the order of 1e5 tokens.
ATTENTION_EQUAL_DEPTH_TOKENS = 131_072
# A checkpoint's bytes in tokens of history: on V4-Flash (FP8 indexer) one checkpoint is
# 4,080,000 B and the history of 256 tokens 998,208 B, so a checkpoint weighs as much as
# the history of 1,046 tokens. A hit at D pins the checkpoint and the history below D.
CHECKPOINT_HISTORY_TOKENS = 1_046
# Recency: a checkpoint's value halves (its score, a log2, drops by 1) for every this many
# requests freed since its last use.
VALUE_HALF_LIFE_REQUESTS = 64
# "prefill-per-byte": a class of checkpoints whose expected reuse (hits per checkpoint, as
# learned) is below this is low priority, evicted before anything usable (and cheap for
# slab moves).
REUSE_FLOOR = 0.25


@dataclass(frozen=True)
class CheckpointPolicy:
    """A named policy with its parameter (``interval_tokens``: ``"interval"`` only)."""

    name: str
    interval_tokens: int | None = None

    def speculative(self, boundary_tokens: int, prompt_tokens: int) -> bool:
        """Whether a boundary a request crosses (not its latest) keeps a speculative
        checkpoint; also whether its own checkpoint there, superseded, is demoted to
        one rather than unpublished."""
        if self.name == "interval":
            return boundary_tokens % self.interval_tokens == 0
        if self.name in ("prompt-boundaries", "prefill-per-byte"):
            return boundary_tokens <= prompt_tokens
        return False

    @property
    def ranks_by_value(self) -> bool:
        return self.name == "prefill-per-byte"


def checkpoint_policy(
    name: str | None, prompt_checkpoints: bool | None, interval_tokens: int | None, grain_tokens: int
) -> CheckpointPolicy:
    """The policy from its name, the older ``prompt_checkpoints`` switch (True:
    ``"prompt-boundaries"``, False: ``"terminal-and-junctions"``) and its parameter;
    ValueError when the name is unknown, the two disagree, or the interval is missing,
    misplaced or not a positive multiple of the grain."""
    if name is not None and name not in CHECKPOINT_POLICIES:
        raise ValueError(f"checkpoint_policy must be one of {CHECKPOINT_POLICIES}, got {name!r}")
    if prompt_checkpoints is not None:
        implied = CHECKPOINT_POLICIES[0] if prompt_checkpoints else CHECKPOINT_POLICIES[1]
        if name is not None and name != implied:
            raise ValueError(f"prompt_checkpoints={prompt_checkpoints!r} contradicts checkpoint_policy={name!r}")
        name = implied
    name = name or DEFAULT_CHECKPOINT_POLICY
    if name != "interval":
        if interval_tokens is not None:
            raise ValueError(
                f"checkpoint_interval_tokens applies to checkpoint_policy='interval' only, not {name!r}"
            )
        return CheckpointPolicy(name)
    if interval_tokens is None:
        raise ValueError("checkpoint_policy='interval' needs checkpoint_interval_tokens")
    n = as_int("checkpoint_interval_tokens", interval_tokens)
    if n <= 0 or n % grain_tokens:
        raise ValueError(f"checkpoint_interval_tokens must be a positive multiple of the grain {grain_tokens}, got {n}")
    return CheckpointPolicy(name, n)


def saved_prefill(boundary_tokens: int) -> float:
    """Prefill work a hit at ``boundary_tokens`` saves, in units of one token's fixed
    work: ``D + D^2 / (2 L)`` with ``L`` = ``ATTENTION_EQUAL_DEPTH_TOKENS`` (token ``t``
    costs ``1 + t / L``), so a deeper boundary saves more per token."""
    d = float(boundary_tokens)
    return d + d * d / (2 * ATTENTION_EQUAL_DEPTH_TOKENS)


SPECULATIVE, OWN, REUSED = "speculative", "own", "reused"  # the classes of CheckpointValues


class CheckpointValues:
    """Saved prefill per byte, blended with recency, of the checkpoints a
    ``"prefill-per-byte"`` prefix cache publishes (one record per key).

    ``score = log2(saved_prefill(D) * expected_reuse / pinned(D)) - age / H``:
    ``pinned(D) = D + checkpoint_tokens`` is what a hit at ``D`` needs cached (the
    history below ``D`` and the checkpoint, in tokens of history bytes; default
    ``CHECKPOINT_HISTORY_TOKENS``); age counts requests freed since the
    checkpoint's last use (publication or hit); ``H`` = ``VALUE_HALF_LIFE_REQUESTS``.

    Expected reuse is learned online per class, from outcomes. A checkpoint is
    published ``"speculative"`` (a boundary the policy guessed) or ``"own"`` (a
    request's latest, junction or interval checkpoint); a speculative one becomes
    ``"reused"`` at its first hit (a hit at an ``own`` one, a terminal, is a
    conversation continuing: it stays ``own``). A hit is a success of the class
    the checkpoint is in; leaving the cache without a hit in its class, a failure
    (an ``own`` one its request moves past counts as neither: it was no terminal;
    kept, it becomes speculative). A class's expected reuse is
    ``(successes + 1) / (successes + failures + 2)``. A speculative or reused
    class rated below ``REUSE_FLOOR`` is low priority; own checkpoints stay
    normal, lowest score first (a terminal keeps the history below it from
    being an orphan). So on a multi-turn workload, where each turn hits the
    previous turn's terminal, ``own`` rates high and ``speculative`` low; on
    documents shared by many questions, ``reused`` rates high and terminals,
    never hit, low."""

    def __init__(self, checkpoint_tokens: int = CHECKPOINT_HISTORY_TOKENS):
        self.checkpoint_tokens = as_int("checkpoint_tokens", checkpoint_tokens, minimum=1)
        self.freed_requests = 0  # the clock: requests freed so far
        # key -> [boundary tokens, class, last use, hits in its class]
        self._records: dict[Hashable, list] = {}
        self.successes = dict.fromkeys((SPECULATIVE, OWN, REUSED), 0)
        self.failures = dict.fromkeys((SPECULATIVE, OWN, REUSED), 0)

    def published(self, key: Hashable, boundary_tokens: int, speculative: bool) -> None:
        if key not in self._records:
            self._records[key] = [boundary_tokens, SPECULATIVE if speculative else OWN, self.freed_requests, 0]

    def hit(self, key: Hashable) -> None:
        """A request hit at the checkpoint (a success of its class)."""
        record = self._records.get(key)
        if record is None:
            return
        self.successes[record[1]] += 1
        record[2] = self.freed_requests
        if record[1] == SPECULATIVE:
            record[1], record[3] = REUSED, 0
        else:
            record[3] += 1

    def superseded(self, key: Hashable, kept: bool) -> None:
        """The request holding it moved past it; ``kept``: it stays cached. An ``own``
        checkpoint is then no terminal: kept, it becomes ``speculative``."""
        record = self._records.get(key)
        if record is None or record[1] != OWN:
            return
        if kept:
            record[1], record[3] = SPECULATIVE, 0
        else:
            del self._records[key]

    def removed(self, key: Hashable) -> None:
        """It left the cache: a failure of its class unless it was hit there."""
        record = self._records.pop(key, None)
        if record is not None and record[3] == 0:
            self.failures[record[1]] += 1

    def kind(self, key: Hashable) -> str | None:
        """The checkpoint's class (None if not recorded)."""
        record = self._records.get(key)
        return None if record is None else record[1]

    def request_freed(self) -> None:
        self.freed_requests += 1

    def expected_reuse(self, kind: str) -> float:
        hits = self.successes[kind]
        return (hits + 1) / (hits + self.failures[kind] + 2)

    def low_priority(self, kind: str) -> bool:
        """Whether checkpoints of class ``kind`` go before anything usable: a
        speculative or reused class rated below ``REUSE_FLOOR``."""
        return kind != OWN and self.expected_reuse(kind) < REUSE_FLOOR

    def score(self, key: Hashable) -> float:
        """The checkpoint's score now (higher: kept longer); KeyError if not recorded."""
        boundary, kind, last_use, _ = self._records[key]
        value = math.log2(saved_prefill(boundary) * self.expected_reuse(kind) / (boundary + self.checkpoint_tokens))
        return value - (self.freed_requests - last_use) / VALUE_HALF_LIFE_REQUESTS

    def eviction_order(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """The recorded ``keys``, low-priority classes first, then lowest score first
        (ties: the shallower first)."""
        low = {kind: self.low_priority(kind) for kind in (SPECULATIVE, OWN, REUSED)}
        records = self._records
        return sorted((k for k in keys if k in records),
                      key=lambda k: (not low[records[k][1]], self.score(k), records[k][0]))


__all__ = [
    "ATTENTION_EQUAL_DEPTH_TOKENS", "CHECKPOINT_HISTORY_TOKENS", "CHECKPOINT_POLICIES", "CheckpointPolicy",
    "CheckpointValues", "DEFAULT_CHECKPOINT_POLICY", "OWN", "REUSE_FLOOR", "REUSED", "SPECULATIVE",
    "VALUE_HALF_LIFE_REQUESTS", "checkpoint_policy", "saved_prefill",
]
