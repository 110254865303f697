"""Fixed-seed request workloads (chat, multi-turn, long context); traces load via ``traces``.

Every generator returns a list of :class:`Request` in dispatch order: a request
never appears before the request it waits for (``after_request_id``). Token ids
are real, random ids so that a prefix cache hashes content; output ids are
drawn from the same seed, so a driver that "generates" exactly
``output_token_ids`` reproduces the multi-turn prompts built here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridkv.sim.requests import (
    DEFAULT_VOCAB_SIZE,
    MAX_TOKEN_ID,
    Request,
    check_int,
    check_vocab_size,
    random_token_ids,
)
from hybridkv.sim.traces import (
    TraceFormatError,
    dump_jsonl_trace,
    load_jsonl_trace,
    parse_jsonl_trace,
    trace_lines,
)

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "MAX_TOKEN_ID",
    "Request",
    "TraceFormatError",
    "dump_jsonl_trace",
    "load_jsonl_trace",
    "parse_jsonl_trace",
    "trace_lines",
]


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
        check_int("min_tokens", self.min_tokens, minimum=1)
        check_int("max_tokens", self.max_tokens, minimum=self.min_tokens)

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


def _split(tokens: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return np.split(tokens, np.cumsum(lengths)[:-1])


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
    check_int("num_requests", num_requests, minimum=1)
    check_vocab_size(vocab_size)
    rng = np.random.default_rng(seed)
    arrivals = _arrival_steps(rng, num_requests, arrival_rate_per_step)
    prompt_lens = prompt_lengths.sample(rng, num_requests)
    output_lens = output_lengths.sample(rng, num_requests)
    prompts = _split(random_token_ids(rng, prompt_lens.sum(), vocab_size), prompt_lens)
    outputs = _split(random_token_ids(rng, output_lens.sum(), vocab_size), output_lens)
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
    check_int("num_conversations", num_conversations, minimum=1)
    check_int("turns", turns, minimum=1)
    check_int("system_prompt_tokens", system_prompt_tokens, minimum=0)
    check_vocab_size(vocab_size)
    rng = np.random.default_rng(seed)
    arrivals = _arrival_steps(rng, num_conversations, arrival_rate_per_step)
    system_prompt = random_token_ids(rng, system_prompt_tokens, vocab_size)
    user_lens = user_message_lengths.sample(rng, num_conversations * turns)
    answer_lens = answer_lengths.sample(rng, num_conversations * turns)
    user_msgs = _split(random_token_ids(rng, user_lens.sum(), vocab_size), user_lens)
    answers = _split(random_token_ids(rng, answer_lens.sum(), vocab_size), answer_lens)

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
    check_int("num_requests", num_requests, minimum=1)
    check_int("min_prompt_tokens", min_prompt_tokens, minimum=1)
    check_int("max_prompt_tokens", max_prompt_tokens, minimum=min_prompt_tokens)
    check_int("max_context_tokens", max_context_tokens, minimum=output_lengths.max_tokens + 1)
    check_vocab_size(vocab_size)
    rng = np.random.default_rng(seed)
    arrivals = _arrival_steps(rng, num_requests, arrival_rate_per_step)
    log_lens = rng.uniform(math.log(min_prompt_tokens), math.log(max_prompt_tokens), num_requests)
    output_lens = output_lengths.sample(rng, num_requests)
    prompt_lens = np.clip(np.rint(np.exp(log_lens)), min_prompt_tokens, max_prompt_tokens)
    prompt_lens = np.minimum(prompt_lens, max_context_tokens - output_lens).astype(np.int64)
    prompts = _split(random_token_ids(rng, prompt_lens.sum(), vocab_size), prompt_lens)
    outputs = _split(random_token_ids(rng, output_lens.sum(), vocab_size), output_lens)
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


AGENT_PREFIX_LENGTHS = LengthDistribution(median_tokens=6_000, sigma=0.4, min_tokens=1_024, max_tokens=24_576)
AGENT_TASK_LENGTHS = LengthDistribution(median_tokens=256, sigma=0.7, min_tokens=16, max_tokens=4_096)
TOOL_CALL_LENGTHS = LengthDistribution(median_tokens=96, sigma=0.6, min_tokens=8, max_tokens=1_024)
TOOL_RESULT_LENGTHS = LengthDistribution(median_tokens=600, sigma=1.0, min_tokens=16, max_tokens=8_192)
BRANCH_MESSAGE_LENGTHS = LengthDistribution(median_tokens=128, sigma=0.6, min_tokens=8, max_tokens=2_048)
BRANCH_OUTPUT_LENGTHS = LengthDistribution(median_tokens=64, sigma=0.6, min_tokens=4, max_tokens=1_024)


@dataclass(frozen=True)
class AgenticShape:
    """Shape of :func:`agentic_workload`'s sessions (token counts are lognormal draws).

    ``steps``: tool-call turns per session, uniform in the range (both ends
    included). After each turn, with probability ``branch_probability``, the
    session forks ``branches`` (uniform, both ends included) one-shot
    requests off its context.
    """

    num_prefixes: int = 4
    steps: tuple[int, int] = (2, 8)
    branch_probability: float = 0.5
    branches: tuple[int, int] = (1, 4)
    prefix_lengths: LengthDistribution = AGENT_PREFIX_LENGTHS
    task_lengths: LengthDistribution = AGENT_TASK_LENGTHS
    tool_call_lengths: LengthDistribution = TOOL_CALL_LENGTHS
    tool_result_lengths: LengthDistribution = TOOL_RESULT_LENGTHS
    branch_message_lengths: LengthDistribution = BRANCH_MESSAGE_LENGTHS
    branch_output_lengths: LengthDistribution = BRANCH_OUTPUT_LENGTHS

    def __post_init__(self) -> None:
        check_int("num_prefixes", self.num_prefixes, minimum=1)
        for name in ("steps", "branches"):
            low, high = getattr(self, name)
            check_int(f"{name}[0]", low, minimum=1)
            check_int(f"{name}[1]", high, minimum=low)
        p = self.branch_probability
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(f"branch_probability must be a number in [0, 1], got {p!r}")


def _agent_session(rng, index, prefix, arrival, shape, vocab_size) -> list[list[Request]]:
    """One session's requests per round: round ``k`` holds tool-call turn ``k``
    and the branches forked off the context that turn ``k`` reads."""
    session_id = f"agent{index:05d}"
    steps = int(rng.integers(shape.steps[0], shape.steps[1] + 1))
    context = prefix
    previous_id: str | None = None
    rounds: list[list[Request]] = []
    for step in range(steps):
        lengths = shape.task_lengths if step == 0 else shape.tool_result_lengths
        message = random_token_ids(rng, int(lengths.sample(rng, 1)[0]), vocab_size)
        call_tokens = int(shape.tool_call_lengths.sample(rng, 1)[0])
        prompt = np.concatenate([context, message])
        turn = Request(
            request_id=f"{session_id}-step{step}", arrival_step=arrival, prompt_token_ids=prompt,
            output_tokens=call_tokens, output_token_ids=random_token_ids(rng, call_tokens, vocab_size),
            conversation_id=session_id, turn=step, after_request_id=previous_id,
        )
        this_round = [turn]
        if rng.random() < shape.branch_probability:
            count = int(rng.integers(shape.branches[0], shape.branches[1] + 1))
            for b in range(count):
                ask = random_token_ids(rng, int(shape.branch_message_lengths.sample(rng, 1)[0]), vocab_size)
                out_tokens = int(shape.branch_output_lengths.sample(rng, 1)[0])
                this_round.append(Request(
                    request_id=f"{session_id}-step{step}-branch{b}", arrival_step=arrival,
                    prompt_token_ids=np.concatenate([context, ask]), output_tokens=out_tokens,
                    output_token_ids=random_token_ids(rng, out_tokens, vocab_size),
                    conversation_id=session_id, turn=step, after_request_id=previous_id,
                ))
        rounds.append(this_round)
        context = np.concatenate([prompt, turn.output_token_ids])
        previous_id = turn.request_id
    return rounds


def agentic_workload(
    num_sessions: int = 64,
    *,
    seed: int = 0,
    shape: AgenticShape = AgenticShape(),
    arrival_rate_per_step: float | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> list[Request]:
    """Agent sessions over a few long shared tool/system prefixes.

    Each session takes one of ``shape.num_prefixes`` shared prefixes (tool
    definitions and system prompt), adds a task message and runs tool-call
    turns: turn ``k``'s output is a short tool call, and turn ``k+1``'s prompt
    is turn ``k``'s prompt, its call and the tool's result (it waits for turn
    ``k``). Off the context a turn reads, a session sometimes forks short
    one-shot branches (a sub-question, a retry) that nobody continues; a
    branch waits for the turn before it, as that turn does. Requests come
    round-major (every session's round 0, then every round 1, ...), a round
    being a turn followed by its branches; sessions arrive per
    ``arrival_rate_per_step`` (all at step 0 by default) and their later
    requests carry that step.
    """
    check_int("num_sessions", num_sessions, minimum=1)
    check_vocab_size(vocab_size)
    if not isinstance(shape, AgenticShape):
        raise ValueError(f"shape must be an AgenticShape, got {type(shape).__name__}")
    rng = np.random.default_rng(seed)
    arrivals = _arrival_steps(rng, num_sessions, arrival_rate_per_step)
    prefix_lens = shape.prefix_lengths.sample(rng, shape.num_prefixes)
    prefixes = [random_token_ids(rng, int(n), vocab_size) for n in prefix_lens]
    choice = rng.integers(0, shape.num_prefixes, size=num_sessions)
    sessions = [
        _agent_session(rng, i, prefixes[int(choice[i])], int(arrivals[i]), shape, vocab_size)
        for i in range(num_sessions)
    ]
    rounds = max(len(s) for s in sessions)
    return [r for k in range(rounds) for s in sessions if k < len(s) for r in s[k]]



def in_waves(requests: list[Request], conversations_per_wave: int) -> list[Request]:
    """``requests`` reordered so that at most ``conversations_per_wave`` conversations
    interleave: conversations (by ``conversation_id``; a request without one is a
    conversation of its own) are taken in order of first appearance, in waves of
    that many, and each wave keeps the list's relative order. Dispatch order holds
    (a request waits only for one of its own conversation)."""
    check_int("conversations_per_wave", conversations_per_wave, minimum=1)
    wave_of: dict[str, int] = {}
    waves: list[list[Request]] = []
    for request in requests:
        conversation = request.conversation_id or f"\0{request.request_id}"
        if conversation not in wave_of:
            wave_of[conversation] = len(wave_of) // conversations_per_wave
            if wave_of[conversation] == len(waves):
                waves.append([])
        waves[wave_of[conversation]].append(request)
    return [request for wave in waves for request in wave]


WORKLOAD_NAMES = ("chat", "multiturn", "longctx", "agentic")


def build_workload(
    name_or_path: str,
    *,
    num_requests: int | None = None,
    seed: int = 0,
    max_request_tokens: int | None = None,
) -> list[Request]:
    """``chat``, ``multiturn``, ``longctx``, ``agentic`` on their defaults, or a JSONL trace path.

    ``num_requests`` overrides the request count; for ``multiturn`` it is the
    total over all turns (``ceil(n / 4)`` conversations of 4 turns, cut to
    ``n`` in turn-major order). A trace is cut to its first ``n`` requests, and
    any of its requests longer than ``max_request_tokens`` is refused while the
    file is read. For ``agentic`` it is the total too: ``ceil(n / 2)`` sessions
    (a session has at least 2 requests, so that is always enough), cut to ``n``
    in round-major order.
    """
    if num_requests is not None:
        check_int("num_requests", num_requests, minimum=1)
    if name_or_path in WORKLOAD_NAMES:
        return _named_workload(name_or_path, num_requests, seed)
    path = Path(name_or_path)
    try:
        readable = path.exists() and not path.is_dir()
    except OSError:  # e.g. a name longer than the system allows
        readable = False
    if not readable:
        shown = name_or_path if len(name_or_path) <= 60 else name_or_path[:57] + "..."
        raise ValueError(
            f"workload must be one of {', '.join(WORKLOAD_NAMES)} or a JSONL trace file, got {shown!r}"
        )
    limits = {} if max_request_tokens is None else {"max_request_tokens": max_request_tokens}
    requests = load_jsonl_trace(path, seed=seed, **limits)
    return requests if num_requests is None else requests[:num_requests]


def _named_workload(name: str, num_requests: int | None, seed: int) -> list[Request]:
    """``build_workload`` of one of ``WORKLOAD_NAMES``."""
    if name == "chat":
        return chat_workload(num_requests or 256, seed=seed)
    if name == "longctx":
        return longctx_workload(num_requests or 8, seed=seed)
    if name == "multiturn":
        if num_requests is None:
            return multiturn_workload(seed=seed)
        turns = 4
        return multiturn_workload(-(-num_requests // turns), turns, seed=seed)[:num_requests]
    if num_requests is None:
        return agentic_workload(seed=seed)
    # A session has at least 2 requests, so ceil(n / 2) sessions are always enough.
    return agentic_workload(-(-num_requests // 2), seed=seed)[:num_requests]


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
    check_int("grain_tokens", grain_tokens, minimum=1)
    cached: list[np.ndarray] = []
    hits = np.zeros(len(requests), dtype=np.int64)
    for index, request in enumerate(requests):
        prompt = request.prompt_token_ids
        best = max((_common_prefix_tokens(prompt, seq) for seq in cached), default=0)
        best = min(best, prompt.size - 1)
        hits[index] = best - best % grain_tokens
        cached.append(np.concatenate([prompt, request.output_token_ids[:-1]]))
    return hits
