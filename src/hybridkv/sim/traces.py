"""JSONL request traces: load (with validation naming the line) and dump."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import xxhash

from hybridkv.sim.requests import DEFAULT_VOCAB_SIZE, Request, check_vocab_size, random_token_ids


class TraceFormatError(ValueError):
    """A JSONL trace line is malformed; the message names the file and line."""


# Bounds checked while reading, before any token array is allocated.
MAX_REQUEST_TOKENS = 2**31 - 1  # prompt + output of one request (int32 positions)
MAX_TRACE_TOKENS = 2**32  # prompt + output over the whole trace (16 GiB of int32 ids)
MAX_ARRIVAL_STEP = 2**62


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


class _LineReader:
    """Checks one trace line's fields; every failure names the line."""

    def __init__(self, obj: dict, line_no: int, vocab_size: int):
        self.obj, self.line_no, self.vocab_size = obj, line_no, vocab_size

    def fail(self, message: str) -> TraceFormatError:
        return TraceFormatError(f"line {self.line_no}: {message}")

    def token_list(self, key: str) -> list[int]:
        ids = self.obj[key]
        if not isinstance(ids, list) or not ids:
            raise self.fail(f"{key!r} must be a non-empty list of token ids")
        if not all(_is_int(t) and 0 <= t < self.vocab_size for t in ids):
            raise self.fail(f"{key!r} must hold ints in [0, {self.vocab_size})")
        return ids

    def positive_int(self, key: str) -> int:
        value = self.obj[key]
        if not _is_int(value) or value < 1:
            raise self.fail(f"{key!r} must be a positive int, got {value!r}")
        return value

    def nonempty_str(self, key: str) -> str:
        value = self.obj[key]
        if not isinstance(value, str) or not value:
            raise self.fail(f"{key!r} must be a non-empty string, got {value!r}")
        return value

    def optional_str(self, key: str) -> str | None:
        return self.nonempty_str(key) if key in self.obj else None

    def check_keys(self) -> None:
        unknown = sorted(set(self.obj) - _TRACE_KEYS)
        if unknown:
            raise self.fail(f"unknown key(s) {unknown}; allowed: {sorted(_TRACE_KEYS)}")
        for key in ("arrival", "output_tokens"):
            if key not in self.obj:
                raise self.fail(f"missing required key {key!r}")
        has_ids, has_count = "prompt_token_ids" in self.obj, "prompt_tokens" in self.obj
        if has_ids == has_count:
            raise self.fail("give exactly one of 'prompt_token_ids' and 'prompt_tokens'")
        if ("prefix_id" in self.obj) != ("prefix_tokens" in self.obj):
            raise self.fail("'prefix_id' and 'prefix_tokens' go together")
        if "prefix_id" in self.obj and has_ids:
            raise self.fail("'prefix_id' applies to 'prompt_tokens', not to explicit 'prompt_token_ids'")

    def arrival_step(self, arrival_steps_per_unit: float) -> int:
        arrival = self.obj["arrival"]
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)):
            raise self.fail(f"'arrival' must be a number, got {arrival!r}")
        if not math.isfinite(arrival) or arrival < 0:
            raise self.fail(f"'arrival' must be finite and >= 0, got {arrival!r}")
        step = math.floor(arrival * arrival_steps_per_unit)
        if step > MAX_ARRIVAL_STEP:
            raise self.fail(f"'arrival' step {step:,} is beyond {MAX_ARRIVAL_STEP:,}")
        return step

    def prompt(self) -> tuple[list[int] | None, int]:
        """The prompt's explicit ids (or None) and its token count."""
        if "prompt_token_ids" in self.obj:
            ids = self.token_list("prompt_token_ids")
            return ids, len(ids)
        return None, self.positive_int("prompt_tokens")

    def prefix(self, prompt_tokens: int) -> tuple[str | None, int]:
        """The shared prefix's key (its id as JSON) and token count; (None, 0) without one."""
        if "prefix_id" not in self.obj:
            return None, 0
        prefix_id = self.obj["prefix_id"]
        if not (isinstance(prefix_id, str) and prefix_id) and not _is_int(prefix_id):
            raise self.fail(f"'prefix_id' must be a non-empty string or an int, got {prefix_id!r}")
        prefix_tokens = self.positive_int("prefix_tokens")
        if prefix_tokens > prompt_tokens:
            raise self.fail(f"'prefix_tokens' ({prefix_tokens}) exceeds 'prompt_tokens' ({prompt_tokens})")
        return json.dumps(prefix_id), prefix_tokens

    def output(self, prompt_tokens: int, max_request_tokens: int) -> tuple[list[int] | None, int]:
        """The output's explicit ids (or None) and its token count."""
        output_tokens = self.positive_int("output_tokens")
        if prompt_tokens + output_tokens > max_request_tokens:
            raise self.fail(
                f"prompt and output tokens ({prompt_tokens + output_tokens:,}) exceed "
                f"{max_request_tokens:,}, the longest request allowed"
            )
        if "output_token_ids" not in self.obj:
            return None, output_tokens
        ids = self.token_list("output_token_ids")
        if len(ids) != output_tokens:
            raise self.fail(f"'output_token_ids' has {len(ids)} ids, 'output_tokens' is {output_tokens}")
        return ids, output_tokens

    def request_ids(self, seen_ids: dict[str, int]) -> tuple[str, str | None]:
        """This line's request id and the earlier request it waits for (or None)."""
        request_id = self.optional_str("request_id") or f"line-{self.line_no}"
        if request_id in seen_ids:
            raise self.fail(f"duplicate request_id {request_id!r} (first on line {seen_ids[request_id]})")
        after = self.optional_str("after")
        if after == request_id:
            raise self.fail(f"request {request_id!r} cannot wait for itself")
        if after is not None and after not in seen_ids:
            raise self.fail(f"'after' names {after!r}, which no earlier line defines")
        return request_id, after

    def turn(self) -> int | None:
        turn = self.obj.get("turn")
        if "turn" in self.obj and (not _is_int(turn) or turn < 0):
            raise self.fail(f"'turn' must be an int >= 0, got {turn!r}")
        return turn


def _parse_trace_line(
    obj: object,
    line_no: int,
    *,
    vocab_size: int,
    arrival_steps_per_unit: float,
    seen_ids: dict[str, int],
    max_request_tokens: int,
) -> _TraceLine:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"line {line_no}: expected a JSON object, got {type(obj).__name__}")
    line = _LineReader(obj, line_no, vocab_size)
    line.check_keys()
    arrival_step = line.arrival_step(arrival_steps_per_unit)
    prompt_ids, prompt_tokens = line.prompt()
    prefix_key, prefix_tokens = line.prefix(prompt_tokens)
    output_ids, output_tokens = line.output(prompt_tokens, max_request_tokens)
    request_id, after = line.request_ids(seen_ids)
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
        conversation_id=line.optional_str("conversation_id"),
        turn=line.turn(),
    )


def _json_line(text: str, line_no: int) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"line {line_no}: invalid JSON ({exc.msg})") from None
    except RecursionError:
        raise TraceFormatError(f"line {line_no}: JSON nested too deeply") from None


def _decoded_lines(handle) -> Iterable[str]:
    """Text lines of a binary file; a line that is not UTF-8 raises naming it."""
    for line_no, raw in enumerate(handle, start=1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceFormatError(
                f"line {line_no}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
            ) from None


def _prefix_stream(seed: int, prefix_key: str, count: int, vocab_size: int) -> np.ndarray:
    """The shared-prefix ids of one ``prefix_id``: a function of (seed, id) only."""
    digest = xxhash.xxh64_intdigest(prefix_key.encode())
    return random_token_ids(np.random.default_rng([seed, digest]), count, vocab_size)


def parse_jsonl_trace(
    lines: Iterable[str],
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    arrival_steps_per_unit: float = 1.0,
    max_request_tokens: int = MAX_REQUEST_TOKENS,
) -> list[Request]:
    """Requests from JSONL text lines (format: ``docs/workloads.md``).

    Blank lines are skipped. Ids not given in the trace (prompt suffixes,
    outputs) are drawn from ``seed`` in line order; shared prefixes from
    ``(seed, prefix_id)``. A UTF-8 byte-order mark on the first line is skipped.
    Raises :class:`TraceFormatError` naming the line, also for a request longer
    than ``max_request_tokens`` and a trace of more than ``MAX_TRACE_TOKENS``
    tokens in all (both checked before any token array is allocated).
    """
    check_vocab_size(vocab_size)
    if not (
        isinstance(arrival_steps_per_unit, (int, float))
        and not isinstance(arrival_steps_per_unit, bool)
        and math.isfinite(arrival_steps_per_unit)
        and arrival_steps_per_unit > 0
    ):
        raise ValueError(
            f"arrival_steps_per_unit must be a positive number, got {arrival_steps_per_unit!r}"
        )
    parsed = _parse_lines(lines, vocab_size, arrival_steps_per_unit, max_request_tokens)
    prefixes = _prefix_streams(parsed, seed, vocab_size)
    rng = np.random.default_rng(seed)
    return [_request(entry, prefixes, rng, vocab_size) for entry in parsed]


def _parse_lines(lines: Iterable[str], vocab_size: int, arrival_steps_per_unit: float,
                 max_request_tokens: int) -> list[_TraceLine]:
    parsed: list[_TraceLine] = []
    seen_ids: dict[str, int] = {}
    total_tokens = 0
    for line_no, text in enumerate(lines, start=1):
        if line_no == 1 and text.startswith("\ufeff"):
            text = text[1:]
        if not text.strip():
            continue
        entry = _parse_trace_line(
            _json_line(text, line_no),
            line_no,
            vocab_size=vocab_size,
            arrival_steps_per_unit=arrival_steps_per_unit,
            seen_ids=seen_ids,
            max_request_tokens=max_request_tokens,
        )
        total_tokens += entry.prompt_tokens + entry.output_tokens
        if total_tokens > MAX_TRACE_TOKENS:
            raise TraceFormatError(
                f"line {line_no}: the trace holds more than {MAX_TRACE_TOKENS:,} tokens in all"
            )
        seen_ids[entry.request_id] = line_no
        parsed.append(entry)
    if not parsed:
        raise TraceFormatError("trace holds no requests")
    return parsed


def _prefix_streams(parsed: list[_TraceLine], seed: int, vocab_size: int) -> dict[str, np.ndarray]:
    """Each shared prefix's ids, as long as its longest use, drawn from ``(seed, prefix_id)``."""
    prefix_lengths: dict[str, int] = {}
    for entry in parsed:
        if entry.prefix_key is not None:
            prefix_lengths[entry.prefix_key] = max(prefix_lengths.get(entry.prefix_key, 0), entry.prefix_tokens)
    return {key: _prefix_stream(seed, key, count, vocab_size) for key, count in prefix_lengths.items()}


def _request(entry: _TraceLine, prefixes: dict[str, np.ndarray], rng: np.random.Generator,
             vocab_size: int) -> Request:
    """The request of a parsed line; ids the trace does not give are drawn from ``rng``."""
    if entry.prompt_token_ids is not None:
        prompt = np.asarray(entry.prompt_token_ids, dtype=np.int32)
    else:
        shared = (
            prefixes[entry.prefix_key][: entry.prefix_tokens]
            if entry.prefix_key is not None
            else np.empty(0, dtype=np.int32)
        )
        suffix = random_token_ids(rng, entry.prompt_tokens - entry.prefix_tokens, vocab_size)
        prompt = np.concatenate([shared, suffix])
    if entry.output_token_ids is not None:
        outputs = np.asarray(entry.output_token_ids, dtype=np.int32)
    else:
        outputs = random_token_ids(rng, entry.output_tokens, vocab_size)
    return Request(
        request_id=entry.request_id,
        arrival_step=entry.arrival_step,
        prompt_token_ids=prompt,
        output_tokens=entry.output_tokens,
        output_token_ids=outputs,
        conversation_id=entry.conversation_id,
        turn=entry.turn,
        after_request_id=entry.after,
    )


def load_jsonl_trace(
    path: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    arrival_steps_per_unit: float = 1.0,
    max_request_tokens: int = MAX_REQUEST_TOKENS,
) -> list[Request]:
    """Read a JSONL trace file (a pipe such as ``/dev/stdin`` too); errors read
    ``<path>: line N: ...``, a line that is not UTF-8 included."""
    path = Path(path)
    with path.open("rb") as handle:
        try:
            return parse_jsonl_trace(
                _decoded_lines(handle),
                seed=seed,
                vocab_size=vocab_size,
                arrival_steps_per_unit=arrival_steps_per_unit,
                max_request_tokens=max_request_tokens,
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
