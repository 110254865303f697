"""The tables printed at the end of a run (everything is also in the JSON)."""

from __future__ import annotations

from typing import Any

SIDES = ("vLLM", "hybridkv")


def fmt_us(us: float | None) -> str:
    if us is None:
        return "n/a"
    if us >= 1000:
        return f"{us / 1000:,.2f} ms"
    return f"{us:,.1f} µs" if us >= 10 else f"{us:.2f} µs"


def fmt_ratio(summary: dict) -> tuple[str, str]:
    """The median round's ratio, and the rounds' range."""
    ratio = summary.get("ratio")
    if not ratio:
        return "n/a", "n/a"
    rounds = ratio["rounds"]
    return f"{ratio['of_totals']:.1f}x", f"{min(rounds):.1f}-{max(rounds):.1f}x"


def _side(summary: dict, name: str) -> dict:
    return summary.get(name) or {}


def _p50_p99(summary: dict, name: str) -> str:
    side = _side(summary, name)
    if not side:
        return "n/a"
    return f"{fmt_us(side['us_per_step_p50'])} / {fmt_us(side['us_per_step_p99'])}"


def serving_rows(results: dict) -> list[list[str]]:
    rows = []
    for size, s in results.get("serving", {}).items():
        ratio, spread = fmt_ratio(s)
        rows.append([size, str(s["finishes_per_step"]),
                     *(fmt_us(_side(s, n).get("us_per_step_mean")) for n in SIDES), ratio, spread,
                     *(_p50_p99(s, n) for n in SIDES), ">= 20x"])
    return rows


def decode_rows(results: dict) -> list[list[str]]:
    rows = []
    for size, s in results.get("decode", {}).items():
        ratio, spread = fmt_ratio(s)
        ours = _side(s, "hybridkv")
        tail = ours.get("p99_over_p50")
        rows.append([size, *(fmt_us(_side(s, n).get("us_per_step_mean")) for n in SIDES),
                     fmt_us(ours.get("us_per_request_step")), ratio, spread, *(_p50_p99(s, n) for n in SIDES),
                     "n/a" if tail is None else f"{tail:.2f}", ">= 50x; p99 <= 3x p50"])
    return rows


def flatness(results: dict, phase: str, name: str = "hybridkv") -> float | None:
    """Per-request step time at the largest size over that at the smallest."""
    by_size = results.get(phase, {})
    if len(by_size) < 2:
        return None
    sizes = sorted(by_size, key=int)
    per_request = [by_size[s][name]["us_per_step_mean"] / int(s) for s in (sizes[0], sizes[-1])]
    return per_request[1] / per_request[0]


def fit_rows(results: dict) -> list[list[str]]:
    rows = []
    targets = {"decode": "fixed <= 30 µs; per request flat (<= 2x)", "serving": "-"}
    for phase, fits in results.get("fits", {}).items():
        cells = []
        for name in SIDES:
            fit = fits.get(name)
            cells += ["n/a", "n/a"] if fit is None else [fmt_us(fit["fixed_us_per_step"]),
                                                           f"{fit['us_per_request']:.3f} µs"]
        flat = flatness(results, phase)
        rows.append([phase, *cells, "n/a" if flat is None else f"{flat:.2f}", targets.get(phase, "-")])
    return rows


def _value(results: dict, *path: str) -> Any:
    node: Any = results
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def other_rows(results: dict) -> list[list[str]]:
    rows = []
    prefill = results.get("prefill")
    if prefill:
        ratio, spread = fmt_ratio(prefill)
        rows.append([f"manager time per {prefill['chunk_tokens']:,}-token prefill chunk (p50 / p99)",
                     *(_p50_p99(prefill, n) for n in SIDES), f"{ratio} ({spread})", ">= 10x"])
    multiturn = results.get("multiturn")
    if multiturn:
        bounds = multiturn["bounds"]
        rates = [_value(multiturn, n, "hit_rate") for n in SIDES]
        rows.append(["token hit rate, multi-turn, served in order",
                     *("n/a" if r is None else f"{r:.1%}" for r in rates), _quotient(rates[1], rates[0]),
                     f"ideal {bounds['ideal_hit_rate']:.1%}, 256-token grain {bounds['grain_256_hit_rate']:.1%}"])
    capacity = results.get("capacity")
    if capacity:
        rows += capacity_rows(capacity)
    return rows


def _quotient(ours: float | None, theirs: float | None) -> str:
    return "n/a" if not ours or not theirs else f"{ours / theirs:.2f}x"


def capacity_rows(capacity: dict) -> list[list[str]]:
    ideal = capacity["byte_ideal"]["requests"]
    context = _value(capacity, "hybridkv", "shrinking_chunks", "context_tokens") or 0
    rows = []
    for key, label in (("shrinking_chunks", "chunks shrink to fit"), ("fixed_chunks", "fixed chunks")):
        counts = [_value(capacity, n, key, "measured_requests") for n in SIDES]
        if counts == [None, None]:
            continue  # a variant this run left out
        rows.append([f"requests of {context:,} tokens that fit, measured ({label})",
                     *("n/a" if c is None else str(c) for c in counts), _quotient(counts[1], counts[0]),
                     f"byte-ideal {ideal:.1f}"])
    computed = [_value(capacity, n, "shrinking_chunks", "computed_requests") for n in SIDES]
    rows.append(["requests that fit, computed from the layout", *("n/a" if c is None else f"{c:.1f}" for c in computed),
                 _quotient(computed[1], computed[0]), "-"])
    for key, value in (capacity.get("hybridkv") or {}).items():
        if key.startswith("per_group_pools_"):
            rows.append([f"hybridkv per-group pools for {value['max_running']} running, measured", "-",
                         str(value["measured_requests"]), "-", "-"])
        elif key.startswith("bound_"):
            rows.append([f"hybridkv bound if no byte were lost (last chunk {value['chunk_tokens']:,})", "-",
                         str(value["requests"]), "-", "-"])
    return rows


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    """A GitHub table (first column left-aligned, the others right-aligned)."""
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _table(title: str, columns: list[str], rows: list[list[str]], markdown: bool = False) -> Any:
    if markdown:
        return f"{title}\n\n{markdown_table(columns, rows)}\n"
    from rich.table import Table

    table = Table(title=title)
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 or column == "target" else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _filled(config: dict) -> str:
    tokens = config.get("fill_tokens", 0)
    return f", the cache first filled with {tokens:,} tokens" if tokens else ""


def tables(report: dict, *, markdown: bool = False) -> list[Any]:
    """The report's tables: rich tables, or markdown text for docs/benchmarks.md."""
    results, config = report["results"], report["config"]
    shape = config["shape"]
    return [
        _table(f"Serving: joins and finishes every step (prompts {shape['prompt_tokens'][0]:,}-"
               f"{shape['prompt_tokens'][1]:,}, outputs {shape['output_tokens'][0]:,}-{shape['output_tokens'][1]:,}, "
               f"prefix caching on{_filled(config)}); manager time per step, median of {config['rounds']} rounds",
               ["running", "finishes/step", "vLLM", "hybridkv", "ratio", "rounds", "vLLM p50 / p99",
                "hybridkv p50 / p99", "target"], serving_rows(results), markdown),
        _table(f"Steady decode: manager time per step, median of {config['rounds']} rounds",
               ["running", "vLLM", "hybridkv", "hybridkv per request", "ratio", "rounds", "vLLM p50 / p99",
                "hybridkv p50 / p99", "p99/p50", "target"], decode_rows(results), markdown),
        _table("Step time = fixed + per request x running (least squares over the sizes); "
               "flat = hybridkv's per-request time, largest size / smallest",
               ["phase", "vLLM fixed", "vLLM per request", "hybridkv fixed", "hybridkv per request", "flat",
                "target"], fit_rows(results), markdown),
        _table("Prefill, hit rate, capacity (DeepSeek-V4-Flash, FP8 indexer, "
               f"{config['kv_memory_bytes'] / 2**30:g} GiB)",
               ["metric", "vLLM", "hybridkv", "ratio (ours better > 1)", "target"], other_rows(results), markdown),
    ]


def footer(report: dict) -> str:
    env = report["environment"]
    where = f"hybridkv at commit {env.get('commit')}" if env.get("commit") else f"hybridkv from {env.get('hybridkv_path')}"
    calls = report.get("config", {}).get("hybridkv_calls", {})  # (runs before it was recorded: none)
    unusual = ", ".join(f"{name}={value}" for name, value in calls.items()
                        if value != {"block_tables": "updates", "write_slots": True, "decode_call": "uniform"}.get(name, value))
    return (f"{where}{' (src modified)' if env.get('src_modified') else ''}{f' ({unusual})' if unusual else ''}, "
            f"vLLM {env.get('vllm')}, {env.get('cpus')} CPUs, load average at the end "
            f"{', '.join(f'{x:.1f}' for x in env.get('load_average', ()))}, {report['wall_seconds']:.0f} s, "
            f"{report['timestamp']}")


def print_report(report: dict, *, markdown: bool = False) -> None:
    if markdown:
        print("\n".join(tables(report, markdown=True)) + "\n" + footer(report))
        return
    from rich.console import Console

    console = Console(width=max(Console().width, 160))
    if report.get("vllm_unavailable"):
        console.print(f"[bold]vLLM side unavailable[/bold]: {report['vllm_unavailable']}")
    for table in tables(report):
        console.print(table)
    console.print(footer(report))
