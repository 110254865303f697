"""``hybridkv verify``: prove the cache end to end and say PASS or FAIL.

Default: the reference DeepSeek-V4 attention, paged (manager + codec pools) vs
dense, over the scripted and pressure scenarios (plus ``--scenarios N`` random
ones). ``--against transformers``: Hugging Face's own DeepseekV4 model on
hybridkv's pages vs on its own cache (needs the ``[hf]`` extra). Progress goes
to stderr, the verdict to stdout; exit 1 on FAIL.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from hybridkv.cli import args as a
from hybridkv.reference.scenario import FAULTS, TOLERANCE

EXIT_FAIL = 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="prove the cache end to end: attention through pages vs dense (or vs transformers)",
        description=(
            "Run a DeepSeek-V4 attention stack (layer ratios 0, 4, 128, 4) twice: densely over whole "
            "sequences, and through the cache manager's block tables, write slots and byte-codec pages "
            "(chunked prefill, decode on the benchmarked schedule_uniform path, verify + rewind, prefix "
            "hits, evictions under a small budget, shuffled pools), comparing every output and the cache "
            "rows themselves. With --against transformers, run Hugging Face's DeepseekV4 model on "
            "hybridkv's pages against its own cache instead. Prints each check and PASS or FAIL (exit 1)."
        ),
    )
    parser.add_argument("--seed", type=a.number("--seed", minimum=0, maximum=a.MAX_SEED), default=0,
                        help="weights and token seed (default 0)")
    parser.add_argument("--scenarios", type=a.number("--scenarios", minimum=0), default=0,
                        help="random pressure scenarios to add (seeds SEED+1..; default 0)")
    parser.add_argument("--against", choices=("reference", "transformers"), default="reference",
                        help="what the paged path is compared with (default: the dense reference)")
    parser.add_argument(
        "--inject-fault",
        choices=FAULTS,
        default=None,
        help="flip one bit of one cached page mid-run of the scripted scenario, to see the check fail",
    )
    parser.add_argument(
        "--tier", choices=("host", "disk", "mooncake"), default=None,
        help="instead: instance A offloads a prompt to this tier, instance B (another manager; another "
             "process for disk and mooncake) hits it from there; B's outputs vs dense, and the faults",
    )
    parser.set_defaults(run=run)


def _progress(message: str) -> None:
    print(f"hybridkv verify: {message}", file=sys.stderr, flush=True)


def run(args: Any) -> int:
    if args.tier is not None:
        if args.inject_fault is not None or args.scenarios or args.against != "reference":
            raise ValueError("--tier does not combine with --inject-fault, --scenarios or --against")
        return _run_tier(args)
    if args.against == "transformers":
        if args.inject_fault is not None or args.scenarios:
            raise ValueError("--inject-fault and --scenarios apply to --against reference only")
        return _run_transformers(args)
    from hybridkv.reference.suite import geometry_label, run_verify_suite

    started = time.perf_counter()
    try:
        results = run_verify_suite(args.seed, args.scenarios, fault=args.inject_fault, progress=_progress)
    except Exception as exc:  # the cache under test broke the run: that is a FAIL, not bad input
        return _crashed(exc)
    seconds = time.perf_counter() - started
    print("hybridkv verify: DeepSeek-V4 reference attention, paged (manager + codec pools) vs dense, "
          f"seed {args.seed}")
    passed = True
    for title, config, report in results:
        print(f"{title}: {geometry_label(config)}")
        _print_checks(report.checks)
        for note in report.notes:
            print(f"  note: {note}")
        passed &= report.passed
    worst = max(r.max_abs_error for _, _, r in results)
    print(f"max abs error {worst:.3e} (tolerance {TOLERANCE:.0e}); {seconds:.1f} s")
    print("PASS" if passed else "FAIL")
    return 0 if passed else EXIT_FAIL


def _crashed(exc: Exception) -> int:
    """A scenario raised (a read of a page the table does not hold, a refused step, ...)."""
    message = " ".join(str(exc).split())
    print(f"hybridkv verify: the run stopped: {type(exc).__name__}: {message}")
    print("FAIL")
    return EXIT_FAIL


def _print_checks(checks, *, details: bool = False) -> None:
    width = max(len(c.name) for c in checks)
    for c in checks:
        verdict = "PASS" if c.passed else "FAIL"
        if c.tokens and c.name.startswith("cache rows"):
            what = f"{c.tokens:6d} rows    max |err| {c.max_abs_error:.2e}  {c.detail}"
        elif c.tokens:
            what = f"{c.tokens:6d} tokens  max |err| {c.max_abs_error:.2e}  top-k mismatches {c.topk_mismatches}"
            what += f"  ({c.detail})" if details and c.detail else ""
        else:
            what = c.detail
        print(f"  {verdict}  {c.name:<{width}}  {what}")


def _run_transformers(args: Any) -> int:
    try:
        from hybridkv.integrations.transformers.check import run_transformers_check
    except ImportError as exc:
        raise ValueError(
            f"--against transformers needs the [hf] extra (torch, transformers): pip install 'hybridkv[hf]' ({exc})"
        ) from None
    started = time.perf_counter()
    try:
        report = run_transformers_check(seed=args.seed, progress=_progress)
    except Exception as exc:
        return _crashed(exc)
    seconds = time.perf_counter() - started
    print("hybridkv verify --against transformers: Hugging Face DeepseekV4ForCausalLM on hybridkv pages vs "
          f"on its own cache, seed {args.seed}")
    print(f"model: {report.model_label}")
    _print_checks(report.checks)
    for note in report.notes:
        print(f"  note: {note}")
    print(f"max abs logit error {report.max_abs_error:.3e} (tolerance {report.tolerance:.0e}); {seconds:.1f} s")
    print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else EXIT_FAIL


def _run_tier(args: Any) -> int:
    from hybridkv.reference.tier_check import run_tier_check
    from hybridkv.tiers import TierUnavailable

    started = time.perf_counter()
    try:
        report = run_tier_check(args.tier, args.seed, progress=_progress)
    except TierUnavailable as exc:  # the tier's package or master is missing: say what to install
        raise ValueError(str(exc)) from None
    except Exception as exc:
        return _crashed(exc)
    seconds = time.perf_counter() - started
    print(f"hybridkv verify --tier {args.tier}: a prefix offloaded by instance A, hit from the tier by "
          f"instance B, B's outputs vs the dense reference, seed {args.seed}")
    _print_checks(report.checks, details=True)
    for note in report.notes:
        print(f"  note: {note}")
    print(f"max abs error {report.max_abs_error:.3e} (tolerance {report.tolerance:.0e}); {seconds:.1f} s")
    print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else EXIT_FAIL
