"""``hybridkv plan``: how a KV memory budget splits over a model's cache groups,
the memory ``N`` requests at context ``L`` need (``--requests``), and what vLLM
reports for the same budget (``--compare vllm``).

Heavy modules (rich, the planner) are imported inside :func:`run`, so that
``hybridkv --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hybridkv.cli import args as a

BUNDLED_MODELS: tuple[str, ...] = ("deepseek-v4-flash", "deepseek-v4-pro")  # = models.layout's
INDEXER_FORMATS: tuple[str, ...] = ("mxfp4", "fp8")
DEFAULT_CONTEXT_TOKENS = 128 * 1024
DEFAULT_MAX_RUNNING = 128
ENGINES = ("vllm",)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="split a KV memory budget over a model's cache groups",
        description=(
            "Plan the paged KV cache of a DeepSeek-V4 model for one GPU: pages per cache group, "
            "token capacity, bytes per token and the requests at a context length that fit at "
            "once. With --requests N: the memory N requests at --context-len need, per group, in "
            "both page spaces. With --compare vllm: what vLLM 0.33 allocates and logs for the "
            "same budget. Sizes: 40GiB, 512MiB, 1.5GiB (powers of 1024), 40GB (powers of 1000). "
            "Tokens: 128k = 131072, 1M = 1048576. Counts: 1k = 1000."
        ),
    )
    add_plan_arguments(parser)
    parser.add_argument(
        "--requests", type=a.number("--requests", maximum=a.MAX_RUNNING_REQUESTS), default=None,
        metavar="N", help="print the KV memory N requests at --context-len need (the inverse plan)",
    )
    parser.add_argument(
        "--compare", choices=ENGINES, default=None,
        help="also show what vLLM 0.33 allocates and logs for this budget (FP8 indexer, as vLLM)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (docs/planning.md)")
    parser.set_defaults(run=run)


def add_plan_arguments(parser: argparse.ArgumentParser, *, context_len: bool = True) -> None:
    """The model and limit options shared by ``plan`` and ``simulate`` (``--context-len``: ``plan``'s alone)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model", type=a.nonempty("--model"), default=None, metavar="NAME",
        help=f"bundled model: {', '.join(BUNDLED_MODELS)} (default {BUNDLED_MODELS[0]})",
    )
    source.add_argument(
        "--config", type=a.nonempty("--config"), metavar="PATH",
        help="a Hugging Face config.json (or its folder)",
    )
    parser.add_argument(
        "--kv-memory", type=a.number("--kv-memory", "bytes", maximum=a.MAX_KV_MEMORY_BYTES),
        default=40 * 2**30, metavar="SIZE", help="KV cache memory of one GPU (default 40GiB)",
    )
    parser.add_argument(
        "--max-running", type=a.number("--max-running", maximum=a.MAX_RUNNING_REQUESTS),
        default=None, metavar="N",
        help=f"max running requests (default {DEFAULT_MAX_RUNNING}; with plan --requests N: N)",
    )
    parser.add_argument(
        "--chunk-tokens", type=a.number("--chunk-tokens", "tokens", maximum=a.MAX_CHUNK_TOKENS),
        default=8192, metavar="TOKENS", help="max tokens scheduled per step (default 8192)",
    )
    parser.add_argument(
        "--max-context", type=a.number("--max-context", "tokens", maximum=a.MAX_CONTEXT_TOKENS),
        default=None, metavar="TOKENS",
        help="max context per request (default and upper bound: the model's max_position_embeddings)",
    )
    if context_len:
        parser.add_argument(
            "--context-len", type=a.number("--context-len", "tokens", maximum=a.MAX_CONTEXT_TOKENS),
            default=None, metavar="TOKENS",
            help="context length of the requests counted (default 128k, or the max context if smaller)",
        )
    parser.add_argument(
        "--indexer", choices=INDEXER_FORMATS, default=None,
        help="indexer key format (default mxfp4; fp8 with --compare vllm, as vLLM caches it)",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=a.number("--speculative-tokens", maximum=a.MAX_SPECULATIVE_TOKENS),
        default=1, metavar="K", help="tokens verified per decode step (default 1)",
    )
    parser.add_argument("--include-mtp", action="store_true", help="also cache the MTP layer(s)")
    parser.add_argument(
        "--page-space", choices=("shared", "per-group"), default="shared",
        help="shared: one arena the groups borrow slabs from, so idle window and state pages "
        "stay cached for prefix hits; per-group: one pool per cache group, sized by the limits "
        "(docs/planning.md); default shared",
    )


def build_layout(args: argparse.Namespace):
    from hybridkv.models.layout import cache_layout

    if args.config is not None:
        source = args.config
    else:
        source = args.model or BUNDLED_MODELS[0]
        if source not in BUNDLED_MODELS:
            raise ValueError(
                f"--model: unknown model {source!r}: bundled models are {', '.join(BUNDLED_MODELS)} "
                "(use --config PATH for a config.json)"
            )
    if args.indexer is None:
        args.indexer = "fp8" if getattr(args, "compare", None) == "vllm" else "mxfp4"
    return cache_layout(
        source,
        indexer=args.indexer,
        include_mtp=args.include_mtp,
        speculative_tokens=args.speculative_tokens,
    )


def resolve_limits(args: argparse.Namespace, layout, *, running_default: int = DEFAULT_MAX_RUNNING):
    """The plan's :class:`Limits` from the flags; fills ``args.context_len``."""
    from hybridkv.plan import Limits

    model_max = layout.max_position_embeddings
    if args.max_context is not None and model_max is not None and args.max_context > model_max:
        raise ValueError(
            f"--max-context {args.max_context:,} exceeds the model's max_position_embeddings "
            f"{model_max:,}"
        )
    max_context = args.max_context or model_max
    if max_context is None:
        raise ValueError("the config has no max_position_embeddings: pass --max-context")
    if getattr(args, "context_len", None) is None:  # simulate has no --context-len
        args.context_len = min(DEFAULT_CONTEXT_TOKENS, max_context)
    if args.context_len > max_context:
        raise ValueError(f"--context-len {args.context_len:,} exceeds the max context {max_context:,}")
    return Limits(
        max_running_requests=args.max_running or running_default,
        max_scheduled_tokens=args.chunk_tokens,
        max_context_tokens=max_context,
        speculative_tokens=args.speculative_tokens,
    )


def build_plan(args: argparse.Namespace):
    from hybridkv.plan import plan_for_budget

    layout = build_layout(args)
    limits = resolve_limits(args, layout)
    try:
        return plan_for_budget(layout, args.kv_memory, limits, page_space=args.page_space)
    except ValueError as exc:
        raise ValueError(a.flag_names(str(exc))) from None


def shared_report(plan, context_tokens: int) -> dict[str, Any]:
    """The shared-arena section of a plan report."""
    from hybridkv.memory.geometry import shared_arena_for, shared_concurrency

    geometry = shared_arena_for(plan)
    return {
        "per_group_pools_fit": plan.fits_per_group,
        "total_bytes": geometry.total_bytes,
        "reserved_bytes": geometry.reserved_bytes,
        "slab_bytes": geometry.slab_bytes,
        "num_slabs": geometry.num_slabs,
        "context_tokens": int(context_tokens),
        "max_requests": shared_concurrency(plan, context_tokens, geometry),
    }


def _check_combination(args: argparse.Namespace) -> None:
    if args.requests is not None and args.compare is not None:
        raise ValueError("--requests and --compare answer different questions: give one of them")
    if args.requests is not None and args.max_running is not None and args.requests > args.max_running:
        raise ValueError(
            f"--requests {args.requests:,} exceeds --max-running {args.max_running:,}: "
            "the requests must all run at once"
        )
    if args.compare == "vllm" and args.indexer == "mxfp4":
        raise ValueError("--compare vllm: vLLM 0.33 caches V4's indexer keys in FP8: drop --indexer mxfp4")
    if args.compare == "vllm" and args.include_mtp:
        raise ValueError("--compare vllm plans the main layers only, as vLLM without a draft: drop --include-mtp")


def _emit_json(report: dict[str, Any]) -> None:
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")


def run(args: argparse.Namespace) -> int:
    _check_combination(args)
    from hybridkv.cli import plan_render as render

    if args.requests is not None:
        return _run_inverse(args, render)
    if args.compare == "vllm":
        return _run_compare(args, render)
    plan = build_plan(args)
    shared = shared_report(plan, args.context_len) if args.page_space == "shared" else None
    if args.json:
        report = plan.report(args.context_len)
        if shared is not None:
            report["shared_arena"] = shared
        _emit_json(report)
    else:
        render.render(plan, args.context_len, sys.stdout, shared)
    return 0


def _run_inverse(args: argparse.Namespace, render) -> int:
    from hybridkv.sizing import memory_for_requests

    layout = build_layout(args)
    limits = resolve_limits(args, layout, running_default=args.requests)
    need = memory_for_requests(
        layout, limits, args.requests, args.context_len, max_total_bytes=a.MAX_KV_MEMORY_BYTES
    )
    if args.json:
        report = need.per_group_plan.report(args.context_len)
        report["requests_memory"] = need.report()
        _emit_json(report)
    else:
        render.render_inverse(need, sys.stdout)
    return 0


def _run_compare(args: argparse.Namespace, render) -> int:
    from hybridkv.compare_vllm import compare_with_vllm

    layout = build_layout(args)
    limits = resolve_limits(args, layout)
    comparison = compare_with_vllm(layout, limits, args.kv_memory, args.context_len, page_space=args.page_space)
    if args.json:
        _emit_json(comparison.report())
    else:
        render.render_compare(comparison, sys.stdout)
    return 0
