"""``hybridkv plan``: how a KV memory budget splits over a model's cache groups."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from hybridkv.arena import shared_arena_for, shared_concurrency
from hybridkv.models.layout import BUNDLED_MODELS, INDEXER_FORMATS, cache_layout
from hybridkv.plan import Limits, Plan, plan_for_budget
from hybridkv.units import format_bytes, format_tokens, parse_bytes, parse_tokens

MAX_WIDTH_COLUMNS = 100
DEFAULT_CONTEXT_TOKENS = 128 * 1024


def _argument_type(parse, what: str):
    def convert(text: str) -> int:
        try:
            value = parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {text!r}")
        return value

    return convert


def _count(text: str) -> int:
    cleaned = text.strip().replace("_", "").replace(",", "")
    if not cleaned.isdigit():
        raise ValueError(f"expected a whole number, got {text!r}")
    return int(cleaned)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="split a KV memory budget over a model's cache groups",
        description=(
            "Plan the paged KV cache of a DeepSeek-V4 model: pages per cache group, token "
            "capacity, bytes per token and concurrent requests at a context length. "
            "Sizes: 40GiB, 512MiB, 1.5GiB (powers of 1024), 40GB (powers of 1000). "
            "Tokens: 128k = 131072, 1M = 1048576."
        ),
    )
    add_plan_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (docs/planning.md)")
    parser.set_defaults(run=run)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and limit options shared by ``plan`` and ``simulate``."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help=f"bundled model: {', '.join(BUNDLED_MODELS)} (default {BUNDLED_MODELS[0]})",
    )
    source.add_argument("--config", metavar="PATH", help="a Hugging Face config.json (or its folder)")
    parser.add_argument(
        "--kv-memory", type=_argument_type(parse_bytes, "--kv-memory"), default="40GiB",
        metavar="SIZE", help="KV cache memory budget (default 40GiB)",
    )
    parser.add_argument(
        "--max-running", type=_argument_type(_count, "--max-running"), default=128,
        metavar="N", help="max running requests (default 128)",
    )
    parser.add_argument(
        "--chunk-tokens", type=_argument_type(parse_tokens, "--chunk-tokens"), default=8192,
        metavar="TOKENS", help="max tokens scheduled per step (default 8192)",
    )
    parser.add_argument(
        "--max-context", type=_argument_type(parse_tokens, "--max-context"), default=None,
        metavar="TOKENS", help="max context per request (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--context-len", type=_argument_type(parse_tokens, "--context-len"), default=None,
        metavar="TOKENS",
        help="context length for the concurrency line (default 128k, or the max context if smaller)",
    )
    parser.add_argument(
        "--indexer", choices=INDEXER_FORMATS, default="mxfp4", help="indexer key format (default mxfp4)"
    )
    parser.add_argument(
        "--speculative-tokens", type=_argument_type(_count, "--speculative-tokens"), default=1,
        metavar="K", help="tokens verified per decode step (default 1)",
    )
    parser.add_argument("--include-mtp", action="store_true", help="also cache the MTP layer(s)")
    parser.add_argument(
        "--page-space", choices=("per-group", "shared"), default="per-group",
        help="per-group: one pool per cache group, sized by the limits; shared: one arena "
        "the groups borrow slabs from (docs/planning.md); default per-group",
    )


def build_plan(args: argparse.Namespace) -> Plan:
    if args.config is not None:
        source = args.config
    else:
        source = args.model or BUNDLED_MODELS[0]
        if source not in BUNDLED_MODELS:
            raise ValueError(
                f"unknown model {source!r}: bundled models are {', '.join(BUNDLED_MODELS)} "
                "(use --config PATH for a config.json)"
            )
    layout = cache_layout(
        source,
        indexer=args.indexer,
        include_mtp=args.include_mtp,
        speculative_tokens=args.speculative_tokens,
    )
    max_context = args.max_context or layout.max_position_embeddings
    if max_context is None:
        raise ValueError("the config has no max_position_embeddings: pass --max-context")
    if args.context_len is None:
        args.context_len = min(DEFAULT_CONTEXT_TOKENS, max_context)
    if args.context_len > max_context:
        raise ValueError(
            f"--context-len {args.context_len:,} exceeds the max context {max_context:,}"
        )
    limits = Limits(
        max_running_requests=args.max_running,
        max_scheduled_tokens=args.chunk_tokens,
        max_context_tokens=max_context,
        speculative_tokens=args.speculative_tokens,
    )
    return plan_for_budget(layout, args.kv_memory, limits, page_space=args.page_space)


def shared_report(plan: Plan, context_tokens: int) -> dict[str, Any]:
    """The shared-arena section of a plan report."""
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


def run(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    shared = shared_report(plan, args.context_len) if args.page_space == "shared" else None
    if args.json:
        report = plan.report(args.context_len)
        if shared is not None:
            report["shared_arena"] = shared
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render(plan, args.context_len, sys.stdout, shared)
    return 0


def _retention(spec) -> str:
    return f"window {spec.sliding_window_tokens:,}" if spec.is_sliding else "full"


def render(plan: Plan, context_tokens: int, file, shared: dict[str, Any] | None = None) -> None:
    """Print the human summary: headline, per-group table, totals."""
    report = plan.report(context_tokens)
    layout, limits = plan.layout, plan.limits
    console = Console(
        file=file,
        width=MAX_WIDTH_COLUMNS if not file.isatty() else None,
        highlight=False,
        soft_wrap=False,
    )
    if console.width > MAX_WIDTH_COLUMNS:
        console.width = MAX_WIDTH_COLUMNS
    concurrency = report["concurrency"]
    console.print(
        f"[bold]{format_bytes(plan.budget_bytes)} holds {plan.total_tokens:,} tokens; "
        f"{concurrency['max_requests']:,} concurrent requests at {format_tokens(context_tokens)} "
        f"(limited by {concurrency['limiting_group']})[/bold]"
    )
    mtp = " + MTP" if layout.include_mtp else ""
    console.print(
        f"{layout.name}: {layout.num_layers} layers{mtp}, {layout.indexer} indexer; "
        f"{limits.max_running_requests:,} running, {limits.max_scheduled_tokens:,} tokens/step, "
        f"max context {format_tokens(limits.max_context_tokens)}, k={limits.speculative_tokens}"
    )
    table = Table(box=None, pad_edge=False, padding=(0, 1), collapse_padding=True, header_style="bold")
    for name, justify in (
        ("group", "left"),
        ("retention", "left"),
        ("layers", "right"),
        ("tok/page", "right"),
        ("pages", "right"),
        ("page bytes", "right"),
        ("GiB", "right"),
        ("share", "right"),
        ("width", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)
    for group, entry in zip(layout.groups, report["groups"]):
        table.add_row(
            entry["group_id"],
            _retention(group.spec),
            f"{entry['num_layers']}",
            f"{entry['page_tokens']:,}",
            f"{entry['pages']:,}",
            f"{entry['page_bytes']:,}",
            f"{entry['bytes'] / 2**30:.2f}",
            f"{entry['share']:.1%}",
            f"{entry['table_width']:,}",
        )
    table.add_section()
    table.add_row("total", "", "", "", "", "", f"{plan.total_bytes / 2**30:.2f}", "100.0%", "")
    console.print(table)
    allocated, ideal = plan.bytes_per_token_allocated, plan.ideal_bytes_per_token
    console.print(
        f"capacity     {plan.scheduler_pages:,} scheduler pages x {plan.scheduler_page_tokens} "
        f"tokens = {plan.total_tokens:,} tokens"
    )
    console.print(
        f"bytes/token  {allocated:,.2f} allocated vs {ideal:,.2f} ideal "
        f"({allocated / ideal - 1:+.1%})"
        if ideal
        else f"bytes/token  {allocated:,.2f} allocated"
    )
    spare = plan.budget_bytes - plan.total_bytes
    console.print(
        f"memory       {plan.total_bytes:,} B used of {plan.budget_bytes:,} B "
        + (f"({spare:,} B spare)" if spare >= 0 else f"({-spare:,} B over)")
    )
    if concurrency["max_requests"] > limits.max_running_requests:
        console.print(
            f"note         memory fits {concurrency['max_requests']:,} requests at "
            f"{format_tokens(context_tokens)}; the scheduler runs at most "
            f"{limits.max_running_requests:,}"
        )
    if shared is not None:
        console.print(
            f"shared arena {shared['num_slabs']:,} slabs x {format_bytes(shared['slab_bytes'])} "
            f"+ {format_bytes(shared['reserved_bytes'])} of null pages: "
            f"{shared['max_requests']:,} concurrent requests at {format_tokens(context_tokens)} "
            f"(per-group pools above: {concurrency['max_requests']:,})"
        )
        if not shared["per_group_pools_fit"]:
            console.print(
                f"note         per-group pools for {limits.max_running_requests:,} running requests "
                f"do not fit {format_bytes(plan.budget_bytes)} (the table above is one scheduler "
                "page of them); only the shared arena runs in this budget"
            )
    console.print("width = block-table width for graph capture (pages per request)")
