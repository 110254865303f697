"""A workload request: token ids, output length, arrival and dependency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_VOCAB_SIZE = 129_280
"""Tokenizer size of DeepSeek-V3/V4; token ids are drawn from ``[0, vocab)``."""

MAX_TOKEN_ID = np.iinfo(np.int32).max


def check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _frozen_token_array(name: str, values: Any) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() > MAX_TOKEN_ID):
        raise ValueError(f"{name} must hold ids in [0, {MAX_TOKEN_ID}]")
    frozen = array.astype(np.int32, copy=True)
    frozen.flags.writeable = False
    return frozen


@dataclass(frozen=True, eq=False)
class Request:
    """One request of a workload.

    ``arrival_step`` is the earliest driver step at which the request may be
    admitted; with ``after_request_id`` set it also waits until that request
    has finished (the driver admits it at the later of the two). Token arrays
    are stored as read-only int32 copies.
    """

    request_id: str
    arrival_step: int
    prompt_token_ids: np.ndarray
    output_tokens: int
    output_token_ids: np.ndarray
    conversation_id: str | None = None
    turn: int | None = None
    after_request_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        object.__setattr__(
            self, "arrival_step", check_int("arrival_step", self.arrival_step, minimum=0)
        )
        prompt = _frozen_token_array("prompt_token_ids", self.prompt_token_ids)
        if prompt.size == 0:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")
        object.__setattr__(self, "prompt_token_ids", prompt)
        output_tokens = check_int("output_tokens", self.output_tokens, minimum=1)
        object.__setattr__(self, "output_tokens", output_tokens)
        outputs = _frozen_token_array("output_token_ids", self.output_token_ids)
        if outputs.size != output_tokens:
            raise ValueError(
                f"request {self.request_id!r}: output_token_ids has {outputs.size} ids, "
                f"output_tokens is {output_tokens}"
            )
        object.__setattr__(self, "output_token_ids", outputs)
        if self.conversation_id is not None and (
            not isinstance(self.conversation_id, str) or not self.conversation_id
        ):
            raise ValueError(f"conversation_id must be a non-empty str, got {self.conversation_id!r}")
        if self.turn is not None:
            object.__setattr__(self, "turn", check_int("turn", self.turn, minimum=0))
        if self.after_request_id is not None:
            if not isinstance(self.after_request_id, str) or not self.after_request_id:
                raise ValueError(
                    f"after_request_id must be a non-empty str, got {self.after_request_id!r}"
                )
            if self.after_request_id == self.request_id:
                raise ValueError(f"request {self.request_id!r} cannot wait for itself")

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt_token_ids.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        return (
            self.request_id == other.request_id
            and self.arrival_step == other.arrival_step
            and self.output_tokens == other.output_tokens
            and self.conversation_id == other.conversation_id
            and self.turn == other.turn
            and self.after_request_id == other.after_request_id
            and np.array_equal(self.prompt_token_ids, other.prompt_token_ids)
            and np.array_equal(self.output_token_ids, other.output_token_ids)
        )

    __hash__ = None  # type: ignore[assignment]  # arrays are not hashable; key by request_id


def random_token_ids(rng: np.random.Generator, count: int, vocab_size: int) -> np.ndarray:
    return rng.integers(0, vocab_size, size=int(count), dtype=np.int32)


def check_vocab_size(vocab_size: int) -> int:
    return check_int("vocab_size", vocab_size, minimum=2)
