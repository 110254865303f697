"""Fixed-seed request workloads and a JSONL trace loader.

Every generator returns a list of :class:`Request` in dispatch order: a request
never appears before the request it waits for (``after_request_id``). Token ids
are real, random ids so that a prefix cache hashes content; output ids are
drawn from the same seed, so a driver that "generates" exactly
``output_token_ids`` reproduces the multi-turn prompts built here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import xxhash

DEFAULT_VOCAB_SIZE = 129_280
"""Tokenizer size of DeepSeek-V3/V4; token ids are drawn from ``[0, vocab)``."""

MAX_TOKEN_ID = np.iinfo(np.int32).max


class TraceFormatError(ValueError):
    """A JSONL trace line is malformed; the message names the file and line."""


def _check_int(name: str, value: object, *, minimum: int) -> int:
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
            self, "arrival_step", _check_int("arrival_step", self.arrival_step, minimum=0)
        )
        prompt = _frozen_token_array("prompt_token_ids", self.prompt_token_ids)
        if prompt.size == 0:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")
        object.__setattr__(self, "prompt_token_ids", prompt)
        output_tokens = _check_int("output_tokens", self.output_tokens, minimum=1)
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
            object.__setattr__(self, "turn", _check_int("turn", self.turn, minimum=0))
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


@dataclass(frozen=True)
class LengthDistribution:
    """Lognormal token counts: ``round(exp(N(ln median_tokens, sigma)))`` clipped to
    ``[min_tokens, max_tokens]``."""

    median_tokens: float
    sigma: float
    min_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        if not (isinstance(self.median_tokens, (int, float)) and self.median_tokens > 0):
            raise ValueError(f"median_tokens must be a positive number, got {self.median_tokens!r}")
        if not (isinstance(self.sigma, (int, float)) and self.sigma >= 0):
            raise ValueError(f"sigma must be a non-negative number, got {self.sigma!r}")
        _check_int("min_tokens", self.min_tokens, minimum=1)
        _check_int("max_tokens", self.max_tokens, minimum=self.min_tokens)

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` lengths as int64."""
        raw = rng.lognormal(mean=math.log(self.median_tokens), sigma=self.sigma, size=count)
        return np.clip(np.rint(raw), self.min_tokens, self.max_tokens).astype(np.int64)


CHAT_PROMPT_LENGTHS = LengthDistribution(median_tokens=1024, sigma=1.0, min_tokens=32, max_tokens=32_768)
CHAT_OUTPUT_LENGTHS = LengthDistribution(median_tokens=256, sigma=0.8, min_tokens=8, max_tokens=4_096)
USER_MESSAGE_LENGTHS = LengthDistribution(median_tokens=512, sigma=0.8, min_tokens=32, max_tokens=8_192)
ANSWER_LENGTHS = LengthDistribution(median_tokens=256, sigma=0.6, min_tokens=16, max_tokens=2_048)
LONGCTX_OUTPUT_LENGTHS = LengthDistribution(median_tokens=256, sigma=0.5, min_tokens=16, max_tokens=2_048)


def _arrival_steps(
    rng: np.random.Generator, count: int, arrival_rate_per_step: float | None
) -> np.ndarray:
    """All at step 0, or a Poisson process with ``arrival_rate_per_step`` requests/step."""
    if arrival_rate_per_step is None:
        return np.zeros(count, dtype=np.int64)
    if not (isinstance(arrival_rate_per_step, (int, float)) and arrival_rate_per_step > 0):
        raise ValueError(f"arrival_rate_per_step must be positive, got {arrival_rate_per_step!r}")
    gaps = rng.exponential(1.0 / arrival_rate_per_step, size=count)
    return np.floor(np.cumsum(gaps)).astype(np.int64)


def _token_ids(rng: np.random.Generator, count: int, vocab_size: int) -> np.ndarray:
    return rng.integers(0, vocab_size, size=int(count), dtype=np.int32)


def _split(tokens: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return np.split(tokens, np.cumsum(lengths)[:-1])


def _check_vocab(vocab_size: int) -> int:
    return _check_int("vocab_size", vocab_size, minimum=2)


def chat_workload(
    num_requests: int = 256,
    *,
    seed: int = 0,
    prompt_lengths: LengthDistribution = CHAT_PROMPT_LENGTHS,
    output_lengths: LengthDistribution = CHAT_OUTPUT_LENGTHS,
    arrival_rate_per_step: float | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> list[Request]:
    """Independent requests with lognormal prompt and output lengths, random ids."""
    _check_int("num_requests", num_requests, minimum=1)
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    arrivals = _arrival_steps(rng, num_requests, arrival_rate_per_step)
    prompt_lens = prompt_lengths.sample(rng, num_requests)
    output_lens = output_lengths.sample(rng, num_requests)
    prompts = _split(_token_ids(rng, prompt_lens.sum(), vocab_size), prompt_lens)
    outputs = _split(_token_ids(rng, output_lens.sum(), vocab_size), output_lens)
    return [
        Request(
            request_id=f"chat-{i:05d}",
            arrival_step=int(arrivals[i]),
            prompt_token_ids=prompts[i],
            output_tokens=int(output_lens[i]),
            output_token_ids=outputs[i],
        )
        for i in range(num_requests)
    ]


def multiturn_workload(
    num_conversations: int = 32,
    turns: int = 4,
    *,
    seed: int = 0,
    system_prompt_tokens: int = 2_000,
    user_message_lengths: LengthDistribution = USER_MESSAGE_LENGTHS,
    answer_lengths: LengthDistribution = ANSWER_LENGTHS,
    arrival_rate_per_step: float | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> list[Request]:
    """Conversations that share one system prompt.

    Turn ``k+1``'s prompt is turn ``k``'s prompt, then turn ``k``'s answer
    (its ``output_token_ids``), then a new user message; it waits for turn
    ``k`` (``after_request_id``). Requests come turn-major: every
    conversation's turn 0, then every turn 1, ...; first turns arrive per
    ``arrival_rate_per_step`` (all at step 0 by default), later turns carry the
    arrival step of their conversation's first turn.
    """
    _check_int("num_conversations", num_conversations, minimum=1)
    _check_int("turns", turns, minimum=1)
    _check_int("system_prompt_tokens", system_prompt_tokens, minimum=0)
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    arrivals = _arrival_steps(rng, num_conversations, arrival_rate_per_step)
    system_prompt = _token_ids(rng, system_prompt_tokens, vocab_size)
    user_lens = user_message_lengths.sample(rng, num_conversations * turns)
    answer_lens = answer_lengths.sample(rng, num_conversations * turns)
    user_msgs = _split(_token_ids(rng, user_lens.sum(), vocab_size), user_lens)
    answers = _split(_token_ids(rng, answer_lens.sum(), vocab_size), answer_lens)

    by_turn: list[list[Request]] = [[] for _ in range(turns)]
    for conv in range(num_conversations):
        conversation_id = f"conv{conv:04d}"
        context = system_prompt
        previous_id: str | None = None
        for turn in range(turns):
            index = conv * turns + turn
            prompt = np.concatenate([context, user_msgs[index]])
            request = Request(
                request_id=f"{conversation_id}-turn{turn}",
                arrival_step=int(arrivals[conv]),
                prompt_token_ids=prompt,
                output_tokens=int(answer_lens[index]),
                output_token_ids=answers[index],
                conversation_id=conversation_id,
                turn=turn,
                after_request_id=previous_id,
            )
            by_turn[turn].append(request)
            context = np.concatenate([prompt, answers[index]])
            previous_id = request.request_id
    return [request for turn_requests in by_turn for request in turn_requests]


def longctx_workload(
    num_requests: int = 8,
    *,
    seed: int = 0,
    min_prompt_tokens: int = 32_768,
    max_prompt_tokens: int = 1_048_576,
    output_lengths: LengthDistribution = LONGCTX_OUTPUT_LENGTHS,
    max_context_tokens: int = 1_048_576,
    arrival_rate_per_step: float | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> list[Request]:
    """A few long prompts, log-uniform in ``[min_prompt_tokens, max_prompt_tokens]``.

    A prompt is shortened so that prompt + output fits ``max_context_tokens``.
    """
    _check_int("num_requests", num_requests, minimum=1)
    _check_int("min_prompt_tokens", min_prompt_tokens, minimum=1)
    _check_int("max_prompt_tokens", max_prompt_tokens, minimum=min_prompt_tokens)
    _check_int("max_context_tokens", max_context_tokens, minimum=output_lengths.max_tokens + 1)
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    arrivals = _arrival_steps(rng, num_requests, arrival_rate_per_step)
    log_lens = rng.uniform(math.log(min_prompt_tokens), math.log(max_prompt_tokens), num_requests)
    output_lens = output_lengths.sample(rng, num_requests)
    prompt_lens = np.clip(np.rint(np.exp(log_lens)), min_prompt_tokens, max_prompt_tokens)
    prompt_lens = np.minimum(prompt_lens, max_context_tokens - output_lens).astype(np.int64)
    prompts = _split(_token_ids(rng, prompt_lens.sum(), vocab_size), prompt_lens)
    outputs = _split(_token_ids(rng, output_lens.sum(), vocab_size), output_lens)
    return [
        Request(
            request_id=f"long-{i:03d}",
            arrival_step=int(arrivals[i]),
            prompt_token_ids=prompts[i],
            output_tokens=int(output_lens[i]),
            output_token_ids=outputs[i],
        )
        for i in range(num_requests)
    ]


# --------------------------------------------------------------------------- JSONL traces

_TRACE_KEYS = frozenset(
    {
        "arrival",
        "prompt_token_ids",
        "prompt_tokens",
        "prefix_id",
        "prefix_tokens",
        "output_tokens",
        "output_token_ids",
        "request_id",
        "after",
        "conversation_id",
        "turn",
    }
)


@dataclass(frozen=True)
class _TraceLine:
    line_no: int
    request_id: str
    arrival_step: int
    prompt_token_ids: list[int] | None
    prompt_tokens: int
    prefix_key: str | None
    prefix_tokens: int
    output_tokens: int
    output_token_ids: list[int] | None
    after: str | None
    conversation_id: str | None
    turn: int | None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_trace_line(
    obj: object,
    line_no: int,
    *,
    vocab_size: int,
    arrival_steps_per_unit: float,
    seen_ids: dict[str, int],
) -> _TraceLine:
    def fail(message: str) -> TraceFormatError:
        return TraceFormatError(f"line {line_no}: {message}")

    def token_list(key: str) -> list[int]:
        ids = obj[key]
        if not isinstance(ids, list) or not ids:
            raise fail(f"{key!r} must be a non-empty list of token ids")
        if not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
            raise fail(f"{key!r} must hold ints in [0, {vocab_size})")
        return ids

    def positive_int(key: str) -> int:
        value = obj[key]
        if not _is_int(value) or value < 1:
            raise fail(f"{key!r} must be a positive int, got {value!r}")
        return value

    def nonempty_str(key: str) -> str:
        value = obj[key]
        if not isinstance(value, str) or not value:
            raise fail(f"{key!r} must be a non-empty string, got {value!r}")
        return value

    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _TRACE_KEYS)
    if unknown:
        raise fail(f"unknown key(s) {unknown}; allowed: {sorted(_TRACE_KEYS)}")
    for key in ("arrival", "output_tokens"):
        if key not in obj:
            raise fail(f"missing required key {key!r}")

    arrival = obj["arrival"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)):
        raise fail(f"'arrival' must be a number, got {arrival!r}")
    if not math.isfinite(arrival) or arrival < 0:
        raise fail(f"'arrival' must be finite and >= 0, got {arrival!r}")
    arrival_step = math.floor(arrival * arrival_steps_per_unit)

    has_ids, has_count = "prompt_token_ids" in obj, "prompt_tokens" in obj
    if has_ids == has_count:
        raise fail("give exactly one of 'prompt_token_ids' and 'prompt_tokens'")
    has_prefix_id, has_prefix_tokens = "prefix_id" in obj, "prefix_tokens" in obj
    if has_prefix_id != has_prefix_tokens:
        raise fail("'prefix_id' and 'prefix_tokens' go together")
    if has_prefix_id and has_ids:
        raise fail("'prefix_id' applies to 'prompt_tokens', not to explicit 'prompt_token_ids'")

    prompt_ids: list[int] | None = None
    if has_ids:
        prompt_ids = token_list("prompt_token_ids")
        prompt_tokens = len(prompt_ids)
    else:
        prompt_tokens = positive_int("prompt_tokens")

    prefix_key: str | None = None
    prefix_tokens = 0
    if has_prefix_id:
        prefix_id = obj["prefix_id"]
        if not (isinstance(prefix_id, str) and prefix_id) and not _is_int(prefix_id):
            raise fail(f"'prefix_id' must be a non-empty string or an int, got {prefix_id!r}")
        prefix_key = json.dumps(prefix_id)
        prefix_tokens = positive_int("prefix_tokens")
        if prefix_tokens > prompt_tokens:
            raise fail(
                f"'prefix_tokens' ({prefix_tokens}) exceeds 'prompt_tokens' ({prompt_tokens})"
            )

    output_tokens = positive_int("output_tokens")
    output_ids: list[int] | None = None
    if "output_token_ids" in obj:
        output_ids = token_list("output_token_ids")
        if len(output_ids) != output_tokens:
            raise fail(
                f"'output_token_ids' has {len(output_ids)} ids, 'output_tokens' is {output_tokens}"
            )

    request_id = nonempty_str("request_id") if "request_id" in obj else f"line-{line_no}"
    if request_id in seen_ids:
        raise fail(f"duplicate request_id {request_id!r} (first on line {seen_ids[request_id]})")
    after: str | None = None
    if "after" in obj:
        after = nonempty_str("after")
        if after == request_id:
            raise fail(f"request {request_id!r} cannot wait for itself")
        if after not in seen_ids:
            raise fail(f"'after' names {after!r}, which no earlier line defines")
    conversation_id = nonempty_str("conversation_id") if "conversation_id" in obj else None
    turn: int | None = None
    if "turn" in obj:
        turn = obj["turn"]
        if not _is_int(turn) or turn < 0:
            raise fail(f"'turn' must be an int >= 0, got {turn!r}")

    return _TraceLine(
        line_no=line_no,
        request_id=request_id,
        arrival_step=arrival_step,
        prompt_token_ids=prompt_ids,
        prompt_tokens=prompt_tokens,
        prefix_key=prefix_key,
        prefix_tokens=prefix_tokens,
        output_tokens=output_tokens,
        output_token_ids=output_ids,
        after=after,
        conversation_id=conversation_id,
        turn=turn,
    )


def _prefix_stream(seed: int, prefix_key: str, count: int, vocab_size: int) -> np.ndarray:
    """The shared-prefix ids of one ``prefix_id``: a function of (seed, id) only."""
    digest = xxhash.xxh64_intdigest(prefix_key.encode())
    return _token_ids(np.random.default_rng([seed, digest]), count, vocab_size)


def parse_jsonl_trace(
    lines: Iterable[str],
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    arrival_steps_per_unit: float = 1.0,
) -> list[Request]:
    """Requests from JSONL text lines (format: ``docs/workloads.md``).

    Blank lines are skipped. Ids not given in the trace (prompt suffixes,
    outputs) are drawn from ``seed`` in line order; shared prefixes from
    ``(seed, prefix_id)``. Raises :class:`TraceFormatError` naming the line.
    """
    _check_vocab(vocab_size)
    if not (
        isinstance(arrival_steps_per_unit, (int, float))
        and not isinstance(arrival_steps_per_unit, bool)
        and math.isfinite(arrival_steps_per_unit)
        and arrival_steps_per_unit > 0
    ):
        raise ValueError(
            f"arrival_steps_per_unit must be a positive number, got {arrival_steps_per_unit!r}"
        )
    parsed: list[_TraceLine] = []
    seen_ids: dict[str, int] = {}
    for line_no, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"line {line_no}: invalid JSON ({exc.msg})") from None
        entry = _parse_trace_line(
            obj,
            line_no,
            vocab_size=vocab_size,
            arrival_steps_per_unit=arrival_steps_per_unit,
            seen_ids=seen_ids,
        )
        seen_ids[entry.request_id] = line_no
        parsed.append(entry)
    if not parsed:
        raise TraceFormatError("trace holds no requests")

    prefix_lengths: dict[str, int] = {}
    for entry in parsed:
        if entry.prefix_key is not None:
            prefix_lengths[entry.prefix_key] = max(
                prefix_lengths.get(entry.prefix_key, 0), entry.prefix_tokens
            )
    prefixes = {
        key: _prefix_stream(seed, key, count, vocab_size) for key, count in prefix_lengths.items()
    }
    rng = np.random.default_rng(seed)
    requests = []
    for entry in parsed:
        if entry.prompt_token_ids is not None:
            prompt = np.asarray(entry.prompt_token_ids, dtype=np.int32)
        else:
            shared = (
                prefixes[entry.prefix_key][: entry.prefix_tokens]
                if entry.prefix_key is not None
                else np.empty(0, dtype=np.int32)
            )
            suffix = _token_ids(rng, entry.prompt_tokens - entry.prefix_tokens, vocab_size)
            prompt = np.concatenate([shared, suffix])
        if entry.output_token_ids is not None:
            outputs = np.asarray(entry.output_token_ids, dtype=np.int32)
        else:
            outputs = _token_ids(rng, entry.output_tokens, vocab_size)
        requests.append(
            Request(
                request_id=entry.request_id,
                arrival_step=entry.arrival_step,
                prompt_token_ids=prompt,
                output_tokens=entry.output_tokens,
                output_token_ids=outputs,
                conversation_id=entry.conversation_id,
                turn=entry.turn,
                after_request_id=entry.after,
            )
        )
    return requests


def load_jsonl_trace(
    path: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    arrival_steps_per_unit: float = 1.0,
) -> list[Request]:
    """Read a JSONL trace file; errors read ``<path>: line N: ...``."""
    path = Path(path)
    with path.open(encoding="utf-8") as handle:
        try:
            return parse_jsonl_trace(
                handle,
                seed=seed,
                vocab_size=vocab_size,
                arrival_steps_per_unit=arrival_steps_per_unit,
            )
        except TraceFormatError as exc:
            raise TraceFormatError(f"{path}: {exc}") from None


def trace_lines(requests: Iterable[Request]) -> list[str]:
    """JSONL lines that :func:`parse_jsonl_trace` reads back into equal requests."""
    lines = []
    for request in requests:
        obj: dict[str, Any] = {
            "request_id": request.request_id,
            "arrival": request.arrival_step,
            "prompt_token_ids": request.prompt_token_ids.tolist(),
            "output_tokens": request.output_tokens,
            "output_token_ids": request.output_token_ids.tolist(),
        }
        if request.after_request_id is not None:
            obj["after"] = request.after_request_id
        if request.conversation_id is not None:
            obj["conversation_id"] = request.conversation_id
        if request.turn is not None:
            obj["turn"] = request.turn
        lines.append(json.dumps(obj, separators=(",", ":")))
    return lines


def dump_jsonl_trace(requests: Iterable[Request], path: str | Path) -> None:
    """Write ``requests`` as a JSONL trace with explicit token ids."""
    Path(path).write_text("".join(line + "\n" for line in trace_lines(requests)), encoding="utf-8")


# --------------------------------------------------------------------------- helpers

WORKLOAD_NAMES = ("chat", "multiturn", "longctx")


def build_workload(name_or_path: str, *, num_requests: int | None = None, seed: int = 0) -> list[Request]:
    """``chat``, ``multiturn``, ``longctx`` on their defaults, or a JSONL trace path.

    ``num_requests`` overrides the request count; for ``multiturn`` it is the
    total over all turns (``ceil(n / 4)`` conversations of 4 turns, cut to
    ``n`` in turn-major order). A trace is cut to its first ``n`` requests.
    """
    if num_requests is not None:
        _check_int("num_requests", num_requests, minimum=1)
    if name_or_path == "chat":
        return chat_workload(num_requests or 256, seed=seed)
    if name_or_path == "multiturn":
        if num_requests is None:
            return multiturn_workload(seed=seed)
        turns = 4
        return multiturn_workload(-(-num_requests // turns), turns, seed=seed)[:num_requests]
    if name_or_path == "longctx":
        return longctx_workload(num_requests or 8, seed=seed)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"workload must be one of {WORKLOAD_NAMES} or a JSONL trace file, got {name_or_path!r}"
        )
    requests = load_jsonl_trace(path, seed=seed)
    return requests if num_requests is None else requests[:num_requests]


def _common_prefix_tokens(a: np.ndarray, b: np.ndarray) -> int:
    length = min(a.size, b.size)
    if length == 0 or a[0] != b[0]:
        return 0
    mismatch = np.flatnonzero(a[:length] != b[:length])
    return int(mismatch[0]) if mismatch.size else length


def ideal_hit_tokens(requests: list[Request], *, grain_tokens: int = 1) -> np.ndarray:
    """Per request, the most prompt tokens an unbounded prefix cache could reuse.

    Requests are served one after another in list order. A finished request
    leaves its prompt and all outputs but the last (never fed back, so it has
    no KV) in the cache. A hit is capped at ``prompt_tokens - 1`` (the last
    prompt token is always computed) and rounded down to ``grain_tokens``.
    """
    _check_int("grain_tokens", grain_tokens, minimum=1)
    cached: list[np.ndarray] = []
    hits = np.zeros(len(requests), dtype=np.int64)
    for index, request in enumerate(requests):
        prompt = request.prompt_token_ids
        best = max((_common_prefix_tokens(prompt, seq) for seq in cached), default=0)
        best = min(best, prompt.size - 1)
        hits[index] = best - best % grain_tokens
        cached.append(np.concatenate([prompt, request.output_token_ids[:-1]]))
    return hits
