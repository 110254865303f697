"""``hybridkv verify``: run the reference DeepSeek-V4 attention paged vs dense and say PASS or FAIL."""

from __future__ import annotations

import time
from typing import Any

from hybridkv.reference.config import ReferenceConfig
from hybridkv.reference.scenario import FAULTS, TOLERANCE, run_verify_scenario

EXIT_FAIL = 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="prove the cache end to end: reference attention through pages vs dense",
        description=(
            "Run a small DeepSeek-V4 attention stack (layer ratios 0, 4, 128, 4) twice: densely "
            "over whole sequences, and through the cache manager's block tables, write slots and "
            "byte-codec pages (chunked prefill, decode, verify + rewind, prefix hits, shuffled "
            "pools). Prints each check, the largest difference and PASS or FAIL (exit 1)."
        ),
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and token seed (default 0)")
    parser.add_argument(
        "--inject-fault",
        choices=FAULTS,
        default=None,
        help="flip one bit of one cached page mid-run, to see the check fail",
    )
    parser.set_defaults(run=run)


def run(args: Any) -> int:
    config = ReferenceConfig()
    started = time.perf_counter()
    report = run_verify_scenario(args.seed, fault=args.inject_fault)
    seconds = time.perf_counter() - started
    print(
        f"hybridkv verify: DeepSeek-V4 reference attention, paged (manager + codec pools) vs dense\n"
        f"model: hidden {config.hidden_size}, {config.num_heads} heads x {config.head_dim} "
        f"(rope {config.rope_dim}), window {config.window_tokens}, layer ratios "
        f"{list(config.layer_ratios)}, index top-k {config.index_topk}, seed {args.seed}"
    )
    width = max(len(c.name) for c in report.checks)
    for c in report.checks:
        verdict = "PASS" if c.passed else "FAIL"
        if c.tokens:
            what = f"{c.tokens:5d} tokens  max |err| {c.max_abs_error:.2e}  top-k mismatches {c.topk_mismatches}"
        else:
            what = c.detail
        print(f"  {verdict}  {c.name:<{width}}  {what}")
    for note in report.notes:
        print(f"  note: {note}")
    print(f"max abs error {report.max_abs_error:.3e} (tolerance {TOLERANCE:.0e}); {seconds:.1f} s")
    print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else EXIT_FAIL
