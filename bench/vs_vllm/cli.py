"""Command line and the order of the phases (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import hybridkv

from . import report
from .capacity import byte_ideal_capacity, layout_capacity_bound, measure_capacity
from .decode import measure_decode
from .hitrate import hit_bounds, measure_multiturn, multiturn_requests
from .prefill import measure_prefill
from .serving import measure_serving
from .sides import GIB, HybridkvSide, load_vllm_side
from .timing import linear_fit
from .workload import ServingShape

BENCH_DIR = Path(__file__).resolve().parent.parent
DEFAULT_JSON = BENCH_DIR / "out" / "vs_vllm.json"
PHASES = ("serving", "decode", "prefill", "multiturn", "capacity")


@dataclass(frozen=True)
class BenchConfig:
    sizes: tuple[int, ...] = (32, 128, 512, 1024)
    rounds: int = 5
    serving_steps: int = 32
    decode_steps: int = 200  # 5 rounds: 1,000 steps, so a p99 has 10 steps above it
    step_tokens: int = 8192
    chunk_tokens: int = 2048
    shape: ServingShape = field(default_factory=ServingShape)
    kv_memory_bytes: int = 40 * GIB
    max_model_len: int = 131_072
    phases: tuple[str, ...] = PHASES
    prefill_requests: int = 4
    prefill_tokens: int = 32_768
    conversations: int = 32
    turns: int = 4
    system_prompt_tokens: int = 2_000
    context_tokens: int = 131_072
    capacity_limit: int = 1_000
    capacity_min_chunk_tokens: int = 256
    capacity_max_running: int | None = 96
    capacity_variants: bool = False
    other_max_num_seqs: int = 256
    seed: int = 0
    page_space: str = "shared"
    fill_tokens: int = 0
    prompt_checkpoints: bool = True
    state_checkpoint_interval: int | None = None


class Sides:
    """Builds both sides for a phase (or says why vLLM is missing)."""

    def __init__(self, config: BenchConfig, vllm_factory: Callable[..., Any] | str) -> None:
        self.config, self.vllm_factory = config, vllm_factory

    def build(self, *, max_num_seqs: int, max_num_batched_tokens: int) -> dict[str, Any]:
        c = self.config
        kwargs = dict(kv_memory_bytes=c.kv_memory_bytes, max_model_len=max(c.max_model_len, c.context_tokens),
                      max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
        sides: dict[str, Any] = {}
        if not isinstance(self.vllm_factory, str):
            sides["vLLM"] = self.vllm_factory(**kwargs)
        sides["hybridkv"] = HybridkvSide(
            **kwargs, page_space=c.page_space, prompt_checkpoints=c.prompt_checkpoints,
            state_checkpoint_interval=c.state_checkpoint_interval)
        return sides


def _timed_log(log: Callable[[str], None], label: str, fn: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    out = fn()
    log(f"{label} done in {time.perf_counter() - started:.1f} s")
    return out


def run_sizes(config: BenchConfig, sides: Sides, log: Callable[[str], None]) -> dict[str, Any]:
    """The serving and decode phases at every size, and the cost fits over the sizes."""
    out: dict[str, Any] = {phase: {} for phase in ("serving", "decode") if phase in config.phases}
    for size in config.sizes:
        live = sides.build(max_num_seqs=size, max_num_batched_tokens=config.step_tokens)
        if "decode" in config.phases:
            out["decode"][str(size)] = _timed_log(log, f"decode at {size}", lambda: measure_decode(
                live, running=size, steps=config.decode_steps, rounds=config.rounds,
                chunk_tokens=config.step_tokens, shape=config.shape, seed=config.seed))
        if "serving" in config.phases:
            out["serving"][str(size)] = _timed_log(log, f"serving at {size}", lambda: measure_serving(
                live, running=size, steps=config.serving_steps, rounds=config.rounds,
                step_tokens=config.step_tokens, chunk_tokens=config.chunk_tokens, shape=config.shape,
                seed=config.seed, fill_tokens=config.fill_tokens))
    out["fits"] = {phase: cost_fits(by_size) for phase, by_size in out.items()}
    return out


def cost_fits(by_size: dict[str, dict]) -> dict[str, Any]:
    """Per side: step time = fixed + per request x running, least squares over the sizes."""
    sizes = [int(size) for size in by_size]
    if not sizes:
        return {}
    first = by_size[str(sizes[0])]
    names = [name for name, value in first.items() if isinstance(value, dict) and "us_per_step_mean" in value]
    fits = {}
    for name in names:
        fit = linear_fit(sizes, [by_size[str(size)][name]["us_per_step_mean"] for size in sizes])
        if fit is not None:
            fits[name] = dict(fixed_us_per_step=fit["fixed"], us_per_request=fit["per_unit"], sizes=sizes)
    return fits


def run_others(config: BenchConfig, sides: Sides, log: Callable[[str], None]) -> dict[str, Any]:
    """Prefill, multi-turn hit rate and capacity, at ``other_max_num_seqs`` and ``chunk_tokens``."""
    out: dict[str, Any] = {}
    if not {"prefill", "multiturn", "capacity"} & set(config.phases):
        return out
    live = sides.build(max_num_seqs=config.other_max_num_seqs, max_num_batched_tokens=config.chunk_tokens)
    out["layouts"] = {name: side.describe() for name, side in live.items()}
    if "prefill" in config.phases:
        out["prefill"] = _timed_log(log, "prefill", lambda: measure_prefill(
            live, num_requests=config.prefill_requests, prompt_tokens=config.prefill_tokens,
            chunk_tokens=config.chunk_tokens, rounds=config.rounds, seed=config.seed))
    if "multiturn" in config.phases:
        workload = multiturn_requests(config.conversations, config.turns,
                                      system_prompt_tokens=config.system_prompt_tokens, seed=config.seed)
        out["multiturn"] = dict(bounds=hit_bounds(workload), **{
            name: _timed_log(log, f"{name}: multiturn", lambda s=side: measure_multiturn(
                s, workload, chunk_tokens=config.chunk_tokens)) for name, side in live.items()})
    if "capacity" in config.phases:
        out["capacity"] = run_capacity(config, live, sides, log)
    return out


def run_capacity(config: BenchConfig, live: dict[str, Any], sides: Sides, log: Callable[[str], None]) -> dict:
    """Both sides with chunks that shrink to fit; with ``capacity_variants`` also with fixed
    chunks, and hybridkv with per-group pools (sized for ``other_max_num_seqs`` and
    ``capacity_max_running``)."""
    out: dict[str, Any] = dict(byte_ideal=byte_ideal_capacity(config.kv_memory_bytes, config.context_tokens))
    kwargs = dict(context_tokens=config.context_tokens, chunk_tokens=config.chunk_tokens, seed=config.seed,
                  limit=config.capacity_limit)
    variants = [("shrinking_chunks", config.capacity_min_chunk_tokens)]
    if config.capacity_variants:
        variants.append(("fixed_chunks", config.chunk_tokens))
    for name, side in live.items():
        out[name] = {
            phase: _timed_log(log, f"{name}: {phase}", lambda s=side, f=floor: measure_capacity(
                s, min_chunk_tokens=f, **kwargs))
            for phase, floor in variants
        }
    held = out["hybridkv"]["shrinking_chunks"]["first_request_pages_per_group"]
    if held:
        out["hybridkv"]["bound_shrinking_chunks"] = layout_capacity_bound(
            config.kv_memory_bytes, held, config.capacity_min_chunk_tokens)
        out["hybridkv"]["bound_fixed_chunks"] = layout_capacity_bound(config.kv_memory_bytes, held, config.chunk_tokens)
    if not config.capacity_variants:
        return out
    for running in filter(None, (config.other_max_num_seqs, config.capacity_max_running)):
        side = HybridkvSide(kv_memory_bytes=config.kv_memory_bytes,
                            max_model_len=max(config.max_model_len, config.context_tokens),
                            max_num_batched_tokens=config.chunk_tokens, max_num_seqs=running, page_space="per-group")
        result = _timed_log(log, f"hybridkv: capacity, per-group pools for {running}", lambda: measure_capacity(
            side, min_chunk_tokens=config.capacity_min_chunk_tokens, **kwargs))
        out["hybridkv"][f"per_group_pools_{running}"] = dict(result, max_running=running)
    return out


def run(config: BenchConfig, vllm_factory: Callable[..., Any] | str, log: Callable[[str], None]) -> dict[str, Any]:
    sides = Sides(config, vllm_factory)
    started = time.perf_counter()
    results = dict(run_sizes(config, sides, log), **run_others(config, sides, log))
    return dict(
        config=_config_json(config),
        vllm_unavailable=vllm_factory if isinstance(vllm_factory, str) else None,
        results=results,
        environment=_environment(vllm_factory),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        wall_seconds=time.perf_counter() - started,
    )


def _config_json(config: BenchConfig) -> dict[str, Any]:
    """The run's settings, with how the hybridkv side calls its manager (class-wide, set from the flags)."""
    calls = dict(block_tables=HybridkvSide.block_tables, write_slots=HybridkvSide.write_slots,
                 decode_call=HybridkvSide.decode_call)
    return json.loads(json.dumps(dict(asdict(config), hybridkv_calls=calls)))


def _environment(vllm_factory: Any) -> dict[str, Any]:
    """Where the run's ``hybridkv`` came from: its package folder, and the commit of the git work tree
    holding it (None outside one, as for a plain copy put first on ``PYTHONPATH``)."""
    package = Path(hybridkv.__file__).resolve().parent
    commit = subprocess.run(["git", "-C", str(package), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or None
    dirty = subprocess.run(["git", "-C", str(package), "status", "--porcelain", "--", "."],
                           capture_output=True, text=True).stdout.strip()
    vllm_version = None
    if not isinstance(vllm_factory, str):
        vllm_version = sys.modules[vllm_factory.__module__].VLLM_VERSION
    return dict(python=platform.python_version(), machine=platform.machine(), cpus=os.cpu_count(),
                load_average=os.getloadavg(), commit=commit, src_modified=bool(dirty), hybridkv_path=str(package),
                vllm=vllm_version)


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, Output]:
    p = argparse.ArgumentParser(prog="vs_vllm", description="hybridkv's cache manager side by side with "
                                "vLLM 0.33's KVCacheManager (DeepSeek-V4-Flash, FP8 indexer)")
    p.add_argument("--sizes", default="32,128,512,1024", help="running requests of the serving and decode phases")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every timed phase; the median round is reported")
    p.add_argument("--serving-steps", type=int, default=32, help="timed steps per serving round")
    p.add_argument("--decode-steps", type=int, default=200,
                   help="timed steps per decode round (200: with 5 rounds, 10 steps lie above the p99)")
    p.add_argument("--step-tokens", type=int, default=8192, help="token budget of a serving step")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (serving, prefill and other phases)")
    p.add_argument("--prompt-tokens", type=_range, default=(512, 4096), help="serving prompts, LOW:HIGH")
    p.add_argument("--output-tokens", type=_range, default=(64, 1024), help="serving outputs, LOW:HIGH")
    p.add_argument("--prefix-tokens", type=int, default=1024,
                   help="shared system prompt at the start of each prompt (at most half the prompt)")
    p.add_argument("--prefixes", type=int, default=8, help="distinct shared system prompts")
    p.add_argument("--kv-memory-gib", type=float, default=40.0)
    p.add_argument("--fill-tokens", type=int, default=0,
                   help="serving: after each reset, prefill and free distinct prompts of this many tokens in all, "
                        "so the prefix cache starts full, as on a server that has run a while (0: empty)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    p.add_argument("--prefill-requests", type=int, default=4)
    p.add_argument("--prefill-tokens", type=int, default=32_768)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--context", type=int, default=131_072, help="capacity phase: tokens per request")
    p.add_argument("--capacity-limit", type=int, default=1_000)
    p.add_argument("--capacity-min-chunk", type=int, default=256)
    p.add_argument("--capacity-variants", action="store_true",
                   help="capacity also with fixed chunks (both sides) and with hybridkv's per-group pools "
                        "(~3 more minutes)")
    p.add_argument("--capacity-max-running", type=int, default=96,
                   help="with --capacity-variants: per-group pools also sized for this many running (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-space", choices=("shared", "per-group"), default="shared", help="hybridkv only")
    p.add_argument("--prompt-checkpoints", action=argparse.BooleanOptionalAction, default=True, help="hybridkv only")
    p.add_argument("--state-checkpoint-interval", type=int, default=None, help="hybridkv only")
    p.add_argument("--block-tables", choices=("updates", "full"), default="updates", help="hybridkv only")
    p.add_argument("--write-slots", action=argparse.BooleanOptionalAction, default=True, help="hybridkv only")
    p.add_argument("--decode-call", choices=("uniform", "pairs"), default="uniform",
                   help="hybridkv only: a decode step as schedule_uniform(ids, 1) or as schedule() of (id, 1) pairs")
    p.add_argument("--quick", action="store_true",
                   help="smoke test (~1 min on a quiet machine): sizes 32 and 256, 3 rounds of 16 steps, "
                        "smaller prefill, multi-turn and capacity phases")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown (for docs/benchmarks.md)")
    p.add_argument("--from-json", type=Path, default=None,
                   help="run nothing: print the tables of an earlier run's JSON")
    a = p.parse_args(argv)
    HybridkvSide.block_tables, HybridkvSide.write_slots = a.block_tables, a.write_slots
    HybridkvSide.decode_call = a.decode_call
    if a.quick:
        a.sizes, a.rounds, a.serving_steps, a.decode_steps = "32,256", 3, 16, 16
        a.prefill_requests, a.prefill_tokens, a.conversations, a.turns = 1, 8_192, 4, 2
        a.context, a.capacity_limit, a.capacity_max_running = 32_768, 8, 0
    phases = tuple(x for x in a.phases.split(",") if x)
    unknown = set(phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES)}")
    config = BenchConfig(
        sizes=tuple(int(x) for x in a.sizes.split(",") if x), rounds=max(1, a.rounds),
        serving_steps=a.serving_steps, decode_steps=a.decode_steps, step_tokens=a.step_tokens, chunk_tokens=a.chunk,
        shape=ServingShape(a.prompt_tokens, a.output_tokens, a.prefix_tokens, a.prefixes),
        kv_memory_bytes=int(a.kv_memory_gib * GIB), phases=phases, prefill_requests=a.prefill_requests,
        prefill_tokens=a.prefill_tokens, conversations=a.conversations, turns=a.turns, context_tokens=a.context,
        capacity_limit=a.capacity_limit, capacity_min_chunk_tokens=a.capacity_min_chunk,
        capacity_max_running=a.capacity_max_running or None, capacity_variants=a.capacity_variants, seed=a.seed,
        page_space=a.page_space, fill_tokens=max(0, a.fill_tokens),
        prompt_checkpoints=a.prompt_checkpoints, state_checkpoint_interval=a.state_checkpoint_interval)
    return config, Output(a.json, a.markdown, a.from_json)


@dataclass(frozen=True)
class Output:
    json_path: Path
    markdown: bool
    from_json: Path | None


def main(argv: list[str] | None = None) -> int:
    config, output = parse_args(argv)
    if output.from_json is not None:
        report.print_report(json.loads(output.from_json.read_text(encoding="utf-8")), markdown=output.markdown)
        return 0
    json_path = output.json_path
    vllm_factory = load_vllm_side()
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if isinstance(vllm_factory, str):
        log(f"{vllm_factory}\nRunning the hybridkv side alone: every ratio is n/a.")
    result = run(config, vllm_factory, log)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    report.print_report(result, markdown=output.markdown)
    print(f"JSON: {json_path}")
    return 2 if isinstance(vllm_factory, str) else 0
