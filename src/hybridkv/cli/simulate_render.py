"""Output of ``hybridkv simulate``: the summary table, the progress bar, the plot."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hybridkv.sim.driver import SimResult
from hybridkv.units import format_bytes

# Drawn widest first, so a group whose line equals another's still shows around it.
_LINE_STYLES = ("-", "--", "-.", ":")


@contextmanager
def progress_bar(total: int, *, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A ``requests finished`` bar on stderr; yields ``advance(done)``."""
    with Progress(
        TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
        TimeElapsedColumn(), console=Console(stderr=True), disable=quiet, transient=True,
    ) as progress:
        task = progress.add_task("sim", total=total)
        yield lambda done: progress.update(task, completed=done)


def print_summary(summary: dict, console: Console) -> None:
    title = (
        f"simulate: {summary['workload']} ({summary['requests']:,} requests), {summary['model']}, "
        f"{format_bytes(summary['kv_memory_bytes'])} {summary['page_space']}"
    )
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("steps", f"{summary['steps']:,}"),
        ("requests finished", f"{summary['requests_finished']:,}"),
        ("scheduled tokens / step", f"{summary['scheduled_tokens_per_step']:,.1f}"),
        ("max running requests", f"{summary['max_running_reached']:,}"),
        ("mean running requests", f"{summary['mean_running']:,.1f}"),
        ("prefix caching", "on" if summary["prefix_caching"] else "off"),
        ("page space", summary["page_space"]),
        ("token hit rate", f"{summary['token_hit_rate']:.1%}"),
        ("preemptions", f"{summary['preemptions']:,}"),
        ("requests the thrash guard put next in line", f"{summary.get('thrash_guarded_requests', 0):,}"),
        ("checkpoints demoted once moved past", f"{summary.get('moved_past_demoted', 0):,}"),
        ("prefill chunks shrunk to fit", f"{summary['shrunk_chunks']:,}"),
        ("manager µs / step p50", f"{summary['manager_us_per_step_p50']:,.0f}"),
        ("manager µs / step p99", f"{summary['manager_us_per_step_p99']:,.0f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    for gid, u in summary["utilization"].items():
        table.add_row(f"utilization {gid}", f"mean {u['mean']:.1%}  peak {u['peak']:.1%}")
    console.print(table)


def plot_title(summary: dict) -> str:
    """What the run was: model, budget, page space, workload, requests, prefix caching."""
    caching = "prefix caching on" if summary["prefix_caching"] else "prefix caching off"
    return (
        f"hybridkv simulate: {summary['model']}, {format_bytes(summary['kv_memory_bytes'])} "
        f"per GPU, {summary['page_space']} page space\n"
        f"workload {summary['workload']} ({summary['requests']:,} requests), {caching}"
    )


def plot_usage(axis, result: SimResult, steps: np.ndarray) -> None:
    shares = {g: 100.0 * result.used_pages[g] / result.group_total_pages[g] for g in result.group_ids}
    count = len(result.group_ids)
    for index, gid in enumerate(result.group_ids):
        axis.plot(
            steps, shares[gid], label=gid, linestyle=_LINE_STYLES[index % len(_LINE_STYLES)],
            linewidth=1.0 + 1.8 * (count - 1 - index) / max(count - 1, 1), alpha=0.85,
        )
    if result.shared_arena:
        total = sum(shares.values())
        axis.plot(steps, total, label="arena (all groups)", color="black", linewidth=1.2)
        axis.set_ylabel("bytes in use (% of arena)")
    else:
        axis.set_ylabel("pages in use (% of pool)")
    axis.legend(fontsize=7, loc="upper right")


def write_plot(result: SimResult, path: str, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(result.steps)
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    plot_usage(axes[0], result, steps)
    axes[1].plot(steps, result.running, color="black")
    axes[1].set_ylabel("running requests")
    prompt = np.cumsum(result.prompt_tokens_started)
    hits = np.cumsum(result.hit_tokens)
    rate = np.divide(100.0 * hits, prompt, out=np.zeros(result.steps), where=prompt > 0)
    axes[2].plot(steps, rate, color="tab:green")
    axes[2].set_ylabel("token hit rate (%, cumulative)")
    axes[2].set_xlabel("scheduled step")
    fig.suptitle(plot_title(summary), fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
