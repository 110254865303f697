"""The fixed verification script: the paged stack under a real manager vs dense.

:func:`run_verify_scenario` is the scripted scenario behind ``hybridkv verify``
(see ``docs/reference.md``); the engine loop and the comparison live in
:mod:`hybridkv.reference.runner`.
"""

from __future__ import annotations

import numpy as np

from hybridkv.models.deepseek_v4 import v4_compressed_kv_group_id, v4_compressor_state_group_id
from hybridkv.reference.config import ReferenceConfig
from hybridkv.reference.runner import (  # noqa: F401  (re-exported)
    TOLERANCE,
    CheckResult,
    ScenarioRunner,
    VerifyReport,
    build_runner,
)

FAULTS = ("kv-byte", "state-byte")


def corrupt_byte(runner: ScenarioRunner, fault: str, request_id: str) -> str:
    """Flip one bit of one cached row of ``request_id``; says which."""
    mgr, stack = runner.manager, runner.stack
    if fault == "kv-byte":
        layer = runner.model.config.layer_ratios.index(128)
        gid = v4_compressed_kv_group_id(128)
        _, pages = mgr.request_pages(request_id, gid)
        pool = stack.pools[layer].entries
        pool[int(pages[0]), 0] ^= 0x01  # e4m3 mantissa LSB of entry 0's first nope value
        return f"layer {layer} HCA compressed entry 0 (page {int(pages[0])}), byte 0"
    if fault == "state-byte":
        layer = runner.model.config.layer_ratios.index(128)
        gid = v4_compressor_state_group_id(128)
        spec = next(s for s in mgr.specs if s.group_id == gid)
        position = mgr.num_computed_tokens(request_id) - 1
        if (position + 1) % 128 == 0:  # that window is closed already: take a token of an open one
            position -= 1
        base, pages = mgr.request_pages(request_id, gid)
        page = int(pages[position // spec.rows_per_page - base])
        row_bytes = stack.pools[layer].state.shape[1] // spec.rows_per_page
        # the top byte of gate channel 0 (Z starts half way): exponent bit 1 -> gate x4 or /4.
        # A small change to one of 128 pooled slots could vanish in the FP8 rounding.
        offset = (position % spec.rows_per_page) * row_bytes + row_bytes // 2 + 3
        stack.pools[layer].state[page, offset] ^= 0x01
        return f"layer {layer} HCA compressor gate of position {position} (page {page}, byte {offset})"
    raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")



def _step_items(plans: dict, manager, hit_tags: dict, after_verify: set) -> tuple[list, dict, list]:
    """The next action of every request's plan: the step's items, each request's tags,
    and the requests that verify (their rejected tokens rewind after the step)."""
    items, tags, verifies = [], {}, []
    for rid, plan in plans.items():
        if not plan or not manager.has_request(rid):
            continue
        action = plan.pop(0)
        req_tags = {hit_tags[rid]} if rid in hit_tags else set()
        if action == "verify":
            items.append((rid, 3))
            verifies.append(rid)
            req_tags.add("verify 3, accept 1, continue")
        elif isinstance(action, str):
            items.append((rid, int(action.split(":")[1])))
            req_tags.add("chunked prefill")
        else:
            items.append((rid, action))
            req_tags.add("decode")
            if rid in after_verify:
                req_tags.add("verify 3, accept 1, continue")
        tags[rid] = req_tags
    return items, tags, verifies


def _scenario_checks(runner: ScenarioRunner, hits: dict[str, int]) -> list[CheckResult]:
    """What the scenario must have exercised: both hits, HCA and CSA reads, windows closed by
    rejected tokens, non-contiguous tables, and every path."""
    checks = [CheckResult(
        "prefix hits at 256 and 512", hits == {"d": 512, "e": 256}, detail=f"hit tokens {hits}")]
    checks.append(CheckResult(
        "HCA reads >= 3 entries", runner.max_hca_entries_read >= 3,
        detail=f"up to {runner.max_hca_entries_read} entries"))
    topk = runner.model.config.index_topk
    checks.append(CheckResult(
        f"CSA indexer selects {topk} of > {4 * topk} visible entries", runner.csa_selecting_queries > 0,
        detail=f"{runner.csa_selecting_queries} queries, up to {runner.max_csa_entries_visible} entries visible"))
    closes = runner.rejected_window_closes
    checks.append(CheckResult(
        "rejected draft tokens closed CSA and HCA windows", closes.get(4, 0) > 0 and closes.get(128, 0) > 0,
        detail=f"windows closed by a rejected token, by ratio: {dict(sorted(closes.items()))}"))
    checks.append(CheckResult(
        "shuffled pools give non-contiguous tables", runner.noncontiguous_steps > 0,
        detail=f"{runner.noncontiguous_steps} of {runner.steps} steps"))
    checks.extend(path_checks(runner))
    return checks


def run_step(runner: ScenarioRunner, items: list[tuple[str, int]], tags: dict, step: int) -> None:
    """One step: a step in which every request gets the same count takes the benchmarked
    path (``schedule_uniform``, table updates through the mirror, fixed widths; on odd
    steps the write slots are computed from the mirrored tables); any other step the
    general path (fixed widths on even steps when every count is a decode or verify count)."""
    counts = {count for _, count in items}
    small = max(counts) <= 4  # decode / verify counts: within the capture widths
    if len(counts) == 1 and small:
        runner.step_uniform([rid for rid, _ in items], items[0][1], tags, write_slots=step % 2 == 0)
    else:
        runner.step(items, tags, fixed_width=small and step % 2 == 0)
    if step % 8 == 0:
        for rid, _ in items:
            runner.snapshot(rid)


def path_checks(runner: ScenarioRunner) -> list[CheckResult]:
    """Coverage: the benchmarked decode path and the general path both ran."""
    return [CheckResult(
        "benchmarked decode path ran (schedule_uniform, table updates, mirror, fixed widths)",
        runner.uniform_steps > 0 and runner.computed_write_slot_steps > 0 and runner.steps > runner.uniform_steps,
        detail=f"{runner.uniform_steps} of {runner.steps} steps ({runner.computed_write_slot_steps} with write "
               f"slots from the mirrored tables), {runner.fixed_width_steps} at fixed widths",
    )]


def run_verify_scenario(
    seed: int = 0, *, fault: str | None = None, tolerance: float = TOLERANCE, config: ReferenceConfig | None = None,
    progress=None,
) -> VerifyReport:
    """The fixed scenario: 5 requests, one shuffled prefix-caching manager, stack [0, 4, 128, 4].

    * ``a``: 517-token one-shot prefill; verify 3 / accept 1 four times (a rejected token
      closes a CSA window); decode to 637; two more verify cycles (a rejected token closes
      HCA window 4); decode on.
    * ``b``: 600-token prefill in chunks 1, 37, 218, 45, 130, 169 (mid-window boundaries).
    * ``c``: 151-token prefill then 330 decode steps (crosses 4- and 128-token boundaries).
    * ``d``: ``b``'s first 512 tokens + 40 new: prefix hit 512, continue.
    * ``e``: ``b``'s first 256 tokens + 150 new: prefix hit 256, continue.

    ``fault`` flips one cached bit mid-run (the report must then FAIL).
    """
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    runner = build_runner(config, seed=seed)
    prompts = _scripted_prompts(np.random.default_rng(seed), runner.model.config.vocab_size)
    for rid in ("a", "b", "c"):
        runner.add(rid, prompts[rid], max_new_tokens=400)
    runner.step([("a", 517), ("b", 1), ("c", 151)],
                {"a": {"one-shot prefill"}, "b": {"chunked prefill"}, "c": {"one-shot prefill"}})
    hits: dict[str, int] = {}
    faulted = _run_plans(runner, prompts, hits, fault, progress)
    if progress is not None:
        progress("scripted: comparing with dense")
    checks = runner.compare(tolerance)
    checks.extend(_scenario_checks(runner, hits))
    notes = (f"fault injected after step 150: {faulted}",) if faulted else ()
    return VerifyReport(tuple(checks), tolerance, notes)


def _scripted_prompts(rng: np.random.Generator, vocab: int) -> dict[str, np.ndarray]:
    """The five prompts: ``d`` and ``e`` share ``b``'s first 512 and 256 tokens."""
    prompts = {"a": rng.integers(0, vocab, 517), "b": rng.integers(0, vocab, 600),
               "c": rng.integers(0, vocab, 151)}
    prompts["d"] = np.concatenate([prompts["b"][:512], rng.integers(0, vocab, 40)])
    prompts["e"] = np.concatenate([prompts["b"][:256], rng.integers(0, vocab, 150)])
    return prompts


def _run_plans(runner: ScenarioRunner, prompts: dict[str, np.ndarray], hits: dict[str, int], fault: str | None,
               progress) -> str:
    """The scenario's 330 steps after the first: each request follows its plan (``d`` and
    ``e`` join at step 8, their hits to ``hits``; ``b`` is freed at step 40); with a
    ``fault``, one cached bit flips after step 150 (what was flipped is returned)."""
    plans = {
        "a": ["verify"] * 4 + [1] * (637 - 521) + ["verify"] * 2 + [1] * 10,
        "b": ["chunk:37", "chunk:218", "chunk:45", "chunk:130", "chunk:169"] + [1] * 34,
        "c": [1] * 330,
        "d": ["chunk:17", "chunk:23"] + [1] * 30,
        "e": ["chunk:150"] + [1] * 20 + ["verify"] * 2 + [1] * 5,
    }
    hit_tags = {"d": "prefix hit 512", "e": "prefix hit 256"}
    faulted = ""
    after_verify: set[str] = set()
    for step in range(330):
        if step == 8:
            for rid in ("d", "e"):
                hits[rid] = runner.add(rid, prompts[rid], max_new_tokens=64).hit_tokens
        items, tags, verifies = _step_items(plans, runner.manager, hit_tags, after_verify)
        run_step(runner, items, tags, step)
        after_verify = set(verifies)
        for rid in verifies:
            runner.rewind(rid, runner.manager.num_computed_tokens(rid) - 2)
            runner.snapshot(rid, "after rewind")
        if step == 40:
            runner.free("b")
        if progress is not None and step % 110 == 109:
            progress(f"scripted: step {step + 1}/330, {runner.manager.num_requests} requests running")
        if fault is not None and step == 150:
            faulted = corrupt_byte(runner, fault, "c")
    return faulted
