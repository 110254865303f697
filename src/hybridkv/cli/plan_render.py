"""Human output of ``hybridkv plan``: headline, page space, per-group table, totals.

The headline states what is true of the run: the budget is one GPU's, the
requests counted really fit at once (memory and the running-request limit), and
which indexer key format the bytes assume. In the shared page space it
describes the arena, not per-group pools.
"""

from __future__ import annotations

from typing import Any

from hybridkv.units import format_bytes, format_tokens, plural

MAX_WIDTH_COLUMNS = 100
_INDEXER_NAMES = {"mxfp4": "MXFP4", "fp8": "FP8"}


class _Printer:
    """Plain lines to ``file`` (no styling: the output is the same on a terminal and in a pipe)."""

    def __init__(self, file) -> None:
        self.file = file

    def print(self, text) -> None:
        if isinstance(text, _Table):
            text = text.render()
        self.file.write(f"{text}\n")


class _Table:
    """Columns aligned by hand: left or right justified, one space apart."""

    def __init__(self, columns: tuple[tuple[str, str], ...]) -> None:
        self.columns = columns
        self.rows: list[tuple[str, ...] | None] = []

    def add_row(self, *cells: str) -> None:
        self.rows.append(tuple(cells))

    def add_section(self) -> None:
        self.rows.append(None)

    def render(self) -> str:
        rows = [tuple(name for name, _ in self.columns)] + self.rows
        widths = [max(len(r[i]) for r in rows if r is not None) for i in range(len(self.columns))]
        lines = []
        for row in rows:
            if row is None:
                continue
            cells = [
                cell.ljust(width) if justify == "left" else cell.rjust(width)
                for cell, width, (_, justify) in zip(row, widths, self.columns)
            ]
            lines.append(" ".join(cells).rstrip())
        return "\n".join(lines)


def _console(file) -> _Printer:
    return _Printer(file)


def _table(columns: tuple[tuple[str, str], ...]) -> _Table:
    return _Table(columns)


def _retention(spec) -> str:
    return f"window {spec.sliding_window_tokens:,}" if spec.is_sliding else "full"


def model_line(layout, limits) -> str:
    """``deepseek-v4-flash: 43 layers, FP8 indexer keys (132 B/row)`` and the limits."""
    mtp = layout.num_layers - layout.num_main_layers
    layers = f"{layout.num_main_layers} layers" + (f" + {plural(mtp, 'MTP layer')}" if mtp else "")
    if layout.indexer_row_bytes is not None:
        indexer = f"{_INDEXER_NAMES[layout.indexer]} indexer keys ({layout.indexer_row_bytes} B/row)"
    else:
        indexer = "no indexer"
    return (
        f"{layout.name}: {layers}, {indexer}\n"
        f"limits       {limits.max_running_requests:,} running, {limits.max_scheduled_tokens:,} "
        f"tokens/step, max context {format_tokens(limits.max_context_tokens)}, "
        f"k={limits.speculative_tokens}"
    )


def headline(plan, context_tokens: int) -> str:
    """What fits at once in per-group pools: memory and the running-request limit."""
    fit, limiting = plan.concurrency(context_tokens)
    running = plan.limits.max_running_requests
    at = f"at {format_tokens(context_tokens)}"
    budget = format_bytes(plan.budget_bytes)
    if fit <= running:
        return f"{budget} per GPU: {plural(fit, 'request')} {at} fit at once (limited by {limiting})"
    return (
        f"{budget} per GPU: {plural(running, 'request')} {at} run at once (--max-running; "
        f"memory fits {fit:,})"
    )


def _capacity_lines(plan, context_tokens: int) -> list[str]:
    fit, limiting = plan.concurrency(context_tokens)
    history = plan.group_pages[limiting]
    spare = plan.limits.max_running_requests
    lines = [
        f"capacity     {plan.scheduler_pages:,} scheduler pages x {plan.scheduler_page_tokens} "
        f"tokens = {plan.total_tokens:,} tokens (token budget)"
    ]
    if fit * context_tokens > plan.total_tokens:
        budget_pages = plan.total_tokens // plan.layout.group(limiting).spec.page_tokens
        lines.append(
            f"why more     {fit:,} x {format_tokens(context_tokens)} = {fit * context_tokens:,} "
            "tokens > the budget: history pools keep a spare page"
        )
        lines.append(
            f"             per running request for partly filled pages "
            f"({limiting}: {history:,} = {budget_pages:,} + {spare:,} + 1 null)"
        )
    return lines


def render(plan, context_tokens: int, file, shared: dict[str, Any] | None = None) -> None:
    """Print the human summary: headline, per-group table, totals."""
    if shared is not None:
        render_shared(plan, context_tokens, file, shared)
        return
    report = plan.report(context_tokens)
    console = _console(file)
    console.print(headline(plan, context_tokens))
    console.print(model_line(plan.layout, plan.limits))
    console.print("page space   per-group pools, each sized by the limits (--page-space shared: one arena)")
    table = _table(
        (("group", "left"), ("retention", "left"), ("layers", "right"), ("tok/page", "right"),
         ("pages", "right"), ("page bytes", "right"), ("GiB", "right"), ("share", "right"),
         ("width", "right"))
    )
    for group, entry in zip(plan.layout.groups, report["groups"]):
        table.add_row(
            entry["group_id"], _retention(group.spec), f"{entry['num_layers']}",
            f"{entry['page_tokens']:,}", f"{entry['pages']:,}", f"{entry['page_bytes']:,}",
            f"{entry['bytes'] / 2**30:.2f}", f"{entry['share']:.1%}", f"{entry['table_width']:,}",
        )
    table.add_section()
    table.add_row("total", "", "", "", "", "", f"{plan.total_bytes / 2**30:.2f}", "100.0%", "")
    console.print(table)
    for line in _capacity_lines(plan, context_tokens):
        console.print(line)
    allocated, ideal = plan.bytes_per_token_allocated, plan.ideal_bytes_per_token
    console.print(
        f"bytes/token  {allocated:,.2f} allocated vs {ideal:,.2f} ideal ({allocated / ideal - 1:+.1%})"
        if ideal
        else f"bytes/token  {allocated:,.2f} allocated"
    )
    spare = plan.budget_bytes - plan.total_bytes
    console.print(
        f"memory       {plan.total_bytes:,} B used of {plan.budget_bytes:,} B ({spare:,} B spare)"
    )
    _footer(console)


def _footer(console: _Printer) -> None:
    console.print("per GPU      one GPU's cache; tensor-parallel ranks each hold all of it (one KV head)")
    console.print("width        block-table width for graph capture (pages per request)")


def render_shared(plan, context_tokens: int, file, shared: dict[str, Any]) -> None:
    """The shared page space: the arena's headline, pages per request per group."""
    console = _console(file)
    at = format_tokens(context_tokens)
    fit = shared["max_requests"]
    running = plan.limits.max_running_requests
    count = (
        f"{plural(fit, 'request')} at {at} fit at once"
        if fit <= running
        else f"{plural(running, 'request')} at {at} run at once (--max-running; "
        f"memory fits {fit:,})"
    )
    console.print(
        f"{format_bytes(plan.budget_bytes)} per GPU as one shared arena: {count}"
    )
    console.print(model_line(plan.layout, plan.limits))
    need = plan.request_pages(context_tokens)
    table = _table(
        (("group", "left"), ("retention", "left"), ("layers", "right"), ("tok/page", "right"),
         ("page bytes", "right"), (f"pages/req at {at}", "right"), ("width", "right"))
    )
    widths = plan.table_widths
    for group in plan.layout.groups:
        gid = group.group_id
        table.add_row(
            gid, _retention(group.spec), f"{len(group.layers)}", f"{group.spec.page_tokens:,}",
            f"{group.page_bytes:,}", f"{need[gid]:,}", f"{widths[gid]:,}",
        )
    console.print(table)
    console.print(
        f"shared arena {shared['num_slabs']:,} slabs x {format_bytes(shared['slab_bytes'])} "
        f"+ {format_bytes(shared['reserved_bytes'])} of null pages = "
        f"{shared['total_bytes']:,} B of {plan.budget_bytes:,} B"
    )
    if shared["per_group_pools_fit"]:
        per_group = plan.max_concurrent_requests(context_tokens)
        console.print(f"per-group    pools in the same budget fit {plural(per_group, 'request')} at {at}")
    else:
        console.print(
            f"per-group    pools for {running:,} running requests do not fit "
            f"{format_bytes(plan.budget_bytes)} (they need at least {plan.total_bytes:,} B); "
            "only the shared arena runs in this budget"
        )
    if fit == 0:
        console.print(
            f"none fit     one request at {at} plus one full {plan.limits.max_scheduled_tokens:,}-token "
            "step of window and state pages needs more slabs than the arena has"
        )
    _footer(console)


def render_inverse(need, file) -> None:
    """``plan --requests N --context-len L``: memory per group in both page spaces."""
    console = _console(file)
    plan = need.per_group_plan
    at = format_tokens(need.context_tokens)
    console.print(
        f"{plural(need.requests, 'request')} at {at} need, per GPU, "
        f"{format_bytes(need.per_group_total_bytes)} in per-group pools or "
        f"{format_bytes(need.shared_total_bytes)} as a shared arena"
    )
    console.print(model_line(plan.layout, plan.limits))
    pages = plan.request_pages(need.context_tokens)
    table = _table(
        (("group", "left"), ("page bytes", "right"), ("pages/req", "right"),
         ("pool pages", "right"), ("pools GiB", "right"), ("arena GiB", "right"))
    )
    group_pages, group_bytes = plan.group_pages, plan.group_bytes
    for group in plan.layout.groups:
        gid = group.group_id
        table.add_row(
            gid, f"{group.page_bytes:,}", f"{pages[gid]:,}",
            f"{group_pages[gid]:,}", f"{group_bytes[gid] / 2**30:.3f}",
            f"{need.shared_group_bytes[gid] / 2**30:.3f}",
        )
    table.add_section()
    table.add_row(
        "total", "", "", "", f"{need.per_group_total_bytes / 2**30:.3f}",
        f"{sum(need.shared_group_bytes.values()) / 2**30:.3f}",
    )
    console.print(table)
    console.print(
        f"per-group    {need.per_group_total_bytes:,} B: token budget {plan.total_tokens:,}, "
        f"pools sized for {plan.limits.max_running_requests:,} running requests"
    )
    console.print(
        f"shared       {need.shared_total_bytes:,} B: {need.shared_num_slabs:,} slabs x "
        f"{format_bytes(need.shared_slab_bytes)} + {format_bytes(need.shared_reserved_bytes)} of null pages"
    )
    console.print("per GPU      one GPU's cache; tensor-parallel ranks each hold all of it (one KV head)")


def render_compare(comparison, file) -> None:
    """``plan --compare vllm``: hybridkv's plan next to vLLM's figures."""
    console = _console(file)
    for line in comparison.lines():
        console.print(line)
